"""When the supervisor may fork again into a slot whose processes keep dying.

A worker (or helper) that dies after a long life is replaced at once; one whose
predecessors keep failing (a TLS certificate mid-rotation, a crash just after it starts
serving) waits, per slot, 0.1 s, doubling to 10 s, so a broken slot costs a few forks a
minute and the healthy workers beside it keep serving. A process that served for
:data:`HEALTHY_AFTER_S` clears its slot's record.
"""

from __future__ import annotations

#: The first wait after a repeated failure; each failure after doubles it.
FIRST_S = 0.1
#: The longest wait between two forks into one failing slot.
MOST_S = 10.0
#: A process that served this long ends its slot's run of failures.
HEALTHY_AFTER_S = 60.0


class SlotBackoff:
    """Per slot (a worker's heartbeat slot, a helper's index): how many of its processes
    failed in a row, and when the next may be forked. Bounded by the number of slots."""

    def __init__(self, first_s: float = FIRST_S, most_s: float = MOST_S) -> None:
        self.first_s, self.most_s = first_s, most_s
        self._failures: dict[int, int] = {}
        self._due: dict[int, float] = {}

    def died(self, slot: int, served_s: float, now: float) -> float:
        """Record that ``slot``'s process died after serving ``served_s`` seconds (0: it
        never served); returns how long the slot now waits before its next fork (the
        first failure of a run waits nothing: most deaths are one-off)."""
        failures = 0 if served_s >= HEALTHY_AFTER_S else self._failures.get(slot, 0)
        self._failures[slot] = failures + 1
        wait = 0.0 if failures == 0 else min(self.most_s, self.first_s * 2 ** (failures - 1))
        self._due[slot] = now + wait
        return wait

    def ready(self, slot: int, now: float) -> bool:
        """Whether ``slot`` may be forked into now."""
        return now >= self._due.get(slot, 0.0)
