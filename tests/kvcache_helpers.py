"""Helpers for the client tests: misbehaving HTTP servers on real loopback sockets.

:class:`RawServer` listens on 127.0.0.1 and answers every request in one chosen broken way
(never, with garbage, with a short body, dripping, with bad JSON, or correctly but closing
the connection after each answer). Everything it starts is stopped by :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading

HEAD_END = b"\r\n\r\n"
_CL_RE = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


class RawServer:
    """A loopback TCP server answering each request according to ``mode``.

    Modes:
        silent: read the request and never answer (the connection stays open).
        garbage: answer bytes that are not HTTP, then close.
        short: promise a 100000-byte body, send 10 bytes, close.
        drip: promise a 1 MB body and send one byte every 0.1 s until stopped.
        badjson: a 200 whose body is not JSON on the JSON routes, 404 elsewhere
            (keep-alive).
        chunked: correct answers with chunked bodies (``hello``, or exists=true JSON).
        close10: an HTTP/1.0 ``200`` whose body ``hello`` ends with the connection.
        oneshot: a correct ``200`` with body ``hello`` (no ``Connection: close``), then
            close the socket, as a server that drops idle kept-alive connections does.

    Attributes:
        accepted: connections accepted so far.
        requests: requests read so far (request lines).
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.accepted = 0
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        t = threading.Thread(target=self._accept_loop, daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop accepting, close every connection, join every thread."""
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        for t in self._threads:
            t.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            with self._lock:
                self._threads.append(t)

    def _read_request(self, conn: socket.socket, buf: bytearray) -> bool:
        """Read one request (headers and body) off ``conn``; False when it closed."""
        while HEAD_END not in buf:
            data = conn.recv(65536)
            if not data:
                return False
            buf += data
        head, _, rest = bytes(buf).partition(HEAD_END)
        m = _CL_RE.search(head)
        need = int(m.group(1)) if m else 0
        while len(rest) < need:
            data = conn.recv(min(1 << 20, need - len(rest)))
            if not data:
                return False
            rest += data
        del buf[:]
        buf += rest[need:]
        with self._lock:
            self.requests.append(head.split(b"\r\n", 1)[0])
        return True

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        buf = bytearray()
        try:
            while not self._stop.is_set():
                if not self._read_request(conn, buf):
                    return
                if self.mode == "silent":
                    self._stop.wait()
                    return
                if self.mode == "garbage":
                    conn.sendall(b"THIS IS NOT HTTP\r\n\r\n")
                    return
                if self.mode == "short":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n0123456789")
                    return
                if self.mode == "drip":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
                    while not self._stop.wait(0.1):
                        conn.sendall(b"x")
                    return
                if self.mode == "badjson":
                    if not any(w in self.requests[-1] for w in (b"exists", b"stats", b"healthz")):
                        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                        continue
                    body = b"{this is not json"
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
                    continue
                if self.mode == "chunked":
                    # Well-formed HTTP/1.1 with chunked bodies (and a chunk extension).
                    line = self.requests[-1]
                    body = b'{"hash": "k", "exists": true}' if b"exists" in line else b"hello"
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"3;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
                        % (body[:3], len(body) - 3, body[3:])
                    )
                    continue
                if self.mode == "close10":
                    # HTTP/1.0, no Content-Length: the body runs to the end of the connection.
                    conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nhello")
                    return
                if self.mode == "oneshot":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                    return
                raise ValueError(f"unknown mode {self.mode}")
        except OSError:
            return
        finally:
            conn.close()
