#!/usr/bin/env python3
"""What integrity costs, side by side in one run: block checksums on GET and PUT, over
HTTP and on local reads, and the tier's per-row digest (issue 32).

Sides, interleaved in rotating order (the box is noisy: read the ratios):

- ``checked``: this checkout, its client checking every block (the default);
- ``keyed``: the same with the engines' block key set: a GMAC per block, which checks
  every byte, so the client checks it instead of the checksum (and the tier's trailer);
- ``unchecked``: this checkout, ``verify_checksums=False`` (the server still computes and
  sends the checksum: what the client's check costs is ``checked / unchecked``);
- ``baseline``: ``--baseline REV``'s server and client (default: the last commit before
  checksums), so ``checked / baseline`` is all that checksums cost.

Each side runs on a fresh 2-worker server with a 512 MiB slab of 64 KiB pages; one client
thread does sequential GETs of a few resident blocks, or PUTs of new ones, for
``--seconds`` per cell, as ``ops/s``. GETs go over HTTP (``local_reads`` off) and by local
reads (on: this benchmark runs on the server's host). PUTs send the checksum
(``checked``), or nothing (``baseline``); the server hashes the body either way.

The ``TIER`` cells load 2 MiB rows through the vLLM tier's copies (``CopyJobs``, 4
threads, local reads): ``baseline`` checks its BLAKE2b trailer, ``checked`` the checksum
and the XXH3-128 trailer, ``keyed`` the MAC alone. Then the digests alone, on one
thread: keyed BLAKE2b, keyed BLAKE3 (the block key's MAC before), the block key's GMAC,
XXH3-64, in MB/s.

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
#: The tier's rows: (rows stored and loaded in turn, bytes each).
TIER_ROWS, TIER_ROW_BYTES = 16, 2 * MiB
#: The block key of the ``keyed`` side (a benchmark's own).
BENCH_KEY = "bench-integrity-" + os.urandom(16).hex()
#: Blocks a GET cell reads in turn (of its size), and the slab that holds them all.
RESIDENT_BYTES = 64 * MiB
SLAB_BYTES = 512 * MiB


def client_main(url: str, cells: list[list], seconds: float, verify: bool) -> None:
    """In a child process under the side's tree: measure each cell, print JSON."""
    from eg_kv.client.sync import ServerConnector  # (the config's module moved: keywords)

    out = {}
    for op, how, size in cells:
        extra = {} if verify else {"verify_checksums": False}
        # Keywords resolve from the environment too: the token and, on the keyed side, the
        # block key.
        with ServerConnector(base_url=url, local_reads=how == "local", **extra) as client:
            run = _tier if op == "TIER" else _cell
            out[f"{op} {how} {size}"] = run(client, op, size, seconds)
    print(json.dumps(out))


def _tier(client, _op: str, size: int, seconds: float) -> float:
    """Rows/s the vLLM tier's copies load (``TIER_ROWS`` rows of ``size`` bytes)."""
    from eg_kv.vllm.tier_copies import CopyJobs

    primary = bytearray(os.urandom(size * TIER_ROWS))
    target = bytearray(size * TIER_ROWS)
    addresses = [f"tier-{os.urandom(4).hex()}-{i}" for i in range(TIER_ROWS)]
    rows = list(range(TIER_ROWS))
    # The keyed side's loads check the MAC alone (as EgKvTier's do); a baseline has no key.
    keyed = {"keyed": True} if getattr(client.config, "block_key", None) else {}
    stores = CopyJobs(client, memoryview(primary), size, threads=4, **keyed)
    stores.submit(0, False, addresses, rows)
    assert stores.drain(60) and all(stores.finished()[0].ok), "the tier could not store"
    stores.close()
    loads = CopyJobs(client, memoryview(target), size, threads=4, **keyed)
    done, job, start = 0, 1, time.perf_counter()
    while time.perf_counter() - start < seconds and job < 100_000:
        loads.submit(job, True, addresses, rows)
        assert loads.drain(60) and all(loads.finished()[0].ok), "a tier load missed"
        done, job = done + TIER_ROWS, job + 1
    rate = done / (time.perf_counter() - start)
    loads.close()
    assert target == primary, "the tier loaded other bytes"
    return rate


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


