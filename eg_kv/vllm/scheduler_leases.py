"""The leases :class:`~eg_kv.vllm.connector.EgKvConnector`'s scheduler lookups take, and
their releases by the same client (no vLLM import).

A lease is ended by the client that took it, or it ends another's: the scheduler's lookup
leases on the slab's host are records in its own reader entry (:mod:`eg_kv.slab.
local_leases`), and a worker that released them found no record of its own and sent the
release to the server, which ended one lease of the token there, another engine's. So the
scheduler, which took them, releases them:

* a request's lookup answers: its hits' leases are held for the request (a newer answer
  for the same request replaces them, the older released: no pile of leases while a
  request waits steps to be scheduled);
* its loads are planned in step ``s``: released at the start of step ``s + lag``, when
  the step that ran them is over (``lag``: vLLM's batches in flight at once,
  ``VllmConfig.max_concurrent_batches``: 1, or 2 with async scheduling, or the pipeline's
  depth; vLLM schedules step ``s + lag`` only after step ``s``'s output);
* vLLM loads none of them (no external tokens allocated, the request finished, a lookup
  dropped before it was read): released at once.

A release is early at worst (a load that then misses is recomputed, never wrong) or late
at worst (the lease ends on its own, ``lease_ms``). Releases run on one background thread,
at most :data:`MAX_QUEUED` batches queued (past it a batch is dropped and counted: its
leases end on their own), so the scheduler never waits on a server.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from ..client.release_queue import MAX_QUEUED, ReleaseQueue

__all__ = ["MAX_HELD", "MAX_QUEUED", "SchedulerLeases"]

#: Requests whose lookup leases are held at most (the oldest is released past it).
MAX_HELD = 4096


class SchedulerLeases:
    """The scheduler's lookup leases by request, released by its own client (see the
    module docstring). Called from the scheduler's thread only; releases run on their own.

    Args:
        release: the client's ``release(addresses) -> int`` (never raises).
        lag: steps after the one that planned a load before its leases are released.
    """

    def __init__(self, release: Callable[[Sequence[str]], int], lag: int = 1) -> None:
        self._release = release
        self.lag = max(1, int(lag))
        self._step = 0
        self._held: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._due: collections.deque[tuple[int, list[str]]] = collections.deque()
        self._queue = ReleaseQueue(release, MAX_QUEUED)
        self.counters = self._queue.counters

    def looked_up(self, req_id: str, addresses: Sequence[str]) -> None:
        """A lookup of ``req_id`` answered: it leased ``addresses`` (releases the
        request's older leases, replaced by these)."""
        older = self._held.pop(req_id, None)
        if addresses:
            self._held[req_id] = list(addresses)
            while len(self._held) > MAX_HELD:
                self.release_now(self._held.popitem(last=False)[1])
        if older:
            self.release_now(older)

    def planned(self, req_id: str) -> None:
        """``req_id``'s loads are in the step being built: its leases end ``lag`` steps on."""
        addresses = self._held.pop(req_id, None)
        if addresses:
            self._due.append((self._step + self.lag, addresses))

    def not_loaded(self, req_id: str) -> None:
        """vLLM loads none of ``req_id``'s hits (none allocated, or it finished): its
        leases not planned yet end now."""
        addresses = self._held.pop(req_id, None)
        if addresses:
            self.release_now(addresses)

    def step(self) -> None:
        """A new step is being built: the leases of loads that ran are released."""
        self._step += 1
        ripe: list[str] = []
        while self._due and self._due[0][0] <= self._step:
            ripe.extend(self._due.popleft()[1])
        if ripe:
            self.release_now(ripe)

    def release_now(self, addresses: Sequence[str]) -> None:
        """Release ``addresses`` on the release thread (dropped past :data:`MAX_QUEUED`)."""
        self._queue.submit(addresses)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the releases queued; whether all were sent."""
        return self._queue.drain(timeout_s)

    def close(self, timeout_s: float = 1.0) -> None:
        """Release what is held and due, wait up to ``timeout_s`` for the releases to be
        sent (the rest end on their own), and stop the thread."""
        rest = [a for _, batch in self._due for a in batch]
        rest += [a for batch in self._held.values() for a in batch]
        self._due.clear()
        self._held.clear()
        self.release_now(rest)
        self._queue.close(timeout_s)

    def stats(self) -> dict[str, Any]:
        """The counters and what is held now."""
        held = sum(map(len, self._held.values())) + sum(len(b) for _, b in self._due)
        return {**self.counters, "held": held}
