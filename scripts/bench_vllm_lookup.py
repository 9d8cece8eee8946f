#!/usr/bin/env python3
"""Per scheduler step, the lookup latency of eg-kv's vLLM connector (EgKvConnector's
scheduler-side ``get_num_new_matched_tokens``) and of EgKvTier (through vLLM's own
``TieringOffloadingManager``), for 16 and 256 blocks, against LMCache's L2 lookup
(``lmcache bench l2 --only lookup`` with eg-kv's native_plugin), all through ONE eg-kv
server this script starts; one table, side by side, with ratios.

vLLM lives in .venv-vllm and LMCache in .venv, so this script (run with .venv's Python)
starts the server, runs LMCache's bench itself, and runs its vLLM part
(``--vllm-part``) with .venv-vllm's Python against the same server. Every loop is
bounded (``--rounds`` lookups per size, each within ``--round-limit-s``).

What is timed, per lookup of N blocks (fresh addresses each round, all misses, as
LMCache's bench asks; every client reads over HTTP, ``local_reads`` off, as from
another host):

* connector: from the first ``get_num_new_matched_tokens`` call until it answers (hashing
  the token chain, one compact batch-exists). It answers in the first call when the
  server answers within 2 ms, else ``None`` ("ask again next step") until done; the
  "first call" column says how often the first call answered, and "sched" the time the
  scheduler thread spent in it;
* tier: a step's ``lookup`` of each of the N keys (RETRY: the batch goes at the step's
  end), ``on_schedule_end`` (one batch-exists), then ``lookup`` polled until answered:
  from the first lookup to the answer, and "sched" the scheduler thread's time in the
  step's calls. In an engine the answer is used at the next step, one model step later;
* LMCache: ``lmcache bench l2 --only lookup`` with N keys per round, one round in
  flight: its per-round p50 and p99 (rounded by the bench to 10 µs).

Run it alone (the box is shared)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_vllm_lookup.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

SIZES = (16, 256)
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def pct(vals: list[float], q: float) -> float:
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


# ---------------------------------------------------------------- the vLLM part (.venv-vllm)


def connector_lookup(url: str, n: int, rounds: int, limit_s: float) -> dict[str, float]:
    """EgKvConnector's scheduler-side lookup of ``n`` blocks, ``rounds`` times."""
    import threading

    from eg_kv.client.connectors import connect
    from eg_kv.vllm.addresses import BlockFormat
    from eg_kv.vllm.connector import EgKvConnector
    from eg_kv.vllm.lookups import PendingLookups
    from eg_kv.vllm.settings import settings_from

    bs = 16
    settings = settings_from({"url": url, "local_reads": False, "timeout_s": 10})
    # The scheduler-side state get_num_new_matched_tokens reads, as __init__ and the
    # workers' handshake leave it (no VllmConfig or model is needed for a lookup).
    conn = EgKvConnector.__new__(EgKvConnector)
    conn._settings = settings
    conn._client = connect(settings.client)
    conn._block_size = bs
    conn._formats = [BlockFormat(model="bench", dtype="bfloat16", block_size=bs, layout="l0")]
    conn._tracked = {}
    conn._lookups = PendingLookups(deadline_s=2 * settings.client.timeout_s + 1.0)
    conn._lock = threading.Lock()
    conn.counters = {"lookups": 0, "lookup_hit_blocks": 0}
    total: list[float] = []
    sched: list[float] = []
    first = 0
    try:
        for r in range(rounds + 10):
            base = (os.getpid() * 7919 + r * 104729 + n) % 1_000_000_000
            tokens = [(base + i) % 2_000_000_000 for i in range(n * bs + 1)]
            req = types.SimpleNamespace(
                request_id=f"bench-{r}", num_tokens=len(tokens), all_token_ids=tokens,
                mm_features=None, prompt_embeds=None, cache_salt=None, lora_request=None,
            )  # fmt: skip
            t0 = time.perf_counter()
            answer, _ = conn.get_num_new_matched_tokens(req, 0)
            spent = time.perf_counter() - t0
            answered_first = answer is not None
            while answer is None:
                if time.perf_counter() - t0 > limit_s:
                    raise RuntimeError(f"connector lookup of {n} blocks took over {limit_s} s")
                time.sleep(0.0001)
                s = time.perf_counter()
                answer, _ = conn.get_num_new_matched_tokens(req, 0)
                spent += time.perf_counter() - s
            if r >= 10:  # the first rounds warm the connections
                total.append((time.perf_counter() - t0) * 1e6)
                sched.append(spent * 1e6)
                first += answered_first
            conn._lookups.drop(req.request_id)
    finally:
        conn._lookups.close()
        conn._client.close()
    return {"p50": pct(total, 0.5), "p99": pct(total, 0.99), "sched": statistics.median(sched),
            "first": first / len(total)}  # fmt: skip


