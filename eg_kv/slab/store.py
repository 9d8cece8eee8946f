"""The shared-memory slab: one block store for every process on the host.

Lifecycle: :meth:`Slab.create` (the supervisor), :meth:`Slab.attach` (every worker, by
name), :meth:`Slab.close` in each process, :meth:`Slab.unlink` once.

Concurrency: every metadata change happens under one slab lock, an open-file-description
byte lock on the segment's fd (``F_OFD_SETLKW``), which the kernel releases when its
holder dies. The holder writes its pid into the header on entry and clears it on exit;
whoever next takes the lock and finds a pid there knows a process died inside the
critical section and repairs the slab before going on. Bulk bytes move outside the lock:
a put fills pages it reserved, a get copies slices out and then checks the block's tag
(see :mod:`eg_kv.slab.layout`), so no reader ever returns bytes that were not the block's.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import fcntl
import itertools
import mmap
import os
import pwd
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

import posix_ipc

if TYPE_CHECKING:
    from typing import TypeAlias

    #: What a put takes: anything with a length that a memoryview can cast to bytes.
    Bytes: TypeAlias = bytes | bytearray | memoryview

from ..address import ADDRESS_MAX, fingerprint
from ..errors import (
    BadRequest,
    Busy,
    Conflict,
    InsufficientStorage,
    SlabError,
    TooLarge,
)
from ..procs import pid_alive
from ..units import DEFAULT_MAX_BLOCK_SIZE, DEFAULT_PAGE_SIZE, human_size
from . import layout as L

# The slot's field indexes, as module globals: read in every probe of every lookup.
from .layout import (
    F_ALEN,
    F_BLOCK_ID,
    F_FIRST,
    F_FP,
    F_LENGTH,
    F_NPAGES,
    F_NS,
    F_REFBIT,
    F_REFS,
    F_STATE,
)

# BlockGone and BlockReader are read through this module too (the server's handlers).
from .view import BlockGone as BlockGone
from .view import BlockReader as BlockReader
from .view import SlabView

# struct flock for F_OFD_SETLKW: l_type, l_whence, l_start, l_len, l_pid (must be 0).
_FLOCK = struct.Struct("hhqqi4x")
_LOCK = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
_UNLOCK = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels fall back to touching each page
#: Reservation entries whose pids are copied out per scan step: a scan of the table (one
#: entry per page) reads them in C (``tolist``, ``index``, ``compress``), not one by one.
_RESV_SCAN = 4096
_FREE_RESV_SLICE = bytes(_RESV_SCAN * L.RESV_SIZE)  # a free entry is all zeros
_OS_PAGE = mmap.PAGESIZE
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
_NS_WORDS = L.NS_WORDS
_CLOCK_STRIDE = 0x9E3779B1  # odd: hand * stride mod 2**k visits every slot once per sweep
_T = TypeVar("_T")
#: Blocks up to this size are stored by :meth:`Slab.put` in one critical section, copy
#: included: a second lock round trip cost more than the copy (scripts/bench_server.py).
SMALL_PUT = 64 * 1024
#: Longest a sliced walk (check_live, release_process) holds the lock at once, checked
#: every few entries: the bound on stalling other requests is ~20 ms, and 5 ms keeps the
#: hold under it on a busy machine (a slice is ~1,000-3,000 slots of 2 GiB's million).
CHECK_SLICE_S = 0.005
#: How long the owner's one-off operations (claim, repair) wait for the lock by default.
OWNER_LOCK_WAIT_S = 10.0
_SPINS = 50  # non-blocking lock attempts (with a yield between) before sleeping on it


class LockTimeout(SlabError):
    """A bounded wait for the slab lock ran out (see :meth:`Slab._locked`)."""


@dataclasses.dataclass
class Leftovers:
    """What :meth:`Slab.release_process` gave back for one dead process."""

    pid: int
    reservations: int = 0  #: uploads it had in flight
    pages: int = 0  #: pages those held
    hits: int = 0  #: its lock-free GET hits, folded into the totals
    misses: int = 0  #: and misses
    full_repair: list[str] | None = None  #: what the full repair found, if one ran


@dataclasses.dataclass
class CheckReport:
    """What :meth:`Slab.check_live` found."""

    problems: list[str]  #: invariants that do not hold (empty: clean as far as checked)
    unchecked: list[str]  #: what could not be concluded because writers ran meanwhile
    slices: int = 0  #: holds of the lock
    longest_hold_s: float = 0.0  #: the longest hold, wall clock
    longest_hold_cpu_s: float = 0.0  #: the longest hold's CPU time (without preemption)
    #: what is not damage on a live slab (a dead writer's reservation the supervisor has
    #: not released yet)
    notes: list[str] = dataclasses.field(default_factory=list)


def readers_name(slab_name: str) -> str:
    """The name of slab ``slab_name``'s readers segment (:mod:`eg_kv.slab.layout`)."""
    return slab_name + L.READERS_SUFFIX


#: Where Linux keeps POSIX shared memory (``posix_ipc`` segment ``/x`` is ``/dev/shm/x``).
SHM_DIR = "/dev/shm"
#: A segment's identity, ``(st_dev, st_ino)``: what a name pointed to when it was opened.
Inode = tuple[int, int]


class ForeignSegment(SlabError):
    """A segment eg-kv must not use: another user's, or open to group or others."""


def _user(uid: int) -> str:
    """``uid 65534 (nobody)``, or just ``uid N`` where the user database has no name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _check_owned(fd: int, name: str) -> Inode:
    """Refuse segment ``name`` unless this process's user owns it, alone (mode 0600).

    Checked with ``fstat`` on the descriptor the caller maps next, never on the name, so
    the name cannot be swapped between the check and the mapping. Explicit, because root
    bypasses permissions: a segment another user made (or made 0666) could be rewritten
    by that user under the server, and a readers segment truncated under it (SIGBUS).

    Args:
        fd: the segment, open.
        name: its name, for the message.

    Returns:
        Its identity, so that only this segment is ever unlinked later under its name.

    Raises:
        ForeignSegment: another owner, or group/other mode bits.
    """
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode & 0o077:
        raise ForeignSegment(
            f"shared-memory segment {name} ({SHM_DIR}{name}) is owned by {_user(st.st_uid)} "
            f"with mode {mode:04o}, and eg-kv ({_user(os.geteuid())}) uses only segments "
            "of its own user with mode 0600: give this server another --slab-name, or "
            f"remove {SHM_DIR}{name} once you know nothing uses it"
        )
    return (st.st_dev, st.st_ino)


def _no_room(shm_dir: str, free: int | None, slab_size: int, readers_size: int) -> SlabError:
    """The error for a ``shm_dir`` too small for the slab and its readers segment."""
    need = slab_size + readers_size
    have = "has no room left" if free is None else f"has {human_size(free)} free"
    if free is not None and human_size(free) == human_size(need):
        have = f"has {free} bytes free"  # rounded alike: the exact figures say which is less
        need_text = f"{need} bytes"
    else:
        need_text = human_size(need)
    return SlabError(
        f"{shm_dir} {have} but the slab needs {need_text} (slab {human_size(slab_size)} + "
        f"readers {human_size(readers_size)}): lower --capacity or enlarge {shm_dir} "
        "(docker: shm_size)"
    )


def _reserve(fd: int, size: int, old_size: int) -> None:
    """Allocate bytes ``[0, size)`` of segment ``fd`` now, so touching them never SIGBUSes.

    A tmpfs that runs out while a mapped page is first touched kills the toucher with
    SIGBUS; ``posix_fallocate`` fails with ENOSPC instead. Where it is not supported,
    writing zeros past ``old_size`` (the bytes before it are in use) reserves as well.

    Raises:
        OSError: ENOSPC / ENOMEM when there is no room, or another error.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if size > old_size:
            os.pwrite(fd, bytes(size - old_size), old_size)


