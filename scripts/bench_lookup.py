#!/usr/bin/env python3
"""Lookup latency per batch: ``lmcache bench l2 --only lookup`` against eg-kv's
native_plugin and LMCache's C++ ``resp`` adapter on ``redis-server``, in one run, for
batches of 1, 16, 256 and 1,024 keys; then eg-kv's time split into its parts.

Each repetition starts a fresh eg-kv server and a fresh redis-server (alternating which
goes first, since background load drifts on a shared box) and runs, for every batch
size, one ``lmcache bench l2 --only lookup`` of ``--rounds`` batches against each. A
lookup round is one batch, so the bench's per-round duration is the latency LMCache's
scheduler waits for; its p50 and p99 are reported in microseconds (the bench rounds them
to 10 µs), with the rate (keys/s) and the ratio ours / redis: the median over
repetitions and the ratio of every repetition.

The split (eg-kv only, measured in this process against the same server, the same
:class:`~eg_kv.lmcache.l2.RemoteKVL2Connector` LMCache loads, fresh keys each batch):

* adapter: submit to the eventfd turning readable, with no LMCache around it;
* hashing: ``address_for_key`` of every key (what a cold digest cache costs);
* HTTP request: one ``POST /kv/batch/exists`` round trip, minus the server handler and
  the answer parsing (sockets, the HTTP heads, aiohttp's parsing and routing);
* server handler: decoding the body, ``Slab.exists_many`` on the server's own slab and
  encoding the answer, timed in this process;
* answer parsing: the client's check and decoding of the answer;
* eventfd signal: one ``eventfd_write`` until a thread in ``poll`` on it runs;
* hand-off: adapter minus all the above (the thread hand-offs inside the adapter);
* LMCache: the ``lmcache bench`` median minus adapter (LMCache's adapter lock, its
  demux thread, its own eventfd and the bench loop).

Run it alone (the box is shared)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_lookup.py
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lmcache import MiB, egkv_server, egkv_spec, redis_server, redis_spec, run_bench

from eg_kv.address import address_for_key
from eg_kv.client.rules import batch_answer, batch_body, json_answer
from eg_kv.lmcache.l2 import RemoteKVL2Connector
from eg_kv.slab.store import Slab

SIZES = (1, 16, 256, 1024)


def rounds_for(n: int, base: int) -> int:
    """Rounds per batch size: many small batches, fewer big ones (similar run times)."""
    return max(base // max(1, n // 64), 50)


def p(vals: list[float], q: float) -> float:
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def _us(f, reps: int) -> list[float]:
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        f(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def split_egkv(url: str, slab_name: str, n: int, reps: int) -> dict[str, float]:
    """Median µs of each part of one eg-kv lookup of ``n`` fresh keys (see the module doc)."""
    from eg_kv import wire
    from eg_kv.client.rules import compact_answer
    from eg_kv.server import lookups

    conn = RemoteKVL2Connector(base_url=url, num_workers=4, timeout_s=60)
    slab = Slab.attach(slab_name)
    keysets = [[f"bench@{os.getpid():08x}@0@{r:08x}{i:08x}" for i in range(n)]
               for r in range(reps * 5)]  # fmt: skip
    efd = conn.event_fd()
    poller = select.poll()
    poller.register(efd, select.POLLIN)
    try:
        # Fresh keys for every part: the server remembers the addresses it validated.
        def adapter(r: int) -> None:
            conn.submit_batch_exists(keysets[reps + r])
            while not conn.drain_completions():
                poller.poll(10_000)

        for r in range(20):  # warm the connections
            adapter(r)
        total = _us(adapter, reps)
        hashing = _us(lambda r: [address_for_key(k) for k in keysets[2 * reps + r]], reps)
        fresh = [[address_for_key(k) for k in keysets[3 * reps + r]] for r in range(reps)]
        client = conn._client
        http = _us(lambda r: client.try_exists_addresses(fresh[r]), reps)
        fresh = [[address_for_key(k) for k in keysets[4 * reps + r]] for r in range(reps)]
        addrs = fresh[0]
        found = slab.exists_many(addrs)
        if client._compact_batches:  # the format the client speaks to this server
            ctype, encode = wire.ADDRESSES_TYPE, wire.encode_addresses
            answer = wire.encode_flags(found)

            def parse(_r: int) -> None:
                compact_answer(200, wire.FLAGS_TYPE.encode(), answer, n)
        else:
            ctype, encode = "application/json", batch_body
            answer = lookups.batch_answer_body(found, ctype)[0]

            def parse(_r: int) -> None:
                batch_answer(json_answer(200, answer), n)

        reqs = [encode(a) for a in fresh]

        def handler_once(r: int) -> None:
            found = slab.exists_many(lookups.batch_addresses(ctype, reqs[r]))
            lookups.batch_answer_body(found, ctype)

        handler = _us(handler_once, reps)
        parsing = _us(parse, reps)
    finally:
        conn.close()
        slab.close()
    signal = eventfd_signal_us(reps)
    med = {k: statistics.median(v) for k, v in
           (("adapter", total), ("hashing", hashing), ("http_total", http),
            ("handler", handler), ("parsing", parsing), ("signal", signal))}  # fmt: skip
    med["http"] = med["http_total"] - med["handler"] - med["parsing"]
    med["handoff"] = med["adapter"] - med["hashing"] - med["http_total"] - med["signal"]
    return med


def eventfd_signal_us(reps: int) -> list[float]:
    """µs from ``eventfd_write`` until a thread polling that eventfd runs."""
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    woke: list[float] = []
    sent = [0.0]
    go = threading.Event()

    def waiter() -> None:
        poller = select.poll()
        poller.register(efd, select.POLLIN)
        go.set()
        for _ in range(reps):
            poller.poll(10_000)
            woke.append((time.perf_counter() - sent[0]) * 1e6)
            os.eventfd_read(efd)
            go.set()

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(reps):
        go.wait(10)
        go.clear()
        time.sleep(0.0002)
        sent[0] = time.perf_counter()
        os.eventfd_write(efd, 1)
    t.join(10)
    os.close(efd)
    return woke


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1500, help="batches of 1-64 keys per run")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--egkv-threads", type=int, default=4)
    ap.add_argument("--redis-threads", type=int, default=8)
    ap.add_argument("--split-reps", type=int, default=300)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--no-split", action="store_true", help="only the lmcache bench table")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    bench_args = argparse.Namespace(num_keys=16, in_flight=1, warmup_rounds=20,
                                    lookup_max_hit_rate=0.0, lookup_rounds=args.rounds)  # fmt: skip
    # lat[name][n] = [(p50_us, p99_us, keys_per_s), ...] one per repetition
    lat: dict[str, dict[int, list[tuple[float, float, float]]]] = {
        name: {n: [] for n in sizes} for name in ("eg-kv", "redis")
    }
    splits: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}

    def measure(name: str, spec: str, logdir: Path) -> None:
        for n in sizes:
            out = logdir / f"{name}-{n}.json"
            sec = run_bench(spec, bench_args, out, lookup_only=True, num_keys=n,
                            lookup_rounds=rounds_for(n, args.rounds))["Lookup"]  # fmt: skip
            lat[name][n].append((sec["duration_p50_ms"] * 1000, sec["duration_p99_ms"] * 1000,
                                 float(sec["ops_per_sec_avg"])))  # fmt: skip

    def run_ours(logdir: Path) -> None:
        with egkv_server(args.workers, 256 * MiB, logdir) as url:
            spec = egkv_spec(url, args.egkv_threads)
            measure("eg-kv", spec, logdir)
            slab_name = f"/eg-kv-bench-{os.getpid()}-{url.rsplit(':', 1)[1]}"
            for n in sizes if not args.no_split else ():
                splits[n].append(split_egkv(url, slab_name, n, args.split_reps))

    def run_redis(logdir: Path) -> None:
        with redis_server(logdir) as port:
            spec = redis_spec(port, args.redis_threads)
            measure("redis", spec, logdir)

    with tempfile.TemporaryDirectory(prefix="eg-kv-bench-") as tmp:
        for rep in range(args.repeat):
            order = (run_ours, run_redis) if rep % 2 == 0 else (run_redis, run_ours)
            for fn in order:
                fn(Path(tmp))

    print(f"lmcache bench l2 --only lookup, 1 batch in flight, all misses; eg-kv: "
          f"{args.workers} server workers, {args.egkv_threads} client threads; redis: "
          f"{args.redis_threads} client threads; median of {args.repeat} interleaved "
          f"repetitions; latency per batch in µs")  # fmt: skip
    print(
        "| keys | eg-kv p50 | eg-kv p99 | redis p50 | redis p99 | eg-kv keys/s "
        "| redis keys/s | rate ours/redis | per run |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    ok = True
    for n in sizes:
        ours, theirs = lat["eg-kv"][n], lat["redis"][n]
        m = [statistics.median(x[i] for x in ours) for i in range(3)]
        r = [statistics.median(x[i] for x in theirs) for i in range(3)]
        per_run = " ".join(f"{a[2] / b[2]:.2f}" for a, b in zip(ours, theirs, strict=True))
        print(f"| {n} | {m[0]:.0f} | {m[1]:.0f} | {r[0]:.0f} | {r[1]:.0f} | {m[2]:,.0f} "
              f"| {r[2]:,.0f} | {m[2] / r[2]:.2f} | {per_run} |")  # fmt: skip
        ok &= m[2] / r[2] >= (2.0 if n >= 1024 else 1.2 if n >= 16 else 0.0)
    if args.no_split:
        return 0 if ok else 1
    print()
    print("eg-kv's lookup split into its parts (µs, median of the repetitions' medians):")
    parts = ("lmcache", "handoff", "hashing", "http", "handler", "parsing", "signal")
    print(
        "| keys | bench p50 | LMCache | hand-off | hashing | HTTP request | server handler "
        "| answer parsing | eventfd signal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        med = {k: statistics.median(s[k] for s in splits[n]) for k in splits[n][0]}
        p50 = statistics.median(x[0] for x in lat["eg-kv"][n])
        med["lmcache"] = p50 - med["adapter"]
        print(f"| {n} | {p50:.0f} | " + " | ".join(f"{med[k]:.0f}" for k in parts) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
