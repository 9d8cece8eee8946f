"""Checking and repairing a slab: the walks over every slot, reservation and page.

:meth:`SlabChecks.check` walks a slab at rest in one hold of the lock,
:meth:`SlabChecks.check_live` a live one in slices (:class:`_SlicedCheck`), and
:meth:`SlabChecks.repair` rebuilds every invariant from the slot table (also run on entry
into the lock after a holder died inside it). :meth:`SlabChecks.release_process` gives
back what one dead process left without a full walk.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from array import array
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..address import ADDRESS_MAX, fingerprint
from ..engine import NO_ENGINE, EngineName
from ..errors import SlabError
from ..procs import pid_alive
from . import layout as L
from .layout import F_ALEN, F_FIRST, F_LENGTH, F_NPAGES, F_NS, F_REFS, F_STATE
from .lock import OWNER_LOCK_WAIT_S, no_job_stops
from .namespaces import SlabNamespaces

_NS_WORDS = L.NS_WORDS
#: Longest a sliced walk (check_live, release_process) holds the lock at once, checked
#: every few entries: the bound on stalling other requests is ~20 ms, and 5 ms keeps the
#: hold under it on a busy machine (a slice is ~1,000-3,000 slots of 2 GiB's million).
CHECK_SLICE_S = 0.005
#: A repair's progress callback hears of its walk every this many slots (~0.1-1 s).
WALK_PROGRESS_SLOTS = 1 << 16


@dataclasses.dataclass
class Leftovers:
    """What :meth:`SlabChecks.release_process` gave back for one dead process."""

    pid: int
    reservations: int = 0  #: uploads it had in flight
    pages: int = 0  #: pages those held
    hits: int = 0  #: its lock-free GET hits, folded into the totals
    misses: int = 0  #: and misses
    full_repair: list[str] | None = None  #: what the full repair found, if one ran


@dataclasses.dataclass
class CheckReport:
    """What :meth:`SlabChecks.check_live` found."""

    problems: list[str]  #: invariants that do not hold (empty: clean as far as checked)
    unchecked: list[str]  #: what could not be concluded because writers ran meanwhile
    slices: int = 0  #: holds of the lock
    longest_hold_s: float = 0.0  #: the longest hold, wall clock
    longest_hold_cpu_s: float = 0.0  #: the longest hold's CPU time (without preemption)
    #: what is not damage on a live slab (a dead writer's reservation the supervisor has
    #: not released yet)
    notes: list[str] = dataclasses.field(default_factory=list)


class SlabChecks(SlabNamespaces):
    """The check and repair part of :class:`eg_kv.slab.store.Slab`."""

    if TYPE_CHECKING:
        # Defined by Slab (eg_kv.slab.store): the pages, slots and reservations the
        # repair frees and rewrites.
        def _npages(self, length: int) -> int: ...
        def _free_pages(self, first: int, n: int) -> None: ...
        def _write_slot(
            self, i: int, clock_ref: int, raw: bytes, refs: int, length: int, first: int,
            npages: int, block_id: int, fp: int, ns: int, meta: tuple[object, ...] = (),
        ) -> None: ...  # fmt: skip
        def _resv_off(self, r: int) -> int: ...
        def _resv_in_use(self) -> list[int]: ...
        def _unreserve(self, r: int) -> tuple[int, int]: ...
        def _release_entry(self, r: int) -> int: ...
        def _fold_proc_entry(self, e: int) -> None: ...

    def check(self) -> list[str]:
        """Walk the whole slab in one hold of the lock; return every invariant that does not
        hold (empty = clean).

        Writers wait for the whole walk (0.3 s at 2 GiB of 4 KiB pages): this is for a slab
        at rest; a live one wants :meth:`check_live`.
        """
        with self._locked(write=False):
            return self._walk(fix=False)

    def check_live(
        self, slice_s: float = CHECK_SLICE_S, timeout: float | None = None
    ) -> CheckReport:
        """Check the slab in slices of at most about ``slice_s`` each under the lock.

        What each slice sees is consistent, so what concerns one slot or one reservation
        (its fields, fingerprint, tag, home, page chain) is always checked. What spans
        slices (a page in two chains, an address stored twice, the free list, the global
        counters) is concluded only if no writer changed the slab between the first
        slice and the last (``ST_SEQ`` did not move); otherwise it is listed in
        ``unchecked``, never reported as a problem.

        Returns:
            A :class:`CheckReport`.

        Raises:
            LockTimeout: a slice waited more than ``timeout`` for the lock.
        """
        return _SlicedCheck(self, slice_s).run(timeout)

    def repair(
        self,
        timeout: float | None = OWNER_LOCK_WAIT_S,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> list[str]:
        """Restore every invariant; return what was wrong before (empty = was clean).

        The slot table is the source of truth: damaged slots are dropped (counted as
        evictions), reservations of dead writers are released, the free list, the table's
        probe order and the derived counters are rebuilt.

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds (None: no bound;
                the default bounds a supervisor's start-up behind a stopped holder).

        ``progress(step, slots done, slots)`` hears of each walk every
        :data:`WALK_PROGRESS_SLOTS` slots (seconds at a slab of 100 GiB).
        """
        self.repaired_on_entry = None
        with no_job_stops(), self._locked(timeout):
            if self.repaired_on_entry is not None:  # the holder had died: done on entry
                return self.repaired_on_entry[1]
            return self._repair_locked(progress=progress)

    def release_process(self, pid: int, timeout: float | None = None) -> Leftovers:
        """Give back what the dead process ``pid`` left in the slab, without a full walk.

        Its reservations (uploads it had in flight) are freed and its PROCS entry is
        folded into the totals. If it died inside the critical section, taking the lock
        runs the full repair first (``full_repair`` in the result). Each hold of the lock
        frees reservations for at most about :data:`CHECK_SLICE_S`.

        Raises:
            SlabError: ``pid`` still runs (its reservations are live uploads).
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        if pid <= 0 or pid == self._pid or pid_alive(pid):
            raise SlabError(f"process {pid} still runs: only a dead process's leftovers go")
        out = Leftovers(pid)
        r = 0
        while True:
            self.repaired_on_entry = None
            with no_job_stops(), self._locked(timeout):
                if self.repaired_on_entry is not None:
                    out.full_repair = self.repaired_on_entry[1]
                end = time.perf_counter() + CHECK_SLICE_S
                while (r := self._next_resv_of(pid, r)) >= 0:
                    npages = self._release_entry(r)
                    out.reservations += 1
                    out.pages += npages
                    if time.perf_counter() > end:
                        break  # let the others in; go on in another hold
                else:
                    procs = self._procs
                    for e in range(0, L.NPROCS * L.PROC_WORDS, L.PROC_WORDS):
                        if procs[e] == pid:
                            out.hits, out.misses = procs[e + 1], procs[e + 2]
                            self._fold_proc_entry(e)
                            procs[e] = 0
                    return out

    def _release_dead_dedups(self) -> None:
        """Take back the references of dedup hits whose writer died before its put ended
        (under the lock, once the table is sound): a process killed outside the lock,
        whose leftovers nobody released (its supervisor died too)."""
        mm = self._mm
        for r in self._resv_in_use():
            pid, first, npages, _ns, _id = L.RESV.unpack_from(mm, self._resv_off(r))
            if first == L.RESV_DEDUP and not npages and pid != self._pid and not pid_alive(pid):
                self._release_entry(r)

    def _next_resv_of(self, pid: int, r: int) -> int:
        """The first reservation at or after ``r`` held by ``pid``, or -1.

        A search of the table's bytes (C speed) for the pid, the first field of an entry:
        a hit that is not at an entry's start is part of another field and is skipped.
        """
        g, mm, size = self.geometry, self._mm, L.RESV_SIZE
        needle = L.RESV.pack(pid, 0, 0, 0, 0)[:8]
        at, end = g.resv_off + r * size, g.resv_off + g.nresv * size
        while (at := mm.find(needle, at, end)) >= 0:
            k, into = divmod(at - g.resv_off, size)
            if into == 0:
                return k
            at += 1
        return -1

    def _repair_locked(
        self, count: bool = False, progress: Callable[[str, int, int], None] | None = None
    ) -> list[str]:
        """Walk; rebuild if anything was wrong. ``count``: count it in ``repairs`` even if
        nothing was (a holder died inside the lock: the full repair ran either way)."""
        self._reconcile_events()  # the dead holder's pending event, against the slots as left
        problems = self._walk(fix=False, progress=progress)
        if problems:
            self._walk(fix=True, progress=progress)
        self._release_dead_dedups()
        if problems or count:
            self._state[L.ST_REPAIRS] += 1
        return problems

    def _chain(self, first: int, npages: int) -> list[int] | str:
        """The pages of the chain from ``first``, or what is wrong with it."""
        nxt, n = self._next, self.geometry.npages
        if npages > n:
            return f"{npages} pages, more than the slab has"
        p, pages = first, []
        for k in range(npages):
            if not 0 <= p < n:
                return f"page {k} of its chain is {p}, out of range"
            pages.append(p)
            p = nxt[p]
        if len(set(pages)) != len(pages):
            return "its chain runs into itself"
        return pages

    def _slot_fault(self, i: int, s: L.SlotFields, raw: bytes, home: bool) -> str | None:
        """What is wrong with slot ``i`` (fields ``s``, address ``raw``) on its own, if
        anything. ``home``: also check that a lookup of its address finds it."""
        state, _clock_ref, alen, refs, length, first, npages, block_id, fp, ns = s[:-2]
        what = f"slot {i} ({raw[:40].decode('ascii', 'replace')})"
        if state != L.SLOT_READY or not 1 <= alen <= ADDRESS_MAX:
            return f"{what}: bad state {state} or address length {alen}"
        if not 0 <= ns < L.NS_COUNT or not self._nsw[ns * _NS_WORDS + L.NS_USED]:
            return f"{what}: namespace {ns} is not in the namespace table"
        if L.ns_fingerprint(fingerprint(raw), ns) != fp:
            return f"{what}: fingerprint does not match the address and namespace"
        if length < 1 or npages != self._npages(length) or refs < 1:
            return f"{what}: {npages} pages / {refs} refs for {length} bytes"
        if not 0 <= first < self.geometry.npages:
            return f"{what}: first page {first} out of range"
        if self._tag[first] != block_id:
            return f"{what}: tag {self._tag[first]} is not its block id {block_id}"
        if home and self._find(raw, fp, ns)[0] != i:
            return f"{what}: not reachable from its home slot"
        return None

    def _resv_ns_fault(self, ns: int) -> str | None:
        """What is wrong with a reservation charged to namespace ``ns``, if anything."""
        if not 0 <= ns < L.NS_COUNT or not self._nsw[ns * _NS_WORDS + L.NS_USED]:
            return f"namespace {ns} is not in the namespace table"
        return None

    def _ns_counter_problems(self, ns_totals: Mapping[int, list[int]]) -> list[str]:
        """Namespace counters that differ from what the slots say (``ns_totals``)."""
        nsw, problems, zero = self._nsw, [], [0] * len(L.NS_DERIVED)
        for ns in range(1, L.NS_COUNT):  # the default namespace's are derived (never kept)
            e, t = ns * _NS_WORDS, ns_totals.get(ns, zero)
            for k, (key, idx) in enumerate(L.NS_DERIVED.items()):
                if nsw[e + idx] != t[k]:
                    problems.append(
                        f"namespace {ns} ({self._ns_name(ns) or 'default'}): counter {key} "
                        f"is {nsw[e + idx]} but the slots say {t[k]}"
                    )
        return problems

    def _leased_pages_problems(self, leased: dict[int, int]) -> list[str]:
        """Where the leased-page counters (the lease caps') differ from the pages of the
        blocks whose slots count a lease: a process killed inside a lease section between
        the two (a repair then rebuilds the table without leases)."""
        problems = []
        total = self._state[L.ST_LEASED_PAGES]
        if total != sum(leased.values()):
            problems.append(
                f"counter leased_pages is {total} but the slots say {sum(leased.values())}"
            )
        column = self._nsw[L.NS_LEASED_PAGES :: _NS_WORDS]
        for ns, pages in enumerate(column):
            if pages != leased.get(ns, 0):
                problems.append(
                    f"namespace {ns}: counter leased_pages is {pages} but the slots say "
                    f"{leased.get(ns, 0)}"
                )
        return problems

    def _walk(
        self, fix: bool, progress: Callable[[str, int, int], None] | None = None
    ) -> list[str]:
        g, st, nxt, tag, mm = self.geometry, self._state, self._next, self._tag, self._mm
        problems: list[str] = []
        owner = bytearray(g.npages)  # 0 free, 1 slot, 2 reservation
        live: list[tuple[int, bytes, int, int, int, int, int, int, int, tuple[object, ...]]] = []
        seen: set[tuple[int, bytes]] = set()
        totals = dict.fromkeys(L.DERIVED_COUNTERS, 0)
        ns_totals: dict[int, list[int]] = {}  # namespace -> its NS_DERIVED values
        ns_zero = [0] * len(L.NS_DERIVED)
        dropped: list[tuple[int, bytes, int, int]] = []  # for the event log (fix only)
        leases = self._slot_leases
        leased: dict[int, int] = {}  # namespace -> pages of its blocks under a lease

        def claim(first: int, npages: int, who: int, what: str) -> bool:
            pages = self._chain(first, npages)
            if isinstance(pages, str):
                problems.append(f"{what}: {pages}")
                return False
            taken = next((p for p in pages if owner[p]), None)
            if taken is not None:  # a damaged chain owns nothing
                problems.append(f"{what}: page {taken} is in two chains")
                return False
            for p in pages:
                owner[p] = who
            return True

        step = "repairing slots" if fix else "checking slots"
        for i in range(g.nslots):
            if progress is not None and not i % WALK_PROGRESS_SLOTS:
                progress(step, i, g.nslots)
            s = self._read_slot(i)
            if s[F_STATE] == L.SLOT_EMPTY:
                continue
            _state, clock_ref, alen, refs, length, first, npages, block_id, fp, ns = s[:-2]
            raw = self._slot_address(i, min(alen, ADDRESS_MAX))
            what = f"slot {i} ({raw[:40].decode('ascii', 'replace')})"
            bad = self._slot_fault(i, s, raw, home=not fix)
            if bad is None and (ns, raw) in seen:
                bad = f"{what}: address stored twice"
            if bad is None and claim(first, npages, 1, what):
                seen.add((ns, raw))
                meta = L.SLOT_META.unpack_from(mm, self._slot_off(i) + L.SLOT_META_OFFSET)
                live.append((clock_ref, raw, refs, length, first, npages, block_id, fp, ns, meta))
                if leases[i]:
                    leased[ns] = leased.get(ns, 0) + npages
                t = ns_totals.setdefault(ns, ns_zero.copy())
                for k, val in enumerate((1, refs, length, length * refs, npages)):
                    t[k] += val
                for key, val in (
                    ("unique_blocks", 1), ("total_refs", refs), ("resident_bytes", length),
                    ("logical_bytes", length * refs), ("slot_pages", npages),
                ):  # fmt: skip
                    totals[key] += val
                continue
            if bad is not None:
                problems.append(bad)
            if fix and (ns, raw) not in seen:  # a dropped block counts as evicted; a copy not
                dropped.append((ns, bytes(raw), block_id, length))
                st[L.ST_EVICTIONS] += 1
                st[L.ST_EVICTED_BYTES] += length if 0 < length <= g.max_block_size else 0

        for r in self._resv_in_use():
            pid, first, npages, rns, length = L.RESV.unpack_from(mm, self._resv_off(r))
            if first == L.RESV_DEDUP and not npages:
                continue  # a dedup hit's reference, no pages: the repair takes a dead one's back
            what = f"reservation {r} (pid {pid})"
            bad_ns = self._resv_ns_fault(rns)
            if pid != self._pid and not pid_alive(pid):
                problems.append(f"{what}: its writer is dead")
                ok = False
            elif bad_ns:
                problems.append(f"{what}: {bad_ns}")
                ok = False
            else:
                ok = claim(first, npages, 2, what)
            if ok:
                totals["reserved_pages"] += npages
                ns_totals.setdefault(rns, ns_zero.copy())[-1] += npages
            elif fix:
                L.RESV.pack_into(mm, self._resv_off(r), 0, 0, 0, 0, 0)

        # The free list must hold exactly the pages no chain owns.
        p, nfree, on_free = st[L.ST_FREE_HEAD], 0, bytearray(g.npages)
        while p != L.NO_PAGE and not fix:
            if not 0 <= p < g.npages or on_free[p]:
                problems.append(f"free list: bad or repeated page {p}")
                break
            if owner[p]:
                problems.append(f"free list: page {p} is also in a chain")
            on_free[p] = 1
            nfree += 1
            p = nxt[p]
        owned = sum(1 for o in owner if o)
        if not fix:
            if nfree != st[L.ST_FREE_COUNT]:
                problems.append(f"free count {st[L.ST_FREE_COUNT]} but {nfree} on the list")
            if nfree + owned != g.npages:
                problems.append(f"free pages {nfree} + used pages {owned} != all pages {g.npages}")
            for key, idx in L.DERIVED_COUNTERS.items():
                if st[idx] != totals[key]:
                    problems.append(f"counter {key} is {st[idx]} but the slots say {totals[key]}")
            problems += self._ns_counter_problems(ns_totals)
            problems += self._leased_pages_problems(leased)
            holder = st[L.ST_LOCK_HOLDER]
            if holder and holder != self._pid:
                problems.append(f"lock holder {holder} recorded but not holding")
            return problems

        # fix: rebuild the table in probe order, then the free list and the counters.
        mv = self._mv
        mv[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE] = bytes(g.nslots * L.SLOT_SIZE)
        for clock_ref, raw, refs, length, first, npages, block_id, fp, ns, meta in live:
            i = self._find(raw, fp, ns)[0]
            self._write_slot(i, clock_ref, raw, refs, length, first, npages, block_id, fp, ns, meta)
        for p in range(g.npages):
            if owner[p]:
                tag[p] = 0
        for _clock_ref, _raw, _refs, _length, first, _npages, block_id, _fp, _ns, _meta in live:
            tag[first] = block_id
        nsw = self._nsw
        for ns in range(1, L.NS_COUNT):
            e, t = ns * _NS_WORDS, ns_totals.get(ns, ns_zero)
            for k, idx in enumerate(L.NS_DERIVED.values()):
                nsw[e + idx] = t[k]
        self._rebuild_free_list(owner)
        for key, idx in L.DERIVED_COUNTERS.items():
            st[idx] = totals[key]
        # The table was rebuilt without leases: no page is leased now, and no holder
        # holds one (a holder's old record would end another's new lease on the block).
        st[L.ST_LEASED_PAGES] = 0
        nsw[L.NS_LEASED_PAGES :: _NS_WORDS] = array("q", bytes(8 * L.NS_COUNT))
        if self._holds is not None:
            self._holds[:] = array("q", bytes(8 * len(self._holds)))
        st[L.ST_CLOCK_HAND] = st[L.ST_CLOCK_HAND] & self._mask
        self._log_repair_drops(dropped, seen)
        return problems

    def _slot_address(self, i: int, alen: int) -> bytes:
        off = self._slot_off(i) + L.SLOT.size
        return self._mm[off : off + alen]

    def _slot_engine(self, i: int) -> EngineName:
        """Slot ``i``'s engine name (its META), for the removal its event names."""
        off = self._slot_off(i) + L.SLOT_META_OFFSET
        if not self._mm[off + L.META_HASH_LEN_OFFSET]:  # none: one byte read, no unpack
            return NO_ENGINE
        _, _, lora, size, _, hlen, h = L.SLOT_META.unpack_from(self._mm, off)
        return EngineName(h[: min(hlen, L.META_ENGINE_HASH_MAX)], b"", size, lora)


class _SlicedCheck:
    """One run of :meth:`SlabChecks.check_live`: the walk's state between holds of the lock.

    Each step (slots, reservations, free list, counters) takes a position and a
    deadline, works until the deadline, and returns where to go on. ``quiet`` stays true
    while ``ST_SEQ`` reads the same at every hold: no writer ran in between, so the
    slices together saw one state and what spans them may be concluded.
    """

    _START = -2  # the free list walk has not begun

    def __init__(self, slab: SlabChecks, slice_s: float) -> None:
        g = slab.geometry
        self.slab, self.slice_s = slab, slice_s
        self.report = CheckReport([], [])
        self.owner = bytearray(g.npages)  # 0 free, 1 slot, 2 reservation
        self.on_free = bytearray(g.npages)
        self.nfree = 0
        self.seen: set[tuple[int, bytes]] = set()
        self.totals = dict.fromkeys(L.DERIVED_COUNTERS, 0)
        self.ns_totals: dict[int, list[int]] = {}  # namespace -> its NS_DERIVED values
        self.spanning: list[str] = []  # problems that hold only if quiet
        self.seq: int | None = None
        self.quiet = True

    def run(self, timeout: float | None) -> CheckReport:
        g = self.slab.geometry
        pos = 0
        while pos < g.nslots:
            pos = self._hold(timeout, self._slots, pos)
        pos = 0
        while pos < g.nresv:
            pos = self._hold(timeout, self._reservations, pos)
        pos = self._START
        while pos != L.NO_PAGE:
            pos = self._hold(timeout, self._free_list, pos)
        self._hold(timeout, self._counters, 0)
        if self.quiet:
            self.report.problems += self.spanning
        else:
            self.report.unchecked.append(
                "page ownership, duplicate addresses, the free list and the counters: "
                "writers changed the slab during the walk (run the check again when it is "
                "quieter, or with the server stopped, to cover them)"
            )
        return self.report

    def _hold(self, timeout: float | None, step: Callable[[int, float], int], pos: int) -> int:
        slab, rep = self.slab, self.report
        # No garbage collection while the lock is held: the walk allocates (a tuple per
        # slot), and a full collection it set off in a process with a large heap ran
        # inside one hold, past the slice's deadline (21 and 25 ms CPU for 5 ms slices,
        # CI); it runs between holds instead.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with no_job_stops(), slab._locked(timeout, write=False):
                t0, c0 = time.perf_counter(), time.thread_time()
                seq = slab._state[L.ST_SEQ]
                self.quiet = self.quiet and self.seq in (None, seq)
                self.seq = seq
                pos = step(pos, t0 + self.slice_s)
                rep.longest_hold_s = max(rep.longest_hold_s, time.perf_counter() - t0)
                rep.longest_hold_cpu_s = max(rep.longest_hold_cpu_s, time.thread_time() - c0)
        finally:
            if collecting:
                gc.enable()
        rep.slices += 1
        # Step aside before the next hold: taken again at once, the lock went back to this
        # walk before a writer woken by its release could run, and writers waited for the
        # whole walk (seen in tests/test_slab_live_check.py, one run in three).
        time.sleep(self.slice_s / 2)
        return pos

    def _slots(self, i: int, deadline: float) -> int:
        slab, start, n = self.slab, i, self.slab.geometry.nslots
        while i < n:
            if i - start >= 16 and not i & 15 and time.perf_counter() > deadline:
                return i
            s = slab._read_slot(i)
            if s[F_STATE] != L.SLOT_EMPTY:
                self._slot(i, s)
            i += 1
        return i

    def _slot(self, i: int, s: L.SlotFields) -> None:
        slab = self.slab
        raw = slab._slot_address(i, min(s[F_ALEN], ADDRESS_MAX))
        what = f"slot {i} ({raw[:40].decode('ascii', 'replace')})"
        fault = slab._slot_fault(i, s, raw, home=True)
        pages = slab._chain(s[F_FIRST], s[F_NPAGES]) if fault is None else fault
        if isinstance(pages, str):
            self.report.problems.append(pages if fault else f"{what}: {pages}")
            return
        if (s[F_NS], raw) in self.seen:  # or a block moved by a delete between two slices
            self.spanning.append(f"{what}: address stored twice")
        self.seen.add((s[F_NS], raw))
        self._own(pages, 1, what)
        refs, length = s[F_REFS], s[F_LENGTH]
        for key, val in (
            ("unique_blocks", 1), ("total_refs", refs), ("resident_bytes", length),
            ("logical_bytes", length * refs), ("slot_pages", s[F_NPAGES]),
        ):  # fmt: skip
            self.totals[key] += val
        t = self.ns_totals.setdefault(s[F_NS], [0] * len(L.NS_DERIVED))
        for k, val in enumerate((1, refs, length, length * refs, s[F_NPAGES])):
            t[k] += val

    def _own(self, pages: list[int], who: int, what: str) -> None:
        owner = self.owner
        for p in pages:
            if owner[p]:
                self.spanning.append(f"{what}: page {p} is in two chains")
            owner[p] = who

    def _reservations(self, r: int, deadline: float) -> int:
        slab, start, n = self.slab, r, self.slab.geometry.nresv
        while r < n:
            if r - start >= 16 and not r & 15 and time.perf_counter() > deadline:
                return r
            pid, first, npages, rns, _length = L.RESV.unpack_from(slab._mm, slab._resv_off(r))
            if pid:
                what = f"reservation {r} (pid {pid})"
                pages = slab._chain(first, npages)
                bad_ns = slab._resv_ns_fault(rns)
                if isinstance(pages, str) or bad_ns:
                    self.report.problems.append(f"{what}: {bad_ns or pages}")
                else:
                    # On a live slab the supervisor releases it (release_process) soon
                    # after reaping its writer: not damage (check()/repair() call it so).
                    if pid != slab._pid and not pid_alive(pid):
                        self.report.notes.append(
                            f"{what}: writer dead, to be released by the supervisor"
                        )
                    self._own(pages, 2, what)
                    self.totals["reserved_pages"] += npages
                    self.ns_totals.setdefault(rns, [0] * len(L.NS_DERIVED))[-1] += npages
            r += 1
        return r

    def _free_list(self, p: int, deadline: float) -> int:
        if not self.quiet:  # the list changed since the chains were walked
            return L.NO_PAGE
        slab, n, k = self.slab, self.slab.geometry.npages, 0
        if p == self._START:
            p = slab._state[L.ST_FREE_HEAD]
        nxt, owner, on_free = slab._next, self.owner, self.on_free
        while p != L.NO_PAGE:
            if k >= 64 and not k & 63 and time.perf_counter() > deadline:
                return p
            if not 0 <= p < n or on_free[p]:
                self.report.problems.append(f"free list: bad or repeated page {p}")
                self.nfree = -1  # broken: its count means nothing
                return L.NO_PAGE
            if owner[p]:
                self.report.problems.append(f"free list: page {p} is also in a chain")
            on_free[p] = 1
            self.nfree += 1
            p = nxt[p]
            k += 1
        return L.NO_PAGE

    def _counters(self, _pos: int, _deadline: float) -> int:
        if not self.quiet or self.nfree < 0:
            return 0
        st, g, problems = self.slab._state, self.slab.geometry, self.report.problems
        owned = g.npages - self.owner.count(0)
        if self.nfree != st[L.ST_FREE_COUNT]:
            problems.append(f"free count {st[L.ST_FREE_COUNT]} but {self.nfree} on the list")
        if self.nfree + owned != g.npages:
            problems.append(f"free pages {self.nfree} + used pages {owned} != all pages {g.npages}")
        for key, idx in L.DERIVED_COUNTERS.items():
            if st[idx] != self.totals[key]:
                problems.append(f"counter {key} is {st[idx]} but the slots say {self.totals[key]}")
        problems += self.slab._ns_counter_problems(self.ns_totals)
        return 0
