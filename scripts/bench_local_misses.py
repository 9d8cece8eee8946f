#!/usr/bin/env python3
"""Local lookups of addresses no tier holds, against a server with a disk tier: this
checkout against ``--baseline TREE``, interleaved in one run.

A client on the server's host reads the slab itself (``local_reads``, the LMCache
adapter's default there); with ``--disk`` on the server, a local miss may be the disk's.
Each run starts a one-worker server from the tree (a 64 MiB slab, a 256 MiB disk tier in
a new directory under /var/tmp), waits for the tier's scan, and times ``--repeat`` x
``--batches`` lookups of 64 addresses through that tree's own
``RemoteKVConnector(local_reads=True)``: of addresses no tier holds, ``exists_many``
without a lease, then with one (2 s); and of 64 blocks the slab holds, a leasing
``exists_many`` and the ``release`` of its leases (LMCache's lookup when a prefix is
stored). Prints the median µs a lookup per tree and side, and the ratio. E.g.::

    git archive d603d90 | tar -x -C .cache/bench-trees/d603d90
    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_local_misses.py \\
        --baseline .cache/bench-trees/d603d90

Every server listens on a free loopback port and is stopped by pid; every slab and disk
directory is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_server import free_port, stop  # noqa: E402

KEYS = 64
LEASE_MS = 2000


def child(tree: Path, batches: int, repeat: int) -> dict[str, float]:
    """In a process of its own: ``tree``'s server and client; µs a lookup (medians)."""
    sys.path.insert(0, str(tree))
    import eg_kv
    from eg_kv.kvcache import RemoteKVConnector
    from eg_kv.slab.store import Slab

    if not Path(eg_kv.__file__).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"eg_kv came from {eg_kv.__file__}, not from {tree}")

    port, name = free_port(), f"/eg-kv-bench-misses-{os.getpid()}"
    disk = tempfile.mkdtemp(prefix="eg-kv-bench-misses-", dir="/var/tmp")
    cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
           "--workers", "1", "--capacity", "64MiB", "--slab-name", name, "--fresh",
           "--disk", disk, "--disk-capacity", "256MiB"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # up, and the disk tier's scan done
            try:
                with urllib.request.urlopen(url + "/kv/stats", timeout=2) as r:
                    if json.loads(r.read()).get("disk", {}).get("ready"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the server from {tree} did not start")
            time.sleep(0.05)
        out = {}
        with RemoteKVConnector(base_url=url, local_reads=True) as kv:
            absent = [f"absent-{i}" for i in range(KEYS)]
            held = [f"held-{i}" for i in range(KEYS)]
            for key in held:
                kv.put(key, b"x" * 4096)
            sides = (("lookup, none held", absent, 0),
                     ("leasing lookup, none held", absent, LEASE_MS),
                     ("leasing lookup and release, all held", held, LEASE_MS))  # fmt: skip
            for side, keys, lease in sides:
                want = [keys is held] * KEYS
                runs = []
                for r in range(repeat + 1):  # the first: maps the slab, untimed
                    t0 = time.perf_counter()
                    for _ in range(batches):
                        if kv.exists_many(keys, lease_ms=lease) != want:
                            raise RuntimeError(f"{side}: a wrong answer")
                        if keys is held:
                            kv.release(keys)
                    if r:
                        runs.append((time.perf_counter() - t0) / batches * 1e6)
                out[side] = statistics.median(runs)
        return out
    finally:
        stop(proc)
        Slab.unlink_named(name)
        shutil.rmtree(disk, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, metavar="TREE",
                    help="a source tree (git archive REV | tar -x -C TREE)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs per tree")
    ap.add_argument("--batches", type=int, default=200, help="lookups per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per run (median kept)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batches, args.repeat)))
        return 0
    if args.baseline is None:
        ap.error("--baseline TREE is required")
    trees = {"eg-kv": ROOT, "baseline": args.baseline.resolve()}
    got: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for label in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(trees[label]), "--batches",
                 str(args.batches), "--repeat", str(args.repeat)],
                capture_output=True, text=True, timeout=600, check=True,
            ).stdout  # fmt: skip
            got[label].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  run {r + 1} {label:>8}: {got[label][-1]}", file=sys.stderr, flush=True)
    print(f"64 addresses a lookup, local reads, a server with a disk tier (µs, medians of "
          f"{args.rounds} runs); baseline {args.baseline}")  # fmt: skip
    print("| lookup | eg-kv | baseline | eg-kv / baseline |\n|---|---:|---:|---:|")
    for side in got["eg-kv"][0]:
        a = statistics.median(run[side] for run in got["eg-kv"])
        b = statistics.median(run[side] for run in got["baseline"])
        print(f"| {side} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
