"""A small HTTP/1.1 client connection on the standard library, for the client's hot path.

Why not ``http.client``: it parses every response's headers with ``email.parser`` and
reads through layers of buffered I/O, which cost more than the server's whole answer to
an existence probe (the figures are in docs/design.md, "Clients"). This module sends a
request with one ``sendall`` (head and a small body together; a large body follows
without a copy), parses the status line and the few headers the client needs, and reads
a block straight into the caller's buffer with ``recv_into``.

Every socket wait is bounded by the operation's :class:`Deadline`, re-armed before each
``recv`` / ``sendall``, so a server that never answers, or drips its answer a byte at a
time, costs at most about the timeout. Interim ``1xx`` answers are read past to the final
one (``100 Continue`` is what ``Expect: 100-continue`` waits for); a connection whose
framing is in doubt is marked ``will_close`` and never reused; an idle one is checked with
a zero-timeout poll before it carries another request (:meth:`Connection.dropped`).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable

from ..wire import whole_number
from .dial import open_tcp

#: Largest response head accepted (status line + headers).
MAX_HEAD = 64 * 1024
#: Most interim (1xx) answers skipped before one request's final answer.
MAX_INTERIM = 16
#: Bodies up to this size are sent in the same ``sendall`` as the head.
COALESCE = 64 * 1024
_RECV = 256 * 1024
#: The most a body reader hands on at a time (:meth:`Response.read_pieces`).
PIECE = 64 * 1024


#: The digits of a chunk size (hex).
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class ProtocolError(Exception):
    """The peer answered something that is not a usable HTTP/1.1 response."""


class ShortBody(ProtocolError):
    """The body ended before its announced length (e.g. a block evicted mid-stream)."""


class StaleConnection(ConnectionError):
    """A kept-alive connection turned out closed by the server before it answered."""


class Deadline:
    """One operation's time budget; each socket wait gets what is left of it."""

    __slots__ = ("end",)

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left. Raises TimeoutError once the budget is spent."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("eg-kv operation timed out")
        return left


