"""Uploads against a real server: what stalled or hostile uploaders can hold, dedup hits
answered from the headers, final answers to ``Expect: 100-continue``, ``--fresh``."""

from __future__ import annotations

import os
import re
import resource
import select
import selectors
import socket
import struct
import subprocess
import sys

import posix_ipc
import pytest
from helpers.common import ROOT, free_port, unique_slab_name, wait_for
from helpers.server_http import request, stats, status_of
from helpers.tenants import token_of, write_tokens

from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024


def _connect(srv) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _put_head(address: str, length: int, expect: bool = False, token: str | None = None) -> bytes:
    head = b"PUT /kv/%s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % (address.encode(), length)
    if expect:
        head += b"Expect: 100-continue\r\n"
    if token:
        head += b"Authorization: Bearer %s\r\n" % token.encode()
    return head + b"\r\n"


def _response(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Read one whole response (head and Content-Length body) from ``s``."""
    s.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
            while len(body) < n:
                chunk = s.recv(65536)
                if not chunk:
                    break
                body += chunk
    return head + b"\r\n\r\n" + body


def _header(raw: bytes, name: bytes) -> bytes | None:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def _closed_by_server(s: socket.socket, timeout: float = 5.0) -> bool:
    """True if the server closes ``s`` within ``timeout`` without sending anything more."""
    s.settimeout(timeout)
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ---------------------------------------------------------------- uploads in flight (item 4)


def test_stalled_uploads_cannot_pin_the_slab(server_factory):
    """Four uploads that announce 16 MiB of a 64 MiB slab and stall: two fit in the default
    upload share (half the slab), the others get 503 + Retry-After, and the other half of
    the slab keeps serving (once, every other PUT got 507)."""
    srv = server_factory(workers=2, capacity="64MiB")
    kept = os.urandom(200 * KiB)
    assert request(srv, "PUT", "/kv/kept", kept).status == 201
    stalled, refused = [], []
    for k in range(4):
        s = _connect(srv)
        s.sendall(_put_head(f"stall-{k}", 16 * MiB) + b"s" * KiB)
        if k < 2:
            wait_for(lambda k=k: stats(srv)["reserved_pages"] == (k + 1) * 256, timeout=10,
                     what=f"stalled upload {k} to reserve its pages")  # fmt: skip
            stalled.append(s)
        else:
            reply = _response(s)
            assert status_of(reply) == 503, reply[:300]
            assert _header(reply, b"Retry-After") == b"1"
            assert b"--upload-share" in reply
            refused.append(s)
    try:
        assert stats(srv)["reserved_pages"] == 2 * 256
        # Honest work goes on in the other half: small PUTs (64 MiB of them, evicting as
        # they go), a hit on a resident block; a streamed PUT is told to retry shortly.
        for i in range(64):
            r = request(srv, "PUT", f"/kv/honest-{i}", os.urandom(64 * KiB))
            assert r.status == 201, r
        assert request(srv, "GET", "/kv/honest-63").status == 200
        r = request(srv, "PUT", "/kv/streamed", os.urandom(MiB))
        assert r.status == 503 and r.headers["Retry-After"] == "1", r
    finally:
        for s in stalled + refused:
            s.close()
    wait_for(lambda: stats(srv)["reserved_pages"] == 0, timeout=10, what="stalled pages freed")
    assert request(srv, "PUT", "/kv/streamed", os.urandom(MiB)).status == 201
    assert stats(srv)["unique_blocks"] >= 2


@pytest.fixture
def fds_for_1030_sockets():
    """Room for this test's sockets under a soft fd limit of 1024 (the server inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_many_small_stalled_uploads_do_not_fill_the_reservation_table(
    server_factory, fds_for_1030_sockets
):
    """1,030 stalled 65,537-byte uploads (more than the old fixed 1,024-entry table held):
    every one reserves, and a streamed PUT still succeeds while most of the slab is free."""
    n, pages_each = 1030, 17  # 65,537 bytes in 4 KiB pages
    srv = server_factory(workers=2, capacity="160MiB", extra=("--page-size", "4KiB"))
    socks: list[socket.socket] = []
    try:
        for k in range(n):
            s = socket.create_connection((srv.host, srv.port), timeout=10)
            s.sendall(_put_head(f"small-stall-{k}", 65_537) + b"x")
            socks.append(s)
        wait_for(lambda: stats(srv)["reserved_pages"] == n * pages_each, timeout=30,
                 what=f"{n} stalled uploads to reserve their pages")  # fmt: skip
        with selectors.DefaultSelector() as sel:  # select() cannot watch fds over 1023
            for s in socks:
                sel.register(s, selectors.EVENT_READ)
            assert not sel.select(0), "no stalled upload is answered while the slab has room"
        st = stats(srv)
        assert st["free_bytes"] > st["capacity_bytes"] // 2
        r = request(srv, "PUT", "/kv/streamed", os.urandom(MiB))
        assert r.status == 201, r
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: stats(srv)["reserved_pages"] == 0, timeout=30, what="stalled pages freed")


