"""The event log as the clients see it: answers of ``GET /kv/events`` and
``GET /kv/events/snapshot`` (:mod:`eg_kv.server.events`), and followers that keep up with
the log and resync from a snapshot when they fall behind.

Standard library only (the sync client imports it). What the log promises: every block
stored and every block removed (evicted, deleted to zero references, dropped by a repair,
evicted for its namespace's quota) is one event, in the order the slab lock saw them, with
sequence numbers that have no gap and no repeat, across worker crashes. The log is
bounded: a reader that fell behind it is told (``gap``) and starts again from a snapshot.

Use::

    for item in follow(client, wait=10):
        if isinstance(item, Snapshot):
            held = {b.hash for b in item.blocks}   # start again from what is held
        elif item.kind == "stored":
            held.add(item.hash)
        else:
            held.discard(item.hash)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol
from urllib.parse import urlencode

from ..errors import RemoteError
from ..wire import EVENTS_PATH

#: Entries one ``events()`` asks for by default (the server's own default).
DEFAULT_LIMIT = 1000
#: The most bytes a snapshot's answer may take (a slab of a million blocks is ~70 MiB),
#: and one of its lines (a block's is under 400 bytes).
SNAPSHOT_ANSWER_MAX = 512 * 1024 * 1024
_SNAPSHOT_LINE_MAX = 4096
#: The most blocks a snapshot may list (a 1 TiB slab of 64 KiB pages holds 16 M): each
#: held costs ~300 bytes here, so a server streaming short distinct lines cannot make a
#: follower hold ~10 bytes for each byte it sent, up to 5 GiB at the answer's cap.
SNAPSHOT_BLOCKS_MAX = 4 * 1024 * 1024
#: A follower's pace (:class:`Pacer`): the least time between two of its requests (at most
#: 20 a second against a server that answers at once), the backoff after an error or a
#: gap (doubling, with jitter, from the first to the second), and the least time between
#: two of its snapshots (a server that keeps saying "gap" gets one every 5 s at most).
MIN_INTERVAL_S = 0.05
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
SNAPSHOT_INTERVAL_S = 5.0


class Pacer:
    """When a follower may send its next request: the pacing rests on the follower, not on
    the server (a lying or broken server got 18,385 requests in 5 s from one follower, and
    200 snapshots from one that always answered ``gap``: issue 31).

    :meth:`turn` says how long to wait before the next request and books it; after an
    error or a gap call :meth:`trouble` (the next turn waits a backoff), after a good
    answer :meth:`answered`. One pacer per follower, kept across its reconnections.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._clock, self._jitter = clock, jitter
        self._next = self._next_snapshot = 0.0
        self._backoff = 0.0

    def turn(self, snapshot: bool = False) -> float:
        """Seconds to wait before the request (a snapshot if ``snapshot``); the caller
        waits them, then sends."""
        now = self._clock()
        at = max(now, self._next, self._next_snapshot if snapshot else 0.0)
        self._next = at + MIN_INTERVAL_S
        if snapshot:
            self._next_snapshot = at + SNAPSHOT_INTERVAL_S
        return at - now

    def trouble(self) -> None:
        """An error or a gap: back off (doubling, at most BACKOFF_MAX_S, with jitter)."""
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._backoff))
        wait = self._backoff * (0.5 + self._jitter() / 2)
        self._next = max(self._next, self._clock() + wait)

    def answered(self) -> None:
        """A good answer: the backoff starts again from its least."""
        self._backoff = 0.0


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of the log."""

    seq: int
    kind: str  #: "stored" or "removed"
    reason: str  #: "put", "evict", "delete", "repair" or "quota"
    hash: str  #: the block's address
    length: int  #: its bytes
    namespace: str | None = None  #: its namespace's name (an admin's view of every one)


@dataclasses.dataclass(frozen=True)
class EventBatch:
    """One answer of ``GET /kv/events``: ask again with ``since=next``; ``gap``: resync."""

    events: list[Event]
    next: int
    gap: bool
    epoch: str


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a snapshot."""

    hash: str
    length: int
    namespace: str | None = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The blocks held when the log's newest seq was ``seq``: follow it from there."""

    epoch: str
    seq: int
    blocks: list[Block]


