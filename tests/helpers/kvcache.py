"""Helpers for the client tests: misbehaving HTTP servers on real loopback sockets.

:class:`RawServer` listens on 127.0.0.1 and answers every request in one chosen broken way
(never, with garbage, with a short body, dripping, with bad JSON, unframed, compressed,
with interim answers, redirected, reset, or correctly but closing the connection after
each answer). Everything it starts is stopped by :meth:`stop`; every loop it runs is
bounded in bytes and time. Also: opening any client kind, waiting on an L2 connector's
completions, and keys in LMCache's format.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from eg_kv.checksum import encode as encode_checksum
from eg_kv.checksum import of as checksum_of
from eg_kv.wire import ADDRESS_HEADER, CHECKSUM_HEADER

HEAD_END = b"\r\n\r\n"
#: Headers that make a read change state (a lookup that leases, a GET that releases).
_LEASE_HEADS = (b"\r\nx-eg-kv-lease-ms:", b"\r\nx-eg-kv-release:")
_CL_RE = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_EXPECT_RE = re.compile(rb"\r\nexpect:\s*100-continue", re.IGNORECASE)
#: What the unframed and endless modes send at most, and for how long.
FLOOD_BYTES = 512 * 1024 * 1024
FLOOD_SECONDS = 20.0
#: What the gzip mode's body inflates to.
BOMB_BYTES = 256 * 1024 * 1024


@functools.cache
def gzip_bomb() -> bytes:
    """A small gzip body that inflates to :data:`BOMB_BYTES` zero bytes."""
    return gzip.compress(bytes(BOMB_BYTES), compresslevel=9)


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
        early_hints / continue100: a ``103 Early Hints`` (or an unasked ``100 Continue``)
            before each correct answer: a GET of ``/kv/<addr>`` answers ``<addr>``, PUT
            201, DELETE 204, HEAD 200, the JSON routes "everything exists" (keep-alive).
        dropwrite: GET and HEAD answer 404 (keep-alive); a PUT or DELETE is counted in
            ``applied`` and the connection dropped without an answer.
        redirect: ``307`` to ``redirect_to`` + the request target.
        final_first: answer ``200`` to a request's head without reading its body (no
            ``100 Continue``), then count in ``after_head`` every byte that still comes
            until the client closes (``client_closed`` is set then).
        huge: promise a 1.5 GiB body and send nothing more.
        nolength: a ``200`` without Content-Length, up to 512 MiB, then close.
        endless_chunked: a ``200`` whose chunked body never ends (1 MiB chunks).
        gzip: a ``200`` (GET, POST) or ``503`` (others) whose small gzip body inflates to
            256 MiB.
        reset: read the request, then reset the connection (RST, no answer).
        late404: answer every request 404 after 0.2 s (keep-alive): healthy, not fast.
        stale: correct answers (``early_hints``'; blocks named ``absent...`` are not
            there), but each GET or HEAD after a connection's first is sent that
            connection's previous answer first: answers out of step.

    Attributes:
        accepted: connections accepted so far.
        requests: requests read so far (request lines).
        heads: the whole head of each request read.
        applied: PUT and DELETE requests the ``dropwrite`` mode took.
    """

    def __init__(self, mode: str, redirect_to: str = "") -> None:
        if mode == "gzip":
            gzip_bomb()  # built before the first answer is due, not while a client waits
        self.mode = mode
        self.redirect_to = redirect_to
        self.accepted = 0
        self.requests: list[bytes] = []
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.applied = 0
        self.after_head = 0
        self.client_closed = threading.Event()
        self._last_answer: dict[int, bytes] = {}  # "stale": each connection's last GET answer
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
        """Read one request (headers and body) off ``conn``; False when it closed.

        ``Expect: 100-continue`` is answered ``100 Continue`` (except in ``final_first``
        mode, which reads the head only).
        """
        while HEAD_END not in buf:
            data = conn.recv(65536)
            if not data:
                return False
            buf += data
        head, _, rest = bytes(buf).partition(HEAD_END)
        with self._lock:
            self.requests.append(head.split(b"\r\n", 1)[0])
            self.heads.append(head)
        if self.mode == "final_first":
            del buf[:]
            buf += rest
            return True
        m = _CL_RE.search(head)
        need = int(m.group(1)) if m else 0
        if need > len(rest) and _EXPECT_RE.search(head):
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(rest) < need:
            data = conn.recv(min(1 << 20, need - len(rest)))
            if not data:
                return False
            rest += data
        del buf[:]
        buf += rest[need:]
        with self._lock:
            self.bodies.append(rest[:need])
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
                    conn.sendall(b"HTTP/1.0 200 OK\r\n%s\r\nhello" % _checksum_line(b"hello"))
                    return
                if self.mode == "oneshot":
                    conn.sendall(_block_answer(b"hello"))
                    return
                if not self._serve_more(conn, buf):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def _serve_more(self, conn: socket.socket, buf: bytearray) -> bool:
        """The modes added for the bad-server matrix; False when the connection is done."""
        line = self.requests[-1]
        method, target = [*line.split(b" "), b"", b""][:2]
        if self.mode in ("early_hints", "continue100"):
            interim = (
                b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
                if self.mode == "early_hints"
                else b"HTTP/1.1 100 Continue\r\n\r\n"
            )
            # The interim answer alone first, as a real server sends it before it has the
            # final one: a client that takes it as final reads the 200 as its next answer.
            conn.sendall(interim)
            self._stop.wait(0.01)
            conn.sendall(self._correct_answer(method, target))
            return True
        if self.mode in ("infinity", "deepjson"):
            # A slab description no server sends (json takes Infinity; int() of it raises),
            # or one nested past the decoder's depth; every other answer is right.
            if target.endswith(b"/kv/local/slab"):
                doc = (b'{"slab":"/a","readers":"/b","slab_id":"00","layout_version":Infinity,'
                       b'"total_size":1,"namespace_id":0}' if self.mode == "infinity"
                       else b"[" * 50_000)  # fmt: skip
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(doc), doc))  # fmt: skip
            else:
                conn.sendall(self._correct_answer(method, target))
            return True
        if self.mode == "long_snapshot":
            # A snapshot of 16 MiB of short lines that change nothing (removals of blocks
            # it never listed), then its end: a reader that holds the answer whole, or
            # splits it at once, holds many times that.
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(LONG_SNAPSHOT))  # fmt: skip
            conn.sendall(LONG_SNAPSHOT)
            return True
        if self.mode in LAX_FRAMINGS:
            # A block's right bytes under a framing HTTP/1.1 does not allow (a proxy may
            # read it otherwise): to be refused, not read as the client's guess.
            address = target.rsplit(b"/", 1)[-1]
            head = _block_answer(address, address).split(b"\r\n\r\n")[0]
            head = head.replace(b"Content-Length: %d" % len(address), LAX_FRAMINGS[self.mode])
            if b"chunked" in LAX_FRAMINGS[self.mode]:
                size = b"0x%x" % len(address) if self.mode == "chunk_0x" else b"-%x" % len(address)
                body = b"%s\r\n%s\r\n0\r\n\r\n" % (size, address)
            else:
                body = address
            conn.sendall(head + b"\r\n\r\n" + body)
            return True
        if self.mode == "stale":
            # Out of step (a proxy that replays): each GET after a connection's first gets
            # that connection's previous answer first, then its own.
            answer = self._correct_answer(method, target)
            if method in (b"GET", b"HEAD"):
                last = self._last_answer.get(conn.fileno())
                if last is not None:
                    conn.sendall(last)
                    self._stop.wait(0.01)
                self._last_answer[conn.fileno()] = answer
            conn.sendall(answer)
            return True
        if self.mode == "late404":  # a healthy server whose every answer takes 0.2 s
            self._stop.wait(0.2)
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return True
        if self.mode == "closelate":  # reads the request, says nothing for 0.9 s, closes
            self._stop.wait(0.9)
            return False
        if self.mode == "nochecksum":  # a block answer without its checksum header
            body = target.rsplit(b"/", 1)[-1]
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            return True
        if self.mode == "dropwrite":
            head = self.heads[-1].lower()
            if method in (b"PUT", b"DELETE") or any(h in head for h in _LEASE_HEADS):
                with self._lock:
                    self.applied += 1
                return False
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return True
        if self.mode == "redirect":
            location = self.redirect_to.encode() + target
            conn.sendall(
                b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n"
                % location
            )
            return True
        if self.mode == "final_first":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            got = len(buf)
            deadline = time.monotonic() + 10
            conn.settimeout(0.1)
            while time.monotonic() < deadline and not self._stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    self.client_closed.set()
                    break
                got += len(data)
            with self._lock:
                self.after_head += got
            return False
        if self.mode == "huge":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1610612736\r\n\r\n")
            self._stop.wait(FLOOD_SECONDS)
            return False
        if self.mode == "nolength":
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            self._flood(conn, b"")
            return False
        if self.mode == "endless_chunked":
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            self._flood(conn, b"100000\r\n", b"\r\n")
            return False
        if self.mode in ("trailers", "extensions"):
            # A chunked answer that never ends in its framing: trailer lines after the last
            # chunk, or one-byte chunks with 4 KB extensions (each line under any limit).
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            if self.mode == "trailers":
                conn.sendall(b"0\r\n")
                line = b"x-t: " + b"a" * 4000 + b"\r\n"
            else:
                line = b"1;" + b"e" * 4000 + b"\r\nz\r\n"
            self._flood(conn, body=line * 250)
            return False
        if self.mode == "gzip":
            # Reads get a 200, writes a 503: the bomb is in every answer, read or drained.
            status = b"200 OK" if method in (b"GET", b"POST") else b"503 Busy"
            bomb = gzip_bomb()
            conn.sendall(
                b"HTTP/1.1 %s\r\nContent-Encoding: gzip\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (status, len(bomb)) + bomb
            )
            return True
        if self.mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        raise ValueError(f"unknown mode {self.mode}")

    def _flood(self, conn: socket.socket, prefix: bytes = b"", suffix: bytes = b"",
               body: bytes = bytes(1024 * 1024)) -> None:  # fmt: skip
        """Send ``prefix + body + suffix`` again and again until the client leaves, or
        FLOOD_BYTES / FLOOD_SECONDS."""
        piece = prefix + body + suffix
        sent, deadline = 0, time.monotonic() + FLOOD_SECONDS
        while sent < FLOOD_BYTES and time.monotonic() < deadline and not self._stop.is_set():
            conn.sendall(piece)
            sent += len(piece)

    def _absent(self, address: bytes) -> bool:
        """Whether a correct server lacks ``address``: in ``stale`` mode, those named
        ``absent...``; elsewhere none (every block exists)."""
        return self.mode == "stale" and address.startswith(b"absent")

    def _correct_answer(self, method: bytes, target: bytes) -> bytes:
        """What a correct server answers (the block at ``/kv/<addr>`` holds ``<addr>``)."""
        if target.endswith(b"/kv/batch/exists"):
            try:
                n = len(json.loads(self.bodies[-1])["addresses"])
            except ValueError:  # a compact body: this server only speaks JSON, like old ones
                why = b"batch body is not JSON\n"
                return b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(why), why)
            body = json.dumps({"exists": [True] * n, "prefix_hits": n}).encode()
        elif target.endswith(b"/exists"):
            address = target.rsplit(b"/", 2)[-2]
            body = b'{"hash": "%s", "exists": %s}' % (
                address,
                b"false" if self._absent(address) else b"true",
            )
        elif method == b"PUT":
            return b"HTTP/1.1 201 Created\r\nContent-Length: 8\r\n\r\ncreated\n"
        elif method == b"DELETE":
            return b"HTTP/1.1 204 No Content\r\n\r\n"
        elif method == b"HEAD" or self._absent(target.rsplit(b"/", 1)[-1]):
            address = target.rsplit(b"/", 1)[-1]
            if self._absent(address):
                return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
            echo = b"%s: %s\r\n" % (ADDRESS_HEADER.encode(), address)
            return b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n%s\r\n" % echo
        else:
            address = target.rsplit(b"/", 1)[-1]
            return _block_answer(address, address)
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


