#!/usr/bin/env python3
"""Lookups that answered "hit" but whose load missed, with leases and without (issue 24).

A slab smaller than the working set, two writer processes putting distinct blocks, and a
reader that does what a scheduler does: store its blocks, look them up (one batch), then
load every hit. Between the lookup and the loads, both writers put a burst of new blocks
(each a slab's worth of pages), so eviction pressure lands exactly where a lease matters:
without a lease the hits are evicted before they load; with one (``exists_many(...,
lease_ms=...)`` and ``get(..., release_lease=True)``) they must all load. Both modes run
in the same run, on the same server, alternating round by round::

    python scripts/bench_leases.py                  # starts its own server
    python scripts/bench_leases.py --url http://127.0.0.1:9130 --json

With ``--url``, the token comes from ``$EPISTEMIC_GRAPH_KVCACHE_TOKEN`` (as ``eg-kv stats``
takes it), never from the command line.

It also times what a lease costs a lookup (``--latency-calls``, 0 to skip): the median of
batch lookups of 16 and 256 addresses, plain (answered from the slab on the server's host),
plain over HTTP, leased (a lookup that finds a hit asks the server, which takes the
lock), and the release.

The server (own or given) needs leases on (``--lease-ms`` above 0) and a slab of about
``--capacity`` (the bursts are sized from the server's stats). Every process started here
is stopped by pid, and its own server's slab unlinked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eg_kv.client.settings import KvCacheConfig  # noqa: E402
from eg_kv.client.sync import ServerConnector  # noqa: E402

#: Each writer: put ``burst`` new blocks of ``size`` bytes per line read, then say "done".
WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from eg_kv.client.sync import ServerConnector
from eg_kv.client.settings import KvCacheConfig
url, wid, size = sys.argv[2], sys.argv[3], int(sys.argv[4])
body = bytes([int(wid)]) * size
with ServerConnector(KvCacheConfig.from_env(base_url=url, local_reads=False)) as kv:
    print("ready", flush=True)
    for line in sys.stdin:
        rnd, burst = line.split()
        stored = sum(kv.put(f"w{wid}-{rnd}-{k}", body) for k in range(int(burst)))
        print(f"done {stored}", flush=True)
"""

#: The most a round's writers may take (a burst is a few ms a block on a busy host).
ROUND_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(url + "/healthz", timeout=2) as r,
        ):
            if json.loads(r.read()).get("status") == "ok":
                return
        time.sleep(0.1)
    raise SystemExit(f"the server at {url} was not healthy within {timeout_s:.0f} s")


