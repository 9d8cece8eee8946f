"""A worker's connections: time limits on reading and sending, a cap, and shedding.

aiohttp bounds none of this itself: its only timer is an hour of keep-alive, so a client
that drips a request head, stalls a body or never reads its answers holds a connection
(and the pages of its upload) for as long as it likes, and 2,000 such clients exhaust a
worker's file descriptors. This module adds, for under a microsecond of a worker's CPU
per request (docs/design.md, "Serving"):

- each connection (:class:`Connection`, aiohttp's handler subclassed) stamps when bytes
  last arrived and when the first bytes of a head arrived (one clock read per read from
  the socket), and when its writes paused; aiohttp itself stamps when a connection went
  idle (its keep-alive deadline) and counts the requests it parsed;
- one sweeper task per worker (:meth:`Connections.run_sweeper`, every
  :func:`sweep_interval`) looks at every open connection and closes those past a limit:

  ===============  ====================================================  =================
  phase            how the sweeper tells                                 limit, counted
  ===============  ====================================================  =================
  reading a head   waiting for a request, and bytes arrived since the    ``header_timeout``
                   last request was parsed                               from its 1st byte
  reading a body   a handler runs, its body has not all arrived, the     ``body_timeout``
                   server is not the one that paused reading             since the last byte
  body too slow    a handler runs and its body averages under            ``min_upload_rate``
                   ``min_upload_rate`` bytes a second, beyond a head     after
                   start of ``body_timeout`` (Apache's ``MinRate``)      ``body_timeout``
  sending          the transport paused writing (the client does not     ``body_timeout``
                   read what it asked for), or is closing with answers   since it last
                   still unsent (a close waits for them to flush)        moved a byte
  idle             waiting for a request, nothing arrived                ``keepalive_timeout``
  ===============  ====================================================  =================

- a cap on open connections per worker (:class:`Limits` ``max_connections``, kept below
  the file-descriptor limit): a connection beyond it closes the oldest idle ones (no
  handler running: keep-alive idle or still dripping a head); if every other one is busy
  the newcomer gets a 503 and is closed.

Back-pressure on answers is :func:`eg_kv.server.app._endpoint`'s: a request is not handled while
the answers before it still fill the transport's buffer.

What this needs of aiohttp's private state is in :mod:`eg_kv.server._compat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import resource
from typing import Any

from ._compat import MAX_HEAD_BYTES, StampedHandler
from .replies import worker_pid

log = logging.getLogger("eg_kv.server.connections")

#: File descriptors a worker keeps for itself beyond its connections (listener, slab,
#: pipes, metrics files, event loop).
FD_RESERVE = 64
#: Default cap on connections per worker when the fd limit allows more: an inference
#: fleet of hundreds of instances holds a few connections each; this leaves room for
#: bursts while bounding the memory idle connections hold: 10 KiB each (2,000 holding a
#: partial head grew a worker's USS by 20 MB), so at most ~100 MB per worker.
DEFAULT_MAX_CONNECTIONS = 10_000
#: At most one log line about closed connections per this many seconds.
LOG_EVERY_S = 10.0
#: aiohttp's own keep-alive timer stays armed as a backstop this far past ours.
KEEPALIVE_BACKSTOP_S = 5.0

#: Seconds a 503 asks the client to wait before retrying (``Retry-After``): the causes
#: (uploads in flight, a worker whose connections are all busy) clear within about that.
RETRY_AFTER_S = 1

#: Why a connection was closed, as the metrics label it.
SHED, HEAD, BODY, SEND, IDLE = "shed", "header", "body", "send", "keepalive"
#: ...and a body that arrived slower than the minimum upload rate.
RATE = "rate"

_HEAD_TIMEOUT_REPLY = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Server: eg-kv\r\nX-EgKv-Worker: %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_HEAD_SIZE_REPLY = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain; "
    b"charset=utf-8\r\nServer: eg-kv\r\nX-EgKv-Worker: %s\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)
_FULL_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Server: eg-kv\r\nX-EgKv-Worker: %%s\r\nRetry-After: %d\r\nConnection: close\r\n"
    b"Content-Length: %%d\r\n\r\n%%s"
) % RETRY_AFTER_S


def _one_line_reply(template: bytes, text: str) -> bytes:
    body = text.encode() + b"\n"
    return template % (worker_pid().encode(), len(body), body)


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (call at worker start).

    Returns:
        The soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):  # e.g. macOS caps it lower
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fd_connection_ceiling(nofile: int) -> int:
    """The most connections a worker with ``nofile`` descriptors can hold safely.

    Two descriptors per connection: a chunked upload spools into a memory file.
    """
    return max(8, (nofile - FD_RESERVE) // 2)


def resolve_max_connections(requested: int) -> int:
    """The per-worker connection cap: ``requested``, or derived from the fd limit if 0.

    A request above what the fd limit allows is lowered to it, with a warning.
    """
    ceiling = fd_connection_ceiling(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    if requested <= 0:
        return min(DEFAULT_MAX_CONNECTIONS, ceiling)
    if requested > ceiling:
        log.warning("--max-connections %d is over what the fd limit allows; using %d "
                    "(raise the hard RLIMIT_NOFILE, e.g. LimitNOFILE= or ulimit -Hn)",
                    requested, ceiling)  # fmt: skip
        return ceiling
    return requested


@dataclasses.dataclass(frozen=True)
class Limits:
    """One worker's connection limits (seconds, and a count)."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int
    #: Bytes a second a body must average once ``body_timeout`` has passed; 0: no minimum.
    min_upload_rate: int = 0

    @property
    def aiohttp_keepalive(self) -> float:
        """aiohttp's own keep-alive timer, a backstop that never fires before ours."""
        return self.keepalive_timeout + self.header_timeout + KEEPALIVE_BACKSTOP_S