#: The answer of RawServer's ``long_snapshot`` mode: an empty snapshot at seq 5.
LONG_SNAPSHOT = (
    b'{"epoch": "e"}\n'
    + b'{"hash": "h", "length": 1, "kind": "removed"}\n' * (16 * 1024 * 1024 // 46)
    + b'{"seq": 5}\n'
)
#: RawServer modes whose block answers are framed as HTTP/1.1 does not allow, for blocks
#: of two bytes (``/kv/k1``): the header that replaces the answer's ``Content-Length: 2``
#: (chunk sizes ``0x2`` and ``-2``).
LAX_FRAMINGS = {
    "cl_plus": b"Content-Length: +2",
    "cl_underscore": b"Content-Length: 0_2",
    "cl_twice": b"Content-Length: 99\r\nContent-Length: 2",
    "chunk_0x": b"Transfer-Encoding: chunked",
    "chunk_neg": b"Transfer-Encoding: chunked",
}


def _checksum_line(body: bytes) -> bytes:
    """The checksum header line every eg-kv server sends with a block."""
    return b"%s: %s\r\n" % (CHECKSUM_HEADER.encode(), encode_checksum(checksum_of(body)).encode())


def _block_answer(body: bytes, address: bytes | None = None) -> bytes:
    """A correct server's answer of a block holding ``body`` (echoing ``address``, as
    today's servers do; None: none, as older ones)."""
    echo = b"" if address is None else b"%s: %s\r\n" % (ADDRESS_HEADER.encode(), address)
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s%s\r\n%s" % (
        len(body),
        _checksum_line(body),
        echo,
        body,
    )


