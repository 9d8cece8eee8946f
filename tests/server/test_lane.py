"""The fast lane (eg_kv/server/lane.py): small PUTs answered as they are parsed.

Raw sockets against a real server. A PUT sent whole on a kept-alive HTTP/1.1 connection
is the lane's; the same PUT with ``Connection: close`` is declined and answered by
aiohttp's way, so each case below is sent both ways and the answers must agree. Then
what the lane must keep of aiohttp's bookkeeping: order on a pipelined connection (past a
burst, and around requests it declines), the keep-alive clock, the metrics.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from helpers.common import wait_for
from helpers.server_http import Conn, both_ways, request

from eg_kv.checksum import encode as encode_checksum
from eg_kv.checksum import of as checksum_of
from eg_kv.engine import BLOCK_SIZE_HEADER

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def srv(module_server_factory):
    return module_server_factory(workers=1)


def _put(address: str, body: bytes, extra: str = "") -> bytes:
    return _req("PUT", address, body, extra)


def _req(method: str, address: str, body: bytes = b"", extra: str = "") -> bytes:
    length = f"Content-Length: {len(body)}\r\n" if method == "PUT" else ""
    return f"{method} /kv/{address} HTTP/1.1\r\nHost: t\r\n{length}{extra}\r\n".encode() + body


def _both_ways(srv, address: str, body: bytes, extra: str = "", setup: bytes = b"",
               method: str = "PUT"):  # fmt: skip
    """The answer to one request through the lane, and to the same request declined
    (closing): :func:`helpers.server_http.both_ways`. With ``address`` ending ``{}``, each
    way gets its own (formatted with 0 and 1)."""

    def send(conn: Conn, i: int, close: str) -> None:
        conn.send(_req(method, address.format(i), body, extra + close))

    return both_ways(srv, send, setup, method)


CASES = {
    # name: (address, body, extra headers, a PUT sent first)
    "dedup": ("ln-dedup", b"abc", "", _put("ln-dedup", b"abc")),
    "conflict": ("ln-conflict", b"abcd", "", _put("ln-conflict", b"abc")),
    "checksum mismatch": ("ln-sum", b"abc", f"X-Eg-Kv-Checksum: {encode_checksum(1)}\r\n", b""),
    "checksum malformed": ("ln-sum2", b"abc", "X-Eg-Kv-Checksum: zz\r\n", b""),
    "empty": ("ln-empty", b"", "", b""),
    "invalid address": ("ln!bad", b"abc", "", b""),
    "reserved word": ("stats", b"abc", "", b""),
    "engine field without hash": ("ln-eng", b"abc", f"{BLOCK_SIZE_HEADER}: 16\r\n", b""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_lane_answers_as_aiohttps_way_does(srv, case):
    address, body, extra, setup = CASES[case]
    lane, declined = _both_ways(srv, address, body, extra, setup)
    assert lane == declined
    assert lane[2].endswith(b"\n") and lane[2].count(b"\n") == 1  # one line


def test_a_created_block_is_answered_alike_and_stored_with_its_checksum(srv):
    body = os.urandom(4096)
    answers = _both_ways(srv, "ln-new-{}", body)
    assert answers[0] == answers[1]
    assert answers[0][0] == "HTTP/1.1 201 Created" and answers[0][2] == b"created\n"
    for i in (0, 1):
        got = request(srv, "GET", f"/kv/ln-new-{i}")
        assert got.body == body
        assert got.headers["X-Eg-Kv-Checksum"] == encode_checksum(checksum_of(body))


@pytest.mark.parametrize("size", [3, 200 * 1024, 2 * 1024 * 1024])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_reads_are_answered_alike(srv, method, size):
    """One page, several pages (one copy), and a block streamed from the slab (longer
    than the lane reads: declined, untouched)."""
    body = os.urandom(size)
    lane, declined = _both_ways(srv, f"ln-r-{method}-{size}", b"", method=method,
                                setup=_put(f"ln-r-{method}-{size}", body))  # fmt: skip
    assert lane == declined
    line, headers, answer = lane
    assert (line, headers["content-length"]) == ("HTTP/1.1 200 OK", str(size))
    assert headers["x-eg-kv-checksum"] == encode_checksum(checksum_of(body))
    assert headers["x-eg-kv-address"] == f"ln-r-{method}-{size}"  # what the clients check
    assert answer == (body if method == "GET" else b"")


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_miss_is_answered_alike(srv, method):
    lane, declined = _both_ways(srv, "ln-absent", b"", method=method)
    assert lane == declined
    assert lane[0] == "HTTP/1.1 404 Not Found"
    assert lane[2] == (b"no block ln-absent\n" if method == "GET" else b"")


def test_pipelined_puts_past_a_burst_and_around_declined_requests_keep_their_order(srv):
    """Hundreds of PUTs in one write (aiohttp queues 32 at a time and pauses reading; the
    lane answers a burst per read), with requests the lane declines in between."""
    n = 300
    blocks = {f"ln-pipe-{i}": os.urandom(100 + i) for i in range(n)}
    wire = [_put(a, b) for a, b in blocks.items()]
    wire.insert(40, b"GET /kv/stats HTTP/1.1\r\nHost: t\r\n\r\n")  # declined: not a PUT
    wire.insert(41, _put("ln-pipe-0", blocks["ln-pipe-0"]))  # a dedup, queued behind it
    wire.insert(150, _put("ln-pipe-5", b"other length"))  # a conflict
    wire.append(b"GET /kv/ln-pipe-299 HTTP/1.1\r\nHost: t\r\n\r\n")
    with Conn(srv) as conn:
        conn.send(b"".join(wire))
        got = [conn.response() for _ in wire]
    lines = [line for line, _, _ in got]
    assert lines[:40] == ["HTTP/1.1 201 Created"] * 40
    assert lines[40] == "HTTP/1.1 200 OK" and got[40][2].startswith(b"{")  # the stats
    assert got[41][::2] == ("HTTP/1.1 200 OK", b"dedup\n")
    assert lines[42:150] == ["HTTP/1.1 201 Created"] * 108
    assert lines[150] == "HTTP/1.1 409 Conflict"
    assert lines[151:-1] == ["HTTP/1.1 201 Created"] * (n - 148)
    assert got[-1][2] == blocks["ln-pipe-299"]


def test_a_connection_the_lane_serves_stays_open_while_used_then_closes_when_idle(
    server_factory,
):
    """The lane restarts the keep-alive clock as aiohttp would after each answer: a
    connection that only ever gets the lane's answers is not closed while in use."""
    srv = server_factory(workers=1, extra=("--keepalive-timeout", "1"))
    with Conn(srv) as conn:
        end = time.monotonic() + 2.5  # well past the timeout, in use all along
        i = 0
        while time.monotonic() < end:
            conn.send(_put(f"ln-ka-{i}", b"x"))
            assert conn.response()[0] == "HTTP/1.1 201 Created"
            answered_at = time.monotonic()
            i += 1
            time.sleep(0.2)
        assert conn.closed_by_server()  # blocks until the server closes it
        assert time.monotonic() - answered_at >= 0.9  # a second after the last answer


def test_the_lane_counts_its_answers_in_the_metrics(server_factory):
    srv = server_factory(workers=1)
    pattern = re.compile(
        r'^eg_kv_requests_total\{method="PUT",route="block",status="201"\} (\S+)$', re.M
    )

    def created() -> float:
        found = pattern.search(request(srv, "GET", "/metrics").body.decode())
        return float(found.group(1)) if found else 0.0

    with Conn(srv) as conn:
        for i in range(25):
            conn.send(_put(f"ln-m-{i}", b"abc"))
            assert conn.response()[0] == "HTTP/1.1 201 Created"
    wait_for(lambda: created() == 25, what="25 PUTs counted")
