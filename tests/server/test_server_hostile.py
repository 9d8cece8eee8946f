"""Hostile clients at the connection level, with real misbehaving sockets against a real server.

Clients that pipeline and never read, drip a request head, stall an upload, sit idle,
open thousands of connections that drip (slowloris), or send a malformed request
carrying a secret: the worker's memory stays bounded, every wait has a limit, the slab
gets its pages back, and honest clients keep being served.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from helpers.common import ROOT, wait_for
from helpers.server_http import raw_exchange, request, stats, status_of
from helpers.server_procs import gone

from eg_kv.server.connections import (
    DEFAULT_MAX_CONNECTIONS,
    FD_RESERVE,
    LOG_EVERY_S,
    fd_connection_ceiling,
    resolve_max_connections,
)

MiB = 1024 * 1024


def _worker(srv) -> psutil.Process:
    """The only worker of a one-worker server."""
    (child,) = [p for p in psutil.Process(srv.pid).children() if p.status() != "zombie"]
    return child


def _metric(srv, name: str) -> float | None:
    """The sum of a metric's samples in /metrics, or None if it is absent."""
    text = request(srv, "GET", "/metrics").text
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


def _connect(srv, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:  # before connect, so the window is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect((srv.host, srv.port))
    return s


def _closed_by_peer(s: socket.socket, wait: float = 0.0) -> bool:
    """Whether the server closed ``s`` (EOF or reset), reading whatever it sent first."""
    while select.select([s], [], [], wait)[0]:
        try:
            if not s.recv(65536):
                return True
        except OSError:
            return True
    return False


def _read_answers(s: socket.socket, count: int, body: bytes) -> int:
    """Read ``count`` pipelined answers from ``s``; each must be 200 with ``body``.

    Returns how many were read whole before the connection ended.
    """
    buf, done = bytearray(), 0
    s.settimeout(30)
    while done < count:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end])
            n = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            if len(buf) >= end + 4 + n:
                assert head.startswith(b"HTTP/1.1 200"), head
                assert buf[end + 4 : end + 4 + n] == body, f"answer {done} has wrong bytes"
                del buf[: end + 4 + n]
                done += 1
                continue
        try:
            chunk = s.recv(4 * MiB)
        except OSError:
            return done
        if not chunk:
            return done
        buf += chunk
    return done


def _peak_growth(proc: psutil.Process, baseline: int, seconds: float) -> int:
    """The largest USS growth over ``baseline`` seen while sampling for ``seconds``."""
    peak, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, proc.memory_full_info().uss - baseline)
        time.sleep(0.05)
    return peak


# ---------------------------------------------------------------------------- back-pressure


def _pipeline_unread(srv, block: bytes, count: int, tag: str) -> None:
    """Pipeline ``count`` GETs of ``block`` without reading; USS growth < 32 MiB; then read.

    Before back-pressure, every answer went into the transport's buffer at once.
    """
    assert request(srv, "PUT", f"/kv/{tag}", block).status == 201
    worker = _worker(srv)
    assert request(srv, "GET", f"/kv/{tag}").body == block  # warm the worker's buffers
    baseline = worker.memory_full_info().uss
    s = _connect(srv, rcvbuf=64 * 1024)
    req = f"GET /kv/{tag} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    # The server stops reading once its queue of parsed requests is full: send from a thread.
    sender = threading.Thread(target=s.sendall, args=(req * count,), daemon=True)
    sender.start()
    try:
        growth = _peak_growth(worker, baseline, 3.0)
        assert growth < 32 * MiB, f"worker grew by {growth / MiB:.0f} MiB"
        assert _read_answers(s, count, block) == count
        sender.join(10)
        assert not sender.is_alive()
    finally:
        s.close()


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_pipelined_large_gets_unread_keep_worker_memory_bounded(server_factory):
    srv = server_factory(workers=1, capacity="32MiB")
    _pipeline_unread(srv, os.urandom(MiB), 300, "pipe-1m")


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_pipelined_small_requests_unread_stay_bounded(server_factory):
    srv = server_factory(workers=1, capacity="32MiB")
    _pipeline_unread(srv, os.urandom(4096), 12_000, "pipe-4k")