# ---------------------------------------------------------------- chunked spool (item 5)


def _chunked_head(address: str, token: str | None = None) -> bytes:
    auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
    return b"PUT /kv/%s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n%s\r\n" % (
        address.encode(),
        auth,
    )


def _chunks(data: bytes, step: int = 256 * KiB) -> bytes:
    out = b""
    for i in range(0, len(data), step):
        piece = data[i : i + step]
        out += b"%x\r\n%s\r\n" % (len(piece), piece)
    return out


def _answers(socks: list[socket.socket], n: int, what: str) -> dict[socket.socket, bytes]:
    """The answers of the first ``n`` of ``socks`` the server answers (waited for)."""
    answered: dict[socket.socket, bytes] = {}

    def enough() -> bool:
        ready, _, _ = select.select([s for s in socks if s not in answered], [], [], 0.05)
        for s in ready:
            answered[s] = _response(s)
        return len(answered) >= n

    wait_for(enough, timeout=20, what=what)
    return answered


def test_stalled_chunked_uploads_have_a_memory_budget(server_factory):
    """Four stalled chunked uploads of 1.5 MiB against a 4 MiB spool: at most two are
    held, the rest get 503 + Retry-After; an honest chunked PUT still fits, and the
    budget comes back when the stalled ones go."""
    srv = server_factory(workers=1, capacity="64MiB", extra=("--chunked-spool", "4MiB"))
    socks = []
    try:
        for k in range(4):
            s = _connect(srv)
            s.sendall(_chunked_head(f"chunk-stall-{k}") + _chunks(b"c" * (3 * MiB // 2)))
            socks.append(s)
        answered = _answers(socks, 2, "two chunked uploads to be refused")
        for reply in answered.values():
            assert status_of(reply) == 503, reply[:300]
            assert _header(reply, b"Retry-After") == b"1"
            assert b"--chunked-spool" in reply
        data = os.urandom(256 * KiB)
        with _connect(srv) as s:
            s.sendall(_chunked_head("honest-chunked") + _chunks(data, 64 * KiB) + b"0\r\n\r\n")
            assert status_of(_response(s)) == 201
        assert request(srv, "GET", "/kv/honest-chunked").body == data
    finally:
        for s in socks:
            s.close()
    big = os.urandom(3 * MiB + 17)

    def big_fits() -> bool:
        with _connect(srv) as s:
            s.sendall(_chunked_head("big-chunked") + _chunks(big) + b"0\r\n\r\n")
            return status_of(_response(s)) == 201

    wait_for(big_fits, timeout=20, what="the spool budget to come back")
    assert request(srv, "GET", "/kv/big-chunked").body == big
    assert stats(srv)["reserved_pages"] == 0


def test_one_tenants_stalled_chunked_uploads_hold_at_most_half_the_spool(server_factory, tmp_path):
    """With tenants, one tenant's three stalled chunked uploads of 1.5 MiB against a 4 MiB
    spool hold at most half of it (the first alone, the others refused), so another
    tenant's chunked PUT of 1.5 MiB still lands while they stall (once it got 503: the
    stalled tenant held the whole spool)."""
    path = write_tokens(tmp_path / "tokens.toml", [
        {"name": "stalls", "namespace": "a"}, {"name": "honest", "namespace": "b"},
    ])  # fmt: skip
    srv = server_factory(workers=1, capacity="64MiB",
                         extra=("--chunked-spool", "4MiB", "--tokens", str(path)))  # fmt: skip
    socks = []
    try:
        for k in range(3):
            s = _connect(srv)
            s.sendall(_chunked_head(f"stall-{k}", token_of("stalls"))
                      + _chunks(b"c" * (3 * MiB // 2)))  # fmt: skip
            socks.append(s)
        answered = _answers(socks, 2, "two of the stalled tenant's uploads refused")
        for reply in answered.values():
            assert status_of(reply) == 503, reply[:300]
            assert b"one tenant may (half the --chunked-spool)" in reply
        data = os.urandom(3 * MiB // 2)
        with _connect(srv) as s:
            s.sendall(_chunked_head("honest", token_of("honest")) + _chunks(data) + b"0\r\n\r\n")
            reply = _response(s)
            assert status_of(reply) == 201, reply[:300]
        assert request(srv, "GET", "/kv/honest", token=token_of("honest")).body == data
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    ("extra", "reason"),
    [(("--capacity", "8MiB", "--max-block-size", "16MiB"),
      "--max-block-size 16MiB is larger than the slab's capacity of 8MiB: no such block could "
      "be stored; lower --max-block-size or raise --capacity"),
     (("--upload-share", "1.5"), "--upload-share 1.5 must be a fraction in (0, 1]"),
     (("--chunked-spool", "0"), "--chunked-spool must be at least 1 byte")],
)  # fmt: skip
def test_bad_upload_limits_are_refused_at_start(extra, reason):
    name = unique_slab_name("lim")
    cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{free_port()}",
           "--slab-name", name, *extra]  # fmt: skip
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        Slab.unlink_named(name)  # made only if the settings were (wrongly) accepted
    assert out.returncode == 1, out.stderr
    assert reason in out.stderr


def test_default_max_block_size_fits_a_small_capacity(server_factory):
    srv = server_factory(workers=1, capacity="8MiB")
    assert stats(srv)["max_block_size"] == 8 * MiB


# ---------------------------------------------------------------- dedup from the headers (item 6)


def test_dedup_hit_with_expect_is_answered_before_any_body_byte(server_factory):
    srv = server_factory(workers=2)
    block = os.urandom(2 * MiB)
    assert request(srv, "PUT", "/kv/dup", block).status == 201
    for n in (1, 2):
        with _connect(srv) as s:
            s.sendall(_put_head("dup", len(block), expect=True))  # the head only
            reply = _response(s)
            assert status_of(reply) == 200, reply[:300]
            assert reply.endswith(b"\r\n\r\ndedup\n")
            assert _header(reply, b"Connection") == b"close"
            assert _closed_by_server(s), "a final answer to Expect closes the connection"
        st = stats(srv)
        assert (st["unique_blocks"], st["total_refs"], st["dedup_hits"]) == (1, 1 + n, n)
    # Answered outside the usual handler, yet counted in /metrics.
    counted = re.compile(
        r'^eg_kv_requests_total\{method="PUT",route="block",status="200"\} 2(\.0)?$', re.M
    )
    wait_for(lambda: counted.search(request(srv, "GET", "/metrics").text), timeout=10,
             what="the two dedup hits in /metrics")  # fmt: skip
    # Another length is a conflict, answered from the headers as well.
    with _connect(srv) as s:
        s.sendall(_put_head("dup", len(block) + 1, expect=True))
        assert status_of(_response(s)) == 409
    # Absent: 100 Continue, then the body is stored.
    with _connect(srv) as s:
        s.sendall(_put_head("fresh", 5, expect=True))
        assert _response(s).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"hello")
        assert status_of(_response(s)) == 201


def test_streamed_dedup_hit_refs_at_the_headers_and_survives_eviction(server_factory):
    """The reference is taken when the headers arrive (the hit counts when the put ends);
    a block evicted while the body is still coming no longer turns the PUT into a 503 (it
    did, 24-39 times in 25 s)."""
    srv = server_factory(workers=2, capacity="16MiB")
    block = os.urandom(MiB)
    assert request(srv, "PUT", "/kv/churned", block).status == 201
    with _connect(srv) as s:
        s.sendall(_put_head("churned", len(block)) + block[: MiB // 2])
        wait_for(lambda: stats(srv)["total_refs"] == 2, timeout=10,
                 what="the dedup hit's reference taken from the headers")  # fmt: skip
        assert stats(srv)["dedup_hits"] == 0
        for i in range(100):  # new blocks through the 16 MiB slab until it is evicted
            assert request(srv, "PUT", f"/kv/churn-{i}", os.urandom(MiB)).status == 201
            if request(srv, "HEAD", "/kv/churned").status == 404:
                break
        assert request(srv, "HEAD", "/kv/churned").status == 404
        s.sendall(block[MiB // 2 :])
        reply = _response(s)
        assert status_of(reply) == 200 and reply.endswith(b"dedup\n"), reply[:300]
        # The body was read and dropped: the connection serves the next request.
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status_of(_response(s)) == 200
    assert stats(srv)["dedup_hits"] == 1


def test_cut_off_dedup_put_gives_its_reference_back(server_factory):
    """The reference goes back, and dedup_hits never moves, back or forth: it went 1 then
    0 (a Prometheus counter that goes back reads as a reset)."""
    srv = server_factory(workers=2)
    block = os.urandom(3 * MiB)
    assert request(srv, "PUT", "/kv/cut", block).status == 201
    seen = []

    def refs(n: int) -> bool:
        st = stats(srv)
        seen.append(st["dedup_hits"])
        return st["total_refs"] == n

    with _connect(srv) as s:
        s.sendall(_put_head("cut", len(block)) + block[:MiB])
        wait_for(lambda: refs(2), timeout=10, what="the reference taken")
    wait_for(lambda: refs(1), timeout=10, what="the reference given back")
    assert set(seen) == {0}
    st = stats(srv)
    assert (st["unique_blocks"], st["dedup_hits"], st["logical_bytes"]) == (1, 0, len(block))
    assert request(srv, "GET", "/kv/cut").body == block


# ---------------------------------------------------- Expect: final answers close (item 10)


@pytest.mark.parametrize(
    ("path", "length", "status"),
    [("/kv/too-big", 65 * MiB, 413), ("/kv/bad!address", 5, 400), ("/kv/other-length", 7, 409)],
)
def test_final_answer_to_expect_closes_the_connection(server_factory, path, length, status):
    srv = server_factory(workers=1)
    assert request(srv, "PUT", "/kv/other-length", b"12345").status == 201
    with _connect(srv) as s:
        s.sendall(_put_head(path.removeprefix("/kv/"), length, expect=True))
        assert status_of(_response(s)) == status
        # The client need not send the body; its next bytes must not be read as a request.
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return
        assert _closed_by_server(s)


def test_unauthorized_expect_closes_the_connection(server_factory):
    srv = server_factory(workers=1, env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "sekrit-token"})
    with _connect(srv) as s:
        s.sendall(_put_head("blk", 5, expect=True, token="wrong"))
        reply = _response(s)
        assert status_of(reply) == 401 and b"sekrit-token" not in reply
        assert _closed_by_server(s)
    # With the token, the same head gets 100 Continue.
    with _connect(srv) as s:
        s.sendall(_put_head("blk", 5, expect=True, token="sekrit-token"))
        assert _response(s).startswith(b"HTTP/1.1 100 Continue")


@pytest.mark.parametrize(
    "head",
    [b"GET /kv/x HTTP/1.1\r\n", b"GET /kv/stats HTTP/1.1\r\n",
     b"POST /kv/batch/exists HTTP/1.1\r\nContent-Length: 16\r\n"],
)  # fmt: skip
def test_every_route_refuses_an_unknown_expect_alike(server_factory, head):
    """eg-kv's one-line 417 that quotes nothing, with its headers, then the close."""
    srv = server_factory(workers=1)
    with _connect(srv) as s:
        s.sendall(head + b"Host: t\r\nExpect: bogus-VALUE-42\r\n\r\n")
        reply = _response(s)
        assert status_of(reply) == 417, reply
        assert b"bogus-VALUE-42" not in reply
        assert reply.endswith(b"\r\n\r\nonly Expect: 100-continue is understood\n"), reply
        assert _header(reply, b"X-EgKv-Worker") and _header(reply, b"Server") == b"eg-kv"
        assert _closed_by_server(s)


def test_expect_100_continue_on_batch_exists_gets_the_interim_answer(server_factory):
    srv = server_factory(workers=1)
    body = b'{"addresses":["a"]}'
    with _connect(srv) as s:
        s.sendall(b"POST /kv/batch/exists HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        assert _response(s).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        reply = _response(s)
        assert status_of(reply) == 200 and reply.endswith(b'"prefix_hits": 0}\n'), reply


@pytest.mark.timeout(60)
def test_a_dedup_answer_the_client_left_before_gives_its_reference_back(server_factory):
    """A client sends an Expect head of a resident block and resets at once: no reference
    may stay taken for an answer nobody got (the 200 write fails, or nothing was taken)."""
    srv = server_factory(workers=1)
    block = os.urandom(64 * KiB)
    address = "leak-" + block[:6].hex()
    assert request(srv, "PUT", f"/kv/{address}", block).status == 201
    before = stats(srv)
    refs, hits, answered = before["total_refs"], before["dedup_hits"], _dedup_answers(srv)
    for _ in range(50):
        s = _connect(srv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(_put_head(address, len(block), expect=True))
        s.close()  # RST, usually before the answer
    # A reference stays only for a 200 that went out (the server cannot know that the
    # kernel's reset came after it: on a loaded machine some do): never for one that did
    # not. The sole worker's /metrics counts every 200 written.
    wait_for(lambda: stats(srv)["total_refs"] - refs == _dedup_answers(srv) - answered,
             timeout=10, what="a reference per dedup answer written, and no more")  # fmt: skip
    # Taken back as the dedup hit it was, not as a DELETE (the counters are exact).
    after = stats(srv)
    assert after["deletes"] == 0, after
    assert after["dedup_hits"] - hits == _dedup_answers(srv) - answered, after


def _dedup_answers(srv) -> int:
    pattern = r'eg_kv_requests_total\{method="PUT",route="block",status="200"\} (\S+)'
    m = re.search(pattern, request(srv, "GET", "/metrics").text)
    return int(float(m.group(1))) if m else 0


# ---------------------------------------------------------------- --fresh (item 9)


def test_fresh_leaves_a_foreign_segment_alone(server_factory):
    name = unique_slab_name("foreign")
    precious = os.urandom(64 * KiB)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=len(precious))
    try:
        os.pwrite(shm.fd, precious, 0)
        srv = server_factory(workers=1, slab_name=name, extra=("--fresh",), wait=False)
        assert srv.proc.wait(30) == 1, srv.log()
        log = srv.log()
        assert f"shared-memory segment {name}" in log and "not an eg-kv slab" in log
        assert "another --slab-name" in log
        assert os.pread(shm.fd, len(precious), 0) == precious
        assert Slab.exists_named(name), "the foreign segment was unlinked"
    finally:
        shm.close_fd()
        Slab.unlink_named(name)


def test_fresh_leaves_a_live_eg_kv_slab_of_another_version_alone(server_factory):
    """A segment with eg-kv's magic but another layout version, owned by a live process."""
    from eg_kv.slab import layout as L

    name = unique_slab_name("otherver")
    header = bytearray(L.HEADER_SIZE)
    header[: len(L.MAGIC)] = L.MAGIC
    header[len(L.MAGIC) : len(L.MAGIC) + 4] = (L.VERSION + 97).to_bytes(4, "little")
    header[L.OWNER_PID_OFFSET : L.OWNER_PID_OFFSET + 8] = os.getpid().to_bytes(8, sys.byteorder)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=len(header))
    try:
        os.pwrite(shm.fd, bytes(header), 0)
        srv = server_factory(workers=1, slab_name=name, extra=("--fresh",), wait=False)
        assert srv.proc.wait(30) == 1, srv.log()
        log = srv.log()
        assert f"slab {name}" in log and f"running eg-kv (pid {os.getpid()})" in log, log
        assert Slab.exists_named(name), "the live slab was unlinked"
        assert os.pread(shm.fd, len(header), 0) == header
    finally:
        shm.close_fd()
        Slab.unlink_named(name)


def test_expect_with_a_malformed_checksum_is_a_400_and_takes_no_reference(server_factory):
    """The headers of a PUT with ``Expect`` are checked as those of one without: a bad
    checksum header is refused before the dedup (it was a 200 that took a reference)."""
    srv = server_factory(workers=1)
    block = os.urandom(200_000)
    assert request(srv, "PUT", "/kv/held", block).status == 201
    with _connect(srv) as s:
        head = _put_head("held", len(block), expect=True)
        s.sendall(head.replace(b"\r\n\r\n", b"\r\nX-Eg-Kv-Checksum: zzzz-not-hex\r\n\r\n"))
        reply = _response(s)
        assert status_of(reply) == 400, reply[:300]
        assert b"checksum" in reply
    st = stats(srv)
    assert (st["total_refs"], st["dedup_hits"]) == (1, 0)


def test_an_http10_put_with_expect_gets_no_interim_answer(server_factory):
    """HTTP/1.0 has no 100 Continue (RFC 9110 15.2): its body is read and answered."""
    srv = server_factory(workers=1)
    with _connect(srv) as s:
        head = _put_head("h10", 5, expect=True).replace(b"HTTP/1.1", b"HTTP/1.0")
        s.sendall(head + b"hello")
        reply = _response(s)
        assert reply.startswith(b"HTTP/1.") and status_of(reply) == 201, reply[:300]
        assert b"100 Continue" not in reply
    assert request(srv, "GET", "/kv/h10").body == b"hello"