def measure_side(
    tree: Path, verify: bool, keyed: bool, cells: list, seconds: float, logdir: Path
) -> dict:
    with egkv_server(2, SLAB_BYTES, logdir, root=tree) as url:
        cmd = [sys.executable, __file__, "--client", url, "--seconds", str(seconds),
               "--cells", json.dumps(cells)] + ([] if verify else ["--unchecked"])  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}
        env.pop("EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY", None)
        if keyed:
            env["EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY"] = BENCH_KEY
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

    from eg_kv.blockkey import BlockKey

    key = os.urandom(32)
    block_key = BlockKey(key)
    row = os.urandom(2 * MiB)
    ways = {
        "BLAKE2b keyed (today's tier trailer)": lambda: hashlib.blake2b(
            row, key=key, digest_size=32
        ).digest(),
        "BLAKE3 keyed (the block key's MAC before)": lambda: blake3.blake3(row, key=key).digest(),
        "GMAC (the block key's MAC)": lambda: block_key.seal("tier-0", [row]),
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
    p.add_argument(
        "--only",
        nargs="+",
        metavar="CELL",
        help="measure only these cells: OP:HOW:SIZE (GET:HTTP:14MiB, GET:local:2MiB, "
        "PUT:HTTP:4KiB, TIER): more repeats of a few cells in the same time",
    )
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--cells", help=argparse.SUPPRESS)
    p.add_argument("--unchecked", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args.client, json.loads(args.cells), args.seconds, not args.unchecked)
        return 0
    # The tier first, on an empty slab: later cells fill it, and a full slab's CLOCK may
    # evict a row its own store job wrote a moment before (new blocks have no use yet).
    cells = [["TIER", "local", TIER_ROW_BYTES]]
    cells += [[op, how, size] for op, how in CELLS for size in SIZES.values()]
    if args.only:
        names = {f"{op}:{how}:{n.replace(' ', '')}": [op, how, v] for n, v in SIZES.items()
                 for op, how in CELLS} | {"TIER": cells[0]}  # fmt: skip
        unknown = [c for c in args.only if c not in names]
        if unknown:
            raise SystemExit(f"unknown cell(s) {unknown}; known: {sorted(names)}")
        cells = [names[c] for c in args.only]
    sha, base_tree = tree_of(args.baseline)
    sides = [
        ("checked", ROOT, True, False), ("keyed", ROOT, True, True),
        ("unchecked", ROOT, False, False), ("baseline", base_tree, True, False),
    ]  # fmt: skip
    samples: dict[str, dict[str, list[float]]] = {side[0]: {} for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        for r in range(args.repeat):
            for k in range(len(sides)):
                name, tree, verify, keyed = sides[(r + k) % len(sides)]
                got = measure_side(tree, verify, keyed, cells, args.seconds, Path(tmp))
                for cell, rate in got.items():
                    samples[name].setdefault(cell, []).append(rate)
                print(f"  run {r + 1} {name}: done", file=sys.stderr)
    med = {n: {c: statistics.median(v) for c, v in cells_.items()} for n, cells_ in samples.items()}
    print(f"\nBlock checksums (ops/s, median of {args.repeat}; baseline {sha[:7]}):\n")
    print("| cell | checked | keyed | unchecked | baseline | checked / unchecked "
          "| checked / baseline | keyed / baseline |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    names = {v: k for k, v in SIZES.items()}
    for op, how, size in sorted(cells, key=lambda c: c[0] == "TIER"):
        cell = f"{op} {how} {size}"
        c, k, u, b = (
            med[n].get(cell, float("nan")) for n in ("checked", "keyed", "unchecked", "baseline")
        )
        if op == "TIER":
            what = "tier load, 2 MiB rows (rows/s; baseline: BLAKE2b trailer)"
        else:
            what = f"{op} {names[size]} {'over HTTP' if how == 'HTTP' else 'local read'}"
        print(f"| {what} | {c:,.0f} | {k:,.0f} | {u:,.0f} | {b:,.0f} | {c / u:.2f} "
              f"| {c / b:.2f} | {k / b:.2f} |")  # fmt: skip
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
