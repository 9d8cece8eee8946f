"""SGLang's own host memory pools and storage config, built on CPU for the SGLang backend's
tests (tests/sglang_hicache/) and benchmark (scripts/bench_sglang.py). Run with a python
that has SGLang (``.venv-vllm``); import ``no_torchvision`` first where SGLang's model
configs would import torchvision."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import no_torchvision  # noqa: F401  (before SGLang's host pools)
import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost, get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

#: The config line that builds eg-kv's backend through SGLang's ``dynamic`` factory.
EG_KV_BACKEND = {"backend_name": "eg-kv", "module_path": "eg_kv.sglang",
                 "class_name": "EgKvHiCacheStorage", "interface_v1": 1}  # fmt: skip


def mha_pool(layout: str, *, layers: int, heads: int, dim: int, page: int, pages: int,
             dtype: Any = torch.bfloat16,
             v_dim: int | None = None) -> MHATokenToKVPoolHost:  # fmt: skip
    """SGLang's MHA host pool of about ``pages`` pages (twice a device pool of half), of
    the class SGLang picks: with ``v_dim`` other than ``dim`` (MiMo-V2's K and V), the
    one that keeps K and V in buffers of their own."""
    tokens = pages * page // 2
    v_dim = dim if v_dim is None else v_dim
    k = tuple(torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, v_dim, dtype=dtype) for _ in range(layers))

    def ptrs(bufs: tuple) -> torch.Tensor:
        return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=dim, v_head_dim=v_dim, dtype=dtype,
        device=torch.device("cpu"),
    )  # fmt: skip
    pool = get_mha_host_pool_cls(info)(info, 2.0, 0, page, layout, pin_memory=False,
                                       device="cpu", device_capacity_tokens=tokens,
                                       start_layer=0, end_layer=layers)  # fmt: skip
    pool._eg_kv_device = (k, v)  # the device buffers the pool's pointers name
    return pool


def mla_pool(layout: str, *, layers: int, rank: int, rope: int, page: int, pages: int,
             dtype: Any = torch.bfloat16) -> MLATokenToKVPoolHost:  # fmt: skip
    """SGLang's MLA host pool of about ``pages`` pages."""
    tokens = pages * page // 2
    bufs = tuple(torch.zeros(tokens, 1, rank + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
        kv_lora_rank=rank, qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=dtype,
        device=torch.device("cpu"),
    )  # fmt: skip
    pool = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0,
                                end_layer=layers, target_layer_num=layers)  # fmt: skip
    pool._eg_kv_device = bufs
    return pool


def storage_config(mla: bool, extra: dict, *, model: str, tp_rank: int = 0,
                   tp_size: int = 1) -> HiCacheStorageConfig:  # fmt: skip
    """SGLang's storage config of one rank, with ``extra`` as its extra config."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=model, extra_config=extra,
    )  # fmt: skip
