"""Fixtures every test folder shares: a slab per test, real servers per test or per module,
and the skips for tests whose optional dependency (``lmcache``) is absent.

Every fixture removes what it created: segments are unlinked, servers are stopped by pid.
The functions behind them live in tests/helpers/ (test modules import those, not this file).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest
from helpers.common import unique_slab_name
from helpers.servers import Server, start_server, stop_server

from eg_kv.slab.store import Slab

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
#: vLLM makes its engines' ZMQ sockets in VLLM_RPC_BASE_PATH (/tmp by default) and leaves
#: them when its process is stopped (868 in /tmp after a few dozen runs). Every vLLM the
#: suite starts inherits this directory, removed when the session ends.
_VLLM_RPC_DIR = tempfile.mkdtemp(prefix="eg-kv-test-vllm-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_RPC_DIR)


def pytest_unconfigure(config):
    shutil.rmtree(_VLLM_RPC_DIR, ignore_errors=True)


#: Markers that say a test needs an optional package: marker -> (module, why it is absent).
NEEDS = {
    "lmcache": (
        "lmcache",
        "needs the lmcache package (pip install -e '.[lmcache]'; scripts/test installs it)",
    ),
}


#: A file with a test allowed this long (its ``timeout`` marker, s) runs first.
LONG_TIMEOUT_S = 600


def _long_files_first(items) -> None:
    """Reorder ``items`` so that the files of the longest tests come first (those with a
    test whose ``timeout`` is at least :data:`LONG_TIMEOUT_S`, longest allowed first; the
    rest keep their order). scripts/test hands whole files to its pytest-xdist processes
    in this order: the 3-minute vLLM end to end then runs beside the rest, not alone at
    the end."""
    allowed: dict[str, float] = {}
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = mark.args[0] if mark is not None and mark.args else 0
        if isinstance(limit, (int, float)) and limit >= LONG_TIMEOUT_S:
            allowed[str(item.path)] = max(allowed.get(str(item.path), 0), limit)
    if allowed:
        items.sort(key=lambda item: -allowed.get(str(item.path), 0))  # stable


def pytest_collection_modifyitems(config, items):
    """Skip, with the reason, each test marked with a package that is not installed; the
    longest files first (:func:`_long_files_first`)."""
    _long_files_first(items)
    missing = {
        marker: pytest.mark.skip(reason=why)
        for marker, (module, why) in NEEDS.items()
        if importlib.util.find_spec(module) is None
    }
    if not missing:
        return
    for item in items:
        for marker, skip in missing.items():
            if item.get_closest_marker(marker):
                item.add_marker(skip)


@pytest.fixture
def slab_name():
    name = unique_slab_name()
    yield name
    Slab.unlink_named(name)


@pytest.fixture
def slab(slab_name):
    """A small slab: 4 MiB of 64 KiB pages, blocks up to 1 MiB."""
    s = Slab.create(slab_name, 4 * 1024 * 1024, page_size=64 * 1024, max_block_size=1024 * 1024)
    yield s
    s.close()


def _factory(log_dir):
    """``start(workers=2, capacity="64MiB", extra=[...], ...)`` and the servers it started."""
    started: list[Server] = []

    def start(**kw) -> Server:
        srv = start_server(log_dir, **kw)
        started.append(srv)
        return srv

    return start, started


@pytest.fixture
def server_factory(tmp_path):
    """Start real servers for one test: ``server_factory(workers=2, capacity="64MiB",
    extra=[...], env=..., port=..., slab_name=..., wait=True)``.

    Waits until /healthz reports every worker up (plain HTTP, no TLS); stops each server
    by pid and unlinks its slab afterwards. Use it where a test kills, fills, restarts or
    reconfigures a server, or counts its stats exactly.
    """
    start, started = _factory(tmp_path)
    yield start
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def module_server_factory(tmp_path_factory):
    """:func:`server_factory` for a whole module: the servers it starts serve every test
    of the module, then stop. Only for tests that read and write blocks under their own
    unique addresses and need no fresh slab, settings or exact counters."""
    start, started = _factory(tmp_path_factory.mktemp("servers"))
    yield start
    for srv in started:
        stop_server(srv)
