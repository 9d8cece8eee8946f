"""One vLLM scheduler-side offloading stack with EgKvTier, driven step by step: run by
tests/vllm/test_tier.py with a vLLM venv's Python (vLLM is not in the test venv).

``tier_proc.py PLAN`` runs a JSON list of steps (``{"scenario": "load", "url": URL,
"options": {...}, "keys": N, "seed": S, ...}``) in one process (vLLM's import costs
seconds). Each step builds vLLM's own ``TieringOffloadingSpec`` from an
``OffloadingConfig`` (a CPU primary tier of ``slots`` slots of ``row_kib`` KiB, and
``secondary_tiers`` naming EgKvTier by module path, as an engine's
``kv_connector_extra_config`` would), gets its real ``TieringOffloadingManager`` and
plays a scheduler against it:

* ``store``: one request stores ``keys`` chunks (deterministic bytes per key) to the
  primary tier; the manager cascades them to the tier; steps until the store jobs end;
  with ``remove``, another client then deletes that many and the tier's KV events must
  report them removed (from the server's event log);
* ``load``: one request looks its keys up step by step (RETRY while the tier's batch is
  in flight, HIT_PENDING while a promotion copies) until every key is a HIT or MISS,
  then compares each HIT's primary slot with the bytes ``store`` wrote;
* ``peek``: the tier alone looks the keys up, then the request finishes unloaded;
* ``forge``: PUTs a block of the right length but the wrong bytes at each key's address
  (a lying server or writer), for ``load`` to refuse;
* ``drain``: submits one load whose copy a slow server drips, calls ``reset_cache``
  (which calls ``drain_jobs``) and checks the slot no longer changes after it returned;
* ``cut``: one load a slow server drips past ``load_deadline_s``: how it ended, how long
  the answer took, and the slots vLLM (0.34) held back until the copy ended.

Prints one JSON line per step (``RESULT {...}``) with what it saw: timings, answers, the tier's
counters. Every loop is bounded in steps and seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from eg_kv.client.connectors import connect
from eg_kv.client.settings import KvCacheConfig


def build(args: argparse.Namespace, events: bool = False):
    """The real TieringOffloadingManager with EgKvTier loaded by module path."""
    row = args.row_kib * 1024
    tier = {"type": "EgKvTier", "module_path": "eg_kv.vllm.tier", "url": args.url}
    tier.update(json.loads(args.options))
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0", "model.layers.1"), 0),),
        worker_kv_bytes_per_block=row,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": row * args.slots, "secondary_tiers": [tier]},
        engine_id=f"eg-kv-tier-test-{os.getpid()}-{args.scenario}",
        model=OffloadingModelConfig(name="eg-kv/tier-test", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )  # fmt: skip
    manager = Locked(TieringOffloadingSpec(cfg).get_manager())
    return manager, manager.secondary_tiers[0], row


class Locked:
    """The manager as vLLM's scheduler uses it: each call under ``manager.lock`` (vLLM
    0.34's poll thread services the tier between calls, under the same lock; 0.32 has
    none). A generator's items are taken under it too; ``shutdown`` is not locked (it
    joins the poll thread, which takes the lock)."""

    def __init__(self, manager) -> None:
        self.inner = manager
        self.lock = getattr(manager, "lock", None) or contextlib.nullcontext()

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "shutdown":
            return attr

        def call(*args, **kwargs):
            with self.lock:
                out = attr(*args, **kwargs)
                return list(out) if inspect.isgenerator(out) else out

        return call


def keys_of(args: argparse.Namespace) -> list[bytes]:
    return [
        make_offload_key(hashlib.sha256(f"{args.seed}/{i}".encode()).digest(), 0)
        for i in range(args.keys)
    ]


def content(key: bytes, row: int) -> bytes:
    """The bytes ``store`` writes for ``key`` (any process computes the same)."""
    return hashlib.shake_256(key).digest(row)


def end_step(manager, new: list[str] = ()) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))


def store(args: argparse.Namespace) -> dict:
    manager, tier, row = build(args, events=True)
    view = manager.primary_tier.get_kv_memoryview()
    flat = view.cast("B")
    keys = keys_of(args)
    ctx = ReqContext(req_id=f"store-{args.seed}")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        flat[int(slot) * row : (int(slot) + 1) * row] = content(key, row)
    t0 = time.monotonic()
    manager.complete_store(keys, ctx)  # cascades to EgKvTier: PUTs from the slots
    end_step(manager, [ctx.req_id])
    steps = 0
    # vLLM 0.34's manager leaves out of has_pending_work what its poll thread finishes (the
    # tier opts in): the tier's own says whether a store job is still unreported.
    while (manager.has_pending_work() or tier.has_pending_work()) and (
        time.monotonic() - t0 < 30 and steps < 10_000
    ):
        time.sleep(0.005)
        end_step(manager)  # polls the finished jobs, as each scheduler step does
        steps += 1
    events = [(len(e.keys), e.removed, e.medium.value) for e in manager.take_events()
              if e.ownership == tier.tier_type]  # fmt: skip
    removed: list[bytes] = []
    if args.remove:
        # Another client deletes some blocks: the server's log says so, the tier relays it.
        client = connect(KvCacheConfig.from_env({}, base_url=args.url, timeout_s=5.0))
        for key in keys[: args.remove]:
            assert client.delete(tier.address(key))
        client.close()
        t1 = time.monotonic()
        while len(removed) < args.remove and time.monotonic() - t1 < 15:
            for e in manager.take_events():
                if e.removed and e.ownership == tier.tier_type:
                    removed.extend(e.keys)
            time.sleep(0.02)
    same = sorted(removed) == sorted(keys[: args.remove])
    manager.on_request_finished(ctx)
    flat.release()
    pending = manager.has_pending_work() or tier.has_pending_work()
    result = {"stats": tier.stats(), "pending": pending, "events": events,
              "removed": len(removed), "removed_match": same,
              "seconds": time.monotonic() - t0, "format": tier.describe()}  # fmt: skip
    manager.shutdown()
    return result


def load(args: argparse.Namespace) -> dict:
    manager, tier, row = build(args)
    keys = keys_of(args)
    ctx = ReqContext(req_id=f"load-{args.seed}")
    manager.on_new_request(ctx)
    answers: dict[bytes, LookupResult] = {}
    history: list[list[str]] = []
    longest = 0.0
    t0 = time.monotonic()
    steps = 0
    while time.monotonic() - t0 < args.budget_s and steps < 20_000:
        todo = [k for k in keys if answers.get(k) not in (LookupResult.HIT, LookupResult.MISS)]
        if not todo:
            break
        s = time.monotonic()
        step = [manager.lookup(k, ctx) for k in todo]
        end_step(manager, [ctx.req_id] if steps == 0 else [])
        longest = max(longest, time.monotonic() - s)
        for k, a in zip(todo, step, strict=True):
            answers[k] = a
        history.append(sorted({a.name for a in step}))
        steps += 1
        time.sleep(0.002)
    hits = [k for k in keys if answers.get(k) is LookupResult.HIT]
    equal = wrong = 0
    if hits:
        spec = manager.prepare_load(hits, ctx)
        flat = manager.primary_tier.get_kv_memoryview().cast("B")
        for key, slot in zip(hits, spec.chunk_ids, strict=True):
            got = bytes(flat[int(slot) * row : (int(slot) + 1) * row])
            if got == content(key, row):
                equal += 1
            else:
                wrong += 1
        manager.complete_load(hits, ctx)
        flat.release()
    manager.on_request_finished(ctx)
    end_step(manager)
    result = {
        "answers": {a.name: sum(1 for v in answers.values() if v is a) for a in LookupResult},
        "unanswered": len(keys) - len(answers),
        "hits": len(hits), "equal": equal, "wrong": wrong, "steps": steps,
        "first_steps": history[:4], "longest_step_s": longest,
        "seconds": time.monotonic() - t0,
    }  # fmt: skip
    t1 = time.monotonic()
    manager.shutdown()
    result["shutdown_s"] = time.monotonic() - t1
    result["stats"] = tier.stats()  # after shutdown: the lease releases have ended
    return result


def peek(args: argparse.Namespace) -> dict:
    """The tier alone: look the keys up until answered, then finish the request without
    loading them (the tier releases the leases its hits took)."""
    manager, tier, _ = build(args)
    ctx = ReqContext(req_id=f"peek-{args.seed}")
    answers: list[LookupResult] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.budget_s:
        with manager.lock:  # the tier alone, called as the manager would call it
            answers = [tier.lookup(k, ctx) for k in keys_of(args)]
            tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
        if LookupResult.RETRY not in answers:
            break
        time.sleep(0.002)
    with manager.lock:
        tier.on_request_finished(ctx)
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
    manager.shutdown()
    return {"hits": answers.count(LookupResult.HIT), "stats": tier.stats()}


def forge(args: argparse.Namespace) -> dict:
    """PUT right-length, wrong bytes at each key's address (before anything is stored)."""
    manager, tier, row = build(args)
    client = connect(KvCacheConfig.from_env({}, base_url=args.url, timeout_s=5.0))
    stored = 0
    for key in keys_of(args):
        address = tier.address(key)
        body = bytes(b ^ 0xFF for b in content(key, row)) + b"\0" * 16
        stored += client.put(address, body)
    client.close()
    manager.shutdown()
    return {"forged": stored}


