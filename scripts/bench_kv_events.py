#!/usr/bin/env python3
"""What the KV-events publisher costs a PUT churn, and whether a subscriber loses any.

Side by side in one run, interleaved: a 2-worker server under a churn of unique 4 KiB
PUTs (a 16 MiB slab of 4 KiB pages: after the first 4,096 blocks every store evicts one,
so the log gets a store and a removal per PUT), once without a publisher,
``--kv-events-endpoint`` and no subscriber, and once with a subscriber (a process of its
own at nice 10, standing in for a router on another host: it checks ``seq`` has no hole
and counts the events)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_kv_events.py

Prints, per round and as medians: the PUT rate without and with the publisher, the
ratios of the rate with a subscriber to the rate with no publisher and to the rate with a
publisher but no subscriber (the issue's "within 5% of no subscriber"), the events the
publisher sent a second, the events the log holds for the run, what the subscriber
received, and the holes it saw. The loaders are processes that PUT on keep-alive
connections (as many on each worker) for ``--seconds`` each; every server is stopped
by pid and its slab unlinked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BODY = b"e" * 4096

#: The subscriber: counts messages, their events and holes in seq until its stdin closes and the
#: stream has been quiet for 1 s, then prints them as JSON.
SUBSCRIBE = r"""
import json, os, sys, threading, zmq, zmq.backend
os.nice(10)  # a stand-in for a router on another host: the CPU the server leaves
recv = zmq.backend.Socket.recv
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.RCVHWM, 0)
sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(sys.argv[1])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
got = holes = events = 0; last = None
print("ready", flush=True)
while True:
    if not sub.poll(1000):
        if done.is_set():
            break
        continue
    recv(sub); seq = int.from_bytes(recv(sub), "big"); payload = recv(sub)
    events += payload.count(b"BlockStored") + payload.count(b"BlockRemoved")  # a batch
    if last is not None and seq > last + 1:
        holes += 1
    last = seq if last is None else max(last, seq); got += 1
