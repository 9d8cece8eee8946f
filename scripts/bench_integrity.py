#!/usr/bin/env python3
"""What integrity costs, side by side in one run: block checksums on GET and PUT, over
HTTP and on local reads, and the tier's per-row digest (issue 32).

Sides, interleaved in rotating order (the box is noisy: read the ratios):

- ``checked``: this checkout, its client checking every block (the default);
- ``unchecked``: this checkout, ``verify_checksums=False`` (the server still computes and
  sends the checksum: what the client's check costs is ``checked / unchecked``);
- ``baseline``: ``--baseline REV``'s server and client (default: the last commit before
  checksums), so ``checked / baseline`` is all that checksums cost.

Each side runs on a fresh 2-worker server with a 512 MiB slab of 64 KiB pages; one client
thread does sequential GETs of a few resident blocks, or PUTs of new ones, for
``--seconds`` per cell, as ``ops/s``. GETs go over HTTP (``local_reads`` off) and by local
reads (on: this benchmark runs on the server's host). PUTs send the checksum
(``checked``), or nothing (``baseline``); the server hashes the body either way.

Then the digests of a tier row (2 MiB, the vLLM tier's ``EgKvTier`` load check): today's
keyed BLAKE2b trailer, keyed BLAKE3 (the block key's MAC), XXH3-64 alone, in MB/s.

Run it alone (the box is shared)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_integrity.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lmcache import ROOT, egkv_server, tree_of

KiB, MiB = 1024, 1024 * 1024
#: The last commit before block checksums: the default baseline.
BEFORE_CHECKSUMS = "9509bdc"
SIZES = {"4 KiB": 4 * KiB, "2 MiB": 2 * MiB, "14 MiB": 14 * MiB}
#: Cells: (operation, how); each is measured at every size.
CELLS = (("GET", "HTTP"), ("GET", "local"), ("PUT", "HTTP"))
#: Blocks a GET cell reads in turn (of its size), and the slab that holds them all.
RESIDENT_BYTES = 64 * MiB
SLAB_BYTES = 512 * MiB


def client_main(url: str, cells: list[list], seconds: float, verify: bool) -> None:
    """In a child process under the side's tree: measure each cell, print JSON."""
    from eg_kv.client.core import KvCacheConfig
    from eg_kv.client.sync import ServerConnector

    token = os.environ.get("EPISTEMIC_GRAPH_KVCACHE_TOKEN")
    out = {}
    for op, how, size in cells:
        extra = {} if verify else {"verify_checksums": False}
        config = KvCacheConfig(base_url=url, token=token, local_reads=how == "local", **extra)
        with ServerConnector(config) as client:
            out[f"{op} {how} {size}"] = _cell(client, op, size, seconds)
    print(json.dumps(out))


def _cell(client, op: str, size: int, seconds: float) -> float:
    """ops/s of ``op`` on blocks of ``size`` bytes for about ``seconds``."""
    count = max(2, min(64, RESIDENT_BYTES // size))
    blocks = [os.urandom(size) for _ in range(count)] if op == "PUT" else None
    tag = os.urandom(4).hex()
    if op == "GET":
        data = os.urandom(size)
        names = [f"get-{tag}-{i}" for i in range(count)]
        for i, name in enumerate(names):
            assert client.put(name, data[:-8] + i.to_bytes(8, "little")), "cannot store"
        buf = bytearray(size)
        assert client.get_into(names[0], buf) == size, "cannot read back"
    done, start = 0, time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline and done < 1_000_000:
        if op == "GET":
            assert client.get_into(names[done % count], buf) == size, "a miss"
        else:
            assert client.put(f"put-{tag}-{done}", blocks[done % count]), "a refused PUT"
        done += 1
    return done / (time.perf_counter() - start)


def measure_side(tree: Path, verify: bool, cells: list, seconds: float, logdir: Path) -> dict:
    with egkv_server(2, SLAB_BYTES, logdir, root=tree) as url:
        cmd = [sys.executable, __file__, "--client", url, "--seconds", str(seconds),
               "--cells", json.dumps(cells)] + ([] if verify else ["--unchecked"])  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=600, check=False)  # fmt: skip
        if done.returncode:
            raise SystemExit(f"client under {tree} failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.splitlines()[-1])


def digests(seconds: float) -> dict[str, float]:
    """MB/s of each per-row digest over 2 MiB rows (one thread)."""
    import hashlib

    import blake3
    import xxhash

    key = os.urandom(32)
    row = os.urandom(2 * MiB)
    ways = {
        "BLAKE2b keyed (today's tier trailer)": lambda: hashlib.blake2b(
            row, key=key, digest_size=32
        ).digest(),
        "BLAKE3 keyed (block key MAC)": lambda: blake3.blake3(row, key=key).digest(),
        "XXH3-64 (checksum only)": lambda: xxhash.xxh3_64_intdigest(row),
    }
    out = {}
    for name, fn in ways.items():
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            n += 1
        out[name] = n * len(row) / (time.perf_counter() - start) / 1e6
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=BEFORE_CHECKSUMS, help="commit before checksums")
    p.add_argument("--seconds", type=float, default=1.5, help="per cell (default 1.5)")
    p.add_argument("--repeat", type=int, default=3, help="runs per side, median kept (3)")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--cells", help=argparse.SUPPRESS)
    p.add_argument("--unchecked", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args.client, json.loads(args.cells), args.seconds, not args.unchecked)
        return 0
    cells = [[op, how, size] for op, how in CELLS for size in SIZES.values()]
    sha, base_tree = tree_of(args.baseline)
    sides = [("checked", ROOT, True), ("unchecked", ROOT, False), ("baseline", base_tree, True)]
    samples: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in sides}
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        for r in range(args.repeat):
            for k in range(len(sides)):
                name, tree, verify = sides[(r + k) % len(sides)]
                got = measure_side(tree, verify, cells, args.seconds, Path(tmp))
                for cell, rate in got.items():
                    samples[name].setdefault(cell, []).append(rate)
                print(f"  run {r + 1} {name}: done", file=sys.stderr)
    med = {n: {c: statistics.median(v) for c, v in cells_.items()} for n, cells_ in samples.items()}
    print(f"\nBlock checksums (ops/s, median of {args.repeat}; baseline {sha[:7]}):\n")
    print("| cell | checked | unchecked | baseline | checked / unchecked | checked / baseline |")
    print("|---|---|---|---|---|---|")
    names = {v: k for k, v in SIZES.items()}
    for op, how, size in cells:
        cell = f"{op} {how} {size}"
        c, u, b = (med[n].get(cell, float("nan")) for n in ("checked", "unchecked", "baseline"))
        what = f"{op} {names[size]} {'over HTTP' if how == 'HTTP' else 'local read'}"
        print(f"| {what} | {c:,.0f} | {u:,.0f} | {b:,.0f} | {c / u:.2f} | {c / b:.2f} |")
    print("\nPer-row digest of a 2 MiB tier row (one thread):\n")
    print("| digest | MB/s | vs BLAKE2b |")
    print("|---|---|---|")
    rates = digests(args.seconds)
    first = next(iter(rates.values()))
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / first:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
