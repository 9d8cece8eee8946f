"""Building LMCache's own in-engine objects (config, metadata, CPU backend, RemoteBackend)
around eg-kv for the tests: the real ``lmcache`` (0.5.6 or 0.5.7rc2), nothing mocked."""

from __future__ import annotations

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

MODEL = "Qwen/Qwen2.5-7B-Instruct"
#: A small model shape: 2 layers x (K, V) x 256 tokens x 2 heads x 64 dims in bf16.
SMALL_SHAPE = (2, 2, 256, 2, 64)
SMALL_CHUNK = 2 * 2 * 256 * 2 * 64 * 2  # 256 KiB


def plugin_extra(name: str, url: str, class_name: str = "EgKvConnectorAdapter", **more) -> dict:
    """``extra_config`` entries of one eg-kv plugin instance."""
    out = {
        f"remote_storage_plugin.{name}.module_path": "eg_kv.kvcache",
        f"remote_storage_plugin.{name}.class_name": class_name,
        f"remote_storage_plugin.{name}.base_url": url,
        f"remote_storage_plugin.{name}.timeout_s": "20",
    }
    out.update({f"remote_storage_plugin.{name}.{k}": v for k, v in more.items()})
    return out


def engine_config(extra: dict, plugins: list[str] | None = None, **kw) -> LMCacheEngineConfig:
    """An LMCache engine config with a small CPU cache and the given plugins."""
    settings = dict(chunk_size=256, local_cpu=True, max_local_cpu_size=0.05,
                    remote_serde="naive", lmcache_instance_id="eg-kv-test")  # fmt: skip
    settings.update(kw)
    if plugins is not None:
        settings["remote_storage_plugins"] = plugins
    return LMCacheEngineConfig.from_defaults(extra_config=extra, **settings)


def engine_metadata(shape=SMALL_SHAPE, dtype=torch.bfloat16, **kw) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=dtype, kv_shape=shape, **kw,
    )  # fmt: skip


def engine_key(chunk_hash: int, dtype=torch.bfloat16) -> CacheEngineKey:
    return CacheEngineKey(
        model_name=MODEL, world_size=1, worker_id=0, chunk_hash=chunk_hash, dtype=dtype
    )


def connector_of(backend):
    """Our connector inside LMCache's ``InstrumentedRemoteConnector`` (None if not built)."""
    conn = backend.connection
    return getattr(conn, "_connector", conn)


def filled(cpu, metadata, seed: int):
    """A chunk from the CPU backend, filled with ``seed``-derived values."""
    obj = cpu.allocate(metadata.get_shapes(), metadata.get_dtypes(), None)
    gen = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(obj.tensor.dtype))
    return obj
