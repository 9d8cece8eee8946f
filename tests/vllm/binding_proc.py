"""Addresses of engines built from vLLM's own config objects: run by
tests/vllm/test_binding.py with .venv-vllm's Python (vLLM is not in the test venv).

``binding_proc.py MODEL_DIR PLAN`` builds, for each engine of the JSON PLAN (``{"name",
"dtype", "revision", "tp", "rank", "lora", "touch"}``), vLLM's ``ModelConfig``,
``CacheConfig``, ``ParallelConfig`` and ``VllmConfig`` for a tiny Llama config in MODEL_DIR,
vLLM's ``KVCacheConfig`` and its own ``build_offloading_config``; then the addresses
EgKvConnector gives 64 blocks of one prompt (its format, from ``connector_format``, and
the token chain with the request's LoRA) and the addresses EgKvTier gives 64 of vLLM's own
block hashes (``hash_block_tokens`` with the LoRA as an extra key), and the binding each
path mixes in (the tier's with vLLM's config current and without). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    model_dir, plan = sys.argv[1], json.loads(sys.argv[2])
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, torch_dtype="bfloat16",
    ).save_pretrained(model_dir)  # fmt: skip
    weights = Path(model_dir) / "model.safetensors"
    weights.write_bytes(b"weights v1")
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from eg_kv.binding import binding_of
    from eg_kv.vllm.addresses import block_address, block_addresses, connector_format, token_chain
    from eg_kv.vllm.tier import tier_binding, tier_format
    from eg_kv.vllm.tier_settings import tier_settings_from

    init_none_hash(sha256)
    tokens = list(range(1, 64 * 16 + 1))
    out = {}
    for engine in plan:
        if engine.get("touch"):  # the same path, new weights (a later checkpoint)
            time.sleep(0.01)
            weights.write_bytes(b"weights v2")
            os.utime(weights, ns=(time.time_ns(), time.time_ns()))
        model = ModelConfig(model=model_dir, dtype=engine["dtype"], skip_tokenizer_init=True,
                            revision=engine.get("revision"))  # fmt: skip
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                    engine_id="e", kv_connector_extra_config={})  # fmt: skip
        config = VllmConfig(
            model_config=model, cache_config=CacheConfig(block_size=16),
            parallel_config=ParallelConfig(tensor_parallel_size=engine.get("tp", 1)),
            kv_transfer_config=transfer,
            # Named: vLLM 0.34's CUDA wheel finds no device to infer on a CPU-only host.
            device_config=DeviceConfig(device="cpu"),
        )  # fmt: skip
        attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=model.dtype)
        layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layers, attn)])  # fmt: skip
        kv_dtype = str(model.dtype).removeprefix("torch.")
        # The connector: its format as register_kv_caches builds it, one shard's addresses.
        described = [f"{name}:(2, 16, 2, 16):torch.{kv_dtype}" for name in layers]
        fmt = connector_format(config, described, kv_dtype)
        lora = engine.get("lora")
        chain = token_chain(tokens, 16, extras=[f"lora={lora}:"] if lora else [])
        shard = fmt.shard_of(engine.get("rank", 0))
        connector = block_addresses(chain, fmt, shard)
        # The tier: vLLM's own offloading config, and vLLM's block hashes.
        offload = build_offloading_config(config, kv)
        spec = type("Spec", (), {"config": offload})()
        settings = tier_settings_from({"revision": engine.get("revision") or ""}, env={})
        unseen = tier_binding(spec, settings)
        with set_current_vllm_config(config):
            seen = tier_binding(spec, settings)
        tier_fmt = tier_format(spec, 4096, unseen)
        salt = tier_fmt.salt(0)
        parent, keys = None, []
        extra = (lora,) if lora else None
        for i in range(64):
            block = tuple(tokens[i * 16 : (i + 1) * 16])
            parent = hash_block_tokens(sha256, parent, block, extra)
            keys.append(parent)
        tier = [block_address(bytes(k), salt) for k in keys]
        out[engine["name"]] = {
            "connector": connector, "tier": tier,
            "binding": binding_of(config).describe(),
            "tier_binding_seen": seen.describe(), "tier_binding_unseen": unseen.describe(),
        }  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
