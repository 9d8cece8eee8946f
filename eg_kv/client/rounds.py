"""The rounds of a server set's calls, written once for the sync and the async set
connectors: :class:`BatchPlan`, one batch lookup (every address at its home, then right
after a change the misses at their previous home) with its one deadline and the merge of
the answers; :class:`Ask`, one round of it; :class:`Waiting`, when a round stops waiting
for its slow members; :func:`fetch_steps`, a GET's two requests under one deadline.

Like :mod:`eg_kv.client.router`, whose :class:`~eg_kv.client.router.Router` it asks where
each address lives, it sends nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .membership import View
from .placement import merge
from .router import Groups, Router

#: The least of a batch's deadline a member's later request (its next 1,024 addresses, or
#: the second round) is sent with: one given a sliver timed out at a healthy member, and
#: a timeout marks a member down. Less than this left, the request is not sent (its
#: addresses are misses, the member's record untouched).
MIN_LEFT_S = 0.02


def fetch_steps(
    sink: Any, may_start: Callable[[float], bool] | None, timeout_s: float | None
) -> tuple[Callable[[Any, str], Any], Callable[[float], bool] | None]:
    """A set's ``fetch`` as its two steps: the request to one member (``op(connector,
    address)``, a coroutine from an async connector) and the gate of the second request
    (``may_start``). With ``timeout_s``, one deadline bounds both: each request gets what
    is left of it, and the second starts only with :data:`MIN_LEFT_S` left."""
    if timeout_s is None:
        return (lambda c, a: c.fetch(a, sink)), may_start
    deadline = time.monotonic() + timeout_s

    def op(c: Any, a: str) -> Any:
        # At least MIN_LEFT_S: fetch_steps' caller does not start one with less, and a
        # second ask gets past the gate only with more.
        return c.fetch(a, sink, timeout_s=max(deadline - time.monotonic(), MIN_LEFT_S))

    def gate(_fresh_s: float) -> bool:
        left = deadline - time.monotonic()
        return left > MIN_LEFT_S and (may_start is None or may_start(left))

    return op, gate


@dataclasses.dataclass(frozen=True)
class Ask:
    """One round of a batch lookup: which member is asked about which addresses.

    Attributes:
        view: the set the batch was placed against.
        groups: ``{member_id: [index into the batch, ...]}``.
        addresses: the whole batch, in the caller's order.
        deadline: the batch's one deadline (``time.monotonic()``).
        bounded: whether the caller's deadline is shorter than the config's timeout (then
            every request is bounded by what is left of it, not only the later ones).
        again: the second round (every request in it is a later one).
    """

    view: View
    groups: Groups
    addresses: Sequence[str]
    deadline: float
    bounded: bool
    again: bool = False

    def jobs(self) -> list[tuple[str, list[str]]]:
        """``(member_id, its addresses)`` for each member asked."""
        return [(m, [self.addresses[i] for i in idx]) for m, idx in self.groups.items()]

    def timeout(self, first: bool) -> float | None:
        """The bound of a member's next request: what is left of the deadline, or None
        (the config's timeout) for a member's first request of an unbounded batch.

        Raises:
            TimeoutError: nothing is left of the deadline, or, for a later request, less
                than :data:`MIN_LEFT_S` (nothing is sent).
        """
        if first and not self.bounded:
            return None
        left = self.deadline - time.monotonic()
        if left <= (MIN_LEFT_S if self.again or not first else 0.0):
            raise TimeoutError("the batch's deadline passed, or all but a sliver of it")
        return left


class BatchPlan:
    """One batch lookup over a set, as rounds of :class:`Ask`: iterate it, send each round
    (one request per member, in parallel) and hand the answers to :meth:`take`.

    The first round asks every address's home; a second one, only right after a
    membership change and while the deadline has room, asks the misses' previous homes.
    :attr:`found` is then one bool per address in the caller's order, :attr:`answered`
    whether any member answered. A leasing lookup (``lease_ms``) notes which member
    granted each hit's lease (:attr:`Router.lease_homes`) once its rounds are done.
    """

    def __init__(self, router: Router, addresses: Sequence[str], timeout_s: float | None,
                 lease_ms: int | None = None) -> None:  # fmt: skip
        limit = router.config.timeout_s
        self._leasing = bool(lease_ms)
        wait_s = limit if timeout_s is None else min(timeout_s, limit)
        self._router = router
        self._addresses = addresses
        self._deadline = time.monotonic() + wait_s
        self._bounded = wait_s < limit
        self._view, self._groups = router.plan(addresses)
        self._again: Groups = {}
        self.found = [False] * len(addresses)
        self.answered = False
        self._found_again: dict[int, str] = {}  # hits of the second round: who answered

    def __iter__(self) -> Iterator[Ask]:
        yield self._ask(self._groups)
        self._again = self._router.second_plan(
            self._view, self._addresses, self.found, self._groups
        )
        if self._again and self._deadline - time.monotonic() > MIN_LEFT_S:
            yield self._ask(self._again, again=True)
        if self._leasing:
            self._note_leases()

    def _ask(self, groups: Groups, again: bool = False) -> Ask:
        # A second round has only what the first left of the deadline, first requests
        # too (each had the config's whole timeout: one batch could take two of them).
        return Ask(
            self._view, groups, self._addresses, self._deadline, self._bounded or again, again
        )

    def take(self, answers: dict[str, list[bool] | None]) -> None:
        """A round's answers: ``{member_id: one bool per address, or None (failed)}``; a
        member missing (cut as a straggler) or failed leaves its addresses misses."""
        ok = {m: a for m, a in answers.items() if a is not None}
        if not self._again:  # the first round
            self.found = merge(len(self._addresses), self._groups, ok, False)
            self.answered = bool(ok)
            return
        for m, a in ok.items():
            for i, hit in zip(self._again[m], a, strict=True):
                if hit:  # asked only about the first round's misses
                    self.found[i] = True
                    self._found_again[i] = m

    def _note_leases(self) -> None:
        """Note which member granted each hit's lease (its home, or the previous home
        that answered it in the second round): a release goes there."""
        found, addresses, again = self.found, self._addresses, self._found_again
        leases = [(addresses[i], m) for i, m in again.items()]
        for m, idx in self._groups.items():
            leases += [(addresses[i], m) for i in idx if found[i] and i not in again]
        self._router.lease_homes.granted(leases)


class Waiting:
    """When a round of a batch stops waiting for the members that have not answered: at
    the deadline, and once one member answered, at :meth:`Router.cut`."""

    def __init__(self, router: Router, deadline: float) -> None:
        self._router = router
        self._deadline = deadline
        self._started = time.monotonic()
        self._cut = deadline

    def timeout(self) -> float:
        """How long to wait for the next answer now."""
        return max(0.0, self._cut - time.monotonic())

    def answered(self, got: object) -> None:
        """A member's part came back (``got``; None: it failed): an answer gives the
        others until the straggler cut. A failure is no answer (a member failing at once
        would otherwise cut a slower healthy one, and leave the batch unanswered)."""
        if got is not None:
            self._cut = self._router.cut(self._started, self._deadline)

    def elapsed(self) -> float:
        """Seconds since the round began."""
        return time.monotonic() - self._started

    def give_up(self, member_ids: Iterable[str]) -> None:
        """The round is answered without these members: marked down."""
        self._router.late(member_ids, time.monotonic() - self._started)
