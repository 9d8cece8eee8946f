"""The shared-memory slab: one block store for every process on the host.

Lifecycle: :meth:`Slab.create` (the supervisor), :meth:`Slab.attach` (every worker, by
name), :meth:`Slab.close` in each process, :meth:`Slab.unlink` once.

Concurrency: every metadata change happens under one slab lock, an open-file-description
byte lock on the segment's fd (``F_OFD_SETLKW``), which the kernel releases when its
holder dies. The holder writes its pid into the header on entry and clears it on exit;
whoever next takes the lock and finds a pid there knows a process died inside the
critical section and repairs the slab before going on. Bulk bytes move outside the lock:
a put fills pages it reserved, a get copies slices out and then checks the block's tag
(see :mod:`eg_kv.layout`), so no reader ever returns bytes that were not the block's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import platform
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import posix_ipc

from . import layout as L
from .address import fingerprint, validate
from .config import DEFAULT_MAX_BLOCK_SIZE, DEFAULT_PAGE_SIZE, format_size
from .errors import (
    BadRequest,
    Busy,
    Conflict,
    InsufficientStorage,
    NotFound,
    SlabError,
    TooLarge,
)

# struct flock for F_OFD_SETLKW: l_type, l_whence, l_start, l_len, l_pid (must be 0).
_FLOCK = struct.Struct("hhqqi4x")
_LOCK = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
_UNLOCK = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels fall back to touching each page
_OS_PAGE = mmap.PAGESIZE
DEFAULT_READ_SLICE = 1024 * 1024
_CLOCK_STRIDE = 0x9E3779B1  # odd: hand * stride mod 2**k visits every slot once per sweep
_T = TypeVar("_T")
#: Blocks up to this size are stored by :meth:`Slab.put` in one critical section, copy
#: included: a second lock round trip cost more than the copy (scripts/bench_server.py).
SMALL_PUT = 64 * 1024
_KEY_CACHE = 16384  # addresses whose validated bytes and fingerprint a handle remembers
_SPINS = 50  # non-blocking lock attempts (with a yield between) before sleeping on it
# Lock-free lookups rely on x86's ordering of loads and of stores (see Slab._read).
_LOCKFREE_READS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class BlockGone(NotFound):
    """The block was evicted or released while it was being read: a miss."""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (``kill(pid, 0)`` says zombies live)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def _check_page_size(page_size: int) -> None:
    if page_size < _OS_PAGE or page_size & (page_size - 1):
        raise SlabError(
            f"page size {page_size} must be a power of two of at least {_OS_PAGE} bytes"
        )


class Slab:
    """A handle on the slab from one process. Not shared across ``fork``: attach anew.

    Threads of one process may share a handle: a thread lock sits on top of the slab lock
    (an OFD lock does not exclude threads that share the fd).
    """

    # ------------------------------------------------------------------ lifecycle

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, geometry: L.Geometry):
        self.name = name
        self.geometry = g = geometry
        self._fd = shm.fd
        self._mm = mmap.mmap(shm.fd, g.total_size)
        self._mv = memoryview(self._mm)
        self._state = self._mv[L.STATE_OFFSET : L.STATE_OFFSET + 8 * L.STATE_WORDS].cast("q")
        self._next = self._mv[g.next_off : g.next_off + 8 * g.npages].cast("q")
        self._tag = self._mv[g.tag_off : g.tag_off + 8 * g.npages].cast("Q")
        self._procs = self._mv[L.PROCS_OFFSET : L.HEADER_SIZE].cast("q")
        self._me = -1  # this handle's entry in the PROCS table once claimed (-2: none free)
        self._keys: dict[str, tuple[bytes, int]] = {}
        self._tlock = threading.Lock()
        self._pid = os.getpid()
        self._mask = g.nslots - 1
        self.page_size = g.page_size
        self.max_block_size = g.max_block_size
        self.closed = False

    @classmethod
    def create(
        cls,
        name: str,
        capacity: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
        *,
        prefault: bool = True,
        shm_dir: str = "/dev/shm",
    ) -> Slab:
        """Create a new slab whose data area holds ``capacity`` bytes.

        Checks that ``shm_dir`` has room, allocates every byte (so the tmpfs can never run
        out later and SIGBUS a process), and pre-faults the pages.

        Raises:
            SlabError: bad geometry, a segment of that name exists, or no room.
        """
        _check_page_size(page_size)
        if capacity < page_size:
            raise SlabError(f"capacity {capacity} is smaller than one page ({page_size})")
        if max_block_size < 1:
            raise SlabError("max block size must be at least 1 byte")
        g = L.Geometry.plan(capacity, page_size, max_block_size)
        try:
            st = os.statvfs(shm_dir)
        except OSError:
            st = None
        if st is not None and st.f_bavail * st.f_frsize < g.total_size:
            raise SlabError(
                f"{shm_dir} has {format_size(st.f_bavail * st.f_frsize)} free but the slab "
                f"needs {format_size(g.total_size)}: lower --capacity or enlarge {shm_dir} "
                "(docker: shm_size)"
            )
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            raise SlabError(
                f"a slab named {name} exists already: attach to it, or remove it first "
                "(eg-kv serve --fresh)"
            ) from None
        try:
            os.ftruncate(shm.fd, g.total_size)
            try:
                os.posix_fallocate(shm.fd, 0, g.total_size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise SlabError(
                        f"no room for a {format_size(g.total_size)} slab in {shm_dir}: "
                        "lower --capacity or enlarge it"
                    ) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            slab = cls(name, shm, g)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        if prefault:
            slab._prefault()
        slab._format()
        return slab

    @classmethod
    def attach(cls, name: str, *, prefault: bool = False) -> Slab:
        """Attach to an existing slab by name.

        ``prefault`` fills this process's page tables for the whole segment up front
        (about 0.2 s per GiB here) instead of taking a fault on each first touch, which
        halved the rate of a new process's first 14 MiB puts (measured).

        Raises:
            SlabError: no such segment, or one that is not an eg-kv slab of this layout.
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SlabError(f"no slab named {name}: start the server (eg-kv serve) first") from None
        try:
            size = os.fstat(shm.fd).st_size
            if size < L.HEADER_SIZE:
                raise SlabError(f"{name} is not an eg-kv slab (only {size} bytes)")
            with mmap.mmap(shm.fd, L.HEADER_SIZE) as head:
                magic, version, g = L.Geometry.unpack(head[: L.GEOMETRY.size])
            if magic != L.MAGIC:
                raise SlabError(
                    f"{name} is not an eg-kv slab (bad magic): pick another --slab-name"
                )
            if version != L.VERSION:
                raise SlabError(
                    f"{name} has slab layout version {version}, this eg-kv reads "
                    f"{L.VERSION}: restart the server with --fresh to recreate it"
                )
            if g.total_size != size:
                raise SlabError(
                    f"{name} is {size} bytes but its header says {g.total_size}: "
                    "it is damaged; restart the server with --fresh"
                )
            slab = cls(name, shm, g)
        except BaseException:
            shm.close_fd()
            raise
        if prefault:
            slab._prefault()
        return slab

    @staticmethod
    def exists_named(name: str) -> bool:
        try:
            posix_ipc.SharedMemory(name).close_fd()
        except posix_ipc.ExistentialError:
            return False
        return True

    @staticmethod
    def unlink_named(name: str) -> bool:
        """Remove the segment ``name`` if it exists; return whether it did."""
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            return False
        return True

    def close(self) -> None:
        """Unmap and close this process's handle. Idempotent. The segment stays."""
        if self.closed:
            return
        with contextlib.suppress(SlabError, OSError):
            self._release_proc_entry()
        self.closed = True
        for view in (self._state, self._procs, self._next, self._tag, self._mv):
            view.release()
        with contextlib.suppress(BufferError):  # a reader holds a view; the GC unmaps it
            self._mm.close()
        os.close(self._fd)

    def unlink(self) -> None:
        """Remove the segment's name; processes that have it mapped keep their mapping."""
        self.unlink_named(self.name)

    def __enter__(self) -> Slab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def owner_pid(self) -> int:
        return self._state[L.ST_OWNER_PID]

    def claim(self) -> None:
        """Make this process the slab's owner (a supervisor re-attaching a warm slab)."""
        with self._locked():
            self._state[L.ST_OWNER_PID] = self._pid

    def _prefault(self) -> None:
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            step = _OS_PAGE
            n = len(range(0, self.geometry.total_size, step))
            self._mv[::step] = bytes(n)

    def _format(self) -> None:
        g = self.geometry
        self._mv[: L.GEOMETRY.size] = g.pack(time.time())
        st = self._state
        for i in range(L.STATE_WORDS):
            st[i] = 0
        st[L.ST_OWNER_PID] = self._pid
        st[L.ST_NEXT_BLOCK_ID] = 1
        self._mv[L.PROCS_OFFSET : L.HEADER_SIZE] = bytes(L.HEADER_SIZE - L.PROCS_OFFSET)
        self._mv[g.resv_off : g.next_off] = bytes(g.next_off - g.resv_off)
        self._rebuild_free_list(bytearray(g.npages))

    def _key(self, address: str) -> tuple[bytes, int]:
        """The address's ASCII bytes and fingerprint, validated once and then remembered
        (a regex and a BLAKE2b per request were a tenth of a small GET's slab time).

        Raises:
            InvalidAddress: see :func:`eg_kv.address.validate`.
        """
        key = self._keys.get(address)
        if key is None:
            raw = validate(address)
            key = (raw, fingerprint(raw))
            if len(self._keys) >= _KEY_CACHE:
                self._keys.clear()
            self._keys[address] = key
        return key

    # ------------------------------------------------------------------ the lock

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the slab lock; repair first if the previous holder died inside."""
        if self.closed:
            raise SlabError("the slab handle is closed")
        with self._tlock:
            self._acquire()
            try:
                st = self._state
                dead = st[L.ST_LOCK_HOLDER]
                st[L.ST_LOCK_HOLDER] = self._pid
                st[L.ST_SEQ] |= 1  # odd: lock-free readers retry (stays odd if holder died)
                if dead:
                    self._repair_locked()
                yield
            finally:
                st[L.ST_SEQ] += 1
                st[L.ST_LOCK_HOLDER] = 0
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _UNLOCK)

    def _acquire(self) -> None:
        # Try without sleeping first: a sleeping waiter is woken only to find the lock
        # taken again by a holder that never left the CPU, and that convoy cut two-process
        # put rates by 10x (measured). Yielding lets the holder finish its few microseconds.
        for _ in range(_SPINS):
            try:
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _LOCK)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                os.sched_yield()
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _LOCK)

    # ------------------------------------------------------------------ slots

    def _slot_off(self, i: int) -> int:
        return self.geometry.slots_off + i * L.SLOT_SIZE

    def _read_slot(self, i: int) -> tuple:
        return L.SLOT.unpack_from(self._mm, self._slot_off(i))

    def _slot_address(self, i: int, alen: int) -> bytes:
        off = self._slot_off(i) + L.SLOT.size
        return self._mm[off : off + alen]

    def _find(self, raw: bytes, fp: int) -> tuple[int, tuple | None]:
        """Probe for ``raw``: (slot index, slot fields) if resident, else (first empty, None)."""
        mask, mm, unpack = self._mask, self._mm, L.SLOT.unpack_from
        i, base = fp & mask, self.geometry.slots_off
        for _ in range(self.geometry.nslots):
            off = base + i * L.SLOT_SIZE
            s = unpack(mm, off)
            if s[0] == L.SLOT_EMPTY:
                return i, None
            key = off + L.SLOT.size
            if s[8] == fp and s[2] == len(raw) and mm[key : key + s[2]] == raw:
                return i, s
            i = (i + 1) & mask
        raise SlabError(f"slot table of {self.name} is full or damaged: run eg-kv check")

    def _write_slot(self, i, refbit, raw, refs, length, first, npages, block_id, fp) -> None:
        off = self._slot_off(i)
        # Fields and address first, the READY state byte last: a reader never sees half.
        L.SLOT.pack_into(self._mm, off, L.SLOT_EMPTY, refbit, len(raw), refs, length, first,
                         npages, block_id, fp)  # fmt: skip
        self._mm[off + L.SLOT.size : off + L.SLOT.size + len(raw)] = raw
        self._mm[off] = L.SLOT_READY

    def _remove_slot(self, i: int) -> None:
        """Empty slot ``i`` with backward-shift deletion (no tombstones)."""
        mask, ss = self._mask, L.SLOT_SIZE
        while True:
            j = i
            while True:
                j = (j + 1) & mask
                s = self._read_slot(j)
                if s[0] == L.SLOT_EMPTY:
                    self._mm[self._slot_off(i)] = L.SLOT_EMPTY
                    return
                home = s[8] & mask
                # Entry j may move into the hole at i unless its home lies in (i, j].
                if (i < home <= j) if i <= j else (home > i or home <= j):
                    continue
                oi, oj = self._slot_off(i), self._slot_off(j)
                self._mm[oi : oi + ss] = self._mm[oj : oj + ss]
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

    def _rebuild_free_list(self, owned: bytearray) -> None:
        """Link every page not marked in ``owned`` into the free list, in page order."""
        nxt, tag, head, count = self._next, self._tag, L.NO_PAGE, 0
        for p in range(self.geometry.npages - 1, -1, -1):
            if not owned[p]:
                nxt[p] = head
                tag[p] = 0
                head = p
                count += 1
        self._state[L.ST_FREE_HEAD] = head
        self._state[L.ST_FREE_COUNT] = count

    def _npages(self, length: int) -> int:
        return -(-length // self.page_size)

    def _drop_block(self, i: int, s: tuple) -> None:
        """Release slot ``i``'s block entirely (last delete or eviction)."""
        st = self._state
        self._free_pages(s[5], s[6])
        self._remove_slot(i)
        st[L.ST_UNIQUE_BLOCKS] -= 1
        st[L.ST_TOTAL_REFS] -= s[3]
        st[L.ST_RESIDENT_BYTES] -= s[4]
        st[L.ST_LOGICAL_BYTES] -= s[4] * s[3]
        st[L.ST_SLOT_PAGES] -= s[6]

    def _make_room(self, n: int) -> None:
        """Free pages until ``n`` are free, evicting by CLOCK (second chance).

        Raises:
            InsufficientStorage: even evicting every published block would not free enough.
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
        mask, hand, mm, base = self._mask, st[L.ST_CLOCK_HAND], self._mm, self.geometry.slots_off
        while st[L.ST_FREE_COUNT] < n:
            i = (hand * _CLOCK_STRIDE) & mask
            off = base + i * L.SLOT_SIZE
            if mm[off] == L.SLOT_READY:
                if mm[off + L.SLOT_REF_OFFSET]:
                    mm[off + L.SLOT_REF_OFFSET] = 0  # second chance
                else:
                    s = self._read_slot(i)
                    self._drop_block(i, s)
                    st[L.ST_EVICTIONS] += 1
                    st[L.ST_EVICTED_BYTES] += s[4]
                    continue  # backward shift may have moved another block into slot i
            hand = (hand + 1) & mask
        st[L.ST_CLOCK_HAND] = hand

    # ------------------------------------------------------------------ reservations

    def _resv_off(self, r: int) -> int:
        return self.geometry.resv_off + r * L.RESV_SIZE

    def _reserve(self, first: int, npages: int, length: int) -> int:
        st, nr = self._state, self.geometry.nresv
        start = st[L.ST_RESV_HINT]
        for k in range(nr):
            r = (start + k) % nr
            if L.RESV.unpack_from(self._mm, self._resv_off(r))[0] == 0:
                L.RESV.pack_into(self._mm, self._resv_off(r), self._pid, first, npages, length)
                st[L.ST_RESV_HINT] = (r + 1) % nr
                st[L.ST_RESV_PAGES] += npages
                return r
        return -1

    def _unreserve(self, r: int) -> tuple[int, int]:
        """Clear reservation ``r``; return its (first page, page count)."""
        _pid, first, npages, _len = L.RESV.unpack_from(self._mm, self._resv_off(r))
        L.RESV.pack_into(self._mm, self._resv_off(r), 0, L.NO_PAGE, 0, 0)
        self._state[L.ST_RESV_PAGES] -= npages
        return first, npages

    def _release_dead_reservations(self) -> int:
        """Give back the pages of puts whose writer died. Returns how many were released."""
        released = 0
        for r in range(self.geometry.nresv):
            pid = L.RESV.unpack_from(self._mm, self._resv_off(r))[0]
            if pid and pid != self._pid and not pid_alive(pid):
                first, npages = self._unreserve(r)
                self._free_pages(first, npages)
                released += 1
        return released

    # ------------------------------------------------------------------ put

    def begin_put(self, address: str, length: int) -> PutHandle:
        """Start a streaming put of ``length`` bytes under ``address``.

        Returns a :class:`PutHandle`: ``write`` the bytes, then ``commit`` (or ``abort``).
        A resident block of the same length makes it a dedup hit that stores nothing.

        Raises:
            InvalidAddress, TooLarge (before any byte is stored), Conflict (resident with
            another length), InsufficientStorage, Busy (too many puts in flight).
        """
        raw, fp = self._key(address)
        n = self._pages_for(length)
        with self._locked():
            _i, s = self._find(raw, fp)
            if s is not None:
                if s[4] != length:
                    raise Conflict(_conflict_message(address, s[4], length))
                return PutHandle(self, address, raw, fp, length, -1, L.NO_PAGE, 0)
            self._make_room(n)
            first = self._alloc_pages(n)
            r = self._reserve(first, n, length)
            if r < 0:
                self._free_pages(first, n)
                raise Busy("too many uploads in flight; retry")
        return PutHandle(self, address, raw, fp, length, r, first, n)

    def put(self, address: str, data) -> bool:
        """Store ``data`` under ``address`` in one call; True if created, False if dedup.

        Up to :data:`SMALL_PUT` bytes are looked up, copied in and published in one
        critical section; larger blocks go through :meth:`begin_put`, copied outside it.

        Raises:
            The same as :meth:`begin_put`.
        """
        length = len(data)
        if length > SMALL_PUT:
            handle = self.begin_put(address, length)
            try:
                handle.write(data)
                return handle.commit()
            finally:
                handle.abort()
        raw, fp = self._key(address)
        n = self._pages_for(length)
        with self._locked():
            i, s = self._find(raw, fp)
            if s is not None:
                return self._add_ref(i, s, address, length)
            if self._state[L.ST_FREE_COUNT] < n:
                self._make_room(n)
                i = self._find(raw, fp)[0]  # evictions may have moved the empty slot
            first = self._alloc_pages(n)
            src, mv = memoryview(data).cast("B"), self._mv
            for pos, off, size in _runs(self, first, n, length):
                mv[off : off + size] = src[pos : pos + size]
            # A crash before the slot is written leaves pages no slot owns: repair frees them.
            self._publish(i, raw, fp, length, first, n)
            return True

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

    def _add_ref(self, i: int, s: tuple, address: str, length: int) -> bool:
        """A dedup hit on slot ``i`` (fields ``s``): one more reference. Returns False.

        Raises:
            Conflict: the resident block has another length.
        """
        if s[4] != length:
            raise Conflict(_conflict_message(address, s[4], length))
        L.SLOT.pack_into(self._mm, self._slot_off(i), L.SLOT_READY, 1, *s[2:3], s[3] + 1, *s[4:])
        st = self._state
        st[L.ST_TOTAL_REFS] += 1
        st[L.ST_LOGICAL_BYTES] += length
        st[L.ST_DEDUP_HITS] += 1
        return False

    def _publish(self, i: int, raw: bytes, fp: int, length: int, first: int, npages: int) -> None:
        """Make the block on pages ``first``.. visible in empty slot ``i``, and count it."""
        st = self._state
        block_id = st[L.ST_NEXT_BLOCK_ID]
        st[L.ST_NEXT_BLOCK_ID] = block_id + 1
        self._tag[first] = block_id
        self._write_slot(i, 0, raw, 1, length, first, npages, block_id, fp)
        st[L.ST_UNIQUE_BLOCKS] += 1
        st[L.ST_TOTAL_REFS] += 1
        st[L.ST_RESIDENT_BYTES] += length
        st[L.ST_LOGICAL_BYTES] += length
        st[L.ST_SLOT_PAGES] += npages
        st[L.ST_PUTS_CREATED] += 1

    def _commit(self, h: PutHandle) -> bool:
        with self._locked():
            i, s = self._find(h.raw, h.fp)
            if s is not None:
                if h.resv >= 0:
                    first, npages = self._unreserve(h.resv)
                    self._free_pages(first, npages)
                return self._add_ref(i, s, h.address, h.length)
            if h.resv < 0:
                raise Busy(f"block {h.address} was evicted while its duplicate was uploaded; retry")
            # Publish the slot before giving up the reservation: a crash in between leaves
            # both claiming the pages, and repair lets the published slot win.
            self._publish(i, h.raw, h.fp, h.length, h.first, h.npages)
            self._unreserve(h.resv)
            return True

    def _abort(self, h: PutHandle) -> None:
        if h.resv < 0:
            return
        with self._locked():
            first, npages = self._unreserve(h.resv)
            self._free_pages(first, npages)

    # ------------------------------------------------------------------ get / exists / delete

    def _read(self, lookup: Callable[[], _T]) -> _T:
        """Run a read-only ``lookup`` of the slot table, without the lock if it can.

        Every critical section makes ST_SEQ odd on entry and even on exit (a seqlock). A
        lookup that saw the same even value before and after read a table no writer
        touched meanwhile, so what it read belongs together; otherwise it runs again
        under the lock. (x86 keeps loads in order and stores in order, which is all a
        seqlock needs; elsewhere every lookup takes the lock.)
        """
        if _LOCKFREE_READS:
            st = self._state
            seq = st[L.ST_SEQ]
            if not seq & 1:
                try:
                    result = lookup()
                except SlabError:  # a torn view of a table being rebuilt
                    pass
                else:
                    if st[L.ST_SEQ] == seq:
                        return result
        with self._locked():
            return lookup()

    def _count_read(self, hit: int, miss: int) -> None:
        """Count get hits and misses in this process's own entry (no lock, one writer)."""
        me = self._me if self._me != -1 else self._claim_proc_entry()
        if me < 0:
            with self._locked():
                self._state[L.ST_GET_HITS] += hit
                self._state[L.ST_GET_MISSES] += miss
            return
        procs = self._procs
        with self._tlock:  # threads sharing this handle share its entry
            procs[me + 1] += hit
            procs[me + 2] += miss

    def _claim_proc_entry(self) -> int:
        """Take a free PROCS entry (folding a dead process's counts into the totals)."""
        procs, st = self._procs, self._state
        with self._locked():
            for e in range(0, L.NPROCS * L.PROC_WORDS, L.PROC_WORDS):
                pid = procs[e]
                if pid and pid_alive(pid):  # taken (by another handle of ours too)
                    continue
                st[L.ST_GET_HITS] += procs[e + 1]
                st[L.ST_GET_MISSES] += procs[e + 2]
                procs[e + 1] = procs[e + 2] = 0
                procs[e] = self._pid
                self._me = e
                return e
        self._me = -2  # more than NPROCS handles: this one counts under the lock
        return -2

    def _release_proc_entry(self) -> None:
        if self._me < 0:  # -1: never claimed, -2: none was free
            return
        procs, st, e = self._procs, self._state, self._me
        with self._locked():
            st[L.ST_GET_HITS] += procs[e + 1]
            st[L.ST_GET_MISSES] += procs[e + 2]
            procs[e + 1] = procs[e + 2] = procs[e] = 0
        self._me = -1

    def open_block(self, address: str) -> BlockReader | None:
        """Look a block up for reading; None (a counted miss) if absent.

        The lookup needs no lock unless a writer is busy (see :meth:`_read`);
        the reader copies the bytes out outside the lock, and a block evicted or released
        meanwhile ends the read with :class:`BlockGone`.
        """
        raw, fp = self._key(address)
        i, s = self._read(lambda: self._find(raw, fp))
        if s is None:
            self._count_read(0, 1)
            return None
        # The CLOCK reference bit, set without the lock: at worst a block that moved into
        # this slot meanwhile gets a second chance it did not earn.
        self._mm[self._slot_off(i) + L.SLOT_REF_OFFSET] = 1
        self._count_read(1, 0)
        return BlockReader(self, s[4], s[5], s[6], s[7])

    def get(self, address: str) -> bytes | None:
        """The block's bytes, or None if absent (or evicted while it was read)."""
        reader = self.open_block(address)
        if reader is None:
            return None
        try:
            return reader.read()
        except BlockGone:
            return None

    def length(self, address: str) -> int | None:
        """The block's length if resident, else None. Counts nothing, reads no data."""
        raw, fp = self._key(address)
        s = self._read(lambda: self._find(raw, fp))[1]
        return None if s is None else s[4]

    def exists(self, address: str) -> bool:
        """Whether a block is resident under ``address`` (no data touched)."""
        return self.length(address) is not None

    def exists_many(self, addresses: Iterable[str]) -> list[bool]:
        """Existence of each address, looked up in one pass (prefix lookups)."""
        keys = [self._key(a) for a in addresses]
        return self._read(lambda: [self._find(raw, fp)[1] is not None for raw, fp in keys])

    def delete(self, address: str) -> bool:
        """Release one reference; free the block when the last goes. False if absent."""
        raw, fp = self._key(address)
        st = self._state
        with self._locked():
            i, s = self._find(raw, fp)
            if s is None:
                return False
            st[L.ST_DELETES] += 1
            if s[3] <= 1:
                self._drop_block(i, s)
            else:
                L.SLOT.pack_into(self._mm, self._slot_off(i), *s[:3], s[3] - 1, *s[4:])
                st[L.ST_TOTAL_REFS] -= 1
                st[L.ST_LOGICAL_BYTES] -= s[4]
            return True

    def _count_aborted_read(self) -> None:
        self._count_read(-1, 1)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, int]:
        """Exact counters over the whole slab (the seed's eight fields and more)."""
        st, ps = self._state, self.page_size
        with self._locked():
            out = {k: st[i] for k, i in L.DERIVED_COUNTERS.items()}
            out.update({k: st[i] for k, i in L.EVENT_COUNTERS.items()})
            free = st[L.ST_FREE_COUNT]
            procs = self._procs
            for e in range(0, L.NPROCS * L.PROC_WORDS, L.PROC_WORDS):
                out["get_hits"] += procs[e + 1]
                out["get_misses"] += procs[e + 2]
        out["dedup_savings_bytes"] = out["logical_bytes"] - out["resident_bytes"]
        out["capacity_bytes"] = self.geometry.npages * ps
        out["free_bytes"] = free * ps
        out["page_size"] = ps
        out["max_block_size"] = self.max_block_size
        # Every block takes whole pages: what its last page leaves empty is lost. Small
        # blocks in big pages waste most of the slab (1 KiB chunks in 64 KiB pages: 98%).
        out["pages_used_bytes"] = out["slot_pages"] * ps
        out["page_waste_bytes"] = out["pages_used_bytes"] - out["resident_bytes"]
        return out

    # ------------------------------------------------------------------ check / repair

    def check(self) -> list[str]:
        """Walk the whole slab; return every invariant that does not hold (empty = clean)."""
        with self._locked():
            return self._walk(fix=False)

    def repair(self) -> list[str]:
        """Restore every invariant; return what was wrong before (empty = was clean).

        The slot table is the source of truth: damaged slots are dropped (counted as
        evictions), reservations of dead writers are released, the free list, the table's
        probe order and the derived counters are rebuilt.
        """
        with self._locked():
            return self._repair_locked()

    def _repair_locked(self) -> list[str]:
        problems = self._walk(fix=False)
        if problems:
            self._walk(fix=True)
            self._state[L.ST_REPAIRS] += 1
        return problems

    def _walk(self, fix: bool) -> list[str]:
        g, st, nxt, tag, mm = self.geometry, self._state, self._next, self._tag, self._mm
        problems: list[str] = []
        owner = bytearray(g.npages)  # 0 free, 1 slot, 2 reservation
        live: list[tuple] = []
        seen: set[bytes] = set()
        totals = dict.fromkeys(L.DERIVED_COUNTERS, 0)

        def claim(first: int, npages: int, who: int, what: str) -> bool:
            p, pages = first, []
            for k in range(npages):
                if not 0 <= p < g.npages:
                    problems.append(f"{what}: page {k} of its chain is {p}, out of range")
                elif owner[p]:
                    problems.append(f"{what}: page {p} is in two chains")
                else:
                    owner[p] = who
                    pages.append(p)
                    p = nxt[p]
                    continue
                for q in pages:  # roll back: a damaged chain owns nothing
                    owner[q] = 0
                return False
            return True

        for i in range(g.nslots):
            s = self._read_slot(i)
            if s[0] == L.SLOT_EMPTY:
                continue
            state, refbit, alen, refs, length, first, npages, block_id, fp = s
            raw = self._slot_address(i, min(alen, L.ADDRESS_MAX))
            what = f"slot {i} ({raw[:40].decode('ascii', 'replace')})"
            bad = None
            if state != L.SLOT_READY or not 1 <= alen <= L.ADDRESS_MAX:
                bad = f"{what}: bad state {state} or address length {alen}"
            elif fingerprint(raw) != fp:
                bad = f"{what}: fingerprint does not match the address"
            elif raw in seen:
                bad = f"{what}: address stored twice"
            elif length < 1 or npages != self._npages(length) or refs < 1:
                bad = f"{what}: {npages} pages / {refs} refs for {length} bytes"
            elif not 0 <= first < g.npages:
                bad = f"{what}: first page {first} out of range"
            elif tag[first] != block_id:
                bad = f"{what}: tag {tag[first]} is not its block id {block_id}"
            elif not fix and self._find(raw, fp)[0] != i:
                bad = f"{what}: not reachable from its home slot"
            if bad is None and claim(first, npages, 1, what):
                seen.add(raw)
                live.append((refbit, raw, refs, length, first, npages, block_id, fp))
                for key, val in (
                    ("unique_blocks", 1), ("total_refs", refs), ("resident_bytes", length),
                    ("logical_bytes", length * refs), ("slot_pages", npages),
                ):  # fmt: skip
                    totals[key] += val
                continue
            if bad is not None:
                problems.append(bad)
            if fix and raw not in seen:  # a dropped block counts as evicted; a copy does not
                st[L.ST_EVICTIONS] += 1
                st[L.ST_EVICTED_BYTES] += length if 0 < length <= g.max_block_size else 0

        for r in range(g.nresv):
            pid, first, npages, length = L.RESV.unpack_from(mm, self._resv_off(r))
            if not pid:
                continue
            what = f"reservation {r} (pid {pid})"
            if pid != self._pid and not pid_alive(pid):
                problems.append(f"{what}: its writer is dead")
                ok = False
            else:
                ok = claim(first, npages, 2, what)
            if ok:
                totals["reserved_pages"] += npages
            elif fix:
                L.RESV.pack_into(mm, self._resv_off(r), 0, L.NO_PAGE, 0, 0)

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
            holder = st[L.ST_LOCK_HOLDER]
            if holder and holder != self._pid:
                problems.append(f"lock holder {holder} recorded but not holding")
            return problems

        # fix: rebuild the table in probe order, then the free list and the counters.
        mv = self._mv
        mv[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE] = bytes(g.nslots * L.SLOT_SIZE)
        for refbit, raw, refs, length, first, npages, block_id, fp in live:
            i = self._find(raw, fp)[0]
            self._write_slot(i, refbit, raw, refs, length, first, npages, block_id, fp)
        for p in range(g.npages):
            if owner[p]:
                tag[p] = 0
        for _refbit, _raw, _refs, _length, first, _npages, block_id, _fp in live:
            tag[first] = block_id
        self._rebuild_free_list(owner)
        for key, idx in L.DERIVED_COUNTERS.items():
            st[idx] = totals[key]
        st[L.ST_CLOCK_HAND] = st[L.ST_CLOCK_HAND] & self._mask
        return problems