def _unlink_ours(name: str, inode: Inode | None) -> bool:
    """Unlink segment ``name`` if this user owns it and, given ``inode``, it is that one.

    A small race remains between the ``stat`` and the unlink (POSIX has no unlink by
    descriptor): only a process that may remove the name anyway (its owner or root: the
    directory is sticky) can swap it in between, so another user cannot use it.

    Returns:
        Whether it was unlinked.
    """
    try:
        st = os.stat(SHM_DIR + name)
    except OSError:
        return False
    if st.st_uid != os.geteuid() or (inode is not None and (st.st_dev, st.st_ino) != inode):
        return False
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _check_page_size(page_size: int) -> None:
    if page_size < _OS_PAGE or page_size & (page_size - 1):
        raise SlabError(
            f"page size {page_size} must be a power of two of at least {_OS_PAGE} bytes"
        )


class _Held:
    """The slab lock, held for a ``with`` block (see :meth:`Slab._locked`).

    A class rather than ``@contextmanager``: the generator and its two resumptions were
    a third of the 3 µs a lock round trip cost (two ``fcntl`` calls are the rest). The
    handle's thread lock serializes its threads, so one object per handle serves every
    section without arguments.
    """

    __slots__ = ("_slab", "_timeout", "_want_write", "_write")

    def __init__(self, slab: Slab, timeout: float | None, write: bool) -> None:
        self._slab, self._timeout, self._want_write, self._write = slab, timeout, write, write

    def __enter__(self) -> None:
        slab = self._slab
        if slab.closed:
            raise SlabError("the slab handle is closed")
        slab._tlock.acquire()
        try:
            try:  # the usual case, inline: the lock is free
                fcntl.fcntl(slab._fd, fcntl.F_OFD_SETLK, _LOCK)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                slab._acquire(self._timeout)
        except BaseException:
            slab._tlock.release()
            raise
        st = slab._state
        try:
            dead = st[L.ST_LOCK_HOLDER]
            st[L.ST_LOCK_HOLDER] = slab._pid
            st[L.ST_LOCK_ENTRIES] += 1
            self._write = write = self._want_write or bool(dead)
            if write:
                st[L.ST_SEQ] |= 1  # odd: lock-free readers retry (stays odd if holder died)
            if dead:
                slab.repaired_on_entry = (dead, slab._repair_locked(count=True))
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        slab = self._slab
        st = slab._state
        try:
            if self._write:
                st[L.ST_SEQ] += 1
            st[L.ST_LOCK_HOLDER] = 0
            fcntl.fcntl(slab._fd, fcntl.F_OFD_SETLKW, _UNLOCK)
        finally:
            slab._tlock.release()