# ---------------------------------------------------------------------------- time limits

TIMEOUTS = ("--header-timeout", "1", "--body-timeout", "2", "--keepalive-timeout", "2")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_head_dripping_past_the_header_timeout_gets_408_and_is_closed(server_factory):
    srv = server_factory(workers=1, extra=TIMEOUTS)
    s = _connect(srv)
    start = time.monotonic()
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    got = b""
    while time.monotonic() - start < 10:  # drip one byte every 0.2 s, for at most 10 s
        try:
            s.sendall(b"X")
        except OSError:
            break
        if select.select([s], [], [], 0.2)[0]:
            with contextlib.suppress(OSError):
                got = s.recv(4096)
            break
    elapsed = time.monotonic() - start
    s.close()
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b"request head not complete within 1 s" in got
    assert f"X-EgKv-Worker: {_worker(srv).pid}\r\n".encode() in got, got  # as every answer
    assert 0.9 < elapsed < 6, elapsed
    # An honest request on a new connection is unaffected.
    assert request(srv, "GET", "/healthz").status == 200
    assert _metric(srv, "eg_kv_connection_timeouts_total") >= 1


@pytest.mark.timeout(60)
def test_a_head_that_grows_past_64_kib_gets_431_and_costs_the_worker_little(server_factory):
    """127 header lines of 8,000 bytes and no end, from no token: aiohttp's own limits
    let each such head hold ~2 MiB of the worker until the header timeout (10 s), times
    every connection it takes. Now reading stops at 64 KiB and the sweeper answers 431."""
    srv = server_factory(workers=1)
    worker = _worker(srv)
    baseline = worker.memory_full_info().uss
    head = b"GET /kv/x HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-%03d: %s\r\n" % (i, b"v" * 8000) for i in range(127)
    )
    socks = [_connect(srv) for _ in range(40)]
    for s in socks:
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.sendall(head)  # as much as the server takes
    try:
        growth = _peak_growth(worker, baseline, 1.5)
        assert growth < 24 * MiB, f"40 endless heads grew the worker by {growth / MiB:.0f} MiB"
        for s in socks:
            s.setblocking(True)
            assert select.select([s], [], [], 5)[0], "no answer within 5 s"
            got = s.recv(4096)
            assert got.startswith(b"HTTP/1.1 431"), got
            assert b"request head over 64 KiB" in got
    finally:
        for s in socks:
            s.close()
    # A long honest head (12 KiB, as an engine's 1,024 token ids) and a keep-alive
    # connection that sends many requests are served.
    long = {"X-Long-A": "a" * 6000, "X-Long-B": "b" * 6000}
    assert request(srv, "GET", "/healthz", headers=long).status == 200
    assert request(srv, "PUT", "/kv/many", b"m" * 100).status == 201
    s = _connect(srv)
    s.sendall(b"GET /kv/many HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)  # 70 KB in one go
    assert _read_answers(s, 2000, b"m" * 100) == 2000
    s.close()


@pytest.mark.timeout(60)
def test_a_body_pipelined_behind_an_unread_answer_is_not_buffered(server_factory):
    """A GET answer left unread, then a PUT with its body pipelined behind it: aiohttp
    read on and held ~2.2 MiB of that body per connection while nothing read it."""
    srv = server_factory(workers=1, capacity="32MiB")
    assert request(srv, "PUT", "/kv/big8", os.urandom(8 * MiB)).status == 201
    worker = _worker(srv)
    assert len(request(srv, "GET", "/kv/big8").body) == 8 * MiB  # warm the worker
    baseline = worker.memory_full_info().uss
    junk = os.urandom(4 * MiB)
    socks = []
    try:
        for i in range(20):
            s = _connect(srv, rcvbuf=4096)
            s.sendall(b"GET /kv/big8 HTTP/1.1\r\nHost: x\r\n\r\n")
            s.sendall(b"PUT /kv/next%d HTTP/1.1\r\nHost: x\r\nContent-Length: 60000000\r\n"
                      b"\r\n" % i)  # fmt: skip
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.sendall(junk)  # as much as the server takes
            socks.append(s)
        growth = _peak_growth(worker, baseline, 2.0)
        assert growth < 16 * MiB, f"20 pipelined bodies grew the worker by {growth / MiB:.0f} MiB"
    finally:
        for s in socks:
            s.close()
    # A pipelined PUT behind a GET that is read is served whole.
    s = _connect(srv)
    body = os.urandom(3 * MiB)
    s.sendall(b"GET /kv/big8 HTTP/1.1\r\nHost: x\r\n\r\n"
              b"PUT /kv/after HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
              + body)  # fmt: skip
    got = b""
    while b"HTTP/1.1 201" not in got:
        chunk = s.recv(4 * MiB)
        assert chunk, got[-200:]
        got += chunk
    s.close()
    assert request(srv, "GET", "/kv/after").body == body


@pytest.mark.timeout(60)
def test_a_head_behind_a_long_poll_is_held_to_the_head_limits(server_factory):
    """While a request was handled (a long poll of the event log), the next request's head
    was counted for nothing and timed by nothing: 1 MB of header lines sat in the worker
    (1.8 MiB a connection) past the header timeout. Now such a connection is cut at
    64 KiB, and one whose head is left unfinished at the header timeout, the poll in hand
    or not (cut, with no answer: the poll would take one for its own). Empty lines
    between requests start no head."""
    srv = server_factory(workers=1, extra=TIMEOUTS)
    after = request(srv, "GET", "/kv/events?limit=1").json()["next"]
    poll = b"GET /kv/events?since=%d&wait=30 HTTP/1.1\r\nHost: x\r\n\r\n" % after
    big, small, blank = _connect(srv), _connect(srv), _connect(srv)
    for s in (big, small, blank):
        s.sendall(poll)
    time.sleep(0.2)  # the polls in hand (a head sent with them would be the parser's)
    big.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        big.sendall(
            b"GET /kv/x HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%03d: %s\r\n" % (i, b"v" * 8000) for i in range(127))
        )
    small.sendall(b"GET /kv/x HTTP/1.1\r\nHost: x\r\n")  # and nothing more
    blank.sendall(b"\r\n")
    start = time.monotonic()
    try:
        for s in (big, small):
            s.setblocking(True)
            assert select.select([s], [], [], 10)[0], "not cut within 10 s"
            try:
                got = s.recv(4096)
            except ConnectionResetError:
                got = b""
            assert got == b"", got  # cut: no answer the poll would take for its own
        assert time.monotonic() - start < 6  # the header timeout (1 s), not the poll's 30
        assert not select.select([blank], [], [], 2.0)[0]  # twice the header timeout
    finally:
        for s in (big, small, blank):
            s.close()


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_head_sent_with_the_connection_then_stalled_gets_408(server_factory):
    """A partial head in the same instant as the connection is a head, not keep-alive idle."""
    srv = server_factory(workers=1, extra=("--header-timeout", "1", "--keepalive-timeout", "60"))
    for _ in range(3):
        s = _connect(srv)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        assert select.select([s], [], [], 10)[0], "no answer within 10 s"
        got = s.recv(4096)
        s.close()
        assert got.startswith(b"HTTP/1.1 408"), got


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_answer_refused_before_its_body_gets_no_second_answer(server_factory):
    """aiohttp lingers over the unread body after the 400: that is no head being sent."""
    srv = server_factory(workers=1, extra=TIMEOUTS)
    s = _connect(srv)
    s.sendall(b"PUT /kv/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
    assert select.select([s], [], [], 10)[0], "no answer"
    got = s.recv(4096)
    s.sendall(b"x" * 1000)  # body bytes aiohttp drains after the answer: not a head
    deadline = time.monotonic() + 3  # three header timeouts
    while time.monotonic() < deadline:
        if select.select([s], [], [], deadline - time.monotonic())[0]:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    s.close()
    assert status_of(got) == 400 and got.count(b"HTTP/1.1 ") == 1, got


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_idle_keepalive_connection_is_closed_after_the_keepalive_timeout(server_factory):
    srv = server_factory(workers=1, extra=TIMEOUTS)
    s = _connect(srv)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    answered = time.monotonic()
    closed = _closed_by_peer(s, wait=10)
    elapsed = time.monotonic() - answered
    s.close()
    assert closed, "the idle connection was still open after 10 s"
    # The keep-alive limit (2 s), not the header limit (1 s), applies to an idle connection.
    assert 1.8 < elapsed < 7, elapsed


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_stalled_upload_is_cut_and_its_pages_come_back(server_factory):
    srv = server_factory(workers=1, capacity="64MiB", extra=TIMEOUTS)
    free = stats(srv)["free_bytes"]
    s = _connect(srv)
    s.sendall(b"PUT /kv/stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 16777216\r\n\r\n")
    s.sendall(os.urandom(MiB))  # then nothing: the upload stalls
    wait_for(lambda: stats(srv)["free_bytes"] < free, timeout=1.5, what="pages reserved")
    start = time.monotonic()
    assert _closed_by_peer(s, wait=15), "the stalled upload's connection was never closed"
    assert time.monotonic() - start < 10
    s.close()
    wait_for(lambda: stats(srv)["free_bytes"] == free, timeout=5, what="the pages freed")
    assert request(srv, "GET", "/kv/stalled").status == 404
    check = subprocess.run(
        [sys.executable, "-m", "workers", "check", "--slab-name", srv.slab_name],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0 and "is clean" in check.stdout, check.stdout + check.stderr
    assert _metric(srv, "eg_kv_connection_timeouts_total") >= 1


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_client_that_never_reads_its_answers_is_cut(server_factory):
    srv = server_factory(workers=1, capacity="32MiB", extra=TIMEOUTS)
    block = os.urandom(MiB)
    assert request(srv, "PUT", "/kv/unread", block).status == 201
    s = _connect(srv, rcvbuf=64 * 1024)
    s.sendall(b"GET /kv/unread HTTP/1.1\r\nHost: x\r\n\r\n" * 32)
    wait_for(lambda: (_metric(srv, 'eg_kv_connection_timeouts_total{limit="send"}') or 0) >= 1,
             timeout=15, what="the send limit to cut the connection")  # fmt: skip
    assert _read_answers(s, 32, block) < 32  # cut short: the rest never went out
    s.close()
    assert request(srv, "GET", "/kv/unread").body == block


def _unreading(srv) -> socket.socket:
    """A client that never reads: a 536-byte MSS (so the server's kernel send buffer stays
    small, as over a real network) and a 4 KiB receive window."""
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect((srv.host, srv.port))
    return s


@pytest.mark.timeout(90)
def test_a_close_whose_answers_never_flush_is_cut_after_the_send_limit(server_factory):
    # aiohttp closes a connection after a `Connection: close` answer (or a parse error's)
    # with transport.close(), which waits for the buffer to flush. With a few KiB left
    # (under the 64 KiB mark: writing never paused) nothing timed it: the connection
    # stayed open and counted busy for as long as the client kept its socket (before the
    # fix: eg_kv_connections_open still above 1 20 s on, ten times the send limit).
    srv = server_factory(workers=1, extra=TIMEOUTS)
    req = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    clients = []
    try:
        for k in range(1100, 1310, 10):  # one of these leaves its close a few KiB short
            s = _unreading(srv)
            clients.append(s)
            s.sendall(req * (k - 1) + last)
        wait_for(lambda: _metric(srv, "eg_kv_connections_open") == 1, timeout=20,
                 what="every unflushed close to be cut")  # fmt: skip
    finally:
        for s in clients:
            s.close()


@pytest.mark.timeout(60)
def test_a_408_to_a_connection_holding_an_unread_answer_frees_it(server_factory):
    # The sweeper's 408 (or 431) of a waiting connection wrote its one line and closed,
    # waiting for a buffer that held an unread answer, after taking the connection out of
    # its registry: the socket and the answer stayed, outside the cap and every limit
    # (before the fix: the server's sockets still open 5 s after the 408s).
    srv = server_factory(workers=1, extra=("--header-timeout", "1", "--body-timeout", "30",
                                           "--keepalive-timeout", "30"))  # fmt: skip
    assert request(srv, "PUT", "/kv/unread408", os.urandom(MiB // 2)).status == 201
    worker = _worker(srv)
    clients = []
    try:
        for _ in range(4):
            s = _unreading(srv)
            clients.append(s)
            s.sendall(b"GET /kv/unread408 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"  # answered, not read
        for s in clients:
            s.sendall(b"GET /hea")  # the start of a next head, and nothing more
        wait_for(lambda: (_metric(srv, 'eg_kv_connection_timeouts_total{limit="header"}') or 0)
                 >= 4, timeout=15, what="four 408s")  # fmt: skip
        ports = {s.getsockname()[1] for s in clients}
        wait_for(lambda: not ports & {c.raddr[1] for c in worker.net_connections() if c.raddr},
                 timeout=5, what="the 408'd connections to let their sockets go")  # fmt: skip
    finally:
        for s in clients:
            s.close()


def _send_some(s: socket.socket, data: bytes, most: int) -> None:
    """Send ``data`` over and over, up to ``most`` bytes or until the server stops taking it."""
    s.settimeout(0.5)
    with contextlib.suppress(OSError):  # a timeout (nothing read), or the server closed
        sent = 0
        while sent < most:
            sent += s.send(data)


@pytest.mark.timeout(60)
def test_a_body_on_a_route_that_reads_none_is_refused_not_buffered(server_factory):
    # A GET (or DELETE, or long poll) with a body had it read into aiohttp's buffer up to
    # 2 MiB while its handler ran, for nothing (before the fix: 20 connections grew the
    # worker by ~40 MiB, and each GET got its 200).
    srv = server_factory(workers=1, capacity="64MiB")
    assert request(srv, "PUT", "/kv/bodied", os.urandom(16 * MiB)).status == 201
    worker = _worker(srv)
    baseline = worker.memory_full_info().uss
    clients = []
    try:
        for _ in range(20):
            s = _connect(srv, rcvbuf=4096)
            clients.append(s)
            s.sendall(b"GET /kv/bodied HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
            _send_some(s, b"y" * (256 * 1024), 3 * MiB)
        growth = worker.memory_full_info().uss - baseline
        assert growth < 8 * MiB, f"worker grew by {growth / MiB:.0f} MiB"
        for s in clients:
            s.settimeout(10)
            got = s.recv(4096)
            assert got.startswith(b"HTTP/1.1 400"), got[:200]
            assert b"GET /kv/bodied takes no request body" in got
            assert _closed_by_peer(s, wait=5)
    finally:
        for s in clients:
            s.close()
    delete = b"DELETE /kv/bodied HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked = raw_exchange(srv.port, delete + b"5\r\nhello\r\n0\r\n\r\n")
    assert status_of(chunked) == 400 and b"takes no request body" in chunked, chunked
    assert request(srv, "HEAD", "/kv/bodied").status == 200  # neither touched the block


def _read_slowly(s: socket.socket, want: int, rate: float, stop_after: int | None = None) -> int:
    """Read up to ``want`` bytes at ``rate`` bytes/s (64 KiB at a time); stop reading
    (without closing) after ``stop_after`` bytes. Returns the bytes read before EOF/reset."""
    got, step, start = 0, 64 * 1024, time.monotonic()
    s.settimeout(30)
    while got < want and (stop_after is None or got < stop_after):
        try:
            chunk = s.recv(step)
        except OSError:
            return got
        if not chunk:
            return got
        got += len(chunk)
        ahead = got / rate - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    return got


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_slow_steady_reader_of_a_large_answer_is_not_cut_but_one_that_stops_is(server_factory):
    """The send limit cuts an answer that moves no byte, not one that is read slowly.

    A 14 MiB GET goes out in 4 MiB batches; the transport stays paused while a batch
    drains, so before the fix a reader at 2 MiB/s was cut after the first batch.
    """
    srv = server_factory(workers=1, capacity="64MiB", extra=("--body-timeout", "1"))
    block = os.urandom(14 * MiB)
    assert request(srv, "PUT", "/kv/slow-read", block).status == 201
    head_len = len(b"HTTP/1.1 200 OK\r\n")  # at least; the whole answer is head + body
    s = _connect(srv, rcvbuf=64 * 1024)
    s.sendall(b"GET /kv/slow-read HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    got = _read_slowly(s, 15 * MiB, rate=2 * MiB)
    s.close()
    assert got > len(block) + head_len, f"cut after {got / MiB:.1f} MiB"
    assert not _metric(srv, 'eg_kv_connection_timeouts_total{limit="send"}')
    # A reader that stops after 1 MiB is still cut by the same limit.
    s = _connect(srv, rcvbuf=64 * 1024)
    s.sendall(b"GET /kv/slow-read HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _read_slowly(s, 15 * MiB, rate=2 * MiB, stop_after=MiB) < 2 * MiB
    wait_for(lambda: (_metric(srv, 'eg_kv_connection_timeouts_total{limit="send"}') or 0) >= 1,
             timeout=15, what="the send limit to cut the stopped reader")  # fmt: skip
    s.close()


# ---------------------------------------------------------------------------- slowloris

_SLOWLORIS = textwrap.dedent("""
    import resource, socket, sys, time
    port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    end = time.monotonic() + seconds
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    time.sleep(0.3)
    for s in socks:
        try:
            s.send(b"GET /healthz HTTP/1.1\\r\\nX-Drip: ")
        except OSError:
            pass
    print("connected", flush=True)
    while time.monotonic() < end:  # one byte per connection every half second
        for s in socks:
            try:
                s.send(b"a")
            except OSError:
                pass
        time.sleep(0.5)
""")


@contextlib.contextmanager
def _soft_fd_limit(n: int):
    """Lower this process's soft fd limit (children inherit it) for the duration."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(90)
def test_slowloris_does_not_take_down_healthz_or_honest_clients(server_factory):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2300:
        pytest.skip("needs a hard fd limit of at least 2300 for the load")
    # A common default: a soft limit of 1024 that the server must raise itself.
    with _soft_fd_limit(1024):
        srv = server_factory(workers=2, capacity="64MiB")
    load = subprocess.Popen(
        [sys.executable, "-c", _SLOWLORIS, str(srv.port), "2100", "12"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert load.stdout.readline().strip() == "connected"
        block = os.urandom(256 * 1024)
        for i in range(5):
            start = time.monotonic()
            reply = request(srv, "GET", "/healthz", timeout=5)
            took = time.monotonic() - start
            assert reply.status == 200 and took < 1.0, (reply, took)
            assert request(srv, "PUT", f"/kv/honest-{i}", block, timeout=5).status == 201
            assert request(srv, "GET", f"/kv/honest-{i}", timeout=5).body == block
        assert load.poll() is None, "the load ended before the checks"
    finally:
        load.kill()
        load.wait(10)


# ---------------------------------------------------------------------------- the cap


@pytest.mark.timeout(60)
def test_connections_over_the_cap_shed_the_oldest_idle_ones(server_factory):
    srv = server_factory(workers=1, extra=("--max-connections", "20"))
    idle = []
    for i in range(30):
        s = _connect(srv)
        if i % 2:  # half of them drip a head, half say nothing: both are idle
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
        idle.append(s)
    try:
        wait_for(lambda: all(_closed_by_peer(s) for s in idle[:10]), timeout=10,
                 what="the 10 oldest idle connections to be shed")  # fmt: skip
        first_shed = time.monotonic()
        block = os.urandom(4096)
        for i in range(3):  # the first one, over the cap, sheds the next oldest (idle[10])
            assert request(srv, "PUT", f"/kv/capped-{i}", block).status == 201
            assert request(srv, "GET", f"/kv/capped-{i}").body == block
        wait_for(lambda: _closed_by_peer(idle[10]), timeout=5, what="idle[10] to be shed")
        assert not any(_closed_by_peer(s) for s in idle[11:]), "a newer idle one was shed"
        assert _metric(srv, "eg_kv_connections_shed_total") >= 11
        assert 1 <= _metric(srv, "eg_kv_connections_open") <= 20
        line = "shed (the oldest idle, at --max-connections 20)"
        wait_for(lambda: line in srv.log(), timeout=5, what="the shed log line")
        lines = srv.log().count(line)
        assert lines <= 1 + (time.monotonic() - first_shed) // LOG_EVERY_S, srv.log()
    finally:
        for s in idle:
            s.close()


@pytest.mark.timeout(60)
def test_a_worker_whose_connections_are_all_busy_answers_503_with_retry_after(server_factory):
    srv = server_factory(workers=1, extra=("--max-connections", "2"))
    busy = []
    for i in range(2):  # two uploads in flight: their handlers wait for the rest
        s = _connect(srv)
        busy.append(s)
        s.sendall(f"PUT /kv/busy-{i} HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n"
                  "Expect: 100-continue\r\n\r\n".encode())  # fmt: skip
        got = s.recv(1000)
        assert got.startswith(b"HTTP/1.1 100"), (i, got)  # its handler runs
        s.sendall(b"x" * 1000)
    try:
        answer = raw_exchange(srv.port, b"GET /healthz HTTP/1.1\r\n\r\n")
        assert status_of(answer) == 503, answer
        assert b"Retry-After: 1\r\n" in answer and b"--max-connections" in answer
        assert f"X-EgKv-Worker: {_worker(srv).pid}\r\n".encode() in answer, answer
        assert not any(_closed_by_peer(s) for s in busy)  # busy ones are never shed
    finally:
        for s in busy:
            s.close()


# ---------------------------------------------------------------------------- small things


def test_malformed_request_answer_and_log_never_echo_the_request(server_factory):
    srv = server_factory(workers=1)
    secret = "s3cr3t-T0KEN-do-not-echo"
    bad_requests = [
        f"GET /kv/x HTTP/1.1\r\nAuthorization: Bearer {secret}\x01\r\n\r\n",
        f"GET /kv/x HTTP/1.1\r\nAuthorization : Bearer {secret}\r\n\r\n",
        f"GET /kv/x HTTP/1.1\r\nX-{secret}\x7f: 1\r\nAuthorization: Bearer {secret}\r\n\r\n",
    ]
    missing_host = raw_exchange(srv.port, b"PUT /kv/x HTTP/1.1\r\nExpect: 100-continue\r\n\r\n")
    assert b"malformed request: Missing 'Host' header in request." in missing_host
    for raw in bad_requests:
        answer = raw_exchange(srv.port, raw.encode())
        assert status_of(answer) == 400, answer
        body = answer.split(b"\r\n\r\n", 1)[1]
        assert body.startswith(b"malformed request: ") and body.count(b"\n") == 1, body
        assert secret.encode() not in answer
    assert request(srv, "GET", "/healthz").status == 200  # the worker is fine
    assert secret not in srv.log()


def test_every_503_carries_retry_after():
    from eg_kv.server.answers import error_response

    assert error_response(503, "busy").headers["Retry-After"] == "1"
    assert error_response(503, "busy", {"Retry-After": "5"}).headers["Retry-After"] == "5"
    assert "Retry-After" not in error_response(507, "full").headers


def test_worker_raises_its_soft_fd_limit_to_the_hard_one(server_factory):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= 1024:
        pytest.skip("the hard fd limit leaves nothing to raise")
    with _soft_fd_limit(1024):
        srv = server_factory(workers=1)
    assert _worker(srv).rlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    assert psutil.Process(srv.pid).rlimit(resource.RLIMIT_NOFILE)[0] == 1024  # only workers


def test_connection_cap_stays_below_the_fd_limit():
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    ceiling = fd_connection_ceiling(soft)
    assert 2 * ceiling + FD_RESERVE <= soft  # two fds per connection, and the reserve
    assert resolve_max_connections(0) == min(DEFAULT_MAX_CONNECTIONS, ceiling)
    assert resolve_max_connections(10) == 10
    assert resolve_max_connections(10**9) == ceiling  # lowered, with a warning


def test_connection_flags_reach_the_settings_and_bad_values_are_refused():
    from eg_kv.config import settings_from_env
    from eg_kv.errors import ConfigError
    from workers.__main__ import SERVE_FLAGS, build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--header-timeout",
            "3",
            "--body-timeout",
            "4",
            "--keepalive-timeout",
            "5",
            "--max-connections",
            "6",
        ]
    )
    s = settings_from_env({}, **{k: getattr(args, k) for k in SERVE_FLAGS})
    assert (s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s) == (3, 4, 5)
    assert s.max_connections == 6
    defaults = settings_from_env({})
    assert (defaults.header_timeout_s, defaults.body_timeout_s) == (10, 30)
    assert (defaults.keepalive_timeout_s, defaults.max_connections) == (75, 0)
    for bad in ({"body_timeout_s": 0}, {"header_timeout_s": -1}, {"max_connections": -1}):
        with pytest.raises(ConfigError, match="--"):
            settings_from_env({}, **bad)


def test_a_killed_workers_open_connections_leave_the_gauge(server_factory):
    """eg_kv_connections_open sums live workers only: a SIGKILLed worker's last value goes
    when the supervisor reaps it (prometheus_client keeps a dead process's gauge file)."""
    srv = server_factory(workers=2)
    socks: dict[int, list[socket.socket]] = {}
    try:
        for _ in range(24):  # keep-alive connections, each asked which worker holds it
            s = _connect(srv)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(4096)
            pid = int(re.search(rb"X-EgKv-Worker: (\d+)", head).group(1))
            socks.setdefault(pid, []).append(s)
        victim = max(socks, key=lambda p: len(socks[p]))
        held = len(socks[victim])
        # The victim has flushed its count (once a second) before it dies.
        wait_for(lambda: (_metric(srv, "eg_kv_connections_open") or 0) >= 24, timeout=30,
                 what="the open connections to be counted")  # fmt: skip
        os.kill(victim, signal.SIGKILL)
        # Dead first: until then its heartbeat still counts it up, and a connection the
        # kernel queues on its listener while it exits is reset (a scrape below was).
        wait_for(lambda: gone(victim), timeout=30, what="the killed worker to exit")
        wait_for(lambda: (srv.healthz() or {}).get("workers_up") == 2, timeout=30,
                 what="the replacement worker")  # fmt: skip
        for s in (s for group in socks.values() for s in group):
            s.close()
        socks.clear()
        # Left: at most the scrape's own connection and a few not yet noticed closed.
        wait_for(lambda: (_metric(srv, "eg_kv_connections_open") or 0) < held, timeout=30,
                 what=f"the gauge to drop below the dead worker's {held}")  # fmt: skip
    finally:
        for s in (s for group in socks.values() for s in group):
            s.close()