def _line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next line a writer says, by ``deadline``."""
    assert proc.stdout is not None
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
        raise SystemExit(f"writer {proc.pid} did not answer in time")
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"writer {proc.pid} exited ({proc.poll()})")
    return line.strip()


def run(url: str, rounds: int, blocks: int, size: int, lease_ms: int) -> dict[str, dict[str, int]]:
    """Alternate leased and lease-less rounds; per mode, lookups' hits and missed loads."""
    config = KvCacheConfig.from_env(base_url=url)
    writers: list[subprocess.Popen[str]] = []
    out = {mode: {"rounds": 0, "hits": 0, "missed": 0} for mode in ("leases", "no_leases")}
    with ServerConnector(config) as kv:
        stats = kv.stats().extra
        pages = int(stats["capacity_bytes"]) // int(stats["page_size"])
        burst = pages  # each writer: a slab's worth of pages, every round
        try:
            for wid in (1, 2):
                writers.append(
                    subprocess.Popen(
                        [sys.executable, "-c", WRITER, str(ROOT), url, str(wid), str(size)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            start = time.monotonic() + ROUND_TIMEOUT_S
            for w in writers:
                assert _line(w, start) == "ready"
            for rnd in range(2 * rounds):
                mode = "leases" if rnd % 2 == 0 else "no_leases"
                lease = lease_ms if mode == "leases" else None
                keys = [f"reader-{rnd}-{k}" for k in range(blocks)]
                for k in keys:
                    if not kv.put(k, bytes(size)):
                        raise SystemExit(f"the reader's put of {k} was refused")
                found = kv.exists_many(keys, lease_ms=lease)
                hits = [k for k, hit in zip(keys, found, strict=True) if hit]
                deadline = time.monotonic() + ROUND_TIMEOUT_S
                for w in writers:  # the burst, between the lookup and the loads
                    assert w.stdin is not None
                    w.stdin.write(f"{rnd} {burst}\n")
                    w.stdin.flush()
                for w in writers:
                    _line(w, deadline)
                missed = sum(kv.get(k, release_lease=lease is not None) is None for k in hits)
                out[mode]["rounds"] += 1
                out[mode]["hits"] += len(hits)
                out[mode]["missed"] += missed
            after = kv.stats().extra
            out["leases"]["taken"] = int(after.get("leases_taken", 0))
            out["leases"]["released"] = int(after.get("leases_released", 0))
        finally:
            for w in writers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
                w.wait(10)
                for f in (w.stdin, w.stdout):
                    if f is not None:
                        with contextlib.suppress(OSError):
                            f.close()
    return out


def latency(url: str, calls: int) -> dict[str, dict[str, float]]:
    """Median µs of a batch lookup of 16 and 256 addresses (all hits): plain local,
    plain over HTTP, leased, and the release of a leased batch."""
    out: dict[str, dict[str, float]] = {}
    local = ServerConnector(KvCacheConfig.from_env(base_url=url))
    remote = ServerConnector(KvCacheConfig.from_env(base_url=url, local_reads=False))
    try:
        keys = [f"lat-{k}" for k in range(256)]
        for k in keys:
            local.put(k, b"x" * 100)
        for n in (16, 256):
            batch = keys[:n]

            def timed(fn: object, batch: list[str] = batch) -> float:
                times = []
                for _ in range(calls):
                    t = time.perf_counter()
                    fn(batch)  # type: ignore[operator]
                    times.append(time.perf_counter() - t)
                return round(statistics.median(times) * 1e6, 1)

            if not all(local.exists_many(batch)):  # maps the slab, and checks the batch
                raise SystemExit(f"latency: {n} addresses are not all held (a slab too small?)")
            out[str(n)] = {
                "plain_local_us": timed(local.exists_many),
                "plain_http_us": timed(remote.exists_many),
                "leased_us": timed(lambda b: local.exists_many(b, lease_ms=5000)),
                "release_us": timed(local.release),
            }
    finally:
        local.close()
        remote.close()
    return out


@contextlib.contextmanager
def _server(url: str | None, capacity: str, role: str) -> Iterator[str]:
    """``url`` when given, else a server of its own (2 workers, 64 KiB pages, ``capacity``)
    for the block, stopped by pid after it."""
    if url is not None:
        yield url
        return
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
         "--workers", "2", "--capacity", capacity, "--page-size", "64KiB",
         "--slab-name", f"/eg-kv-bench-leases-{role}-{os.getpid()}", "--fresh"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def main() -> int:
    """Parse the flags, run both modes (starting a server unless ``--url``), print."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (leases on; its token from "
                   "$EPISTEMIC_GRAPH_KVCACHE_TOKEN); default: start one")  # fmt: skip
    p.add_argument("--rounds", type=int, default=20, help="rounds per mode (default 20)")
    p.add_argument("--blocks", type=int, default=8, help="blocks the reader looks up a round")
    p.add_argument("--size", type=int, default=64 * 1024, help="block size in bytes")
    p.add_argument("--capacity", default="2MiB", help="its own server's slab (default 2MiB)")
    p.add_argument("--lease-ms", type=int, default=5000, help="the lease asked (default 5000)")
    p.add_argument(
        "--latency-calls", type=int, default=300, help="lookups timed per kind (0: none)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    with _server(args.url, args.capacity, "pressure") as url:
        start = time.monotonic()
        out: dict[str, object] = dict(run(url, args.rounds, args.blocks, args.size, args.lease_ms))
        seconds = time.monotonic() - start
    if args.latency_calls > 0:
        # A slab that holds every timed block (the pressure run's evicts them: its
        # lookups would be misses, answered locally, leased or not).
        with _server(args.url, "64MiB", "latency") as url:
            out["latency"] = latency(url, args.latency_calls)
    if args.json:
        print(json.dumps({**out, "seconds": round(seconds, 1)}))
        return 0
    for mode, label in (("leases", "with leases   "), ("no_leases", "without leases")):
        one: Any = out[mode]
        print(
            f"{label}: {one['rounds']} rounds, {one['hits']} lookups answered hit, "
            f"{one['missed']} of their loads missed"
        )
    print(f"({seconds:.1f} s; two writers put a slab's worth each between lookup and load)")
    lat: Any = out.get("latency")
    if lat:
        print("\nbatch lookup, median µs   plain (local)   plain (HTTP)   leased   release")
        for n, row in lat.items():
            print(
                f"{n:>4} addresses            {row['plain_local_us']:>13}   "
                f"{row['plain_http_us']:>12}   {row['leased_us']:>6}   {row['release_us']:>7}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
