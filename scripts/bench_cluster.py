#!/usr/bin/env python3
"""Benchmark a server set (issue 14): placement overhead, split lookups, spread, a lost host.

Starts 3 real servers on loopback (1 worker each) and measures:

1. a set of one against the direct client (a plain URL *is* the direct client; the cluster
   layer forced over one member shows what placement would cost);
2. 16-, 256- and 1,024-key lookups (``exists_many``) over 3 members, against one server;
3. placement spread and moved-on-add over 10,000 addresses (computation only);
4. the hit rate over time while one member is SIGKILLed and restarted with ``--keep``.

Run it alone: ``flock /tmp/eg-kv-bench.lock python scripts/bench_cluster.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from eg_kv.client.connectors import RemoteKVConnector  # noqa: E402
from eg_kv.client.placement import Placement  # noqa: E402
from eg_kv.client.sets import ClusterConnector  # noqa: E402
from eg_kv.client.settings import KvCacheConfig  # noqa: E402
from eg_kv.slab.store import Slab  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int | None = None, slab: str | None = None) -> None:
        self.port = port or free_port()
        self.slab = slab or f"/eg-kv-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{self.port}",
               "--workers", "1", "--capacity", "128MiB", "--slab-name", self.slab,
               "--keep"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                urllib.request.urlopen(f"{self.url}/healthz", timeout=1)
                return
            time.sleep(0.05)
        raise RuntimeError(f"server on {self.port} did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        pids = [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def us(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e6:8.1f} us (p99 {xs[int(len(xs) * 0.99)] * 1e6:8.1f})"


def overhead(servers: list[Server], n: int) -> None:
    print("\n## 1. A set of one against the direct client")
    direct = RemoteKVConnector(base_url=servers[0].url)
    one = RemoteKVConnector(base_url=servers[0].url)  # a plain URL: the direct client again
    # The cluster layer over one member, forced (a plain URL never builds it).
    forced = ClusterConnector(KvCacheConfig(base_url=servers[0].url))
    block = os.urandom(4096)
    keys = [f"ovh{i:05d}" for i in range(16)]
    for k in keys:
        direct.put(k, block)
    print(f"{'client':<34} {'GET 4 KiB':>30} {'exists_many 16':>30}")
    clients = {"direct": direct, "set of one (plain URL)": one,
               "cluster layer, one member": forced}  # fmt: skip
    for c in clients.values():
        for _ in range(200):  # warm: connections, caches
            c.get(keys[0])
    gets: dict[str, list[float]] = {name: [] for name in clients}
    looks: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(10):  # interleaved rounds: a loaded machine slows each client alike
        for name, c in clients.items():
            gets[name] += timed(lambda c=c: c.get(keys[0]), n // 10)
            looks[name] += timed(lambda c=c: c.exists_many(keys), n // 10)
    rows = {}
    for name in clients:
        rows[name] = (statistics.median(gets[name]), statistics.median(looks[name]))
        print(f"{name:<34} {us(gets[name]):>30} {us(looks[name]):>30}")
    base = rows["direct"]
    for name, (g, b) in rows.items():
        print(f"  {name}: GET {100 * (g / base[0] - 1):+.1f}%, "
              f"exists_many {100 * (b / base[1] - 1):+.1f}%")  # fmt: skip
    for c in (direct, one, forced):
        c.close()


def lookups(servers: list[Server], n: int) -> None:
    print("\n## 2. Lookups over 3 members (exists_many; half the keys present)")
    single = RemoteKVConnector(base_url=servers[0].url)
    cluster = RemoteKVConnector(base_url=",".join(s.url for s in servers))
    for size in (16, 256, 1024):
        keys = [f"look{size}-{i:05d}" for i in range(size)]
        for k in keys[::2]:
            single.put(k, b"v")
            cluster.put(k, b"v")
        one = timed(lambda k=keys: single.exists_many(k), n)
        three = timed(lambda k=keys: cluster.exists_many(k), n)
        print(f"{size:5d} keys: one server {us(one)}, 3 members {us(three)}")
    single.close()
    cluster.close()


def spread() -> None:
    print("\n## 3. Placement over 10,000 addresses")
    addrs = [f"{i:064x}" for i in range(10_000)]
    three = Placement({"a:1": 1, "b:1": 1, "c:1": 1})
    four = Placement({"a:1": 1, "b:1": 1, "c:1": 1, "d:1": 1})
    before = [three.home(a) for a in addrs]
    after = [four.home(a) for a in addrs]
    shares = {m: before.count(m) / len(addrs) for m in three.members}
    moved = sum(x != y for x, y in zip(before, after, strict=True))
    between_old = sum(x != y and y != "d:1" for x, y in zip(before, after, strict=True))
    print("equal weights: " + ", ".join(f"{m} {s:.1%}" for m, s in shares.items()))
    print(f"adding a 4th: {moved / len(addrs):.1%} moved, {between_old} between old members")
    weighted = Placement({"big:1": 2, "small:1": 1})
    big = sum(weighted.home(a) == "big:1" for a in addrs) / len(addrs)
    print(f"weights 2:1: {big:.1%} on the larger")
    t = time.perf_counter()
    for a in addrs:
        three.home(a)
    print(f"home() over 3 members: {(time.perf_counter() - t) / len(addrs) * 1e6:.2f} us/address")


def lost_host(servers: list[Server], seconds: float) -> None:
    print("\n## 4. Hit rate while one of 3 members is SIGKILLed, then restarted with --keep")
    kv = RemoteKVConnector(base_url=",".join(s.url for s in servers), timeout_s=2)
    keys = [f"loss{i:05d}" for i in range(3000)]
    for k in keys:
        kv.put(k, b"w" * 256)
    victim = servers[0]
    kill_at, restart_at = seconds * 0.2, seconds * 0.55
    start = time.monotonic()
    killed = restarted = False
    print(f"{'t (s)':>6} {'event':<10} {'hit rate':>9} {'lookup ms':>10} {'down':>5}")
    while (now := time.monotonic() - start) < seconds:
        event = ""
        if not killed and now >= kill_at:
            victim.kill()
            killed, event = True, "SIGKILL"
        elif killed and not restarted and now >= restart_at:
            servers[0] = Server(victim.port, victim.slab)
            restarted, event = True, "restart"
        t = time.perf_counter()
        found = kv.exists_many(keys)
        ms = (time.perf_counter() - t) * 1e3
        print(f"{now:6.2f} {event:<10} {sum(found) / len(found):9.1%} {ms:10.2f} "
              f"{len(kv.router.down()):5d}")  # fmt: skip
        time.sleep(0.25)
    kv.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="requests per measurement")
    p.add_argument("--seconds", type=float, default=8.0, help="length of the loss timeline")
    args = p.parse_args()
    servers = [Server() for _ in range(3)]
    try:
        overhead(servers, args.n)
        lookups(servers, max(args.n // 10, 50))
        spread()
        lost_host(servers, args.seconds)
    finally:
        for s in servers:
            s.stop()
            with contextlib.suppress(Exception):
                Slab.unlink_named(s.slab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
