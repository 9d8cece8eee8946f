"""A slab's shared-memory segments: create, attach, map, close and unlink them.

A slab is two POSIX shared-memory segments: the slab itself and its readers segment, where
local readers (clients on the slab's host) count their hits and misses and leave CLOCK
hints (:mod:`eg_kv.slab.layout`). Both are this user's alone (mode 0600, checked on the
descriptor before either is mapped), allocated up front (a tmpfs that runs out SIGBUSes
whoever first touches a page), and unlinked only while their names still point to the
segments this handle mapped.

Lifecycle: :meth:`SlabSegment.create` (the supervisor), :meth:`SlabSegment.attach` (every
worker, by name), :meth:`SlabSegment.close` in each process, :meth:`SlabSegment.unlink`
once.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import pwd
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import posix_ipc

from ..errors import SlabError
from ..procs import pid_alive, uses_file
from ..shm import SHM_DIR, segment_name
from ..units import DEFAULT_MAX_BLOCK_SIZE, DEFAULT_PAGE_SIZE, MiB, human_size
from . import layout as L
from .lock import OWNER_LOCK_WAIT_S, Held, SlabLocking

_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels fall back to touching each page
_OS_PAGE = mmap.PAGESIZE
#: A caller's progress callback for long steps: ``(step, done, total)`` (bytes or slots),
#: called after each chunk; the slab itself never logs.
Progress = Callable[[str, int, int], None]
#: Allocating and prefaulting go in chunks this large (~0.4 s each to prefault here), so a
#: progress callback hears of a slab of GiBs several times a second.
PROGRESS_CHUNK = 256 * MiB


def readers_name(slab_name: str) -> str:
    """The name of slab ``slab_name``'s readers segment (:mod:`eg_kv.slab.layout`)."""
    return slab_name + L.READERS_SUFFIX


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


