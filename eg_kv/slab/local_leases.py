"""A local reader's leases: a leasing lookup answered on the slab's host without HTTP.

A client that maps the slab read-only (:mod:`eg_kv.slab.local`) cannot write a slot's lease
fields, and asking its server to lease costs a round trip (about 0.3 ms here, ten times the
lookup). So its entry in the readers segment owns a table of lease records
(:mod:`eg_kv.slab.layout`): one per block it leases, the block's id and when the lease
ends. The server's eviction reads the tables under the lock and passes over those blocks
(:meth:`eg_kv.slab.leases.SlabLeases._local_leases`).

Why a hit the lookup answered is still there when the server reads the record (no window
where both sides miss each other):

1. the lookup finds the blocks lock-free, at slab sequence ``seq`` (even: no writer in);
2. the reader writes each hit's record (end, then id), then a full barrier
   (:func:`eg_kv.slab.view.full_fence`), then reads the sequence again;
3. a writer makes the sequence odd, then a full barrier, then reads the records
   (:class:`eg_kv.slab.lock.Held`), and only then evicts.

If the sequence is still ``seq``, no writer has entered since the lookup, and any that
enters later reads the records. If it moved, the hits are looked up again (a validated
lock-free read, after the writer left): a block still there with the same id is leased
for good (any later writer reads its record), one gone is a miss and its record is
dropped. Either way the lookup never answers a hit that an eviction may take before its
lease ends.

Releases are the reader's own: it counts leases per block and clears a record at zero,
so one client never ends another's lease. A record outlives nothing: its block id names
one block for good (ids only grow), and its end passes. A reader that takes an entry
clears the table a dead owner left. The table is bounded (:data:`~eg_kv.slab.layout.
lease_records`); a lookup that does not fit leases over HTTP instead.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from . import layout as L
from .layout import now_ms

_WORDS = L.LEASE_RECORD_WORDS


# A record, mirrored here (the table is written, never read back): a list, not an object
# (creating one per lease was most of a lookup's lease cost).
_INDEX, _BLOCK, _COUNT, _END = range(4)


class LocalLeases:
    """The lease table of one reader entry (see the module docstring). Thread-safe.

    Records are kept by address: an address names one block at a time in a namespace, so
    a lease on an address whose block was replaced moves its record to the new block
    (the old one is gone, and with it what its leases protected).

    Args:
        table: the entry's table as int64 words (records x (id, end)).
        entries: the readers' entries as int64 words; ``me`` the first word of this one.
    """

    def __init__(self, table: memoryview, entries: memoryview, me: int) -> None:
        self._table, self._entries, self._me = table, entries, me
        self._capacity = len(table) // _WORDS
        self._records: dict[str, list[int]] = {}  # address -> [index, block, count, end]
        self._free: list[int] = []
        self._lock = threading.Lock()
        # What a dead owner left: the mark first (the server reads no record past it).
        top = min(max(entries[me + L.R_LEASE_TOP], 0), self._capacity)
        entries[me + L.R_LEASE_TOP] = 0
        table[: top * _WORDS] = memoryview(bytes(8 * top * _WORDS)).cast("q")
        self._top = 0
        self._moved()

    def take(self, addresses: Sequence[str], ids: Sequence[int], lease_ms: int) -> bool:
        """Lease each address whose block id (its lookup's) is not 0, for ``lease_ms`` (an
        address twice: twice).

        Returns:
            False, with nothing taken, when the table has no room for them all.
        """
        now = now_ms()
        end = now + lease_ms
        table, records, free = self._table, self._records, self._free
        with self._lock:
            top, taken = self._top, 0
            if len(addresses) > len(free) + self._capacity - top:  # else surely room
                held = {a for a, block in zip(addresses, ids, strict=True) if block}
                if not self._room_for(len(held - records.keys()), now):
                    return False
            for address, block in zip(addresses, ids, strict=True):
                if not block:
                    continue
                rec = records.get(address)
                if rec is None:
                    if free:
                        index = free.pop()
                    else:  # a record never used (the mark rises below)
                        index, top = top, top + 1
                    rec = records[address] = [index, block, 0, end]
                    table[index * _WORDS + 1] = end  # the end before the id: the server
                    table[index * _WORDS] = block  # reads an id with its end written
                elif rec[_BLOCK] == block and rec[_END] > now:  # held: extend it
                    if rec[_END] < end:
                        rec[_END] = table[rec[_INDEX] * _WORDS + 1] = end
                else:  # ended, or the address names another block now: a new lease
                    rec[_BLOCK], rec[_COUNT], rec[_END] = block, 0, end
                    table[rec[_INDEX] * _WORDS + 1] = end
                    table[rec[_INDEX] * _WORDS] = block
                rec[_COUNT] += 1
                taken += 1
            # The mark after the records under it: the server reads none past the mark,
            # and the barrier after take (LocalSlab.lease_addresses) orders all of these.
            self._top = top
            entries, me = self._entries, self._me
            entries[me + L.R_LEASE_TOP] = top
            entries[me + L.R_LEASES_TAKEN] += taken
            entries[me + L.R_LEASE_GEN] += 1  # _moved(), inline
        return True

    def undo(self, address: str) -> None:
        """Take back one lease on ``address`` that :meth:`take` took (its lookup found the
        block gone after all): not counted as a release."""
        with self._lock:
            rec = self._records.get(address)
            if rec is not None:
                rec[_COUNT] -= 1
                if rec[_COUNT] <= 0:
                    self._drop(address, rec)
                    self._moved()
                self._entries[self._me + L.R_LEASES_TAKEN] -= 1

    def release(self, addresses: Sequence[str]) -> tuple[int, list[str]]:
        """End one of this reader's leases on each address's block.

        Returns:
            How many were released (a lease that had ended counts 0, and is forgotten),
            and the addresses this reader holds no lease on: one taken over HTTP is the
            server's to release.
        """
        released, rest = 0, []
        now = now_ms()
        records = self._records
        with self._lock:
            for address in addresses:
                rec = records.get(address)
                if rec is None:
                    rest.append(address)
                    continue
                if rec[_END] <= now:
                    self._drop(address, rec)
                    continue
                rec[_COUNT] -= 1
                if rec[_COUNT] <= 0:
                    self._drop(address, rec)
                released += 1
            if released:
                self._entries[self._me + L.R_LEASES_RELEASED] += released
                self._moved()  # after the count: the server's wall stamp reads both
        return released, rest

    def holds(self, address: str) -> bool:
        """Whether a lease of this reader is on ``address``'s block (ended or not)."""
        return address in self._records

    def held(self) -> int:
        """Blocks this reader leases now (its records whose end is ahead)."""
        now = now_ms()
        with self._lock:
            return sum(1 for rec in self._records.values() if rec[_END] > now)

    def close(self) -> None:
        """Let go of the table's view (the mapping is closed after it); the records stay
        until the next owner of the entry clears them, or their ends pass."""
        self._table.release()

    # ------------------------------------------------------------------ internals

    def _room_for(self, n: int, now: int) -> bool:
        """Whether ``n`` new records fit, after freeing ended ones if they must (under the
        lock)."""
        if n <= len(self._free) + self._capacity - self._top:
            return True
        for address, rec in list(self._records.items()):
            if rec[_END] <= now:
                self._drop(address, rec)
        self._moved()
        return n <= len(self._free) + self._capacity - self._top

    def _moved(self) -> None:
        """Bump the table's generation, after the records it covers changed: a server
        that finds it as it last read it uses what it read then."""
        self._entries[self._me + L.R_LEASE_GEN] += 1

    def _drop(self, address: str, rec: list[int]) -> None:
        """Free ``address``'s record (under the lock): its id first, which the server reads."""
        self._table[rec[_INDEX] * _WORDS] = 0
        self._free.append(rec[_INDEX])
        del self._records[address]