def _conflict_message(address: str, resident: int, wanted: int) -> str:
    return (
        f"block {address} is resident with {resident} bytes, not {wanted}: "
        "delete it first or use another address"
    )


class PutHandle:
    """A put in flight: ``write`` chunks in order, then ``commit`` or ``abort``.

    ``abort`` after ``commit`` does nothing, so ``finally: handle.abort()`` is safe.
    """

    __slots__ = ("_run", "_runs", "_slab", "address", "done", "first", "fp", "length", "npages",
                 "pos", "raw", "resv")  # fmt: skip

    def __init__(self, slab, address, raw, fp, length, resv, first, npages):
        self._slab, self.address, self.raw, self.fp = slab, address, raw, fp
        self.length, self.resv, self.first, self.npages = length, resv, first, npages
        self.pos = self._run = 0
        self.done = False
        self._runs = None if resv < 0 else _runs(slab, first, npages, length)

    def write(self, chunk) -> None:
        """Copy ``chunk`` into the block's pages at the current position.

        Raises:
            BadRequest: more bytes than the announced length.
        """
        n = len(chunk)
        if self.pos + n > self.length:
            raise BadRequest(f"body is longer than its announced length {self.length}")
        if self._runs is not None and n:
            src, mv = memoryview(chunk).cast("B"), self._slab._mv
            cur, end, runs, r = self.pos, self.pos + n, self._runs, self._run
            while cur < end:
                start, off, size = runs[r]
                if cur >= start + size:  # this run is full: move on
                    r += 1
                    continue
                a = cur - start
                k = min(size - a, end - cur)
                mv[off + a : off + a + k] = src[cur - self.pos : cur - self.pos + k]
                cur += k
            self._run = r
        self.pos += n

    def commit(self) -> bool:
        """Publish the block. True if this put created it, False if it was a dedup hit.

        Raises:
            BadRequest: fewer bytes were written than announced (nothing is published).
            Conflict: a block of another length was published meanwhile.
            Busy: a dedup hit whose block was evicted during the upload.
        """
        if self.done:
            raise SlabError("put already finished")
        if self.pos != self.length:
            self.abort()
            raise BadRequest(f"body cut short: {self.pos} of {self.length} bytes arrived")
        self.done = True
        return self._slab._commit(self)

    def abort(self) -> None:
        """Give the reserved pages back; nothing is published. Idempotent."""
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
    return [tuple(r) for r in runs]


