"""What one worker holds in flight: requests (so it can drain) and spooled chunked bytes.

:class:`Drain` counts the requests being answered, so a stopping worker waits for them;
:class:`SpoolBudget` bounds the chunked bodies it holds outside the slab. One of each per
worker, kept under the app's keys (:mod:`eg_kv.server.keys`).
"""

from __future__ import annotations

import asyncio

from ..errors import Busy


class Drain:
    """Counts requests in flight so a worker can stop gracefully.

    aiohttp's own graceful shutdown marks every connection closing, and a closing
    connection ignores the bytes that still arrive, so an upload in flight could never
    finish. The worker instead closes its listener, sets :attr:`draining` (answers then
    say ``Connection: close``) and waits for :meth:`wait_idle` before aiohttp's shutdown.
    """

    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        self.draining = True
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class SpoolBudget:
    """Bytes of chunked bodies this worker holds spooled (``--chunked-spool`` bounds them).

    A chunked body's length is known only at its end, so it waits in a memory file
    outside the slab; without a bound, stalled chunked uploads pinned 720 MiB of them.
    """

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, n: int, own: int) -> None:
        """Count ``n`` more bytes of an upload that holds ``own`` bytes already.

        One upload alone may always grow to the maximum block size; beyond the limit
        while others hold spool, it is refused.

        Raises:
            Busy: the worker's spool is full.
        """
        if self.held + n > self.limit and self.held > own:
            raise Busy(
                f"chunked uploads on this worker hold {self.held} of {self.limit} spool bytes "
                "(--chunked-spool); retry shortly, or send a Content-Length"
            )
        self.held += n

    def give_back(self, n: int) -> None:
        self.held -= n
