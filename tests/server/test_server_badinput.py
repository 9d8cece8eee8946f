"""Bad input over raw sockets: a clear 4xx, nothing stored, nothing lost, no worker hurt."""

from __future__ import annotations

import random
import re
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from helpers.common import wait_for
from helpers.server_http import raw_exchange, request, stats, status_of

MiB = 1024 * 1024


@pytest.fixture
def srv(server_factory):
    return server_factory(workers=2)


def _body_of(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[2]


def _assert_nothing_held(srv) -> None:
    """No block published, no pages left reserved by an upload."""
    wait_for(lambda: stats(srv)["reserved_pages"] == 0, timeout=10, what="reservations freed")
    assert stats(srv)["unique_blocks"] == 0


def test_put_without_content_length_is_400(srv):
    raw = raw_exchange(srv.port, b"PUT /kv/x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert status_of(raw) == 400
    assert b"Content-Length" in _body_of(raw)
    # Without a length, bytes after the headers are the next request: garbage, one line.
    raw = raw_exchange(srv.port, b"PUT /kv/x HTTP/1.1\r\nHost: t\r\n\r\nhello")
    assert status_of(raw) == 400
    assert _body_of(raw).count(b"\n") == 1 and b"malformed" in _body_of(raw)
    assert b"\r\nX-EgKv-Worker: " in raw, "aiohttp's own parse errors carry the header too"
    _assert_nothing_held(srv)


@pytest.mark.slow
@pytest.mark.parametrize("value", [b"abc", b"-5", b"1.5", b"12, 13", b"0x10"])
def test_invalid_content_length_is_400(srv, value):
    head = b"PUT /kv/x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: "
    raw = raw_exchange(srv.port, head + value + b"\r\n\r\n")
    assert status_of(raw) == 400
    _assert_nothing_held(srv)


def test_oversize_is_refused_before_the_body_is_read(server_factory):
    srv = server_factory(workers=1, extra=("--max-block-size", "1MiB"))
    head = b"PUT /kv/big HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (100 * MiB)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(head)  # and not one byte of the body
        reply = s.recv(65536)
    assert status_of(reply) == 413
    assert b"maximum block size" in reply
    _assert_nothing_held(srv)


@pytest.mark.slow
def test_expect_100_continue(srv):
    # Oversize: refused without the interim 100, before any body byte is sent.
    head = b"PUT /kv/e HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % (65 * MiB)
    head += b"Expect: 100-continue\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(head)
        reply = s.recv(65536)
    assert status_of(reply) == 413, reply
    assert b"\r\nX-EgKv-Worker: " in reply
    # A fitting one gets 100 Continue, then 201 once the body arrives.
    head = b"PUT /kv/e HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(head)
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"hello")
        reply = s.recv(65536)
    assert status_of(reply) == 201, reply
    assert request(srv, "GET", "/kv/e").body == b"hello"


def test_body_cut_short_publishes_nothing(srv):
    # The client ends the connection after half its body (aiohttp closes a connection on
    # a half-close too, so no answer can reach such a client): nothing may be published.
    raw = raw_exchange(
        srv.port,
        b"PUT /kv/short HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n" + b"x" * 50_000,
        shut_write=True,
    )
    assert status_of(raw) in (400, None)
    _assert_nothing_held(srv)
    assert request(srv, "GET", "/kv/short").status == 404


def test_client_disconnect_mid_upload_leaves_nothing(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"PUT /kv/gone HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (8 * MiB))
        s.sendall(b"y" * (3 * MiB))
        wait_for(lambda: stats(srv)["reserved_pages"] > 0, timeout=10, what="upload reserved")
    _assert_nothing_held(srv)
    assert request(srv, "HEAD", "/kv/gone").status == 404


def test_no_room_is_507(server_factory):
    srv = server_factory(workers=1, capacity="16MiB", extra=("--max-block-size", "16MiB"))
    # An upload in flight holds 12 MiB of the 16: those pages cannot be evicted.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"PUT /kv/holder HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (12 * MiB))
        s.sendall(b"z" * MiB)
        wait_for(lambda: stats(srv)["reserved_pages"] > 0, timeout=10, what="upload reserved")
        r = request(srv, "PUT", "/kv/other", b"o" * (8 * MiB))
        assert r.status == 507, r
        assert r.text.count("\n") == 1
        s.sendall(b"z" * (11 * MiB))
        reply = s.recv(65536)
        assert status_of(reply) == 201
    # Once the holder is done, the same PUT fits by evicting it.
    assert request(srv, "PUT", "/kv/other", b"o" * (8 * MiB)).status == 201
    assert stats(srv)["evictions"] == 1


def test_pipelined_requests_on_one_connection(srv):
    data = (
        b"PUT /kv/p1 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /kv/p1 HTTP/1.1\r\nHost: t\r\n\r\n"
        b"HEAD /kv/p1 HTTP/1.1\r\nHost: t\r\n\r\n"
        b"GET /kv/p1/exists HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    raw = raw_exchange(srv.port, data)
    assert raw.count(b"HTTP/1.1 ") == 4
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", raw) == [b"201", b"200", b"200", b"200"]
    assert b'"exists": true' in raw


# ---------------------------------------------------------------------------- the fuzz

_METHODS = [b"GET", b"PUT", b"HEAD", b"DELETE", b"POST", b"PATCH", b"OPTIONS", b"BREW",
            b"G\x00T", b"", b"get", b"PUT PUT", b"TRACE", b"CONNECT"]  # fmt: skip
_PATHS = [b"/kv/ok", b"/kv/", b"/kv/a/b", b"/kv/" + b"x" * 300, b"/kv/%00", b"/kv/%zz",
          b"/kv/\xff\xfe", b"/kv/stats", b"/kv/batch/exists", b"/kv/ok/exists", b"*",
          b"/kv/../../etc/passwd", b"http://evil/kv/ok", b"/metrics", b"/healthz", b"",
          b"/kv/a b", b"/kv/a?x=1", b"/kv/a#frag", b"//kv//ok", b"/kv/" + b"%41" * 200]  # fmt: skip
_VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"HTTP/1.1x", b"", b"FOO/1.1"]


def _fuzz_request(rng: random.Random) -> bytes:
    # Half the request lines are well formed, so the fuzz reaches the handlers too.
    method = rng.choice(_METHODS[:5] if rng.random() < 0.6 else _METHODS)
    path = rng.choice(_PATHS[:10] if rng.random() < 0.6 else _PATHS)
    version = _VERSIONS[0] if rng.random() < 0.6 else rng.choice(_VERSIONS)
    line = b" ".join(p for p in (method, path, version) if p or rng.random() < 0.3)
    headers: list[bytes] = [b"Host: fuzz"] if rng.random() < 0.85 else []
    if rng.random() < 0.7:
        headers.append(b"Connection: close")  # so a well-formed request ends quickly
    body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 10, 300, 5000])))
    cl = "right" if rng.random() < 0.5 else rng.choice(["none", "short", "long", "bad", "huge",
                                                        "two", "neg"])  # fmt: skip
    cl_value = {
        "right": str(len(body)).encode(), "short": str(len(body) + 50).encode(),
        "long": str(max(0, len(body) - 3)).encode(), "bad": b"12abc",
        "huge": b"99999999999999999999", "neg": b"-1",
        "two": str(len(body)).encode() + b"\r\nContent-Length: 7",
    }.get(cl)  # fmt: skip
    if cl_value is not None:
        headers.append(b"Content-Length: " + cl_value)
    pick = rng.random() * 1.5  # a third of the requests get no odd header
    if pick < 0.1:
        headers.append(b"Transfer-Encoding: chunked")
        body = rng.choice([b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\nhello\r\n", b"5\r\nhel", b"0\r\n"])
    elif pick < 0.2:
        headers.append(b"Transfer-Encoding: gzip, chunked")
    elif pick < 0.3:
        headers.append(b"Bad Header Without Colon")
    elif pick < 0.35:
        headers.append(b"X-Long: " + b"a" * 20_000)
    elif pick < 0.4:
        headers.append(b"Host: \x00\x01\x02")
    elif pick < 0.45:
        headers.append(b"Expect: 100-continue")
    elif pick < 0.5:
        headers.append(b"Authorization: Bearer \xff\xfe")
    elif pick < 0.55:
        headers.append(b"Content-Encoding: gzip")
    elif pick < 0.6:
        headers.extend([b"X-%d: y" % i for i in range(200)])
    sep = rng.choice([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"])
    raw = line + sep + sep.join(headers) + (sep if headers else b"") + sep + body
    if rng.random() < 0.15:
        raw = raw[: rng.randrange(len(raw) + 1)]  # truncated anywhere
    if rng.random() < 0.05:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))  # pure noise
    return raw


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_fuzz_malformed_requests(srv):
    """1,200 malformed requests: no 5xx but 507, no worker dies, the slab stays sound."""
    sup = psutil.Process(srv.pid)
    workers_before = {p.pid for p in sup.children()}
    assert len(workers_before) == 2
    rng = random.Random(20261129)
    requests = [_fuzz_request(rng) for _ in range(1200)]
    deadline = time.monotonic() + 90

    def send(data: bytes) -> list[int | None]:
        if time.monotonic() > deadline:
            return []
        # A request the server still waits on (truncated) ends when the timeout passes.
        raw = raw_exchange(srv.port, data, timeout=0.5)
        return [int(m) if m.isdigit() else None for m in re.findall(rb"HTTP/1\.. (...)", raw)]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, requests))
    assert time.monotonic() < deadline, "the fuzz ran out of time"
    codes = [c for r in results for c in r]
    print("fuzz answers by status:", sorted(Counter(codes).items(), key=str))
    bad = [c for c in codes if c is None or (c >= 500 and c != 507)]
    assert not bad, bad
    assert len(codes) >= 600, f"only {len(codes)} answers to {len(requests)} requests"
    assert {c for c in codes if c >= 400} >= {400, 404, 405}, sorted(set(codes))
    assert {p.pid for p in sup.children()} == workers_before, "a worker died"
    log = srv.log()
    assert "replacing it" not in log and "Traceback" not in log, log[-3000:]
    wait_for(lambda: stats(srv)["reserved_pages"] == 0, timeout=10, what="reservations freed")
    # The server still works normally afterwards.
    assert request(srv, "PUT", "/kv/after-fuzz", b"fine").status in (200, 201)
    assert request(srv, "GET", "/kv/after-fuzz").body == b"fine"


@pytest.mark.parametrize("route", ["/kv/batch/exists", "/kv/batch/release"])
def test_deeply_nested_json_in_a_batch_is_a_400_not_a_500(srv, route):
    """5,000 nested brackets (10 KB) raised RecursionError: a 500 and a traceback each."""
    body = b'{"addresses": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    reply = request(srv, "POST", route, body, headers={"Content-Type": "application/json"})
    assert reply.status == 400, reply.text
    assert "batch body is not JSON" in reply.text
    assert request(srv, "GET", "/healthz").status == 200
