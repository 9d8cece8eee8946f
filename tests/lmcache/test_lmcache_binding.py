"""The LMCache paths bind what changes a chunk's meaning (eg_kv.binding): engines at two
revisions, two KV element types or two checkpoints at one path share no address, and an
identically configured engine shares every one. Real servers, the real ``lmcache``."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from helpers.kvcache import lm_keys, wait_completions  # noqa: E402
from helpers.lmcache_engine import (  # noqa: E402
    connector_of,
    engine_config,
    engine_key,
    engine_metadata,
    filled,
    plugin_extra,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from eg_kv.errors import ConfigError  # noqa: E402
from eg_kv.kvcache import RemoteKVL2Connector  # noqa: E402

pytestmark = pytest.mark.lmcache

SIZE = 64 * 1024


def _touch_weights(model_dir, content: bytes) -> None:
    """Write a new checkpoint at the same path (a later modification time)."""
    weights = model_dir / "model.safetensors"
    weights.write_bytes(content)
    later = time.time_ns() + 10**9
    os.utime(weights, ns=(later, later))


def test_l2_adapter_params_bind_revision_dtype_and_weights(server_factory, tmp_path):
    """One LMCache server stores chunks; servers declaring another revision or KV element
    type, or whose model directory now holds other weights, find none of them and load
    nothing; a server declaring the same binding finds and loads every one."""
    srv = server_factory(workers=1, capacity="32MiB")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    _touch_weights(model_dir, b"weights v1")
    base = dict(base_url=srv.url, timeout_s=10, num_workers=2, local_reads=False)
    bound = dict(revision="r1", kv_dtype="bfloat16")
    keys = lm_keys(4) + [f"{model_dir}@{1:08x}@0@{i:064x}" for i in range(4)]
    blocks = [os.urandom(SIZE) for _ in keys]

    writer = RemoteKVL2Connector(**base, **bound)
    conns = [writer]
    try:
        fid = writer.submit_batch_set(keys, [memoryview(b) for b in blocks])
        assert wait_completions(writer, {fid})[fid][3] == [True] * len(keys)
        others = {
            "fp16": RemoteKVL2Connector(**base, revision="r1", kv_dtype="float16"),
            "r2": RemoteKVL2Connector(**base, revision="r2", kv_dtype="bfloat16"),
            "undeclared": RemoteKVL2Connector(**base),
        }
        conns += others.values()
        _touch_weights(model_dir, b"weights v2")  # the same path, another checkpoint
        later = RemoteKVL2Connector(**base, **bound)
        twin_dir = RemoteKVL2Connector(**base, **bound)
        conns += [later, twin_dir]
        for name, conn in others.items():
            assert not set(conn.addresses.addresses(keys)) & set(writer.addresses.addresses(keys))
            fid = conn.submit_batch_exists(keys)
            assert wait_completions(conn, {fid})[fid][3] == [False] * len(keys), name
            outs = [bytearray(SIZE) for _ in keys]
            fid = conn.submit_batch_get(keys, [memoryview(o) for o in outs])
            assert wait_completions(conn, {fid})[fid][3] == [False] * len(keys), name
            assert not any(any(o) for o in outs), name  # no byte written
        # The local directory's new weights: its keys are new addresses, the hub's stay.
        fid = later.submit_batch_exists(keys)
        assert wait_completions(later, {fid})[fid][3] == [True] * 4 + [False] * 4
        assert later.addresses.addresses(keys) == twin_dir.addresses.addresses(keys)
        # The same binding (and weights) as the writer: every chunk found and loaded.
        twin = RemoteKVL2Connector(**base, **bound)
        conns.append(twin)
        assert twin.addresses.addresses(keys[:4]) == writer.addresses.addresses(keys[:4])
        outs = [bytearray(SIZE) for _ in keys[:4]]
        fid = twin.submit_batch_get(keys[:4], [memoryview(o) for o in outs])
        assert wait_completions(twin, {fid})[fid][3] == [True] * 4
        assert [bytes(o) for o in outs] == blocks[:4]
    finally:
        for conn in conns:
            conn.close()


@pytest.mark.parametrize("value", [5, ["r1"], None])
def test_a_binding_param_that_is_not_a_string_is_refused(value):
    with pytest.raises(ConfigError, match="revision must be a string"):
        RemoteKVL2Connector(base_url="http://127.0.0.1:9", revision=value)


def test_the_in_engine_plugin_binds_revision_dtype_and_weights(
    server_factory, lmcache_loop, tmp_path
):
    """In-engine LMCache plugins on one server: one at another revision, one with fp16
    KV, one whose model directory holds a later checkpoint load none of the first one's
    chunks; an identically configured engine loads it."""
    srv = server_factory(workers=1, capacity="64MiB")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    _touch_weights(model_dir, b"weights v1")

    def engine(dtype=torch.bfloat16, **declared):
        metadata = engine_metadata(dtype=dtype)
        metadata.model_name = str(model_dir)
        cfg = engine_config(plugin_extra("egkv", srv.url, **declared), plugins=["egkv"])
        cpu = LocalCPUBackend(cfg, metadata, dst_device="cpu")
        backend = RemoteBackend(cfg, metadata, lmcache_loop, cpu, "cpu", plugin_name="egkv")
        cpus.append(cpu)
        backends.append(backend)
        return backend, cpu, metadata

    cpus: list = []
    backends: list = []
    try:
        writer, cpu, metadata = engine(revision="r1")
        assert connector_of(writer).binding.revision == "r1"
        key = engine_key(0xB1D)
        obj = filled(cpu, metadata, 7)
        writer.submit_put_task(key, obj).result(30)
        # The PUT named the chunk by LMCache's chunk hash, for the server's KV events.
        with urllib.request.urlopen(srv.url + "/kv/events?since=0&limit=100") as answer:
            named = [e.get("engine_hash") for e in json.loads(answer.read())["events"]]
        assert named == [(0xB1D).to_bytes(8, "big").hex()]
        strangers = [engine(revision="r2")[0], engine(dtype=torch.float16, revision="r1")[0]]
        twin = engine(revision="r1")[0]
        _touch_weights(model_dir, b"weights v2")
        strangers.append(engine(revision="r1")[0])
        for backend in strangers:
            assert connector_of(backend).layout_tag != connector_of(writer).layout_tag
            assert backend.get_blocking(key) is None
        got = twin.get_blocking(key)
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        for backend in backends:
            backend.close()
        for cpu in cpus:
            cpu.memory_allocator.close()
