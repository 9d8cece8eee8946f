#!/usr/bin/env python3
"""How long a big slab takes to start serving, against the floor: ``fallocate`` of the same
size on the same ``/dev/shm``, side by side in one run.

Per size (default 8 GiB), interleaved ``--rounds`` times:

* ``fallocate -l SIZE`` of a file in ``/dev/shm`` (the allocation any slab needs), removed
  at once;
* ``eg-kv serve --capacity SIZE --workers 2`` from its start until ``/healthz`` says every
  worker serves, then stopped by pid (its slab unlinked);

and prints each time and their ratio (the goal: at most 1.5)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_start.py --size 8GiB

Needs ``SIZE`` free in ``/dev/shm`` (checked first).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eg_kv.config import parse_size  # noqa: E402
from eg_kv.slab.store import Slab  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fallocate_s(size: int) -> float:
    path = f"/dev/shm/eg-kv-bench-fallocate-{os.getpid()}"
    t0 = time.monotonic()
    try:
        subprocess.run(["fallocate", "-l", str(size), path], check=True)
        return time.monotonic() - t0
    finally:
        os.unlink(path)


def serve_s(size_text: str, workers: int) -> float:
    port, name = free_port(), f"/eg-kv-bench-start-{os.getpid()}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
         "--capacity", size_text, "--workers", str(workers), "--slab-name", name, "--fresh"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = t0 + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    if json.loads(r.read()).get("workers_up") == workers:
                        return time.monotonic() - t0
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"eg-kv serve exited with {proc.returncode}")
            time.sleep(0.02)
        raise SystemExit("eg-kv serve did not come up in 600 s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        Slab.unlink_named(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    size = parse_size(args.size)
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < size * 1.1:
        raise SystemExit(f"/dev/shm has less than {args.size} free")
    rows = []
    for r in range(args.rounds):
        floor, start = fallocate_s(size), serve_s(args.size, args.workers)
        rows.append((floor, start))
        print(f"round {r + 1}: fallocate {floor:.2f} s, eg-kv serve to healthy {start:.2f} s "
              f"({start / floor:.2f}x)", flush=True)  # fmt: skip
    med = statistics.median
    print(f"\n| size | fallocate | eg-kv serve, {args.workers} workers, to healthy | ratio |")
    print("|---|---|---|---|")
    print(f"| {args.size} | {med(f for f, _ in rows):.2f} s | {med(s for _, s in rows):.2f} s | "
          f"{med(s / f for f, s in rows):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