def _reserve(fd: int, size: int, old_size: int, progress: Progress | None = None) -> None:
    """Allocate bytes ``[0, size)`` of segment ``fd`` now, so touching them never SIGBUSes.

    A tmpfs that runs out while a mapped page is first touched kills the toucher with
    SIGBUS; ``posix_fallocate`` fails with ENOSPC instead. Where it is not supported,
    writing zeros past ``old_size`` (the bytes before it are in use) reserves as well.

    Raises:
        OSError: ENOSPC / ENOMEM when there is no room, or another error.
    """
    try:
        for off in range(0, size, PROGRESS_CHUNK):
            os.posix_fallocate(fd, off, min(PROGRESS_CHUNK, size - off))
            if progress is not None:
                progress("allocating", min(off + PROGRESS_CHUNK, size), size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if size > old_size:
            os.pwrite(fd, bytes(size - old_size), old_size)


#: The suffix, before the creator's pid, of a slab being made (:meth:`SlabSegment.create`).
CREATING = ".creating-"


def _sweep_abandoned(name: str) -> None:
    """Unlink this user's segments of ``name`` left being made: by a process that died,
    by one whose pid is this process's now (a container starts again with the same small
    pids), or by one that runs but does not use it (its pid reused)."""
    prefix = name.lstrip("/") + CREATING
    with contextlib.suppress(OSError):
        for entry in os.listdir(SHM_DIR):
            pid = entry[len(prefix) :]
            if not (entry.startswith(prefix) and pid.isdigit()):
                continue
            maker = int(pid)
            if (
                maker == os.getpid()
                or not pid_alive(maker)
                or not uses_file(maker, SHM_DIR + "/" + entry)
            ):
                _unlink_ours("/" + entry, None)


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


_S = TypeVar("_S", bound="SlabSegment")


class SlabSegment(SlabLocking):
    """The segments' part of :class:`eg_kv.slab.store.Slab`: the handle's mappings of the
    slab and its readers segment, from creation or attachment to close and unlink.

    ``__init__`` sets every attribute of a handle: the other parts read them.
    """

    if TYPE_CHECKING:
        # Defined by Slab (eg_kv.slab.store): close() gives back its PROCS entry.
        def _release_proc_entry(self) -> None: ...

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
        #: The readers' lease tables (int64 words) and each entry's records in use.
        self._lease_tables: memoryview | None = None
        self._lease_tops: memoryview | None = None
        #: Who holds the leases servers took (:mod:`eg_kv.slab.holds`), int64 words.
        self._holds: memoryview | None = None
        self._procs = self._mv[L.PROCS_OFFSET : L.HEADER_SIZE].cast("q")
        self._nsw = self._mv[L.NS_OFFSET : L.NS_OFFSET + L.NS_TABLE_SIZE].cast("q")
        # The namespace id of every slot, as one strided column (searched in C).
        slots = self._mv[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE].cast("I")
        self._slot_ns = slots[L.SLOT_NS_OFFSET // 4 :: L.SLOT_SIZE // 4]
        self._slots_u32 = slots
        # Every slot's lease count and lease end, as strided columns (eg_kv.slab.leases).
        self._slot_leases = slots[L.SLOT_LEASES_OFFSET // 4 :: L.SLOT_SIZE // 4]
        self._slots_i64 = self._mv[g.slots_off : g.slots_off + g.nslots * L.SLOT_SIZE].cast("q")
        self._slot_lease_end = self._slots_i64[L.SLOT_LEASE_END_OFFSET // 8 :: L.SLOT_SIZE // 8]
        # Every slot's block id: what a local reader's lease names (eg_kv.slab.leases).
        self._slot_block_ids = self._slots_i64[L.SLOT_BLOCK_ID_OFFSET // 8 :: L.SLOT_SIZE // 8]
        # Every slot's fingerprint (signed: its low bits, a home, read the same): what a
        # backward shift asks of each slot it passes.
        self._slot_fps = self._slots_i64[L.SLOT_FP_OFFSET // 8 :: L.SLOT_SIZE // 8]
        # The reservation table as int64 words, and its pid column (0 = entry free).
        self._resv = self._mv[g.resv_off : g.resv_off + g.nresv * L.RESV_SIZE].cast("q")
        self._resv_pids = self._resv[:: L.RESV_SIZE // 8]
        self._resv_raw = self._mv[g.resv_off : g.resv_off + g.nresv * L.RESV_SIZE]
        self._me = -1  # this handle's entry in the PROCS table once claimed (-2: none free)
        self._tlock = threading.Lock()
        self._held = Held(self, None, True)
        self._pid = os.getpid()
        self.closed = False
        #: (dead holder's pid, problems) once an entry into the lock repaired the slab (a
        #: caller that wants to know resets it first: the hot path does not pay for it)
        self.repaired_on_entry: tuple[int, list[str]] | None = None

    @classmethod
    def create(
        cls: type[_S],
        name: str,
        capacity: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
        *,
        prefault: bool = True,
        shm_dir: str = "/dev/shm",
        progress: Progress | None = None,
    ) -> _S:
        """Create a new slab whose data area holds ``capacity`` bytes.

        Checks that ``shm_dir`` has room for the slab and its readers segment, creates
        both exclusively (mode 0600), allocates every byte of both (so the tmpfs can never
        run out later and SIGBUS a process), and pre-faults the pages (seconds a GiB:
        ``progress`` hears after each :data:`PROGRESS_CHUNK` allocated and prefaulted).

        Raises:
            SlabError: bad geometry, a segment of that name exists, or no room.
            ForeignSegment: a readers segment of that name is another user's.
        """
        name = segment_name(name)
        _check_page_size(page_size)
        if capacity < page_size:
            raise SlabError(f"capacity {capacity} is smaller than one page ({page_size})")
        if max_block_size < 1:
            raise SlabError("max block size must be at least 1 byte")
        g = L.Geometry.plan(capacity, page_size, max_block_size)
        rsize = L.readers_size(g.nslots)
        _sweep_abandoned(name)  # before the room is counted: a half-made one takes some
        try:
            st = os.statvfs(shm_dir)
        except OSError:
            st = None
        # The readers segment counts too: a slab that fits without it died of SIGBUS.
        if st is not None and st.f_bavail * st.f_frsize < g.total_size + rsize:
            raise _no_room(shm_dir, st.f_bavail * st.f_frsize, g.total_size, rsize)
        exists = SlabError(
            f"a slab named {name} exists already: attach to it, or remove it first "
            "(eg-kv serve --fresh)"
        )
        if os.path.lexists(SHM_DIR + name):  # before seconds of allocation, not after
            raise exists
        # Made under a name of its own and linked to ``name`` once formatted: a process
        # killed while it allocates (seconds a GiB: the OOM killer's moment) leaves no
        # half-made segment under the name, which every later start, --fresh included,
        # refused as "not an eg-kv slab".
        making = f"{name}{CREATING}{os.getpid()}"
        try:
            shm = posix_ipc.SharedMemory(making, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            raise exists from None
        made = os.fstat(shm.fd)
        try:
            _check_owned(shm.fd, name)  # O_EXCL made it ours, and a umask adds no bits: sure
            try:
                _reserve(shm.fd, g.total_size, 0, progress)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise _no_room(shm_dir, None, g.total_size, rsize) from None
                raise
            slab = cls(name, shm, g)
        except BaseException:
            shm.close_fd()
            _unlink_ours(making, (made.st_dev, made.st_ino))
            raise
        try:
            if prefault:  # nobody has it yet: zeros harmless
                slab._prefault(may_write=True, progress=progress)
            slab._format()
            os.link(SHM_DIR + making, SHM_DIR + name)
        except BaseException as e:
            slab.close()
            _unlink_ours(making, (made.st_dev, made.st_ino))
            if isinstance(e, FileExistsError):  # another process made it meanwhile
                raise exists from None
            raise
        _unlink_ours(making, (made.st_dev, made.st_ino))
        try:
            slab._map_readers(create=True)
        except BaseException:
            slab.close()
            slab.unlink()
            raise
        return slab

    @classmethod
    def attach(
        cls: type[_S], name: str, *, prefault: bool = False, progress: Progress | None = None
    ) -> _S:
        """Attach to an existing slab by name.

        ``prefault`` fills this process's page tables for the whole segment up front
        (about 0.2 s per GiB here) instead of taking a fault on each first touch, which
        halved the rate of a new process's first 14 MiB puts (measured). It never writes
        a byte: other processes may be using the slab. ``progress`` hears of the prefault
        as :meth:`create`'s does.

        Raises:
            SlabError: no such segment, or one that is not an eg-kv slab of this layout,
                or no room in ``/dev/shm`` for its readers segment.
            ForeignSegment: the slab or its readers segment is another user's, or has
                group/other mode bits (checked before either is mapped).
        """
        name = segment_name(name)
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
            slab._prefault(may_write=False, progress=progress)
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
        self._hints = rmv[L.READERS_HINTS_OFFSET : L.READERS_HINTS_OFFSET + self.geometry.nslots]
        nslots = self.geometry.nslots
        holds_off = L.readers_holds_offset(nslots)
        self._lease_tables = rmv[L.readers_leases_offset(nslots) : holds_off].cast("q")
        self._holds = rmv[holds_off:size].cast("q")
        self._lease_tops = self._readers[L.R_LEASE_TOP :: L.READER_WORDS][: L.LEASE_READERS]
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

    def _reader_checksum_failures(self) -> int:
        """Blocks local readers copied whose bytes failed their checksum, all together."""
        r = self._readers
        return 0 if r is None else sum(r[L.R_CHECKSUM_FAILURES :: L.READER_WORDS].tolist())

    def fold_local_hits(self) -> int:
        """Give every slot a local reader hit since the last fold its CLOCK reference count.

        Returns:
            How many slots were marked. Runs in C over the hint bytes (``find``); no lock.
        """
        hints, rmm, mm, n = self._hints, self._rmm, self._mm, 0
        if hints is None or rmm is None:
            return 0
        end = L.READERS_HINTS_OFFSET + self.geometry.nslots  # the lease tables follow
        i = rmm.find(b"\x01", L.READERS_HINTS_OFFSET, end)
        while i != -1:
            slot = i - L.READERS_HINTS_OFFSET
            hints[slot] = 0
            mm[self._slot_off(slot) + L.SLOT_REF_OFFSET] = L.REF_TOUCHED
            n += 1
            i = rmm.find(b"\x01", i + 1, end)
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
        name = segment_name(name)
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
        views = (self._procs, self._nsw, self._slot_ns, self._slot_leases, self._slots_u32,
                 self._slot_lease_end, self._slot_block_ids, self._slot_fps, self._slots_i64,
                 self._resv_pids,
                 self._resv, self._resv_raw)  # fmt: skip
        for view in views:
            view.release()
        self._release_views()
        if self._rmm is not None:
            maps = (self._lease_tops, self._lease_tables, self._holds, self._readers, self._hints)
            for mapped in maps:
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

    def __enter__(self: _S) -> _S:
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

    def _prefault(self, may_write: bool, progress: Progress | None = None) -> None:
        """Fault the whole mapping in now rather than page by page later.

        ``MADV_POPULATE_WRITE`` maps every page writable without touching its bytes. Where
        the kernel lacks it (before 5.14), a new slab is faulted in by writing a zero per
        page, but an attached one (``may_write`` False) only by reading a byte per page:
        another process may be storing blocks in it. In chunks, for ``progress``.
        """
        total, step = self.geometry.total_size, _OS_PAGE
        for off in range(0, total, PROGRESS_CHUNK):
            end = min(off + PROGRESS_CHUNK, total)
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE, off, end - off)
            except (OSError, ValueError):
                if may_write:
                    self._mv[off:end:step] = bytes(len(range(off, end, step)))
                else:
                    self._mv[off:end:step].tobytes()  # one read per page
            if progress is not None:
                progress("prefaulting", end, total)

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

    def _rebuild_free_list(self, owned: bytearray) -> None:
        """Link every page not marked in ``owned`` into the free list, in page order.

        Here rather than with the page allocator (:mod:`eg_kv.slab.store`): it builds a new
        slab's list (:meth:`_format`), and repair (:mod:`eg_kv.slab.check`) rebuilds it.
        """
        nxt, tag, head, count = self._next, self._tag, L.NO_PAGE, 0
        for p in range(self.geometry.npages - 1, -1, -1):
            if not owned[p]:
                nxt[p] = head
                tag[p] = 0
                head = p
                count += 1
        self._state[L.ST_FREE_HEAD] = head
        self._state[L.ST_FREE_COUNT] = count
