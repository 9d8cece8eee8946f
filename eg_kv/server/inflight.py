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
    With tenants (``--tokens``), one namespace's uploads may hold at most half of it, so
    a tenant that stalls its uploads leaves the other half to the rest (uploads in the
    slab are bounded per tenant by its quota, see ``Slab._room``).

    Args:
        limit: the spool's bytes (``--chunked-spool``).
        shared: tenants share it (each namespace held to half).
    """

    def __init__(self, limit: int, shared: bool = False):
        self.limit, self.held = limit, 0
        self.ns_limit = limit // 2 if shared else limit
        self._by_ns: dict[int, int] = {}  # namespace -> bytes; at most one per namespace

    def take(self, n: int, own: int, ns: int = 0) -> None:
        """Count ``n`` more bytes of an upload to namespace ``ns`` that holds ``own`` bytes
        already.

        One upload alone may always grow to the maximum block size; beyond the limit
        (or its namespace's half, with tenants) while others hold spool, it is refused.

        Raises:
            Busy: the worker's spool, or the namespace's share of it, is full.
        """
        if self.held + n > self.limit and self.held > own:
            raise Busy(
                f"chunked uploads on this worker hold {self.held} of {self.limit} spool bytes "
                "(--chunked-spool); retry shortly, or send a Content-Length"
            )
        mine = self._by_ns.get(ns, 0)
        if mine + n > self.ns_limit and mine > own:
            raise Busy(
                f"this tenant's chunked uploads on this worker hold {mine} of the "
                f"{self.ns_limit} spool bytes one tenant may (half the --chunked-spool); "
                "retry shortly, or send a Content-Length"
            )
        self.held += n
        self._by_ns[ns] = mine + n

    def give_back(self, n: int, ns: int = 0) -> None:
        self.held -= n
        left = self._by_ns.pop(ns, 0) - n
        if left:
            self._by_ns[ns] = left