def drain(args: argparse.Namespace) -> dict:
    """One load copy dripped by a slow server; reset_cache (drain_jobs) must outlast it."""
    manager, tier, row = build(args)
    (key,) = keys_of(args)[:1]
    flat = manager.primary_tier.get_kv_memoryview().cast("B")
    ctx = ReqContext(req_id="drain")
    manager.on_new_request(ctx)
    slots = []
    original = tier._copies.submit

    def spy(job_id, is_load, addresses, rows):
        slots.extend(int(r) for r in rows)
        return original(job_id, is_load, addresses, rows)

    tier._copies.submit = spy
    t0 = time.monotonic()
    answer = LookupResult.RETRY
    while answer is LookupResult.RETRY and time.monotonic() - t0 < 10:
        answer = manager.lookup(key, ctx)
        end_step(manager)  # flush: the lookup batch; after a HIT: submit_load
        time.sleep(0.005)
    for _ in range(200):  # the copy has begun writing the slot
        if slots and any(flat[slots[0] * row : slots[0] * row + 4096]):
            break
        time.sleep(0.01)
    began = time.monotonic()
    running = tier._copies.running
    manager.reset_cache()  # drain_jobs, then the primary tier is reset
    drained = time.monotonic()
    snap = bytes(flat[slots[0] * row : (slots[0] + 1) * row]) if slots else b""
    time.sleep(args.after_s)
    later = bytes(flat[slots[0] * row : (slots[0] + 1) * row]) if slots else b""
    manager.on_request_finished(ctx)
    flat.release()
    result = {
        "first_answer": answer.name, "slots": slots, "running_before": running,
        "drain_s": drained - began, "changed_after": snap != later,
        "written": sum(1 for b in snap if b), "stats": tier.stats(),
    }  # fmt: skip
    manager.shutdown()
    return result


