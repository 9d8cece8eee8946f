#!/usr/bin/env python3
"""The disk tier against the disk's own limit, side by side in one run on one directory.

Per block size (2 MiB and 14 MiB by default), ``--total`` bytes of blocks:

* ``disk write`` / ``disk read``: the limit, measured just before each eg-kv figure
  (this virtual disk's rate moves by a third from one minute to the next). The same bytes
  written with O_DIRECT ``pwrite`` one block after another into a preallocated file, then
  read back with O_DIRECT ``preadv`` (what the tier itself does, with nothing around it);
* ``spill``: ``eg-kv serve --disk`` takes as many other blocks first, and spills them
  (untimed: the disk tier is then full, as in its steady state, and the timed records
  overwrite theirs). Then it takes the blocks (HTTP PUTs, eight connections) while its
  disk keeper is stopped (SIGSTOP), the keeper is let go (SIGCONT) and timed until the
  last block is on disk: its own rate (O_DIRECT writes straight from the slab's pages),
  not the PUTs'. Blocks it dropped are counted beside it;
* ``cold hit``: the server started again on the same directory with a slab a quarter of
  the blocks (the restart keeps them), and the blocks loaded through eg-kv's own driver
  (``get_into``, over HTTP, eight threads as LMCache's L2 adapter): each one read from
  disk, verified, promoted into the slab and answered. The first quarter fills the slab,
  untimed; the rest are timed, each evicting one.

Then ``lmcache bench l2`` (48 chunks of 14 MiB a round, 672 MiB, ``--lmcache N``
repetitions) through eg-kv with a 256 MiB slab and the disk tier, against LMCache's own
disk path on CPU (its ``fs`` L2 adapter, buffered: its own O_DIRECT mode fails every
store here) on the same directory: once as one run (LMCache's loads then read the page
cache its stores filled), once as a store run and a load run with the page cache dropped
between them (root only: both sides read the disk). And
``--rebuild N`` (100,000) records of 4 KiB are written with the tier's own store and the
scan that rebuilds their index at a restart is timed.

Each eg-kv figure is also printed as a ratio of the limit measured beside it (the goal:
0.8); each cell is the median of ``--rounds`` rounds (a ratio: the median of the rounds'
ratios).
Run it alone (the box is shared)::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_disk.py --dir /var/tmp/eg-kv-bench

``--dir`` must be on the disk to measure (not tmpfs); it is made, and what the script
writes there is removed at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eg_kv.config import format_size, parse_size  # noqa: E402
from eg_kv.disk import layout as D  # noqa: E402
from eg_kv.slab.store import Slab  # noqa: E402

MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def disk_limit(path: Path, block: int, count: int) -> tuple[float, float]:
    """O_DIRECT sequential write, then read, of ``count`` blocks: (write, read) bytes/s."""
    name = path / "limit.bin"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    buf = mmap.mmap(-1, block)
    buf[:] = os.urandom(block)
    try:
        os.posix_fallocate(fd, 0, block * count)
        t0 = time.perf_counter()
        for i in range(count):
            os.pwritev(fd, [buf], i * block)
        os.fsync(fd)
        write = block * count / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(count):
            os.preadv(fd, [buf], i * block)
        read = block * count / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        buf.close()
        name.unlink()
    return write, read


class Server:
    """``eg-kv serve --disk`` on loopback, stopped by pid (its slab unlinked)."""

    def __init__(self, disk: Path, slab: int, disk_capacity: int, max_block: int) -> None:
        self.port, self.name = free_port(), f"/eg-kv-bench-disk-{os.getpid()}"
        self.log = open(disk.parent / "server.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{self.port}",
             "--workers", "2", "--capacity", str(slab), "--slab-name", self.name,
             "--max-block-size", str(max_block), "--disk", str(disk),
             "--disk-capacity", str(disk_capacity)],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.disk_stats().get("ready"):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: see {disk.parent / 'server.log'}")
            time.sleep(0.1)
        self.stop()
        raise SystemExit("the server did not start within 60 s")

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def disk_stats(self) -> dict:
        c = self.conn()
        try:
            c.request("GET", "/kv/stats")
            return json.loads(c.getresponse().read())["disk"]
        finally:
            c.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        with contextlib.suppress(Exception):
            Slab.unlink_named(self.name)


def _each(server: Server, method: str, addresses: list[str], body: bytes | None) -> int:
    """``method`` each address on one keep-alive connection; returns bytes moved."""
    c, moved = server.conn(), 0
    try:
        for address in addresses:
            c.request(method, f"/kv/{address}", body=body)
            r = c.getresponse()
            data = r.read()
            if r.status not in (200, 201):
                raise SystemExit(f"{method} {address}: {r.status} {data[:200]!r}")
            moved += len(body) if body is not None else len(data)
    finally:
        c.close()
    return moved


#: Connections the PUTs and GETs go over: LMCache's L2 adapter loads with 8 threads. (With
#: 4, SO_REUSEPORT put all of them on one of the two workers in some runs: the figure was
#: then one worker's, 0.55-0.83 of the disk's.)
CONNECTIONS = 8


def connections(server: Server, method: str, addresses: list[str], body: bytes | None) -> float:
    """Bytes a second of ``method`` over ``addresses`` split across :data:`CONNECTIONS`."""
    parts = [addresses[k::CONNECTIONS] for k in range(CONNECTIONS)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CONNECTIONS) as pool:
        moved = sum(pool.map(lambda part: _each(server, method, part, body), parts))
    return moved / (time.perf_counter() - t0)


def loads(server: Server, addresses: list[str], block: int) -> float:
    """Bytes a second of GETs of ``addresses`` (each ``block`` bytes) through eg-kv's own
    driver, as an engine loads: ``get_into`` a buffer of its own (the checksum checked),
    over HTTP (no local reads), :data:`CONNECTIONS` threads."""
    from eg_kv.client.sync import ServerConnector

    client = ServerConnector(base_url=f"http://127.0.0.1:{server.port}", local_reads=False,
                             max_block_size=block, max_connections=CONNECTIONS,
                             timeout_s=60)  # fmt: skip

    def part(k: int) -> int:
        buf, moved = mmap.mmap(-1, block), 0
        try:
            for address in addresses[k::CONNECTIONS]:
                got = client.get_into(address, buf)
                if got != block:
                    raise SystemExit(f"GET {address}: {got} bytes, not {block}")
                moved += got
        finally:
            buf.close()
        return moved

    try:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(CONNECTIONS) as pool:
            moved = sum(pool.map(part, range(CONNECTIONS)))
        return moved / (time.perf_counter() - t0)
    finally:
        client.close()


def on_disk_only(server: Server, addresses: list[str]) -> list[str]:
    """Those of ``addresses`` the disk tier answers (the batch exists' ``on_disk``)."""
    out = []
    for i in range(0, len(addresses), 1024):
        part = addresses[i : i + 1024]
        c = server.conn()
        try:
            c.request("POST", "/kv/batch/exists", body=json.dumps({"addresses": part}))
            answer = json.loads(c.getresponse().read())
        finally:
            c.close()
        out += [part[j] for j in answer.get("on_disk", [])]
    return out


def spilled(server: Server, count: int, timeout: float = 300) -> dict:
    """Wait until ``count`` blocks in all have been spilled or dropped (polled every 5 ms:
    each poll is a request to a worker and the keeper); returns the disk's stats then."""
    deadline = time.monotonic() + timeout
    while True:
        st = server.disk_stats()
        done = st.get("spills", 0) + st.get("spill_drops", 0)  # none: a probe is due
        if done >= count or time.monotonic() > deadline:
            return st
        time.sleep(0.005)


def egkv(path: Path, block: int, count: int) -> dict[str, float]:
    """The spill rate and the cold-hit rate of ``count`` blocks, each beside the disk's
    limit measured just before it (this virtual disk's rate moves by a third from one
    minute to the next: a limit taken minutes apart would be another disk's)."""
    disk = path / "tier"
    disk.mkdir(mode=0o700)
    # The disk holds the blocks and little more: the timed spill overwrites the records
    # of the untimed one before it (a disk tier in its steady state: full, its oldest
    # records going), as the limit rewrites the blocks its file had just before. Writes
    # to space this virtual disk had never held ran at about half the speed of rewrites.
    capacity = count * D.record_size(block) + 16 * MiB
    addresses = [f"bench-{block}-{i:05d}" for i in range(count)]
    # Spill: the blocks stored while the keeper is stopped, then timed from its SIGCONT
    # until the last is on disk (the keeper's own rate, not the PUTs'). First, as many
    # other blocks go through the same slab and are spilled, untimed: a server that has
    # run a while. (The keeper's first write from a slab page faults that page into its
    # own page tables: a fresh slab's first pass spilled at 0.5-0.7 of the limit.)
    server = Server(disk, block * count + 16 * block, capacity, block)
    try:
        keeper = server.disk_stats()["pid"]
        connections(server, "PUT", [f"warm-{a}" for a in addresses], os.urandom(block))
        before = spilled(server, count)
        os.kill(keeper, signal.SIGSTOP)
        try:
            connections(server, "PUT", addresses, os.urandom(block))
            write = disk_limit(path, block, count)[0]
        finally:
            os.kill(keeper, signal.SIGCONT)
        t0 = time.perf_counter()
        st = spilled(server, 2 * count)
        spill = (st["spilled_bytes"] - before["spilled_bytes"]) / (time.perf_counter() - t0)
        st["spill_drops"] -= before["spill_drops"]
    finally:
        server.stop()
    # Cold hits: a new server with a slab a quarter of the blocks, on the same directory
    # (the restart keeps the cache): every GET reads, verifies and promotes one.
    read = disk_limit(path, block, count)[1]
    server = Server(disk, max(4 * block, block * count // 4), capacity, block)
    try:
        # The first quarter untimed: it fills the new slab (its pages taken from the
        # kernel and zeroed on first use), so each timed hit evicts a block, as on a
        # server that has run a while.
        cold = on_disk_only(server, addresses)
        loads(server, cold[: len(cold) // 4], block)
        hit = loads(server, cold[len(cold) // 4 :], block)
        return {"write": write, "spill": spill, "spill ratio": spill / write,
                "drops": st["spill_drops"], "read": read, "cold hit": hit,
                "cold ratio": hit / read, "cold": len(cold)}  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(disk, ignore_errors=True)


def rebuild_time(path: Path, records: int, block: int = 4096) -> tuple[float, float]:
    """Write ``records`` records of ``block`` bytes with the tier's own store, then time
    the scan that rebuilds their index at start. Returns (write s, rebuild s)."""
    from eg_kv.checksum import of as checksum_of
    from eg_kv.disk.scan import rebuild
    from eg_kv.disk.store import DiskStore

    where = path / "rebuild"
    where.mkdir(mode=0o700)
    capacity = records * (4096 + block) + 64 * MiB
    data = os.urandom(block)
    digest = checksum_of(data)

    def fill(view: memoryview) -> None:
        view[:] = data

    try:
        store = DiskStore(str(where), capacity, block)
        rebuild(store)
        t0 = time.perf_counter()
        for i in range(records):
            store.append(("", f"rebuild-{i:07d}"), block, digest, fill)
        wrote = time.perf_counter() - t0
        store.close()
        again = DiskStore(str(where), capacity, block)
        t0 = time.perf_counter()
        found = rebuild(again)
        took = time.perf_counter() - t0
        again.close()
        if found != records:
            raise SystemExit(f"the rebuild found {found} of {records} records")
        return wrote, took
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _l2(bl, spec: str, sargs: argparse.Namespace, out: Path) -> dict:
    """One ``lmcache bench l2`` run's sections; a run that missed keys (exit status 1)
    still wrote them, and its hit rate is part of the answer."""
    out.unlink(missing_ok=True)
    try:
        return bl.run_bench(spec, sargs, out)
    except RuntimeError:
        if not out.exists():
            raise
        return {sec["operation"]: sec for sec in bl._sections(json.loads(out.read_text()))}


def drop_page_cache() -> bool:
    """Write back and drop the kernel's page cache (root only): the next buffered read of
    a file comes from the disk. False where this process may not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def drained(server: Server, timeout: float = 120) -> None:
    """Wait until the keeper has taken every block queued for its spill (its queue empty
    twice in a row, its counts unchanged between)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        st = server.disk_stats()
        now = (st.get("spill_queue"), st.get("spills"), st.get("spill_drops"))
        if now[0] == 0 and now == last:
            return
        last = now
        time.sleep(0.2)


def lmcache_cells(path: Path, repeat: int) -> dict[tuple[str, str], float]:
    """``lmcache bench l2`` (48 x 14 MiB chunks a round, scripts/bench_lmcache.py's flags)
    through eg-kv with a 256 MiB slab and a disk tier, against LMCache's own file-system L2
    adapter (``fs``, buffered) on the same directory; sides alternating, medians of
    ``repeat``. Each side runs twice on a fresh directory:

    * ``warm``: one bench run, stores then loads: LMCache's loads read the page cache its
      stores just filled (memory the host lends it beyond any budget), eg-kv's read its
      256 MiB slab and then the disk (O_DIRECT: no page cache);
    * ``cold``: ``--only store``, the keeper let finish, the page cache written back and
      dropped (root only; otherwise not run), then ``--only load``: both read the disk.

    Returns {(side, "Store" | "Load" | "Load cold" | "hits" | "hits cold"): value}."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_lmcache as bl

    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    sargs = bl.shape_args(argparse.Namespace(rounds=3, lookup_rounds=0), 48, 14 * 1024)
    only = {op: argparse.Namespace(**{**vars(sargs), "only": op}) for op in ("store", "load")}
    samples: dict[tuple[str, str], list[float]] = {}

    def keep(side: str, got: dict, op: str, suffix: str = "") -> None:
        samples.setdefault((side, op + suffix), []).append(float(got[op]["ops_per_sec_avg"]))
        if op == "Load":  # its hits: what the store kept (eg-kv drops spills it cannot
            # take in time rather than make a PUT wait)
            total, ok = got[op].get("total_keys") or 1, got[op].get("total_success", 0)
            samples.setdefault((side, "hits" + suffix), []).append(ok / total)

    def run(side: str, where: Path, cold: bool) -> None:
        with contextlib.ExitStack() as stack:
            if side == "eg-kv":
                server = Server(where, 256 * MiB, 4 * 1024 * MiB, 14 * MiB)
                stack.callback(server.stop)
                spec = bl.default_spec(f"http://127.0.0.1:{server.port}")
            else:
                # Its default, buffered: with "use_odirect" (LMCache 0.5.6) every store
                # failed here (EINVAL: its buffers are not aligned), and nothing loaded.
                spec = json.dumps({"type": "fs", "base_path": str(where)})
            if not cold:
                got = _l2(bl, spec, sargs, path / "l2.json")
                keep(side, got, "Store")
                keep(side, got, "Load")
                return
            _l2(bl, spec, only["store"], path / "l2.json")
            if side == "eg-kv":
                drained(server)
            drop_page_cache()
            keep(side, _l2(bl, spec, only["load"], path / "l2.json"), "Load", " cold")

    can_drop = drop_page_cache()
    for rep in range(repeat):
        for side in ["eg-kv", "LMCache fs"] if rep % 2 == 0 else ["LMCache fs", "eg-kv"]:
            for cold in (False, True) if can_drop else (False,):
                where = path / "lmcache-side"
                where.mkdir(mode=0o700)
                try:
                    run(side, where, cold)
                finally:
                    shutil.rmtree(where, ignore_errors=True)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="a directory on the disk to measure")
    p.add_argument("--total", default="512MiB", help="bytes of blocks per size")
    p.add_argument("--sizes", default="2MiB,14MiB", help="block sizes, comma separated")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    p.add_argument("--lmcache", type=int, default=3, metavar="N",
                   help="repetitions of the lmcache bench l2 comparison (0: none)")  # fmt: skip
    p.add_argument(
        "--rebuild",
        type=int,
        default=100_000,
        metavar="N",
        help="also time the index's rebuild at start for N records (0: not)",
    )
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="eg-kv-bench-disk-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    total = parse_size(args.total)
    rows = []
    try:
        for size in (parse_size(s) for s in args.sizes.split(",") if s):
            count = max(64, total // size)  # 64: a load of eight threads has a tail
            runs = []
            for _ in range(args.rounds):  # the limit and eg-kv interleaved, medians kept
                runs.append(egkv(work, size, count))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((size, count, med))
            print(f"  {format_size(size)}: {med}", file=sys.stderr, flush=True)
        rebuilt = rebuild_time(work, args.rebuild) if args.rebuild else None
        print(f"  rebuild: {rebuilt}", file=sys.stderr, flush=True)
        l2 = lmcache_cells(work, args.lmcache) if args.lmcache else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    gb = 1e9
    print(f"disk tier on {base} ({format_size(total)} a size, medians of {args.rounds} rounds; "
          "GB/s; ratio to the disk's limit)")  # fmt: skip
    print("| block | disk write | eg-kv spill | ratio | disk read | eg-kv cold hit | ratio "
          "| spill drops |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for size, count, got in rows:  # each ratio: the median of the rounds' own ratios
        print(
            f"| {format_size(size)} x {count} | {got['write'] / gb:.2f} | "
            f"{got['spill'] / gb:.2f} | {got['spill ratio']:.2f} | {got['read'] / gb:.2f} | "
            f"{got['cold hit'] / gb:.2f} | {got['cold ratio']:.2f} | {got['drops']} |"
        )
    if l2 is not None:
        print(
            f"\nlmcache bench l2, 48 x 14 MiB chunks a round (ops/s, medians of {args.lmcache}): "
            "eg-kv with a 256 MiB slab and a disk tier against LMCache's fs adapter (buffered)"
        )
        print("| op | eg-kv | LMCache fs | eg-kv / fs |\n|---|---:|---:|---:|")
        rows = [("store", "Store"), ("load, page cache warm", "Load"),
                ("load, page cache dropped", "Load cold")]  # fmt: skip
        for label, op in rows:
            if ("eg-kv", op) in l2:
                a, b = l2[("eg-kv", op)], l2[("LMCache fs", op)]
                print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
        for label, op in (("keys loaded, warm", "hits"), ("keys loaded, dropped", "hits cold")):
            if ("eg-kv", op) in l2:
                a, b = l2[("eg-kv", op)], l2[("LMCache fs", op)]
                print(f"| {label} | {a:.0%} | {b:.0%} | |")
        if ("eg-kv", "Load cold") not in l2:
            print("(the page cache could not be dropped: not root; warm loads only)")
    if rebuilt is not None:
        print(f"\nrebuild of the index at start: {args.rebuild:,} records of 4 KiB in "
              f"{rebuilt[1]:.2f} s (written in {rebuilt[0]:.1f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
