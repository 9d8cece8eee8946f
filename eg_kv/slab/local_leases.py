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
from array import array
from collections.abc import Sequence

from . import layout as L
from .layout import now_ms

_WORDS = L.LEASE_RECORD_WORDS


#: Leases one reader takes are mirrored here (the table is written, never read back) in
#: columns indexed like the table's records: an object or a list per lease was most of a
#: lookup's lease cost (issue 37), columns let a lookup's new leases be written in slices.


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
        self._capacity = n = len(table) // _WORDS
        self._records: dict[str, int] = {}  # address -> its record's index
        # Each record's block id, lease count, end (monotonic ms) and address.
        self._blocks, self._counts, self._ends = [0] * n, [0] * n, [0] * n
        self._addresses: list[str] = [""] * n
        self._free: list[int] = []
        # Releases still to come for leases whose record went (ended, or reused for the
        # address's newer block) before the client released them: address -> count.
        self._absorb: dict[str, int] = {}
        self._lock = threading.Lock()
        # What a dead owner left: the mark first (the server reads no record past it).
        top = min(max(entries[me + L.R_LEASE_TOP], 0), n)
        entries[me + L.R_LEASE_TOP] = 0
        table[: top * _WORDS] = memoryview(bytes(8 * top * _WORDS)).cast("q")
        self._top = 0
        self._moved()

    def take(self, addresses: Sequence[str], ids: list[int], lease_ms: int) -> bool:
        """Lease each address whose block id (its lookup's) is not 0, for ``lease_ms`` (an
        address twice: twice).

        Returns:
            False, with nothing taken, when the table has no room for them all.
        """
        now = now_ms()
        end = now + lease_ms
        table, records, free = self._table, self._records, self._free
        blocks, counts, ends = self._blocks, self._counts, self._ends
        with self._lock:
            held_at, held_ids, new, again = self._sort(addresses, ids)
            if len(new) > len(free) + self._capacity - self._top:
                had = len(records)
                if not self._room_for(len(new), now):
                    return False
                if len(records) != had:  # ended records went, maybe some held here: again
                    held_at, held_ids, new, again = self._sort(addresses, ids)
                    if len(new) > len(free) + self._capacity - self._top:
                        return False
            for i, block in zip(held_at, held_ids, strict=True):
                if blocks[i] == block and ends[i] > now:  # held: one more, and extend it
                    counts[i] += 1
                    if ends[i] < end:
                        ends[i] = table[i * _WORDS + 1] = end
                else:  # ended, or the address names another block now: a new lease
                    self._absorb_later(self._addresses[i], counts[i])  # the old ones' releases
                    blocks[i], counts[i], ends[i] = block, 1, end
                    table[i * _WORDS + 1] = end  # the end before the id: the server
                    table[i * _WORDS] = block  # reads an id with its end written
            if new:
                self._add(new, end)
                if again:  # the second asks of an address new in this lookup
                    self._count_again(addresses, ids, new)
            entries, me = self._entries, self._me
            entries[me + L.R_LEASE_TOP] = self._top  # after the records under it
            entries[me + L.R_LEASES_TAKEN] += len(held_at) + len(new) + again
            entries[me + L.R_LEASE_GEN] += 1  # _moved(), inline
        return True

    def _sort(
        self, addresses: Sequence[str], ids: list[int]
    ) -> tuple[list[int], list[int], dict[str, int], int]:
        """A lookup's hits (under the lock): the records of those held already and their
        blocks (once per ask), the new ones (address -> block), and how many more times
        new addresses were asked in it. Parallel lists, not tuples, so that a lookup's
        leases leave little for the garbage collector to count (LMCache's process holds
        torch's objects)."""
        held_at: list[int] = []
        held_ids: list[int] = []
        new: dict[str, int] = {}
        records = self._records
        if records.keys().isdisjoint(addresses):  # (in C) a lookup of blocks new to it
            if 0 in ids:
                new = {a: block for a, block in zip(addresses, ids, strict=True) if block}
            else:  # all hits (the usual lookup of a stored prefix): in C
                new = dict(zip(addresses, ids, strict=True))
            return held_at, held_ids, new, len(ids) - ids.count(0) - len(new)
        again = 0
        for address, block in zip(addresses, ids, strict=True):
            if block:
                i = records.get(address)
                if i is not None:
                    held_at.append(i)
                    held_ids.append(block)
                elif address in new:
                    again += 1
                else:
                    new[address] = block
        return held_at, held_ids, new, again

    def _add(self, new: dict[str, int], end: int) -> None:
        """Records for ``new`` (address -> block), one lease each (under the lock): freed
        records first, then never used ones. A run of consecutive records (what a batch
        released, or never used) is written in slices; other freed ones one by one."""
        free = self._free
        names, ids = list(new), list(new.values())
        k = min(len(free), len(names))
        if k:
            tail = free[-k:]  # freed records are distinct: k of them in k places run
            lo = min(tail)
            if max(tail) - lo + 1 == k:
                del free[-k:]
                self._fill(lo, names[:k], ids[:k], end)
            else:
                table, records = self._table, self._records
                for address, block in zip(names[:k], ids[:k], strict=True):
                    i = free.pop()
                    records[address] = i
                    self._blocks[i], self._counts[i], self._ends[i] = block, 1, end
                    self._addresses[i] = address
                    table[i * _WORDS + 1] = end  # the end before the id, as in _fill
                    table[i * _WORDS] = block
        if k < len(names):
            lo = self._top
            self._top += len(names) - k
            self._fill(lo, names[k:], ids[k:], end)

    def _fill(self, lo: int, names: list[str], ids: list[int], end: int) -> None:
        """Records ``lo`` onwards for ``names`` (their blocks ``ids``), one lease each
        ending at ``end`` (under the lock): every end before any id, since the server
        reads an id with its end written."""
        hi = lo + len(names)
        self._blocks[lo:hi], self._addresses[lo:hi] = ids, names
        self._counts[lo:hi], self._ends[lo:hi] = [1] * len(names), [end] * len(names)
        self._records.update(zip(names, range(lo, hi), strict=True))
        table = self._table
        table[lo * _WORDS + 1 : hi * _WORDS : _WORDS] = array("q", [end] * len(names))
        table[lo * _WORDS : hi * _WORDS : _WORDS] = array("q", ids)

    def _count_again(
        self, addresses: Sequence[str], ids: Sequence[int], new: dict[str, int]
    ) -> None:
        """One more lease for every repeat of an address that was new in this lookup (the
        repeats of one held already were counted as held)."""
        seen: set[str] = set()
        for address, block in zip(addresses, ids, strict=True):
            if block and address in new:
                if address in seen:
                    self._counts[self._records[address]] += 1
                seen.add(address)

    def undo(self, address: str, block: int) -> None:
        """Take back one lease on ``address`` that :meth:`take` took on ``block`` (its
        lookup found the block gone after all): not counted as a release. A record that
        another lookup moved to a newer block meanwhile keeps that lease; the one taken
        back is then among those it left to absorb."""
        with self._lock:
            i = self._records.get(address)
            if i is not None and self._blocks[i] == block:
                self._counts[i] -= 1
                if self._counts[i] <= 0:
                    self._drop(i)
                    self._moved()
            elif not self._absorbed(address):
                return  # not this reader's lease (any more): nothing to take back
            self._entries[self._me + L.R_LEASES_TAKEN] -= 1

    def release(self, addresses: Sequence[str]) -> tuple[int, list[str]]:
        """End one of this reader's leases on each address's block.

        Returns:
            How many were released (a lease that had ended counts 0, and is forgotten),
            and the addresses this reader holds no lease on: one taken over HTTP is the
            server's to release.
        """
        released, rest = 0, list[str]()
        now = now_ms()
        records, counts, ends = self._records, self._counts, self._ends
        with self._lock:
            if self._release_run(addresses, now):
                return len(addresses), rest
            for address in addresses:
                i = records.get(address)
                if i is None:
                    if not self._absorbed(address):
                        rest.append(address)
                    continue
                if ends[i] <= now:  # ended: its other leases' releases are absorbed too
                    self._absorb_later(address, counts[i] - 1)
                    self._drop(i)
                    continue
                counts[i] -= 1
                if counts[i] <= 0:
                    self._drop(i)
                released += 1
            if released:
                self._entries[self._me + L.R_LEASES_RELEASED] += released
                self._moved()  # after the count: the server's wall stamp reads both
        return released, rest

    def _release_run(self, addresses: Sequence[str], now: int) -> bool:
        """Release the leases of a batch that holds one each on a run of consecutive
        records, none ended (what a lookup's :meth:`_add` wrote, then its load releases),
        in slices (under the lock). Returns False, with nothing done, for any other
        batch: the caller goes key by key."""
        n, names = len(addresses), set(addresses)
        if not n or len(names) != n or not self._records.keys() >= names:
            return False
        at = list(map(self._records.__getitem__, addresses))  # n distinct records
        lo = min(at)
        hi = lo + n
        if (
            max(at) != hi - 1  # so they are the records from lo to hi - 1
            or self._counts[lo:hi].count(1) != n
            or min(self._ends[lo:hi]) <= now
        ):
            return False
        self._table[lo * _WORDS : hi * _WORDS : _WORDS] = array("q", bytes(8 * n))  # ids
        self._free.extend(range(lo, hi))
        records = self._records
        for address in addresses:
            del records[address]
        self._entries[self._me + L.R_LEASES_RELEASED] += n
        self._moved()  # after the count: the server's wall stamp reads both
        return True

    def holds(self, address: str) -> bool:
        """Whether a lease of this reader is on ``address``'s block (ended or not, or
        forgotten with releases still to come)."""
        return address in self._records or address in self._absorb

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
        for i in list(self._records.values()):
            if self._ends[i] <= now:
                self._absorb_later(self._addresses[i], self._counts[i])
                self._drop(i)
        self._moved()
        return n <= len(self._free) + self._capacity - self._top

    def _moved(self) -> None:
        """Bump the table's generation, after the records it covers changed: a server
        that finds it as it last read it uses what it read then."""
        self._entries[self._me + L.R_LEASE_GEN] += 1

    def _absorb_later(self, address: str, count: int) -> None:
        """Remember that ``count`` releases of ``address`` will come for leases of this
        reader whose record went (under the lock): they end nothing, here or at the
        server, where a release would end another client's lease. Bounded: past
        :attr:`_capacity` addresses the oldest are forgotten (their releases then go to
        the server, as a lease taken over HTTP)."""
        if count > 0:
            absorb = self._absorb
            absorb[address] = absorb.pop(address, 0) + count  # newest last
            if len(absorb) > self._capacity:
                del absorb[next(iter(absorb))]

    def _absorbed(self, address: str) -> bool:
        """Take one release of ``address`` off :meth:`_absorb_later`'s count (under the
        lock); False if none was due."""
        left = self._absorb.get(address)
        if not left:
            return False
        if left > 1:
            self._absorb[address] = left - 1
        else:
            del self._absorb[address]
        return True

    def _drop(self, i: int) -> None:
        """Free record ``i`` (under the lock): its id first, which the server reads."""
        self._table[i * _WORDS] = 0
        self._free.append(i)
        del self._records[self._addresses[i]]