def events_target(since: int, wait: float, limit: int, epoch: str | None) -> str:
    """The request target (path and query) of ``GET /kv/events``."""
    query: dict[str, Any] = {"since": since, "limit": limit}
    if wait > 0:
        query["wait"] = f"{wait:g}"
    if epoch:
        query["epoch"] = epoch
    return f"{EVENTS_PATH}?{urlencode(query)}"


def _bad(what: str) -> RemoteError:
    return RemoteError(f"the server's {what} answer is not what eg-kv sends")


def parse_events(doc: Any) -> EventBatch:
    """An :class:`EventBatch` from the decoded JSON answer.

    Raises:
        RemoteError: it is not an answer of ``GET /kv/events``.
    """
    try:
        events = [
            Event(
                int(e["seq"]),
                str(e["kind"]),
                str(e["reason"]),
                str(e["hash"]),
                int(e["length"]),
                e.get("namespace"),
            )
            for e in doc["events"]
        ]
        return EventBatch(events, int(doc["next"]), bool(doc["gap"]), str(doc["epoch"]))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError):
        raise _bad("events") from None


def after(batch: EventBatch, since: int) -> bool:
    """Whether ``batch`` answers a read after ``since``: every event past it and past the
    one before, and ``next`` at or past both. An answer that is not (a stale one a caching
    proxy kept, a replay) would take a follower back: it resyncs instead, as after a gap."""
    last = since
    for ev in batch.events:
        if ev.seq <= last:
            return False
        last = ev.seq
    return batch.next >= last


