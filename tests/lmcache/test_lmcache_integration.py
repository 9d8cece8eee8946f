"""eg-kv inside the real ``lmcache`` package (0.5.6 in .venv, 0.5.7rc2 in
.venv-lmcache057; CPU torch), against a real server.

(a) The ``native_plugin`` adapter built by LMCache's own config parser and adapter
    registry stores, looks up, loads (byte-identical) and deletes a 14 MiB chunk.
(b) ``lmcache bench l2 --l2-adapter '<our json>' --no-skip-verify`` passes.
(c) The ``remote_storage_plugins`` path round-trips a chunk through ``RemoteBackend``.
(d) Two adapters in two processes: one stores, the other loads the same chunk and stores
    it again; ``/kv/stats`` shows one resident copy and the dedup hit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from helpers.lmcache_l2 import CHUNK, LMCACHE_ENV, TESTS, our_json  # noqa: E402
from lmcache.cli.commands.bench.l2_adapter_bench.data import (  # noqa: E402
    create_l1_memory_desc,
    make_aligned_tensor,
    make_memory_objects,
    make_object_keys,
    wait_eventfd,
)
from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (  # noqa: E402
    NativeConnectorL2Adapter,
    _object_key_to_string,
)

from eg_kv.kvcache import EgKvRemoteConnector, RemoteKVConnector, RemoteKVL2Connector  # noqa: E402
from eg_kv.lmcache.key_addresses import KeyAddresses, binding_params  # noqa: E402

pytestmark = pytest.mark.lmcache

MODEL = "Qwen/Qwen2.5-7B-Instruct"


# --------------------------------------------------------------------------- (a)


@pytest.mark.slow
def test_a_native_plugin_through_lmcache_registry(server_factory):
    srv = server_factory(workers=2, capacity="128MiB")
    cfg = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[our_json(srv.url, timeout_s=30, num_workers=4)])
    )
    buf = make_aligned_tensor(2 * CHUNK)
    adapter = create_l2_adapter(cfg.adapters[0], l1_memory_desc=create_l1_memory_desc(buf))
    try:
        assert isinstance(adapter, NativeConnectorL2Adapter)
        assert isinstance(adapter._client, RemoteKVL2Connector)
        keys = make_object_keys(1, model_name=MODEL)
        (src,) = make_memory_objects(buf, 1, CHUNK, 0)
        (dst,) = make_memory_objects(buf, 1, CHUNK, CHUNK, fill_offset=1)
        src.raw_data.copy_(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8))
        layout = {0: MemoryLayoutDesc(shapes=[], dtypes=[])}

        def lookup() -> int:
            task = adapter.submit_lookup_and_lock_task(keys, layout)
            assert wait_eventfd(adapter.get_lookup_and_lock_event_fd(), timeout=30)
            return adapter.query_lookup_and_lock_result(task).popcount()

        assert lookup() == 0
        task = adapter.submit_store_task(keys, [src])
        assert wait_eventfd(adapter.get_store_event_fd(), timeout=60)
        assert adapter.pop_completed_store_tasks()[task].is_successful()
        assert lookup() == 1

        assert not torch.equal(src.raw_data, dst.raw_data)
        task = adapter.submit_load_task(keys, [dst])
        assert wait_eventfd(adapter.get_load_event_fd(), timeout=60)
        assert adapter.query_load_result(task).popcount() == 1
        assert torch.equal(src.raw_data, dst.raw_data)  # byte-identical

        # Stored once, under the digest of LMCache's whole key string and the binding.
        kv = RemoteKVConnector(base_url=srv.url)
        addr = KeyAddresses(binding_params({})).address(_object_key_to_string(keys[0]))
        assert "/" in _object_key_to_string(keys[0]) and kv.contains(addr)
        stats = kv.stats()
        assert stats.unique_blocks == 1 and stats.resident_bytes >= CHUNK

        adapter.delete(keys)  # blocks until the plugin's delete completes
        assert lookup() == 0 and not kv.contains(addr)
        assert kv.stats().unique_blocks == 0
        kv.close()
    finally:
        adapter.close()


# --------------------------------------------------------------------------- (b)


@pytest.mark.slow
def test_b_lmcache_bench_l2_verifies_our_plugin(server_factory):
    srv = server_factory(workers=2, capacity="256MiB")
    cmd = [
        sys.executable, "-m", "lmcache.cli.main", "bench", "l2",
        "--l2-adapter", our_json(srv.url, timeout_s=30),
        "--no-skip-verify", "--num-keys", "4", "--data-size-kb", str(CHUNK // 1024),
        "--rounds", "2", "--warmup-rounds", "1", "--lookup-max-hit-rate", "1.0",
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=150, env=LMCACHE_ENV, cwd=TESTS.parent
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "All 4 keys data verified OK" in text, text[-4000:]
    assert "TIMEOUT" not in text
    # Store, lookup and load each report every key of the 2 measured rounds.
    successes = re.findall(r"Total success:\s+(\d+)", text)
    assert successes == ["8", "8", "8"], text[-4000:]
    assert KvStats(srv.url).unique_blocks == 12  # 3 rounds (1 warmup) x 4 keys


def KvStats(url: str):
    with RemoteKVConnector(base_url=url) as kv:
        return kv.stats()


# --------------------------------------------------------------------------- (c)


def test_c_remote_storage_plugin_round_trips_through_remote_backend(server_factory, lmcache_loop):
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    srv = server_factory(workers=2, capacity="128MiB")
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=0.1,
        remote_serde="naive",
        lmcache_instance_id="eg-kv-test",
        remote_storage_plugins=["egkv"],
        extra_config={
            "remote_storage_plugin.egkv.module_path": "eg_kv.kvcache",
            "remote_storage_plugin.egkv.class_name": "EgKvRemoteConnector",
            "remote_storage_plugin.egkv.base_url": srv.url,
            "remote_storage_plugin.egkv.timeout_s": "30",
        },
    )
    # 14 layers x (K, V) x 256 tokens x 8 heads x 128 dims in bf16: a 14 MiB chunk.
    metadata = LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(14, 2, 256, 8, 128),
    )  # fmt: skip
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    backend = RemoteBackend(config, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
    try:
        # LMCache wraps every connector in its InstrumentedRemoteConnector.
        connector = getattr(backend.connection, "_connector", backend.connection)
        assert isinstance(connector, EgKvRemoteConnector)
        assert connector.kv_config.base_url == srv.url  # read from extra_config
        key = CacheEngineKey(
            model_name=MODEL, world_size=1, worker_id=0, chunk_hash=0xE6, dtype=torch.bfloat16
        )
        obj = cpu.allocate(metadata.get_shapes(), metadata.get_dtypes(), None)
        assert obj.get_size() == CHUNK
        obj.tensor.copy_(torch.randn(obj.tensor.shape).to(torch.bfloat16))

        assert backend.contains(key) is False
        assert backend.get_blocking(key) is None
        backend.submit_put_task(key, obj).result(60)
        assert backend.contains(key) is True
        assert backend.batched_contains([key, key]) == 2

        got = backend.get_blocking(key)
        assert got is not None and got is not obj
        assert got.get_shapes() == obj.get_shapes() and got.get_dtypes() == obj.get_dtypes()
        assert torch.equal(got.tensor, obj.tensor)

        # On the server: LMCache's 28-byte chunk header + the chunk, under the digest.
        with RemoteKVConnector(base_url=srv.url) as kv:
            stored = kv.get(connector._address(key))
            assert stored is not None and len(stored) == CHUNK + 28
            assert stored[28:] == bytes(obj.byte_array)
        assert backend.remove(key) is True
        assert backend.contains(key) is False
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        backend.close()
        cpu.memory_allocator.close()


# --------------------------------------------------------------------------- (d)


def run_proc(op: str, url: str, seed: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(TESTS / "lmcache_l2_proc.py"), op, url, str(CHUNK), str(seed)],
        capture_output=True, text=True, timeout=90, env=LMCACHE_ENV, cwd=TESTS.parent,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_d_two_processes_share_one_copy(server_factory):
    srv = server_factory(workers=2, capacity="128MiB")
    first = run_proc("store", srv.url, seed=7)
    assert first["adapter"] == "NativeConnectorL2Adapter"
    assert first["plugin"] == "RemoteKVL2Connector" and first["stored"] is True
    second = run_proc("load", srv.url, seed=7)
    assert second["found"] == 1 and second["loaded"] == 1
    assert second["digest"] == first["digest"]  # the other process got the same bytes
    third = run_proc("store", srv.url, seed=7)  # the same chunk computed elsewhere
    assert third["stored"] is True and third["digest"] == first["digest"]
    stats = KvStats(srv.url)
    assert stats.unique_blocks == 1  # one resident copy...
    assert stats.dedup_hits == 1  # ...and the second store was the dedup hit
    assert CHUNK <= stats.resident_bytes < 2 * CHUNK
    assert stats.logical_bytes == 2 * CHUNK and stats.dedup_savings_bytes == CHUNK
    assert stats.get_hits >= 1
