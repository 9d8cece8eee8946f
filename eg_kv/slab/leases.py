"""Leases: a lookup's promise that the blocks it found stay resident until they are loaded.

A lookup that answers "hit" may take a lease on each block it found
(:meth:`SlabLeases.exists_many` with ``lease_ms``), in the same critical section that
finds them, so no eviction can come between the answer and the lease. A slot holds its
leases as two fields (:mod:`eg_kv.slab.layout`): how many are held, and when the newest
ends (``CLOCK_MONOTONIC`` milliseconds, the same clock in every process of the host).

What a lease does, and does not:

- The CLOCK sweep over every namespace (:meth:`eg_kv.slab.store.Slab._make_room`) passes
  over a leased block whose lease has not ended. A put that only leased blocks stand in
  the way of is refused as a full slab is (507), saying within how long they end.
- A namespace over its quota evicts its own blocks leased or not (unleased ones first):
  a lease never lets a tenant hold more than its quota.
- It never stops a ``DELETE``: the last reference frees the block, lease or not.
- A lease ends when its holder releases it (:meth:`SlabLeases.release_leases`, a count
  never goes below 0) or when the newest lease on the block ends: a holder that died
  costs nothing after that. An ended lease is forgotten when next seen (a sweep, a new
  lease, a release, a lease the caps would refuse), and counted then as expired
  (``leases_expired``).
- A repair (a process died inside the lock) rebuilds the slot table without leases.

Local leases: a client on the slab's host answers a leasing lookup from its read-only
mapping and records each lease in its own table of the readers segment
(:mod:`eg_kv.slab.local_leases`, :mod:`eg_kv.slab.layout`): no HTTP request, the lease a
store of a block id and an end. Eviction reads those tables once per sweep
(:meth:`SlabLeases._local_leases`) and passes over their blocks as over a slot's own
lease; their counts join ``leases_taken``, ``leases_released`` and ``leased_blocks``. A
record's block id names one block for good (ids only grow), so a record left behind by a
block that went, or by a reader that died, protects nothing once its end has passed.

Lease changes take the lock but leave the seqlock alone (``write=False``): lock-free
lookups read no lease field, so they need not retry for one.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable

from ..errors import InsufficientStorage
from . import layout as L
from .check import SlabChecks
from .holds import LeaseHolders
from .layout import now_ms

#: The most leases one slot counts (its field is a uint32): more are taken but not counted.
_MAX_COUNT = 0xFFFFFFFF
#: The least time between two searches for ended leases a handle makes when the caps
#: would refuse a lease (ms): each looks at every slot with a count, under the lock.
FORGET_EVERY_MS = 100


class SlabLeases(SlabChecks):
    """The leases' part of :class:`eg_kv.slab.store.Slab` (see the module docstring)."""

    #: The local readers' leases as last read, with the tables' generations then.
    _local_cache: tuple[list[int], dict[int, int]] | None = None
    _lease_holders: LeaseHolders | None = None

    def exists_many(self, addresses: Iterable[str], ns: int = 0, lease_ms: int = 0) -> list[bool]:
        """Existence of each address in namespace ``ns``, looked up in one pass.

        Args:
            lease_ms: above 0, take a lease of this many milliseconds on every hit, in the
                critical section that finds it (a block found twice is leased twice). 0:
                the lock-free lookup, no lease.

        Returns:
            One bool per address, True for a resident block.

        Raises:
            InvalidAddress: an address is not one (nothing is leased).
        """
        if lease_ms <= 0:
            return super().exists_many(addresses, ns)
        return self.exists_leased(addresses, ns, lease_ms)[0]

    def exists_leased(
        self,
        addresses: Iterable[str],
        ns: int = 0,
        lease_ms: int = 1,
        share: float = 1.0,
        holder: int = 0,
    ) -> tuple[list[bool], bool]:
        """Existence of each address in namespace ``ns``, every hit leased for
        ``lease_ms`` (above 0) unless that would take the leased pages past a cap.

        The caps: the pages under leases (:data:`~eg_kv.slab.layout.ST_LEASED_PAGES`, a
        block's pages counted once however many leases it holds) stay within ``share`` of
        the slab's pages, and a namespace's within ``share`` of its quota. A lookup whose
        new leases would pass one takes none: its hits are answered all the same.

        ``holder`` (:func:`eg_kv.slab.holds.holder_of` a tenant; 0: none) is recorded as
        the leases' holder, and only a release by the same holder ends them. A lookup
        whose leases find no room among the holder records takes none either.

        Returns:
            ``(found, leased)``: one bool per address; whether the hits were leased.

        Raises:
            InvalidAddress: an address is not one (nothing is leased).
        """
        keys = [self._key(a, ns) for a in addresses]
        counts, ends, st = self._slot_leases, self._slot_lease_end, self._state
        found: list[bool] = []
        hits: list[int] = []
        blocks: list[int] = []
        with self._locked(write=False):
            now = now_ms()
            self._forget_if_all_ended(now)
            sizes: dict[int, int] = {}  # slot -> its pages
            for raw, fp in keys:
                i, s = self._find(raw, fp, ns)
                if s is None:
                    found.append(False)
                    continue
                found.append(True)
                hits.append(i)
                blocks.append(s[L.F_BLOCK_ID])
                sizes[i] = s[L.F_NPAGES]
            pages = self._fresh_pages(sizes)
            if pages and not self._lease_room(ns, pages, share) and self._forget_ended(now):
                pages = self._fresh_pages(sizes)  # hits whose ended leases went are fresh
            end = now + lease_ms
            holders = self._holders() if holder else None
            if (pages and not self._lease_room(ns, pages, share)) or (
                holders is not None and not holders.take(blocks, holder, end, now)
            ):
                st[L.ST_LEASES_REFUSED] += len(hits)
                return found, False
            expired = 0
            for i in hits:
                held = counts[i]
                if held and ends[i] <= now:  # ended: forgotten now
                    expired += held
                    held = 0
                if held < _MAX_COUNT:
                    counts[i] = held + 1
                if not held or ends[i] < end:
                    ends[i] = end
            if pages:
                self._count_leased(ns, pages)
            if end > st[L.ST_LEASE_LATEST_END]:
                st[L.ST_LEASE_LATEST_END] = end
            st[L.ST_LEASES_TAKEN] += len(hits)
            st[L.ST_LEASES_EXPIRED] += expired
        return found, True

    def _fresh_pages(self, sizes: dict[int, int]) -> int:
        """The pages of the slots in ``sizes`` (slot -> its pages) that hold no lease yet:
        what leasing them adds to the leased pages (a block's pages count once)."""
        counts = self._slot_leases
        return sum(n for i, n in sizes.items() if not counts[i])

    def _forget_ended(self, now: int) -> bool:
        """Forget every lease that has ended (under the lock), at most once every
        :data:`FORGET_EVERY_MS` a handle: a lease the caps would refuse. The leases of the
        whole slab were forgotten only once all had ended, so on a slab with any live lease
        the ended ones (a request dropped before its load) kept their pages counted, until
        their sum reached a cap and every namespace's leases were refused. The count column
        is searched in C; only slots with a count are looked at.

        Returns:
            Whether any was forgotten.
        """
        if now < getattr(self, "_next_forget", 0):
            return False
        self._next_forget = now + FORGET_EVERY_MS
        counts, ends = self._slot_leases, self._slot_lease_end
        ended = [i for i in itertools.compress(range(len(counts)), counts) if ends[i] <= now]
        for i in ended:
            self._forget_leases(i, counts[i], now)
        return bool(ended)

    def _lease_room(self, ns: int, pages: int, share: float) -> bool:
        """Whether ``pages`` more leased pages of namespace ``ns`` keep within the caps
        (under the lock)."""
        if self._state[L.ST_LEASED_PAGES] + pages > share * self.geometry.npages:
            return False
        if not 0 < ns < L.NS_COUNT:
            return True
        e = ns * L.NS_WORDS
        quota = self._nsw[e + L.NS_QUOTA]
        if not quota:
            return True
        return self._nsw[e + L.NS_LEASED_PAGES] + pages <= share * (quota // self.page_size)

    def _count_leased(self, ns: int, pages: int) -> None:
        """Add ``pages`` (negative: take them away) to the leased pages, the slab's and
        namespace ``ns``'s (under the lock; never below 0: a slab leased before these
        counters existed counts from 0)."""
        st = self._state
        st[L.ST_LEASED_PAGES] = max(0, st[L.ST_LEASED_PAGES] + pages)
        if 0 <= ns < L.NS_COUNT:
            w = ns * L.NS_WORDS + L.NS_LEASED_PAGES
            self._nsw[w] = max(0, self._nsw[w] + pages)

    def _forget_if_all_ended(self, now: int) -> None:
        """Once every lease a slot took has ended, forget them all at once (under the
        lock): the count column and the leased pages, in C. A lease ended but not yet
        forgotten (no sweep, release or new lease saw it) still counts against the caps
        until then: the caps err towards refusing a lease, never towards more."""
        st = self._state
        if not st[L.ST_LEASED_PAGES] or now < st[L.ST_LEASE_LATEST_END]:
            return
        counts = self._slot_leases
        st[L.ST_LEASES_EXPIRED] += sum(counts.tolist())
        counts[:] = array("I", bytes(4 * len(counts)))
        st[L.ST_LEASED_PAGES] = 0
        column = self._nsw[L.NS_LEASED_PAGES :: L.NS_WORDS]
        column[:] = array("q", bytes(8 * len(column)))

    def release_leases(self, addresses: Iterable[str], ns: int = 0, holder: int = 0) -> list[bool]:
        """Release one lease on each address's block in namespace ``ns``: with a
        ``holder``, one that holder took (:meth:`exists_leased`).

        Returns:
            One bool per address: True when a lease that had not ended was released; False
            for an absent block, one without a lease (of ``holder``'s), or one whose
            leases had ended (they are forgotten and counted as expired).

        Raises:
            InvalidAddress: an address is not one (nothing is released).
        """
        keys = [self._key(a, ns) for a in addresses]
        counts, ends, st = self._slot_leases, self._slot_lease_end, self._state
        out: list[bool] = []
        released = expired = 0
        with self._locked(write=False):
            now = now_ms()
            holders = self._holders() if holder else None
            for raw, fp in keys:
                i, s = self._find(raw, fp, ns)
                held = 0 if s is None else counts[i]
                if not held:
                    out.append(False)
                    continue
                assert s is not None
                if ends[i] <= now:
                    counts[i] = 0
                    self._count_leased(ns, -s[L.F_NPAGES])
                    expired += held
                    out.append(False)
                    continue
                if holders is not None and not holders.release(s[L.F_BLOCK_ID], holder, now):
                    out.append(False)  # leased, but not by this holder
                    continue
                counts[i] = held - 1
                if held == 1:
                    self._count_leased(ns, -s[L.F_NPAGES])
                    st[L.ST_UNLEASED_HINT] = i + 1  # where a put behind the leases looks first
                released += 1
                out.append(True)
            st[L.ST_LEASES_RELEASED] += released
            st[L.ST_LEASES_EXPIRED] += expired
        return out

    def _holders(self) -> LeaseHolders | None:
        """The lease holder records (:mod:`eg_kv.slab.holds`); None without a readers
        segment (leases are then anyone's to release)."""
        if self._holds is None:
            return None
        if self._lease_holders is None:
            self._lease_holders = LeaseHolders(self._holds)
        return self._lease_holders

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """The slab's counters (:meth:`eg_kv.slab.stats.SlabStats.stats`) and
        ``leased_blocks``: blocks under a lease that has not ended, now."""
        out = super().stats(timeout)
        out["leases_taken"] += sum(self._reader_lease_column(L.R_LEASES_TAKEN))
        out["leases_released"] += sum(self._reader_lease_column(L.R_LEASES_RELEASED))
        out["leased_blocks"] = self.leased_blocks()
        out["leased_pages"] = self._state[L.ST_LEASED_PAGES]
        return out

    def _lease_stamp(self) -> int:
        """What changes whenever a block may have become evictable without a lease ending:
        a release (over HTTP or local), a block published, a repair (counters that only
        grow)."""
        st = self._state
        local = sum(self._reader_lease_column(L.R_LEASES_RELEASED))
        return st[L.ST_LEASES_RELEASED] + st[L.ST_PUTS_CREATED] + st[L.ST_REPAIRS] + local

    def _reader_lease_column(self, word: int) -> list[int]:
        """Word ``word`` of every reader entry that may lease locally."""
        readers = self._readers
        if readers is None:
            return []
        return readers[word :: L.READER_WORDS][: L.LEASE_READERS].tolist()

    def _local_leases(self) -> dict[int, int]:
        """The blocks local readers lease: block id -> when the last lease on it ends
        (compare with the lease clock: an end may have passed since it was read).

        One pass in C over the records each table has in use (up to its high-water mark,
        bounded; a record not yet written has id 0, free), and only when a table's
        generation moved since the last pass; a slab no local reader leases costs one
        read of 16 words. Read under the lock after a writing section's sequence
        (:func:`eg_kv.slab.view.full_fence`): a reader that leased before then is seen; one
        that leases after sees the sequence move and checks its blocks again
        (:mod:`eg_kv.slab.local_leases`).
        """
        gens = self._reader_lease_column(L.R_LEASE_GEN)
        cached = self._local_cache
        if cached is not None and cached[0] == gens:
            return cached[1]
        tops, tables = self._lease_tops, self._lease_tables
        out: dict[int, int] = {}
        if tops is None or tables is None:
            return out
        records = L.lease_records(self.geometry.nslots)
        words = records * L.LEASE_RECORD_WORDS
        for e, top in enumerate(tops.tolist()):
            if top <= 0:
                continue
            start = e * words
            stop = start + min(top, records) * L.LEASE_RECORD_WORDS
            # Ids before ends: a record's end is written before its id (x86 keeps stores,
            # and loads, in order), so an id read here has its end written.
            ids = tables[start:stop:2].tolist()
            ends = tables[start + 1 : stop : 2].tolist()
            for block, end in zip(ids, ends, strict=True):
                if block and end > out.get(block, 0):
                    out[block] = end
        self._local_cache = (gens, out)
        return out

    def _raise_lease_wall(self, first_end: int) -> None:
        """Record that a sweep found only leased blocks, the first ending at ``first_end``
        (under the lock): until then, or until the stamp moves, another sweep would find
        the same, so :meth:`_behind_lease_wall` refuses at once. Two sweeps of a table of
        32,768 slots took 49 ms; of a 64 GiB slab's 2 M, seconds under the lock."""
        self._state[L.ST_LEASE_WALL_END] = first_end
        self._state[L.ST_LEASE_WALL_STAMP] = self._lease_stamp()

    def _behind_lease_wall(self, now: int) -> bool:
        """Whether the last sweep's finding (only leased blocks) still holds."""
        st = self._state
        return now < st[L.ST_LEASE_WALL_END] and st[L.ST_LEASE_WALL_STAMP] == self._lease_stamp()

    def _leased_full(self, n: int, end: int, now: int, first: bool = True) -> InsufficientStorage:
        """The 507 of a put that only leased blocks stand in the way of; ``end`` is when
        the first of their leases ends (``first``), or the last."""
        st = self._state
        which = "the first of them" if first else "all of them"
        return InsufficientStorage(
            f"no room for {n} pages: {st[L.ST_FREE_COUNT]} free, {st[L.ST_RESV_PAGES]} held "
            "by uploads in flight, the rest by leased blocks (leases end within "
            f"{max(0, end - now) / 1000:.1f} s, {which})"
        )

    def _forget_leases(self, i: int, held: int, now: int) -> None:
        """Clear slot ``i``'s ``held`` leases before its block is evicted (under the lock);
        counted as expired when they had ended (``now`` 0: the lease clock was not read)."""
        self._slot_leases[i] = 0
        s = self._read_slot(i)
        self._count_leased(s[L.F_NS], -s[L.F_NPAGES])
        holders = self._holders()
        if holders is not None:  # the block goes: its holders' records with it
            holders.drop(s[L.F_BLOCK_ID])
        if self._slot_lease_end[i] <= (now or now_ms()):
            self._state[L.ST_LEASES_EXPIRED] += held

    def leased_blocks(self) -> int:
        """Blocks under a lease that has not ended, over the whole slab: a slot's own or a
        local reader's (a block leased both ways counts once).

        The count column is searched in C; only the slots with a count are looked at one
        by one (few, in use), so a large slab with no leases costs one pass in C, and none
        when no leased page is counted.
        """
        now = now_ms()
        local = {block for block, end in self._local_leases().items() if end > now}
        held: set[int] = set()
        # No leased page counted, no slot to look at: a slab of millions of slots with no
        # lease costs its stats no pass over the count column.
        counts = self._slot_leases.tolist() if self._state[L.ST_LEASED_PAGES] else []
        if counts.count(0) != len(counts):
            ends, ids = self._slot_lease_end, self._slot_block_ids
            for i in itertools.compress(range(len(counts)), counts):
                if ends[i] > now and self._mm[self._slot_off(i)]:
                    held.add(ids[i])
        if local:  # a local lease counts while its block is published
            held.update(local & self._published_ids())
        return len(held)

    def _published_ids(self) -> set[int]:
        """The ids of every published block: the id column less the empty slots' (an
        emptied slot keeps its old fields), both read in C."""
        g = self.geometry
        states = self._mm[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE : L.SLOT_SIZE]
        return set(itertools.compress(self._slot_block_ids.tolist(), states))
