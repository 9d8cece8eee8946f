"""A client's read-only mapping of its server's slab: same-host loads at memory speed.

A client on the slab's host (same IPC namespace or a shared ``/dev/shm``, same user: the
slab is mode 0600) asks its server where the slab is (``GET /kv/local/slab``, an admin's
right), maps it here **read-only**, and serves GETs and existence from it with the slab's
own lock-free lookup (:meth:`~eg_kv.slab.view.SlabView._read`) and tag check: a block
evicted, deleted or overwritten while it is copied is a miss, exactly as over HTTP.

What a local read must record it writes into the slab's *readers* segment (the only
thing it may write, see :mod:`eg_kv.slab.layout`): its get hits and misses, in an entry it
owns through an OFD lock, which the server adds to ``/kv/stats`` and ``/metrics``; and a
hint per slot hit, which the server folds into the CLOCK reference counts.

Anything that keeps a local read from being exact raises :class:`LocalUnavailable` and
the client asks over HTTP instead: another host's slab (its id differs), no permission,
another layout, a CPU without the ordering lock-free reads need, a slab a writer keeps
busy, or one that was retired (:class:`LocalRetired`: the server removed it, or this
process forked).

The standard library and ``xxhash`` only: a client needs neither ``posix_ipc`` nor the
server's packages.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..checksum import HASH_PIECE, ChecksumMismatch, Verifier
from ..errors import SlabError
from ..keyfilter import FilterReader
from ..procs import after_fork_in_child
from ..shm import SHM_DIR
from . import layout as L
from .local_leases import LocalLeases
from .view import LOCKFREE_READS, BlockGone, BlockReader, SlabView, full_fence

#: Lock-free attempts at one lookup before it goes over HTTP instead (a writer kept the
#: slot table busy through all of them; each attempt is a few microseconds).
LOOKUP_ATTEMPTS = 64
#: How often a reader checks that the slab still has its name (a removed one that no
#: server retired: ``rm /dev/shm/...``).
NAME_CHECK_S = 1.0
#: Runs at least this long are copied by ``memmove`` without the GIL (see _Copier).
#: Shorter ones hold it: eight loader threads each giving up the GIL for a 64 KiB copy
#: waited on each other to get it back, and loaded 1,024 x 64 KiB at 21,000 chunks/s
#: against 30,000 holding it (128 KiB: 15,500 against 27,800; 256 KiB even; 512 KiB
#: 10,200 against 6,700 for memmove: copies that long overlap on both cores).
MEMMOVE_MIN = 256 * 1024
#: How much of the slab's tables a new mapping maps into this process at once
#: (``MADV_POPULATE_READ``, Linux 5.14+; elsewhere lookups fault as they go): a lookup
#: of a key whose slot this process had not read faulted the slot's page in (16 faults
#: in 32 lookups of new keys, 217 against 135 µs for the call). 256 MiB (a 20 GiB slab's
#: tables with 64 KiB pages) take about 20 ms; a 1 GiB slab's 13 MiB about 1 ms. Not the
#: blocks' bytes: mapping those ahead, in a thread, made 14 MiB loads 1.27x faster but
#: slowed the lookups and loads of 64 KiB blocks that ran meanwhile to 0.75-0.78
#: (``scripts/bench_lmcache.py``, five runs), even at the lowest priority.
TABLES_MAX = 256 * 1024 * 1024
_MADV_POPULATE_READ = 22
_T = TypeVar("_T")


class _Torn(Exception):
    """A lock-free lookup a writer got in the way of (:meth:`LocalSlab._read` retries)."""


# struct flock for F_OFD_SETLK: l_type, l_whence, l_start, l_len, l_pid (must be 0).
_FLOCK = struct.Struct("hhqqi4x")


def _libc_mmap() -> tuple[Any, Any] | None:
    """libc's ``mmap`` and ``munmap`` through ctypes, or None where they cannot be had."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mm, unmap = libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None
    mm.restype = ctypes.c_void_p
    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_long]  # fmt: skip
    unmap.restype = ctypes.c_int
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return mm, unmap


