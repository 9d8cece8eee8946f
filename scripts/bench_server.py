#!/usr/bin/env python3
"""Benchmark eg-kv against a bare aiohttp handler and redis-server, side by side.

GET, PUT and HEAD at 4 KiB, 1 MiB and 14 MiB, with 1 and N workers. Small requests are
driven by ``wrk`` (and ``redis-benchmark`` for redis); large ones by a raw-socket
keep-alive client in threads (the same client for every server). Also measured: a worker's
private memory (anonymous pages) while 4 clients move 14 MiB blocks, and batch existence
against the same number of HEADs over one connection.

Run it alone on the machine (other load skews it), e.g.::

    flock /tmp/eg-kv-bench.lock .venv/bin/python scripts/bench_server.py --seconds 2

Needs ``wrk``, ``ab``, ``redis-server`` and ``redis-benchmark`` on PATH (Debian:
``apt-get install redis-server wrk apache2-utils``; ``ab`` drives HEAD, since ``wrk``
waits for a body after a HEAD answer). Every server it starts listens on a free loopback port and is
stopped by pid; every slab it creates is removed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KiB, MiB = 1024, 1024 * 1024
SIZES = {"4KiB": 4 * KiB, "1MiB": MiB, "14MiB": 14 * MiB}
OPS = ("GET", "HEAD", "PUT")  # PUT last: its new blocks may evict the ones GET reads
#: With --tenants N: eg-kv gets a tokens file of N tenants and every client sends the
#: token of one of them (its own namespace), as a header line of every request.
AUTH: dict = {}
#: With --disk: eg-kv (and the baseline) each get a disk tier of this size in a new
#: directory under /var/tmp (a real disk), removed after.
DISK: dict = {}


def tokens_file(n: int, directory: str) -> tuple[str, str]:
    """Write a tokens file of ``n`` readwrite tenants; return (its path, one tenant's token)."""
    import hashlib

    lines = []
    for k in range(n):
        digest = hashlib.sha256(f"bench-token-{k}".encode()).hexdigest()
        lines.append(f'[[tenant]]\nname = "t{k}"\ntoken_sha256 = "{digest}"\n'
                     'role = "readwrite"\n')  # fmt: skip
    path = os.path.join(directory, "tokens.toml")
    Path(path).write_text("\n".join(lines))
    return path, f"bench-token-{n // 2}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------- the bare server


def bare_server(port: int, workers: int) -> None:
    """The framework's ceiling: aiohttp + uvloop serving / draining bytes from memory.

    Started the way an eg-kv worker starts (forked, ``AppRunner`` + ``TCPSite`` with
    ``reuse_port``, uvloop), so the handlers are the only difference. Large bodies go out
    in 1 MiB zero-copy slices of the in-memory block: one 14 MiB write is slower in
    aiohttp (measured), and a ceiling should be the best the framework can do.
    """
    import asyncio

    from aiohttp import web

    blocks = {f"b{name}": os.urandom(n) for name, n in SIZES.items()}
    slice_size = MiB

    async def get(request):
        data = blocks[request.match_info["h"]]
        if len(data) <= slice_size:
            return web.Response(body=data, content_type="application/octet-stream")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = len(data)
        await resp.prepare(request)
        view = memoryview(data)
        for i in range(0, len(data), slice_size):
            await resp.write(view[i : i + slice_size])
        await resp.write_eof()
        return resp

    async def head(request):
        resp = web.StreamResponse()
        resp.content_length = len(blocks[request.match_info["h"]])
        await resp.prepare(request)
        await resp.write_eof()
        return resp

    async def put(request):
        while await request.content.readany():
            pass
        return web.Response(status=201, text="created\n")

    async def run() -> None:
        app = web.Application(handler_args={"auto_decompress": False})
        app.router.add_route("GET", "/kv/{h}", get)
        app.router.add_route("HEAD", "/kv/{h}", head)
        app.router.add_route("PUT", "/kv/{h}", put)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=1024).start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    def serve() -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(run())

    children = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                serve()
            finally:
                os._exit(0)
        children.append(pid)

    def down(*_):
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, signal.SIGTERM)

    signal.signal(signal.SIGTERM, down)
    for c in children:
        while True:
            try:
                os.waitpid(c, 0)
                break
            except ChildProcessError:
                break
            except InterruptedError:
                continue


