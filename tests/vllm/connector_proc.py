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
        # The same loads staged a block at a time (max_load_bytes under two blocks).
        extra = config.kv_transfer_config.kv_connector_extra_config
        extra["max_load_bytes"] = loader._block_bytes + 1
        try:
            waves, in_waves = worker(fill=False)
        finally:
            del extra["max_load_bytes"]
        waves.bind_connector_metadata(EgKvConnectorMetadata(loads=loads))
        real_empty, staged = torch.empty, []

        def empty(shape, *args, **kwargs):  # the staging buffers' rows, as allocated
            staged.append(shape[0])
            return real_empty(shape, *args, **kwargs)

        torch.empty = empty
        try:
            waves.start_load_kv(None)  # type: ignore[arg-type]
        finally:
            torch.empty = real_empty
        equal = equal and sorted(waves.get_block_ids_with_load_errors()) == errors and all(
            torch.equal(in_waves[name][i], loaded[name][i]) for name in layers for i in range(8)
        )  # fmt: skip
        waves.shutdown()
        untouched = all(not loaded[name][6].any() for name in layers)
        loader_counters = dict(loader.counters)
        # The step's saves computed after the failed block 6 are not stored, this step's
        # nor the next's (planned before vLLM heard); others are, and so are the later.
        after_bad = [BlockTransfer("r3", [7], [b"\x0a" * 32], after=[6])]
        loader.bind_connector_metadata(
            EgKvConnectorMetadata(
                loads=loads, saves=[*after_bad, BlockTransfer("r2", [5], [b"\x0b" * 32], after=[0])]
            )
        )
        loader.start_load_kv(None)  # type: ignore[arg-type]
        loader.wait_for_save()
        loader.clear_connector_metadata()
        for step in range(2):  # no load fails in these
            loader.bind_connector_metadata(EgKvConnectorMetadata(saves=[BlockTransfer(
                "r3", [7], [bytes([0x0c + step]) * 32], after=[6])]))  # fmt: skip
            loader.wait_for_save()
            loader.clear_connector_metadata()
        loader.flush()
        poisoned = {
            "stored": [loader._client.exists(a) for a in loader._addresses(
                [b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32, b"\x0d" * 32])],
            "skipped": loader.counters["save_skipped_blocks"],
        }  # fmt: skip
        result = {
            "vllm": vllm.__version__, "saver": dict(saver.counters),
            "loader": loader_counters, "load_errors": errors, "equal": equal,
            "block_6_untouched": untouched, "poisoned": poisoned, "staged_rows": staged,
            "rollback_saves": rollback(config, kv), "dcp_refused": dcp_refused(config, kv),
            "leases": scheduler_leases(config, kv, url, saver, worker_caches=loaded),
            "silent_saves": silent_saves(config, kv, layers, worker_caches=loaded),
            "handshake_shard": loader.get_handshake_metadata().shard,  # type: ignore[union-attr]
        }  # fmt: skip
        saver.shutdown()
        loader.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def silent_saves(config, kv, layers, worker_caches) -> dict:
    """Saves to a server that takes the connection and never answers, one block's worth
    of PUTs allowed in flight: a step's three saves return at once, two dropped (it waited
    for the oldest PUT, a timeout, before each)."""
    import copy
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from eg_kv.vllm.connector import BlockTransfer, EgKvConnector, EgKvConnectorMetadata

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # never accepts
        cfg = copy.deepcopy(config)
        cfg.kv_transfer_config.kv_connector_extra_config = {
            "url": f"http://127.0.0.1:{silent.getsockname()[1]}", "local_reads": False,
            "timeout_s": 1, "max_pending_bytes": 1}  # fmt: skip
        conn = EgKvConnector(cfg, KVConnectorRole.WORKER, kv)
        conn.register_kv_caches(worker_caches)
        conn.bind_connector_metadata(
            EgKvConnectorMetadata(
                saves=[BlockTransfer("s", [1, 2, 3], [bytes([0x20 + i]) * 32 for i in range(3)])]
            )
        )
        t0 = time.monotonic()
        conn.wait_for_save()
        took = time.monotonic() - t0
        conn.clear_connector_metadata()
        dropped = conn.counters["save_dropped_blocks"]
        conn.shutdown()  # waits for the one PUT sent (its timeout)
    return {"took": took, "dropped": dropped}


