"""The sync client's side of HTTP/1.1: its transport (kept-alive pooled connections, the
request heads encoded once, the one resend a request that changes nothing may get) and the
readers of answers within their bounds. Used by
:class:`~eg_kv.client.sync.ServerConnector`, as :mod:`eg_kv.client.aio_http` is by the async
client; no rule of the contract lives here (they are in :mod:`eg_kv.client.rules` and
:mod:`eg_kv.client.core`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import RemoteError
from ..wire import (
    ADDRESS_HEADER,
    ADDRESSES_TYPE,
    BLOCK_TYPE,
    CHECKSUM_HEADER,
    JSON_TYPE,
    LEASE_HEADER,
    LEASE_REFUSED_HEADER,
    RELEASE_HEADER,
)
from .core import ClientCore
from .events import SNAPSHOT_ANSWER_MAX, Snapshot, SnapshotReader
from .http11 import Deadline, Response, StaleConnection
from .interface import Sink
from .pool import Pool
from .rules import (
    SMALL_ANSWER_MAX,
    DeadlineSpent,
    Miss,
    block_to_read,
    check_echo,
    check_final,
    compact_answer,
    exists_answer,
    json_answer,
    may_resend,
    own_deadline,
    status_answer,
    wants_continue,
)
from .settings import KvCacheConfig

T = TypeVar("T")

#: Header lines some requests add, encoded once.
PUT_HEAD = b"Content-Type: %s\r\n" % BLOCK_TYPE.encode()
JSON_HEAD = b"Content-Type: %s\r\n" % JSON_TYPE.encode()
COMPACT_HEAD = b"Content-Type: %s\r\n" % ADDRESSES_TYPE.encode()
RELEASE_HEAD = b"%s: 1\r\n" % RELEASE_HEADER.encode()
_REFUSED = LEASE_REFUSED_HEADER.lower().encode()
_CHECKSUM = CHECKSUM_HEADER.lower().encode()
_ADDRESS = ADDRESS_HEADER.lower().encode()


def lease_line(lease_ms: int | None) -> bytes:
    """A leasing lookup's header line (none for no lease)."""
    return b"%s: %d\r\n" % (LEASE_HEADER.encode(), lease_ms) if lease_ms and lease_ms > 0 else b""


class Transport:
    """One server's connections and the exchange of one request on them. Thread-safe."""

    def __init__(self, config: KvCacheConfig, headers: dict[str, str]) -> None:
        """Args:
        config: the connector's settings (server, timeout, connections).
        headers: the fields every request carries (the token among them).
        """
        self.timeout_s = config.timeout_s
        self.pool = Pool(config)
        self.closed = False
        self.head = b"".join(
            b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
        )

    def close(self) -> None:
        """Close every idle connection; later exchanges raise. Idempotent."""
        self.closed = True
        self.pool.close()

    def abort_in_flight(self) -> int:
        """End the requests in flight now (:meth:`Pool.abort_busy`); returns how many."""
        return self.pool.abort_busy()

    def exchange(
        self,
        method: str,
        target: str,
        on_response: Callable[[Response], T],
        body: Sequence[Any] = (),
        headers: bytes = b"",
        timeout_s: float | None = None,
    ) -> T:
        """Send one request and hand the final response to ``on_response``.

        ``on_response`` must read the body fully (the connection is then kept) or raise
        (the connection is closed: its framing is in doubt). A kept-alive connection the
        server closed fails before any answer; a request that changes nothing
        (:func:`~eg_kv.client.rules.may_resend`) is then sent once more on a fresh one.
        ``timeout_s``: this exchange's deadline, when shorter than the config's.

        Raises:
            RemoteError (closed), any transport error, TimeoutError, PoolWaitTimeout (no
            pooled connection freed up), ProtocolError, or what ``on_response`` raises.
        """
        if self.closed:
            raise RemoteError("the connector is closed")
        deadline = Deadline(timeout_s or self.timeout_s)
        parts = [memoryview(b).cast("B") for b in body]
        head = self.head + headers
        expect = False
        if method in ("PUT", "POST"):
            size = sum(len(p) for p in parts)
            head += b"Content-Length: %d\r\n" % size
            if wants_continue(method, size):
                expect = True
                head += b"Expect: 100-continue\r\n"
        resend = may_resend(method, target, headers)
        for attempt in (0, 1):
            conn = self.pool.acquire(deadline)
            keep = False
            try:
                resp = conn.request(
                    method, target, head, parts, deadline, may_resend=resend, expect_continue=expect
                )
                result = on_response(resp)
                keep = conn.reusable(resp)
                return result
            except StaleConnection:
                # The server closed this idle connection; a fresh one gets a real answer.
                if attempt == 0:
                    continue
                raise
            except TimeoutError as exc:
                if own_deadline(timeout_s, self.timeout_s):
                    raise DeadlineSpent(str(exc)) from exc
                raise
            finally:
                self.pool.release(conn, keep)
        raise RemoteError("unreachable")  # pragma: no cover


