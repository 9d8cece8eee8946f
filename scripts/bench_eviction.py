"""Eviction: hit rates of cache workloads on a real slab, and the cost of an evicting put.

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_eviction.py \
        --baseline .cache/bench-trees/REV                    # about a minute

Each side runs in a process of its own with its tree's ``eg_kv`` first on the path: this
checkout, and with ``--baseline DIR`` another source tree (``git archive REV`` unpacked),
so a change to the CLOCK policy is compared with the one before it on the same
workloads. A pure-Python LRU of the same capacity runs beside them, for reference.

The slab holds 1,024 blocks of 4 KiB (one page each). Workloads, deterministic (seeded):

- ``conversations N``: N conversations at a time, each turn of one (picked at random)
  looks up every block of its conversation so far (a hit is read, a miss stored again)
  and stores 2 new ones; a conversation ends after 12 turns. Blocks come back soon after
  they are stored: recency.
- ``prefixes s``: requests whose 4-block prefix is drawn from 4,000 by a Zipf law of
  exponent s (looked up, read on a hit, stored on a miss), and 2 blocks of their own each,
  never asked again. Popular blocks must outlive one-off ones: frequency.
- ``newest stored``: 8,192 blocks stored one after the other, none read: the share of
  the newest tenth and half of the slab's capacity still held at the end.

Hit rates count after a warm-up (the first 3,000 turns or 5,000 requests). The evicting
put: 4 KiB puts into a full slab of 4,096 blocks, a read of every fourth shortly after
its put, best of 5 rounds of 20,000, in µs per put.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = 4096
BLOCKS = 1024
#: (name, workload, its argument)
WORKLOADS = [
    ("conversations 60", "conversations", 60),
    ("conversations 120", "conversations", 120),
    ("prefixes s=0.9", "prefixes", 0.9),
    ("prefixes s=0.6", "prefixes", 0.6),
]


class Lru:
    """The reference: exact LRU over as many blocks as the slab holds."""

    def __init__(self, blocks: int) -> None:
        self.blocks, self.held = blocks, OrderedDict()

    def get(self, address: str) -> bytes | None:
        if address not in self.held:
            return None
        self.held.move_to_end(address)
        return b""

    def put(self, address: str, data: bytes) -> None:
        self.held[address] = True
        self.held.move_to_end(address)
        while len(self.held) > self.blocks:
            self.held.popitem(last=False)

    def exists(self, address: str) -> bool:
        return address in self.held


def _look(store, address: str, data: bytes) -> bool:
    """A lookup of ``address``: a hit is read, a miss stored (as an engine would)."""
    if store.get(address) is not None:
        return True
    store.put(address, data)
    return False


def conversations(store, active: int) -> float:
    """The hit rate of ``active`` interleaved conversations (see the module docstring)."""
    rng, data = random.Random(11), b"x" * PAGE
    convs: dict[int, int] = {}
    started = hits = looks = 0
    for step in range(25_000):
        if len(convs) < active:
            convs[started] = 0
            started += 1
        c = rng.choice(list(convs))
        turn = convs[c]
        for b in range(2 * turn):
            hit = _look(store, f"c{c}-{b}", data)
            if step > 3_000:
                looks, hits = looks + 1, hits + hit
        for b in range(2 * turn, 2 * turn + 2):
            store.put(f"c{c}-{b}", data)
        convs[c] = turn + 1
        if turn + 1 >= 12:
            del convs[c]
    return hits / looks


def prefixes(store, s: float) -> float:
    """The hit rate of Zipf-drawn prefixes among one-off blocks (the module docstring)."""
    rng, data = random.Random(7), b"x" * PAGE
    cum, total = [], 0.0
    for k in range(4_000):
        total += 1 / (k + 1) ** s
        cum.append(total)
    hits = looks = 0
    for r in range(30_000):
        doc = bisect.bisect(cum, rng.random() * total)
        for b in range(4):
            hit = _look(store, f"d{doc}-{b}", data)
            if r > 5_000:
                looks, hits = looks + 1, hits + hit
        for u in range(2):
            store.put(f"u{r}-{u}", data)
    return hits / looks


def newest_stored(store) -> dict[str, float]:
    """The share of the newest tenth and half of capacity still held after 8x capacity."""
    data, n = b"x" * PAGE, 8 * BLOCKS
    for k in range(n):
        store.put(f"n{k}", data)
    out = {}
    for frac in (0.1, 0.5):
        last = int(BLOCKS * frac)
        out[f"newest {frac:.0%}"] = sum(store.exists(f"n{k}") for k in range(n - last, n)) / last
    return out


def evicting_put_us() -> float:
    """µs per 4 KiB put into a full slab (a read of every fourth), best of 5 rounds."""
    from eg_kv.slab.store import Slab

    blocks, data = 4 * BLOCKS, b"x" * PAGE
    slab = Slab.create(f"/eg-kv-bench-evict-{os.getpid()}", blocks * PAGE, PAGE, PAGE)
    try:
        for k in range(blocks):
            slab.put(f"w{k}", data)
        best = float("inf")
        for rep in range(5):
            t0 = time.perf_counter()
            for k in range(20_000):
                slab.put(f"p{rep}-{k}", data)
                if k % 4 == 0:
                    slab.get(f"p{rep}-{k - 2}")
            best = min(best, time.perf_counter() - t0)
        return best / 20_000 * 1e6
    finally:
        slab.close()
        slab.unlink()


def with_store(run: Callable, lru: bool):
    """``run(store)`` on a fresh slab of :data:`BLOCKS` blocks (or the LRU), removed after."""
    if lru:
        return run(Lru(BLOCKS))
    from eg_kv.slab.store import Slab

    slab = Slab.create(f"/eg-kv-bench-evict-{os.getpid()}", BLOCKS * PAGE, PAGE, PAGE,
                       prefault=False)  # fmt: skip
    try:
        return run(slab)
    finally:
        slab.close()
        slab.unlink()


def side(lru: bool) -> dict:
    """Every figure of one side (run in its own process)."""
    out: dict[str, float] = {}
    for name, kind, arg in WORKLOADS:
        work = conversations if kind == "conversations" else prefixes
        out[name] = with_store(lambda store, w=work, a=arg: w(store, a), lru)
    out.update(with_store(newest_stored, lru))
    if not lru:
        out["evicting put (µs)"] = evicting_put_us()
    return out


def run_side(tree: Path | None) -> dict:
    """One side in a process of its own: ``tree``'s eg_kv, or the LRU (None)."""
    env = {**os.environ, "PYTHONPATH": str(tree or ROOT)}
    cmd = [sys.executable, __file__, "--side", "lru" if tree is None else "slab"]
    out = subprocess.run(cmd, env=env, cwd=tree or ROOT, capture_output=True, text=True,
                         timeout=600, check=True)  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", metavar="DIR", help="also measure this source tree's eg-kv")
    p.add_argument("--side", choices=["slab", "lru"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        print(json.dumps(side(args.side == "lru")))
        return 0
    sides = {"eg-kv": run_side(ROOT)}
    if args.baseline:
        sides["baseline"] = run_side(Path(args.baseline).resolve())
    sides["LRU"] = run_side(None)
    names = list(sides)
    print("| figure | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for row in sides["eg-kv"]:
        cells = [sides[n].get(row) for n in names]
        shown = ["" if c is None else f"{c:.2f}" if "µs" in row else f"{c:.3f}" for c in cells]
        print(f"| {row} | " + " | ".join(shown) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