class AsyncAsSync:
    """An :class:`~eg_kv.client.aio.AsyncRemoteKVConnector` driven from synchronous test code.

    Each method call runs the coroutine to completion on one private event loop, so one
    test body can drive the sync and the async client alike.
    """

    def __init__(self, **settings: Any) -> None:
        from eg_kv.client.aio_connectors import AsyncRemoteKVConnector

        self._loop = asyncio.new_event_loop()
        self._kv = AsyncRemoteKVConnector(**settings)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._kv, name)
        if not callable(method):  # a property (a counter): as it is
            return method
        return lambda *args, **kw: self._loop.run_until_complete(method(*args, **kw))

    def close(self) -> None:
        self._loop.run_until_complete(self._kv.close())
        self._loop.close()


@contextlib.contextmanager
def open_client(kind: str, **settings: Any) -> Iterator[Any]:
    """A ``"sync"`` :class:`RemoteKVConnector` or an ``"async"`` one behind
    :class:`AsyncAsSync`, closed on exit."""
    from eg_kv.client.connectors import RemoteKVConnector

    kv = RemoteKVConnector(**settings) if kind == "sync" else AsyncAsSync(**settings)
    try:
        yield kv
    finally:
        kv.close()


@contextlib.contextmanager
def bad_server(mode: str) -> Iterator[str]:
    """The URL of a server broken in ``mode`` (a RawServer mode, or ``refused``: a port
    bound but not listening)."""
    if mode == "refused":
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            yield f"http://127.0.0.1:{held.getsockname()[1]}"
    else:
        with RawServer(mode) as srv:
            yield srv.url


def wait_completions(conn: Any, fids: set[int], timeout: float = 30.0) -> dict:
    """Poll the eventfd the way LMCache's demux thread does; return {fid: completion}."""
    poller = select.poll()
    poller.register(conn.event_fd(), select.POLLIN)
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    while not fids <= got.keys():
        left = deadline - time.monotonic()
        assert left > 0, f"completions missing for {fids - got.keys()}"
        if poller.poll(left * 1000):
            for c in conn.drain_completions():
                got[c[0]] = c
    return got


#: The model name in the LMCache-format keys of the tests.
LM_MODEL = "Qwen/Qwen2.5-7B-Instruct"


def lm_keys(n: int, start: int = 0, model: str = LM_MODEL) -> list[str]:
    """Keys in LMCache's native-connector format (they hold ``/``)."""
    return [f"{model}@{1:08x}@0@{(start + i).to_bytes(32, 'big').hex()}" for i in range(n)]