class BlockReader:
    """Reads one block out of the slab outside the lock; the block's tag says whether what
    was read is still the block's (see :mod:`eg_kv.layout`)."""

    __slots__ = ("_slab", "block_id", "first", "length", "npages")

    def __init__(self, slab: Slab, length: int, first: int, npages: int, block_id: int):
        self._slab, self.length, self.first = slab, length, first
        self.npages, self.block_id = npages, block_id

    def still_there(self) -> bool:
        """True while the block has not been evicted or released since it was opened."""
        return self._slab._tag[self.first] == self.block_id

    def verify(self) -> None:
        """Raise :class:`BlockGone` (a counted miss) unless :meth:`still_there`."""
        if not self.still_there():
            raise self._gone()

    def _gone(self) -> BlockGone:
        self._slab._count_aborted_read()
        return BlockGone("block was evicted while it was read")

    def views(self, max_slice: int = DEFAULT_READ_SLICE) -> Iterator[memoryview]:
        """Yield zero-copy views of the block's contiguous runs (each <= ``max_slice``).

        The views are slab memory: they are the block's bytes only if :meth:`still_there`
        is true *after* they were last read. A caller that hands them on (a socket send)
        must check it once they are consumed, and treat False as a miss.

        Raises:
            BlockGone: the page chain broke off (the block was released meanwhile).
        """
        slab = self._slab
        nxt, ps, g, mv = slab._next, slab.page_size, slab.geometry, slab._mv
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
            yield mv[start : start + size]
        if pos < length:
            raise self._gone()

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
