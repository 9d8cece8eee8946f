"""Large GETs are sent straight from slab memory: a block released mid-send must never
reach the client as a complete body, only as a short one (a miss). With tenants they are
sent as checked copies: a block released mid-send must not carry another namespace's
bytes to its reader, not even in a short body."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

MiB = 1024 * 1024
SIZE = 32 * MiB


def _request(srv, method: str, path: str, body: bytes | None = None) -> int:
    req = urllib.request.Request(srv.url + path, data=body, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def _stats(srv) -> dict:
    with urllib.request.urlopen(srv.url + "/kv/stats", timeout=10) as r:
        return json.loads(r.read())


def _slow_get(srv, address: str, token: str = "") -> tuple[socket.socket, int, bytes]:
    """Start a GET on a socket with a tiny receive buffer; read the headers and a little."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.settimeout(30)
    sock.connect((srv.host, srv.port))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"GET /kv/{address} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, body = buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                 .split(b":")[1])  # fmt: skip
    return sock, length, body


def _read_to_end(sock: socket.socket, have: bytes, length: int) -> bytes:
    chunks = [have]
    got = len(have)
    while got < length:
        try:
            data = sock.recv(4 * MiB)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
        got += len(data)
    sock.close()
    return b"".join(chunks)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1])
def test_block_released_mid_send_gives_a_short_body(server_factory, workers):
    srv = server_factory(workers=workers, capacity="64MiB")
    old = bytes([0xAA]) * SIZE
    new = bytes([0x55]) * SIZE
    assert _request(srv, "PUT", "/kv/blk", old) == 201
    sock, length, first = _slow_get(srv, "blk")
    assert length == SIZE
    # A hit is counted once the send ends whole: one counted at its start and taken back
    # when the block went made get_hits go 1 -> 0 (a counter reset to Prometheus).
    assert (_stats(srv)["get_hits"], _stats(srv)["get_misses"]) == (0, 0)
    # While the send is stuck on the client's full buffer, the block is released and its
    # pages are reused by another block of the same size.
    assert _request(srv, "DELETE", "/kv/blk") == 204
    assert _request(srv, "PUT", "/kv/other", new) == 201
    body = _read_to_end(sock, first, length)
    assert len(body) < SIZE, "a released block reached the client as a complete body"
    assert (_stats(srv)["get_hits"], _stats(srv)["get_misses"]) == (0, 1)


def test_large_get_is_complete_and_identical_when_nothing_changes(server_factory):
    srv = server_factory(workers=1, capacity="64MiB")
    data = bytes(range(256)) * (SIZE // 256)
    assert _request(srv, "PUT", "/kv/whole", data) == 201
    sock, length, first = _slow_get(srv, "whole")
    assert _read_to_end(sock, first, length) == data
    with urllib.request.urlopen(srv.url + "/kv/whole", timeout=30) as r:  # keep-alive path
        assert r.read() == data
    assert _stats(srv)["get_hits"] == 2


@pytest.mark.slow
def test_with_tenants_a_block_released_mid_send_never_carries_another_namespaces_bytes(
    server_factory, tmp_path
):
    """Tenant "evil" starts a slow GET of its own block, deletes it, and "victim" stores
    one of its own: the pages evil's send was reading from were free again, and it got
    5.5 MB of victim's block before the final check cut the body."""
    from helpers.server_http import request
    from helpers.tenants import token_of, write_tokens

    tenants = [{"name": "evil", "role": "readwrite"}, {"name": "victim", "role": "readwrite"}]
    tokens = write_tokens(tmp_path / "tokens.toml", tenants)
    srv = server_factory(workers=1, capacity="64MiB", extra=("--tokens", str(tokens)))
    evil, victim = token_of("evil"), token_of("victim")
    assert request(srv, "PUT", "/kv/blk", bytes([0xAA]) * SIZE, token=evil).status == 201
    sock, length, first = _slow_get(srv, "blk", evil)
    assert length == SIZE
    assert request(srv, "DELETE", "/kv/blk", token=evil).status == 204
    assert request(srv, "PUT", "/kv/secret", bytes([0x55]) * SIZE, token=victim).status == 201
    body = _read_to_end(sock, first, length)
    assert len(body) < SIZE, "a released block reached the client as a complete body"
    assert body.count(0x55) == 0, f"{body.count(0x55)} bytes of victim's block reached evil"