def sweep_interval(limits: Limits) -> float:
    """How often the sweeper looks: a quarter of the shortest limit, within 0.05-0.5 s.

    A limit is therefore enforced up to one interval late, never early.
    """
    shortest = min(limits.header_timeout, limits.body_timeout, limits.keepalive_timeout)
    return min(0.5, max(0.05, shortest / 4))


class Connection(StampedHandler):
    """A connection that registers with its worker's :class:`Connections`."""

    __slots__ = ("registry", "tx")

    def __init__(self, manager, *, registry: Connections, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.registry = registry
        #: The transport, kept until the connection is lost: aiohttp's ``force_close()``
        #: drops the handler's own reference while a close may still wait to flush.
        self.tx: Any = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.tx = transport
        self.registry.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.registry.closed(self)
        self.tx = None
        super().connection_lost(exc)


class Connections:
    """The open connections of one worker, oldest first, with their counters.

    Args:
        limits: the time limits and the cap.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._open: dict[Connection, None] = {}  # insertion order: oldest first
        #: Connections closed by a limit, by reason (SHED, HEAD, BODY, RATE, SEND, IDLE).
        self.closed_by: dict[str, int] = dict.fromkeys((SHED, HEAD, BODY, RATE, SEND, IDLE), 0)
        self._logged: dict[str, int] = {}  # closed_by as of the last log line
        self._logged_at = -math.inf

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, c: Connection) -> None:
        """Register a new connection; beyond the cap, shed the oldest idle ones."""
        self._open[c] = None
        if len(self._open) > self.limits.max_connections:
            self._shed(c)

    def closed(self, c: Connection) -> None:
        self._open.pop(c, None)

    def _shed(self, newcomer: Connection) -> None:
        excess = len(self._open) - self.limits.max_connections
        victims = []
        for c in self._open:  # oldest first
            if c is not newcomer and c.waiting():
                victims.append(c)
                if len(victims) == excess:
                    break
        for c in victims:
            self._close(c, SHED)
        if len(self._open) > self.limits.max_connections:  # every other one is busy
            self._close(newcomer, SHED, _one_line_reply(
                _FULL_REPLY, f"this worker holds {self.limits.max_connections} busy "
                "connections (--max-connections); retry"))  # fmt: skip

    def _close(self, c: Connection, why: str, last_words: bytes = b"", cut: bool = False) -> None:
        """Close ``c``, counted under ``why``: ``last_words`` first (an answer of its own),
        or, with ``cut``, at once (a handler's answer in flight must not be waited for)."""
        self._open.pop(c, None)
        self.closed_by[why] += 1
        transport = c.tx
        if transport is not None:
            unsent = transport.get_write_buffer_size()
            if last_words and not cut and not unsent and not transport.is_closing():
                transport.write(last_words)
            # An answer that did not flush at once never will (the client does not read),
            # and once out of the registry nothing would time the close: cut it.
            if cut or transport.get_write_buffer_size():
                transport.abort()
        c.force_close()

    def sweep(self, now: float) -> None:
        """Close every connection past one of its time limits."""
        lim = self.limits
        for c in list(self._open):
            # A head that grows too large or too slow, whether the connection waits for
            # it or has requests before it still in hand (a head behind a long poll). One
            # in hand would take the answer for its own, and an answer being sent has no
            # room for one: such a connection is cut without it.
            late = now - c.head_at > lim.header_timeout
            # (Not while the server holds reading: complete heads may wait unparsed then.)
            if c.head_over or (c.head_arriving() and late and not c.reading_held()):
                if not c.waiting():
                    self._close(c, HEAD, cut=True)
                elif c.head_over:
                    text = f"request head over {MAX_HEAD_BYTES // 1024} KiB"
                    self._close(c, HEAD, _one_line_reply(_HEAD_SIZE_REPLY, text))
                else:
                    text = f"request head not complete within {lim.header_timeout:g} s"
                    self._close(c, HEAD, _one_line_reply(_HEAD_TIMEOUT_REPLY, text))
                continue
            transport = c.tx
            if c.writing_paused or (transport is not None and transport.is_closing()):
                # An answer being sent: paused writing (whether a handler still runs or
                # the connection waits for its next request), or a close waiting for the
                # buffer to flush (aiohttp's after ``Connection: close`` or a parse
                # error, or ``force_close()``). Cut only an answer that moved no byte for
                # body_timeout: a slow reader drains the buffer while it stays paused
                # (aiohttp's high watermark is 0 between batches), and that is progress.
                size = transport.get_write_buffer_size() if transport is not None else 0
                if size < c.wpaused_size or not c.wpaused_size:
                    c.wpaused_at = now  # progress, or first seen (a close never paused)
                c.wpaused_size = size
                if now - c.wpaused_at > lim.body_timeout:
                    self._close(c, SEND)
                continue
            c.wpaused_size = 0  # the next close is timed from when it is first seen
            if not c.waiting():  # a request is queued or handled
                stalled = c.body_stalled_since(now)
                if stalled is not None and now - stalled > lim.body_timeout:
                    self._close(c, BODY)
                elif lim.min_upload_rate and c.body_behind(
                    now, lim.body_timeout, lim.min_upload_rate
                ):
                    # A body that drips a byte just inside body_timeout would hold its
                    # reserved pages (and a share of the uploads' room) for good.
                    self._close(c, RATE)
                continue
            if not c.head_arriving() and now - c.idle_since() > lim.keepalive_timeout:
                self._close(c, IDLE)

    def log_closed(self, now: float) -> None:
        """One line about connections shed or timed out, at most every LOG_EVERY_S."""
        if now - self._logged_at < LOG_EVERY_S:
            return
        new = {k: n - self._logged.get(k, 0) for k, n in self.closed_by.items() if k != IDLE}
        if not any(new.values()):
            return
        since = f" in the last {now - self._logged_at:.0f} s" if self._logged else ""
        self._logged, self._logged_at = dict(self.closed_by), now
        log.warning(
            "closed connections%s: %d shed (the oldest idle, at --max-connections %d), "
            "%d heads not complete within %g s, %d bodies and %d answers stalled for %g s, "
            "%d bodies under --min-upload-rate %d bytes/s; %d open", since, new[SHED],
            self.limits.max_connections, new[HEAD], self.limits.header_timeout, new[BODY],
            new[SEND], self.limits.body_timeout, new[RATE], self.limits.min_upload_rate,
            len(self._open),
        )  # fmt: skip

    async def run_sweeper(self) -> None:
        """Sweep and log forever (a task per worker; cancel it to stop)."""
        loop = asyncio.get_running_loop()
        interval = sweep_interval(self.limits)
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            try:
                self.sweep(now)
                self.log_closed(now)
            except Exception:  # a bug here must not stop the limits for good
                log.exception("connection sweep failed")