class Slab(SlabView):
    """A handle on the slab from one process. Not shared across ``fork``: attach anew.

    Threads of one process may share a handle: a thread lock sits on top of the slab lock
    (an OFD lock does not exclude threads that share the fd).
    """

    # ------------------------------------------------------------------ lifecycle

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, geometry: L.Geometry) -> None:
        super().__init__(name, mmap.mmap(shm.fd, geometry.total_size), geometry)
        g = geometry
        self._fd = shm.fd
        st = os.fstat(shm.fd)
        #: The segment this handle maps (its name may later point elsewhere: see unlink).
        self.inode: Inode = (st.st_dev, st.st_ino)
        #: The readers segment this handle maps, once it does (see _map_readers).
        self.readers_inode: Inode | None = None
        self._rmm: mmap.mmap | None = None  # the readers segment (see _map_readers)
        self._readers: memoryview | None = None
        self._hints: memoryview | None = None
        self._procs = self._mv[L.PROCS_OFFSET : L.HEADER_SIZE].cast("q")
        self._nsw = self._mv[L.NS_OFFSET : L.NS_OFFSET + L.NS_TABLE_SIZE].cast("q")
        # The namespace id of every slot, as one strided column (searched in C).
        slots = self._mv[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE].cast("I")
        self._slot_ns = slots[L.SLOT_NS_OFFSET // 4 :: L.SLOT_SIZE // 4]
        self._slots_u32 = slots
        # The reservation table as int64 words, and its pid column (0 = entry free).
        self._resv = self._mv[g.resv_off : g.resv_off + g.nresv * L.RESV_SIZE].cast("q")
        self._resv_pids = self._resv[:: L.RESV_SIZE // 8]
        self._resv_raw = self._mv[g.resv_off : g.resv_off + g.nresv * L.RESV_SIZE]
        self._me = -1  # this handle's entry in the PROCS table once claimed (-2: none free)
        self._tlock = threading.Lock()
        self._held = _Held(self, None, True)
        self._pid = os.getpid()
        self.closed = False
        #: (dead holder's pid, problems) once an entry into the lock repaired the slab (a
        #: caller that wants to know resets it first: the hot path does not pay for it)
        self.repaired_on_entry: tuple[int, list[str]] | None = None

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

        Checks that ``shm_dir`` has room for the slab and its readers segment, creates
        both exclusively (mode 0600), allocates every byte of both (so the tmpfs can never
        run out later and SIGBUS a process), and pre-faults the pages.

        Raises:
            SlabError: bad geometry, a segment of that name exists, or no room.
            ForeignSegment: a readers segment of that name is another user's.
        """
        _check_page_size(page_size)
        if capacity < page_size:
            raise SlabError(f"capacity {capacity} is smaller than one page ({page_size})")
        if max_block_size < 1:
            raise SlabError("max block size must be at least 1 byte")
        g = L.Geometry.plan(capacity, page_size, max_block_size)
        rsize = L.readers_size(g.nslots)
        try:
            st = os.statvfs(shm_dir)
        except OSError:
            st = None
        # The readers segment counts too: a slab that fits without it died of SIGBUS.
        if st is not None and st.f_bavail * st.f_frsize < g.total_size + rsize:
            raise _no_room(shm_dir, st.f_bavail * st.f_frsize, g.total_size, rsize)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            raise SlabError(
                f"a slab named {name} exists already: attach to it, or remove it first "
                "(eg-kv serve --fresh)"
            ) from None
        made = os.fstat(shm.fd)
        try:
            _check_owned(shm.fd, name)  # O_EXCL made it ours, and a umask adds no bits: sure
            try:
                _reserve(shm.fd, g.total_size, 0)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise _no_room(shm_dir, None, g.total_size, rsize) from None
                raise
            slab = cls(name, shm, g)
        except BaseException:
            shm.close_fd()
            _unlink_ours(name, (made.st_dev, made.st_ino))
            raise
        if prefault:
            slab._prefault(may_write=True)  # nobody else has it yet: zeros are harmless
        slab._format()
        try:
            slab._map_readers(create=True)
        except BaseException:
            slab.close()
            slab.unlink()
            raise
        return slab

    @classmethod
    def attach(cls, name: str, *, prefault: bool = False) -> Slab:
        """Attach to an existing slab by name.

        ``prefault`` fills this process's page tables for the whole segment up front
        (about 0.2 s per GiB here) instead of taking a fault on each first touch, which
        halved the rate of a new process's first 14 MiB puts (measured). It never writes
        a byte: other processes may be using the slab.

        Raises:
            SlabError: no such segment, or one that is not an eg-kv slab of this layout,
                or no room in ``/dev/shm`` for its readers segment.
            ForeignSegment: the slab or its readers segment is another user's, or has
                group/other mode bits (checked before either is mapped).
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SlabError(f"no slab named {name}: start the server (eg-kv serve) first") from None
        try:
            _check_owned(shm.fd, name)  # before a byte of it is read or mapped
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
        try:
            if slab.slab_id == bytes(L.SLAB_ID_SIZE):  # made before slabs had ids
                with slab._locked(OWNER_LOCK_WAIT_S):
                    if slab.slab_id == bytes(L.SLAB_ID_SIZE):
                        slab._mv[L.SLAB_ID_OFFSET : L.SLAB_ID_OFFSET + L.SLAB_ID_SIZE] = os.urandom(
                            L.SLAB_ID_SIZE
                        )
            slab._map_readers()
        except BaseException:
            slab.close()
            raise
        if prefault:
            slab._prefault(may_write=False)
        return slab

    @property
    def slab_id(self) -> bytes:
        """The slab's 16 random id bytes (see :data:`eg_kv.slab.layout.SLAB_ID_OFFSET`)."""
        return bytes(self._mv[L.SLAB_ID_OFFSET : L.SLAB_ID_OFFSET + L.SLAB_ID_SIZE])

    @property
    def readers_name(self) -> str:
        """The name of the segment local readers count in (:func:`readers_name`)."""
        return readers_name(self.name)

    def _map_readers(self, create: bool = False) -> None:
        """Map the readers segment once it is checked to be this user's alone.

        Args:
            create: for a new slab: the segment is created exclusively; one of this user's
                left by an earlier slab of the name is replaced, another user's refused.
                Otherwise an existing one is used and a missing one created (every process
                that attaches may: they write the same header, so a race is harmless).

        Raises:
            ForeignSegment: it is another user's, or has group/other mode bits.
            SlabError: no room for it in ``/dev/shm``.
        """
        size = L.readers_size(self.geometry.nslots)
        shm = self._open_readers(create)
        try:
            self.readers_inode = _check_owned(shm.fd, self.readers_name)
            try:  # allocated before it is touched: a tmpfs out of room SIGBUSes a toucher
                _reserve(shm.fd, size, os.fstat(shm.fd).st_size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise _no_room(SHM_DIR, None, self.geometry.total_size, size) from None
                raise
            self._rmm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        head = L.READERS_HEAD.pack(L.READERS_MAGIC, self.slab_id, L.NREADERS, self.geometry.nslots)
        if self._rmm[: len(head)] != head:
            # New, or left by another slab of this name (removed without its readers):
            # none of its counts are this slab's.
            self._rmm[L.READERS_HEADER_SIZE : size] = bytes(size - L.READERS_HEADER_SIZE)
            self._rmm[: len(head)] = head
        rmv = memoryview(self._rmm)
        self._readers = rmv[L.READERS_HEADER_SIZE : L.READERS_HINTS_OFFSET].cast("q")
        self._hints = rmv[L.READERS_HINTS_OFFSET : size]
        rmv.release()

    def _open_readers(self, create: bool) -> posix_ipc.SharedMemory:
        """Open the readers segment for :meth:`_map_readers` (which checks its owner).

        Raises:
            ForeignSegment: ``create`` found another user's segment under the name.
            SlabError: the name kept changing hands while it was opened.
        """
        name = self.readers_name
        for _ in range(3):  # each retry follows another process's create or remove
            try:
                return posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
            except posix_ipc.ExistentialError:
                pass
            try:
                shm = posix_ipc.SharedMemory(name)
            except posix_ipc.ExistentialError:
                continue  # removed meanwhile: create it
            if not create:
                return shm
            try:  # a new slab counts from zero in a segment of its own, never in another's
                stale = _check_owned(shm.fd, name)
            finally:
                shm.close_fd()
            _unlink_ours(name, stale)
        raise SlabError(
            f"the readers segment {name} kept being created and removed while this slab "
            "opened it: is another eg-kv using this --slab-name?"
        )

    def _reader_counts(self) -> dict[int, tuple[int, int]]:
        """(get hits, get misses) that local readers counted, by namespace id: one pass
        over the entries' columns (not one per namespace: a tokens file may hold 4,096)."""
        r, w = self._readers, L.READER_WORDS
        out: dict[int, tuple[int, int]] = {}
        if r is None:
            return out
        columns = (r[L.R_NS :: w].tolist(), r[L.R_HITS :: w].tolist(), r[L.R_MISSES :: w].tolist())
        for ns, hits, misses in zip(*columns, strict=True):
            if hits or misses:
                had = out.get(ns, (0, 0))
                out[ns] = (had[0] + hits, had[1] + misses)
        return out

    def fold_local_hits(self) -> int:
        """Give every slot a local reader hit since the last fold its CLOCK reference bit.

        Returns:
            How many slots were marked. Runs in C over the hint bytes (``find``); no lock.
        """
        hints, rmm, mm, n = self._hints, self._rmm, self._mm, 0
        if hints is None or rmm is None:
            return 0
        i = rmm.find(b"\x01", L.READERS_HINTS_OFFSET)
        while i != -1:
            slot = i - L.READERS_HINTS_OFFSET
            hints[slot] = 0
            mm[self._slot_off(slot) + L.SLOT_REF_OFFSET] = 1
            n += 1
            i = rmm.find(b"\x01", i + 1)
        return n

    @staticmethod
    def is_eg_kv_segment(name: str) -> bool:
        """Whether segment ``name`` starts with eg-kv's magic (of any layout version).

        ``--fresh`` removes only such segments: a segment of the same name without the
        magic belongs to another program.
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            return False
        try:
            return os.pread(shm.fd, len(L.MAGIC), 0) == L.MAGIC
        except OSError:
            return False
        finally:
            shm.close_fd()

    @staticmethod
    def segment_owner_pid(name: str) -> int:
        """The owner pid recorded in eg-kv segment ``name``, of any layout version.

        Returns:
            The pid at ``layout.OWNER_PID_OFFSET``, or 0 if it cannot be read.
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            return 0
        try:
            word = os.pread(shm.fd, 8, L.OWNER_PID_OFFSET)
        except OSError:
            return 0
        finally:
            shm.close_fd()
        return struct.unpack("=q", word)[0] if len(word) == 8 else 0  # native, as written

    @staticmethod
    def exists_named(name: str) -> bool:
        try:
            posix_ipc.SharedMemory(name).close_fd()
        except posix_ipc.ExistentialError:
            return False
        return True

    @staticmethod
    def unlink_named(
        name: str, inode: Inode | None = None, readers_inode: Inode | None = None
    ) -> bool:
        """Remove segment ``name`` and its readers segment, if they are this user's.

        A slab of this layout is marked retired first, so that a client that maps it (a
        local reader) lets it go instead of reading a slab nobody serves. Another user's
        segment is never touched.

        Args:
            name: the slab's name.
            inode: remove ``name`` only while it is this segment (the server's own, from
                :attr:`inode`), not another program's that took the name meanwhile.
            readers_inode: the same for the readers segment; with ``inode`` given and
                this None, the readers segment is left alone (this slab never had one).

        Returns:
            Whether the slab's name was removed.
        """
        ours = False
        with contextlib.suppress(OSError, posix_ipc.Error):
            shm = posix_ipc.SharedMemory(name)
            try:
                st = os.fstat(shm.fd)
                ours = st.st_uid == os.geteuid() and inode in (None, (st.st_dev, st.st_ino))
                head = os.pread(shm.fd, L.GEOMETRY.size, 0) if ours else b""
                if len(head) == L.GEOMETRY.size and L.Geometry.unpack(head)[:2] == (
                    L.MAGIC,
                    L.VERSION,
                ):
                    retired = L.STATE_OFFSET + 8 * L.ST_RETIRED
                    os.pwrite(shm.fd, struct.pack("=q", 1), retired)
            finally:
                shm.close_fd()
        if inode is None or readers_inode is not None:
            _unlink_ours(readers_name(name), readers_inode)
        return ours and _unlink_ours(name, inode)

    def close(self) -> None:
        """Unmap and close this process's handle. Idempotent. The segment stays."""
        if self.closed:
            return
        with contextlib.suppress(SlabError, OSError):
            self._release_proc_entry()
        self.closed = True
        views = (self._procs, self._nsw, self._slot_ns, self._slots_u32,
                 self._resv_pids, self._resv, self._resv_raw)  # fmt: skip
        for view in views:
            view.release()
        self._release_views()
        if self._rmm is not None:
            for mapped in (self._readers, self._hints):
                if mapped is not None:
                    mapped.release()
            self._rmm.close()
        with contextlib.suppress(BufferError):  # a reader holds a view; the GC unmaps it
            self._mm.close()
        os.close(self._fd)

    def unlink(self) -> bool:
        """Remove the segment's name (and its readers segment's) while they are still the
        segments this handle mapped; processes that have them mapped keep their mapping.
        Works after :meth:`close` too.

        Returns:
            Whether the slab's name was removed (False: it was gone, or another segment's).
        """
        return self.unlink_named(self.name, self.inode, self.readers_inode)

    def __enter__(self) -> Slab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def owner_pid(self) -> int:
        return self._state[L.ST_OWNER_PID]

    def claim(self, timeout: float | None = OWNER_LOCK_WAIT_S) -> None:
        """Make this process the slab's owner (a supervisor re-attaching a warm slab).

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        with self._locked(timeout):
            self._state[L.ST_OWNER_PID] = self._pid

    def _prefault(self, may_write: bool) -> None:
        """Fault the whole mapping in now rather than page by page later.

        ``MADV_POPULATE_WRITE`` maps every page writable without touching its bytes. Where
        the kernel lacks it (before 5.14), a new slab is faulted in by writing a zero per
        page, but an attached one (``may_write`` False) only by reading a byte per page:
        another process may be storing blocks in it.
        """
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            step = _OS_PAGE
            if may_write:
                self._mv[::step] = bytes(len(range(0, self.geometry.total_size, step)))
            else:
                self._mv[::step].tobytes()  # one read per page

    def _format(self) -> None:
        g = self.geometry
        self._mv[: L.GEOMETRY.size] = g.pack(time.time())
        self._mv[L.SLAB_ID_OFFSET : L.SLAB_ID_OFFSET + L.SLAB_ID_SIZE] = os.urandom(L.SLAB_ID_SIZE)
        st = self._state
        for i in range(L.STATE_WORDS):
            st[i] = 0
        st[L.ST_OWNER_PID] = self._pid
        st[L.ST_NEXT_BLOCK_ID] = 1
        self._mv[L.PROCS_OFFSET : L.HEADER_SIZE] = bytes(L.HEADER_SIZE - L.PROCS_OFFSET)
        self._mv[L.NS_OFFSET : g.next_off] = bytes(g.next_off - L.NS_OFFSET)
        self._nsw[L.NS_USED] = 1  # namespace 0, the default one (named "")
        self._rebuild_free_list(bytearray(g.npages))

    # ------------------------------------------------------------------ the lock

    def _locked(self, timeout: float | None = None, *, write: bool = True) -> _Held:
        """Hold the slab lock (``with``); repair first if the previous holder died inside.

        Args:
            timeout: give up after this many seconds (:class:`LockTimeout`); None waits
                as long as it takes (workers: the supervisor kills a holder that hangs).
            write: False for a section that changes nothing the lock-free readers look
                at: it leaves ``ST_SEQ`` alone, so readers need not retry and a sliced
                check can tell that no writer ran between its slices.

        Raises:
            LockTimeout: ``timeout`` passed and the lock was still taken.
        """
        if timeout is None and write:
            return self._held  # the usual section: one object per handle, not one per call
        return _Held(self, timeout, write)

    def _try_lock(self) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _LOCK)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return False
        return True

    def _acquire(self, timeout: float | None = None) -> None:
        # Try without sleeping first: a sleeping waiter is woken only to find the lock
        # taken again by a holder that never left the CPU, and that convoy cut two-process
        # put rates by 10x (measured). Yielding lets the holder finish its few microseconds.
        for _ in range(_SPINS):
            if self._try_lock():
                return
            os.sched_yield()
        if timeout is None:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _LOCK)
            return
        # A bounded wait polls: F_OFD_SETLKW cannot time out, and a signal to break it
        # would need a timer thread. Sleeps grow to 2 ms, so a holder that leaves at once
        # costs the poller little and a long hold costs it ~500 wake-ups a second.
        deadline, pause = time.monotonic() + timeout, 0.0002
        while not self._try_lock():
            if time.monotonic() >= deadline:
                holder = self._state[L.ST_LOCK_HOLDER]
                raise LockTimeout(
                    f"the lock of slab {self.name} stayed taken for {timeout:g} s (holder: pid "
                    f"{holder}): retry later, or stop that process if it hangs"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.002)

    def lock_state(self) -> tuple[int, int]:
        """``(holder pid or 0, lock entries so far)``, read without taking the lock.

        The same non-zero pair seen twice, some time apart, means one critical section
        lasted at least that long (the supervisor's watchdog).
        """
        return self._state[L.ST_LOCK_HOLDER], self._state[L.ST_LOCK_ENTRIES]

    # ------------------------------------------------------------------ slots

    def _slot_address(self, i: int, alen: int) -> bytes:
        off = self._slot_off(i) + L.SLOT.size
        return self._mm[off : off + alen]

    def _write_slot(
        self, i: int, refbit: int, raw: bytes, refs: int, length: int, first: int,
        npages: int, block_id: int, fp: int, ns: int,
    ) -> None:  # fmt: skip
        off = self._slot_off(i)
        # Fields and address first, the READY state byte last: a reader never sees half.
        L.SLOT.pack_into(self._mm, off, L.SLOT_EMPTY, refbit, len(raw), refs, length, first,
                         npages, block_id, fp, ns)  # fmt: skip
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
                if s[F_STATE] == L.SLOT_EMPTY:
                    self._mm[self._slot_off(i)] = L.SLOT_EMPTY
                    return
                home = s[F_FP] & mask
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

    def _drop_block(self, i: int, s: L.SlotFields, evicted: bool = False) -> None:
        """Release slot ``i``'s block entirely (last delete, or an eviction if ``evicted``:
        counted here, one call per evicted block rather than two)."""
        st = self._state
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
        step per foreign slot. At most two passes (the first may only clear reference bits).

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
        i, scanned, step = nsw[e + L.NS_HAND] % nslots, 0, 256
        while nsw[e + _NS_PAGES] > target and scanned < 2 * nslots:
            end = min(nslots, i + step)
            try:
                j = i + col[i:end].tolist().index(ns)
            except ValueError:
                scanned += end - i
                i = end % nslots
                # Slices grow while they miss: a dense namespace finds its next block in
                # a short one, a sparse one is not searched 256 slots at a time.
                step = min(step * 4, _NS_SCAN)
                continue
            scanned += j - i + 1
            if self._clock_visit(j):
                i = j  # backward shift may have moved another block into slot j
                continue
            i = (j + 1) % nslots
        nsw[e + L.NS_HAND] = i
        if nsw[e + _NS_PAGES] > target:  # two passes missed blocks moved by backward shifts
            raise Busy(f"namespace {self._ns_name(ns)} is at its quota of {quota} bytes; retry")

    def _clock_visit(self, i: int) -> bool:
        """CLOCK's visit of slot ``i``: clear its reference bit (a second chance), or
        evict its block if the bit was clear. True if it evicted (the backward shift may
        have moved another block into slot ``i``)."""
        mm, off = self._mm, self.geometry.slots_off + i * L.SLOT_SIZE
        if mm[off] != L.SLOT_READY:
            return False
        if mm[off + L.SLOT_REF_OFFSET]:
            mm[off + L.SLOT_REF_OFFSET] = 0
            return False
        self._drop_block(i, self._read_slot(i), evicted=True)
        return True

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
        # The visit is inline, not _clock_visit(): a method call per visited slot cost
        # evicting 4 KiB puts about 5% (measured).
        mask, hand, mm, base = self._mask, st[L.ST_CLOCK_HAND], self._mm, self.geometry.slots_off
        while st[L.ST_FREE_COUNT] < n:
            i = (hand * _CLOCK_STRIDE) & mask
            off = base + i * L.SLOT_SIZE
            if mm[off] == L.SLOT_READY:
                if mm[off + L.SLOT_REF_OFFSET]:
                    mm[off + L.SLOT_REF_OFFSET] = 0  # second chance
                else:
                    self._drop_block(i, self._read_slot(i), evicted=True)
                    continue  # backward shift may have moved another block into slot i
            hand = (hand + 1) & mask
        st[L.ST_CLOCK_HAND] = hand

    # ------------------------------------------------------------------ reservations

    def _resv_off(self, r: int) -> int:
        return self.geometry.resv_off + r * L.RESV_SIZE

    def _reserve(self, first: int, npages: int, length: int, ns: int = 0) -> int:
        """Record a put's pages under this pid, charged to namespace ``ns`` (its quota
        counts them until they are published or given back); the entry's index, or -1
        if none is free."""
        st, nr = self._state, self.geometry.nresv
        r = self._free_resv_entry(st[L.ST_RESV_HINT] % nr)
        if r >= 0:
            L.RESV.pack_into(self._mm, self._resv_off(r), self._pid, first, npages, ns, length)
            st[L.ST_RESV_HINT] = (r + 1) % nr
            st[L.ST_RESV_PAGES] += npages
            if ns:  # the default namespace's is derived (the slab's less the others')
                self._nsw[ns * _NS_WORDS + _NS_RESV_PAGES] += npages
        return r

    def _free_resv_entry(self, start: int) -> int:
        """The first free reservation entry from ``start`` on (wrapping), or -1.

        Entries are taken in turn from a rotating hint, so the one at the hint is nearly
        always free; otherwise the pid column is searched in C, a slice at a time (past
        131,072 entries in use: 2-6 ms here, against 50 ms entry by entry).
        """
        pids, nr = self._resv_pids, self.geometry.nresv
        if pids[start] == 0:
            return start
        for lo, hi in ((start, nr), (0, start)):
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
                first, npages = self._unreserve(r)
                self._free_pages(first, npages)
                released += 1
        return released

    # ------------------------------------------------------------------ put

    def begin_put(
        self, address: str, length: int, upload_share: float = 1.0, ns: int = 0
    ) -> PutHandle:
        """Start a streaming put of ``length`` bytes under ``address``.

        Returns a :class:`PutHandle`: ``write`` the bytes, then ``commit`` (or ``abort``).
        A resident block of the same length makes it a dedup hit, counted now (the address
        names the content): its bytes are counted and dropped, ``commit`` stores nothing,
        and ``abort`` (a body that broke off) takes the reference back.

        Args:
            upload_share: the fraction of the slab's pages that puts in flight may hold
                together. A put that would take them over it is refused, unless none is in
                flight (so a block larger than the share can still be stored).

        Raises:
            InvalidAddress, TooLarge (before any byte is stored), Conflict (resident with
            another length), InsufficientStorage, Busy (the share of the slab that puts in
            flight may hold is taken; retry).
        """
        raw, fp = self._key(address, ns)
        n = self._pages_for(length)
        st = self._state
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is not None:
                self._add_ref(i, s, address, length)
                return PutHandle(
                    self, address, raw, fp, length, -1, L.NO_PAGE, 0, s[F_BLOCK_ID], ns
                )
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
        return PutHandle(self, address, raw, fp, length, r, first, n, 0, ns)

    def add_ref(self, address: str, length: int, ns: int = 0) -> bool:
        """A dedup hit from the headers alone: one more reference if ``address`` is
        resident with ``length`` bytes. Returns True if it was, False if it is absent.

        Raises:
            InvalidAddress. Conflict: resident with another length.
        """
        raw, fp = self._key(address, ns)
        if self._read(self._find, raw, fp, ns)[1] is None:  # lock-free: the usual miss
            return False
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is None:
                return False
            self._add_ref(i, s, address, length)
            return True

    def put(self, address: str, data: Bytes, ns: int = 0) -> bool:
        """Store ``data`` under ``address`` in one call; True if created, False if dedup.

        Up to :data:`SMALL_PUT` bytes are looked up, copied in and published in one
        critical section; larger blocks go through :meth:`begin_put`, copied outside it.

        Raises:
            The same as :meth:`begin_put`.
        """
        length = len(data)
        if length > SMALL_PUT:
            handle = self.begin_put(address, length, ns=ns)
            try:
                handle.write(data)
                return handle.commit()
            finally:
                handle.abort()
        raw, fp = self._key(address, ns)
        n = self._pages_for(length)
        with self._locked():
            i, s = self._find(raw, fp, ns)
            if s is not None:
                return self._add_ref(i, s, address, length)
            if self._state[L.ST_FREE_COUNT] < n or (ns and self._nsw[ns * _NS_WORDS + _NS_QUOTA]):
                self._room(n, ns, length)
                i = self._find(raw, fp, ns)[0]  # evictions may have moved the empty slot
            first = self._alloc_pages(n)
            src, mv = memoryview(data).cast("B"), self._mv
            for pos, off, size in _runs(self, first, n, length):
                mv[off : off + size] = src[pos : pos + size]
            # A crash before the slot is written leaves pages no slot owns: repair frees them.
            self._publish(i, raw, fp, length, first, n, ns)
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

    def _add_ref(self, i: int, s: L.SlotFields, address: str, length: int) -> bool:
        """A dedup hit on slot ``i`` (fields ``s``): one more reference. Returns False.

        Raises:
            Conflict: the resident block has another length.
        """
        if s[F_LENGTH] != length:
            raise Conflict(_conflict_message(address, s[F_LENGTH], length))
        # One more reference, and the reference bit set (a dedup hit is a use).
        fields = list(s)
        fields[F_STATE], fields[F_REFBIT] = L.SLOT_READY, 1
        fields[F_REFS] += 1
        L.SLOT.pack_into(self._mm, self._slot_off(i), *fields)
        st, e, nsw = self._state, s[F_NS] * _NS_WORDS, self._nsw
        st[L.ST_TOTAL_REFS] += 1
        st[L.ST_LOGICAL_BYTES] += length
        st[L.ST_DEDUP_HITS] += 1
        if e:
            nsw[e + _NS_REFS] += 1
            nsw[e + _NS_LOGICAL_BYTES] += length
            nsw[e + _NS_DEDUP_HITS] += 1
        return False

    def _publish(
        self, i: int, raw: bytes, fp: int, length: int, first: int, npages: int, ns: int
    ) -> None:
        """Make the block on pages ``first``.. visible in empty slot ``i``, and count it."""
        st = self._state
        block_id = st[L.ST_NEXT_BLOCK_ID]
        st[L.ST_NEXT_BLOCK_ID] = block_id + 1
        self._tag[first] = block_id
        self._write_slot(i, 0, raw, 1, length, first, npages, block_id, fp, ns)
        st[L.ST_UNIQUE_BLOCKS] += 1
        st[L.ST_TOTAL_REFS] += 1
        st[L.ST_RESIDENT_BYTES] += length
        st[L.ST_LOGICAL_BYTES] += length
        st[L.ST_SLOT_PAGES] += npages
        st[L.ST_PUTS_CREATED] += 1
        if ns:
            e, nsw = ns * _NS_WORDS, self._nsw
            nsw[e + _NS_BLOCKS] += 1
            nsw[e + _NS_REFS] += 1
            nsw[e + _NS_RESIDENT_BYTES] += length
            nsw[e + _NS_LOGICAL_BYTES] += length
            nsw[e + _NS_PAGES] += npages
            nsw[e + _NS_PUTS_CREATED] += 1

    def _commit(self, h: PutHandle) -> bool:
        if h.resv < 0:  # a dedup hit: its reference was taken when the put began
            return False
        with self._locked():
            i, s = self._find(h.raw, h.fp, h.ns)
            if s is not None:
                first, npages = self._unreserve(h.resv)
                self._free_pages(first, npages)
                return self._add_ref(i, s, h.address, h.length)
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
            self._publish(i, h.raw, h.fp, h.length, h.first, h.npages, h.ns)
            self._unreserve(h.resv)
            return True

    def _abort(self, h: PutHandle) -> None:
        if h.resv < 0:
            self._take_back_ref(h)
            return
        with self._locked():
            first, npages = self._unreserve(h.resv)
            self._free_pages(first, npages)

    def _take_back_ref(self, h: PutHandle) -> None:
        """Undo a dedup hit whose body broke off: the put did not happen.

        The reference goes only if the same block (by id) is still resident: one evicted
        meanwhile took every reference with it, and a block stored anew under the address
        is not the one this put referenced.
        """
        st = self._state
        with self._locked():
            st[L.ST_DEDUP_HITS] -= 1
            if h.ns:
                self._nsw[h.ns * _NS_WORDS + _NS_DEDUP_HITS] -= 1
            i, s = self._find(h.raw, h.fp, h.ns)
            if s is not None and s[F_BLOCK_ID] == h.block_id:
                self._drop_ref(i, s)  # the last one if every other was deleted meanwhile

    # ------------------------------------------------------------------ get / exists / delete

    def _torn(self, lookup: Callable[..., _T], *args: object) -> _T:
        """A lookup a writer got in the way of runs again under the lock."""
        with self._locked(write=False):
            return lookup(*args)

    def _touch(self, i: int) -> None:
        # The CLOCK reference bit, set without the lock: at worst a block that moved into
        # this slot meanwhile gets a second chance it did not earn.
        self._mm[self._slot_off(i) + L.SLOT_REF_OFFSET] = 1

    def _count_read(self, hit: int, miss: int, ns: int = 0) -> None:
        """Count get hits and misses in this process's own entry (no lock, one writer),
        and in namespace ``ns``'s entry (no lock: a concurrent reader may lose one)."""
        # One word each for a plain hit or miss (an aborted read moves both): every
        # read-modify-write of slab memory is a cache line a busy worker may not hold.
        if ns:
            e = ns * _NS_WORDS
            if hit:
                self._nsw[e + _NS_GET_HITS] += hit
            if miss:
                self._nsw[e + _NS_GET_MISSES] += miss
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

    # ------------------------------------------------------------------ stats

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """Exact counters over the whole slab (the contract's eight fields and more).

        Args:
            timeout: wait at most this long for the lock (the supervisor never blocks).

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        st, ps = self._state, self.page_size
        with self._locked(timeout, write=False):
            out = {k: st[i] for k, i in L.DERIVED_COUNTERS.items()}
            out.update({k: st[i] for k, i in L.EVENT_COUNTERS.items()})
            free = st[L.ST_FREE_COUNT]
            procs = self._procs
            for e in range(0, L.NPROCS * L.PROC_WORDS, L.PROC_WORDS):
                out["get_hits"] += procs[e + 1]
                out["get_misses"] += procs[e + 2]
        # Local readers' counts, as if their reads had come over HTTP.
        for hits, misses in self._reader_counts().values():
            out["get_hits"] += hits
            out["get_misses"] += misses
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

    # ------------------------------------------------------------------ namespaces

    def _ns_name(self, ns: int) -> str:
        e = self._nsw
        off = L.NS_OFFSET + 8 * (ns * _NS_WORDS + L.NS_NAME_WORD)
        n = min(e[ns * _NS_WORDS + L.NS_NAME_LEN], L.NS_NAME_MAX)
        return self._mm[off : off + n].decode("utf-8", "replace")

    def bind_namespaces(
        self, quotas: Mapping[str, int], timeout: float | None = OWNER_LOCK_WAIT_S
    ) -> dict[str, int]:
        """Give each namespace name its id, and set its quota (bytes; 0 = none).

        A name already in the namespace table keeps its id (so every process and every
        restart of a kept slab agrees); a new one takes a free entry. The default
        namespace ``""`` is id 0. Names no longer given keep their entries and blocks.

        Returns:
            name -> namespace id.

        Raises:
            SlabError: the table's :data:`layout.NS_COUNT` entries are all taken, or a
                name is longer than :data:`layout.NS_NAME_MAX` bytes.
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        nsw, out = self._nsw, {}
        with self._locked(timeout):
            known, free = {}, []
            for ns in range(1, L.NS_COUNT):
                if nsw[ns * _NS_WORDS + L.NS_USED]:
                    known[self._ns_name(ns)] = ns
                else:
                    free.append(ns)
            free.reverse()
            for name, quota in quotas.items():
                raw = name.encode("utf-8")
                if len(raw) > L.NS_NAME_MAX:
                    raise SlabError(f"namespace name {name[:80]!r} is over {L.NS_NAME_MAX} bytes")
                ns = 0 if not name else known.get(name, -1)
                if ns < 0:
                    if not free:
                        raise SlabError(
                            f"the namespace table is full ({L.NS_COUNT - 1} namespaces): "
                            "restart with --fresh to drop namespaces no longer used"
                        )
                    ns = free.pop()
                    e = ns * _NS_WORDS
                    nsw[e : e + _NS_WORDS] = array.array("q", bytes(L.NS_ENTRY_SIZE))
                    off = L.NS_OFFSET + 8 * (e + L.NS_NAME_WORD)
                    self._mm[off : off + len(raw)] = raw
                    nsw[e + L.NS_NAME_LEN] = len(raw)
                    nsw[e + L.NS_USED] = 1
                    known[name] = ns
                nsw[ns * _NS_WORDS + _NS_QUOTA] = quota
                out[name] = ns
        return out

    def namespace_stats(
        self, only: int | None = None, timeout: float | None = None
    ) -> dict[str, dict[str, int | str]]:
        """Each namespace's counters by name (the contract's eight fields first), or only
        namespace ``only``'s. The default namespace's get hits and misses are the slab's
        less the others' (those of named namespaces are counted without the lock).

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        nsw, out = self._nsw, {}
        total, local = self.stats(timeout), self._reader_counts()
        with self._locked(timeout, write=False):
            for ns in range(L.NS_COUNT):
                e = ns * _NS_WORDS
                if not nsw[e + L.NS_USED]:
                    continue
                one: dict[str, int | str] = {k: nsw[e + i] for k, i in L.NS_DERIVED.items()}
                one.update({k: nsw[e + i] for k, i in L.NS_EVENTS.items()})
                one["quota_bytes"] = nsw[e + _NS_QUOTA]
                one["quota_used_bytes"] = one["reserved_bytes"] = 0  # set below
                if ns:  # the default namespace's are derived below
                    hits, misses = local.get(ns, (0, 0))
                    one["get_hits"] = int(one["get_hits"]) + hits
                    one["get_misses"] = int(one["get_misses"]) + misses
                one["dedup_savings_bytes"] = int(one["logical_bytes"]) - int(one["resident_bytes"])
                one["namespace"] = name = self._ns_name(ns)
                out[name] = (ns, one)
        # The default namespace's counters are the slab's less the named ones' (the hot
        # paths of a server without tenants then pay nothing for namespaces).
        default = out[""][1]
        for key in (*L.NS_DERIVED, *L.NS_EVENTS):
            default[key] = total[key] - sum(int(v[key]) for k, (_, v) in out.items() if k)
        default["dedup_savings_bytes"] = int(default["logical_bytes"]) - int(
            default["resident_bytes"]
        )
        ps = self.page_size
        for _ns, one in out.values():
            # What the quota counts: whole pages, of published blocks and uploads in flight.
            one["reserved_bytes"] = int(one["reserved_pages"]) * ps
            one["quota_used_bytes"] = (int(one["slot_pages"]) + int(one["reserved_pages"])) * ps
        return {k: v for k, (ns, v) in out.items() if only is None or ns == only}

    # ------------------------------------------------------------------ check / repair

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

    def repair(self, timeout: float | None = OWNER_LOCK_WAIT_S) -> list[str]:
        """Restore every invariant; return what was wrong before (empty = was clean).

        The slot table is the source of truth: damaged slots are dropped (counted as
        evictions), reservations of dead writers are released, the free list, the table's
        probe order and the derived counters are rebuilt.

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds (None: no bound;
                the default bounds a supervisor's start-up behind a stopped holder).
        """
        self.repaired_on_entry = None
        with self._locked(timeout):
            if self.repaired_on_entry is not None:  # the holder had died: done on entry
                return self.repaired_on_entry[1]
            return self._repair_locked()

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
            with self._locked(timeout):
                if self.repaired_on_entry is not None:
                    out.full_repair = self.repaired_on_entry[1]
                end = time.perf_counter() + CHECK_SLICE_S
                while (r := self._next_resv_of(pid, r)) >= 0:
                    first, npages = self._unreserve(r)
                    self._free_pages(first, npages)
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

    def _repair_locked(self, count: bool = False) -> list[str]:
        """Walk; rebuild if anything was wrong. ``count``: count it in ``repairs`` even if
        nothing was (a holder died inside the lock: the full repair ran either way)."""
        problems = self._walk(fix=False)
        if problems:
            self._walk(fix=True)
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
        state, _refbit, alen, refs, length, first, npages, block_id, fp, ns = s
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

    def _walk(self, fix: bool) -> list[str]:
        g, st, nxt, tag, mm = self.geometry, self._state, self._next, self._tag, self._mm
        problems: list[str] = []
        owner = bytearray(g.npages)  # 0 free, 1 slot, 2 reservation
        live: list[tuple[int, bytes, int, int, int, int, int, int, int]] = []
        seen: set[tuple[int, bytes]] = set()
        totals = dict.fromkeys(L.DERIVED_COUNTERS, 0)
        ns_totals: dict[int, list[int]] = {}  # namespace -> its NS_DERIVED values
        ns_zero = [0] * len(L.NS_DERIVED)

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

        for i in range(g.nslots):
            s = self._read_slot(i)
            if s[F_STATE] == L.SLOT_EMPTY:
                continue
            _state, refbit, alen, refs, length, first, npages, block_id, fp, ns = s
            raw = self._slot_address(i, min(alen, ADDRESS_MAX))
            what = f"slot {i} ({raw[:40].decode('ascii', 'replace')})"
            bad = self._slot_fault(i, s, raw, home=not fix)
            if bad is None and (ns, raw) in seen:
                bad = f"{what}: address stored twice"
            if bad is None and claim(first, npages, 1, what):
                seen.add((ns, raw))
                live.append((refbit, raw, refs, length, first, npages, block_id, fp, ns))
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
                st[L.ST_EVICTIONS] += 1
                st[L.ST_EVICTED_BYTES] += length if 0 < length <= g.max_block_size else 0

        for r in self._resv_in_use():
            pid, first, npages, rns, length = L.RESV.unpack_from(mm, self._resv_off(r))
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
            holder = st[L.ST_LOCK_HOLDER]
            if holder and holder != self._pid:
                problems.append(f"lock holder {holder} recorded but not holding")
            return problems

        # fix: rebuild the table in probe order, then the free list and the counters.
        mv = self._mv
        mv[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE] = bytes(g.nslots * L.SLOT_SIZE)
        for refbit, raw, refs, length, first, npages, block_id, fp, ns in live:
            i = self._find(raw, fp, ns)[0]
            self._write_slot(i, refbit, raw, refs, length, first, npages, block_id, fp, ns)
        for p in range(g.npages):
            if owner[p]:
                tag[p] = 0
        for _refbit, _raw, _refs, _length, first, _npages, block_id, _fp, _ns in live:
            tag[first] = block_id
        nsw = self._nsw
        for ns in range(1, L.NS_COUNT):
            e, t = ns * _NS_WORDS, ns_totals.get(ns, ns_zero)
            for k, idx in enumerate(L.NS_DERIVED.values()):
                nsw[e + idx] = t[k]
        self._rebuild_free_list(owner)
        for key, idx in L.DERIVED_COUNTERS.items():
            st[idx] = totals[key]
        st[L.ST_CLOCK_HAND] = st[L.ST_CLOCK_HAND] & self._mask
        return problems


class _SlicedCheck:
    """One run of :meth:`Slab.check_live`: the walk's state between holds of the lock.

    Each step (slots, reservations, free list, counters) takes a position and a
    deadline, works until the deadline, and returns where to go on. ``quiet`` stays true
    while ``ST_SEQ`` reads the same at every hold: no writer ran in between, so the
    slices together saw one state and what spans them may be concluded.
    """

    _START = -2  # the free list walk has not begun

    def __init__(self, slab: Slab, slice_s: float) -> None:
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
        with slab._locked(timeout, write=False):
            t0, c0 = time.perf_counter(), time.thread_time()
            seq = slab._state[L.ST_SEQ]
            self.quiet = self.quiet and self.seq in (None, seq)
            self.seq = seq
            pos = step(pos, t0 + self.slice_s)
            rep.longest_hold_s = max(rep.longest_hold_s, time.perf_counter() - t0)
            rep.longest_hold_cpu_s = max(rep.longest_hold_cpu_s, time.thread_time() - c0)
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


def _conflict_message(address: str, resident: int, wanted: int) -> str:
    return (
        f"block {address} is resident with {resident} bytes, not {wanted}: "
        "delete it first or use another address"
    )


class PutHandle:
    """A put in flight: ``write`` chunks in order, then ``commit`` or ``abort``.

    ``abort`` after ``commit`` does nothing, so ``finally: handle.abort()`` is safe.
    """

    __slots__ = ("_run", "_runs", "_slab", "address", "block_id", "done", "first", "fp",
                 "length", "npages", "ns", "pos", "raw", "resv")  # fmt: skip

    def __init__(
        self, slab: Slab, address: str, raw: bytes, fp: int, length: int, resv: int,
        first: int, npages: int, block_id: int = 0, ns: int = 0,
    ) -> None:  # fmt: skip
        self._slab, self.address, self.raw, self.fp = slab, address, raw, fp
        self.length, self.resv, self.first, self.npages = length, resv, first, npages
        self.block_id = block_id  # of the resident block, for a dedup hit (resv < 0)
        self.ns = ns
        self.pos = self._run = 0
        self.done = False
        self._runs = None if resv < 0 else _runs(slab, first, npages, length)

    def write(self, chunk: Bytes) -> None:
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

    @property
    def dedup(self) -> bool:
        """Whether this put is a dedup hit (counted when it began; its bytes are dropped)."""
        return self.resv < 0

    def commit(self) -> bool:
        """Publish the block. True if this put created it, False if it was a dedup hit.

        Raises:
            BadRequest: fewer bytes were written than announced (nothing is published;
                a dedup hit's reference is taken back).
            Conflict: a block of another length was published meanwhile.
        """
        if self.done:
            raise SlabError("put already finished")
        if self.pos != self.length:
            self.abort()
            raise BadRequest(f"body cut short: {self.pos} of {self.length} bytes arrived")
        self.done = True
        return self._slab._commit(self)

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