# ---------------------------------------------------------------------------- servers


class Server:
    """A server under test: eg-kv, bare aiohttp or redis."""

    kind = ""

    def __init__(self, workers: int):
        self.workers = workers
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            stop(self.proc)


class EgKv(Server):
    """eg-kv from this tree, or with ``root`` from another (``--baseline``: a commit's
    ``git archive``), which is served with the clients' token as its one token."""

    kind = "eg-kv"

    def __init__(self, workers: int, root: Path = ROOT, kind: str = "eg-kv"):
        super().__init__(workers)
        self.root, self.kind = root, kind

    def start(self) -> None:
        self.slab = f"/eg-kv-bench-{os.getpid()}-{self.port}"
        mine = self.root == ROOT
        extra = ["--tokens", AUTH["file"]] if AUTH.get("file") and mine else []
        if DISK:
            self.disk = tempfile.mkdtemp(prefix="eg-kv-bench-disk-", dir="/var/tmp")
            extra += ["--disk", self.disk, "--disk-capacity", DISK["capacity"]]
        token = AUTH.get("token") if mine else AUTH.get("bearer")
        env = {**os.environ, "EPISTEMIC_GRAPH_KVCACHE_TOKEN": token} if token else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{self.port}",
             "--workers", str(self.workers), "--capacity", "512MiB", "--slab-name", self.slab,
             "--fresh", *extra],
            cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/healthz", timeout=2
                ) as r:
                    if json.loads(r.read())["workers_up"] == self.workers:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        self.blocks = {name: os.urandom(n) for name, n in SIZES.items()}

    def ensure(self, size_name: str) -> None:
        """(Re)store the block GET and HEAD read: an earlier PUT run may have evicted it."""
        http_put_once(self.port, f"/kv/b{size_name}", self.blocks[size_name])

    def __exit__(self, *exc):
        super().__exit__(*exc)
        from eg_kv.slab.store import Slab

        Slab.unlink_named(self.slab)
        if DISK:
            shutil.rmtree(self.disk, ignore_errors=True)

    def worker_pids(self) -> list[int]:
        import psutil

        return [p.pid for p in psutil.Process(self.proc.pid).children()]


class Bare(Server):
    kind = "bare aiohttp"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare-server", str(self.port), str(self.workers)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(self.port, self.proc)

    def ensure(self, size_name: str) -> None:
        pass


class Redis(Server):
    kind = "redis"

    def start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="eg-kv-bench-redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru",
             "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(self.port, self.proc)

    def ensure(self, size_name: str) -> None:
        with connect(self.port) as s:
            redis_cmd(s, b"SET", f"b{size_name}".encode(), os.urandom(SIZES[size_name]))

    def __exit__(self, *exc):
        super().__exit__(*exc)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------- raw clients


def _read_until(s: socket.socket, buf: bytearray, marker: bytes) -> int:
    while (i := buf.find(marker)) < 0:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return i


def _read_exact(s: socket.socket, buf: bytearray, n: int, sink: memoryview) -> None:
    """Consume ``n`` bytes: first from ``buf``, the rest straight into ``sink``."""
    take = min(n, len(buf))
    del buf[:take]
    left = n - take
    while left:
        got = s.recv_into(sink[: min(left, len(sink))])
        if not got:
            raise ConnectionError("closed mid-body")
        left -= got


def http_exchange(s, buf, sink, method: str, path: str, body=None) -> int:
    head = f"{method} {path} HTTP/1.1\r\nHost: b\r\n{AUTH.get('line', '')}"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    s.sendall(head.encode() + b"\r\n")
    if body is not None:
        s.sendall(body)
    end = _read_until(s, buf, b"\r\n\r\n")
    header = bytes(buf[:end])
    del buf[: end + 4]
    status = int(header[9:12])
    m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", header)
    if method != "HEAD" and m:
        _read_exact(s, buf, int(m.group(1)), sink)
    return status


