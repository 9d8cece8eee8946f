"""Large PUT bodies read straight into the slab (eg_kv/server/intake.py).

Raw sockets against a real server. A PUT over 64 KiB on a kept-alive HTTP/1.1 connection,
whose body has not all arrived with its head, is taken by the fast lane and its body read
by the socket into the block's pages; the same PUT with ``Connection: close`` takes
aiohttp's way. Each case is sent both ways and the answers must agree; then what the
intake must keep: the bytes and their checksum, the requests behind a body, ``Expect``,
and the pages of a body that never completes.
"""

from __future__ import annotations

import os
import socket

import pytest
from helpers.common import wait_for
from helpers.server_http import Conn, both_ways, request, stats

from eg_kv.checksum import encode as encode_checksum
from eg_kv.checksum import of as checksum_of

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024
BODY = os.urandom(MiB + 3)


@pytest.fixture(scope="module")
def srv(module_server_factory):
    return module_server_factory(workers=1, capacity="64MiB")


def _head(address: str, length: int, extra: str = "") -> bytes:
    head = f"PUT /kv/{address} HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n{extra}\r\n"
    return head.encode()


def _both_ways(srv, address: str, extra: str = "", setup: bytes = b"", with_head: int = 0):
    """The answer to one PUT of BODY through the intake, and to the same PUT declined
    (closing): :func:`helpers.server_http.both_ways`. The head goes alone (with
    ``with_head`` bytes of the body), then the rest. ``address`` ending ``{}``: each way
    gets its own (formatted with 0 and 1)."""

    def send(conn: Conn, i: int, close: str) -> None:
        conn.send(_head(address.format(i), len(BODY), extra + close) + BODY[:with_head])
        conn.send(BODY[with_head:])

    return both_ways(srv, send, setup)


_RIGHT = f"X-Eg-Kv-Checksum: {encode_checksum(checksum_of(BODY))}\r\n"
CASES = {
    # name: (address, extra headers, a request sent first, body bytes sent with the head)
    "created": ("in-new{}", "", b"", 0),
    "created, the head with 200 KiB": ("in-split{}", "", b"", 200 * 1024),
    "dedup": ("in-dedup", "", _head("in-dedup", len(BODY)) + BODY, 0),
    "conflict": ("in-conflict", "", _head("in-conflict", 70_000) + BODY[:70_000], 0),
    "checksum right": ("in-sum{}", _RIGHT, b"", 0),
    "checksum wrong": ("in-bad{}", f"X-Eg-Kv-Checksum: {encode_checksum(1)}\r\n", b"", 4096),
}


@pytest.mark.parametrize("case", CASES)
def test_each_case_is_answered_as_aiohttps_way_answers_it(srv, case):
    address, extra, setup, with_head = CASES[case]
    intake, declined = _both_ways(srv, address, extra, setup, with_head)
    assert intake == declined
    status = int(intake[0].split()[1])
    expected = {"created": 201, "dedup": 200, "conflict": 409, "checksum right": 201,
                "checksum wrong": 400}[case.split(",")[0]]  # fmt: skip
    assert status == expected, intake
    if status == 400:
        assert request(srv, "GET", "/kv/in-bad0").status == 404  # nothing stored


def test_a_body_in_odd_pieces_reads_back_with_its_checksum(srv):
    """A 3 MiB body in pieces of 1 byte, 7 bytes, 100 KiB and the rest, with a GET of it
    right behind its last byte: stored whole, and the GET (parsed after it) returns it."""
    body = os.urandom(3 * MiB)
    with Conn(srv) as conn:
        conn.send(_head("in-odd", len(body)))
        for a, b in ((0, 1), (1, 8), (8, 8 + 100 * 1024)):
            conn.send(body[a:b])
        conn.send(body[8 + 100 * 1024 :] + b"GET /kv/in-odd HTTP/1.1\r\nHost: t\r\n\r\n")
        assert conn.response("PUT")[0] == "HTTP/1.1 201 Created"
        line, headers, got = conn.response()
    assert line == "HTTP/1.1 200 OK" and got == body
    assert headers["x-eg-kv-checksum"] == encode_checksum(checksum_of(body))


def test_expect_continue_gets_its_interim_answer_then_the_body_is_taken(srv):
    with Conn(srv) as conn:
        conn.send(_head("in-expect", len(BODY), "Expect: 100-continue\r\n"))
        while b"\r\n\r\n" not in conn.buf:
            assert conn._fill()
        interim, conn.buf = conn.buf.split(b"\r\n\r\n", 1)
        assert interim == b"HTTP/1.1 100 Continue"
        conn.send(BODY)
        assert conn.response("PUT")[0] == "HTTP/1.1 201 Created"
        conn.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert conn.response()[0] == "HTTP/1.1 200 OK"
    assert request(srv, "GET", "/kv/in-expect").body == BODY


def test_expect_on_a_block_held_is_a_dedup_from_the_head_and_the_connection_closes(srv):
    assert request(srv, "PUT", "/kv/in-held", BODY).status in (200, 201)
    with Conn(srv) as conn:
        conn.send(_head("in-held", len(BODY), "Expect: 100-continue\r\n"))
        line, headers, answer = conn.response("PUT")
        assert (line, answer) == ("HTTP/1.1 200 OK", b"dedup\n")
        assert headers["connection"] == "close" and conn.closed_by_server()


def test_a_body_cut_short_gets_400_and_gives_its_pages_back(srv):
    with Conn(srv) as conn:
        conn.send(_head("in-cut", len(BODY)) + BODY[:300_000])
        wait_for(lambda: stats(srv)["reserved_pages"] > 0, what="the pages reserved")
        conn.sock.shutdown(socket.SHUT_WR)  # the client's end: no more body
        line, _, answer = conn.response("PUT")
        assert line.startswith("HTTP/1.1 400")
        assert answer == f"body cut short: 300000 of {len(BODY)} bytes arrived\n".encode()
        assert conn.closed_by_server()
    assert stats(srv)["reserved_pages"] == 0
    assert request(srv, "GET", "/kv/in-cut").status == 404


def test_a_client_gone_mid_body_gives_its_pages_back(srv):
    worker = request(srv, "GET", "/healthz").worker
    with Conn(srv) as conn:
        conn.send(_head("in-gone", len(BODY)))
        conn.send(BODY[:500_000])
        wait_for(lambda: stats(srv)["reserved_pages"] > 0, what="the pages reserved")
    wait_for(lambda: stats(srv)["reserved_pages"] == 0, what="the pages given back")
    assert request(srv, "GET", "/kv/in-gone").status == 404
    assert request(srv, "PUT", "/kv/in-gone", BODY).status == 201
    assert request(srv, "GET", "/healthz").worker == worker  # the same worker, alive


def test_a_malformed_head_with_a_large_body_behind_it_gets_one_400_and_is_closed(srv):
    """A read that holds a PUT's head and 200 KiB of its body is parsed head first; a
    head that does not parse is answered once, in one line, and nothing of the body is
    read as a request."""
    with Conn(srv) as conn:
        conn.send(b"PUT /kv/in-bad-head HTTP/1.1\r\nHost: t\r\nContent-Length: 900000\r\n"
                  b"Not a header\r\n\r\n" + b"GET /healthz HTTP/1.1\r\n\r\n" * 8000)  # fmt: skip
        line, _, answer = conn.response("PUT")
        assert line.split()[1] == "400" and answer.count(b"\n") == 1, answer
        assert conn.closed_by_server()
    assert stats(srv)["reserved_pages"] == 0