def drained(resp: Response) -> int:
    """Read a small body to its end (so the connection can be kept); its status."""
    resp.read_all(SMALL_ANSWER_MAX)
    return resp.status


def block_status(method: str, address: str, resp: Response) -> int:
    """The status of ``method`` on ``address`` (:func:`~eg_kv.client.rules.status_answer`)."""
    check_final(resp.status)
    return status_answer(method, address, drained(resp), resp.headers.get(_ADDRESS))


def exists_body(address: str, resp: Response) -> bool:
    """The answer to ``GET /kv/<addr>/exists`` (:func:`~eg_kv.client.rules.exists_answer`),
    checked before the connection is kept."""
    return exists_answer(address, json_body(resp))


def small_body(resp: Response) -> tuple[int, bytes]:
    return resp.status, resp.read_all(SMALL_ANSWER_MAX)


def json_body(resp: Response) -> Any:
    check_final(resp.status)
    return json_answer(resp.status, resp.read_all(SMALL_ANSWER_MAX))


def flag_body(n: int, resp: Response) -> list[bool]:
    """The answer to a compact batch of ``n`` addresses."""
    check_final(resp.status)
    body = resp.read_all(SMALL_ANSWER_MAX)
    return compact_answer(resp.status, resp.headers.get(b"content-type"), body, n)


def with_refusal(parse: Callable[[Response], T], resp: Response) -> tuple[T, bool]:
    """``parse``'s answer, and whether the server answered a leasing lookup's hits
    unleased (a lease cap: :data:`~eg_kv.wire.LEASE_REFUSED_HEADER`)."""
    return parse(resp), resp.headers.get(_REFUSED) is not None


def snapshot_body(resp: Response) -> Snapshot:
    """The snapshot, parsed a piece at a time as the body comes (never held whole: an 8 MiB
    answer of short lines, read whole and split at once, took 166 MiB)."""
    check_final(resp.status)
    if resp.status != 200:
        raise Miss(f"HTTP {resp.status}")
    reader = SnapshotReader()
    resp.read_pieces(SNAPSHOT_ANSWER_MAX, reader.feed)
    return reader.result()


def block_body(core: ClientCore, address: str, sink: Sink[T], resp: Response) -> T | None:
    """A block answer handed to ``sink`` (already keyed), its checksum checked; None for an
    answer that is not a block to read (read to its end first).

    Raises:
        OutOfStep: the answer is another address's (nothing handed to ``sink``).
        Miss: the sink left part of the body unread. What :meth:`ClientCore.checked` raises.
    """
    raw = resp.headers.get(b"content-encoding")
    encoding = None if raw is None else raw.decode("latin-1")
    if not block_to_read(resp.status, resp.length, encoding, core.config.max_block_size):
        resp.read_all(SMALL_ANSWER_MAX)
        return None
    check_echo(address, resp.headers.get(_ADDRESS))

    def read_exact(view: memoryview) -> None:
        resp.read_exact(memoryview(view).cast("B"))

    result = core.checked(resp.headers.get(_CHECKSUM), sink, resp.length or 0, read_exact)
    if not resp.complete:
        raise Miss("sink left part of the body unread")
    return result
