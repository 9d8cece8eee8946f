"""Which leases a client's lookups took and no load has ended yet: :class:`LeaseRecord`.

An engine's lookup leases its hits (``lease_ms``, :mod:`eg_kv.slab.leases`) so they
survive until the engine loads them; the load then ends one lease per block, in one
``release`` for its batch (on the server's host, where the lookup leased locally, without
a request). Only leases this client's lookups took are released: a load that no lookup
leased sends nothing, and a release never ends another client's lease. Shared by the
LMCache L2 adapter and the SGLang backend.

A forked child forgets what its parent's lookups leased: those leases are the parent's to
end (on the local slab, in the parent's own lease table), and a child that sent their
releases to the server would end other clients' leases instead.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..procs import after_fork_in_child

#: Addresses remembered with their leases (the newest): ~100 bytes each.
MAX_LEASED = 65536


class LeaseRecord:
    """The leases one client's lookups took, by address (thread-safe, bounded)."""

    def __init__(
        self,
        client: Any,
        lease_ms: int,
        max_leased: int = MAX_LEASED,
        send: Callable[[list[str]], Any] | None = None,
    ) -> None:
        """Args:
        client: what ``release(addresses)`` is sent to (a connector or a set).
        lease_ms: the lease a lookup asks (0: none, and nothing is recorded).
        max_leased: addresses remembered; past it the oldest are forgotten (their
            leases end on their own).
        send: sends the releases instead of ``client.release`` on the caller's thread
            (:meth:`eg_kv.client.release_queue.ReleaseQueue.submit`: an engine's thread
            that must not wait on a server).
        """
        self._send = send or client.release
        self.lease_ms = lease_ms
        self._max = max_leased
        self._leased: Counter[str] = Counter()
        self._lock = threading.Lock()
        after_fork_in_child(self)

    def after_fork_in_child(self) -> None:
        """In a forked child: none of the leases recorded is the child's."""
        self._leased = Counter()
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork

    @property
    def asked(self) -> int | None:
        """What a lookup passes as ``lease_ms`` (None: no lease)."""
        return self.lease_ms or None

    def note(self, addresses: Sequence[str], found: list[bool]) -> list[bool]:
        """Record the leases a lookup's hits took; returns ``found``. The counting runs
        in C (``Counter.update``): a Python step per hit was a tenth of a 1,024-key
        lookup."""
        if self.lease_ms > 0:
            with self._lock:
                leased = self._leased
                leased.update(itertools.compress(addresses, found))
                if len(leased) > self._max:  # the oldest first (a dict keeps its order)
                    for address in list(itertools.islice(leased, len(leased) - self._max)):
                        del leased[address]
        return found

    def release(self, addresses: Sequence[str]) -> None:
        """End one lease on each of ``addresses`` that a lookup leased (one taken off the
        record per address), in one ``release`` (a lease per GET header or per request
        cost loads 1.5-3x: issue 37)."""
        if self.lease_ms <= 0:
            return
        with self._lock:
            # Each address's count, taken off the record in C; a batch with none above 1
            # (the usual: one lookup, then its load) is done. Else they go back and are
            # taken one at a time (an address twice in a batch ends two leases).
            counts = list(map(self._leased.pop, addresses, itertools.repeat(0)))
            if max(counts, default=0) <= 1:
                leased = list(itertools.compress(addresses, counts))
            else:
                self._leased.update({a: c for a, c in zip(addresses, counts, strict=True) if c})
                leased = []
                for address in addresses:
                    count = self._leased.pop(address, 0)
                    if count > 1:
                        self._leased[address] = count - 1
                    if count:
                        leased.append(address)
        if leased:
            self._send(leased)