print(json.dumps({"messages": got, "events": events, "holes": holes}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_answer(s: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """One HTTP answer from ``s`` (``buf``: what was read past the last): its head and
    what follows its body."""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, buf = buf.split(b"\r\n\r\n", 1)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(buf) < length:
        buf += s.recv(65536)
    return head, buf[length:]


def balanced(port: int, conns: int, workers: int) -> list[socket.socket]:
    """``conns`` keep-alive connections, as many on each worker (its pid is in every
    answer's ``X-EgKv-Worker``): SO_REUSEPORT spreads connections at random, and two
    loaded connections on one worker and none on the other halve the rate, which made
    the ratio swing by 15% from run to run."""
    on: dict[bytes, list[socket.socket]] = {}
    for _ in range(conns * 50):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n")
        head, _ = read_answer(s, b"")
        pid = head.lower().split(b"x-egkv-worker: ")[1].split(b"\r\n")[0]
        if len(on.setdefault(pid, [])) < conns // workers:
            on[pid].append(s)
        else:
            s.close()
        if sum(map(len, on.values())) == conns:
            break
    return [s for group in on.values() for s in group]


def load(
    port: int, tag: str, seconds: float, workers: int, out: multiprocessing.Queue,
    conns: int = 4,
) -> None:  # fmt: skip
    """PUT unique 4 KiB blocks for ``seconds`` on ``conns`` keep-alive connections spread
    evenly over the workers, one PUT in flight on each."""
    socks = balanced(port, conns, workers)
    bufs = [b""] * len(socks)
    head = "PUT /kv/{} HTTP/1.1\r\nHost: b\r\nContent-Length: 4096\r\n\r\n"
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for k, s in enumerate(socks):
            s.sendall(head.format(f"{tag}-{n + k}").encode() + BODY)
        for k, s in enumerate(socks):
            answer, bufs[k] = read_answer(s, bufs[k])
            if not answer.startswith(b"HTTP/1.1 201"):
                raise SystemExit(f"PUT answered {answer[:40]!r}")
        n += len(socks)
    for s in socks:
        s.close()
    out.put(n)


def log_head(url: str) -> int:
    """The log's newest seq (a reader beyond it is told where it stands)."""
    with urllib.request.urlopen(url + "/kv/events?since=999999999999", timeout=10) as r:
        return int(json.loads(r.read())["next"])


def one_run(args, publish: bool, tag: str, subscribe: bool = True) -> dict:
    port, pub_port = free_port(), free_port()
    name = f"/eg-kv-bench-events-{os.getpid()}"
    cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
           "--workers", str(args.workers), "--capacity", "16MiB", "--page-size", "4KiB",
           "--slab-name", name, "--fresh"]  # fmt: skip
    if publish:
        cmd += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sub = None
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                    if json.loads(r.read()).get("workers_up") == args.workers:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        if publish and subscribe:
            endpoint = f"tcp://127.0.0.1:{pub_port}"
            sub = subprocess.Popen(
                [sys.executable, "-c", SUBSCRIBE, endpoint],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the subscription reaches the publisher
        before = log_head(url)
        out: multiprocessing.Queue = multiprocessing.Queue()
        procs = [multiprocessing.Process(target=load, args=(port, f"{tag}-{k}", args.seconds,
                                                            args.workers, out))
                 for k in range(args.loaders)]  # fmt: skip
        t0 = time.monotonic()
        for p in procs:
            p.start()
        puts = sum(out.get(timeout=args.seconds + 60) for _ in procs)
        for p in procs:
            p.join(30)
        elapsed = time.monotonic() - t0
        logged = log_head(url) - before
        row = {"puts_s": puts / args.seconds, "logged": logged}
        if sub is not None:
            got, _ = sub.communicate("", timeout=60)
            seen = json.loads(got.strip().splitlines()[-1])
            row.update(seen, events_s=seen["events"] / elapsed)
        return row
    finally:
        if sub is not None and sub.poll() is None:
            sub.kill()
            sub.wait(10)
        server.terminate()
        server.wait(30)
        from eg_kv.slab.store import Slab

        Slab.unlink_named(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--loaders", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        off = one_run(args, False, f"r{r}-off")
        alone = one_run(args, True, f"r{r}-alone", subscribe=False)
        on = one_run(args, True, f"r{r}-on")
        rows.append((off, alone, on))
        print(f"round {r + 1}: PUT/s {off['puts_s']:,.0f} without, {alone['puts_s']:,.0f} "
              f"publishing to no one, {on['puts_s']:,.0f} to a subscriber "
              f"({on['puts_s'] / off['puts_s']:.3f} of without, "
              f"{on['puts_s'] / alone['puts_s']:.3f} of no one); events {on['logged']:,} logged, "
              f"{on['events']:,} received ({on['events_s']:,.0f}/s), holes {on['holes']}",
              flush=True)  # fmt: skip
    med = statistics.median
    print("\n| PUT/s, no publisher | publisher, no subscriber | publisher + subscriber | "
          "ratio to no publisher | ratio to no subscriber | events/s sent | "
          "events logged / received | holes |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    print(f"| {med(o['puts_s'] for o, _, _ in rows):,.0f} | "
          f"{med(a['puts_s'] for _, a, _ in rows):,.0f} | "
          f"{med(n['puts_s'] for _, _, n in rows):,.0f} | "
          f"{med(n['puts_s'] / o['puts_s'] for o, _, n in rows):.3f} | "
          f"{med(n['puts_s'] / a['puts_s'] for _, a, n in rows):.3f} | "
          f"{med(n['events_s'] for _, _, n in rows):,.0f} | "
          f"{sum(n['logged'] for _, _, n in rows):,} / {sum(n['events'] for _, _, n in rows):,} | "
          f"{sum(n['holes'] for _, _, n in rows)} |")  # fmt: skip


if __name__ == "__main__":
    main()
