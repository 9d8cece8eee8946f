"""Stats over a server set's members: one :class:`MemberStats` line per member and their
sum (:func:`sum_stats`). Every connector answers ``member_stats()`` with these lines (one
server is a set of one), so a caller never asks which kind of connector it holds.

Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import RemoteError
from .members import Member
from .rules import KvCacheStats

#: Per-member limits: the set's value is the smallest, not the sum.
LIMIT_FIELDS = ("page_size", "max_block_size")


@dataclasses.dataclass(frozen=True)
class MemberStats:
    """One member's line of a set's stats: up or down, and its stats when it answered."""

    member: Member
    up: bool
    stats: KvCacheStats | None
    error: str = ""

    @property
    def hit_rate(self) -> float | None:
        s = self.stats
        if s is None or s.get_hits + s.get_misses == 0:
            return None
        return s.get_hits / (s.get_hits + s.get_misses)


def member_line(member: Member, read: Any) -> MemberStats:
    """The line of ``member`` whose stats ``read()`` returns (down, with the error, when it
    raises: one line per member, and the set goes on)."""
    try:
        stats = read()
    except Exception as e:
        return MemberStats(member, False, None, str(e))
    return MemberStats(member, True, stats)


def sum_stats(parts: Sequence[KvCacheStats]) -> KvCacheStats:
    """The stats of a set: every numeric field summed over the members that answered;
    per-member limits (``page_size``, ``max_block_size``) are the smallest."""
    names = [f.name for f in dataclasses.fields(KvCacheStats) if f.name != "extra"]
    totals = {n: sum(getattr(s, n) for s in parts) for n in names}
    extra: dict[str, Any] = {}
    for s in parts:
        for key, value in s.extra.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in LIMIT_FIELDS:
                extra[key] = min(extra.get(key, value), value)
            else:
                extra[key] = extra.get(key, 0) + value
    return KvCacheStats(**totals, extra=extra)


def set_stats(lines: Sequence[MemberStats]) -> KvCacheStats:
    """The sum over the members that answered.

    Raises:
        RemoteError: no member answered (the first member's error is named).
    """
    parts = [line.stats for line in lines if line.stats is not None]
    if not parts:
        why = lines[0].error if lines else "the set has no member"
        raise RemoteError(f"cannot read /kv/stats from any member of the set: {why}")
    return sum_stats(parts)
