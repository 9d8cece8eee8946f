"""EgKvConnector's worker side under a vLLM version, without an engine: run by
tests/vllm/test_connector_worker.py with a vLLM venv's Python (vLLM is not in the test venv).

``connector_proc.py URL MODEL_DIR`` builds vLLM's own ``VllmConfig`` (a tiny Llama config in
MODEL_DIR, the KV connector named by module path, a CPU device) and its parallel state (one
rank, gloo), then two worker-side connectors, each with its own paged KV tensors (two
layers, 8 blocks, bfloat16): the first saves blocks 1, 2 and 5 (``wait_for_save`` with the
step's metadata bound, then ``flush``); the second, whose tensors are zeros, loads the three
into blocks 0, 3 and 4 (``start_load_kv``) and one block never stored into block 6. Prints
one JSON line (``RESULT {...}``): what each step saw, the counters, and whether the loaded
blocks equal the saved ones byte for byte.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    url, model_dir = sys.argv[1], sys.argv[2]
    import torch
    import vllm
    from transformers import LlamaConfig
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from eg_kv.vllm.connector import BlockTransfer, EgKvConnector, EgKvConnectorMetadata

    LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, torch_dtype="bfloat16",
    ).save_pretrained(model_dir)  # fmt: skip
    model = ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True)
    transfer = KVTransferConfig(
        kv_connector="EgKvConnector", kv_connector_module_path="eg_kv.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"url": url, "local_reads": False},
    )  # fmt: skip
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(), kv_transfer_config=transfer,
        device_config=DeviceConfig(device="cpu"),  # vLLM 0.34's CUDA wheel infers none here
    )  # fmt: skip
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layers, attn)])  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo",
        )  # fmt: skip
        initialize_model_parallel(1, 1)

        def worker(fill: bool) -> tuple[EgKvConnector, dict[str, torch.Tensor]]:
            conn = EgKvConnector(config, KVConnectorRole.WORKER, kv)
            gen = torch.Generator().manual_seed(7)
            caches = {
                name: (torch.randn((8, 2, 16, 2, 16), generator=gen) if fill
                       else torch.zeros((8, 2, 16, 2, 16))).to(torch.bfloat16)
                for name in layers
            }  # fmt: skip
            conn.register_kv_caches(caches)
            return conn, caches

        digests = [bytes([i]) * 32 for i in (1, 2, 5)]
        saver, saved = worker(fill=True)
        saver.bind_connector_metadata(
            EgKvConnectorMetadata(saves=[BlockTransfer("r1", [1, 2, 5], digests)])
        )
        saver.wait_for_save()
        saver.flush()
        saver.clear_connector_metadata()
        loader, loaded = worker(fill=False)
        loads = [BlockTransfer("r2", [0, 3, 4], digests),
                 BlockTransfer("r3", [6], [b"\x09" * 32])]  # fmt: skip
        loader.bind_connector_metadata(EgKvConnectorMetadata(loads=loads))
        loader.start_load_kv(None)  # type: ignore[arg-type]
        errors = sorted(loader.get_block_ids_with_load_errors())
        equal = all(
            torch.equal(loaded[name][dst], saved[name][src])
            for name in layers
            for dst, src in ((0, 1), (3, 2), (4, 5))
        )
        untouched = all(not loaded[name][6].any() for name in layers)
        result = {
            "vllm": vllm.__version__, "saver": dict(saver.counters),
            "loader": dict(loader.counters), "load_errors": errors, "equal": equal,
            "block_6_untouched": untouched,
            "handshake_shard": loader.get_handshake_metadata().shard,  # type: ignore[union-attr]
        }  # fmt: skip
        saver.shutdown()
        loader.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