def connect(port: int) -> socket.socket:
    """A client connection; no Nagle delay between a request's head and its body."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def http_put_once(port: int, path: str, body: bytes) -> int:
    with connect(port) as s:
        return http_exchange(s, bytearray(), memoryview(bytearray(65536)), "PUT", path, body)


def redis_cmd(s: socket.socket, *parts: bytes, buf=None, sink=None) -> None:
    out = b"*%d\r\n" % len(parts)
    for p in parts:
        out += b"$%d\r\n" % len(p)
        if len(p) > 65536:
            s.sendall(out)
            s.sendall(p)
            out = b"\r\n"
        else:
            out += p + b"\r\n"
    s.sendall(out)
    buf = bytearray() if buf is None else buf
    sink = memoryview(bytearray(65536)) if sink is None else sink
    end = _read_until(s, buf, b"\r\n")
    line = bytes(buf[:end])
    del buf[: end + 2]
    if line == b"$-1":
        raise RuntimeError(f"redis: no key {parts[1]!r}")
    if line.startswith(b"$"):
        _read_exact(s, buf, int(line[1:]) + 2, sink)
    elif line.startswith(b"-"):
        raise RuntimeError(line.decode())


def run_threads(nthreads: int, seconds: float, one) -> float:
    """Run ``one(state)`` in a loop in each thread for ``seconds``; return total ops/s."""
    counts = [0] * nthreads
    errors: list[BaseException] = []
    start = threading.Barrier(nthreads + 1)
    stop_at = [0.0]

    def loop(i: int) -> None:
        state = {"i": i, "n": 0}
        try:
            one(state, setup=True)
        finally:
            start.wait()
        try:
            while time.monotonic() < stop_at[0] and not errors:
                one(state)
                counts[i] += 1
        except BaseException as e:
            errors.append(e)
        finally:
            one(state, teardown=True)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    stop_at[0] = time.monotonic() + seconds
    t0 = time.monotonic()
    start.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts) / (time.monotonic() - t0)


def run_raw(port: int, seconds: float, conns: int, exchange) -> float:
    """Run ``exchange(state)`` on ``conns`` raw keep-alive connections; return ops/s.

    Each state holds its socket (``s``), a read buffer (``buf``), a 4 MiB body sink
    (``sink``), the thread index (``i``) and the operations done so far (``n``).
    """

    def one(st, setup=False, teardown=False):
        if setup:
            st["s"] = connect(port)
            st["buf"], st["sink"] = bytearray(), memoryview(bytearray(4 * MiB))
        elif teardown:
            st["s"].close()
        else:
            st["n"] += 1
            exchange(st)

    return run_threads(conns, seconds, one)


def large_http(port: int, op: str, size_name: str, seconds: float, conns: int) -> float:
    payload = os.urandom(SIZES[size_name])

    def exchange(st):
        path = f"/kv/b{size_name}" if op != "PUT" else f"/kv/p{st['i']}-{st['n']}-{size_name}"
        status = http_exchange(st["s"], st["buf"], st["sink"], op, path,
                               payload if op == "PUT" else None)  # fmt: skip
        if status not in (200, 201):
            raise RuntimeError(f"{op} {path}: {status}")

    return run_raw(port, seconds, conns, exchange)


def dedup_put(port: int, seconds: float, conns: int, expect: bool) -> float:
    """PUTs per second of a resident 14 MiB block: every one a dedup hit.

    ``expect`` False sends the body, as clients did before; True sends
    ``Expect: 100-continue`` and gets its 200 from the headers, no body moved. The server
    closes the connection after such an answer, so each of those PUTs opens its own.
    """
    payload = os.urandom(SIZES["14MiB"])
    path = "/kv/dedup-14MiB"
    if http_put_once(port, path, payload) not in (200, 201):
        raise RuntimeError(f"PUT {path} failed")

    def sent(st):
        status = http_exchange(st["s"], st["buf"], st["sink"], "PUT", path, payload)
        if status != 200:
            raise RuntimeError(f"dedup PUT {path}: {status}")

    if not expect:
        return run_raw(port, seconds, conns, sent)
    head = (f"PUT {path} HTTP/1.1\r\nHost: b\r\n{AUTH.get('line', '')}"
            f"Content-Length: {len(payload)}\r\nExpect: 100-continue\r\n\r\n").encode()  # fmt: skip
    sink = memoryview(bytearray(65536))

    def expecting(st, setup=False, teardown=False):
        if setup or teardown:
            return
        with connect(port) as s:
            s.sendall(head)
            buf = bytearray()
            end = _read_until(s, buf, b"\r\n\r\n")
            if int(buf[9:12]) != 200:  # a 100 Continue: not answered from the headers
                raise RuntimeError(f"dedup PUT {path} with Expect: {bytes(buf[:12])!r}")
            m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", bytes(buf[:end]))
            del buf[: end + 4]
            _read_exact(s, buf, int(m.group(1)) if m else 0, sink)

    return run_threads(conns, seconds, expecting)


def dedup_rows(port: int, seconds: float, repeat: int) -> dict[str, float]:
    """Dedup PUTs of 14 MiB, body sent against Expect, interleaved; medians (req/s)."""
    runs: dict[str, list[float]] = {"body sent": [], "Expect: 100-continue": []}
    for _ in range(repeat):
        runs["body sent"].append(dedup_put(port, seconds, 4, expect=False))
        runs["Expect: 100-continue"].append(dedup_put(port, seconds, 4, expect=True))
    return {kind: statistics.median(values) for kind, values in runs.items()}


def large_redis(port: int, op: str, size_name: str, seconds: float, conns: int) -> float:
    payload = os.urandom(SIZES[size_name])

    def exchange(st):
        key = f"b{size_name}".encode()
        if op == "GET":
            redis_cmd(st["s"], b"GET", key, buf=st["buf"], sink=st["sink"])
        elif op == "HEAD":
            redis_cmd(st["s"], b"STRLEN", key, buf=st["buf"], sink=st["sink"])
        else:
            k = f"p{st['i']}-{st['n']}-{size_name}".encode()
            redis_cmd(st["s"], b"SET", k, payload, buf=st["buf"], sink=st["sink"])

    return run_raw(port, seconds, conns, exchange)


# ---------------------------------------------------------------------------- wrk / redis-benchmark


WRK_PUT = """
counter = 0
thread_id = 0
local threads = {}
function setup(thread) thread:set("id", #threads); table.insert(threads, thread) end
function init(args) body = string.rep("x", %d) end
request = function()
  counter = counter + 1
  return wrk.format("PUT", "/kv/w" .. id .. "-" .. counter, nil, body)
end
"""


def ab_head_rate(port: int, size_name: str, seconds: float, conns: int) -> float:
    """HEAD requests/s with ApacheBench: wrk waits for a body after a HEAD answer."""
    url = f"http://127.0.0.1:{port}/kv/b{size_name}"
    args = ["ab", "-q", "-k", "-i", "-c", str(conns), "-t", str(max(1, round(seconds))),
            "-n", "10000000", *AUTH.get("args", []), url]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"Requests per second:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx responses:\s+(\d+)", out)
    failed = re.search(r"Failed requests:\s+(\d+)", out)
    if not m or bad or (failed and int(failed.group(1))):
        raise RuntimeError(f"ab failed: {out}")
    return float(m.group(1))


def wrk_rate(port: int, op: str, size_name: str, seconds: float, conns: int) -> float:
    if op == "HEAD":
        return ab_head_rate(port, size_name, seconds, conns)
    url = f"http://127.0.0.1:{port}/kv/b{size_name}"
    args = ["wrk", "-t", "1", "-c", str(conns), "-d", f"{max(1, round(seconds))}s",
            *AUTH.get("args", [])]  # fmt: skip
    script = None
    if op == "PUT":
        script = WRK_PUT % SIZES[size_name]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script or "")
    try:
        if script:
            args += ["-s", f.name]
        out = subprocess.run([*args, url], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if not m or bad:
        raise RuntimeError(f"wrk failed: {out}")
    return float(m.group(1))


def redis_bench_rate(port: int, op: str, size_name: str, seconds: float, conns: int) -> float:
    n = SIZES[size_name]
    cmd = {"GET": ["GET", f"b{size_name}"], "HEAD": ["STRLEN", f"b{size_name}"],
           "PUT": ["SET", "w:__rand_int__", "x" * n]}[op]  # fmt: skip
    # redis-benchmark runs a request count, not a duration: size it from a short probe.
    total = 20000
    args = ["redis-benchmark", "-p", str(port), "-c", str(conns), "-q", "--csv", "-r", "100000"]
    for _ in range(2):
        t0 = time.monotonic()
        out = subprocess.run([*args, "-n", str(total), *cmd], capture_output=True, text=True,
                             timeout=120).stdout  # fmt: skip
        took = time.monotonic() - t0
        if took >= seconds * 0.5:
            break
        total = int(total * seconds / max(took, 0.05))
    m = re.findall(r'"([\d.]+)"', out)
    if not m:
        raise RuntimeError(f"redis-benchmark failed: {out}")
    return float(m[0])


# ---------------------------------------------------------------------------- extra checks


def uss_under_load(workers: int, seconds: float) -> dict:
    """A fresh server's worker USS: idle, at the peak while 4 clients move 14 MiB blocks
    (PUTs, then GETs), and after."""
    from eg_kv.procs import private_memory

    with EgKv(workers) as srv:
        pids = srv.worker_pids()

        def uss() -> list[int]:  # the workers' own memory: their anonymous pages
            return [private_memory(pid) for pid in pids]

        idle = uss()
        peak = list(idle)
        done = threading.Event()

        def sample():
            while not done.is_set():
                for i, v in enumerate(uss()):
                    peak[i] = max(peak[i], v)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            large_http(srv.port, "PUT", "14MiB", seconds / 2, 4)
            srv.ensure("14MiB")
            large_http(srv.port, "GET", "14MiB", seconds / 2, 4)
        finally:
            done.set()
            sampler.join()
        time.sleep(3.0)  # a worker hands freed buffers back after a quiet second (app.py)
        after = uss()
    return {"idle_mib": [round(v / MiB, 1) for v in idle],
            "peak_mib": [round(v / MiB, 1) for v in peak],
            "after_mib": [round(v / MiB, 1) for v in after]}  # fmt: skip


def batch_vs_heads(srv: EgKv) -> dict:
    """1024 addresses: one POST /kv/batch/exists against 1024 HEADs on one connection."""
    addrs = [f"bx{i}" for i in range(1024)]
    for a in addrs[:512]:
        http_put_once(srv.port, f"/kv/{a}", b"x" * 100)
    body = json.dumps({"addresses": addrs}).encode()
    with connect(srv.port) as s:
        buf, sink = bytearray(), memoryview(bytearray(MiB))
        t0 = time.perf_counter()
        for a in addrs:
            http_exchange(s, buf, sink, "HEAD", f"/kv/{a}")
        heads = time.perf_counter() - t0
        rounds = 20
        t0 = time.perf_counter()
        for _ in range(rounds):
            assert http_exchange(s, buf, sink, "POST", "/kv/batch/exists", body) == 200
        batch = (time.perf_counter() - t0) / rounds
    return {"heads_ms": round(heads * 1000, 1), "batch_ms": round(batch * 1000, 2),
            "speedup": round(heads / batch, 1)}  # fmt: skip


# ---------------------------------------------------------------------------- main


def measure(server: Server, op: str, size_name: str, seconds: float) -> float:
    """Requests per second for one cell."""
    if op != "PUT":
        server.ensure(size_name)
    small = SIZES[size_name] <= 64 * KiB
    if isinstance(server, Redis):
        if small:
            return redis_bench_rate(server.port, op, size_name, seconds, 16)
        return large_redis(server.port, op, size_name, seconds, 4)
    if small or op == "HEAD":
        return wrk_rate(server.port, op, size_name, seconds, 16)
    return large_http(server.port, op, size_name, seconds, 4)


def fmt_rate(rate: float, size: int, op: str) -> str:
    if op == "HEAD" or size <= 64 * KiB:
        return f"{rate:,.0f} req/s"
    return f"{rate * size / MiB:,.0f} MiB/s"


def parse_cells(specs: list[str]) -> list[tuple[str, str]]:
    """``["GET:4KiB", ...]`` as (op, size) pairs; SystemExit naming the valid ones."""
    cells = []
    for spec in specs:
        op, _, size_name = spec.partition(":")
        if op.upper() not in OPS or size_name not in SIZES:
            raise SystemExit(f"bench_server: bad cell {spec!r}; use OP:SIZE with OP in "
                             f"{'/'.join(OPS)} and SIZE in {'/'.join(SIZES)}")  # fmt: skip
        cells.append((op.upper(), size_name))
    return cells


def quick_ab(args, worker_counts: list[int], cell, rates: dict) -> int:
    """Only the cells of ``--only``, eg-kv against the bare handler.

    The slab is first churned by 4 KiB and 1 MiB PUTs, as the full run's PUT cells leave it
    before the 14 MiB GETs, so large blocks lie on scattered pages here too.
    """
    cells = parse_cells(args.only)
    for workers in worker_counts:
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(s) for s in servers_for(args, workers)]
            for eg in servers[:-1]:  # eg-kv (and the baseline), churned alike
                wrk_rate(eg.port, "PUT", "4KiB", args.seconds, 16)
                large_http(eg.port, "PUT", "1MiB", args.seconds, 4)
            for op, size_name in cells:
                cell(servers, workers, op, size_name)
    print("\n".join(table(args, worker_counts, cells, rates, redis=False)[0]))
    return 0


def servers_for(args, workers: int) -> list[Server]:
    """eg-kv, the ``--baseline`` tree's eg-kv if given, and the bare handler (last)."""
    baseline = [EgKv(workers, Path(args.baseline).resolve(), BASELINE)] if args.baseline else []
    return [EgKv(workers), *baseline, Bare(workers)]


#: The kind of the ``--baseline`` tree's server in the tables.
BASELINE = "baseline"


def table(args, worker_counts, cells, rates, redis: bool) -> tuple[list[str], list[dict]]:
    """The markdown table of ``cells`` (and the JSON rows): eg-kv against the bare handler,
    the ``--baseline`` tree and redis where measured."""
    cols = ["eg-kv", "bare aiohttp", "eg-kv / bare"]
    if args.baseline:
        cols += ["baseline", "eg-kv / baseline"]
    if redis:
        cols += ["redis", "eg-kv / redis"]
    lines = ["| op | size | workers | " + " | ".join(cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]  # fmt: skip
    rows = []
    for op, size_name in cells:
        size = SIZES[size_name]
        for workers in worker_counts:
            eg = rates[("eg-kv", workers, op, size_name)]
            row = {"op": op, "size": size_name, "workers": workers, "eg_kv": eg}
            others = [("bare", rates[("bare aiohttp", workers, op, size_name)])]
            if args.baseline:
                others.append(("baseline", rates[(BASELINE, workers, op, size_name)]))
            if redis:
                others.append(("redis", rates[("redis", 1, op, size_name)]))
            out = [fmt_rate(eg, size, op)]
            for key, rate in others:
                row[key] = rate
                out += [fmt_rate(rate, size, op), f"{eg / rate:.2f}"]
            lines.append(f"| {op} | {size_name} | {workers} | " + " | ".join(out) + " |")
            rows.append(row)
    return lines, rows


def print_dedup(rates: dict[str, float], workers: int) -> None:
    """The PUT dedup 14MiB row: requests/s, and the logical bytes they stand for."""
    print(f"\n| PUT dedup 14MiB, {workers} workers, 4 clients | req/s | logical MiB/s |")
    print("|---|---|---|")
    for kind, rate in rates.items():
        print(f"| {kind} | {rate:,.0f} | {rate * 14:,.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement (default 2)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="N (default: cores)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell, median kept (3)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--only", nargs="+", metavar="OP:SIZE",
                    help="measure only these cells (e.g. GET:4KiB GET:14MiB) against the bare "
                         "handler, without redis and the memory checks: a quick A/B")  # fmt: skip
    ap.add_argument(
        "--dedup",
        action="store_true",
        help="measure only PUT dedup 14MiB, body sent against Expect: 100-continue",
    )
    ap.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="serve eg-kv with a tokens file of this many tenants; clients send one's token",
    )
    ap.add_argument(
        "--single-token",
        action="store_true",
        help="serve eg-kv with one EPISTEMIC_GRAPH_KVCACHE_TOKEN; clients send it (the "
        "baseline of --tenants)",
    )
    ap.add_argument(
        "--baseline",
        metavar="TREE",
        help="also run eg-kv from this source tree (e.g. `git archive <commit> | tar -x -C "
        "TREE`), interleaved with this one, and print eg-kv / baseline: today's against a "
        "commit's, in one run (it gets the clients' token as its one token)",
    )
    ap.add_argument(
        "--disk",
        metavar="SIZE",
        help="serve eg-kv (and the baseline) with a disk tier of SIZE (e.g. 1GiB) in a new "
        "directory under /var/tmp each: what the tier costs the slab's requests",
    )
    ap.add_argument("--bare-server", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.disk:
        DISK["capacity"] = args.disk
    if args.single_token:
        header = "Authorization: Bearer bench-single-token"
        AUTH.update(token="bench-single-token", bearer="bench-single-token",
                    line=header + "\r\n", args=["-H", header])  # fmt: skip
    if args.tenants:
        tmp = tempfile.mkdtemp(prefix="eg-kv-bench-tokens-")
        atexit.register(shutil.rmtree, tmp, True)
        path, token = tokens_file(args.tenants, tmp)
        header = f"Authorization: Bearer {token}"
        AUTH.update(file=path, bearer=token, line=header + "\r\n", args=["-H", header])
    if args.bare_server:
        bare_server(*args.bare_server)
        return 0
    for tool in ("wrk", "ab", "redis-server", "redis-benchmark"):
        if not shutil.which(tool):
            print(f"bench_server: {tool} is not on PATH (apt-get install redis-server wrk "
                  "apache2-utils)",
                  file=sys.stderr)  # fmt: skip
            return 1
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    results: dict = {"cells": [], "seconds": args.seconds, "repeat": args.repeat,
                     "cpus": os.cpu_count()}  # fmt: skip
    worker_counts = sorted({1, args.workers})
    rates: dict[tuple, float] = {}

    def cell(servers: list[Server], workers: int, op: str, size_name: str) -> None:
        # Interleave the servers and keep each one's median of --repeat runs: the machine
        # is shared, and load that comes and goes would otherwise favour one of them.
        runs: dict[str, list[float]] = {srv.kind: [] for srv in servers}
        for _ in range(args.repeat):
            for srv in servers:
                runs[srv.kind].append(measure(srv, op, size_name, args.seconds))
        for kind, values in runs.items():
            r = statistics.median(values)
            rates[(kind, workers, op, size_name)] = r
            print(f"  {kind:>12} x{workers} {op:4} {size_name:>5}: "
                  f"{fmt_rate(r, SIZES[size_name], op)}", file=sys.stderr)  # fmt: skip

    if args.only:
        return quick_ab(args, worker_counts, cell, rates)
    if args.dedup:
        with EgKv(args.workers) as eg:
            print_dedup(dedup_rows(eg.port, args.seconds, args.repeat), args.workers)
        return 0

    with Redis(1) as redis:
        for workers in worker_counts:
            with contextlib.ExitStack() as stack:
                servers = [stack.enter_context(s) for s in servers_for(args, workers)]
                eg = servers[0]
                servers += [redis] if workers == 1 else []
                for size_name in SIZES:
                    for op in OPS:
                        cell(servers, workers, op, size_name)
                if workers == args.workers:
                    results["batch_exists"] = batch_vs_heads(eg)
                    results["dedup_put_14MiB"] = dedup_rows(eg.port, args.seconds, args.repeat)
    results["uss"] = uss_under_load(args.workers, 4 * args.seconds)

    cells = [(op, size_name) for size_name in SIZES for op in OPS]
    lines, results["cells"] = table(args, worker_counts, cells, rates, redis=True)
    print("\n".join(lines))
    print(f"\nworker USS with 4 clients moving 14 MiB blocks: {results['uss']}")
    print(f"batch exists of 1024 vs 1024 HEADs on one connection: {results['batch_exists']}")
    print_dedup(results["dedup_put_14MiB"], args.workers)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
