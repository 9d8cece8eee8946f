"""Per-worker caps on requests whose cost grows with the data: event reads, snapshots and
long-poll waiters.

One worker runs one event loop. A request that walks the event log or the slot table
holds that loop (or, on a thread, the GIL) for as long as the data is large, so a burst
of them from one tenant starved every other request of the worker, its heartbeat
included, until the supervisor's watchdog killed it (issue 31). A :class:`Gate` admits
at most ``per_worker`` such requests at once, and at most ``per_namespace`` of one
namespace (a tenant's, or the admin view's): the next one gets ``503`` with
``Retry-After`` at once, and costs nothing. So one tenant cannot take the slots another
tenant's requests need, and the loop's share any tenant can take is bounded.

:func:`client_gone` tells a handler that works in steps that its client left, so it
stops instead of working for nobody (aiohttp runs without handler cancellation here).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from ..errors import Busy

#: The key of the admin view (every namespace's) in a gate's per-namespace counts.
EVERY_NAMESPACE = -1


class Gate:
    """Counts one kind of costly request in flight on this worker (one event loop: plain
    counters), by namespace.

    Args:
        what: what the requests do, for the 503's reason ("read the event log").
        per_worker: the most in flight at once on this worker.
        per_namespace: the most in flight at once for one namespace.
    """

    def __init__(self, what: str, per_worker: int, per_namespace: int) -> None:
        self.what, self.per_worker, self.per_namespace = what, per_worker, per_namespace
        self.inflight = 0
        self._by_ns: dict[int, int] = {}  # only namespaces with one in flight: bounded

    def held(self, ns: int | None) -> int:
        """How many of namespace ``ns``'s (None: the admin view's) are in flight."""
        return self._by_ns.get(EVERY_NAMESPACE if ns is None else ns, 0)

    @contextmanager
    def admit(self, ns: int | None) -> Iterator[None]:
        """Count one request of namespace ``ns`` (None: the admin view) while the block runs.

        Raises:
            Busy: this worker has ``per_worker`` in flight, or ``ns`` has ``per_namespace``.
        """
        key = EVERY_NAMESPACE if ns is None else ns
        mine = self._by_ns.get(key, 0)
        if mine >= self.per_namespace:
            raise Busy(
                f"{mine} requests of this namespace already {self.what} on this worker "
                "(the most one namespace may); retry shortly"
            )
        if self.inflight >= self.per_worker:
            raise Busy(
                f"{self.inflight} requests already {self.what} on this worker; retry shortly"
            )
        self.inflight += 1
        self._by_ns[key] = mine + 1
        try:
            yield
        finally:
            self.inflight -= 1
            left = self._by_ns[key] - 1
            if left:
                self._by_ns[key] = left
            else:
                del self._by_ns[key]


def client_gone(request: web.Request) -> bool:
    """Whether ``request``'s client closed its connection (nobody to answer)."""
    transport = request.transport
    return transport is None or transport.is_closing()
