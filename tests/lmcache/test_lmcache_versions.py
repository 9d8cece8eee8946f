"""The in-engine plugin takes LMCache's names from where the installed release keeps them.

LMCache 0.5.7 moved its in-process engine under ``lmcache.inprocess``: ``RemoteMetadata``
left ``lmcache.v1.protocol``. A plugin that imports a moved name fails to load, LMCache
logs it and leaves the backend out, and vLLM recomputes every prefix. ``.ci/run`` runs
tests/lmcache under 0.5.6 (``.venv``) and 0.5.7rc2 (``.venv-lmcache057``,
``scripts/setup-lmcache057``)."""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from helpers.lmcache_engine import (
    connector_of,
    engine_config,
    engine_metadata,
    plugin_extra,
)
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.connector import fs_connector

from eg_kv.kvcache import EgKvRemoteConnector
from eg_kv.lmcache import compat

pytestmark = pytest.mark.lmcache


def test_the_chunk_header_is_the_class_lmcache_own_connectors_use():
    """Our chunks' header is LMCache's own (its fs connector writes the same one), from
    lmcache.inprocess.v1.protocol on 0.5.7 and lmcache.v1.protocol on 0.5.6."""
    assert compat.RemoteMetadata is fs_connector.RemoteMetadata
    where = compat.RemoteMetadata.__module__
    if version("lmcache").startswith("0.5.6"):
        assert where == "lmcache.v1.protocol"
    else:
        assert where == "lmcache.inprocess.v1.protocol", version("lmcache")


def test_lmcache_builds_the_plugin_and_leaves_nothing_out(server_factory, lmcache_loop, caplog):
    """LMCache builds ``RemoteBackend-egkv`` around our connector and logs no failure."""
    srv = server_factory(workers=1, capacity="16MiB")
    caplog.set_level(logging.WARNING)
    config = engine_config(plugin_extra("egkv", srv.url), plugins=["egkv"])
    backends = CreateStorageBackends(config, engine_metadata(), lmcache_loop, "cpu")
    try:
        assert "RemoteBackend-egkv" in backends, sorted(backends)
        assert isinstance(connector_of(backends["RemoteBackend-egkv"]), EgKvRemoteConnector)
        failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not failed, failed
    finally:
        for backend in backends.values():
            backend.close()