def cut(args: argparse.Namespace) -> dict:
    """A load of ``keys`` blocks a slow server drips, with a short ``load_deadline_s``:
    vLLM 0.34 has it failed at the deadline (the keys MISS), their slots held back until
    the copies end and handed back after; older vLLM waits for the copies (HITs)."""
    import vllm

    from eg_kv.vllm.tier import DEFERS_RELEASE

    manager, tier, _ = build(args)
    keys = keys_of(args)
    primary = manager.primary_tier
    pollers: set[str] = set()  # the threads that asked the tier for finished jobs
    finished = tier.get_finished_jobs

    def spy():
        pollers.add(threading.current_thread().name)
        return finished()

    tier.get_finished_jobs = spy

    def held() -> int:  # the slots vLLM holds back for a deferred release (0.34's property)
        return int(getattr(primary, "num_deferred_release_chunks", 0))

    ctx = ReqContext(req_id="cut")
    manager.on_new_request(ctx)
    t0 = time.monotonic()
    waiting = (LookupResult.RETRY, LookupResult.HIT_PENDING)
    answers, pending_at, most_held = [LookupResult.RETRY] * len(keys), None, 0
    while any(a in waiting for a in answers) and time.monotonic() - t0 < 30:
        answers = [
            manager.lookup(k, ctx) if a in waiting else a
            for k, a in zip(keys, answers, strict=True)
        ]
        if LookupResult.HIT_PENDING in answers and pending_at is None:
            pending_at = time.monotonic()
        end_step(manager)
        most_held = max(most_held, held())
        time.sleep(0.01)
    final_s = time.monotonic() - (pending_at or t0)
    running_at_answer = tier._copies.running
    for _ in range(3000):  # the slow server finishes the bodies: the copies end
        if not tier._copies.running:
            break
        most_held = max(most_held, held())
        time.sleep(0.01)
    end_step(manager)  # the step's poll hands the held slot back
    result = {
        "vllm": vllm.__version__, "defers": DEFERS_RELEASE,
        "answers": sorted({a.name for a in answers}),
        "final_s": final_s, "running_at_answer": running_at_answer,
        "most_held": most_held, "held_after": held(), "stats": tier.stats(),
        "pollers": sorted(pollers),
    }  # fmt: skip
    manager.on_request_finished(ctx)
    end_step(manager)
    manager.shutdown()
    return result


DEFAULTS = {"options": "{}", "keys": 8, "seed": "s", "row_kib": 96, "slots": 64,
            "budget_s": 20.0, "after_s": 0.5, "remove": 0}  # fmt: skip
SCENARIOS = {"store": store, "load": load, "forge": forge, "drain": drain, "peek": peek, "cut": cut}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "plan",
        help='a JSON list of steps run in order, each {"scenario": ..., "url": ...} and any '
        f"of {sorted(DEFAULTS)} (options: a dict of the tier entry's further keys)",
    )
    for i, step in enumerate(json.loads(ap.parse_args().plan)):
        opts = {**DEFAULTS, **step}
        if not isinstance(opts["options"], str):
            opts["options"] = json.dumps(opts["options"])
        args = argparse.Namespace(**opts)
        args.scenario = f"{step['scenario']}{i}"
        result = SCENARIOS[step["scenario"]](args)
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
