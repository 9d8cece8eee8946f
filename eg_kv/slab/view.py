"""The read side of a slab: what any mapping of it can look up and copy out.

Two kinds of handle share it: :class:`eg_kv.slab.store.Slab`, every server process's read-write
handle, which also takes the lock and changes the slab, and
:class:`eg_kv.slab.local.LocalSlab`, a client's read-only mapping on the slab's host
(local reads). Neither the lookups nor the copies here write to the slab: what a hit
records (the CLOCK reference count, the hit and miss counters) each handle records its own
way, through :meth:`SlabView._touch`, :meth:`SlabView._count_read` and
:meth:`BlockReader.done` (a hit is counted once its read ends whole).

Nothing here imports ``posix_ipc``: a client needs only the standard library and
``xxhash`` to read.
"""

from __future__ import annotations

import mmap
import platform
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ..address import all_valid, fingerprint, validate
from ..checksum import of as checksum_of
from ..errors import NotFound, SlabError
from . import layout as L

# The slot's field indexes, as module globals: read in every probe of every lookup.
from .layout import F_ALEN, F_BLOCK_ID, F_FIRST, F_FP, F_LENGTH, F_NPAGES, F_NS, F_STATE

DEFAULT_READ_SLICE = 1024 * 1024
#: Addresses whose validated bytes and fingerprint a handle remembers, per namespace: each
#: namespace has its own memo, so how fast one tenant's lookup is never tells which
#: addresses another tenant used (a shared memo told them apart at 0.9 vs 2.0 ms per
#: batch of 1,024).
_KEY_CACHE = 16384
#: ...and in all namespaces together: with more than two namespaces, each one's memo holds
#: this divided by their number (:meth:`SlabView.share_key_cache`), about 10 MiB at most.
_KEY_CACHE_TOTAL = 32768
#: Every namespace's memo until its first address: shared, never written (see _remember).
_NO_KEYS: dict[str, tuple[bytes, int]] = {}
#: The same for the memo of where hits were (see SlabView._ids_of).
_NO_PLACES: dict[str, tuple[int, int]] = {}
#: Each namespace's fingerprint mix (layout.ns_fingerprint), made once: a multiply and a
#: mask of a 64-bit int per lookup were a tenth of a namespace's extra cost.
_NS_MIXES = [(ns * L.NS_MIX) & 0xFFFFFFFFFFFFFFFF for ns in range(L.NS_COUNT)]
_T = TypeVar("_T")
_M = TypeVar("_M")  # what a memo holds per address
#: Lock-free lookups rely on x86's ordering of loads and of stores (see SlabView._read).
LOCKFREE_READS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_FENCE = threading.Lock()


def full_fence() -> None:
    """Order this thread's earlier stores before its later loads, across processes.

    x86 keeps loads in order and stores in order, but lets a load pass an earlier store
    (the store buffer). A local lease (:mod:`eg_kv.slab.local_leases`) is a store then a
    check of the slab's sequence, and an eviction a store of the sequence then a read of
    the leases (Dekker's pattern): each side needs a full barrier between the two, or both
    can miss the other. A lock's acquire and release are ``lock``-prefixed instructions,
    full barriers on x86 (the only CPUs local reads run on); about 0.1 µs.
    """
    _FENCE.acquire()
    _FENCE.release()


_unpack_slot = L.SLOT.unpack_from
_unpack_state_and_id = L.SLOT_STATE_AND_ID.unpack_from
_unpack_checksum = L.SLOT_CHECKSUM.unpack_from
_META = L.SLOT_META_OFFSET
_SLOT_READY = L.SLOT_READY
_SLOT_SIZE, _SLOT_HEAD, _SLOT_EMPTY, _ST_SEQ = L.SLOT_SIZE, L.SLOT.size, L.SLOT_EMPTY, L.ST_SEQ


class BlockGone(NotFound):
    """The block was evicted or released while it was being read: a miss."""


class Longer(Exception):
    """The block is longer than the read asked for (:meth:`SlabView.read_or_open`'s
    ``limit``): nothing was read or counted."""


#: No limit on the length of a block read (:meth:`SlabView.read_or_open`).
UNLIMITED = 1 << 62


