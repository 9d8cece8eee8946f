"""Every assumption eg_kv.server._compat makes about aiohttp and prometheus_client, checked.

An upgrade that renames a private field or changes what it means fails here, with the
assumption named, rather than as a server that silently stops timing out connections.
A real aiohttp server on loopback, real sockets, the installed libraries.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import sys

import pytest
from aiohttp import web
from helpers.common import ROOT
from prometheus_client import Histogram

from eg_kv.server import _compat
from eg_kv.server.intake import BodyIntake
from eg_kv.slab.store import Slab


def test_installed_versions_are_the_tested_ones():
    tomllib = pytest.importorskip("tomllib")
    specifiers = pytest.importorskip("packaging.specifiers")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = next(d for d in deps if d.startswith("aiohttp"))
    assert declared == f"aiohttp{_compat.AIOHTTP_TESTED}", "keep pyproject and _compat in step"
    installed = importlib.metadata.version("aiohttp")
    assert installed in specifiers.SpecifierSet(_compat.AIOHTTP_TESTED), (
        f"aiohttp {installed} is outside the tested range {_compat.AIOHTTP_TESTED}: "
        "run this file and tests/server/test_server_hostile.py, then widen the range"
    )


def test_aiohttp_bounds_pipelined_requests():
    assert _compat.PIPELINE_QUEUE_MAX is not None and 0 < _compat.PIPELINE_QUEUE_MAX <= 64, (
        "aiohttp no longer bounds the requests it queues per connection: pause reading "
        "in eg_kv.server._compat.StampedHandler.data_received past a bound"
    )


def test_sent_response_looks_finished_to_aiohttp():
    resp = _compat.SentResponse(201, keep_alive=False, body_length=17)
    assert resp.prepared and resp.status == 201
    assert resp.keep_alive is False and resp.body_length == 17


def test_prometheus_histogram_parts():
    h = Histogram("compat_probe", "probe", buckets=(0.1, 1.0), registry=None)
    parts = _compat.histogram_parts(h)
    assert parts is not None, "prometheus_client moved a histogram's _buckets/_sum"
    buckets, total = parts
    assert len(buckets) == 3  # two bounds and +Inf
    buckets[1].inc(2)
    total.inc(1.5)
    samples = {(s.name, s.labels.get("le")): s.value for s in h.collect()[0].samples}
    assert (
        samples[("compat_probe_bucket", "1.0")] == 2 and samples[("compat_probe_sum", None)] == 1.5
    )


class _Probe(_compat.StampedHandler):
    """Records every handler the runner makes, to look at their state from outside."""

    __slots__ = ()
    made: list[_compat.StampedHandler] = []

    def __init__(self, manager, *, tag: str, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        assert tag == "probe"  # the runner's handler_kwargs reach the handler
        _Probe.made.append(self)


class _Runner(_compat.HandlerRunner):
    handler_class = _Probe

    def handler_kwargs(self) -> dict:
        return {"tag": "probe"}


async def _exercise_a_connection() -> None:
    gate = asyncio.Event()
    body_started = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        body_started.set()
        await gate.wait()
        return web.Response(text="ok")

    async def upload(request: web.Request) -> web.Response:
        body_started.set()
        return web.Response(text=str(len(await request.read())))

    async def held(request: web.Request) -> web.Response:
        body_started.set()
        await gate.wait()  # not consuming the body: aiohttp holds reading past its buffer
        return web.Response(text=str(len(await request.read())))

    app = web.Application(handler_args={"read_bufsize": 4096})
    app.router.add_get("/slow", slow)
    app.router.add_put("/up", upload)
    app.router.add_put("/held", held)
    runner = _Runner(app, keepalive_timeout=100)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(200):
            if _Probe.made:
                break
            await asyncio.sleep(0.01)
        (h,) = _Probe.made
        for name in _compat.HANDLER_PRIVATE:
            assert hasattr(h, name), f"aiohttp's RequestHandler has no {name} any more"
        assert h.waiting() and not h.head_arriving()
        opened = h.idle_since()
        assert abs(opened - loop.time()) < 1, "_next_keepalive_close_time - timeout != open"

        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # a partial head
        await writer.drain()
        await _until(lambda: h.head_arriving())
        # idle_since() is (open + timeout) - timeout: float rounding may put it an ulp or
        # two above the loop time the head arrived at, in the same millisecond tick.
        assert h.waiting() and h.head_at >= opened - 1e-6

        writer.write(b"\r\n")  # the head completes; the handler waits on the gate
        await body_started.wait()
        assert not h.waiting(), "_waiter is set while a request is handled"
        assert h.body_stalled_since(loop.time()) is None  # a GET: its (empty) body is complete
        before_answer = loop.time()
        gate.set()
        assert await _response(reader) == (200, b"ok")
        await _until(lambda: h.waiting())
        assert not h.head_arriving() and h.idle_since() >= before_answer - 0.01

        body_started.clear()
        writer.write(b"PUT /up HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        await body_started.wait()
        await _until(lambda: h.body_stalled_since(loop.time()) is not None)
        assert h.body_stalled_since(loop.time()) == h.rx_at, "_current_request moved"
        writer.write(b"67890")
        assert await _response(reader) == (200, b"10")
        await _until(lambda: h.waiting() and h.body_stalled_since(loop.time()) is None)

        body_started.clear()
        gate.clear()
        writer.write(b"PUT /held HTTP/1.1\r\nHost: x\r\nContent-Length: 65536\r\n\r\n")
        writer.write(b"x" * 65536)
        await body_started.wait()
        await _until(lambda: h._reading_paused)  # the server holds reading, not the client
        now = loop.time()
        assert h.body_stalled_since(now) is None and h.held_at == now
        gate.set()
        assert await _response(reader) == (200, b"65536")
    finally:
        writer.close()
        await runner.cleanup()


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One whole response: its status and body (framed by Content-Length; reading up to
    an expected body instead stopped inside the Date header whenever the clock said 10)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length: *(\d+)\r$", head).group(1))
    return int(head[9:12]), await reader.readexactly(length)


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(30)
def test_handler_state_reads_mean_what_eg_kv_assumes():
    _Probe.made.clear()
    asyncio.run(_exercise_a_connection())


def test_handler_runner_builds_our_handlers_on_uvloop_too():
    uvloop = pytest.importorskip("uvloop")
    _Probe.made.clear()
    if sys.version_info >= (3, 12):
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        with runner:
            runner.run(_exercise_a_connection())
    else:
        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(_exercise_a_connection())
        finally:
            loop.close()


class _Taker(_compat.StampedHandler):
    """A handler whose lane takes every PUT's body into a real slab (eg_kv/server/intake.py)
    and answers 201 when it is in: what :meth:`StampedHandler.take_body` assumes of
    aiohttp's parser and of the loop's transports, checked on each loop."""

    __slots__ = ()
    slab: Slab
    reads: list[int] = []

    def __init__(self, manager, **kwargs) -> None:
        super().__init__(manager, lane=self._take, **kwargs)

    def _take(self, conn, message, payload, unfed: int = 0) -> bool:
        if message.method != "PUT" or payload.is_eof():
            return False
        length = int(message.headers["Content-Length"])
        handle = self.slab.begin_put(message.path[1:], length)

        def ended(why, lost) -> None:
            assert why is None and not lost
            handle.commit()
            conn.transport.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
            conn.lane_answered()

        intake = _CountingIntake(conn, handle, ended)
        conn.take_body(intake)
        intake.feed(payload.read_nowait(-1))
        return True


class _CountingIntake(BodyIntake):
    __slots__ = ()

    def buffer_updated(self, nbytes: int) -> None:
        _Taker.reads.append(nbytes)  # the socket read into the intake's own buffer
        super().buffer_updated(nbytes)


class _TakerRunner(_compat.HandlerRunner):
    handler_class = _Taker


async def _take_bodies() -> None:
    async def echo_length(request: web.Request) -> web.Response:
        return web.Response(text=str(len(await request.read())))

    app = web.Application()
    app.router.add_post("/echo", echo_length)
    app.router.add_get("/x", echo_length)
    runner = _TakerRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = os.urandom(3 * 1024 * 1024 + 5)
    try:
        # The head alone, then the body in pieces, and a request right behind its last
        # byte: the body lands in the slab, the request after it reaches aiohttp whole.
        writer.write(b"PUT /b1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        for at in range(0, len(body), 700_000):
            writer.write(body[at : at + 700_000])
            await writer.drain()
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert await _response(reader) == (201, b"")
        assert await _response(reader) == (200, b"3")
        assert _Taker.slab.get("b1") == body and sum(_Taker.reads) == len(body)
        # The head and 200 KiB of the body in one read: the head is parsed alone
        # (SPLIT_READS_OVER), the rest fed to the intake. The parser that replaced the one
        # midway through the body keeps aiohttp's limits: a header line over 8190 bytes.
        writer.write(b"PUT /b2 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body[:200_000])  # fmt: skip
        writer.write(body[200_000:] + b"GET /x HTTP/1.1\r\nHost: x\r\nX-Long: %s\r\n\r\n"
                     % (b"y" * 9000))  # fmt: skip
        assert await _response(reader) == (201, b"")
        assert _Taker.slab.get("b2") == body
        assert (await _response(reader))[0] == 400
    finally:
        writer.close()
        await runner.cleanup()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_body_taken_past_the_parser_lands_and_the_connection_goes_on(loop, slab_name):
    factory = asyncio.new_event_loop
    if loop == "uvloop":
        factory = pytest.importorskip("uvloop").new_event_loop
    _Taker.slab = Slab.create(slab_name, 32 * 1024 * 1024, max_block_size=8 * 1024 * 1024)
    _Taker.reads = []
    event_loop = factory()
    try:
        event_loop.run_until_complete(_take_bodies())
    finally:
        event_loop.close()
        _Taker.slab.close()
