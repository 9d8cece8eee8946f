#!/usr/bin/env python3
"""CPU time one worker spends per request, for several source trees: an A/B that holds on a
busy machine.

Throughput on a machine shared with other work swings by a quarter between runs (the
bare-aiohttp column of scripts/bench_server.py included); the worker's own CPU time per
request moves by a few percent. Each round starts a one-worker server from every tree in
turn (the order alternates between rounds), drives it with ``wrk`` (8 connections, one
thread) for ``--seconds``, and divides the worker's user+system CPU time by the requests
served. Prints each run and the median per tree and op, e.g.::

    git archive HEAD~3 | tar -x -C /tmp/old
    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_cpu.py \\
        --tree old=/tmp/old --tree new=. --op GET --op PUT --rounds 6

With ``--tenants 1000`` the last tree also runs with a tokens file of 1,000 tenants (every
other run sends one token from the environment): tenants' cost against today's server.

Every server listens on a free loopback port and is stopped by pid; every slab is removed.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eg_kv.slab import Slab  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_server import free_port, tokens_file  # noqa: E402

BLOCK = 4096
PUT_SCRIPT = f'wrk.method = "PUT"\nwrk.body = string.rep("x", {BLOCK})\n'
#: New addresses on every request: a 256 MiB slab fills and then every PUT evicts.
PUTNEW_SCRIPT = f"""
counter = 0
function init(args) body = string.rep("x", {BLOCK}) end
request = function()
  counter = counter + 1
  return wrk.format("PUT", "/kv/n" .. counter, nil, body)
end
"""


def measure(
    tree: Path,
    op: str,
    seconds: float,
    lua: dict[str, str],
    tenants: int = 0,
    want_token: bool = True,
) -> tuple[float, float]:
    """(µs of worker CPU per request, requests per second) for ``op`` on a fresh server.

    ``tenants``: serve with a tokens file of that many tenants (0: one token in the
    environment) and send one tenant's token. ``want_token`` False: no token at all.
    """
    port = free_port()
    name = f"/eg-kv-bench-cpu-{os.getpid()}-{port}"
    cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
           "--workers", "1", "--capacity", "256MiB", "--slab-name", name]  # fmt: skip
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    tmp = tempfile.TemporaryDirectory()
    if tenants:
        path, token = tokens_file(tenants, tmp.name)
        cmd += ["--tokens", path]
    else:
        token = "cpu-single-token"
        if want_token:
            env["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = token
    auth = {"Authorization": f"Bearer {token}"}
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the server from {tree} did not start") from None
                time.sleep(0.05)
        put = urllib.request.Request(
            url + "/kv/blk", data=os.urandom(BLOCK), method="PUT", headers=auth
        )
        urllib.request.urlopen(put, timeout=5).read()
        (worker,) = psutil.Process(proc.pid).children()
        before = sum(worker.cpu_times()[:2])
        args = ["wrk", "-t1", "-c8", f"-d{seconds:g}s", "-H",
                f"Authorization: Bearer {token}", url + "/kv/blk"]  # fmt: skip
        if op in lua:
            args += ["-s", lua[op]]
        out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 30).stdout
        cpu = sum(worker.cpu_times()[:2]) - before
        n = int(re.search(r"(\d+) requests in", out).group(1))
        return cpu / n * 1e6, n / seconds
    finally:
        tmp.cleanup()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        Slab.unlink_named(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="LABEL=PATH",
        help="a source tree to run the server from (repeat: two or more)",
    )
    ap.add_argument(
        "--op",
        action="append",
        choices=("GET", "PUT", "PUTNEW"),
        help="4 KiB GETs (a hit), PUTs (a dedup hit) or PUTNEW (new blocks: once the slab "
        "is full, every one evicts); default GET",
    )
    ap.add_argument(
        "--tenants",
        type=int,
        default=0,
        metavar="N",
        help="also run the last --tree (the one under test) with a tokens file of N tenants "
        "(label +tN); every other run has one token in the environment",
    )
    ap.add_argument(
        "--no-token",
        action="store_true",
        help="serve and send no token (the runs without --tenants)",
    )
    ap.add_argument("--rounds", type=int, default=6, help="runs per tree and op (6)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per run (3)")
    args = ap.parse_args()
    trees = [(label, Path(path).resolve()) for label, _, path in
             (t.partition("=") for t in args.tree)]  # fmt: skip
    ops = args.op or ["GET"]
    results: dict[tuple[str, str], list[float]] = {}
    runs = [(label, tree, 0) for label, tree in trees]
    if args.tenants:
        label, tree = trees[-1]
        runs.append((f"{label}+t{args.tenants}", tree, args.tenants))
    with tempfile.TemporaryDirectory() as scripts:
        lua = {}
        for op, text in (("PUT", PUT_SCRIPT), ("PUTNEW", PUTNEW_SCRIPT)):
            lua[op] = os.path.join(scripts, f"{op}.lua")
            Path(lua[op]).write_text(text)
        for r in range(args.rounds):
            for label, tree, tenants in runs if r % 2 == 0 else runs[::-1]:
                for op in ops:
                    us, rps = measure(tree, op, args.seconds, lua, tenants, not args.no_token)
                    results.setdefault((label, op), []).append(us)
                    print(
                        f"{label:>8} {op}: {us:5.1f} µs CPU/request, {rps:,.0f} req/s", flush=True
                    )
    for (label, op), runs in results.items():
        print(f"{label:>8} {op}: median {statistics.median(runs):.2f} µs CPU/request over "
              f"{len(runs)} runs: {', '.join(f'{x:.1f}' for x in runs)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
