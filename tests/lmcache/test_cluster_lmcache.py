"""LMCache over a server set of 3 real members: ``lmcache bench l2 --no-skip-verify`` and
two LMCache processes that keep one copy per chunk in the whole fleet."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from helpers.lmcache_engine import (  # noqa: E402
    connector_of,
    engine_config,
    engine_key,
    engine_metadata,
    filled,
    plugin_extra,
)
from helpers.lmcache_l2 import CHUNK, LMCACHE_ENV, TESTS, our_json  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402

from eg_kv.client.connectors import RemoteKVConnector  # noqa: E402
from eg_kv.client.sets import ClusterConnector  # noqa: E402

pytestmark = pytest.mark.lmcache


def run_proc(op: str, url: str, seed: int) -> dict:
    """tests/lmcache_l2_proc.py with this checkout's eg_kv first on the path."""
    env = {**LMCACHE_ENV, "PYTHONPATH": str(TESTS.parent)}
    out = subprocess.run(
        [sys.executable, str(TESTS / "lmcache_l2_proc.py"), op, url, str(CHUNK), str(seed)],
        capture_output=True, text=True, timeout=90, env=env, cwd=TESTS.parent,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def fleet(servers) -> list:
    """Each member's stats, read from the member itself."""
    out = []
    for s in servers:
        with RemoteKVConnector(base_url=s.url) as kv:
            out.append(kv.stats())
    return out


def three(server_factory) -> tuple[list, str]:
    # Each member holds every chunk a test stores (18 x 14 MiB): placement may send most of
    # them to one member, and an eviction there would be a miss the test did not cause.
    servers = [server_factory(workers=1, capacity="320MiB") for _ in range(3)]
    return servers, ",".join(s.url for s in servers)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_lmcache_bench_l2_verifies_over_a_set_of_three(server_factory):
    servers, url = three(server_factory)
    cmd = [
        sys.executable, "-m", "lmcache.cli.main", "bench", "l2",
        "--l2-adapter", our_json(url, timeout_s=30),
        "--no-skip-verify", "--num-keys", "6", "--data-size-kb", str(CHUNK // 1024),
        "--rounds", "2", "--warmup-rounds", "1", "--lookup-max-hit-rate", "1.0",
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=200, env=LMCACHE_ENV, cwd=TESTS.parent
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "All 6 keys data verified OK" in text, text[-4000:]
    assert re.findall(r"Total success:\s+(\d+)", text) == ["12", "12", "12"], text[-4000:]
    blocks = [s.unique_blocks for s in fleet(servers)]
    assert sum(blocks) == 18  # 3 rounds x 6 keys, one copy each in the whole fleet
    assert sum(1 for b in blocks if b) >= 2, f"the chunks spread over the members: {blocks}"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_two_lmcache_processes_keep_one_copy_per_chunk_in_the_fleet(server_factory):
    servers, url = three(server_factory)
    first = run_proc("store", url, seed=7)
    assert first["plugin"] == "RemoteKVL2Connector"
    second = run_proc("store", url, seed=7)  # the same chunk, computed by another process
    other = run_proc("store", url, seed=8)
    loaded = run_proc("load", url, seed=7)
    assert first["stored"] and second["stored"] and other["stored"]
    assert loaded["found"] == 1 and loaded["loaded"] == 1
    assert loaded["digest"] == first["digest"]
    stats = fleet(servers)
    assert sum(s.unique_blocks for s in stats) == 2  # distinct chunks, one copy each
    assert sum(s.dedup_hits for s in stats) == 1  # the second process's store


@pytest.mark.slow
def test_the_in_engine_plugin_over_a_set_from_extra_config(server_factory, lmcache_loop):
    """``remote_storage_plugin.egkv.base_url: a,b,c``: LMCache's RemoteBackend stores each
    chunk at its home, loads it back and counts prefix hits over the merged order."""
    servers, url = three(server_factory)
    config = engine_config(plugin_extra("egkv", url), plugins=["egkv"])
    metadata = engine_metadata()
    backends = CreateStorageBackends(config, metadata, lmcache_loop, "cpu")
    try:
        remote = backends["RemoteBackend-egkv"]
        assert isinstance(connector_of(remote).client, ClusterConnector)
        cpu = backends["LocalCPUBackend"]
        obj = filled(cpu, metadata, 3)
        keys = [engine_key(0x100 + i) for i in range(9)]
        for k in keys[:6]:
            remote.submit_put_task(k, obj).result(30)
        blocks = [s.unique_blocks for s in fleet(servers)]
        assert sum(blocks) == 6 and sum(1 for b in blocks if b) >= 2, blocks
        assert remote.batched_contains(keys) == 6
        got = remote.get_blocking(keys[4])
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        for backend in backends.values():
            backend.close()
