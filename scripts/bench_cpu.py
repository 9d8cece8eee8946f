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

With ``--instructions N`` each server runs under valgrind's callgrind instead, and the
figure is the worker's instructions per request over N sequential requests: it does not
move with the machine's load (a run repeats to 0.02%), so one round tells apart changes
too small for the clock; it is blind to cache misses, so confirm with the clock.

With ``--tenants 1000`` the last tree also runs with a tokens file of 1,000 tenants (every
other run sends one token from the environment): tenants' cost against today's server.

Every server listens on a free loopback port and is stopped by pid; every slab is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eg_kv.slab.store import Slab  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_server import free_port, tokens_file  # noqa: E402

BLOCK = 4096
#: Requests sent before counting instructions (caches filled, code paths warm).
WARMUP = 500
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


@contextlib.contextmanager
def serving(
    tree: Path, tenants: int = 0, want_token: bool = True, wrapper: list[str] | None = None
) -> Iterator[tuple[str, dict[str, str], psutil.Process]]:
    """A one-worker server from ``tree`` on a free loopback port, with a 4 KiB block at
    ``/kv/blk``: yields (its URL, the client's headers, the worker's process).

    ``tenants``: serve with a tokens file of that many tenants (0: one token in the
    environment) and send one tenant's token. ``want_token`` False: no token at all.
    ``wrapper``: a command the server runs under (valgrind). The server is stopped by its
    pid and its slab removed on exit.
    """
    port = free_port()
    name = f"/eg-kv-bench-cpu-{os.getpid()}-{port}"
    cmd = [*(wrapper or []), sys.executable, "-m", "workers", "serve",
           "--addr", f"127.0.0.1:{port}", "--workers", "1", "--capacity", "256MiB",
           "--slab-name", name]  # fmt: skip
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
    tmp = tempfile.TemporaryDirectory()
    headers = {}
    if tenants:
        path, token = tokens_file(tenants, tmp.name)
        cmd += ["--tokens", path]
        headers["Authorization"] = f"Bearer {token}"
    elif want_token:
        env["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = token = "cpu-single-token"
        headers["Authorization"] = f"Bearer {token}"
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + (300 if wrapper else 30)
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the server from {tree} did not start") from None
                time.sleep(0.05)
        put = urllib.request.Request(
            url + "/kv/blk", data=os.urandom(BLOCK), method="PUT", headers=headers
        )
        urllib.request.urlopen(put, timeout=60).read()
        (worker,) = psutil.Process(proc.pid).children()
        yield url, headers, worker
    finally:
        tmp.cleanup()
        proc.terminate()
        try:
            proc.wait(120 if wrapper else 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        Slab.unlink_named(name)


def measure(
    tree: Path,
    op: str,
    seconds: float,
    lua: dict[str, str],
    tenants: int = 0,
    want_token: bool = True,
) -> tuple[float, float]:
    """(µs of worker CPU per request, requests per second) for ``op`` on a fresh server,
    driven by ``wrk`` (8 connections) for ``seconds`` (see :func:`serving`)."""
    with serving(tree, tenants, want_token) as (url, headers, worker):
        before = sum(worker.cpu_times()[:2])
        args = ["wrk", "-t1", "-c8", f"-d{seconds:g}s", url + "/kv/blk"]
        for k, v in headers.items():
            args[1:1] = ["-H", f"{k}: {v}"]
        if op in lua:
            args += ["-s", lua[op]]
        out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 30).stdout
        cpu = sum(worker.cpu_times()[:2]) - before
        n = int(re.search(r"(\d+) requests in", out).group(1))
        return cpu / n * 1e6, n / seconds


def _send(url: str, headers: dict[str, str], op: str, n: int) -> None:
    """``n`` requests of ``op``, one after another on one keep-alive connection."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = b"x" * BLOCK
    try:
        for k in range(n):
            if op == "GET":
                conn.request("GET", "/kv/blk", headers=headers)
            else:
                path = "/kv/blk" if op == "PUT" else f"/kv/n{k}"
                conn.request("PUT", path, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status not in (200, 201):
                raise RuntimeError(f"{op} answered {resp.status}")
    finally:
        conn.close()


def instructions(tree: Path, op: str, n: int, tenants: int = 0, want_token: bool = True) -> float:
    """Instructions the worker executes per request of ``op`` (valgrind's callgrind).

    Two servers under callgrind, one given ``n`` more requests than the other (after the
    same warm-up): the difference in the worker's instruction count, divided by ``n``.
    Deterministic (PYTHONHASHSEED is fixed) and blind to what else the machine runs, so
    it tells changes of a few tenths of a percent apart; it does not see cache misses.
    """
    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for extra in (0, n):
            out = os.path.join(tmp, f"callgrind.{extra}.%p")
            wrapper = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
            with serving(tree, tenants, want_token, wrapper) as (url, headers, worker):
                _send(url, headers, op, WARMUP)
                _send(url, headers, op, extra)
                pid = worker.pid
            text = Path(out.replace("%p", str(pid))).read_text()
            counts.append(int(re.search(r"^totals: (\d+)", text, re.M).group(1)))
    return (counts[1] - counts[0]) / n


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
    ap.add_argument(
        "--instructions",
        type=int,
        default=0,
        metavar="N",
        help="count the worker's instructions per request under valgrind's callgrind over "
        "N sequential requests instead of timing wrk (deterministic: one round is enough; "
        "apt-get install valgrind)",
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
                    if args.instructions:
                        x = instructions(tree, op, args.instructions, tenants, not args.no_token)
                        print(f"{label:>8} {op}: {x:,.0f} instructions/request", flush=True)
                    else:
                        x, rps = measure(tree, op, args.seconds, lua, tenants, not args.no_token)
                        print(f"{label:>8} {op}: {x:5.1f} µs CPU/request, {rps:,.0f} req/s",
                              flush=True)  # fmt: skip
                    results.setdefault((label, op), []).append(x)
    unit = "instructions" if args.instructions else "µs CPU"
    first = {op: statistics.median(results[(runs[0][0], op)]) for op in ops}
    for (label, op), xs in results.items():
        m = statistics.median(xs)
        print(f"{label:>8} {op}: median {m:,.2f} {unit}/request over {len(xs)} runs "
              f"({m / first[op]:.3f} of {runs[0][0]}): "
              f"{', '.join(f'{x:,.1f}' for x in xs)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