class Response:
    """The head of one response, and its body to read (exactly once, in order)."""

    __slots__ = ("_conn", "_deadline", "_left", "chunked", "headers", "length", "status")

    def __init__(self, conn: Connection, status: int, headers: dict[bytes, bytes],
                 no_body: bool, deadline: Deadline) -> None:  # fmt: skip
        self._conn = conn
        self._deadline = deadline
        self.status = status
        self.headers = headers
        self.chunked = False
        cl = headers.get(b"content-length")
        if no_body:
            self.length: int | None = 0
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self.length = None
            self.chunked = True
        elif cl is not None:
            # ASCII digits alone (RFC 9112: 1*DIGIT): ``int`` took ``+6``, ``0_6`` and
            # `` 6``, framings a proxy may read otherwise (answers out of step); two
            # Content-Length headers that differ are refused when the head is read.
            length = whole_number(cl.decode("latin-1"))
            if length is None:
                raise ProtocolError(f"bad Content-Length {cl[:20]!r}")
            self.length = length
        else:
            self.length = None  # the body runs to the end of the connection
            conn.will_close = True
        # Bytes of a fixed-length body still unread (None: chunked or read-to-close).
        self._left = self.length

    @property
    def complete(self) -> bool:
        """True once the whole body has been read."""
        return self._left == 0

    def read_exact(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` body bytes (no copy past the socket).

        Raises:
            ShortBody: the body (or the connection) ended first.
            ProtocolError: the view is longer than what is left of the body.
        """
        n = len(view)
        if self._left is None:
            raise ProtocolError("read_exact needs a body with a Content-Length")
        if n > self._left:
            raise ProtocolError(f"asked for {n} bytes, {self._left} left in the body")
        self._conn.read_into(view, self._deadline)
        self._left -= n

    def read_all(self, limit: int) -> bytes:
        """The rest of the body, at most ``limit`` bytes.

        Raises:
            ProtocolError: the body is larger than ``limit`` or malformed.
            ShortBody: it ended early.
        """
        parts: list[bytes] = []
        self.read_pieces(limit, parts.append, piece=limit)  # a Content-Length: one piece
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_pieces(self, limit: int, feed: Callable[[bytes], object], piece: int = PIECE) -> None:
        """Hand the rest of the body to ``feed``, at most ``piece`` bytes at a time and
        ``limit`` in all: a stream's reader (the snapshot's) holds a piece, never the whole
        answer, and nothing is allocated for a length announced before it comes.

        Raises:
            ProtocolError: the body is larger than ``limit`` or malformed.
            ShortBody: it ended early.
        """
        piece = max(1, piece)
        if self._left is not None:
            if self._left > limit:
                raise ProtocolError(f"answer of {self._left} bytes is over {limit}")
            while self._left:
                buf = bytearray(min(piece, self._left))
                self.read_exact(memoryview(buf))
                feed(bytes(buf))
        elif self.chunked:
            self._read_chunked(limit, feed, piece)
        else:
            self._conn.read_to_close(limit, self._deadline, feed)
            self._left = 0

    def _read_chunked(self, limit: int, feed: Callable[[bytes], object], piece: int) -> None:
        conn, dl = self._conn, self._deadline
        total = 0  # body bytes so far
        framing = 0  # bytes of chunk-size lines (extensions included) and trailers
        while True:
            line = conn.read_line(dl)
            framing += len(line) + 2
            digits = line.split(b";", 1)[0].strip()
            if not digits or len(digits) > 15 or digits.strip(_HEX_DIGITS):  # 1*HEXDIG
                raise ProtocolError("bad chunk size")
            size = int(digits, 16)
            if size == 0:
                while line := conn.read_line(dl):  # trailers, then the empty line
                    framing += len(line) + 2
                    if framing > MAX_HEAD:
                        raise ProtocolError(f"chunked answer's trailers are over {MAX_HEAD}")
                self._left = 0
                return
            if total + size + framing > limit + MAX_HEAD:  # endless tiny chunks too
                raise ProtocolError(f"chunked answer is over {limit} bytes")
            total += size
            while size:
                buf = bytearray(min(piece, size))
                conn.read_into(memoryview(buf), dl)
                feed(bytes(buf))
                size -= len(buf)
            if conn.read_line(dl):
                raise ProtocolError("chunk not followed by CRLF")


class Connection:
    """One HTTP/1.1 connection (plain or TLS), used by one thread at a time."""

    def __init__(self, host: str, port: int, host_header: bytes,
                 ssl_context: ssl.SSLContext | None = None,
                 server_name: str | None = None) -> None:  # fmt: skip
        self.host = host
        self.server_name = server_name or host  # the name TLS checks (and SNI)
        self.port = port
        self.host_header = host_header
        self.ssl_context = ssl_context
        self.sock: socket.socket | None = None
        self.will_close = False
        self.used = False  # has answered at least one request (so may have gone stale)
        self.aborted = False  # ended from another thread (:meth:`abort`): never resent
        self._buf = bytearray()
        self._pos = 0
        self._scratch = bytearray(_RECV)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def abort(self) -> None:
        """From another thread: end the request in flight on this connection at once (its
        thread's wait for the server returns, and the request fails; the connection is
        not reused). The socket is shut down, not closed: its fd stays its thread's."""
        self.aborted = self.will_close = True  # not resent as a stale connection's
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def reusable(self, resp: Response) -> bool:
        """Can the next request go on this connection? Only after a clean, complete answer."""
        return (
            self.sock is not None
            and not self.will_close
            and resp.complete
            and self._pos == len(self._buf)  # nothing unexpected after the body
        )

    # ------------------------------------------------------------------ request

    def request(self, method: str, target: str, head: bytes, parts: list[memoryview],
                deadline: Deadline, *, may_resend: bool = True,
                expect_continue: bool = False) -> Response:  # fmt: skip
        """Send one request and read its final response head (interim 1xx are skipped).

        Args:
            method, target: the request line.
            head: the extra header lines, each ending in CRLF (Content-Length included
                when there is a body; ``Expect: 100-continue`` with ``expect_continue``).
            parts: the body, sent in order without a copy (small bodies are coalesced).
            deadline: bounds every socket wait.
            may_resend: the request changes nothing, so a reused connection found closed
                before any answer raises :class:`StaleConnection` (the caller resends).
                Otherwise that is a plain error: the request may have been applied.
            expect_continue: send the head alone and the body only after ``100
                Continue``. A final answer that comes first (a dedup hit, a refusal) is
                returned without sending the body, and the connection will close: whether
                the server still waits for the body is unknown.

        Raises:
            StaleConnection: a reused connection was closed by the server before
                answering (only with ``may_resend``).
            ProtocolError, TimeoutError, OSError: the exchange failed.
        """
        stale_ok = self.used and may_resend
        if self.sock is None:
            self._connect(deadline)
        if self.aborted:  # ended while it connected
            raise ConnectionAbortedError("the request was ended (its member was cut)")
        sock = self.sock
        assert sock is not None
        msg = bytearray(b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (
            method.encode(), target.encode(), self.host_header))  # fmt: skip
        msg += head
        msg += b"\r\n"
        big: list[memoryview] = []
        if expect_continue:
            big = parts
        elif sum(len(p) for p in parts) <= COALESCE:
            for p in parts:
                msg += p
        else:
            big = parts
        try:
            sock.settimeout(deadline.left())
            sock.sendall(msg)
            self.used = True
            if expect_continue:
                resp = self._read_head(False, deadline, stale_ok, interim_100=True)
                if resp.status != 100:
                    self.will_close = True  # the body was never sent: framing in doubt
                    return resp
            for p in big:
                sock.settimeout(deadline.left())
                sock.sendall(p)
        except (BrokenPipeError, ConnectionResetError) as e:
            if stale_ok and not self.aborted:
                raise StaleConnection(str(e)) from None
            raise
        return self._read_head(method == "HEAD", deadline, stale_ok)

    def dropped(self) -> bool:
        """True when an idle connection cannot carry another request.

        urllib3's check: a zero-timeout poll. An idle kept-alive connection has nothing
        to read, so readable means the server closed it (or sent bytes no request asked
        for); either way it is thrown away before a request goes out on it.
        """
        sock = self.sock
        if sock is None or self.will_close:
            return True
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def _connect(self, deadline: Deadline) -> None:
        sock = open_tcp(self.host, self.port, deadline.left)
        try:
            # Head and a large body go out in separate sends; with Nagle on, delayed ACKs
            # would hold the body back by up to 40 ms.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock.settimeout(deadline.left())
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_name)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.will_close = False
        self._buf.clear()
        self._pos = 0

    # ------------------------------------------------------------------ reading

    def _fill(self, deadline: Deadline) -> int:
        """Receive more bytes into the buffer; returns how many (0 at end of stream)."""
        sock = self.sock
        assert sock is not None
        if self._pos:  # what was parsed goes (a buffer kept whole grew with every read)
            del self._buf[: self._pos]
            self._pos = 0
        sock.settimeout(deadline.left())
        n = sock.recv_into(self._scratch)
        if n:
            self._buf += memoryview(self._scratch)[:n]
        return n

    def _read_head(self, is_head: bool, deadline: Deadline, stale_ok: bool,
                   interim_100: bool = False) -> Response:  # fmt: skip
        """Read response heads up to the final one (or ``100`` with ``interim_100``).

        Interim answers (``103 Early Hints``, an unasked ``100 Continue``) have no body
        and are skipped; taking one as final would leave the real answer to be read as
        the next request's (the previous key's bytes returned for the next key).
        """
        for _ in range(MAX_INTERIM + 1):
            status, headers, version = self._read_one_head(deadline, stale_ok)
            stale_ok = False  # something came back: the server has the request
            if status == 101 or not 100 <= status < 200:
                break
            if status == 100 and interim_100:
                return Response(self, 100, headers, True, deadline)
        else:
            raise ProtocolError(f"more than {MAX_INTERIM} interim (1xx) answers")
        if status == 101:
            raise ProtocolError("101 Switching Protocols: no upgrade was asked for")
        conn_hdr = headers.get(b"connection", b"").lower()
        if version == b"HTTP/1.0":
            self.will_close = b"keep-alive" not in conn_hdr
        else:
            self.will_close = b"close" in conn_hdr
        no_body = is_head or status in (204, 304)
        return Response(self, status, headers, no_body, deadline)

    def _read_one_head(self, deadline: Deadline,
                       stale_ok: bool) -> tuple[int, dict[bytes, bytes], bytes]:  # fmt: skip
        while True:
            end = self._buf.find(b"\r\n\r\n", self._pos)
            if end >= 0:
                break
            if len(self._buf) - self._pos > MAX_HEAD:
                raise ProtocolError("response head too large")
            try:
                n = self._fill(deadline)
            except ConnectionResetError as e:
                if stale_ok and not self.aborted and self._pos == len(self._buf):
                    raise StaleConnection(str(e)) from None
                raise
            if not n:
                self.will_close = True
                if stale_ok and not self.aborted and self._pos == len(self._buf):
                    raise StaleConnection("server closed the kept-alive connection")
                raise ProtocolError("connection closed before a complete response head")
        head = bytes(self._buf[self._pos : end])
        self._pos = end + 4
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:40]!r}")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ProtocolError("malformed header line")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length" and headers.get(name, value) != value:
                raise ProtocolError("two Content-Length headers that differ")
            headers[name] = value
        return int(parts[1]), headers, parts[0]

    def read_into(self, view: memoryview, deadline: Deadline) -> None:
        """Fill ``view``: buffered bytes first, then ``recv_into`` straight into it."""
        got, total = 0, len(view)
        avail = len(self._buf) - self._pos
        if avail:
            k = min(avail, total)
            view[:k] = self._buf[self._pos : self._pos + k]
            self._pos += k
            got = k
        sock = self.sock
        while got < total:
            assert sock is not None
            sock.settimeout(deadline.left())
            n = sock.recv_into(view[got:])
            if not n:
                self.will_close = True
                raise ShortBody(f"body cut short at {got} of {total} bytes")
            got += n

    # The body readers a Response uses (their connection's buffer and socket).

    def read_line(self, deadline: Deadline) -> bytes:
        """One CRLF-terminated line of a chunked body, without its CRLF."""
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return line
            if len(self._buf) - self._pos > MAX_HEAD:
                raise ProtocolError("line too long")
            if not self._fill(deadline):
                raise ShortBody("connection closed inside a chunked body")

    def read_to_close(
        self, limit: int, deadline: Deadline, feed: Callable[[bytes], object]
    ) -> None:
        """A body framed by the connection's close, handed to ``feed`` as it comes (a
        read's bytes at a time): at most ``limit`` bytes."""
        self.will_close = True
        total = 0
        while True:
            data = bytes(self._buf[self._pos :])
            self._pos = len(self._buf)
            total += len(data)
            if total > limit:
                raise ProtocolError(f"answer is over {limit} bytes")
            if data:
                feed(data)
            if not self._fill(deadline):
                return


def host_header(host: str, port: int, https: bool) -> bytes:
    """The ``Host`` header value: the port only when it is not the scheme's default."""
    name = f"[{host}]" if ":" in host else host
    default = 443 if https else 80
    return (name if port == default else f"{name}:{port}").encode("idna")
