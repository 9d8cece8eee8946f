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

import collections
import threading
from collections.abc import Iterable

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
        self._members: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._members)

    def granted(self, leases: Iterable[tuple[str, str]]) -> None:
        """Note ``(address, member_id)`` for each lease a lookup's answer granted."""
        with self._lock:
            for address, member in leases:
                held = self._members.get(address)
                if held is None:
                    self._members[address] = [member]
                else:
                    held.append(member)
                    del held[:-MAX_PER_ADDRESS]
                    self._members.move_to_end(address)
            while len(self._members) > self._max:
                self._members.popitem(last=False)

    def take(self, address: str) -> str | None:
        """The member that granted the oldest lease noted on ``address`` (the note is
        spent), or None when none is noted."""
        with self._lock:
            held = self._members.get(address)
            if not held:
                return None
            member = held.pop(0)
            if not held:
                del self._members[address]
            return member
