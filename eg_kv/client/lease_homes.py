"""Which member of a server set granted each lease the set's lookups took:
:class:`LeaseHomes`.

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
from collections.abc import Iterable, Sequence

__all__ = ["MAX_NOTED", "MAX_PER_ADDRESS", "LeaseHomes"]

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
