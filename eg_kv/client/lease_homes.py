"""Which member of a server set granted each lease the set's lookups took
(:class:`LeaseHomes`), and which took each reference its PUTs stored (:class:`PutHomes`).

A lease is ended by a release at the member that granted it. A set's release went to each
address's home as the set saw it at the release, which is not always the member that
leased: a hit found at its previous home right after a membership change, or a home that
was down at the lookup (its addresses went to their next-ranked member) and is up at the
release. The release then reached a member that held no lease of this client's and ended
one another client took there under the same token, while the lease it meant stayed.
The set now notes the granting member of each hit it leased, and a release goes there;
an address noted nowhere (its note forgotten past the bound) goes to its home, as before.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Iterable, Sequence

__all__ = ["MAX_NOTED", "MAX_PER_ADDRESS", "NOT_NOTED", "LeaseHomes", "PutHomes", "delete_answer"]

#: Addresses noted at most (about 150 bytes each); past it the oldest are forgotten.
MAX_NOTED = 65536
#: Leases noted on one address at most (a lookup repeated without releases).
MAX_PER_ADDRESS = 64


class LeaseHomes:
    """The granting member of each lease a set's lookups took, by address (thread-safe,
    bounded). An address leased several times keeps one member per lease, oldest first.

    Args:
        max_noted: addresses noted at most.
    """

    def __init__(self, max_noted: int = MAX_NOTED) -> None:
        self._max = max_noted
        # address -> its granting member, or the members of its leases, oldest first
        # (a plain dict keeps insertion order: the oldest notes are the first keys).
        self._members: dict[str, str | list[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._members)

    def granted(self, leases: Iterable[tuple[str, str]]) -> None:
        """Note ``(address, member_id)`` for each lease a lookup's answer granted."""
        with self._lock:
            members = self._members
            for address, member in leases:
                held = members.pop(address, None)  # noted again: the newest
                if held is None:
                    members[address] = member
                elif isinstance(held, str):
                    members[address] = [held, member]
                else:
                    held.append(member)
                    del held[:-MAX_PER_ADDRESS]
                    members[address] = held
            excess = len(members) - self._max
            if excess > 0:
                for address in list(itertools.islice(members, excess)):
                    del members[address]

    def take(self, addresses: Sequence[str]) -> list[str | None]:
        """The member that granted the oldest lease noted on each address (the note is
        spent), or None where none is noted."""
        members = self._members
        if not members:
            return [None] * len(addresses)
        out: list[str | None] = []
        with self._lock:
            for address in addresses:
                held = members.pop(address, None)
                if held is None or isinstance(held, str):
                    out.append(held)
                    continue
                out.append(held.pop(0))
                members[address] = held[0] if len(held) == 1 else held
        return out


#: :meth:`PutHomes.where`'s answers besides a member id (never one: "host:port").
NOT_NOTED, NOTED_DOWN, NOTED_GONE = "", "down", "gone"


class PutHomes(LeaseHomes):
    """The member that took each reference a set's PUTs stored, by address: a DELETE goes
    there. After a home was down, the set's PUT went to its stand-in; a DELETE at the
    home, up again, ended a reference another client took there, while the set's own
    stayed at the stand-in."""

    def stored(self, address: str, member: str, status: int | None) -> None:
        """A PUT of ``address`` at ``member`` answered ``status``: a reference was taken
        there (201, 200)."""
        if status in (200, 201):
            self.granted(((address, member),))

    def delete_answered(self, address: str, member: str, status: int | None) -> None:
        """A DELETE at the member :meth:`where` named answered ``status``: a 503 was not
        applied (the caller asks again), so the reference is noted there again; a lost
        answer (None) may have been, and is not asked again there."""
        if status == 503:
            self.granted(((address, member),))

    def where(self, address: str, members: Collection[str], down: Collection[str]) -> str:
        """Where a DELETE of ``address`` goes: the member one of the set's PUTs stored it
        at (the oldest noted), :data:`NOT_NOTED` (none: its home), :data:`NOTED_DOWN`
        (noted at a member down now: ask later) or :data:`NOTED_GONE` (at one that left
        ``members``: its reference left with it)."""
        noted = self.take((address,))[0]
        if noted is None:
            return NOT_NOTED
        if noted not in members:
            return NOTED_GONE
        if noted in down:
            self.granted(((address, noted),))  # still the set's to release
            return NOTED_DOWN
        return noted


def delete_answer(where: str) -> int | None:
    """A DELETE's status when :meth:`PutHomes.where` names no member to send it to: None
    (down: unknown, ask again) or 404 (the member that held it left)."""
    return None if where == NOTED_DOWN else 404