class SlabView:
    """Lookups and block reads over a mapping of a slab (see the module docstring).

    Args:
        name: the segment's name (``/eg-kv-9130``).
        mm: the whole segment, mapped (read-write or read-only).
        geometry: the slab's geometry, from its header.
    """

    def __init__(self, name: str, mm: mmap.mmap, geometry: L.Geometry) -> None:
        self.name = name
        self.geometry = g = geometry
        self._mm = mm
        self._mv = memoryview(mm)
        self._state = self._mv[L.STATE_OFFSET : L.STATE_OFFSET + 8 * L.STATE_WORDS].cast("q")
        self._next = self._mv[g.next_off : g.next_off + 8 * g.npages].cast("q")
        self._tag = self._mv[g.tag_off : g.tag_off + 8 * g.npages].cast("Q")
        #: Per namespace id: address -> (ASCII bytes, the namespace's fingerprint).
        self._keys: list[dict[str, tuple[bytes, int]]] = [_NO_KEYS] * L.NS_COUNT
        #: Per namespace id: address -> (slot, block id) where a lookup last found it.
        self._places: list[dict[str, tuple[int, int]]] = [_NO_PLACES] * L.NS_COUNT
        self._key_cap = _KEY_CACHE
        self._mask = g.nslots - 1
        self._nslots, self._slots_off = g.nslots, g.slots_off
        self.page_size = g.page_size
        self._data_off = g.data_off
        self.max_block_size = g.max_block_size

    def _release_views(self) -> None:
        for view in (self._state, self._next, self._tag, self._mv):
            view.release()

    # ------------------------------------------------------------------ hooks

    def _read(self, lookup: Callable[..., _T], *args: object) -> _T:
        """Run a read-only ``lookup(*args)`` of the slot table without the lock, or, if a
        writer got in the way, as :meth:`_torn` says (arguments rather than a closure: a
        lambda per lookup was 0.1 µs).

        Every critical section makes ST_SEQ odd on entry and even on exit (a seqlock). A
        lookup that saw the same even value before and after read a table no writer
        touched meanwhile, so what it read belongs together. (x86 keeps loads in order and
        stores in order, which is all a seqlock needs; elsewhere every lookup is torn.)
        """
        if LOCKFREE_READS:
            st = self._state
            seq = st[_ST_SEQ]
            if not seq & 1:
                try:
                    result = lookup(*args)
                except SlabError:  # a torn view of a table being rebuilt
                    pass
                else:
                    if st[_ST_SEQ] == seq:
                        return result
        return self._torn(lookup, *args)

    def _torn(self, lookup: Callable[..., _T], *args: object) -> _T:
        """Run ``lookup(*args)`` whose lock-free attempt was torn (see subclasses)."""
        raise NotImplementedError

    def _touch(self, i: int) -> None:
        """Record a hit on slot ``i`` for the CLOCK sweep."""
        raise NotImplementedError

    def _count_read(self, hit: int, miss: int, ns: int = 0) -> None:
        """Count get hits and misses."""
        raise NotImplementedError

    def _count_bad_checksum(self, ns: int = 0) -> None:
        """A hit whose bytes failed the block's checksum: a miss, and one more checksum
        failure where this handle counts them."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lookups

    def _key(self, address: str, ns: int = 0) -> tuple[bytes, int]:
        """The address's ASCII bytes and its fingerprint in namespace ``ns``
        (:func:`eg_kv.slab.layout.ns_fingerprint`), validated once and then remembered in that
        namespace's memo (a regex and a BLAKE2b per request were a tenth of a small GET's
        slab time).

        Raises:
            InvalidAddress: see :func:`eg_kv.address.validate`.
        """
        key = self._keys[ns].get(address)
        if key is None:
            key = self._remember(address, ns)
        return key

    def _remember(self, address: str, ns: int) -> tuple[bytes, int]:
        """Validate and fingerprint ``address`` and remember it in namespace ``ns``'s memo.

        A full memo is emptied, that namespace's alone: what one tenant looks up never
        changes how fast another's lookups are.

        Raises:
            InvalidAddress: see :func:`eg_kv.address.validate` (nothing is remembered).
        """
        raw = validate(address)
        key = (raw, fingerprint(raw) ^ _NS_MIXES[ns])  # layout.ns_fingerprint, inline
        self._memo(self._keys, _NO_KEYS, ns, 1)[address] = key
        return key

    def _memo(
        self, memos: list[dict[str, _M]], empty: dict[str, _M], ns: int, more: int
    ) -> dict[str, _M]:
        """Namespace ``ns``'s memo in ``memos`` (addresses, or places) with room for
        ``more`` entries: made on first use (``empty`` until then), emptied when they would
        take it past the cap, that namespace's alone: what one tenant looks up never
        changes how fast another's lookups are."""
        memo = memos[ns]
        if memo is empty:
            memo = memos[ns] = {}
        elif len(memo) + more > self._key_cap:
            memo.clear()
        return memo

    def _remember_new(self, addresses: list[str], ns: int) -> None:
        """Remember the addresses of a batch that namespace ``ns``'s memo lacks, checked
        as one batch (:func:`eg_kv.address.all_valid`) instead of a regex each: a third of
        a lookup's first sight of 1,024 addresses. A batch that fails is left to
        :meth:`_key`, which names the bad address."""
        new = [a for a in addresses if a not in self._keys[ns]]
        if len(new) < 2 or not all_valid(new):
            return
        keys = self._memo(self._keys, _NO_KEYS, ns, len(new))
        mix = _NS_MIXES[ns]
        for address in new[: self._key_cap]:
            raw = address.encode("ascii")
            keys[address] = (raw, fingerprint(raw) ^ mix)

    def share_key_cache(self, namespaces: int) -> None:
        """Size each namespace's memo for ``namespaces`` namespaces in use, and forget
        every address remembered (call it whenever the namespaces are bound: an id a
        removed tenant had may be given to a new one, who must not inherit its memo).

        Args:
            namespaces: how many namespaces requests may use (at least 1).
        """
        self._key_cap = max(1, min(_KEY_CACHE, _KEY_CACHE_TOTAL // max(1, namespaces)))
        self._keys = [_NO_KEYS] * L.NS_COUNT
        self._places = [_NO_PLACES] * L.NS_COUNT

    def check_address(self, address: str, ns: int = 0) -> None:
        """Raise :class:`~eg_kv.errors.InvalidAddress` unless ``address`` is one (from
        namespace ``ns``'s memo of addresses already validated: a regex per PUT was 0.2 µs).
        """
        self._key(address, ns)

    def _slot_off(self, i: int) -> int:
        return self.geometry.slots_off + i * L.SLOT_SIZE

    def _read_slot(self, i: int) -> L.SlotFields:
        return L.SLOT.unpack_from(self._mm, self._slot_off(i))

    def _find(self, raw: bytes, fp: int, ns: int = 0) -> tuple[int, L.SlotFields | None]:
        """Probe for ``raw`` in namespace ``ns`` (``fp`` is its :func:`layout.ns_fingerprint`):
        (slot index, slot fields) if resident, else (first empty, None)."""
        # Every name here is a local or a module global: attribute lookups were half of
        # a hit's 0.5 µs (a hit is one probe).
        mask, mm, alen = self._mask, self._mm, len(raw)
        i, base = fp & mask, self._slots_off
        for _ in range(self._nslots):
            off = base + i * _SLOT_SIZE
            s = _unpack_slot(mm, off)
            if s[F_STATE] == _SLOT_EMPTY:
                return i, None
            if s[F_FP] == fp and s[F_ALEN] == alen and s[F_NS] == ns:
                key = off + _SLOT_HEAD
                if mm[key : key + alen] == raw:
                    return i, s
            i = (i + 1) & mask
        raise SlabError(f"slot table of {self.name} is full or damaged: run eg-kv check")

    def open_block(self, address: str, ns: int = 0) -> BlockReader | None:
        """Look a block up for reading; None (a counted miss) if absent.

        The reader copies the bytes out without the lock, and a block evicted or released
        meanwhile ends the read with :class:`BlockGone`.
        """
        found = self._look(address, ns)
        if found is None:
            return None
        s, checksum = found
        return BlockReader(self, s[F_LENGTH], s[F_FIRST], s[F_NPAGES], s[F_BLOCK_ID], ns, checksum)

    def _find_summed(self, raw: bytes, fp: int, ns: int) -> tuple[int, L.SlotFields | None, int]:
        """:meth:`_find`, and the block's checksum (its slot's META) read in the same
        lock-free read: (slot, fields, checksum), or (empty slot, None, 0)."""
        i, s = self._find(raw, fp, ns)
        if s is None:
            return i, None, 0
        return i, s, _unpack_checksum(self._mm, self._slots_off + i * _SLOT_SIZE + _META)[0]

    def _look(
        self,
        address: str,
        ns: int,
        limit: int = UNLIMITED,
        use: bool = True,
        miss: bool = True,
    ) -> tuple[L.SlotFields, int] | None:
        """The block's slot fields and checksum, its use recorded; None: a counted miss.
        The hit is the caller's to count once the read ends whole (a read that breaks off
        is a miss: a hit counted at the start and taken back made ``get_hits`` go back, a
        counter reset to Prometheus). ``use`` False: the server's own read (a spill),
        neither counted nor a use that earns the block a second chance. ``miss`` False: a
        miss is the caller's to count (the disk tier may answer it:
        :meth:`eg_kv.slab.store.Slab.count_get`).

        Raises:
            Longer: the block is longer than ``limit`` bytes (nothing counted).
        """
        raw, fp = self._key(address, ns)
        i, s, checksum = self._read(self._find_summed, raw, fp, ns)
        if s is None:
            if use and miss:
                self._count_read(0, 1, ns)
            return None
        if s[F_LENGTH] > limit:
            raise Longer
        if use:
            self._touch(i)
        return s, checksum

    def read_or_open(
        self,
        address: str,
        ns: int = 0,
        limit: int = UNLIMITED,
        use: bool = True,
        miss: bool = True,
    ) -> tuple[int, bytes | BlockReader] | None:
        """The block's checksum, and a one-page block's bytes, copied, or a
        :class:`BlockReader` for a longer block; None (a counted miss) if absent.

        :meth:`open_block` and :meth:`BlockReader.read` in one call, for the server's GET:
        the reader object and its four calls were a tenth of a small GET's slab time.

        Args:
            limit: the longest block to read (the fast lane's: a longer one is streamed).
            use: False for the server's own reads (the disk keeper's spills): no hit or
                miss counted, no second chance given.
            miss: False: a miss is not counted (the caller counts the GET once the disk
                tier answered it).

        Raises:
            BlockGone: the one-page block was evicted or released while it was copied.
            Longer: the block is longer than ``limit`` (nothing read or counted).
        """
        found = self._look(address, ns, limit, use, miss)
        if found is None:
            return None
        s, checksum = found
        if s[F_NPAGES] != 1:
            return checksum, BlockReader(
                self, s[F_LENGTH], s[F_FIRST], s[F_NPAGES], s[F_BLOCK_ID], ns, checksum, use
            )
        first = s[F_FIRST]
        start = self._data_off + first * self.page_size
        data = self._mv[start : start + s[F_LENGTH]].tobytes()
        gone = self._tag[first] != s[F_BLOCK_ID]  # BlockReader.verify, inline
        if use:
            self._count_read(0 if gone else 1, 1 if gone else 0, ns)
        if gone:
            raise BlockGone("block was evicted while it was read")
        return checksum, data

    def get(self, address: str, ns: int = 0) -> bytes | None:
        """The block's bytes, or None if absent, evicted while it was read, or not the
        bytes stored (they fail the block's checksum: counted, see
        :meth:`_count_bad_checksum`)."""
        reader = self.open_block(address, ns)
        if reader is None:
            return None
        try:
            data = reader.read()
        except BlockGone:
            return None
        if checksum_of(data) != reader.checksum:
            self._count_bad_checksum(ns)
            return None
        reader.done()
        return data

    def length(self, address: str, ns: int = 0) -> int | None:
        """The block's length if resident, else None. Counts nothing, reads no data."""
        raw, fp = self._key(address, ns)
        s = self._read(self._find, raw, fp, ns)[1]
        return None if s is None else s[F_LENGTH]

    def refs(self, address: str, ns: int = 0) -> int:
        """The block's references if resident, else 0. Counts nothing, reads no data."""
        raw, fp = self._key(address, ns)
        s = self._read(self._find, raw, fp, ns)[1]
        return 0 if s is None else int(s[L.F_REFS])

    def describe(self, address: str, ns: int = 0) -> tuple[int, int] | None:
        """The block's (length, checksum) if resident, else None (a HEAD). Counts nothing,
        reads no data."""
        raw, fp = self._key(address, ns)
        _i, s, checksum = self._read(self._find_summed, raw, fp, ns)
        return None if s is None else (s[F_LENGTH], checksum)

    def spilled(self, address: str, ns: int = 0) -> bool:
        """Whether the block resident under ``address`` has a copy on the disk tier (its
        slot says so: :mod:`eg_kv.disk`). Counts nothing, reads no data."""
        raw, fp = self._key(address, ns)

        def flagged(raw: bytes, fp: int, ns: int) -> bool:
            i, s = self._find(raw, fp, ns)
            if s is None:
                return False
            off = self._slot_off(i) + L.SLOT_META_OFFSET + L.META_FLAGS_OFFSET
            return bool(self._mm[off] & L.META_SPILLED)

        return bool(self._read(flagged, raw, fp, ns))

    def exists(self, address: str, ns: int = 0) -> bool:
        """Whether a block is resident under ``address`` (no data touched)."""
        return self.length(address, ns) is not None

    def exists_many(self, addresses: Iterable[str], ns: int = 0) -> list[bool]:
        """Existence of each address, looked up in one pass (prefix lookups).

        Raises:
            InvalidAddress: see :func:`eg_kv.address.validate`.
        """
        return list(map(bool, self.block_ids(list(addresses), ns)[1]))

    def block_ids(self, addresses: list[str], ns: int = 0) -> tuple[int, list[int]]:
        """Each address's block id (0: absent), in one consistent read of the table, and
        the slab's sequence (``ST_SEQ``) it was read at.

        An address found before is checked where it was: its slot still ready and
        holding the same block id (ids are never reused, so that is the same block),
        one 9-byte read instead of a probe that compares the address (a 1,024-address
        lookup took 0.22 ms instead of 1.35 ms). Places are learned only from reads that
        held (the seqlock), and each namespace has its own memo, as with addresses.

        Raises:
            InvalidAddress: see :func:`eg_kv.address.validate`.
        """
        self._remember_new(addresses, ns)
        places = self._places[ns]
        seq, ids, found_at, slots = self._read(self._ids_of, addresses, ns, places)
        if slots:  # hits a probe found: where they lie, now that the read held
            keep = min(len(slots), self._key_cap)  # a batch of more: its first, up to the cap
            places = self._memo(self._places, _NO_PLACES, ns, keep)
            at = found_at[:keep]
            probed, blocks = [addresses[n] for n in at], [ids[n] for n in at]
            places.update(zip(probed, zip(slots[:keep], blocks, strict=True), strict=True))
        return seq, ids

    def _ids_of(
        self, addresses: list[str], ns: int, places: dict[str, tuple[int, int]]
    ) -> tuple[int, list[int], list[int], list[int]]:
        """:meth:`block_ids`'s lookup, for :meth:`_read`: the sequence, the ids, and the
        positions in ``addresses`` and slots of the hits that took a probe (learned only
        if the read holds)."""
        seq, mm, base = self._state[_ST_SEQ], self._mm, self._slots_off
        key, find = self._key, self._find
        ids: list[int] = []
        found_at: list[int] = []
        slots: list[int] = []
        place_of = places.get
        for n, address in enumerate(addresses):
            place = place_of(address)
            if place is not None:
                i, block = place
                if _unpack_state_and_id(mm, base + i * _SLOT_SIZE) == (_SLOT_READY, block):
                    ids.append(block)
                    continue
            raw, fp = key(address, ns)
            i, s = find(raw, fp, ns)
            if s is None:
                ids.append(0)
            else:
                ids.append(s[F_BLOCK_ID])
                found_at.append(n)
                slots.append(i)
        return seq, ids, found_at, slots


class BlockReader:
    """Reads one block out of the slab outside the lock; the block's tag says whether what
    was read is still the block's (see :mod:`eg_kv.slab.layout`)."""

    __slots__ = ("_pending", "_slab", "block_id", "checksum", "first", "length", "npages", "ns")

    def __init__(
        self, slab: SlabView, length: int, first: int, npages: int, block_id: int, ns: int = 0,
        checksum: int = 0, counted: bool = True,
    ) -> None:  # fmt: skip
        self._slab, self.length, self.first = slab, length, first
        self.npages, self.block_id, self.ns = npages, block_id, ns
        self.checksum = checksum  # of the block's bytes, as its slot says (eg_kv.checksum)
        # A client's read: counted once it ends, a hit (done) or a miss (gone); one that
        # neither ends nor breaks off (its client left) is not counted.
        self._pending = counted

    def still_there(self) -> bool:
        """True while the block has not been evicted or released since it was opened."""
        return self._slab._tag[self.first] == self.block_id

    def verify(self) -> None:
        """Raise :class:`BlockGone` (a counted miss) unless :meth:`still_there`."""
        if not self.still_there():
            raise self._gone()

    def done(self) -> None:
        """The read ended whole (and checked, where its caller checks the checksum):
        count its hit, once."""
        if self._pending:
            self._pending = False
            self._slab._count_read(1, 0, self.ns)

    def _gone(self) -> BlockGone:
        if self._pending:
            self._pending = False
            self._slab._count_read(0, 1, self.ns)
        return BlockGone("block was evicted while it was read")

    def runs(self, max_slice: int = DEFAULT_READ_SLICE) -> Iterator[tuple[int, int]]:
        """Yield the block's contiguous runs as (offset in the slab, size), each at most
        ``max_slice`` bytes, in order.

        Raises:
            BlockGone: the page chain broke off (the block was released meanwhile).
        """
        slab = self._slab
        nxt, ps, g = slab._next, slab.page_size, slab.geometry
        base, npages, length = g.data_off, g.npages, self.length
        p, pos, left = self.first, 0, self.npages
        while pos < length and left and 0 <= p < npages:
            start = base + p * ps
            size = 0
            # Gather pages that lie next to each other into one run.
            while left and size < max_slice and base + p * ps == start + size:
                size += min(ps, length - pos - size)
                left -= 1
                if left:
                    p = nxt[p]
                    if not 0 <= p < npages:
                        break
            pos += size
            yield start, size
        if pos < length:
            raise self._gone()

    def views(self, max_slice: int = DEFAULT_READ_SLICE) -> Iterator[memoryview]:
        """Yield zero-copy views of the block's contiguous runs (each <= ``max_slice``).

        The views are slab memory: they are the block's bytes only if :meth:`still_there`
        is true *after* they were last read. A caller that hands them on (a socket send)
        must check it once they are consumed, and treat False as a miss.

        Raises:
            BlockGone: the page chain broke off (the block was released meanwhile).
        """
        mv = self._slab._mv
        for start, size in self.runs(max_slice):
            yield mv[start : start + size]

    def aligned_views(self, align: int) -> list[memoryview] | None:
        """The block's runs as views whose starts and sizes are multiples of ``align`` (the
        last run's view goes on past the block's end to the next multiple, within its own
        page), for an O_DIRECT write straight from the slab; None where the slab's pages
        are not multiples of ``align``. The same caveat as :meth:`views`: the bytes are
        the block's only if :meth:`still_there` after they were written out.

        Raises:
            BlockGone: the page chain broke off.
        """
        slab = self._slab
        if slab.page_size % align or slab.geometry.data_off % align:
            return None
        mv = slab._mv
        runs = list(self.runs(1 << 62))
        if runs:
            start, size = runs[-1]
            runs[-1] = (start, -(-size // align) * align)
        return [mv[start : start + size] for start, size in runs]

    def slices(self, max_slice: int = DEFAULT_READ_SLICE) -> Iterator[bytes]:
        """Yield the block's bytes in copies of about ``max_slice`` bytes each.

        Scattered runs are gathered into one copy (``b"".join`` of views: one memcpy each).

        Raises:
            BlockGone: the block was evicted or released meanwhile (the bytes already
                yielded were the block's; the caller must treat the whole read as a miss).
        """
        pending: list[memoryview] = []
        size = 0
        for view in self.views(max_slice):
            pending.append(view)
            size += len(view)
            if size >= max_slice:
                data = b"".join(pending)
                pending.clear()
                size = 0
                self.verify()
                yield data
        if pending:
            data = b"".join(pending)
            self.verify()
            yield data

    def read(self) -> bytes:
        """The whole block in one copy.

        Raises:
            BlockGone: the block was evicted or released meanwhile.
        """
        slab = self._slab
        if self.npages == 1:  # a small block: one slice, no generator
            start = slab.geometry.data_off + self.first * slab.page_size
            data = slab._mv[start : start + self.length].tobytes()
        else:
            data = b"".join(self.views(self.length))
        self.verify()
        return data

    def read_into(self, buf: memoryview) -> int:
        """Copy the whole block into ``buf`` (at least :attr:`length` bytes, byte format).

        Returns:
            The block's length.

        Raises:
            BlockGone: the block was evicted or released meanwhile (``buf`` then holds
                bytes that are not the block's: the caller must treat it as a miss).
        """
        pos = 0
        for view in self.views(self.length):
            n = len(view)
            buf[pos : pos + n] = view
            pos += n
        self.verify()
        return pos
