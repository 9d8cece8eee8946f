"""Every endpoint, status code and body of the contract, against a real 2-worker server."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import socket
import threading
import time

import pytest
from helpers.common import wait_for
from helpers.server_http import WORKER_HEADER, request, stats

from eg_kv.address import RESERVED

CONTRACT_FIELDS = [
    "unique_blocks", "total_refs", "resident_bytes", "logical_bytes",
    "dedup_savings_bytes", "dedup_hits", "get_hits", "get_misses",
]  # fmt: skip


@pytest.fixture(scope="module")
def srv(module_server_factory):
    """One server for the module: its tests read and write their own addresses only. The
    tests that count stats exactly start their own."""
    return module_server_factory(workers=2)


def _one_line(reply) -> str:
    text = reply.text
    assert reply.headers["Content-Type"].startswith("text/plain"), reply.headers
    assert text.endswith("\n") and "\n" not in text[:-1], text
    assert len(text) > 5, "an error body says what was wrong"
    return text


def test_healthz_reports_workers(srv):
    reply = request(srv, "GET", "/healthz")
    assert reply.status == 200
    assert reply.json() == {"status": "ok", "workers_up": 2, "workers": 2}
    assert reply.worker > 0


def test_put_get_head_exists_delete_roundtrip(server_factory):
    srv = server_factory(workers=2)  # its own: the test counts its stats exactly
    data = os.urandom(10_000)
    r = request(srv, "PUT", "/kv/blk-1", data)
    assert r.status == 201 and r.text == "created\n"
    assert int(r.headers[WORKER_HEADER]) > 0
    r = request(srv, "PUT", "/kv/blk-1", data)
    assert r.status == 200 and r.text == "dedup\n"

    r = request(srv, "GET", "/kv/blk-1")
    assert r.status == 200 and r.body == data
    assert r.headers["Content-Type"] == "application/octet-stream"
    assert int(r.headers["Content-Length"]) == len(data)

    r = request(srv, "HEAD", "/kv/blk-1")
    assert r.status == 200 and r.body == b""
    assert int(r.headers["Content-Length"]) == len(data)

    assert request(srv, "GET", "/kv/blk-1/exists").json() == {"hash": "blk-1", "exists": True}
    s = stats(srv)
    assert (s["unique_blocks"], s["total_refs"], s["dedup_hits"]) == (1, 2, 1)
    assert s["resident_bytes"] == len(data) and s["logical_bytes"] == 2 * len(data)
    assert s["dedup_savings_bytes"] == len(data)

    # Two references: the first DELETE releases one, the second frees the block.
    assert request(srv, "DELETE", "/kv/blk-1").status == 204
    assert request(srv, "GET", "/kv/blk-1").body == data
    r = request(srv, "DELETE", "/kv/blk-1")
    assert r.status == 204 and r.body == b""
    assert request(srv, "GET", "/kv/blk-1/exists").json() == {"hash": "blk-1", "exists": False}
    r = request(srv, "DELETE", "/kv/blk-1")
    assert r.status == 404
    _one_line(r)


def test_misses_are_404_and_counted(server_factory):
    srv = server_factory(workers=2)  # its own: the test counts its stats exactly
    r = request(srv, "GET", "/kv/nope")
    assert r.status == 404
    assert "nope" in _one_line(r)
    r = request(srv, "HEAD", "/kv/nope")
    assert r.status == 404 and r.body == b""
    s = stats(srv)
    assert s["get_misses"] == 1 and s["get_hits"] == 0


def test_stats_has_the_contract_fields_first(server_factory):
    srv = server_factory(workers=2)  # its own: the test counts its stats exactly
    request(srv, "PUT", "/kv/a", b"x" * 100)
    request(srv, "GET", "/kv/a")
    r = request(srv, "GET", "/kv/stats")
    assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
    body = r.json()
    assert list(body)[:8] == CONTRACT_FIELDS
    assert body["unique_blocks"] == 1 and body["get_hits"] == 1
    for extra in ("capacity_bytes", "free_bytes", "evictions", "evicted_bytes"):
        assert extra in body
    assert body["capacity_bytes"] == 64 * 1024 * 1024


@pytest.mark.parametrize("size", [1, 65_536, 1024 * 1024, 1024 * 1024 + 1, 14 * 1024 * 1024])
def test_block_sizes_roundtrip_identically(srv, size):
    data = os.urandom(size)
    assert request(srv, "PUT", f"/kv/size-{size}", data).status == 201
    r = request(srv, "GET", f"/kv/size-{size}")
    assert r.status == 200 and len(r.body) == size
    assert hashlib.sha256(r.body).digest() == hashlib.sha256(data).digest()


def test_chunked_put_is_stored(srv):
    data = os.urandom(3 * 1024 * 1024 + 17)
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        chunks = (data[i : i + 100_000] for i in range(0, len(data), 100_000))
        conn.request("PUT", "/kv/chunky", body=chunks, encode_chunked=True,
                     headers={"Transfer-Encoding": "chunked"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 201, resp.read()
        resp.read()
    finally:
        conn.close()
    assert request(srv, "GET", "/kv/chunky").body == data
    assert stats(srv)["reserved_pages"] == 0


@pytest.mark.parametrize("size", [5000, 200_000])  # stored in one go / streamed
def test_chunked_put_arriving_in_fragments_is_stored_whole(srv, size):
    """Each chunk's data lands before its closing CRLF: the server reads up to a chunk
    boundary that is only marked later, and must not take that mark for the end."""
    data = os.urandom(size)
    step = size // 8 + 1
    with socket.create_connection((srv.host, srv.port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = b"PUT /kv/fragments-%d HTTP/1.1\r\nHost: t\r\n" % size  # one per size
        s.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(0, size, step):
            piece = data[i : i + step]
            s.sendall(b"%x\r\n" % len(piece) + piece)
            time.sleep(0.02)  # provokes the split; the outcome must not depend on it
            s.sendall(b"\r\n")
        s.sendall(b"0\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 201"), answer
    assert request(srv, "GET", f"/kv/fragments-{size}").body == data


def test_batch_exists_and_prefix_hits(srv):
    for a in ("p0", "p1", "p3"):
        assert request(srv, "PUT", f"/kv/{a}", b"k" * 10).status == 201
    body = b'{"addresses": ["p0", "p1", "p2", "p3"]}'
    r = request(srv, "POST", "/kv/batch/exists", body, {"Content-Type": "application/json"})
    assert r.status == 200
    assert r.json() == {"exists": [True, True, False, True], "prefix_hits": 2}
    r = request(srv, "POST", "/kv/batch/exists", b'{"addresses": []}')
    assert r.json() == {"exists": [], "prefix_hits": 0}
    many = ",".join(f'"p{i % 2}"' for i in range(1024)).encode()
    r = request(srv, "POST", "/kv/batch/exists", b'{"addresses": [' + many + b"]}")
    assert r.status == 200 and r.json()["prefix_hits"] == 1024


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json", 400),
        (b'["p0"]', 400),
        (b'{"addresses": "p0"}', 400),
        (b'{"addresses": [1, 2]}', 400),
        (b'{"addresses": ["bad/address"]}', 400),
        (b'{"addresses": ["stats"]}', 400),
        (b'{"addresses": [' + b",".join([b'"a"'] * 1025) + b"]}", 413),
        (b'{"addresses": ["' + b"a" * 600_000 + b'"]}', 413),
    ],
)
def test_batch_exists_bad_bodies(srv, body, status):
    r = request(srv, "POST", "/kv/batch/exists", body)
    assert r.status == status
    _one_line(r)


def test_wrong_method_is_405_with_allow(srv):
    r = request(srv, "POST", "/kv/abc", b"x")
    assert r.status == 405
    assert set(r.headers["Allow"].split(", ")) == {"GET", "HEAD", "PUT", "DELETE"}
    assert "POST" in _one_line(r)
    assert request(srv, "PATCH", "/kv/abc", b"x").status == 405
    assert request(srv, "DELETE", "/kv/stats").status in (400, 405)
    r = request(srv, "GET", "/kv/batch/exists")
    assert r.status == 405 and r.headers["Allow"] == "POST"
    r = request(srv, "PUT", "/kv/abc/exists", b"x")
    assert r.status == 405 and r.headers["Allow"] == "GET"
    assert request(srv, "POST", "/healthz").status == 405


@pytest.mark.parametrize(
    "path",
    ["/kv/a%20b", "/kv/" + "a" * 257, "/kv/a/b", "/kv/", "/kv/%C3%A9t%C3%A9", "/kv/a%2Fb",
     *(f"/kv/{w}" for w in sorted(RESERVED - {"stats", "events"}))],  # GET routes
)  # fmt: skip
def test_invalid_addresses_are_400(srv, path):
    blocks = stats(srv)["unique_blocks"]
    for method, body in (("PUT", b"data"), ("GET", None)):
        r = request(srv, method, path, body)
        assert r.status == 400, (method, path, r)
        _one_line(r)
    assert stats(srv)["unique_blocks"] == blocks  # nothing stored


def test_reserved_stats_cannot_be_stored(srv):
    r = request(srv, "PUT", "/kv/stats", b"data")
    assert r.status == 400 and "reserved" in _one_line(r)


def test_address_of_256_chars_is_fine(srv):
    addr = "a" * 255 + "Z"
    assert request(srv, "PUT", f"/kv/{addr}", b"1").status == 201
    assert request(srv, "GET", f"/kv/{addr}").body == b"1"


def test_length_conflict_is_409(srv):
    assert request(srv, "PUT", "/kv/c", b"1234").status == 201
    r = request(srv, "PUT", "/kv/c", b"12345")
    assert r.status == 409
    assert "4" in _one_line(r)
    assert request(srv, "GET", "/kv/c").body == b"1234"


def test_oversize_put_is_413(server_factory):
    srv = server_factory(workers=1, extra=("--max-block-size", "1MiB"))
    r = request(srv, "PUT", "/kv/big", os.urandom(1024 * 1024 + 1))
    assert r.status == 413
    assert "1,048,577 bytes" in _one_line(r) and "1 MiB (1,048,576 bytes" in _one_line(r)
    assert request(srv, "PUT", "/kv/big", os.urandom(1024 * 1024)).status == 201


def test_empty_put_is_400(srv):
    r = request(srv, "PUT", "/kv/empty", b"")
    assert r.status == 400
    _one_line(r)


def test_unknown_path_is_404(srv):
    r = request(srv, "GET", "/nothing/here")
    assert r.status == 404
    _one_line(r)


def test_metrics_aggregate_over_workers(server_factory):
    srv = server_factory(workers=2)  # its own: the test counts its stats exactly
    pids = set()
    for i in range(20):
        r = request(srv, "PUT", f"/kv/m{i}", b"x" * 10)
        assert r.status == 201
        pids.add(r.worker)
    assert len(pids) == 2, "20 connections should reach both workers"
    # Each worker flushes its counts into the shared files at least once a second.
    pattern = re.compile(
        r'^eg_kv_requests_total\{method="PUT",route="block",status="201"\} (\S+)$', re.M
    )

    def scraped():
        r = request(srv, "GET", "/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        m = pattern.search(r.text)
        return r.text if m and float(m.group(1)) == 20.0 else None

    text = wait_for(scraped, timeout=10, what="20 PUTs in /metrics")
    assert re.search(r"^eg_kv_unique_blocks 20\.0$", text, re.M)
    assert re.search(r"^eg_kv_workers_up 2\.0$", text, re.M)
    assert 'eg_kv_request_duration_seconds_bucket{le="+Inf",route="block"} 20.0' in text
    assert 'eg_kv_request_duration_seconds_count{route="block"} 20.0' in text
    total = re.search(r'^eg_kv_request_duration_seconds_sum\{route="block"\} (\S+)$', text, re.M)
    assert total and 0 < float(total.group(1)) < 20


def test_dedup_across_processes(server_factory):
    """32 connections PUT one address at once: one 201, 31 dedup hits, >= 2 workers."""
    srv = server_factory(workers=2)  # its own: the test counts its stats exactly
    data = os.urandom(256 * 1024)
    n = 32
    barrier = threading.Barrier(n)
    replies: list = [None] * n

    def put(i: int) -> None:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        try:
            conn.connect()
            barrier.wait(timeout=30)
            conn.request("PUT", "/kv/shared-block", body=data)
            resp = conn.getresponse()
            replies[i] = (resp.status, int(resp.headers[WORKER_HEADER]), resp.read())
        finally:
            conn.close()

    threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in replies), replies
    statuses = sorted(r[0] for r in replies)
    assert statuses == [200] * 31 + [201]
    assert len({r[1] for r in replies}) >= 2, "both workers served some of the PUTs"
    s = stats(srv)
    assert (s["unique_blocks"], s["total_refs"], s["dedup_hits"]) == (1, 32, 31)
    assert request(srv, "GET", "/kv/shared-block").body == data


def test_block_on_scattered_pages_reads_back(srv):
    """A block whose pages are not contiguous comes out of the slab in several slices."""
    page = 64 * 1024
    for name in ("f0", "f1", "f2"):
        assert request(srv, "PUT", f"/kv/{name}", os.urandom(page)).status == 201
    for name in ("f0", "f2"):
        assert request(srv, "DELETE", f"/kv/{name}").status == 204
    for i in range(40):
        assert request(srv, "PUT", f"/kv/g{i}", os.urandom(page)).status == 201
    for i in range(0, 40, 2):
        assert request(srv, "DELETE", f"/kv/g{i}").status == 204
    # Under one read slice, and over it (scattered pages first, then contiguous ones).
    for size in (3 * page, 3 * page - 100, 1024 * 1024 + 7, 3 * 1024 * 1024):
        data = os.urandom(size)
        assert request(srv, "PUT", f"/kv/scattered-{size}", data).status == 201
        assert request(srv, "GET", f"/kv/scattered-{size}").body == data
        assert request(srv, "DELETE", f"/kv/scattered-{size}").status == 204
