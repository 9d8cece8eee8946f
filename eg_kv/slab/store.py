"""The shared-memory slab: one block store for every process on the host.

:class:`Slab` is one handle on it. Its parts are classes in their own modules, each
built on the one below (so a method or attribute is found as fast as in one class, and
no call goes through a wrapper):

- :class:`eg_kv.slab.view.SlabView`: lookups and block reads (lock-free);
- :class:`eg_kv.slab.lock.SlabLocking`: the slab lock;
- :class:`eg_kv.slab.segment.SlabSegment`: the segments' lifecycle (create, attach, close,
  unlink), and every attribute of a handle;
- :class:`eg_kv.slab.stats.SlabStats`: the counters;
- :class:`eg_kv.slab.namespaces.SlabNamespaces`: the namespace table;
- :class:`eg_kv.slab.check.SlabChecks`: check, repair, a dead process's leftovers;
- :class:`Slab`, here: the hot path, kept whole in this one module: slots, pages,
  eviction, reservations, put, get counting and delete. Its module globals (the slot's
  field indexes, the namespace words) are bound here for speed (measured, see the
  comments): keep them beside the code that reads them.

Concurrency: every metadata change happens under the slab lock (:mod:`eg_kv.slab.lock`),
which the kernel releases when its holder dies; whoever next takes it repairs the slab if
the holder died inside. Bulk bytes move outside the lock: a put fills pages it reserved, a
get copies slices out and then checks the block's tag (see :mod:`eg_kv.slab.layout`), so
no reader ever returns bytes that were not the block's.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from typing import TypeAlias

    #: What a put takes: anything with a length that a memoryview can cast to bytes.
    Bytes: TypeAlias = bytes | bytearray | memoryview

from ..checksum import BodyMismatch
from ..checksum import Running as RunningChecksum
from ..checksum import encode as encode_checksum
from ..checksum import of as checksum_of
from ..engine import NO_ENGINE, EngineName
from ..errors import (
    BadRequest,
    Busy,
    Conflict,
    InsufficientStorage,
    SlabError,
    TooLarge,
)
from ..procs import pid_alive
from . import layout as L
from .events import R_DELETE, R_DISK, R_EVICT, R_PUT, R_QUOTA, REMOVED, STORED

# The slot's field indexes, as module globals: read in every probe of every lookup.
from .layout import (
    F_BLOCK_ID,
    F_FIRST,
    F_LENGTH,
    F_NPAGES,
    F_NS,
    F_REF,
    F_REFS,
    F_STATE,
    now_ms,
)
from .leases import SlabLeases

# BlockGone and BlockReader are read through this module too (the server's handlers).
from .view import BlockGone as BlockGone
from .view import BlockReader as BlockReader

#: Reservation entries whose pids are copied out per scan step: a scan of the table (one
#: entry per page) reads them in C (``tolist``, ``index``, ``compress``), not one by one.
_RESV_SCAN = 4096
_FREE_RESV_SLICE = bytes(_RESV_SCAN * L.RESV_SIZE)  # a free entry is all zeros
_NS_TABLE_WORDS = L.NS_COUNT * L.NS_WORDS
_NS_SCAN = 16384  # the most namespace ids one step of a namespace's own sweep reads
# The namespace words the hot paths touch, as module globals (one lookup, not two).
_NS_BLOCKS = L.NS_BLOCKS
_NS_REFS = L.NS_REFS
_NS_RESIDENT_BYTES = L.NS_RESIDENT_BYTES
_NS_LOGICAL_BYTES = L.NS_LOGICAL_BYTES
_NS_PAGES = L.NS_PAGES
_NS_RESV_PAGES = L.NS_RESV_PAGES
_NS_PUTS_CREATED = L.NS_PUTS_CREATED
_NS_EVICTIONS = L.NS_EVICTIONS
_NS_EVICTED_BYTES = L.NS_EVICTED_BYTES
_NS_DEDUP_HITS = L.NS_DEDUP_HITS
_NS_QUOTA = L.NS_QUOTA
_NS_GET_HITS = L.NS_GET_HITS
_NS_GET_MISSES = L.NS_GET_MISSES
_unpack_slot = L.SLOT.unpack_from
_NS_WORDS = L.NS_WORDS
#: Sweeps of the hand that evict nothing before it judges every block leased: the first
#: REF_TOUCHED may only count a used block's reference count down to 0.
_SWEEPS = L.REF_TOUCHED + 1
_CLOCK_STRIDE = 0x9E3779B1  # odd: hand * stride mod 2**k visits every slot once per sweep
#: Leased blocks one put's sweep passes over before it is refused (507; the next put goes
#: on from where it stopped, after a change): ~10 ms under the lock here, where two sweeps
#: of a mostly leased table of 524,288 slots held it 2.5 s (issue 31).
SWEEP_LEASED_MAX = 8192
#: Blocks not on disk yet that one eviction passes over looking for a spilled one: a
#: keeper behind by 90% of the slab leaves one victim in ten, found in ~10 visits.
SPILL_PASS_MAX = 64
#: Pages an eviction frees beyond what its put needs, at most (a slab's 1,024th, so none
#: in a slab under 1,024 pages): the next puts find them free and skip the sweep's set-up
#: and a second probe. Best effort: the sweep stops at what the put needs once it has
#: visited AHEAD_IDLE_MAX slots without a victim (leased or used blocks), or would drop
#: a block the keeper has not spilled.
EVICT_AHEAD = 16
AHEAD_IDLE_MAX = 64
_T = TypeVar("_T")
#: Where a slot's META flags lie (from the slot's start), and the disk tier's flag.
_META_FLAGS = L.SLOT_META_OFFSET + L.META_FLAGS_OFFSET
_SPILLED = L.META_SPILLED
#: A slot's META flags byte -> 1 where it has the spilled bit (bytes.translate's table).
_SPILLED_BIT = bytes(int(bool(b & _SPILLED)) for b in range(256))
_RECORD = struct.Struct("<Q")
#: The META of a slot rebuilt without one (check's repair): no checksum, nothing else.
_NO_META = (0, 0, 0, 0, 0, 0, b"")
#: Blocks up to this size are stored by :meth:`Slab.put` in one critical section, copy
#: included: a second lock round trip cost more than the copy (scripts/bench_server.py).
SMALL_PUT = 64 * 1024


def move_slot(mm: Any, to: int, src: int, size: int) -> None:
    """Copy the ready slot at byte ``src`` of ``mm`` over the slot at ``to``, its state
    byte last: a copy cut short (a SIGKILL) leaves the slot at ``to`` empty and the one at
    ``src`` whole, never a ready slot with part of each (a deleted address over another
    block's pages, which a repair would keep)."""
    mm[to] = L.SLOT_EMPTY
    mm[to + 1 : to + size] = mm[src + 1 : src + size]
    mm[to] = L.SLOT_READY


class Slab(SlabLeases):
    """A handle on the slab from one process. Not shared across ``fork``: attach anew.

    Threads of one process may share a handle: a thread lock sits on top of the slab lock
    (an OFD lock does not exclude threads that share the fd).
    """

    # ------------------------------------------------------------------ slots

    def _write_slot(
        self, i: int, clock_ref: int, raw: bytes, refs: int, length: int, first: int,
        npages: int, block_id: int, fp: int, ns: int, meta: tuple[object, ...] = (),
    ) -> None:  # fmt: skip
        """Write slot ``i`` whole: its fields, its address and its META (``meta``: the
        SLOT_META fields; empty: a checksum of 0 and nothing else, as check's rebuild)."""
        off = self._slot_off(i)
        # Fields, address and META first, the READY state byte last: a reader never sees half.
        L.SLOT.pack_into(self._mm, off, L.SLOT_EMPTY, clock_ref, len(raw), refs, length, first,
                         npages, block_id, fp, ns, 0, 0)  # fmt: skip
        self._mm[off + L.SLOT.size : off + L.SLOT.size + len(raw)] = raw
        L.SLOT_META.pack_into(self._mm, off + L.SLOT_META_OFFSET, *(meta or _NO_META))
        self._mm[off] = L.SLOT_READY

    def _remove_slot(self, i: int) -> None:
        """Empty slot ``i`` with backward-shift deletion (no tombstones)."""
        # Offsets inline and only each slot's state and fingerprint read (not its fields
        # unpacked): every eviction runs this.
        mask, mm, base, ss, fps = self._mask, self._mm, self._slots_off, L.SLOT_SIZE, self._slot_fps
        while True:
            j = i
            while True:
                j = (j + 1) & mask
                if mm[base + j * ss] == L.SLOT_EMPTY:
                    mm[base + i * ss] = L.SLOT_EMPTY
                    self._slot_leases[i] = 0  # an empty slot counts no lease (a sum in C)
                    return
                home = fps[j] & mask
                # Entry j may move into the hole at i unless its home lies in (i, j].
                if (i < home <= j) if i <= j else (home > i or home <= j):
                    continue
                move_slot(mm, base + i * ss, base + j * ss, ss)
                i = j
                break

    # ------------------------------------------------------------------ pages

    def _alloc_pages(self, n: int) -> int:
        """Take ``n`` pages off the free list (caller made room); return the first."""
        st, nxt = self._state, self._next
        first = st[L.ST_FREE_HEAD]
        last = first
        for _ in range(n - 1):
            last = nxt[last]
        st[L.ST_FREE_HEAD] = nxt[last]
        nxt[last] = L.NO_PAGE
        st[L.ST_FREE_COUNT] -= n
        return first

    def _free_pages(self, first: int, n: int) -> None:
        st, nxt = self._state, self._next
        self._tag[first] = 0  # first: readers of this block now see it gone
        last = first
        for _ in range(n - 1):
            last = nxt[last]
        nxt[last] = st[L.ST_FREE_HEAD]
        st[L.ST_FREE_HEAD] = first
        st[L.ST_FREE_COUNT] += n

    def _npages(self, length: int) -> int:
        return -(-length // self.page_size)

    def _drop_block(
        self, i: int, s: L.SlotFields, evicted: bool = False, reason: int = 0, held: bool = False
    ) -> None:
        """Release slot ``i``'s block entirely (last delete, or an eviction if ``evicted``:
        counted here, one call per evicted block rather than two). ``reason``: the event
        log's (:mod:`eg_kv.slab.events`; 0: evict or delete, as ``evicted`` says).
        ``held``: the disk tier holds the address: no removal is logged."""
        st, ev = self._state, self._events
        if ev is not None and (held or (
            evicted and self._mm[self._slot_off(i) + _META_FLAGS] & _SPILLED
        )):  # fmt: skip
            ev = None  # the disk tier holds it: a move between tiers, not a removal
        if ev is not None:  # pending before the change, published after (crash safety)
            ev.begin(REMOVED, reason or (R_EVICT if evicted else R_DELETE), s[F_NS],
                     self._slot_address(i, s[L.F_ALEN]), s[F_BLOCK_ID], s[F_LENGTH],
                     self._slot_engine(i))  # fmt: skip
        if self._slot_leases[i]:  # a DELETE of a leased block: its pages are no longer leased
            self._count_leased(s[F_NS], -s[F_NPAGES])
            holders = self._holders()
            if holders is not None:  # nor are its holders' records taken
                holders.drop(s[F_BLOCK_ID])
        self._free_pages(s[F_FIRST], s[F_NPAGES])
        self._remove_slot(i)
        st[L.ST_UNIQUE_BLOCKS] -= 1
        st[L.ST_TOTAL_REFS] -= s[F_REFS]
        st[L.ST_RESIDENT_BYTES] -= s[F_LENGTH]
        st[L.ST_LOGICAL_BYTES] -= s[F_LENGTH] * s[F_REFS]
        st[L.ST_SLOT_PAGES] -= s[F_NPAGES]
        if evicted:
            st[L.ST_EVICTIONS] += 1
            st[L.ST_EVICTED_BYTES] += s[F_LENGTH]
        e = s[F_NS] * _NS_WORDS
        if 0 < e < _NS_TABLE_WORDS:  # 0: derived; a damaged id may lie beyond the table
            nsw = self._nsw
            nsw[e + _NS_BLOCKS] -= 1
            nsw[e + _NS_REFS] -= s[F_REFS]
            nsw[e + _NS_RESIDENT_BYTES] -= s[F_LENGTH]
            nsw[e + _NS_LOGICAL_BYTES] -= s[F_LENGTH] * s[F_REFS]
            nsw[e + _NS_PAGES] -= s[F_NPAGES]
            if evicted:
                nsw[e + _NS_EVICTIONS] += 1
                nsw[e + _NS_EVICTED_BYTES] += s[F_LENGTH]
        if ev is not None:
            ev.commit()

    def _room(self, n: int, ns: int, length: int) -> None:
        """Make room for a block of ``length`` bytes on ``n`` new pages in namespace ``ns``.

        A namespace with a quota keeps within it on its own first: the pages it holds
        (published blocks and uploads in flight: whole pages, what the slab gives up for
        them) plus ``n`` must fit in the quota, evicting only its own blocks. So the global
        eviction below, over every namespace, is reached only by a namespace within its
        quota, when the slab itself is full.

        Args:
            n: pages to take now; 0 at a commit (its pages were charged when reserved).

        Raises:
            InsufficientStorage: the block alone is over the namespace's quota, or the
                slab has no room even evicting every block.
            Busy: the namespace's own uploads in flight hold the rest of its quota.
        """
        if ns:
            e, nsw = ns * _NS_WORDS, self._nsw
            quota = nsw[e + _NS_QUOTA]
            if quota:
                held = nsw[e + _NS_PAGES] + nsw[e + _NS_RESV_PAGES]
                if (held + n) * self.page_size > quota:
                    self._evict_own(ns, n, length)
        if self._state[L.ST_FREE_COUNT] < n:
            self._make_room(n)

    def _evict_own(self, ns: int, n: int, length: int) -> None:
        """Evict namespace ``ns``'s own blocks by CLOCK until its pages, its uploads' in
        flight and ``n`` more fit in its quota. Never touches another namespace's blocks.

        The namespace's hand walks the slots in order; the namespace-id column is searched
        in C a slice at a time, so a small namespace in a big table does not pay a Python
        step per foreign slot. At most REF_TOUCHED + 1 passes (the first ones may only count
        reference counts down)
        passing over leased blocks, then, if it is still over, two more that evict them
        too: a lease never holds a namespace beyond its quota.

        Args:
            n: pages about to be taken (0 at a commit). length: the block's bytes.

        Raises:
            InsufficientStorage: the block alone (in whole pages) is over the quota.
            Busy: its own uploads in flight hold the rest of the quota; nothing is
                evicted for them (it would not be enough). A dead writer's pages are
                given back when the supervisor reaps it (:meth:`release_process`); a scan
                for them here would cost every refused put a walk of the table.
        """
        e, nsw, ps = ns * _NS_WORDS, self._nsw, self.page_size
        quota = nsw[e + _NS_QUOTA]
        if self._npages(length) * ps > quota:
            raise InsufficientStorage(
                f"the block takes {self._npages(length) * ps} bytes ({self._npages(length)} "
                f"pages of {ps}), over its namespace's quota of {quota} bytes (quotas count "
                "whole pages): raise the quota in the tokens file"
            )
        # The most pages its published blocks may keep: the quota less its uploads in
        # flight and the new block's pages.
        target = quota // ps - n - nsw[e + _NS_RESV_PAGES]
        if target < 0:
            raise Busy(
                f"namespace {self._ns_name(ns)}: its uploads in flight hold "
                f"{nsw[e + _NS_RESV_PAGES] * ps} bytes of its quota of {quota}; retry when "
                "they finish, or raise the quota in the tokens file"
            )
        col, nslots = self._slot_ns, self.geometry.nslots
        i = nsw[e + L.NS_HAND] % nslots
        for now in (now_ms(), 0):  # leases honoured, then not
            local = self._local_leases() if now else {}
            scanned, step = 0, 256
            while nsw[e + _NS_PAGES] > target and scanned < _SWEEPS * nslots:
                end = min(nslots, i + step)
                try:
                    j = i + col[i:end].tolist().index(ns)
                except ValueError:
                    scanned += end - i
                    i = end % nslots
                    # Slices grow while they miss: a dense namespace finds its next block
                    # in a short one, a sparse one is not searched 256 slots at a time.
                    step = min(step * 4, _NS_SCAN)
                    continue
                scanned += j - i + 1
                if self._clock_visit(j, now, local):
                    i = j  # backward shift may have moved another block into slot j
                    continue
                i = (j + 1) % nslots
        nsw[e + L.NS_HAND] = i
        if nsw[e + _NS_PAGES] > target:  # two passes missed blocks moved by backward shifts
            raise Busy(f"namespace {self._ns_name(ns)} is at its quota of {quota} bytes; retry")

    def _clock_visit(
        self,
        i: int,
        now: int = 0,
        local: dict[int, int] | None = None,
        reason: int = R_QUOTA,
        second_chance: bool = True,
    ) -> bool:
        """CLOCK's visit of slot ``i``: take one off its reference count (another chance),
        or evict its block if the count was 0. True if it evicted (the backward shift may
        have moved another block into slot ``i``).

        Args:
            now: the lease clock (:func:`eg_kv.slab.leases.now_ms`): a block leased until
                after it is passed over. 0: leases do not protect it.
            local: the local readers' leases (:meth:`_local_leases`), honoured with ``now``.
            reason: the event log's reason for an eviction (a namespace's own: quota).
            second_chance: False evicts a referenced block too (the hint of a release).
        """
        mm, off = self._mm, self.geometry.slots_off + i * L.SLOT_SIZE
        if mm[off] != L.SLOT_READY:
            return False
        if local and local.get(self._slot_block_ids[i], 0) > now:
            return False
        held = self._slot_leases[i]
        if held and now and self._slot_lease_end[i] > now:
            return False  # leased: passed over, its count kept (as _make_room does)
        if mm[off + L.SLOT_REF_OFFSET] and second_chance:
            mm[off + L.SLOT_REF_OFFSET] -= 1
            return False
        if held:
            self._forget_leases(i, held, now)
        self._drop_block(i, self._read_slot(i), evicted=True, reason=reason)
        return True

    def _make_room(self, n: int) -> None:
        """Free pages until ``n`` are free, evicting by CLOCK (second chance), and a few
        more where it is cheap (:data:`EVICT_AHEAD`).

        A block under a lease that has not ended is passed over (:mod:`eg_kv.slab.leases`).

        Raises:
            InsufficientStorage: even evicting every published block would not free
                enough, or two sweeps found only leased blocks left to evict.
        """
        st = self._state
        if st[L.ST_FREE_COUNT] >= n:
            return
        if st[L.ST_FREE_COUNT] + st[L.ST_SLOT_PAGES] < n:
            self._release_dead_reservations()
            if st[L.ST_FREE_COUNT] + st[L.ST_SLOT_PAGES] < n:
                raise InsufficientStorage(
                    f"no room for {n} pages: {st[L.ST_FREE_COUNT]} free, "
                    f"{st[L.ST_RESV_PAGES]} held by uploads in flight"
                )
        # The hand walks the slots in a scattered (but complete, cyclic) order: sweeping
        # them in address order grew probe clusters of ~900 slots (measured), since every
        # eviction then lands at the front of the same cluster.
        # The visit is inline, not _clock_visit(): a method call per visited slot cost
        # evicting 4 KiB puts about 5% (measured).
        leases, ends, now = self._slot_leases, self._slot_lease_end, now_ms()
        if self._behind_lease_wall(now):  # only leased blocks, as the last sweep found
            raise self._leased_full(n, st[L.ST_LEASE_WALL_END], now)
        self._forget_if_all_ended(now)
        if st[L.ST_FREE_COUNT] + st[L.ST_SLOT_PAGES] - st[L.ST_LEASED_PAGES] < n:
            # Refused before evicting anything: even every unleased block would not do.
            raise self._leased_full(n, st[L.ST_LEASE_LATEST_END], now, first=False)
        local, ids = self._local_leases(), self._slot_block_ids
        hint = st[L.ST_UNLEASED_HINT] - 1
        st[L.ST_UNLEASED_HINT] = 0
        if hint >= 0 and 8 * (st[L.ST_SLOT_PAGES] - st[L.ST_LEASED_PAGES]) < st[L.ST_SLOT_PAGES]:
            # Almost every block leased: a sweep would pass over thousands to find the one
            # whose last lease was just released. It is the victim, second chance or not.
            self._clock_visit(hint, now, local, reason=R_EVICT, second_chance=False)
            if st[L.ST_FREE_COUNT] >= n:
                return
        want = n + min(EVICT_AHEAD, self.geometry.npages >> 10)
        mask, hand, mm, base = self._mask, st[L.ST_CLOCK_HAND], self._mm, self.geometry.slots_off
        # With a disk tier, a block its keeper has not written yet is passed over while a
        # spilled one may be found: evicting a spilled block moves it to disk, evicting
        # another loses it (a spill drop). The hand visits slots in scattered order, not
        # by age, so without this a keeper behind by a fraction of the slab loses that
        # fraction of evictions (measured: a third of lmcache bench l2's keys). Bounded:
        # after SPILL_PASS_MAX such passes without a victim it evicts as before, and does
        # not look again until the keeper marks another block (ST_SPILL_WALL).
        spilled_only = st[L.ST_SPILLS] != st[L.ST_SPILL_WALL]
        # Slots visited since the last eviction: REF_TOUCHED + 1 sweeps without one (the
        # first ones may only count reference counts down) mean only leased blocks are left.
        idle, first_end, passed, unspilled = 0, 1 << 62, 0, 0
        while st[L.ST_FREE_COUNT] < want:
            i = (hand * _CLOCK_STRIDE) & mask
            off = base + i * L.SLOT_SIZE
            if mm[off] == L.SLOT_READY:
                # Leases first: a leased block keeps its count (it is in use), and a slab
                # of leased blocks is known as such in one sweep, not REF_TOUCHED + 1.
                if leases[i] and ends[i] > now:
                    first_end = min(first_end, ends[i])  # leased: passed over
                    passed += 1
                elif local and local.get(ids[i], 0) > now:
                    first_end = min(first_end, local[ids[i]])  # leased locally: passed over
                    passed += 1
                elif mm[off + L.SLOT_REF_OFFSET]:
                    mm[off + L.SLOT_REF_OFFSET] -= 1  # another chance
                elif spilled_only and not mm[off + _META_FLAGS] & _SPILLED:
                    unspilled += 1  # not on disk yet: passed over while a spilled one may be
                    if unspilled > SPILL_PASS_MAX:
                        if st[L.ST_FREE_COUNT] >= n:
                            break  # evicting ahead: not at the cost of a spill drop
                        spilled_only = False
                        st[L.ST_SPILL_WALL] = st[L.ST_SPILLS]
                        continue  # this one is the victim after all
                else:
                    if leases[i]:
                        self._forget_leases(i, leases[i], now)
                    self._drop_block(i, _unpack_slot(mm, off), evicted=True)
                    idle = unspilled = 0
                    continue  # backward shift may have moved another block into slot i
            hand = (hand + 1) & mask
            idle += 1
            if idle > AHEAD_IDLE_MAX and st[L.ST_FREE_COUNT] >= n:
                break  # evicting ahead: not through a run of leased or used blocks
            if passed > SWEEP_LEASED_MAX:  # mostly leased: this put has looked long enough
                st[L.ST_CLOCK_HAND] = hand  # the next one goes on from here, after a change
                self._raise_lease_wall(first_end)
                raise self._leased_full(n, first_end, now)
            if idle > _SWEEPS * (mask + 1):
                if spilled_only:  # a small table, swept twice: no spilled block in it
                    spilled_only, idle = False, 0
                    st[L.ST_SPILL_WALL] = st[L.ST_SPILLS]
                    continue
                st[L.ST_CLOCK_HAND] = hand
                self._raise_lease_wall(first_end)
                raise self._leased_full(n, first_end, now)
        st[L.ST_CLOCK_HAND] = hand

    # ------------------------------------------------------------------ reservations

    def _resv_off(self, r: int) -> int:
        return self.geometry.resv_off + r * L.RESV_SIZE

    def _reserve(self, first: int, npages: int, length: int, ns: int = 0) -> int:
        """Record a put's pages under this pid, charged to namespace ``ns`` (its quota
        counts them until they are published or given back); the entry's index, or -1
        if none is free.

        The table's first entries (one per page) are the page-holding puts', the rest
        (:data:`~eg_kv.slab.layout.DEDUP_ENTRIES`) a dedup hit's (``first`` RESV_DEDUP):
        those can never take the room a put's pages need."""
        st, g = self._state, self.geometry
        if first == L.RESV_DEDUP and g.nresv > g.npages:
            r = self._free_resv_entry(g.npages, g.npages, g.nresv)
        elif first == L.RESV_DEDUP:  # a slab made before the dedup entries: the one table
            r = self._free_resv_entry(st[L.ST_RESV_HINT] % g.nresv, 0, g.nresv)
        else:
            nr = min(g.npages, g.nresv) or 1
            r = self._free_resv_entry(st[L.ST_RESV_HINT] % nr, 0, nr)
        if r >= 0:
            L.RESV.pack_into(self._mm, self._resv_off(r), self._pid, first, npages, ns, length)
            if first != L.RESV_DEDUP:
                st[L.ST_RESV_HINT] = r + 1
            st[L.ST_RESV_PAGES] += npages
            if ns:  # the default namespace's is derived (the slab's less the others')
                self._nsw[ns * _NS_WORDS + _NS_RESV_PAGES] += npages
        return r

    def _free_resv_entry(self, start: int, first: int, end: int) -> int:
        """The first free reservation entry of ``first``..``end`` from ``start`` on
        (wrapping), or -1.

        Entries are taken in turn from a rotating hint, so the one at the hint is nearly
        always free; otherwise the pid column is searched in C, a slice at a time (past
        131,072 entries in use: 2-6 ms here, against 50 ms entry by entry).
        """
        pids = self._resv_pids
        if pids[start] == 0:
            return start
        for lo, hi in ((start, end), (first, start)):
            while lo < hi:
                end = min(hi, lo + _RESV_SCAN)
                with contextlib.suppress(ValueError):
                    return lo + pids[lo:end].tolist().index(0)
                lo = end
        return -1

    def _resv_in_use(self) -> list[int]:
        """Indexes of the reservation entries in use.

        A slice of free (all-zero) entries is skipped with one compare; the pids of the
        others are read in C. At 262,144 entries (1 GiB of 4 KiB pages) that took 0.3 ms
        with none in use and 6 ms with half, against 50 ms for a loop over every entry.
        """
        pids, raw, nr = self._resv_pids, self._resv_raw, self.geometry.nresv
        used: list[int] = []
        size = L.RESV_SIZE
        for lo in range(0, nr, _RESV_SCAN):
            end = min(nr, lo + _RESV_SCAN)
            if raw[lo * size : end * size].tobytes() == _FREE_RESV_SLICE[: (end - lo) * size]:
                continue
            used.extend(itertools.compress(range(lo, end), pids[lo:end].tolist()))
        return used

    def _unreserve(self, r: int) -> tuple[int, int]:
        """Clear reservation ``r`` and un-charge its namespace; return its (first page,
        page count)."""
        _pid, first, npages, ns, _len = L.RESV.unpack_from(self._mm, self._resv_off(r))
        L.RESV.pack_into(self._mm, self._resv_off(r), 0, 0, 0, 0, 0)
        self._state[L.ST_RESV_PAGES] -= npages
        if 0 < ns < L.NS_COUNT:  # 0: derived; a damaged id may lie beyond the table
            self._nsw[ns * _NS_WORDS + _NS_RESV_PAGES] -= npages
        return first, npages

    def _release_dead_reservations(self) -> int:
        """Give back the pages of puts whose writer died. Returns how many were released."""
        released, pids = 0, self._resv_pids
        for r in self._resv_in_use():
            pid = pids[r]
            if pid != self._pid and not pid_alive(pid):
                self._release_entry(r)
                released += 1
        return released

    def _release_entry(self, r: int) -> int:
        """Give back reservation ``r`` of a writer that died: an upload's pages, or a
        dedup hit's reference (its put never ended). Returns the pages freed."""
        _pid, _first, _npages, ns, length = L.RESV.unpack_from(self._mm, self._resv_off(r))
        first, npages = self._unreserve(r)
        if first == L.RESV_DEDUP:
            self._take_back_dedup_of(ns, length)
            return 0
        self._free_pages(first, npages)
        return npages

    def _take_back_dedup_of(self, ns: int, block_id: int) -> None:
        """Undo the dedup hit in namespace ``ns`` of a put whose writer died, on block
        ``block_id`` (under the lock; found by its id, a search of the id column in C)."""
        ids, i = self._slot_block_ids.tolist(), -1
        while True:
            try:
                i = ids.index(block_id, i + 1)
            except ValueError:  # evicted meanwhile: it took every reference with it
                self._undo_dedup(-1, None, ns, block_id)
                return
            s = self._read_slot(i)
            # An emptied slot keeps the id of the last block shifted out of it: a copy at
            # a lower index than the block itself, once a shift crossed the table's wrap.
            if s[F_STATE] != L.SLOT_EMPTY:
                break
        self._undo_dedup(i, s if s[F_STATE] == L.SLOT_READY else None, ns, block_id)

    # ------------------------------------------------------------------ put

    def begin_put(
        self, address: str, length: int, upload_share: float = 1.0, ns: int = 0,
        checksum: int | None = None, engine: EngineName = NO_ENGINE,
    ) -> PutHandle:  # fmt: skip
        """Start a streaming put of ``length`` bytes under ``address``.

        Returns a :class:`PutHandle`: ``write`` the bytes, then ``commit`` (or ``abort``).
        A resident block of the same length makes it a dedup hit, counted now (the address
        names the content): its bytes are counted and dropped, ``commit`` stores nothing,
        and ``abort`` (a body that broke off) takes the reference back.

        Args:
            upload_share: the fraction of the slab's pages that puts in flight may hold
                together. A put that would take them over it is refused, unless none is in
                flight (so a block larger than the share can still be stored).
            checksum: the bytes' XXH3-64 as their sender gave it (:mod:`eg_kv.checksum`);
                ``commit`` refuses bytes that do not match it. None: the one computed
                from the bytes is kept.
            engine: the block's engine name (:mod:`eg_kv.engine`), kept with it for the
                KV events; a dedup hit keeps the resident block's.

        Raises:
            InvalidAddress, TooLarge (before any byte is stored), Conflict (resident with
            another length), InsufficientStorage, Busy (the share of the slab that puts in
            flight may hold is taken; retry).
        """
        raw, fp = self._key(address, ns)
        n = self._pages_for(length)
        st = self._state
        self._refuse_early(address, n, ns)
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is not None:  # a dedup hit: counted once its put ends (_commit)
                self._add_ref(i, s, address, length, hit=False)
                h = PutHandle(self, address, raw, fp, length, -1, L.NO_PAGE, 0, s[F_BLOCK_ID], ns)
                # Its reference, noted under this pid: given back if the writer dies first.
                h.ref_entry = self._reserve(L.RESV_DEDUP, 0, s[F_BLOCK_ID], ns)
                return h
            held, cap = st[L.ST_RESV_PAGES], int(upload_share * self.geometry.npages)
            # Over the share but within the slab: 503, retry. Beyond the slab: 507 below
            # (after _make_room has released any dead writer's pages).
            if held and cap < held + n <= self.geometry.npages:
                raise Busy(
                    f"uploads in flight hold {held * self.page_size} bytes of the "
                    f"{cap * self.page_size} they may reserve (--upload-share "
                    f"{upload_share:g}); retry shortly"
                )
            self._room(n, ns, length)
            first = self._alloc_pages(n)
            r = self._reserve(first, n, length, ns)
            if r < 0:  # cannot happen while every put holds a page (one entry per page)
                self._free_pages(first, n)
                raise Busy("the reservation table is full; retry")
        return PutHandle(self, address, raw, fp, length, r, first, n, 0, ns, checksum, engine)

    def add_ref(self, address: str, length: int, ns: int = 0, refs: int = 1,
                hit: bool = True) -> int:  # fmt: skip
        """A dedup hit from the headers alone: one more reference if ``address`` is
        resident with ``length`` bytes.

        Args:
            refs: references to add (in one hold of the lock).
            hit: count a dedup hit; False for references that come with a block from
                the disk tier (its copy's, joining the slab's: no PUT of a block held), or
                for a hit counted once its answer went out (:meth:`count_dedup_hit`).

        Returns:
            The block's id (what :meth:`take_back_ref` names), or 0 if it is absent.

        Raises:
            InvalidAddress. Conflict: resident with another length.
        """
        raw, fp = self._key(address, ns)
        if self._read(self._find, raw, fp, ns)[1] is None:  # lock-free: the usual miss
            return 0
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is None:
                return 0
            self._add_ref(i, s, address, length, refs, hit)
            return int(s[F_BLOCK_ID])

    def count_dedup_hit(self, ns: int = 0) -> None:
        """Count a dedup hit whose :meth:`add_ref` (``hit=False``) was answered: a hit is
        counted once it went out, so no counter goes back when a client leaves first."""
        with self._locked():
            self._count_dedup_hit(ns)

    def _count_dedup_hit(self, ns: int) -> None:
        self._state[L.ST_DEDUP_HITS] += 1
        if ns:
            self._nsw[ns * _NS_WORDS + _NS_DEDUP_HITS] += 1

    def take_back_ref(self, address: str, block_id: int, ns: int = 0) -> None:
        """Undo an :meth:`add_ref` whose answer never went out (the client left): not a
        DELETE (no delete is counted, nor a dedup hit), and only of the same block."""
        raw, fp = self._key(address, ns)
        self._take_back_ref(raw, fp, ns, block_id)

    def put(
        self, address: str, data: Bytes, ns: int = 0, checksum: int | None = None,
        engine: EngineName = NO_ENGINE, new_ok: Callable[[], bool] | None = None,
    ) -> bool:  # fmt: skip
        """Store ``data`` under ``address`` in one call; True if created, False if dedup.

        Up to :data:`SMALL_PUT` bytes are looked up, copied in and published in one
        critical section; larger blocks go through :meth:`begin_put`, copied outside it.

        Args:
            new_ok: asked under the lock before a small block is created (the disk tier:
                that no copy of it was spilled, the slab having evicted it since the
                caller looked).

        Raises:
            The same as :meth:`begin_put`, BodyMismatch: ``data`` does not have the
            ``checksum`` given (nothing is stored), and Busy: ``new_ok`` said no.
        """
        length = len(data)
        if length > SMALL_PUT:
            handle = self.begin_put(address, length, ns=ns, checksum=checksum, engine=engine)
            try:
                handle.write(data)
                return handle.commit()
            finally:
                handle.abort()
        raw, fp = self._key(address, ns)
        n = self._pages_for(length)
        got = checksum_of(data)
        if checksum is not None and checksum != got:
            self.refuse_body(checksum, got)
        self._refuse_early(address, n, ns)
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is not None:
                return self._add_ref(i, s, address, length)
            if new_ok is not None and not new_ok():
                raise Busy(f"block {address} is moving between the disk and the slab; retry")
            if self._state[L.ST_FREE_COUNT] < n or (ns and self._nsw[ns * _NS_WORDS + _NS_QUOTA]):
                self._room(n, ns, length)
                i = self._find(raw, fp, ns)[0]  # evictions may have moved the empty slot
            first = self._alloc_pages(n)
            mv = self._mv
            if n == 1:  # the usual small block: one page, no runs to work out
                off = self._data_off + first * self.page_size
                mv[off : off + length] = data if type(data) is bytes else memoryview(data).cast("B")
            else:
                src = memoryview(data).cast("B")
                for pos, off, size in _runs(self, first, n, length):
                    mv[off : off + size] = src[pos : pos + size]
            # A crash before the slot is written leaves pages no slot owns: repair frees them.
            self._publish(i, raw, fp, length, first, n, ns, got, engine)
            return True

    def refuse_body(self, expected: int, got: int) -> NoReturn:
        """Count a PUT body that does not match the checksum it carried, and refuse it.

        Raises:
            BodyMismatch: always.
        """
        with self._locked():
            self._state[L.ST_CHECKSUM_REFUSED] += 1
        raise BodyMismatch(
            f"the body's checksum is {encode_checksum(got)}, not {encode_checksum(expected)} "
            "as its header says: the bytes changed on the way; nothing was stored, send it again"
        )

    def _refuse_early(self, address: str, n: int, ns: int) -> None:
        """Refuse a put of ``n`` new pages that only leased blocks stand in the way of,
        without the lock: a slab behind a wall of leases refused thousands of puts a
        second, each taking the lock and moving the seqlock, and the lock-free GETs fell
        to a fraction (issue 31). The words are read without the lock: a put let through
        here is decided under it; one refused here in a change's microsecond retries.
        A dedup hit is never refused, nor a namespace with a quota (it evicts its own).

        Raises:
            InsufficientStorage: as :meth:`_make_room` would, at once.
        """
        st = self._state
        if st[L.ST_FREE_COUNT] >= n or not st[L.ST_LEASED_PAGES]:
            return
        if ns and self._nsw[ns * _NS_WORDS + _NS_QUOTA]:
            return
        now = now_ms()
        short = st[L.ST_FREE_COUNT] + st[L.ST_SLOT_PAGES] - st[L.ST_LEASED_PAGES] < n
        if not (short and now < st[L.ST_LEASE_LATEST_END]) and not self._behind_lease_wall(now):
            return
        if self.exists(address, ns):  # a dedup hit takes no page
            return
        raise self._leased_full(n, st[L.ST_LEASE_LATEST_END], now, first=False)

    def _pages_for(self, length: int) -> int:
        """Pages a block of ``length`` bytes takes.

        Raises:
            BadRequest: an empty block. TooLarge: over the maximum block size.
        """
        if length < 1:
            raise BadRequest(f"empty block ({length} bytes): nothing to store")
        if length > self.max_block_size:
            raise TooLarge(
                f"block of {length} bytes is over the maximum block size of {self.max_block_size}"
            )
        return self._npages(length)

    def _add_ref(
        self, i: int, s: L.SlotFields, address: str, length: int, refs: int = 1,
        hit: bool = True,
    ) -> bool:  # fmt: skip
        """A dedup hit on slot ``i`` (fields ``s``): ``refs`` more references (a dedup
        hit counted unless ``hit`` is False). Returns False.

        Raises:
            Conflict: the resident block has another length.
        """
        if s[F_LENGTH] != length:
            raise Conflict(conflict_message(address, s[F_LENGTH], length))
        # More references, and the reference count set (a dedup hit is a use).
        fields = list(s)
        fields[F_STATE], fields[F_REF] = L.SLOT_READY, L.REF_TOUCHED
        fields[F_REFS] += refs
        L.SLOT.pack_into(self._mm, self._slot_off(i), *fields)
        st, e, nsw = self._state, s[F_NS] * _NS_WORDS, self._nsw
        st[L.ST_TOTAL_REFS] += refs
        st[L.ST_LOGICAL_BYTES] += length * refs
        st[L.ST_DEDUP_HITS] += hit
        if e:
            nsw[e + _NS_REFS] += refs
            nsw[e + _NS_LOGICAL_BYTES] += length * refs
            nsw[e + _NS_DEDUP_HITS] += hit
        return False

    def _publish(
        self, i: int, raw: bytes, fp: int, length: int, first: int, npages: int, ns: int,
        checksum: int, engine: EngineName = NO_ENGINE, record: int = 0, refs: int = 1,
    ) -> None:  # fmt: skip
        """Make the block on pages ``first``.. visible in empty slot ``i`` with ``refs``
        references, and count it. ``record``: the disk tier's record it was read from (a
        promotion: its slot says the disk has it). A promotion is logged as stored: a
        reader that knew the block sees it again (harmless), one that started after it
        went to disk (a restart) learns of it."""
        st, ev = self._state, self._events
        block_id = st[L.ST_NEXT_BLOCK_ID]
        if ev is not None:  # pending before the change, published after (crash safety)
            ev.begin(STORED, R_PUT, ns, raw, block_id, length, engine)
        st[L.ST_NEXT_BLOCK_ID] = block_id + 1
        self._tag[first] = block_id
        flags = _SPILLED if record else 0
        if engine is NO_ENGINE:
            meta: tuple[object, ...] = (checksum, record, 0, 0, flags, 0, b"")
        else:
            meta = (checksum, record, engine.lora_id, engine.block_size, flags, len(engine.hash),
                    engine.hash)  # fmt: skip
        self._write_slot(i, L.REF_NEW, raw, refs, length, first, npages, block_id, fp, ns, meta)
        st[L.ST_UNIQUE_BLOCKS] += 1
        st[L.ST_TOTAL_REFS] += refs
        st[L.ST_RESIDENT_BYTES] += length
        st[L.ST_LOGICAL_BYTES] += length * refs
        st[L.ST_SLOT_PAGES] += npages
        created = 0 if record else 1  # a promotion from the disk tier is no client's PUT
        st[L.ST_PUTS_CREATED] += created
        if 8 * (st[L.ST_SLOT_PAGES] - st[L.ST_LEASED_PAGES]) < st[L.ST_SLOT_PAGES]:
            st[L.ST_UNLEASED_HINT] = i + 1  # almost all leased: the next victim, known
        if ns:
            e, nsw = ns * _NS_WORDS, self._nsw
            nsw[e + _NS_BLOCKS] += 1
            nsw[e + _NS_REFS] += refs
            nsw[e + _NS_RESIDENT_BYTES] += length
            nsw[e + _NS_LOGICAL_BYTES] += length * refs
            nsw[e + _NS_PAGES] += npages
            nsw[e + _NS_PUTS_CREATED] += created
        if ev is not None:
            ev.commit()

    def _commit(self, h: PutHandle) -> bool:
        if h.resv < 0:  # a dedup hit: its reference was taken when the put began
            with self._locked():
                if h.ref_entry >= 0:
                    self._unreserve(h.ref_entry)
                self._count_dedup_hit(h.ns)
            return False
        with self._locked():
            i, s = self._find(h.raw, h.fp, h.ns)
            if s is not None:
                first, npages = self._unreserve(h.resv)
                self._free_pages(first, npages)
                if h.record:  # a promotion: the block stored meanwhile has its references
                    return False
                return self._add_ref(i, s, h.address, h.length)
            if h.new_ok is not None and not h.new_ok():
                first, npages = self._unreserve(h.resv)
                self._free_pages(first, npages)
                raise Busy(f"block {h.address} is moving between the disk and the slab; retry")
            if h.ns and self._nsw[h.ns * _NS_WORDS + _NS_QUOTA]:
                # Its pages were charged to the quota when reserved: only a quota lowered
                # meanwhile (a reload) finds the namespace over it now.
                try:
                    self._room(0, h.ns, h.length)
                except InsufficientStorage:  # the quota was lowered below the block
                    first, npages = self._unreserve(h.resv)
                    self._free_pages(first, npages)
                    raise
                except Busy:
                    pass  # its other uploads hold the rest: its next puts wait for them
                i = self._find(h.raw, h.fp, h.ns)[0]
            # Publish the slot before giving up the reservation: a crash in between leaves
            # both claiming the pages, and repair lets the published slot win.
            self._publish(i, h.raw, h.fp, h.length, h.first, h.npages, h.ns, h.checksum, h.engine,
                          h.record or h.joined, h.refs)  # fmt: skip
            self._unreserve(h.resv)
            return True

    def _abort(self, h: PutHandle) -> None:
        if h.resv < 0:
            self._take_back_ref(h.raw, h.fp, h.ns, h.block_id, h.ref_entry)
            return
        with self._locked():
            first, npages = self._unreserve(h.resv)
            self._free_pages(first, npages)

    def _take_back_ref(self, raw: bytes, fp: int, ns: int, block_id: int, entry: int = -1) -> None:
        """Undo a dedup hit whose body broke off: the put did not happen (``entry``: its
        reservation entry, given back too).

        The reference goes only if the same block (by id) is still resident: one evicted
        meanwhile took every reference with it, and a block stored anew under the address
        is not the one this put referenced.
        """
        with self._locked():
            if entry >= 0:
                self._unreserve(entry)
            i, s = self._find(raw, fp, ns)
            self._undo_dedup(i, s, ns, block_id)

    def _undo_dedup(self, i: int, s: L.SlotFields | None, ns: int, block_id: int) -> None:
        """Take a dedup hit that did not end back: its reference on slot ``i`` (fields
        ``s``) if that holds block ``block_id`` (under the lock). It was not counted yet
        (a hit counts once its put ends: a counter that went back read as a reset)."""
        if s is not None and s[F_BLOCK_ID] == block_id:
            self._drop_ref(i, s)  # the last one if every other was deleted meanwhile

    # ------------------------------------------------------------------ get / exists / delete

    def _torn(self, lookup: Callable[..., _T], *args: object) -> _T:
        """A lookup a writer got in the way of runs again under the lock."""
        with self._locked(write=False):
            return lookup(*args)

    def _touch(self, i: int) -> None:
        # The CLOCK reference count, set without the lock: at worst a block that moved into
        # this slot meanwhile gets a second chance it did not earn.
        self._mm[self._slot_off(i) + L.SLOT_REF_OFFSET] = L.REF_TOUCHED

    def _count_bad_checksum(self, ns: int = 0) -> None:
        self._count_read(0, 1, ns)
        with self._locked():
            self._state[L.ST_CHECKSUM_FAILURES] += 1

    def count_get(self, ns: int = 0, hit: bool = True) -> None:
        """Count a GET the slab missed (read with ``miss=False``) once the disk tier has
        answered it: a hit if it served the block (the dashboards' hit ratio read 0% while
        every GET was answered 200), else a miss. Counted once, never taken back (a
        counter that goes back is a reset to Prometheus)."""
        self._count_read(1 if hit else 0, 0 if hit else 1, ns)

    def _count_read(self, hit: int, miss: int, ns: int = 0) -> None:
        """Count get hits and misses: a named namespace's in its entry (no lock: a
        concurrent reader may lose one), the default namespace's in this process's own
        entry (no lock, one writer). Each read is counted in one place, so the default
        namespace's counts are its own, not the slab's less the named ones' (two words
        written apart: a scrape between them saw the default's count go back)."""
        # One word each for a plain hit or miss (an aborted read moves both): every
        # read-modify-write of slab memory is a cache line a busy worker may not hold.
        if ns:
            e = ns * _NS_WORDS
            if hit:
                self._nsw[e + _NS_GET_HITS] += hit
            if miss:
                self._nsw[e + _NS_GET_MISSES] += miss
            return
        me = self._me if self._me != -1 else self._claim_proc_entry()
        if me < 0:
            with self._locked():
                self._state[L.ST_GET_HITS] += hit
                self._state[L.ST_GET_MISSES] += miss
            return
        procs = self._procs
        with self._tlock:  # threads sharing this handle share its entry
            if hit:
                procs[me + 1] += hit
            if miss:
                procs[me + 2] += miss

    def _claim_proc_entry(self) -> int:
        """Take a free PROCS entry (folding a dead process's counts into the totals)."""
        procs = self._procs
        with self._locked():
            for e in range(0, L.NPROCS * L.PROC_WORDS, L.PROC_WORDS):
                pid = procs[e]
                if pid and pid_alive(pid):  # taken (by another handle of ours too)
                    continue
                self._fold_proc_entry(e)
                procs[e] = self._pid
                self._me = e
                return e
        self._me = -2  # more than NPROCS handles: this one counts under the lock
        return -2

    def _release_proc_entry(self) -> None:
        if self._me < 0:  # -1: never claimed, -2: none was free
            return
        with self._locked():
            self._fold_proc_entry(self._me)
            self._procs[self._me] = 0
        self._me = -1

    def _fold_proc_entry(self, e: int) -> None:
        """Add PROCS entry ``e``'s read counts to the totals and zero them (under the lock)."""
        procs, st = self._procs, self._state
        st[L.ST_GET_HITS] += procs[e + 1]
        st[L.ST_GET_MISSES] += procs[e + 2]
        procs[e + 1] = procs[e + 2] = 0

    def delete(self, address: str, ns: int = 0) -> bool:
        """Release one reference; free the block when the last goes. False if absent."""
        raw, fp = self._key(address, ns)
        st = self._state
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is None:
                return False
            st[L.ST_DELETES] += 1
            if ns:
                self._nsw[ns * _NS_WORDS + L.NS_DELETES] += 1
            self._drop_ref(i, s)
            return True

    # ------------------------------------------------------------------ the disk tier

    def mark_spilled(self, address: str, ns: int, block_id: int, record: int) -> int:
        """The disk tier holds block ``block_id`` (resident under ``address``) as its record
        ``record``: say so in its slot, so that its eviction is a move between tiers, not
        a removal (:mod:`eg_kv.disk`). Returns the block's references now (0: it is not
        resident any more)."""
        raw, fp = self._key(address, ns)
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is None or s[F_BLOCK_ID] != block_id:
                return 0
            off = self._slot_off(i) + L.SLOT_META_OFFSET
            _RECORD.pack_into(self._mm, off + L.META_DISK_OFFSET, record)
            self._mm[off + L.META_FLAGS_OFFSET] |= _SPILLED
            self._state[L.ST_SPILLS] += 1  # an eviction may look for spilled victims again
            return int(s[F_REFS])

    def spilled_marks(self) -> list[tuple[int, str, int, int]]:
        """The resident blocks whose slots say the disk tier holds a copy, as
        ``(ns, address, length, record)``: what the keeper checks against its index once
        its scan is done (a data file made anew holds none of them). Read without the lock
        (a flag column in C, then each marked slot): :meth:`disk_dropped` decides under it.
        """
        step, first = L.SLOT_SIZE, self._slots_off + _META_FLAGS
        flags = self._mm[first : first + self._nslots * step : step].translate(_SPILLED_BIT)
        out = []
        i = flags.find(1)
        while i >= 0:
            s = self._read_slot(i)
            if s[F_STATE] == L.SLOT_READY:
                off = self._slot_off(i)
                record = _RECORD.unpack_from(self._mm, off + L.SLOT_META_OFFSET
                                             + L.META_DISK_OFFSET)[0]  # fmt: skip
                address = self._slot_address(i, s[L.F_ALEN]).decode("ascii", "replace")
                out.append((int(s[F_NS]), address, int(s[F_LENGTH]), record))
            i = flags.find(1, i + 1)
        return out

    def disk_dropped(
        self, address: str, ns: int, length: int, reason: int = R_DISK,
        engine: EngineName = NO_ENGINE,
    ) -> bool:  # fmt: skip
        """The disk tier dropped its copy of ``address``: a resident block loses its mark
        (its eviction is a removal again); otherwise the block has left the last tier,
        and the event log says so (``reason``: ``disk``, or ``delete`` for the last
        reference of a block only the disk held). Returns whether that was logged."""
        raw, fp = self._key(address, ns)
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is not None:
                self._mm[self._slot_off(i) + _META_FLAGS] &= ~_SPILLED & 0xFF
                return False
            ev = self._events
            if ev is None:
                return False
            ev.begin(REMOVED, reason, ns, raw, 0, length, engine)
            ev.commit()
            return True

    def _drop_ref(self, i: int, s: L.SlotFields) -> None:
        """Release one reference of slot ``i`` (fields ``s``); the last frees the block."""
        if s[F_REFS] <= 1:
            self._drop_block(i, s)
            return
        fields = list(s)
        fields[F_REFS] -= 1
        L.SLOT.pack_into(self._mm, self._slot_off(i), *fields)
        self._state[L.ST_TOTAL_REFS] -= 1
        self._state[L.ST_LOGICAL_BYTES] -= s[F_LENGTH]
        e = s[F_NS] * _NS_WORDS
        if e:
            self._nsw[e + _NS_REFS] -= 1
            self._nsw[e + _NS_LOGICAL_BYTES] -= s[F_LENGTH]


def conflict_message(address: str, resident: int, wanted: int) -> str:
    return (
        f"block {address} is resident with {resident} bytes, not {wanted}: "
        "delete it first or use another address"
    )


class PutHandle:
    """A put in flight: ``write`` chunks in order, then ``commit`` or ``abort``.

    ``abort`` after ``commit`` does nothing, so ``finally: handle.abort()`` is safe.
    """

    __slots__ = ("_hash", "_run", "_runs", "_slab", "address", "block_id", "checksum",
                 "done", "engine", "expected", "first", "fp", "joined", "length", "new_ok",
                 "npages", "ns", "pos", "raw", "record", "ref_entry", "refs",
                 "resv")  # fmt: skip

    def __init__(
        self, slab: Slab, address: str, raw: bytes, fp: int, length: int, resv: int,
        first: int, npages: int, block_id: int = 0, ns: int = 0, expected: int | None = None,
        engine: EngineName = NO_ENGINE,
    ) -> None:  # fmt: skip
        self._slab, self.address, self.raw, self.fp = slab, address, raw, fp
        self.length, self.resv, self.first, self.npages = length, resv, first, npages
        self.block_id = block_id  # of the resident block, for a dedup hit (resv < 0)
        self.ns = ns
        self.pos = self._run = 0
        self.done = False
        self._runs = None if resv < 0 else _runs(slab, first, npages, length)
        # The bytes' checksum, computed as they are written (while they are in cache);
        # ``expected``: the one their sender gave, checked at commit.
        self._hash = None if resv < 0 else RunningChecksum()
        self.expected = expected
        self.checksum = 0
        self.engine = engine
        #: The disk tier's record the bytes come from (a promotion; 0: a put's own bytes).
        self.record = 0
        #: The disk's copy of the same bytes an adopting PUT joins (its record; 0: none):
        #: published with it, the slot says the disk holds the block, so that its eviction
        #: is a move (unmarked, it was logged a removal until the keeper's next spill of
        #: it marked it). Unlike a promotion, it brings the PUT's reference to a block
        #: stored meanwhile.
        self.joined = 0
        #: Asked under the lock before the block is created (Slab.put's ``new_ok``).
        self.new_ok: Callable[[], bool] | None = None
        #: The references the block is published with: a promotion's are its disk copy's,
        #: all at once (published with one, then given the rest, a DELETE on another
        #: worker in between took the only one: the block and its copy went, with the
        #: others' references).
        self.refs = 1
        #: A dedup hit's reservation entry (its reference, noted under this pid), or -1.
        self.ref_entry = -1

    def write(self, chunk: Bytes) -> None:
        """Copy ``chunk`` into the block's pages at the current position.

        Raises:
            BadRequest: more bytes than the announced length.
        """
        n = len(chunk)
        if self.pos + n > self.length:
            raise BadRequest(f"body is longer than its announced length {self.length}")
        src = memoryview(chunk).cast("B")
        while src:
            room = self.room(len(src))
            if room is None:  # a dedup hit: its bytes are counted and dropped
                self.pos += len(src)
                return
            k = len(room)
            room[:] = src[:k]
            self.wrote(room, k)
            src = src[k:]

    def room(self, most: int) -> memoryview | None:
        """A writable view of the block's pages at the current position: at most ``most``
        bytes, within one contiguous run, not past the block's end. A socket reads the next
        bytes of the body straight into it; then call :meth:`wrote`. None for a dedup hit
        (its bytes are dropped) or once every byte was written."""
        if self._runs is None or self.pos >= self.length:
            return None
        runs, r, cur = self._runs, self._run, self.pos
        start, off, size = runs[r]
        while cur >= start + size:  # this run is full: move on
            r += 1
            start, off, size = runs[r]
        self._run = r
        at = off + cur - start
        return self._slab._mv[at : at + min(most, start + size - cur)]

    def wrote(self, view: memoryview | None, n: int) -> None:
        """The first ``n`` bytes of ``view`` (from :meth:`room`) were filled: hash them
        (while they are in cache) and move on. For a dedup hit (no view), count them."""
        if self._hash is not None and view is not None:
            self._hash.update(view[:n])
        self.pos += n

    def page_views(self, align: int) -> list[memoryview] | None:
        """Writable views of the reserved pages in order, for a read straight into them
        (the disk tier's promotion: O_DIRECT ``preadv``): starts and sizes multiples of
        ``align``, the last going on past the block's end within its own page. None for a
        dedup hit, or where the slab's pages are not multiples of ``align``. Fill them
        all, then call :meth:`filled`."""
        slab = self._slab
        if self._runs is None or slab.page_size % align or slab.geometry.data_off % align:
            return None
        mv = slab._mv
        runs = [(off, size) for _, off, size in self._runs]
        off, size = runs[-1]
        runs[-1] = (off, -(-size // align) * align)
        return [mv[off : off + size] for off, size in runs]

    def filled(self) -> int:
        """The pages were filled through :meth:`page_views`: hash what they hold, and
        return that checksum (``commit`` checks it against the expected one, as for a
        PUT's body). Any one thread may call it (the disk tier's reading thread does):
        it reads only the handle's own reserved pages."""
        if self._runs is not None:
            mv = self._slab._mv
            for _, off, size in self._runs:
                self._hash.update(mv[off : off + size])  # type: ignore[union-attr]
        self.pos = self.length
        return self._hash.intdigest() if self._hash is not None else 0

    @property
    def dedup(self) -> bool:
        """Whether this put is a dedup hit (counted when it began; its bytes are dropped)."""
        return self.resv < 0

    def commit(self) -> bool:
        """Publish the block. True if this put created it, False if it was a dedup hit
        (a promotion's, ``record`` set, adds no reference to a block stored meanwhile).

        Raises:
            BadRequest: fewer bytes were written than announced (nothing is published;
                a dedup hit's reference is taken back).
            Conflict: a block of another length was published meanwhile.
        """
        self.seal()
        self.done = True
        return self._slab._commit(self)

    def seal(self) -> int:
        """Check that every byte arrived and that they match the checksum their sender
        gave; returns their checksum (0 for a dedup hit). :meth:`commit` does it itself:
        call it first to know the checksum before the block is published (the disk
        tier's ADOPT).

        Raises:
            SlabError: the put is finished. BadRequest: fewer bytes were written than
            announced. BodyMismatch: not the bytes their sender's checksum names. (The
            put is aborted on either.)
        """
        if self.done:
            raise SlabError("put already finished")
        if self.pos != self.length:
            self.abort()
            raise BadRequest(f"body cut short: {self.pos} of {self.length} bytes arrived")
        if self._hash is not None:
            self.checksum = self._hash.intdigest()
            if self.expected is not None and self.expected != self.checksum:
                self.abort()
                self._slab.refuse_body(self.expected, self.checksum)
        return self.checksum

    def abort(self) -> None:
        """Give the reserved pages (or a dedup hit's reference) back. Idempotent."""
        if not self.done:
            self.done = True
            self._slab._abort(self)


def _runs(slab: Slab, first: int, npages: int, length: int) -> list[tuple[int, int, int]]:
    """The block's bytes as contiguous runs: (offset in block, offset in slab, size)."""
    runs: list[list[int]] = []
    nxt, ps, base = slab._next, slab.page_size, slab.geometry.data_off
    p, pos = first, 0
    for _ in range(npages):
        size = min(ps, length - pos)
        if runs and runs[-1][1] + runs[-1][2] == base + p * ps:
            runs[-1][2] += size
        else:
            runs.append([pos, base + p * ps, size])
        pos += size
        p = nxt[p]
    return [(pos, off, size) for pos, off, size in runs]