_LIBC_MMAP = _libc_mmap()
_MAP_FAILED = ctypes.c_void_p(-1).value


class LocalUnavailable(SlabError):
    """This read cannot be served locally (the message says why): ask over HTTP."""


class LocalRetired(LocalUnavailable):
    """The mapping must be let go: the slab was retired, or this process forked."""


@dataclasses.dataclass(frozen=True)
class LocalInfo:
    """Where a server's slab is, as ``GET /kv/local/slab`` answers.

    Attributes:
        slab: the segment's name (``/eg-kv-9130``).
        readers: the readers segment's name.
        slab_id: the slab's 16 id bytes.
        layout_version: the slab's layout version.
        total_size: the segment's size in bytes.
        ns: the namespace id of the token's tenant.
        uid: the server's effective uid, which must own both segments (None from a
            server that does not say: then this process's own uid must).
        lease_ms: the longest lease the server grants (its ``--lease-ms``; 0: none), which
            local leases (:mod:`eg_kv.slab.local_leases`) keep to as well.
        disk: the server has a disk tier (``--disk``): a block the slab misses may be on
            disk, so a local miss asks the server...
        disk_dir: ...unless the disk tier's key filter in this directory rules it out
            (:mod:`eg_kv.keyfilter`; "": none named, every local miss asks).
        namespace: the token's namespace by name (the filter's keys name it).
    """

    slab: str
    readers: str
    slab_id: bytes
    layout_version: int
    total_size: int
    ns: int
    uid: int | None = None
    lease_ms: int = 0
    disk: bool = False
    disk_dir: str = ""
    namespace: str = ""

    @classmethod
    def from_json(cls, doc: Any) -> LocalInfo:
        """Parse the server's answer.

        Raises:
            LocalUnavailable: not an answer of this shape.
        """
        try:
            info = cls(
                slab=str(doc["slab"]),
                readers=str(doc["readers"]),
                slab_id=bytes.fromhex(str(doc["slab_id"])),
                layout_version=int(doc["layout_version"]),
                total_size=int(doc["total_size"]),
                ns=int(doc["namespace_id"]),
                uid=None if doc.get("uid") is None else int(doc["uid"]),
                lease_ms=max(0, int(doc.get("lease_ms", 0))),
                disk=doc.get("disk") is True,
                disk_dir=str(doc.get("disk_dir") or ""),
                namespace=str(doc.get("namespace") or ""),
            )
        except (TypeError, KeyError, ValueError, OverflowError) as e:
            raise LocalUnavailable(f"the server's slab description is malformed ({e})") from None
        for name in (info.slab, info.readers):
            if not name.startswith("/") or "/" in name[1:] or name in ("/", "/.", "/.."):
                raise LocalUnavailable(f"the server named no shared-memory segment: {name!r}")
        return info

    @classmethod
    def of(
        cls, slab_name: str, slab_id: bytes, total_size: int, ns: int, lease_ms: int = 0,
        disk_dir: str = "", namespace: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        """The JSON a server answers for its slab (the inverse of :meth:`from_json`)."""
        return {
            "slab": slab_name,
            "readers": slab_name + L.READERS_SUFFIX,
            "slab_id": slab_id.hex(),
            "layout_version": L.VERSION,
            "total_size": total_size,
            "namespace_id": ns,
            "uid": os.geteuid(),  # the server's: a client trusts no other user's segment
            "lease_ms": lease_ms,
            "disk": bool(disk_dir),
            "disk_dir": disk_dir,
            "namespace": namespace,
        }


def _open(path: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise LocalUnavailable(f"cannot open {path}: {e.strerror}") from None


def _check_owner(fd: int, name: str, uid: int) -> None:
    """Refuse segment ``name`` (open on ``fd``) unless ``uid`` owns it, alone (mode 0600).

    On the descriptor about to be mapped, not the name: a name can change hands between
    a check and a mapping. Explicit, because root opens anything: another user's segment
    of the name (made before the server's, or after it stopped) could hold any bytes.

    Raises:
        LocalUnavailable: another owner, or group/other mode bits.
    """
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != uid or mode & 0o077:
        raise LocalUnavailable(
            f"{name} here is owned by uid {st.st_uid} with mode {mode:04o}, not by the "
            f"server's uid {uid} with mode 0600: it is not the server's, so it is not read"
        )


class LocalSlab(SlabView):
    """A read-only mapping of a server's slab. Open with :meth:`open`; thread-safe.

    Not shared across ``fork``: a child's reads raise :class:`LocalRetired` (its parent
    owns the counters entry), and the client maps the slab anew.
    """

    def __init__(
        self, info: LocalInfo, fd: int, mm: mmap.mmap, geometry: L.Geometry, rfd: int
    ) -> None:
        super().__init__(info.slab, mm, geometry)
        self.info = info
        self._fd, self._rfd = fd, rfd
        self._rmm = mmap.mmap(rfd, L.readers_size(geometry.nslots))
        rmv = memoryview(self._rmm)
        self._entries = rmv[L.READERS_HEADER_SIZE : L.READERS_HINTS_OFFSET].cast("q")
        self._hints = rmv[L.READERS_HINTS_OFFSET : L.READERS_HINTS_OFFSET + geometry.nslots]
        self._tables = rmv[L.readers_leases_offset(geometry.nslots) :].cast("q")
        rmv.release()
        self._lock = threading.Lock()
        self._users = 0  # lookups, leases and copies now (close() leaves the unmapping
        # to the last one out: a lookup on released views raised ValueError)
        self._pid = os.getpid()
        self._named_at = time.monotonic()
        # A second read-only mapping whose address ctypes knows, for bulk copies.
        self._base, self._size = 0, geometry.total_size
        if _LIBC_MMAP is not None:
            addr = _LIBC_MMAP[0](None, self._size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr not in (None, _MAP_FAILED):
                self._base = addr
        try:
            self._me = self._claim_entry(info.ns)
        except BaseException:
            for view in (self._entries, self._hints, self._tables):
                view.release()
            self._rmm.close()
            self._release_views()
            self._unmap_base()
            raise  # open() closes the slab's mapping and both descriptors
        #: The server's disk tier's key filter, when it names one (:mod:`eg_kv.keyfilter`):
        #: a local miss it rules out is not asked of the server. Its own lock: the reader
        #: maps the file anew when the keeper makes it anew.
        self._disk_filter: FilterReader | None = None
        if info.disk_dir:
            owner = os.geteuid() if info.uid is None else info.uid
            self._disk_filter = FilterReader(info.disk_dir, uid=owner)
        self._filter_lock = threading.Lock()
        #: This entry's lease table, when it has one (the first LEASE_READERS entries)
        #: and the server grants leases; else a leasing lookup goes over HTTP.
        self.leases: LocalLeases | None = None
        entry = self._me // L.READER_WORDS
        if entry < L.LEASE_READERS and info.lease_ms > 0:
            words = L.lease_records(geometry.nslots) * L.LEASE_RECORD_WORDS
            table = self._tables[entry * words : (entry + 1) * words]
            self.leases = LocalLeases(table, self._entries, self._me)
        self.closed = False
        after_fork_in_child(self)
        self._populate_tables()

    def after_fork_in_child(self) -> None:
        """Fresh locks in a forked child: a thread of the parent may have held one at the
        fork, and the child would wait for it forever when it closes the mapping (which
        it must not use: :meth:`_still_mine`)."""
        self._lock = threading.Lock()
        self._users = 0  # the parent's threads: the child's close() unmaps its copies
        if self.leases is not None:
            self.leases._lock = threading.Lock()

    @classmethod
    def open(cls, info: LocalInfo, shm_dir: str = SHM_DIR) -> LocalSlab:
        """Map the slab ``info`` describes, read-only, and take a counters entry.

        Raises:
            LocalUnavailable: it cannot be read here, and why (no such segment or no
                permission: another host, container or user; a segment that is not the
                server's user's alone (mode 0600); another slab of that name;
                another layout; no lock-free reads on this CPU; no counters entry free).
        """
        if not LOCKFREE_READS:
            raise LocalUnavailable("local reads need x86's memory ordering (lock-free lookups)")
        if info.layout_version != L.VERSION:
            raise LocalUnavailable(
                f"the slab has layout version {info.layout_version}; this client reads {L.VERSION}"
            )
        uid = os.geteuid() if info.uid is None else info.uid
        fd = _open(shm_dir + info.slab, os.O_RDONLY)
        rfd = -1
        try:
            _check_owner(fd, info.slab, uid)
            size = os.fstat(fd).st_size
            if size != info.total_size or size < L.HEADER_SIZE:
                raise LocalUnavailable(f"{info.slab} here is not the server's slab (its size)")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            try:
                magic, version, g = L.Geometry.unpack(mm[: L.GEOMETRY.size])
                slab_id = mm[L.SLAB_ID_OFFSET : L.SLAB_ID_OFFSET + L.SLAB_ID_SIZE]
                if (magic, version, g.total_size) != (L.MAGIC, L.VERSION, size):
                    raise LocalUnavailable(f"{info.slab} here is not an eg-kv slab of this layout")
                if slab_id != info.slab_id:
                    raise LocalUnavailable(f"{info.slab} here is another slab (its id differs)")
                rfd = _open(shm_dir + info.readers, os.O_RDWR)
                _check_owner(rfd, info.readers, uid)
                head = os.pread(rfd, L.READERS_HEAD.size, 0)
                if head != L.READERS_HEAD.pack(L.READERS_MAGIC, slab_id, L.NREADERS, g.nslots):
                    raise LocalUnavailable(f"{info.readers} is not this slab's readers segment")
                if os.fstat(rfd).st_size < L.readers_size(g.nslots):
                    raise LocalUnavailable(f"{info.readers} is too short")
                return cls(info, fd, mm, g, rfd)
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            if rfd != -1:
                os.close(rfd)
            raise

    def _claim_entry(self, ns: int) -> int:
        """Take a counters entry: one whose lock nobody holds (its owner, if any, died)
        and whose counts are this namespace's or none. Returns its first word's index.

        Raises:
            LocalUnavailable: every entry is taken.
        """
        entries = self._entries
        for e in range(L.NREADERS):
            w = e * L.READER_WORDS
            if entries[w + L.R_NS] != ns and (entries[w + L.R_HITS] or entries[w + L.R_MISSES]):
                continue  # another namespace's counts: they stay where the stats add them
            start = L.READERS_HEADER_SIZE + e * L.READER_ENTRY_SIZE
            lock = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0)
            try:
                fcntl.fcntl(self._rfd, fcntl.F_OFD_SETLK, lock)
            except OSError:
                continue  # a live reader owns it
            entries[w + L.R_NS] = ns
            entries[w + L.R_PID] = self._pid
            return w
        raise LocalUnavailable(f"all {L.NREADERS} local reader entries are taken")

    # ------------------------------------------------------------------ SlabView hooks

    def _read(self, lookup: Callable[..., _T], *args: object) -> _T:
        """:meth:`SlabView._read` on a mapping still this process's server's, a few times
        at most (a reader cannot take the lock).

        Raises:
            LocalRetired: the slab was retired, or this process forked.
            LocalUnavailable: writers kept the table busy through every attempt.
        """
        self._still_mine()
        for _ in range(LOOKUP_ATTEMPTS):
            try:
                return super()._read(lookup, *args)
            except _Torn:
                os.sched_yield()  # let the writer finish
        raise LocalUnavailable("writers kept the slot table busy")

    def _torn(self, lookup: Callable[..., _T], *args: object) -> _T:
        raise _Torn

    def _touch(self, i: int) -> None:
        self._hints[i] = 1

    def _count_read(self, hit: int, miss: int, ns: int = 0) -> None:
        entries, me = self._entries, self._me
        with self._lock:  # threads share the entry; the entry has one writer process
            entries[me + L.R_HITS] += hit
            entries[me + L.R_MISSES] += miss

    def _count_bad_checksum(self, ns: int = 0) -> None:
        entries, me = self._entries, self._me
        with self._lock:
            entries[me + L.R_MISSES] += 1
            entries[me + L.R_CHECKSUM_FAILURES] += 1

    # ------------------------------------------------------------------ reads

    def _use(self) -> None:
        """Count a user of the mappings until :meth:`_done`: a :meth:`close` meanwhile
        (another thread found the slab retired) leaves the unmapping to the last one out.

        Raises:
            LocalRetired: the mapping was closed.
        """
        with self._lock:
            if self.closed:
                raise LocalRetired("the local slab mapping is closed")
            self._users += 1

    def _done(self) -> None:
        with self._lock:
            self._users -= 1
            last_out = self.closed and not self._users
        if last_out:  # closed meanwhile: close() left the unmapping to the last user
            self._release_maps()

    def _still_mine(self) -> None:
        """Raise :class:`LocalRetired` once this mapping must not be used any more."""
        if self.closed:
            raise LocalRetired("the local slab mapping is closed")
        if os.getpid() != self._pid:
            raise LocalRetired("this process forked: the parent owns the mapping")
        if self._state[L.ST_RETIRED]:
            raise LocalRetired(f"{self.name} was retired by its server")
        now = time.monotonic()
        if now - self._named_at > NAME_CHECK_S:
            if os.fstat(self._fd).st_nlink == 0:
                raise LocalRetired(f"{self.name} was removed")
            self._named_at = now

    def fetch(
        self, address: str, limit: int, sink: Callable[[int, Callable[[memoryview], None]], _T]
    ) -> _T | None:
        """Hand a block to ``sink(length, read_exact)`` as the HTTP clients do; None on a
        miss (absent, over ``limit`` bytes, or gone while it was copied: counted a miss).
        :meth:`open_to_fetch` then :meth:`copy_out`.

        Raises:
            LocalUnavailable: ask over HTTP instead (nothing was counted).
            Exception: what ``sink`` raises (the caller's miss).
        """
        reader = self.open_to_fetch(address, limit)
        return None if reader is None else self.copy_out(reader, sink)

    def open_to_fetch(self, address: str, limit: int) -> BlockReader | None:
        """The block to copy out (its hit counted when :meth:`copy_out` ends whole);
        None: absent (a counted miss), or over ``limit`` bytes (not counted: as over HTTP,
        where the client gives up the send).

        Raises:
            LocalUnavailable: ask over HTTP instead (nothing was counted).
        """
        self._use()
        try:
            reader = self.open_block(address, self.info.ns)
        finally:
            self._done()
        if reader is None or reader.length > limit:
            return None
        return reader

    def copy_out(
        self,
        reader: BlockReader,
        sink: Callable[[int, Callable[[memoryview], None]], _T],
        verify: bool = True,
    ) -> _T | None:
        """Hand ``reader``'s block to ``sink(length, read_exact)``; None if it went while
        it was copied (a counted miss). Any thread may run it.

        Args:
            verify: check the bytes copied against the block's checksum.

        Raises:
            LocalRetired: the mapping was closed.
            ChecksumMismatch: the bytes copied are not the block's (a counted miss and
                checksum failure; what ``sink`` made of them must be dropped).
            Exception: what ``sink`` raises (the caller's miss).
        """
        self._use()  # the mapping must outlive the copy, whatever thread closes it
        try:
            copier = _Copier(self, reader)
            if not verify:
                result = sink(reader.length, copier.read_exact)
                copier.finish()
            else:
                verifier = Verifier(reader.checksum, copier.read_exact, HASH_PIECE)
                result = sink(reader.length, verifier.read_exact)
                copier.finish()  # the block was still there: a mismatch is its bytes'
                try:
                    verifier.check()
                except ChecksumMismatch:
                    self._count_bad_checksum(reader.ns)
                    raise
            reader.done()
        except BlockGone:
            return None
        finally:
            self._done()
        return result

    def exists_addresses(self, addresses: list[str]) -> list[bool]:
        """Existence of each address in the token's namespace (no counts, as over HTTP).

        Raises:
            LocalUnavailable: ask over HTTP instead.
        """
        self._use()
        try:
            return self.exists_many(addresses, self.info.ns)
        finally:
            self._done()

    def lease_addresses(self, addresses: list[str], lease_ms: int) -> list[bool] | None:
        """Existence of each address, every hit leased here for ``lease_ms`` (at most the
        server's): a leasing lookup without HTTP (:mod:`eg_kv.slab.local_leases`).

        Returns:
            One bool per address; None when this reader cannot lease locally (no table,
            or no room in it): ask over HTTP instead. (The misses may be the server's
            disk tier's: :meth:`disk_may_hold`.)

        Raises:
            LocalUnavailable: ask over HTTP instead. InvalidAddress: as the server's 400.
        """
        if self.leases is None:
            return None
        self._use()
        try:
            return self._lease(self.leases, addresses, lease_ms)
        finally:
            self._done()

    def _lease(self, leases: LocalLeases, addresses: list[str], lease_ms: int) -> list[bool] | None:
        ns = self.info.ns
        seq, ids = self.block_ids(addresses, ns)
        found = list(map(bool, ids))
        if any(found):
            if not leases.take(addresses, ids, min(lease_ms, self.info.lease_ms)):
                return None
            full_fence()
            if self._state[L.ST_SEQ] != seq:  # a writer came in: are they still there?
                try:
                    again = self.block_ids(addresses, ns)[1]
                except BaseException:  # no answer: none of the leases is the caller's
                    for address, block in zip(addresses, ids, strict=True):
                        if block:
                            leases.undo(address, block)
                    raise
                for i, (before, now) in enumerate(zip(ids, again, strict=True)):
                    if before and now != before:  # gone (or replaced): a miss after all
                        leases.undo(addresses[i], before)
                        found[i] = False
        return found

    def holds_lease(self, address: str) -> bool:
        """Whether this reader holds a local lease on ``address``'s block (never in a
        forked child: the table is the parent's)."""
        if self.leases is None or self._pid != os.getpid():
            return False
        try:
            self._use()
        except LocalRetired:  # (closed: the leases went with the mapping)
            return False
        try:
            return self.leases.holds(address)
        finally:
            self._done()

    def release_leases(self, addresses: list[str]) -> tuple[int, list[str]]:
        """End one of this reader's local leases on each address's block.

        Returns:
            How many were released, and the addresses it holds none on (release those
            over HTTP). A forked child releases none here: the table is its parent's, and
            the leases the parent took are not the child's to end (a client forgets them
            at the fork: :mod:`eg_kv.client.lease_record`).
        """
        if self.leases is None or self._pid != os.getpid():
            return 0, addresses
        try:
            self._use()
        except LocalRetired:  # closed meanwhile: as when none is mapped (the caller's HTTP)
            return 0, addresses
        try:
            return self.leases.release(addresses)
        finally:
            self._done()

    # ------------------------------------------------------------------ lifecycle

    def _populate_tables(self) -> None:
        """Map the tables lookups walk into this process now (:data:`TABLES_MAX` at
        most), so that no lookup faults a slot's page in."""
        with contextlib.suppress(OSError, ValueError):  # an older kernel: lookups fault
            self._mm.madvise(_MADV_POPULATE_READ, 0, min(self.geometry.data_off, TABLES_MAX))

    def _unmap_base(self) -> None:
        if self._base and _LIBC_MMAP is not None:
            _LIBC_MMAP[1](self._base, self._size)
            self._base = 0

    def disk_may_hold(self, misses: Sequence[str]) -> bool:
        """Whether the server's disk tier may hold any of ``misses`` (addresses this
        mapping did not find): True, ask the server; False when it has no disk tier, or
        its key filter rules every one out (a block the slab evicted to disk is counted
        there before the slab lets it go, so a miss read here, then a count of 0 read
        after it, is on no tier). A filter that cannot be read asks. Never raises."""
        if not misses or not self.info.disk:
            return False
        flt = self._disk_filter
        if flt is None:
            return True
        with self._filter_lock:
            try:
                return not all(flt.absent(self.info.namespace, misses))
            except (OSError, ValueError):  # unmapped under us, or gone: ask
                return True

    def _release_maps(self) -> None:
        if self._disk_filter is not None:
            with self._filter_lock:
                self._disk_filter.close()
        if self.leases is not None:
            self.leases.close()
        for view in (self._entries, self._hints, self._tables):
            view.release()
        self._rmm.close()
        self._unmap_base()
        self._release_views()
        self._mm.close()
        os.close(self._rfd)  # drops the entry's lock
        os.close(self._fd)

    def __enter__(self) -> LocalSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the slab and give the counters entry back (its counts stay). Idempotent.

        A copy, lookup or lease in flight on another thread keeps the mappings until it
        ends (unmapping under a ``memmove`` would crash the process, and a lookup on
        released views raised ``ValueError``); the last one out unmaps.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._users:
                return
        # In a forked child these are its own copies: closing them leaves the parent's
        # entry lock (an OFD lock lasts while any descriptor of it is open) and mapping.
        self._release_maps()


class _Copier:
    """Feeds a block's bytes to ``read_exact`` calls in order, straight from the slab.

    A run of at least :data:`MEMMOVE_MIN` bytes into a writable buffer is copied by
    ``ctypes.memmove``, which releases the GIL: the threads of a loader (the L2 adapter's
    pool) then copy on every core at once (a memoryview slice assignment holds the GIL:
    four threads loaded 14 MiB chunks at one core's speed). A shorter one is copied from
    the mapping, holding the GIL: for it, waiting to get the GIL back cost more than the
    copy. Either way the tag check afterwards decides (:meth:`finish`).
    """

    def __init__(self, slab: LocalSlab, reader: BlockReader) -> None:
        self._base, self._mv = slab._base, slab._mv
        self._reader = reader
        self._runs = reader.runs(reader.length)
        self._off = self._left = 0  # the current run: where it goes on, what is left
        self._done = 0

    def read_exact(self, dest: memoryview) -> None:
        dest = memoryview(dest).cast("B")
        pos, n = 0, len(dest)
        to = 0
        if self._base and n >= MEMMOVE_MIN and not dest.readonly:
            to = ctypes.addressof(ctypes.c_char.from_buffer(dest))
        while pos < n:
            if not self._left:
                self._off, self._left = next(self._runs, (0, 0))
                if not self._left:
                    raise self._reader._gone()
            k = min(n - pos, self._left)
            if to and k >= MEMMOVE_MIN:
                ctypes.memmove(to + pos, self._base + self._off, k)
            else:
                dest[pos : pos + k] = self._mv[self._off : self._off + k]
            self._off += k
            self._left -= k
            pos += k
        self._done += n

    def finish(self) -> None:
        """Check the copy was the block's (tag unchanged) and whole.

        Raises:
            BlockGone: it was not (a counted miss).
        """
        if self._done != self._reader.length:
            raise self._reader._gone()  # the sink left part of it unread
        self._reader.verify()
