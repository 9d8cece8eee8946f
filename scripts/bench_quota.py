#!/usr/bin/env python3
"""What a quota costs a put: a small namespace evicting its own blocks from a big table.

A namespace over its quota evicts its own blocks by CLOCK over its own slots only. The
worst case is a namespace with few blocks in a table full of another's: its sweep must
skip every foreign slot. This fills a slab with one namespace's 4 KiB blocks, then times
4 KiB puts of a second namespace whose quota holds ``--small-blocks`` blocks (every put
then evicts one of its own), against puts of a namespace without a quota.

Every loop is bounded by a count and a time limit; the segment is unlinked at the end.

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_quota.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024


def timed_puts(slab: Slab, ns: int, tag: str, count: int, seconds: float) -> float:
    """Microseconds per 4 KiB put (new addresses) in namespace ``ns``."""
    body = os.urandom(4 * KiB)
    n, t0 = 0, time.perf_counter()
    while n < count and time.perf_counter() - t0 < seconds:
        slab.put(f"{tag}-{n}", body, ns)
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity-mib", type=int, default=512)
    ap.add_argument("--small-blocks", type=int, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--count", type=int, default=3000, help="puts per measurement")
    ap.add_argument("--seconds", type=float, default=10.0, help="time limit per measurement")
    args = ap.parse_args()
    name = f"/eg-kv-bench-quota-{os.getpid()}"
    slab = Slab.create(name, args.capacity_mib * MiB, page_size=4 * KiB)
    try:
        quotas = {"big": 0, "free": 0}
        quotas.update({f"small{k}": k * 4 * KiB for k in args.small_blocks})
        ids = slab.bind_namespaces(quotas)
        fill = slab.geometry.npages * 3 // 4
        body = os.urandom(4 * KiB)
        for k in range(fill):
            slab.put(f"big-{k}", body, ids["big"])
        print(f"slab: {args.capacity_mib} MiB of 4 KiB pages, {slab.geometry.nslots:,} slots, "
              f"{fill:,} blocks of namespace big\n")  # fmt: skip
        print("| namespace | quota (blocks) | us per 4 KiB put | evictions |")
        print("|---|---:|---:|---:|")
        us = timed_puts(slab, ids["free"], "free", min(args.count, fill // 8), args.seconds)
        print(f"| free | none | {us:.1f} | 0 |")
        for k in args.small_blocks:
            ns = ids[f"small{k}"]
            timed_puts(slab, ns, f"warm{k}", k, args.seconds)  # fill to the quota
            us = timed_puts(slab, ns, f"s{k}", args.count, args.seconds)
            ev = slab.namespace_stats(ns)[f"small{k}"]["evictions"]
            print(f"| small{k} | {k} | {us:.1f} | {ev} |")
        assert slab.check() == []
    finally:
        slab.close()
        Slab.unlink_named(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
