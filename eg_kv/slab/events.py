"""The event log: an ordered, bounded record of the blocks stored in and removed from a slab.

Every change to the set of resident blocks (a put that creates a block, an eviction, a
``DELETE`` of the last reference, a namespace's quota eviction, a repair that drops a
damaged slot) appends one entry, under the slab lock, in the same critical section as the
change: the lock orders the entries, and sequence numbers (``seq``, from 1) count them
with no gap. Dedup hits and deletes that leave references change no block: no entry.

With a disk tier (:mod:`eg_kv.disk`) the log is of the blocks the server holds in either
tier: an eviction of a block the disk holds a copy of moves it, and is no entry; a block
leaving the last tier is a removal (``delete``, or ``disk``: the disk dropped the only
copy left); a promotion back into the slab is logged as stored (a reader that started
after the block went to disk learns of it then).

The log lives in its own segment, ``<slab name>.events`` (mode 0600, owned and checked
like the readers segment, created by the server's supervisor, removed with the slab)::

    0        64       128                                 128 + N × 384     + 4096 × 16
    ┌────────┬────────┬─────────────────────────────────────┬────────────────┐
    │ header │ words  │ entries: N × ENTRY (384 B), a ring  │ namespaces     │
    └────────┴────────┴─────────────────────────────────────┴────────────────┘
    header:  EVENTS_HEAD: magic, slab id, N (entries), epoch (8 random bytes as an int:
             a new log of the same slab has another, so a reader knows its seq is void),
             and when the log was created (Unix ms: the KV-events publisher's seq base)
    words:   W_HEAD: seq of the newest published entry (0: none yet);
             W_PENDING: seq of the entry being written inside the lock (0: none)
    entry:   ENTRY: seq, block id, block length, namespace id, kind, reason, address
             length, nseq, prev; then the address (ASCII, padded to 256); then ENGINE:
             the block's engine name (:mod:`eg_kv.engine`: LoRA id, block size, hash and
             parent lengths, a flags byte, hash, parent; zeros: none), so a removal names
             the block as its store did, for the KV-events publisher
             (:mod:`eg_kv.kvevents`). Flags: E_EXTRAS, the worker handed the publisher
             the store's token ids or LoRA name (:mod:`eg_kv.server.extras`).
             Entry ``seq`` lies at index ``(seq - 1) % N``.
    namespaces: per namespace id, two int64: NS_LAST, the seq of its newest entry (0:
             none), and NS_COUNT_WORD, its nseq.

Positions per namespace: a tenant's reader must learn nothing of other namespaces, not
even how many events they had (issue 31), so it counts in its namespace's own positions:
entry ``nseq`` is the namespace's n-th event, and ``prev`` links the namespace's entries
backwards. A reader at position ``p`` walks back from the namespace's newest entry to
``p + 1`` (:meth:`EventRing.read_ns`, at most :data:`HOPS_MAX` entries); the admin's
reader reads every entry by ``seq``, as before.

Crash safety (a process SIGKILLed inside the lock): an entry is written as *pending*
(W_PENDING) before the slot table changes and published (W_HEAD) after. Whoever next takes
the lock finds the dead holder and repairs the slab (:mod:`eg_kv.slab.check`); that
repair first reconciles the pending entry with the slot table (:meth:`SlabEventLog.
_reconcile_events`): a pending "stored" is published if its block (by address, namespace
and block id) is in the table, a pending "removed" if it is not; otherwise it is dropped.
Then the slots the repair drops as damaged are logged as removed (reason ``repair``). So
replaying the log gives the slot table's set of blocks, with no entry lost or repeated.
(One case is not covered: a repair that is itself killed after rebuilding the table and
before logging what it dropped loses those removals: a second fault inside the recovery
from the first.)

Readers never take the lock (:meth:`EventRing.read`): they read W_HEAD, copy the entries
after their ``seq``, and read W_HEAD again; the entry a writer may be overwriting is the
one after W_HEAD, which lies where entry ``W_HEAD + 1 - N`` did, so everything from
``W_HEAD + 2 - N`` on is intact. A reader whose ``seq`` fell before that is told so (a
gap) and resyncs from a snapshot (:meth:`SlabEventLog.events_snapshot`, taken under the
lock, with the seq it is consistent with). x86 keeps stores in order, which is all this
needs (as the slab's seqlock). A namespace's words are written at the commit, NS_LAST
first, before W_HEAD: a reader that finds NS_LAST beyond W_HEAD takes the entry's ``prev``
and ``nseq - 1`` instead (:meth:`EventRing.ns_position`); a repair that drops a pending
entry puts them back.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import operator
import os
import struct
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import posix_ipc

from ..address import ADDRESS_MAX
from ..engine import NO_ENGINE, EngineName
from ..errors import SlabError
from ..units import human_size
from . import layout as L
from .segment import ForeignSegment, Inode, Progress, SlabSegment, _check_owned, _reserve
from .segment import _unlink_ours as unlink_ours

EVENTS_SUFFIX = ".events"
BATCHES_SUFFIX = ".kvbatches"
EVENTS_MAGIC = b"EGKVEVT3"  # 2: per-namespace positions (nseq, prev, the namespace table);
# 3: each entry carries the block's engine name (ENGINE)
EVENTS_HEAD = struct.Struct("<8s16sQQQ")  # magic, slab id, entries, epoch, created (ms)
EVENTS_WORDS_OFFSET = 64
EVENTS_ENTRIES_OFFSET = 128
W_HEAD, W_PENDING = 0, 1
#: An entry: seq, block id, block length, namespace id, kind, reason, address length, its
#: namespace's position (nseq: that namespace's events counted from 1), and the seq of
#: that namespace's entry before it (prev; 0: none).
ENTRY = struct.Struct("<QQQIBBHQQ")
#: After the address: the engine's LoRA id, block size, hash length, parent length, then
#: the hash and the parent's hash (eg_kv.engine.EngineName).
ENGINE = struct.Struct("<qIBB2x32s32s")
ENGINE_OFFSET = ENTRY.size + ADDRESS_MAX
ENTRY_SIZE = ENGINE_OFFSET + ENGINE.size  # 384
#: The byte after ENGINE's lengths (a pad byte before 2026-12-06): E_EXTRAS when the
#: worker handed the block's token ids or LoRA name to the KV-events publisher as it stored
#: it (eg_kv.engine.extras_message): the publisher waits for them before it publishes.
ENGINE_FLAGS_OFFSET = ENGINE_OFFSET + 14
E_EXTRAS = 1
#: A whole entry in one format (the KV-events publisher's and the disk keeper's fast
#: read): ENTRY's fields, the address (padded), then ENGINE's with its flags byte: LoRA
#: id, block size, hash length, parent length, flags, hash, parent (W_* below).
WHOLE_ENTRY = struct.Struct(ENTRY.format + f"{ADDRESS_MAX}s" + "qIBBBx32s32s")
(W_LORA, W_SIZE, W_HLEN, W_PLEN, W_FLAGS, W_HASH, W_PARENT) = range(10, 17)
assert WHOLE_ENTRY.size == ENTRY_SIZE
#: Namespaces the table after the entries has room for (the slab's namespace ids).
EVENTS_NAMESPACES = L.NS_COUNT
#: A namespace's words in that table: the seq of its newest entry, and its nseq.
NS_LAST, NS_COUNT_WORD = 0, 1
#: The most entries a namespace's reader walks back through to find where it stands (one
#: whose position is further behind resyncs, as after a gap): a few ms.
HOPS_MAX = 16384
#: Int64 words of an entry, and where in them its seq, namespace id (the low half), nseq
#: and prev lie.
_EW = ENTRY_SIZE // 8
_E_SEQ, _E_NS, _E_NSEQ, _E_PREV = 0, 3, 4, 5
#: The uint32 word of an entry that holds its namespace id (bytes 24-27 of ENTRY).
_NS_WORD = 6
assert ENTRY.unpack(bytes(24) + (7).to_bytes(4, "little") + bytes(20))[3] == 7  # fmt: skip
assert ENTRY.unpack(bytes(32) + (5).to_bytes(8, "little") + (9).to_bytes(8, "little"))[7:] == (
    5, 9,
)  # fmt: skip

#: An entry's ENGINE head when it carries no engine name (checked before unpacking).
_NO_ENGINE_HEAD = bytes(14)

STORED, REMOVED = 1, 2
R_PUT, R_EVICT, R_DELETE, R_REPAIR, R_QUOTA, R_DISK = 1, 2, 3, 4, 5, 6
KINDS = {STORED: "stored", REMOVED: "removed"}
#: Why: ``put`` (a put created the block), ``evict`` (the slab was full), ``delete`` (the
#: last reference went), ``repair`` (a damaged slot was dropped), ``quota`` (its namespace
#: was over its quota), ``disk`` (the disk tier dropped the last copy: eg_kv.disk).
REASONS = {R_PUT: "put", R_EVICT: "evict", R_DELETE: "delete", R_REPAIR: "repair",
           R_QUOTA: "quota", R_DISK: "disk"}  # fmt: skip
#: The fewest entries a log holds (a reader needs room for one pending entry and more).
MIN_EVENTS = 16
#: The most (2**24 entries are 4.5 GiB of ``/dev/shm``).
MAX_EVENTS = 1 << 24
#: The most entries one :meth:`EventRing.read` looks at (a namespace's reader skips the
#: others' entries: this bounds the time one call takes whatever it filters out).
SCAN_MAX = 16384


def events_name(slab_name: str) -> str:
    """The name of slab ``slab_name``'s events segment."""
    return slab_name + EVENTS_SUFFIX