def scheduler_leases(config, kv, url, saver, worker_caches) -> dict:
    """On the server's host (local reads): the scheduler's lookup leases three stored
    blocks, a worker loads them, and the scheduler's own client releases the leases when
    the next step is built (vLLM's one batch in flight), not before; another engine's
    leases on the same blocks, under the same token, are all still held after."""
    import copy
    import time
    from types import SimpleNamespace as NS

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from eg_kv.client.connectors import connect
    from eg_kv.client.settings import KvCacheConfig
    from eg_kv.vllm.addresses import token_chain
    from eg_kv.vllm.connector import BlockTransfer, EgKvConnector, EgKvConnectorMetadata

    cfg = copy.deepcopy(config)
    cfg.kv_transfer_config.kv_connector_extra_config = {"url": url, "local_reads": True}
    tokens = [200 + i for i in range(16 * 3 + 1)]  # three whole blocks and a token
    chain = token_chain(tokens, 16, extras=(), max_blocks=3)
    saver.bind_connector_metadata(
        EgKvConnectorMetadata(saves=[BlockTransfer("q", [1, 2, 5], chain)])
    )
    saver.wait_for_save()
    saver.flush()
    saver.clear_connector_metadata()
    addresses = saver._addresses(chain)
    other = connect(KvCacheConfig(base_url=url, local_reads=False))
    assert other.exists_many(addresses, lease_ms=60_000) == [True] * 3
    sched = EgKvConnector(cfg, KVConnectorRole.SCHEDULER, kv)
    sched.set_xfer_handshake_metadata({0: saver.get_handshake_metadata()})
    req = NS(request_id="q", all_token_ids=tokens, num_tokens=len(tokens),
             block_hashes=[bytes([i]) * 32 for i in range(3)], mm_features=None,
             prompt_embeds=None, cache_salt=None, lora_request=None)  # fmt: skip
    end = time.monotonic() + 10
    while (matched := sched.get_num_new_matched_tokens(req, 0)[0]) is None:
        assert time.monotonic() < end, "the lookup never answered"
        time.sleep(0.01)
    sched.update_state_after_alloc(req, None, matched)
    empty = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    new = NS(req_id="q", block_ids=([0, 3, 4, 6],), num_computed_tokens=matched)
    step = NS(num_scheduled_tokens={"q": 1}, scheduled_new_reqs=[new], scheduled_cached_reqs=empty)
    meta = sched.build_connector_meta(step)
    loader = EgKvConnector(cfg, KVConnectorRole.WORKER, kv)
    loader.register_kv_caches(worker_caches)
    loader.bind_connector_metadata(meta)
    loader.start_load_kv(None)  # type: ignore[arg-type]
    loader.clear_connector_metadata()
    book = sched._leases
    assert book is not None and book.drain(5)
    idle = NS(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=empty)
    for _ in range(book.lag - 1):  # steps built while the loading one may still run
        sched.build_connector_meta(idle)
    book.drain(5)
    during = book.stats()
    sched.build_connector_meta(idle)  # vLLM has the loading step's output now
    book.drain(5)
    after = book.stats()
    other_held = other.release(addresses)
    loaded = loader.counters["loaded_blocks"]
    for c in (sched, loader):
        c.shutdown()
    other.close()
    return {"lag": book.lag == cfg.max_concurrent_batches, "matched": matched,
            "loaded": loaded, "held_during": during["held"],
            "released_during": during["released"], "released_after": after["released"],
            "held_after": after["held"], "other_held": other_held}  # fmt: skip


def dcp_refused(config, kv) -> str:
    """What building the connector says under decode context parallel (a block holds
    block_size * dcp tokens: addresses of block_size would name too few)."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from eg_kv.vllm.connector import EgKvConnector

    dcp = copy.copy(config)
    dcp.parallel_config = copy.copy(config.parallel_config)
    dcp.parallel_config.decode_context_parallel_size = 2
    try:
        EgKvConnector(dcp, KVConnectorRole.SCHEDULER, kv).shutdown()
    except ValueError as e:
        return str(e)
    return ""


def rollback(config, kv) -> tuple[list[list[int]], int]:
    """The scheduler's saves after vLLM rolls a request back to its first block (a load
    that failed): the blocks it recomputes are planned again, those it had saved were
    computed on the failed block (before, none were: the mark of saved blocks stayed)."""
    from types import SimpleNamespace as NS

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from eg_kv.vllm.connector import EgKvConnector

    sched = EgKvConnector(config, KVConnectorRole.SCHEDULER, kv)
    tokens = list(range(1, 16 * 5 + 2))  # five whole blocks and a token
    req = NS(request_id="r", all_token_ids=tokens, num_tokens=len(tokens),
             block_hashes=[bytes([i]) * 32 for i in range(5)], mm_features=None,
             prompt_embeds=None, cache_salt=None, lora_request=None)  # fmt: skip
    sched.update_state_after_alloc(req, None, 32)  # blocks 0-1 to load
    new = NS(req_id="r", block_ids=([10, 11, 12, 13, 14, 15],), num_computed_tokens=32)
    first = sched.build_connector_meta(NS(
        num_scheduled_tokens={"r": len(tokens) - 32}, scheduled_new_reqs=[new],
        scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                 num_computed_tokens=[])))  # fmt: skip
    assert [t.after for t in first.saves] == [[10, 11]], first.saves
    again = sched.build_connector_meta(NS(
        num_scheduled_tokens={"r": len(tokens)}, scheduled_new_reqs=[],
        scheduled_cached_reqs=NS(req_ids=["r"], new_block_ids=[None], resumed_req_ids=set(),
                                 num_computed_tokens=[0])))  # fmt: skip
    finished = sched.request_finished(req, [])[1]
    sched.shutdown()  # what it loaded was rolled back: none of it counts
    return [t.block_ids for t in again.saves], finished["eg_kv_loaded_tokens"]


if __name__ == "__main__":
    main()
