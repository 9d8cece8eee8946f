#!/usr/bin/env python3
"""The worst loop stall of a worker serving the event log's heaviest requests at a million
blocks (issue 31).

One ``eg-kv serve`` worker over a slab of 1,048,576 one-byte blocks (4 GiB of 4 KiB pages:
the block count of a 64 GiB slab of 64 KiB pages) and a full 65,536-entry event log. A
prober asks the worker's ``/healthz`` every 20 ms; its wait is how long the worker's event
loop was held. Each cell runs a load and reports the prober's worst and p99 wait, and the
growth of the worker's private memory (RSS less shared pages: the slab's pages a walk
touches are shared, mapped by every process)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_events.py

Cells: idle; snapshots of every block, one after another (streamed: seconds each, the
answer's bytes); the heaviest log reads (10,000 events from 16,384 back) from 8 threads;
and a burst of 300 of them on connections closed at once. Every load is bounded in count
and time; the server is stopped by pid and its slab unlinked.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eg_kv.slab.store import Slab  # noqa: E402

#: The log reads' query: the most events one answer carries, as far back as the log keeps.
HEAVY_READ = "/kv/events?since={since}&limit=10000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


#: The prober: asks ``/healthz`` every 20 ms until its stdin closes, then prints each wait
#: (in a process of its own: the loads' client threads must not hold its GIL).
PROBE = r"""
import sys, threading, time, urllib.request
stop, waits = threading.Event(), []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.wait(0.02) and len(waits) < 1_000_000:
    t0 = time.monotonic()
    urllib.request.urlopen(sys.argv[1] + "/healthz", timeout=60).read()
    waits.append(time.monotonic() - t0)
print(" ".join(f"{w:.6f}" for w in waits))
"""


class Prober:
    """The prober process, and the worker's private memory sampled every 20 ms here."""

    def __init__(self, url: str, worker: psutil.Process) -> None:
        self.worker = worker
        self.waits: list[float] = []
        self.rss: list[int] = []
        self._proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02) and len(self.rss) < 1_000_000:
            info = self.worker.memory_info()
            self.rss.append(info.rss - info.shared)  # its own: the slab's pages are shared

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        out, _ = self._proc.communicate("", timeout=120)
        self.waits = [float(w) for w in out.split()]


def cell(url: str, worker: psutil.Process, load: Callable[[], str]) -> dict[str, str]:
    """Run ``load`` under the prober; its figures and what ``load`` says of itself."""
    info = worker.memory_info()
    base = info.rss - info.shared
    prober = Prober(url, worker)
    time.sleep(0.2)
    try:
        note = load()
    finally:
        prober.stop()
    waits = sorted(prober.waits)
    return {
        "worst": f"{waits[-1] * 1000:.0f}",
        "p99": f"{waits[int(0.99 * (len(waits) - 1))] * 1000:.0f}",
        "rss": f"{(max(prober.rss) - base) / 2**20:+.0f}",
        "note": note,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--snapshots", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="the reads' cell")
    args = ap.parse_args()
    port, name = free_port(), f"/eg-kv-bench-events-{os.getpid()}"
    capacity = max(args.blocks, 1 << 16) * 4096
    cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
           "--workers", "1", "--capacity", str(capacity), "--page-size", "4KiB",
           "--slab-name", name, "--lock-timeout", "5"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                get(url + "/healthz", 2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.1)
        with Slab.attach(name) as slab:
            t0 = time.monotonic()
            for i in range(args.blocks):
                slab.put(f"b{i}", b"v")
            print(f"stored {args.blocks:,} blocks in {time.monotonic() - t0:.0f} s", flush=True)
            head = slab.events.head
        (worker,) = psutil.Process(proc.pid).children()
        rows = []

        def idle() -> str:
            time.sleep(2)
            return ""

        def snapshots() -> str:
            took, size = [], 0
            for _ in range(args.snapshots):
                t0 = time.monotonic()
                size = len(get(url + "/kv/events/snapshot", 600))
                took.append(time.monotonic() - t0)
            return f"{statistics.median(took):.1f} s each, {size / 2**20:.0f} MiB streamed"

        target = HEAVY_READ.format(since=head - 16384)

        def reads() -> str:
            count, busy, end = [0], [0], time.monotonic() + args.seconds

            def one() -> None:
                while time.monotonic() < end and count[0] + busy[0] < 100_000:
                    try:
                        get(url + target)
                        count[0] += 1
                    except urllib.error.HTTPError as e:  # 503: the worker's reads cap
                        if e.code != 503:
                            raise
                        busy[0] += 1

            threads = [threading.Thread(target=one) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            return (
                f"{count[0] / args.seconds:.0f} reads/s of 10,000 events, "
                f"{busy[0] / args.seconds:.0f}/s answered 503 (the reads cap)"
            )

        def burst() -> str:
            raw = f"GET {target} HTTP/1.1\r\nHost: b\r\n\r\n".encode()
            for _ in range(300):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    s.sendall(raw)
            time.sleep(2)
            return "300 sent, each closed at once"

        for label, load in (("idle", idle), (f"snapshot of {args.blocks:,} blocks", snapshots),
                            ("heaviest log reads, 8 threads", reads),
                            ("300 heaviest reads, connections closed", burst)):  # fmt: skip
            rows.append((label, cell(url, worker, load)))
        alive = worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        kept = "kept" if alive else "REPLACED"
        print(
            f"\n`scripts/bench_events.py`: one worker, {args.blocks:,} one-byte blocks of 4 KiB "
            f"pages, a 65,536-entry log; /healthz every 20 ms (the worker: {kept})\n"
        )
        print("| load | worst /healthz wait (ms) | p99 (ms) | worker private memory (MiB) | |")
        print("|---|---:|---:|---:|---|")
        for label, r in rows:
            print(f"| {label} | {r['worst']} | {r['p99']} | {r['rss']} | {r['note']} |")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        Slab.unlink_named(name)


if __name__ == "__main__":
    main()
