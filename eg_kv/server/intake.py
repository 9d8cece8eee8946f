"""A large PUT's body, read by the socket straight into the block's reserved pages.

aiohttp hands a request body over as ``bytes``: the event loop copies each read out of
its buffer, the parser copies the body's part of it again, and the put copies that into
the slab, three passes over every byte before the checksum reads it once more. A 1 MiB
PUT spent about 150 µs of a worker's CPU on those copies. The fast lane
(:mod:`eg_kv.server.lane`) instead takes the body of a ``PUT`` over
:data:`~eg_kv.slab.store.SMALL_PUT` whose head it answered for: the connection's
transport reads into a :class:`BodyIntake` (an ``asyncio.BufferedProtocol``) until the
body's last byte (:meth:`eg_kv.server._compat.StampedHandler.take_body`), and each read
lands in the block's pages, hashed right after while it is in cache
(:meth:`eg_kv.slab.store.PutHandle.room`). A dedup hit's bytes land in a scratch buffer and
are dropped, as aiohttp's way drops them.

Reads never go past the body's end, so whatever the client sent after it stays in the
socket for the connection's parser. The sweeper times the body as it times any other
(:mod:`eg_kv.server.connections`); a body cut short, by the client or a limit, gives its
pages back.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable
from typing import Any

from ..checksum import HASH_PIECE
from ..slab.store import PutHandle
from ._compat import StampedHandler

#: Where a dedup hit's bytes are read and dropped (one per worker: the loop is one
#: thread). Anonymous memory: its pages take room only once a dedup hit's body used them.
_SCRATCH = memoryview(mmap.mmap(-1, HASH_PIECE))


class BodyIntake(asyncio.BufferedProtocol):
    """The rest of one PUT's body, read into ``handle``'s pages.

    Args:
        conn: the connection the body arrives on; it gets its transport back at the end
            and is told of everything else (writing paused, the connection lost).
        handle: the put the bytes go to (:meth:`~eg_kv.slab.store.Slab.begin_put`).
        ended: called once, with the transport given back to ``conn``: ``(None,
            False)`` when the body is in; ``(why, False)`` when it was cut short (a
            one-line reason: answer it, then close); ``(why, True)`` when the connection
            was lost (nobody to answer). It finishes or aborts ``handle``.
    """

    __slots__ = ("_view", "conn", "done", "ended", "handle")

    def __init__(
        self, conn: StampedHandler, handle: PutHandle,
        ended: Callable[[str | None, bool], None],
    ) -> None:  # fmt: skip
        self.conn, self.handle, self.ended = conn, handle, ended
        self.done = False
        self._view: memoryview = _SCRATCH

    @property
    def received(self) -> int:
        """Body bytes in so far."""
        return self.handle.pos

    def feed(self, data: Any) -> None:
        """Body bytes that arrived before the transport was handed over (never all of it)."""
        view = memoryview(data).cast("B")
        while view and not self.done:
            room = self.get_buffer(len(view))
            n = min(len(room), len(view))
            room[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]

    def get_buffer(self, sizehint: int) -> memoryview:
        handle = self.handle
        room = handle.room(HASH_PIECE)
        if room is None:  # a dedup hit: its bytes are dropped
            room = _SCRATCH[: min(len(_SCRATCH), handle.length - handle.pos)]
        self._view = room
        return room

    def buffer_updated(self, nbytes: int) -> None:
        self.conn.stamp_rx()
        handle = self.handle
        handle.wrote(self._view, nbytes)
        if handle.pos >= handle.length:
            self._end(None)

    def eof_received(self) -> bool:
        handle = self.handle
        self._end(f"body cut short: {handle.pos} of {handle.length} bytes arrived")
        return False  # the transport closes once the answer is written

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            self._end("the connection was lost", lost=True)
        finally:  # the connection's own bookkeeping, whatever the put's end raised
            self.conn.connection_lost(exc)

    def pause_writing(self) -> None:
        self.conn.pause_writing()

    def resume_writing(self) -> None:
        self.conn.resume_writing()

    def _end(self, why: str | None, lost: bool = False) -> None:
        if self.done:
            return
        self.done = True
        self._view = _SCRATCH
        try:
            # A body cut short ends its connection: no more reads to switch.
            self.conn.give_body_back(read_on=why is None)
        finally:  # the put is finished or aborted, whatever the switch raised
            self.ended(why, lost)