def tier_lookup(url: str, n: int, rounds: int, limit_s: float) -> dict[str, float]:
    """EgKvTier's lookups of ``n`` keys in one step, through TieringOffloadingManager."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.base import make_offload_key as key_of
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    row = 64 * 1024
    tier_entry = {"type": "EgKvTier", "module_path": "eg_kv.vllm.tier", "url": url,
                  "local_reads": False, "timeout_s": 10}  # fmt: skip
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=row, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": row * 16, "secondary_tiers": [tier_entry]},
        engine_id=f"eg-kv-bench-{os.getpid()}-{n}",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )  # fmt: skip
    manager = TieringOffloadingSpec(cfg).get_manager()
    end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=[])
    total: list[float] = []
    sched: list[float] = []
    try:
        for r in range(rounds + 10):
            ctx = ReqContext(req_id=f"bench-{r}")
            manager.on_new_request(ctx)
            keys = [key_of(os.urandom(32), 0) for _ in range(n)]
            t0 = time.perf_counter()
            answers = [manager.lookup(k, ctx) for k in keys]
            manager.on_schedule_end(end)
            spent = time.perf_counter() - t0
            while LookupResult.RETRY in answers:
                if time.perf_counter() - t0 > limit_s:
                    raise RuntimeError(f"tier lookup of {n} keys took over {limit_s} s")
                time.sleep(0.0001)
                s = time.perf_counter()
                if manager.lookup(keys[-1], ctx) is not LookupResult.RETRY:
                    answers = [manager.lookup(k, ctx) for k in keys]
                spent += time.perf_counter() - s
            if r >= 10:
                total.append((time.perf_counter() - t0) * 1e6)
                sched.append(spent * 1e6)
            manager.on_request_finished(ctx)
            manager.on_schedule_end(end)
    finally:
        manager.shutdown()
    return {"p50": pct(total, 0.5), "p99": pct(total, 0.99), "sched": statistics.median(sched)}


def vllm_part(args: argparse.Namespace) -> int:
    out = {}
    for n in [int(s) for s in args.sizes.split(",")]:
        out[str(n)] = {
            "connector": connector_lookup(args.url, n, args.rounds, args.round_limit_s),
            "tier": tier_lookup(args.url, n, args.rounds, args.round_limit_s),
        }
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------- the whole run (.venv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="lookups per size and path")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--workers", type=int, default=2, help="server workers")
    ap.add_argument("--lmcache-threads", type=int, default=4)
    ap.add_argument("--round-limit-s", type=float, default=10.0, help="one lookup's bound")
    ap.add_argument("--vllm-part", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_part:
        return vllm_part(args)
    if not VLLM_PY.exists():
        print("needs .venv-vllm (scripts/setup-vllm)", file=sys.stderr)
        return 77
    from bench_lmcache import MiB, egkv_server, egkv_spec, run_bench

    sizes = [int(s) for s in args.sizes.split(",")]
    lmcache: dict[int, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="eg-kv-bench-") as tmp,
        egkv_server(args.workers, 256 * MiB, Path(tmp)) as url,
    ):
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(ROOT)}
        env.pop("EPISTEMIC_GRAPH_KVCACHE_TOKEN", None)
        part = subprocess.run(
            [str(VLLM_PY), __file__, "--vllm-part", "--url", url, "--sizes", args.sizes,
             "--rounds", str(args.rounds), "--round-limit-s", str(args.round_limit_s)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        lines = [ln for ln in part.stdout.splitlines() if ln.startswith("RESULT ")]
        if part.returncode != 0 or not lines:
            print((part.stdout + part.stderr)[-4000:], file=sys.stderr)
            return 1
        ours = json.loads(lines[-1][7:])
        bench_args = argparse.Namespace(
            num_keys=16, in_flight=1, warmup_rounds=20, lookup_max_hit_rate=0.0,
            lookup_rounds=args.rounds,
        )  # fmt: skip
        for n in sizes:
            sec = run_bench(egkv_spec(url, args.lmcache_threads, local_reads=False), bench_args,
                            Path(tmp) / f"lmcache-{n}.json", lookup_only=True, num_keys=n,
                            lookup_rounds=args.rounds)["Lookup"]  # fmt: skip
            lmcache[n] = {
                "p50": sec["duration_p50_ms"] * 1000,
                "p99": sec["duration_p99_ms"] * 1000,
            }
    print(f"Lookup latency per scheduler step, µs: one eg-kv server ({args.workers} workers), "
          f"{args.rounds} lookups per size and path, fresh addresses (misses), HTTP (no "
          f"local reads); connector/tier: time to the answer, sched: the scheduler "
          f"thread's share")  # fmt: skip
    print("| blocks | connector p50 | p99 | sched | tier p50 | p99 | sched | LMCache L2 p50 "
          "| p99 | connector / LMCache | tier / LMCache |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        c, t, lm = ours[str(n)]["connector"], ours[str(n)]["tier"], lmcache[n]
        print(f"| {n} | {c['p50']:.0f} | {c['p99']:.0f} | {c['sched']:.0f} | {t['p50']:.0f} "
              f"| {t['p99']:.0f} | {t['sched']:.0f} | {lm['p50']:.0f} | {lm['p99']:.0f} "
              f"| {c['p50'] / lm['p50']:.2f} | {t['p50'] / lm['p50']:.2f} |")  # fmt: skip
    for n in sizes:
        first = ours[str(n)]["connector"]["first"]
        print(f"connector, {n} blocks: answered in the first call {first:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
