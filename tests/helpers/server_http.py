"""Small HTTP helpers shared by the server tests: one real connection per call, no mocks."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time

WORKER_HEADER = "X-EgKv-Worker"


class Reply:
    """A complete HTTP response: status, headers (case-insensitive) and the whole body."""

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.body)

    @property
    def worker(self) -> int:
        return int(self.headers[WORKER_HEADER])

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.body[:120]!r})"


def request(
    srv,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    context: ssl.SSLContext | None = None,
    token: str | None = None,
) -> Reply:
    """One request on a fresh connection to the server ``srv`` (a conftest ``Server``)."""
    if srv.scheme == "https":
        conn = http.client.HTTPSConnection(srv.host, srv.port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    hdrs = dict(headers or {})
    tok = token if token is not None else srv.token
    if tok and "Authorization" not in hdrs:
        hdrs["Authorization"] = f"Bearer {tok}"
    try:
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, resp.headers, resp.read())
    finally:
        conn.close()


def stats(srv) -> dict:
    reply = request(srv, "GET", "/kv/stats")
    assert reply.status == 200, reply
    return reply.json()


def raw_exchange(
    port: int, data: bytes, timeout: float = 5.0, shut_write: bool = False, host="127.0.0.1"
) -> bytes:
    """Send raw bytes and read until the server closes the connection or ``timeout`` passes.

    aiohttp closes a connection as soon as the client half-closes it (``shut_write``),
    without answering; send ``Connection: close`` to have the server close after its answer.
    """
    out = bytearray()
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)


def status_of(raw: bytes) -> int | None:
    """The status code of the first response in ``raw``, or None if there is none."""
    if not raw.startswith(b"HTTP/1."):
        return None
    return int(raw.split(b" ", 2)[1])


class Conn:
    """One raw connection to ``srv``, and a strict reader of the responses that come back on it."""

    def __init__(self, srv):
        self.sock = socket.create_connection((srv.host, srv.port), timeout=10)
        self.buf = b""

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 20)
        self.buf += chunk
        return bool(chunk)

    def response(self, method: str = "GET") -> tuple[str, dict[str, str], bytes]:
        """The next response: (status line, headers by lower-case name, body)."""
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), f"connection closed before a response head: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("ascii").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            assert sep and name.lower() not in headers, f"bad or repeated header {line!r}"
            headers[name.lower()] = value.strip()
        status = int(status_line.split()[1])
        length = 0 if method == "HEAD" or status == 204 else int(headers["content-length"])
        while len(self.buf) < length:
            assert self._fill(), "connection closed inside a body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return status_line, headers, body

    def closed_by_server(self) -> bool:
        """True once the server has closed its end (and sent nothing more)."""
        return not self.buf and not self._fill()


#: Header lines that may differ between the fast lane's answer and aiohttp's: the clock,
#: and the close.
VARYING = {"date", "connection"}


def both_ways(srv, send, setup: bytes = b"", method: str = "PUT") -> list:
    """The answer to one request on a kept-alive connection (the fast lane's,
    eg_kv/server/lane.py), and to the same request with ``Connection: close`` (which the
    lane declines: aiohttp's way): ``[(status line, headers but VARYING, body)] * 2``.

    Args:
        send: ``send(conn, i, close)`` sends the request on ``conn``, with the header line
            ``close`` added (empty the first time); ``i``: 0, then 1, for its own address.
        setup: a request sent first on each connection (its answer read and dropped).

    After the kept-alive answer nothing more may have come, and the next request is
    answered whole; the closing one must close.
    """
    answers = []
    for i, close in enumerate(("", "Connection: close\r\n")):
        with Conn(srv) as conn:
            if setup:
                conn.send(setup)
                conn.response()
            send(conn, i, close)
            line, headers, answer = conn.response(method)
            answers.append((line, {k: v for k, v in headers.items() if k not in VARYING},
                            answer))  # fmt: skip
            if close:
                assert conn.closed_by_server()
            else:
                conn.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                assert conn.response()[0] == "HTTP/1.1 200 OK"
    return answers
