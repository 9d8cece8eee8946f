"""HTTP framing of the responses the block routes write themselves (eg_kv/server/replies.py).

Raw sockets, so every byte of the head is checked: status lines per HTTP version,
Content-Length (none on 204, the block's on HEAD without a body), Date, keep-alive and
close, and pipelined requests answered in order on one connection.
"""

from __future__ import annotations

import email.utils
import os
import socket

import pytest
from helpers.server_http import WORKER_HEADER, Conn

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def srv(module_server_factory):
    """One server for the module: each test writes its own addresses (or rewrites the same
    bytes) and checks replies, never counters."""
    return module_server_factory(workers=1)


def _put(conn: Conn, address: str, body: bytes, extra: str = "") -> None:
    conn.send(f"PUT /kv/{address} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
              f"{extra}\r\n".encode() + body)  # fmt: skip


def _common_headers(headers: dict[str, str]) -> None:
    assert headers["server"] == "eg-kv"
    assert int(headers[WORKER_HEADER.lower()]) > 0
    assert email.utils.parsedate_to_datetime(headers["date"]).tzname() == "UTC"


def test_pipelined_block_requests_are_framed_in_order(srv):
    data = os.urandom(5000)
    big = os.urandom(3 * 1024 * 1024 + 17)  # streamed from the slab, not one copy
    with Conn(srv) as conn:
        # Everything in one send: each answer must end exactly where the next begins.
        _put(conn, "pipe-a", data)
        _put(conn, "pipe-a", data)
        _put(conn, "pipe-big", big)
        conn.send(b"GET /kv/pipe-a HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"HEAD /kv/pipe-a HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"GET /kv/pipe-big HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"GET /kv/pipe-a/exists HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"DELETE /kv/pipe-a HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"DELETE /kv/pipe-a HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"GET /kv/pipe-a HTTP/1.1\r\nHost: t\r\n\r\n")  # fmt: skip
        line, h, body = conn.response()
        assert (line, body) == ("HTTP/1.1 201 Created", b"created\n")
        assert h["content-type"].startswith("text/plain") and "connection" not in h
        _common_headers(h)
        assert conn.response()[::2] == ("HTTP/1.1 200 OK", b"dedup\n")
        assert conn.response()[0] == "HTTP/1.1 201 Created"
        line, h, body = conn.response()
        assert (line, body, h["content-type"]) == (
            "HTTP/1.1 200 OK",
            data,
            "application/octet-stream",
        )
        assert h["content-length"] == "5000"
        _common_headers(h)
        line, h, body = conn.response("HEAD")
        assert (line, h["content-length"], body) == ("HTTP/1.1 200 OK", "5000", b"")
        line, h, body = conn.response()
        assert (line, h["content-length"], body == big) == ("HTTP/1.1 200 OK", str(len(big)), True)
        _common_headers(h)
        line, h, body = conn.response()
        assert h["content-type"].startswith("application/json")
        assert body == b'{"hash": "pipe-a", "exists": true}\n'
        line, h, body = conn.response()
        assert line == "HTTP/1.1 204 No Content"
        assert "content-length" not in h and "content-type" not in h
        _common_headers(h)
        assert conn.response()[0] == "HTTP/1.1 204 No Content"  # the second reference
        line, h, body = conn.response()
        assert line.startswith("HTTP/1.1 404") and body.startswith(b"no block pipe-a")
        assert not conn.buf, "nothing after the last response"


@pytest.mark.parametrize("size", [100, 2 * 1024 * 1024])
def test_http10_without_keep_alive_is_answered_then_closed(srv, size):
    data = os.urandom(size)
    with Conn(srv) as conn:
        _put(conn, f"v10-{size}", data)  # one address per size
        assert conn.response()[0] == "HTTP/1.1 201 Created"
        conn.send(b"GET /kv/v10-%d HTTP/1.0\r\n\r\n" % size)
        line, h, body = conn.response()
        assert (line, body == data) == ("HTTP/1.0 200 OK", True)
        assert "connection" not in h  # HTTP/1.0 closes by default
        assert conn.closed_by_server()


def test_http10_keep_alive_is_honoured(srv):
    with Conn(srv) as conn:
        _put(conn, "v10ka", b"abc")
        conn.response()
        for _ in range(2):
            conn.send(b"GET /kv/v10ka HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            line, h, body = conn.response()
            assert (line, h["connection"].lower(), body) == (
                "HTTP/1.0 200 OK",
                "keep-alive",
                b"abc",
            )


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT"])
def test_connection_close_is_announced_and_done(srv, method):
    with Conn(srv) as conn:
        _put(conn, "cl", b"xyz")
        conn.response()
        if method == "PUT":
            _put(conn, "cl", b"xyz", "Connection: close\r\n")
        else:
            conn.send(f"{method} /kv/cl HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        line, h, _ = conn.response(method)
        assert line.startswith("HTTP/1.1 200") and h["connection"] == "close"
        assert conn.closed_by_server()


def test_error_responses_carry_the_same_server_headers(srv):
    with Conn(srv) as conn:
        conn.send(b"GET /kv/absent HTTP/1.1\r\nHost: t\r\n\r\n")
        line, h, _ = conn.response()
        assert line.startswith("HTTP/1.1 404")
        _common_headers(h)


def test_client_leaving_mid_download_is_no_error(srv):
    """Clients that hang up inside a large body cost nothing but their connection."""
    import struct

    data = os.urandom(12 * 1024 * 1024)  # far more than the socket buffers hold
    with Conn(srv) as conn:
        _put(conn, "leave", data)
        assert conn.response()[0] == "HTTP/1.1 201 Created"
        worker = None
        for _ in range(10):
            with Conn(srv) as c:
                c.send(b"GET /kv/leave HTTP/1.1\r\nHost: t\r\n\r\n")
                while b"\r\n\r\n" not in c.buf:
                    assert c._fill()
                worker = worker or c.buf.split(b"X-EgKv-Worker: ")[1].split(b"\r\n")[0]
                # Hang up with a reset, the way a killed client does.
                c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The same worker answers, whole, and wrote nothing alarming in its log.
        conn.send(b"GET /kv/leave HTTP/1.1\r\nHost: t\r\n\r\n")
        line, h, body = conn.response()
        assert (line, body == data) == ("HTTP/1.1 200 OK", True)
        assert h[WORKER_HEADER.lower()].encode() == worker
    log = srv.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def test_empty_puts_are_400_and_the_worker_stays_responsive(srv):
    """aiohttp shares one empty-payload reader among all bodiless requests of a process;
    repeated empty PUTs must not leave it (or a loop reading it) in a state that hangs."""
    with Conn(srv) as conn:
        for _ in range(3):
            conn.send(b"PUT /kv/empty HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            line, _, body = conn.response()
            assert line.startswith("HTTP/1.1 400") and b"empty" in body, (line, body)
        _put(conn, "after-empty", b"fine")
        assert conn.response()[0] == "HTTP/1.1 201 Created"
