#!/usr/bin/env python3
"""In-process slab throughput and memory efficiency, side by side in one run.

Measures put (new block), put (dedup hit), get and exists for 4 KiB and 14 MiB blocks, in
one process and in two processes at once (aggregate rate), then fills a slab of the
default geometry with 14 MiB blocks and reports block bytes resident / data area.

Every loop is bounded by a count and a time limit. The segment is unlinked at the end.

    .venv/bin/python scripts/bench_slab.py            # prints a Markdown table
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time

from eg_kv.config import DEFAULT_CAPACITY, DEFAULT_MAX_BLOCK_SIZE, DEFAULT_PAGE_SIZE, MiB
from eg_kv.slab.store import Slab

SEED = 1234
SIZES = {"4 KiB": 4096, "14 MiB": 14 * MiB}
OPS = ("put new", "put dedup", "get", "exists")


def run_ops(
    name: str, size: int, op: str, tag: str, count: int, seconds: float
) -> tuple[int, float]:
    """Run up to ``count`` operations for at most ``seconds``; return (ops done, elapsed)."""
    slab = Slab.attach(name, prefault=True)  # steady state: a long-lived worker's view
    body = random.Random(SEED).randbytes(size)
    n, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    try:
        while n < count and time.perf_counter() < deadline:
            if op == "put new":
                slab.put(f"{tag}-{n}", body)
            elif op == "put dedup":
                slab.put(f"{tag}-hot", body)
            elif op == "get":
                slab.get(f"{tag}-hot")
            else:
                slab.exists(f"{tag}-hot")
            n += 1
        return n, time.perf_counter() - t0
    finally:
        slab.close()


def _worker(args, out) -> None:
    out.put(run_ops(*args))


def measure(name: str, size: int, op: str, procs: int, count: int, seconds: float) -> float:
    """Aggregate operations per second over ``procs`` processes running ``op`` at once."""
    slab = Slab.attach(name)
    body = random.Random(SEED).randbytes(size)
    for p in range(procs):  # the block the dedup/get/exists loops hit
        slab.put(f"p{p}-{size}-hot", body)
    slab.close()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=((name, size, op, f"p{p}-{size}", count, seconds), out))
        for p in range(procs)
    ]
    for w in workers:
        w.start()
    results = [out.get(timeout=seconds + 60) for _ in workers]
    for w in workers:
        w.join(30)
    return sum(n / elapsed for n, elapsed in results)


def efficiency(name: str) -> tuple[float, float, int]:
    """Fill a default-geometry slab with 14 MiB blocks; return (resident/data, resident/segment)."""
    slab = Slab.create(name, DEFAULT_CAPACITY, DEFAULT_PAGE_SIZE, DEFAULT_MAX_BLOCK_SIZE)
    try:
        body = random.Random(SEED).randbytes(14 * MiB)
        i = 0
        while slab.stats()["evictions"] == 0 and i < 10_000:
            slab.put(f"fill-{i}", body)
            i += 1
        st = slab.stats()
        return (
            st["resident_bytes"] / st["capacity_bytes"],
            st["resident_bytes"] / slab.geometry.total_size,
            st["unique_blocks"],
        )
    finally:
        slab.close()
        Slab.unlink_named(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="time limit per measurement")
    ap.add_argument("--count", type=int, default=200_000, help="op limit per process")
    args = ap.parse_args()
    name = f"/eg-kv-bench-slab-{os.getpid()}"
    slab = Slab.create(name, 1024 * MiB, DEFAULT_PAGE_SIZE, 64 * MiB)
    slab.close()
    rows = []
    try:
        for label, size in SIZES.items():
            for op in OPS:
                one = measure(name, size, op, 1, args.count, args.seconds)
                two = measure(name, size, op, 2, args.count, args.seconds)
                rows.append((label, op, one, two))
    finally:
        Slab.unlink_named(name)
    eff_data, eff_total, blocks = efficiency(f"{name}-eff")
    cores = os.cpu_count()
    print(f"slab ops/s ({cores} cores, {args.seconds}s per cell, seed {SEED})\n")
    print("| block | op | 1 process | 2 processes | 2p / 1p | MB/s (1p) |")
    print("|---|---|---:|---:|---:|---:|")
    for label, op, one, two in rows:
        mbs = "" if op in ("exists", "put dedup") else f"{one * SIZES[label] / 1e6:,.0f}"
        print(f"| {label} | {op} | {one:,.0f} | {two:,.0f} | {two / one:.2f} | {mbs} |")
    print(
        f"\nmemory efficiency, 14 MiB blocks, default geometry (1 GiB, 64 KiB pages): "
        f"{blocks} blocks, resident / data area = {eff_data:.2%}, "
        f"resident / whole segment = {eff_total:.2%}"
    )


if __name__ == "__main__":
    main()