def batches_name(slab_name: str) -> str:
    """The name of the KV-events publisher's batch index beside slab ``slab_name``'s log
    (:mod:`eg_kv.kvevents.batches`): removed with the log."""
    return slab_name + BATCHES_SUFFIX


def events_size(entries: int) -> int:
    """Bytes of an events segment of ``entries`` entries."""
    return EVENTS_ENTRIES_OFFSET + entries * ENTRY_SIZE + EVENTS_NAMESPACES * 16


class Event(NamedTuple):
    """One entry of the log."""

    seq: int
    kind: int  #: STORED or REMOVED
    reason: int  #: R_* (see REASONS)
    ns: int  #: namespace id
    address: bytes  #: ASCII
    length: int  #: the block's bytes
    block_id: int  #: the slab's id of the block (ids only grow)
    engine: EngineName = NO_ENGINE  #: the block's engine name (eg_kv.engine)
    nseq: int = 0  #: its namespace's position (0: an entry of no namespace's count)


class EventRing:
    """One process's mapping of an events segment (see the module docstring)."""

    __slots__ = ("_eq", "_mm", "_mv", "_nsw", "_staged", "_w", "capacity", "created_ms", "epoch")

    def __init__(self, mm: mmap.mmap, capacity: int, epoch: int, created_ms: int = 0) -> None:
        self._mm, self.capacity, self.epoch = mm, capacity, epoch
        self.created_ms = created_ms  #: when the log was created (Unix ms)
        self._mv = memoryview(mm)
        self._w = self._mv[EVENTS_WORDS_OFFSET:EVENTS_ENTRIES_OFFSET].cast("q")
        end = EVENTS_ENTRIES_OFFSET + capacity * ENTRY_SIZE
        self._eq = self._mv[EVENTS_ENTRIES_OFFSET:end].cast("q")  # the entries as words
        self._nsw = self._mv[end:].cast("q")
        #: The pending entry this process began: (seq, namespace, nseq), for its commit.
        self._staged = (0, 0, 0)

    @property
    def head(self) -> int:
        """The seq of the newest published entry (0: none yet)."""
        return self._w[W_HEAD]

    @property
    def pending_seq(self) -> int:
        """The seq of the entry being written inside the lock (0: none); a read only."""
        return self._w[W_PENDING]

    def begin(
        self, kind: int, reason: int, ns: int, raw: bytes, block_id: int, length: int,
        engine: EngineName = NO_ENGINE,
    ) -> None:  # fmt: skip
        """Write the next entry as pending (under the slab lock, before the change)."""
        w, nsw = self._w, self._nsw
        seq = w[W_HEAD] + 1
        nseq = prev = 0
        if 0 <= ns < EVENTS_NAMESPACES:
            prev, nseq = nsw[2 * ns + NS_LAST], nsw[2 * ns + NS_COUNT_WORD] + 1
        off = EVENTS_ENTRIES_OFFSET + (seq - 1) % self.capacity * ENTRY_SIZE
        # The whole entry in one call (the address zero-padded): three writes cost an
        # evicting PUT, which logs two entries, a tenth of its slab time.
        if engine is NO_ENGINE:  # the usual case: a zero engine head (what _entry checks)
            WHOLE_ENTRY.pack_into(self._mm, off, seq, block_id, length, ns, kind, reason,
                                  len(raw), nseq, prev, raw, 0, 0, 0, 0, 0, b"", b"")  # fmt: skip
        else:
            h, parent = engine.hash, engine.parent
            # Flags: the block's token ids or LoRA name were handed to the publisher (the
            # server sends only what it handed).
            flags = E_EXTRAS if engine.token_ids or engine.lora_name else 0
            WHOLE_ENTRY.pack_into(self._mm, off, seq, block_id, length, ns, kind, reason,
                                  len(raw), nseq, prev, raw, engine.lora_id, engine.block_size,
                                  len(h), len(parent), flags, h, parent)  # fmt: skip
        self._staged = (seq, ns, nseq)
        w[W_PENDING] = seq  # after the entry: a pending seq always names a whole entry

    def commit(self) -> None:
        """Publish the pending entry (under the lock, after the change)."""
        w = self._w
        seq = w[W_PENDING]
        if seq:
            staged, ns, nseq = self._staged
            if staged != seq:  # another process's entry (a repair commits it): read it
                e = (seq - 1) % self.capacity * _EW
                ns, nseq = self._eq[e + _E_NS] & 0xFFFFFFFF, self._eq[e + _E_NSEQ]
            if nseq:  # its namespace's words, NS_LAST first (see the module docstring)
                self._nsw[2 * ns + NS_LAST] = seq
                self._nsw[2 * ns + NS_COUNT_WORD] = nseq
            w[W_HEAD] = seq  # a crash before the next line leaves W_PENDING == W_HEAD: done
            w[W_PENDING] = 0

    def drop_pending(self) -> None:
        """Forget the pending entry: its change did not happen (repair). Its namespace's
        words go back to the entry before it, if a commit had begun to move them."""
        w = self._w
        seq = w[W_PENDING]
        if seq:
            _, _, _, ns, _, _, _, nseq, prev = ENTRY.unpack_from(self._entry_bytes(seq))
            if nseq and self._nsw[2 * ns + NS_LAST] == seq:
                self._nsw[2 * ns + NS_COUNT_WORD] = nseq - 1
                self._nsw[2 * ns + NS_LAST] = prev
        w[W_PENDING] = 0

    def pending(self) -> Event | None:
        """The entry a dead holder left pending, if any (under the lock)."""
        w = self._w
        seq = w[W_PENDING]
        if seq != w[W_HEAD] + 1:  # 0, or published already (died between the two words)
            if seq:
                w[W_PENDING] = 0
            return None
        return self._entry(seq, bytes(self._entry_bytes(seq)))

    def _entry_bytes(self, seq: int) -> memoryview:
        off = EVENTS_ENTRIES_OFFSET + (seq - 1) % self.capacity * ENTRY_SIZE
        return self._mv[off : off + ENTRY_SIZE]

    @staticmethod
    def _entry(seq: int, raw: bytes, nseq: int = 0) -> Event | None:
        """Entry ``seq`` from its bytes (None: another entry, or not one); with ``nseq``,
        as its namespace's reader sees it (``seq`` its position, None unless it is that)."""
        got, block_id, length, ns, kind, reason, alen, pos, _ = ENTRY.unpack_from(raw)
        if got != seq or alen > ADDRESS_MAX or kind not in KINDS or (nseq and pos != nseq):
            return None
        address = raw[ENTRY.size : ENTRY.size + alen]
        engine = NO_ENGINE
        if raw[ENGINE_OFFSET : ENGINE_OFFSET + 14] != _NO_ENGINE_HEAD:
            lora, size, hlen, plen, h, parent = ENGINE.unpack_from(raw, ENGINE_OFFSET)
            engine = EngineName(h[: min(hlen, 32)], parent[: min(plen, 32)], size, lora)
        return Event(nseq or seq, kind, reason, ns, address, length, block_id, engine, pos)

    def ns_position(self, ns: int) -> tuple[int, int]:
        """Namespace ``ns``'s published position and the seq of its newest published entry
        (``(0, 0)``: none yet), without the lock."""
        w, nsw = self._w, self._nsw
        if not 0 <= ns < EVENTS_NAMESPACES:
            return 0, 0
        for _ in range(1000):  # a commit moves the words in a few instructions
            last = nsw[2 * ns + NS_LAST]
            count = nsw[2 * ns + NS_COUNT_WORD]
            if nsw[2 * ns + NS_LAST] != last:  # a commit moved it meanwhile: again
                continue
            if not last:
                return 0, 0
            if last <= w[W_HEAD]:
                # Its entry, where the ring still holds it, says its nseq (count may be a
                # commit's newer word); one lapped is too old for a commit to be on it.
                e = (last - 1) % self.capacity * _EW
                got, nseq = self._eq[e + _E_SEQ], self._eq[e + _E_NSEQ]
                if got == last and last >= w[W_HEAD] + 2 - self.capacity:
                    return nseq, last
                return count, last
            # Committing now (NS_LAST moves before W_HEAD): the entry before it.
            e = (last - 1) % self.capacity * _EW
            if self._eq[e + _E_SEQ] == last:
                return self._eq[e + _E_NSEQ] - 1, self._eq[e + _E_PREV]
        raise SlabError(f"namespace {ns}'s event words kept moving; the log may be damaged")

    def read_ns(
        self, since: int, limit: int, ns: int, at: tuple[int, int] | None = None
    ) -> tuple[list[Event], int, bool]:
        """Namespace ``ns``'s published entries after its position ``since``, each with
        ``seq`` its position (see the module docstring), without the lock.

        Args:
            at: where the namespace stands (:meth:`ns_position`), if the caller read it.

        Returns:
            ``(events, next, gap)`` as :meth:`read`, in the namespace's positions: a gap
            when ``since`` is beyond the namespace's position, or its entries after it
            are no longer all in the log (or more than :data:`HOPS_MAX` back).
        """
        return next(self.read_ns_steps(since, limit, limit, ns, at))

    def read_ns_steps(
        self, since: int, limit: int, step: int, ns: int, at: tuple[int, int] | None = None
    ) -> Iterator[tuple[list[Event], int, bool]]:
        """:meth:`read_ns` of up to ``limit`` entries, ``step`` at a time, from ONE walk
        back along the namespace's links: a reader that yields between steps re-walked
        them from the newest entry at each step (a 10,000-event read walked 16,384 links
        40 times: 209 ms of a worker's CPU). Each step's entries are checked as they are
        read (a writer may lap them between steps: that step is a gap, and the last).

        Yields:
            ``(events, next, gap)`` per step, as :meth:`read_ns` returns; the first is
            ``([], since, False)`` when there is nothing new.
        """
        count, last = at or self.ns_position(ns)
        if since > count or count - since > HOPS_MAX:
            yield [], count, True
            return
        if since == count:
            yield [], count, False
            return
        # Walk back from the newest to since + 1, checking each link, then read the oldest.
        seqs: list[int] = []
        seq, n, eq = last, self.capacity, self._eq
        for pos in range(count, since, -1):
            e = (seq - 1) % n * _EW
            if eq[e + _E_SEQ] != seq or eq[e + _E_NSEQ] != pos or eq[e + _E_NS] & 0xFFFFFFFF != ns:
                yield [], count, True
                return
            seqs.append(seq)
            seq = eq[e + _E_PREV]
        seqs.reverse()  # the oldest first
        del seqs[limit:]
        for first in range(0, len(seqs), step):
            part, out = seqs[first : first + step], []
            for k, seq in enumerate(part, since + first + 1):
                ev = self._entry(seq, bytes(self._entry_bytes(seq)), k)
                if ev is None:
                    yield [], count, True
                    return
                out.append(ev)
            if part[0] < self._w[W_HEAD] + 2 - n:  # a writer lapped the oldest meanwhile
                yield [], count, True
                return
            yield out, since + first + len(out), False

    def read(
        self, since: int, limit: int, ns: int | None = None, scan: int = SCAN_MAX
    ) -> tuple[list[Event], int, bool]:
        """The published entries after ``since``, without the lock.

        Args:
            since: the last seq the reader has (0: from the start).
            limit: the most entries to return (at least 1).
            ns: only this namespace's entries (None: every namespace's).
            scan: the most entries to look at (at most :data:`SCAN_MAX`): a caller that
                must yield between steps reads in smaller ones.

        Returns:
            ``(events, next, gap)``: ``next`` is the seq to ask from next time (the last
            one looked at, returned or filtered out); ``gap`` is True when entries after
            ``since`` are no longer in the log (or ``since`` is beyond it: another log):
            the reader must resync from a snapshot, and ``next`` is the newest seq.
        """
        got = self._copy(since, scan)
        if isinstance(got, int):
            return [], got, True
        blob, end = got
        looked = range(end - since)
        if ns is not None:  # the namespace column, compared in C: a skipped entry is free
            column = memoryview(blob).cast("I")[_NS_WORD :: ENTRY_SIZE // 4]
            looked = itertools.compress(looked, map(ns.__eq__, column.tolist()))  # type: ignore[assignment]
        out: list[Event] = []
        for k in looked:
            ev = self._entry(since + k + 1, blob[k * ENTRY_SIZE : (k + 1) * ENTRY_SIZE])
            if ev is None:  # cannot happen while the log is intact; resync rather than guess
                return [], self._w[W_HEAD], True
            out.append(ev)
            if len(out) >= limit:
                return out, ev.seq, False
        return out, end, False

    def _copy(self, since: int, scan: int) -> tuple[bytes, int] | int:
        """The entries after ``since`` (at most ``scan``, :data:`SCAN_MAX`) as one bytes
        copy and the seq of the last; an int: they are gone (the newest seq, a gap)."""
        w, n = self._w, self.capacity
        head = w[W_HEAD]
        if since > head or since + 1 < head + 2 - n:
            return head
        end = min(head, since + min(scan, SCAN_MAX))
        # Copy the range in at most two pieces (the ring wraps), then check it was intact.
        raws: list[bytes] = []
        lo = since + 1
        while lo <= end:
            i = (lo - 1) % n
            k = min(end - lo + 1, n - i)
            off = EVENTS_ENTRIES_OFFSET + i * ENTRY_SIZE
            raws.append(self._mm[off : off + k * ENTRY_SIZE])
            lo += k
        if since + 1 < w[W_HEAD] + 2 - n:  # a writer lapped the reader while it copied
            return w[W_HEAD]
        return b"".join(raws), end

    def read_whole(self, since: int, scan: int) -> tuple[list[tuple[Any, ...]], int, bool]:
        """:meth:`read` for a reader that wants every entry and its speed (the KV-events
        publisher): each entry as :data:`WHOLE_ENTRY`'s tuple, unpacked in C, unchecked
        (the caller checks each one's seq, field 0, is the one it expects).

        Returns:
            ``(entries, next, gap)`` as :meth:`read`'s.
        """
        got = self._copy(since, scan)
        if isinstance(got, int):
            return [], got, True
        blob, end = got
        return list(WHOLE_ENTRY.iter_unpack(blob)), end, False

    def release(self) -> None:
        """Unmap (views first)."""
        self._w.release()
        self._eq.release()
        self._nsw.release()
        self._mv.release()
        with contextlib.suppress(BufferError):
            self._mm.close()


_E = TypeVar("_E", bound="SlabEventLog")
#: Slots one hold of the lock walks for a snapshot (~5 ms here with every other slot held;
#: a slice runs on to the next empty slot).
SNAPSHOT_SLICE = 8192
#: A slot's state byte -> 1 if it is ready, else 0 (bytes.translate, in C).
_READY_ONLY = bytes(int(b == L.SLOT_READY) for b in range(256))
#: The int64 word of a slot that holds its block length (byte 8 of SLOT).
_LENGTH_WORD = 1
assert L.SLOT.unpack_from(bytes(8) + (7).to_bytes(8, "little") + bytes(L.SLOT.size))[
    L.F_LENGTH
] == 7  # fmt: skip


class SlabEventLog(SlabSegment):
    """The event log's part of :class:`eg_kv.slab.store.Slab`: its segment's lifecycle,
    reconciling after a crash, logging a repair's drops, and the snapshot."""

    if TYPE_CHECKING:
        # Defined by SlabChecks (eg_kv.slab.check).
        def _slot_address(self, i: int, alen: int) -> bytes: ...
        def _slot_engine(self, i: int) -> EngineName: ...

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, geometry: L.Geometry) -> None:
        super().__init__(name, shm, geometry)
        #: The event log this handle appends to (None: the server runs without one).
        self._events: EventRing | None = None
        #: The events segment this handle maps, once it does.
        self.events_inode: Inode | None = None

    @classmethod
    def attach(
        cls: type[_E], name: str, *, prefault: bool = False, progress: Progress | None = None
    ) -> _E:
        """:meth:`SlabSegment.attach`, then the slab's event log if it has one."""
        slab = super().attach(name, prefault=prefault, progress=progress)
        try:
            slab._map_events()
        except BaseException:
            slab.close()
            raise
        return slab

    @property
    def events(self) -> EventRing | None:
        """The event log (None: off)."""
        return self._events

    def _map_events(self) -> None:
        """Map the events segment if there is one of this slab (by its slab id).

        Raises:
            ForeignSegment: it is another user's, or has group/other mode bits.
        """
        try:
            shm = posix_ipc.SharedMemory(events_name(self.name))
        except posix_ipc.ExistentialError:
            return
        try:
            inode = _check_owned(shm.fd, events_name(self.name))
            size = os.fstat(shm.fd).st_size
            if size < EVENTS_ENTRIES_OFFSET:
                return
            head = os.pread(shm.fd, EVENTS_HEAD.size, 0)
            magic, slab_id, entries, epoch, created_ms = EVENTS_HEAD.unpack(head)
            if magic != EVENTS_MAGIC or slab_id != self.slab_id or size != events_size(entries):
                return  # another slab's: setup_events replaces it
            self._events = EventRing(mmap.mmap(shm.fd, size), entries, epoch, created_ms)
            self.events_inode = inode
        finally:
            shm.close_fd()

    def setup_events(self, entries: int) -> None:
        """Give the slab an event log of ``entries`` entries (the server's owner, before
        its workers attach). A log of that size already there is kept (a warm restart:
        readers resume); one of another size is replaced by an empty one with a new epoch;
        0 removes it.

        Raises:
            SlabError: a size out of range, or no room in ``/dev/shm``.
            ForeignSegment: a segment of that name is another user's.
        """
        if entries and not MIN_EVENTS <= entries <= MAX_EVENTS:
            raise SlabError(f"events: {entries} entries; want 0 (off) or {MIN_EVENTS}-{MAX_EVENTS}")
        ring = self._events
        if ring is not None and ring.capacity == entries:
            return
        if ring is not None:
            self._events = None
            ring.release()
        unlink_ours(events_name(self.name), self.events_inode)
        unlink_ours(batches_name(self.name), None)  # it numbered the old log's batches
        self.events_inode = None
        if not entries:
            with contextlib.suppress(ForeignSegment):
                self._unlink_stale_events()
            return
        self._unlink_stale_events()
        name, size = events_name(self.name), events_size(entries)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            raise SlabError(f"events segment {name} appeared while it was created") from None
        try:
            inode = _check_owned(shm.fd, name)
            try:
                _reserve(shm.fd, size, 0)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise SlabError(
                        f"/dev/shm has no room for the event log ({human_size(size)} for "
                        f"{entries} entries): lower --events (0: no log) or enlarge /dev/shm "
                        "(docker: shm_size)"
                    ) from None
                raise
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            unlink_ours(name, None)
            raise
        shm.close_fd()
        epoch = int.from_bytes(os.urandom(8), "little") >> 1
        created_ms = int(time.time() * 1000)
        head = EVENTS_HEAD.pack(EVENTS_MAGIC, self.slab_id, entries, epoch, created_ms)
        mm[: EVENTS_HEAD.size] = head
        self._events = EventRing(mm, entries, epoch, created_ms)
        self.events_inode = inode

    def _unlink_stale_events(self) -> None:
        """Remove a leftover events segment of this name, if it is this user's.

        Raises:
            ForeignSegment: it is another user's (never removed).
        """
        name = events_name(self.name)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            return
        try:
            stale = _check_owned(shm.fd, name)
        finally:
            shm.close_fd()
        unlink_ours(name, stale)

    def close(self) -> None:
        """:meth:`SlabSegment.close`, then the event log's mapping."""
        super().close()  # it may take the lock, and a repair on entry logs: mapped until after
        ring, self._events = self._events, None
        if ring is not None:
            ring.release()

    def unlink(self) -> bool:
        """:meth:`SlabSegment.unlink`, and the events segment this handle mapped."""
        gone = super().unlink()
        if self.events_inode is not None:
            unlink_ours(events_name(self.name), self.events_inode)
        unlink_ours(batches_name(self.name), None)
        return gone

    @staticmethod
    def unlink_named(
        name: str, inode: Inode | None = None, readers_inode: Inode | None = None
    ) -> bool:
        """:meth:`SlabSegment.unlink_named`; by name alone (``--fresh``) the events
        segment goes too (this user's only)."""
        gone = SlabSegment.unlink_named(name, inode, readers_inode)
        if inode is None:
            unlink_ours(events_name(name), None)
            unlink_ours(batches_name(name), None)
        return gone

    # ------------------------------------------------------------------ under the lock

    def _reconcile_events(self) -> None:
        """Publish or drop the entry a dead holder left pending (repair, under the lock,
        before the walk): it happened if the slot table says so."""
        ring = self._events
        if ring is None:
            return
        ev = ring.pending()
        if ev is None:
            return
        if self._block_present(ev.ns, ev.address, ev.block_id) == (ev.kind == STORED):
            ring.commit()
        else:
            ring.drop_pending()

    def _block_present(self, ns: int, raw: bytes, block_id: int) -> bool:
        """Whether a ready slot holds block ``block_id`` of ``raw`` in namespace ``ns``,
        wherever it lies (a probe may be broken mid backward-shift): a search of the slot
        table's bytes for the address, in C."""
        g, mm, head = self.geometry, self._mm, L.SLOT.size
        if not raw:
            return False
        at, end = g.slots_off, g.slots_off + g.nslots * L.SLOT_SIZE
        while (at := mm.find(raw, at, end)) >= 0:
            i, into = divmod(at - g.slots_off, L.SLOT_SIZE)
            if into == head:
                s = self._read_slot(i)
                if (
                    s[L.F_STATE] == L.SLOT_READY
                    and s[L.F_ALEN] == len(raw)
                    and s[L.F_NS] == ns
                    and s[L.F_BLOCK_ID] == block_id
                ):
                    return True
            at += 1
        return False

    def _log_repair_drops(
        self, dropped: list[tuple[int, bytes, int, int]], kept: set[tuple[int, bytes]]
    ) -> None:
        """Log as removed (reason repair) each block a repair dropped, once, unless a copy
        of it was kept. ``dropped``: (namespace, address, block id, length)."""
        ring = self._events
        if ring is None:
            return
        logged: set[tuple[int, bytes]] = set()
        for ns, raw, block_id, length in dropped:
            if (ns, raw) in kept or (ns, raw) in logged or not 1 <= len(raw) <= ADDRESS_MAX:
                continue
            logged.add((ns, raw))
            ring.begin(REMOVED, R_REPAIR, ns, raw, block_id, length)
            ring.commit()

    def snapshot_stream(
        self, ns: int | None, timeout: float | None = None, engines: bool = False
    ) -> Generator[SnapshotPart, None, None]:
        """The blocks held, as a stream: what a reader applies in order to get the blocks
        held at the position the stream ends with (see :class:`SnapshotPart`).

        The slot table is walked in slices of about :data:`SNAPSHOT_SLICE` slots, each
        under the lock (write=False: lock-free readers need not retry), so writers wait
        for a slice (a few ms), never for the whole walk; nothing is kept between slices.
        Each slice ends at an empty slot, and the walk starts after one: a delete's
        backward shift moves a block only towards its home, through occupied slots, so a
        block can cross into the walked part only if it was stored after that part was
        walked, and then its "stored" entry is in the log. So the walk's blocks, then the
        log's entries from the walk's first seq to its last (the stream's ``events``
        parts), give exactly the blocks held at the last. A block may come twice (walked,
        and stored meanwhile): a reader keeps a set.

        Args:
            ns: only this namespace's blocks (None: every namespace's).
            engines: each block also carries its engine name (a fourth item, from its
                slot's META: the KV-events publisher's resync).

        Yields:
            :class:`SnapshotPart` s: ``blocks`` parts, then ``events`` parts, then one
            ``end`` part with the log's epoch and the position (namespace ``ns``'s, when
            given: :meth:`EventRing.read_ns`).

        Raises:
            SlabError: the slab has no event log; SnapshotVoid: the slab was repaired or
            the log lapped the walk meanwhile (take it again). LockTimeout: after
            ``timeout``.
        """
        ring = self._events
        if ring is None:
            raise SlabError("this server keeps no event log")
        g, st, mm = self.geometry, self._state, self._mm
        nslots, base = g.nslots, g.slots_off

        def empty(rotated: int) -> bool:
            return mm[base + (start + 1 + rotated) % nslots * L.SLOT_SIZE] == L.SLOT_EMPTY

        with self._locked(timeout, write=False):
            first, repairs = ring.head, st[L.ST_REPAIRS]
            # A namespace without a block has nothing to walk: what it stores meanwhile
            # is in the log. Its snapshot costs no look at the others' slots.
            done, start = (
                (nslots, 0) if ns is not None and not self._ns_block_count(ns) else (0, -1)
            )
            if start < 0:  # the first empty slot (the table is never full: a few steps)
                start = 0
                while mm[base + start * L.SLOT_SIZE] != L.SLOT_EMPTY:
                    start += 1
        while done < nslots:
            with self._locked(timeout, write=False):
                if st[L.ST_REPAIRS] != repairs:
                    raise SnapshotVoid("the slab was repaired during the snapshot")
                hi = min(nslots, done + SNAPSHOT_SLICE)
                while hi < nslots and not empty(hi - 1):  # end the slice at an empty slot
                    hi += 1
                lo_slot = (start + 1 + done) % nslots
                first_part = min(hi - done, nslots - lo_slot)
                blocks = self._held_in(lo_slot, lo_slot + first_part, ns, engines)
                if first_part < hi - done:  # the slice wraps round the table's end
                    blocks += self._held_in(0, hi - done - first_part, ns, engines)
            yield SnapshotPart("blocks", blocks)
            done = hi
            if done < nslots:
                time.sleep(0.0005)  # step aside: writers woken by the release go first
        with self._locked(timeout, write=False):
            if st[L.ST_REPAIRS] != repairs:
                raise SnapshotVoid("the slab was repaired during the snapshot")
            last = ring.head
            position = _position(ring, last, ns)
        since = first
        while since < last:
            events, since, gap = ring.read(since, SCAN_MAX, ns)
            if gap:
                raise SnapshotVoid("the event log lapped the snapshot's walk")
            yield SnapshotPart("events", events=[ev for ev in events if ev.seq <= last])
        yield SnapshotPart("end", [], ring.epoch, position)

    def events_snapshot(
        self, ns: int | None, timeout: float | None = None
    ) -> tuple[int, int, list[tuple[int, str, int]]]:
        """:meth:`snapshot_stream`, gathered: the blocks held, and the position of the log
        they are consistent with.

        Returns:
            ``(epoch, seq, [(namespace id, address, length), ...])``: replaying the log's
            entries after ``seq`` over these gives the slab's blocks at any later seq;
            ``seq`` is namespace ``ns``'s position when ``ns`` is given.

        Raises:
            As :meth:`snapshot_stream`.
        """
        held: dict[tuple[int, bytes], int] = {}
        for part in self.snapshot_stream(ns, timeout):
            if part.kind == "blocks":
                held.update(((n, raw), length) for n, raw, length in part.blocks)
            elif part.kind == "events":
                for ev in part.events:
                    if ev.kind == STORED:
                        held[(ev.ns, ev.address)] = ev.length
                    else:
                        held.pop((ev.ns, ev.address), None)
            else:
                return part.epoch, part.position, _decoded(held)
        raise AssertionError("a snapshot stream ends with its end part")

    def _ns_block_count(self, ns: int) -> int:
        """The exact number of blocks namespace ``ns`` holds (under the lock; the default
        namespace's is derived: the slab's less every other's)."""
        column = self._nsw[L.NS_BLOCKS :: L.NS_WORDS]
        if ns:
            return column[ns] if 0 < ns < L.NS_COUNT else 0
        return self._state[L.ST_UNIQUE_BLOCKS] - sum(column.tolist()[1:])

    def _held_in(
        self, lo: int, hi: int, ns: int | None, engines: bool = False
    ) -> list[tuple[Any, ...]]:
        """``(namespace id, address, length)`` of the ready slots in ``[lo, hi)`` (of
        namespace ``ns`` if given), under the lock: the state and namespace columns are
        matched in C, so a slot of another namespace costs no Python step."""
        g, ss = self.geometry, L.SLOT_SIZE
        w4, w8 = ss // 4, ss // 8
        wanted = self._mv[g.slots_off + lo * ss : g.slots_off + hi * ss : ss].tobytes()
        wanted = wanted.translate(_READY_ONLY)
        if ns is not None:
            mine = map(ns.__eq__, self._slot_ns[lo:hi].tolist())
            wanted = bytes(map(operator.and_, wanted, mine))
        slots = list(itertools.compress(range(lo, hi), wanted))
        if not slots:
            return []
        heads, i64, col = self._slots_u32, self._slots_i64, self._slot_ns
        mm, at = self._mm, g.slots_off + L.SLOT.size
        if engines:
            return [
                (col[k], mm[at + k * ss : at + k * ss + (heads[k * w4] >> 16)],
                 i64[k * w8 + _LENGTH_WORD], self._slot_engine(k))
                for k in slots
            ]  # fmt: skip
        return [
            (
                col[k],
                mm[at + k * ss : at + k * ss + (heads[k * w4] >> 16)],
                i64[k * w8 + _LENGTH_WORD],
            )
            for k in slots
        ]


class SnapshotPart(NamedTuple):
    """One part of :meth:`SlabEventLog.snapshot_stream`: ``blocks`` (namespace id, address,
    length), ``events`` (the log's entries to apply over them, in order), or the ``end``
    (the log's ``epoch`` and the ``position`` the whole is consistent with)."""

    kind: str
    blocks: list[tuple[Any, ...]] = []  # defaults never mutated
    epoch: int = 0
    position: int = 0
    events: list[Event] = []


class SnapshotVoid(SlabError):
    """A snapshot's walk met a repair, or the log lapped it: take it again."""


def _position(ring: EventRing, seq: int, ns: int | None) -> int:
    """The log's position ``seq`` as namespace ``ns`` counts it (None: every namespace's,
    ``seq`` itself); under the lock, where no commit is half done."""
    return seq if ns is None else ring.ns_position(ns)[0]


def _decoded(held: dict[tuple[int, bytes], int]) -> list[tuple[int, str, int]]:
    return [(ns, raw.decode("ascii", "replace"), length) for (ns, raw), length in held.items()]