class SnapshotReader:
    """Builds a :class:`Snapshot` from ``GET /kv/events/snapshot``'s NDJSON stream
    (:mod:`eg_kv.server.events`), a line at a time as the bytes come: what it holds is the
    set of blocks and one unfinished line, never the whole answer.

    Feed it the body's bytes in any pieces (:meth:`feed`), then take :meth:`result`.
    """

    def __init__(self) -> None:
        self._tail = b""
        self._epoch: str | None = None
        self._seq: int | None = None
        self._held: dict[tuple[str | None, str], Block] = {}

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the answer.

        Raises:
            RemoteError: a line that is not what eg-kv sends, a line after the end, or
                the server's ``error`` line (the walk must be taken again).
        """
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > _SNAPSHOT_LINE_MAX:
            raise _bad("snapshot")
        for line in lines:  # every line, not only the unfinished one (a piece may hold
            if len(line) > _SNAPSHOT_LINE_MAX:  # several, parse_snapshot's the whole answer)
                raise _bad("snapshot")
            self._line(line)

    def result(self) -> Snapshot:
        """The snapshot, once the whole answer was fed.

        Raises:
            RemoteError: the answer was cut before its end line.
        """
        if self._tail:
            self._line(self._tail)
            self._tail = b""
        if self._epoch is None or self._seq is None:
            raise RemoteError("the server's snapshot answer was cut short")
        return Snapshot(self._epoch, self._seq, list(self._held.values()))

    def _line(self, line: bytes) -> None:
        try:
            doc = json.loads(line)
            if self._seq is not None or not isinstance(doc, dict):
                raise ValueError
            if self._epoch is None:
                self._epoch = str(doc["epoch"])
            elif "error" in doc:
                raise RemoteError(f"the server's snapshot failed: {str(doc['error'])[:200]}")
            elif "hash" not in doc:
                self._seq = int(doc["seq"])
            else:
                block = Block(str(doc["hash"]), int(doc["length"]), doc.get("namespace"))
                key = (block.namespace, block.hash)
                if doc.get("kind", "stored") == "stored":
                    self._held[key] = block
                    if len(self._held) > SNAPSHOT_BLOCKS_MAX:  # as it grows, not per piece
                        raise RemoteError(f"the server's snapshot lists over "
                                          f"{SNAPSHOT_BLOCKS_MAX} blocks: not taken")  # fmt: skip
                elif doc["kind"] == "removed":
                    self._held.pop(key, None)
                else:
                    raise ValueError
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError):
            raise _bad("snapshot") from None


def parse_snapshot(body: bytes) -> Snapshot:
    """A :class:`Snapshot` from the whole NDJSON answer (:class:`SnapshotReader`).

    Raises:
        RemoteError: it is not an answer of ``GET /kv/events/snapshot``, or it was cut.
    """
    reader = SnapshotReader()
    reader.feed(body)
    return reader.result()


class EventSource(Protocol):
    """What :func:`follow` needs: the sync clients' two calls."""

    def events(
        self,
        since: int = 0,
        wait: float = 0.0,
        limit: int = DEFAULT_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch: ...

    def snapshot(self) -> Snapshot: ...


class AsyncEventSource(Protocol):
    """What :func:`follow_async` needs: the async client's two calls."""

    def events(
        self,
        since: int = 0,
        wait: float = 0.0,
        limit: int = DEFAULT_LIMIT,
        epoch: str | None = None,
    ) -> Awaitable[EventBatch]: ...

    def snapshot(self) -> Awaitable[Snapshot]: ...


def follow(
    source: EventSource,
    wait: float = 10.0,
    since: int | None = None,
    epoch: str | None = None,
    pacer: Pacer | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> Iterator[Snapshot | Event]:
    """Follow the log for ever: a :class:`Snapshot` first (and after every gap), then each
    :class:`Event` after it, in order. Errors (an unreachable server) propagate: call
    again with the last ``seq`` and ``epoch`` seen to resume without a snapshot (and the
    same ``pacer``, told of the error with :meth:`Pacer.trouble`).

    Args:
        wait: seconds each request waits for new events (the server clamps it to 30).
        since, epoch: resume after this seq of this log (both from an earlier follow);
            None: start from a snapshot.
        pacer: paces the requests (:class:`Pacer`; a new one if None).
        sleep: how it waits its turn (a ``threading.Event.wait`` makes it stoppable).
    """
    pacer = pacer or Pacer()
    if since is None or epoch is None:
        sleep(pacer.turn(snapshot=True))
        snap = source.snapshot()
        since, epoch = snap.seq, snap.epoch
        yield snap
    while True:
        sleep(pacer.turn())
        batch = source.events(since, wait, DEFAULT_LIMIT, epoch)
        if batch.gap or not after(batch, since):
            pacer.trouble()
            sleep(pacer.turn(snapshot=True))
            snap = source.snapshot()
            since, epoch = snap.seq, snap.epoch
            yield snap
            continue
        pacer.answered()
        yield from batch.events
        since = batch.next


async def follow_async(
    source: AsyncEventSource,
    wait: float = 10.0,
    since: int | None = None,
    epoch: str | None = None,
    pacer: Pacer | None = None,
) -> AsyncIterator[Snapshot | Event]:
    """:func:`follow` for the async client (``async for``)."""
    pacer = pacer or Pacer()
    if since is None or epoch is None:
        await asyncio.sleep(pacer.turn(snapshot=True))
        snap = await source.snapshot()
        since, epoch = snap.seq, snap.epoch
        yield snap
    while True:
        await asyncio.sleep(pacer.turn())
        batch = await source.events(since, wait, DEFAULT_LIMIT, epoch)
        if batch.gap or not after(batch, since):
            pacer.trouble()
            await asyncio.sleep(pacer.turn(snapshot=True))
            snap = await source.snapshot()
            since, epoch = snap.seq, snap.epoch
            yield snap
            continue
        pacer.answered()
        for ev in batch.events:
            yield ev
        since = batch.next
