#!/usr/bin/env python3
"""CPU time a client spends per batch lookup on the server's host, for several source trees.

An A/B that holds on a busy machine (process CPU time, not wall time): for each tree, a
fresh one-worker server on loopback, 32 blocks stored, then ``--calls`` lookups of a
32-address batch (half present) through

* the sync client's ``try_exists_addresses`` (answered from the slab, read-only: local
  reads), and
* the LMCache L2 adapter's ``submit_batch_exists`` + ``drain_completions`` (the path
  LMCache's lookups take, answered inline for one server),

each in a child process of its own with the tree first on ``sys.path``. Rounds rotate the
trees; medians are printed with the ratio to the first tree::

    python scripts/bench_lookup_cpu.py --tree before=/tmp/old --tree after=.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

#: The child: one tree, one server, both lookup paths timed.
CHILD = r"""
import json, sys, time
tree, url, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
from eg_kv.kvcache import RemoteKVConnector, RemoteKVL2Connector, to_address

def timed(fn):
    for _ in range(300):
        fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6

with RemoteKVConnector(base_url=url) as kv:
    addresses = [to_address(f"bench-lookup-{i}") for i in range(64)]
    for a in addresses[:32]:
        assert kv.put(a, b"x" * 1000)
    batch = addresses[16:48]
    client_us = timed(lambda: kv.try_exists_addresses(batch))
l2 = RemoteKVL2Connector(base_url=url)
keys = [f"bench@1@0@{i:x}@bfloat16" for i in range(16, 48)]

def l2_lookup():
    l2.submit_batch_exists(keys)
    while not l2.drain_completions():
        pass

l2_us = timed(l2_lookup)
l2.close()
print(json.dumps({"client": client_us, "l2": l2_us}))
"""


def serve(tree: Path, port: int) -> subprocess.Popen:
    """A one-worker server from ``tree`` on loopback; returns once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
         "--workers", "1", "--capacity", "256MiB", "--fresh",
         "--slab-name", f"/eg-kv-bench-lookup-cpu-{port}"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"bench_lookup_cpu: the server from {tree} did not start")


def one_run(tree: Path, port: int, calls: int) -> dict[str, float]:
    proc = serve(tree, port)
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(tree), f"http://127.0.0.1:{port}", str(calls)],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
        )  # fmt: skip
        if out.returncode:
            raise SystemExit(f"bench_lookup_cpu: {tree}: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="LABEL=PATH",
        help="a source tree (repeat: two or more; ratios are to the first)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree (3)")
    parser.add_argument("--calls", type=int, default=20_000, help="lookups per run (20,000)")
    parser.add_argument("--port", type=int, default=19470)
    args = parser.parse_args()  # fmt: skip
    trees = [(label, Path(path).resolve()) for label, _, path in
             (t.partition("=") for t in args.tree)]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for r in range(args.rounds):
        order = trees[r % len(trees) :] + trees[: r % len(trees)]  # rotate who goes first
        for label, tree in order:
            got = one_run(tree, args.port, args.calls)
            runs[label].append(got)
            print(f"{label}: client {got['client']:.1f} µs, l2 {got['l2']:.1f} µs CPU/lookup")
    first = trees[0][0]
    base = {k: statistics.median(r[k] for r in runs[first]) for k in ("client", "l2")}
    print(f"\n32-address lookups, CPU µs per lookup, median of {args.rounds} runs")
    print("| tree | client (local reads) | ratio | L2 adapter | ratio |\n|---|---|---|---|---|")
    for label, _ in trees:
        med = {k: statistics.median(r[k] for r in runs[label]) for k in ("client", "l2")}
        print(f"| {label} | {med['client']:.1f} | {med['client'] / base['client']:.2f} "
              f"| {med['l2']:.1f} | {med['l2'] / base['l2']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
