"""Which blocks the disk tier may hold, readable by every worker without asking the keeper.

Without it a worker asks the keeper (a round trip over its socket) whenever the slab
misses: before every PUT of a new block (ADOPT: 4 KiB PUTs on one connection ran at 1,084
a second, 2,576 with the filter), and for every GET, HEAD, exists or DELETE of a block the
slab does not hold, though most such blocks are on neither tier; and the fast lane, which
cannot wait, stayed off (slab hits at half speed). The keeper, the index's only
writer, keeps a counting filter of the index's keys in ``DIR/filter``; a worker maps it
read-only, and a key whose count is 0 is on no record the index holds: the worker answers
as if the keeper had said so (NEW, a miss, 404). Any other count asks the keeper, as
before (a count is shared by the keys that hash to it, so it may be another's).

The file (little-endian)::

    0         8         16        24                      64
    ┌─────────┬─────────┬─────────┬───────────────────────┬──────────────────────────┐
    │ magic   │ gen     │ mask    │ zeros                 │ counts: mask + 1 bytes   │
    └─────────┴─────────┴─────────┴───────────────────────┴──────────────────────────┘
    gen:    odd while the keeper fills it (its start, until the index is rebuilt), even
            and not 0 once every record indexed is counted.
    counts: one byte per slot, the keys hashed to it (XXH3-64 of the namespace's name, a
            zero byte and the address, masked); at 255 a count stays until the keeper's
            next start.

Why a zero count can be trusted: the keeper counts a key when it indexes its record, and a
spilled block is marked in the slab (under the slab's lock) only after that, so a worker
that finds the slab without the block, after its eviction, finds it counted. A worker
reads ``gen``, the counts, then ``gen`` again, and trusts a zero only when both reads are
the same even, non-zero number: a keeper that starts again makes ``gen`` odd before it
zeroes the counts. While the keeper is down its file stays as it left it, and so does the
data file (nothing else writes it).

The supervisor makes the file anew, its space allocated, when the server starts
(:func:`make`: its size follows ``--disk-capacity``); each keeper fills it again.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import time
from collections.abc import Sequence

import xxhash

from ..errors import ConfigError
from ..units import human_size

FILE = "filter"
MAGIC = b"EGKVFLT1"
HEAD = struct.Struct("<8sQQ")
_GEN = struct.Struct("<Q")
GEN_OFFSET = 8
COUNTS_OFFSET = 64
SATURATED = 255
#: Slots: one per record the file could hold at most (a record is 8 KiB at least: a 4 KiB
#: header and one aligned page), as a power of two within these bounds.
MIN_SLOTS = 1 << 16
MAX_SLOTS = 1 << 26
_MIN_RECORD = 8192
#: How often a worker looks for the file while it is not there (or not made yet).
RETRY_S = 0.5


def slots_for(capacity: int) -> int:
    """The filter's slots for a data file of ``capacity`` bytes."""
    want = max(1, capacity // _MIN_RECORD)
    return min(MAX_SLOTS, max(MIN_SLOTS, 1 << (want - 1).bit_length()))


def slot_of(namespace: str, address: str, mask: int) -> int:
    """The slot of key ``(namespace, address)``."""
    return xxhash.xxh3_64_intdigest(f"{namespace}\0{address}".encode()) & mask


def make(path: str, capacity: int) -> None:
    """Make ``path``'s filter anew for a data file of ``capacity`` bytes, its space taken
    now (a server starting: a disk without room for it shows at start, as the data
    file's does; written later through a mapping, a page with no room behind it killed
    the keeper with SIGBUS). Its generation is 0: workers ask the keeper until it has
    filled it.

    Raises:
        ConfigError: the file cannot be made (no room; something else in its place), in
            one line that says what to do.
    """
    size = COUNTS_OFFSET + slots_for(capacity)
    try:
        os.close(_make(os.path.join(path, FILE), size))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(
                f"--disk {path}: cannot reserve {human_size(size)} for {FILE} "
                f"({e.strerror}); free space or lower --disk-capacity"
            ) from None
        raise ConfigError(f"--disk {path}: cannot use {FILE} ({e.strerror}); remove or "
                          "rename it") from None  # fmt: skip


def _make(name: str, size: int) -> int:
    """A new file of ``size`` bytes, allocated, put in place of ``name`` (another inode:
    a worker that mapped the old one reads past no end of it); its open descriptor."""
    tmp = name + ".new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.replace(tmp, name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


class FilterWriter:
    """The keeper's side: taken over (the one the supervisor made, or a predecessor left;
    made anew if it is missing or of another size) at its start with ``gen`` odd and
    every count 0; :meth:`add` and :meth:`remove` as the index gains and loses keys
    (under the index's lock), then :meth:`ready` once the index is rebuilt.

    Raises:
        OSError: the file cannot be made (the keeper cannot start).
    """

    def __init__(self, path: str, capacity: int) -> None:
        self.slots = slots_for(capacity)
        self.mask = self.slots - 1
        name = os.path.join(path, FILE)
        size = COUNTS_OFFSET + self.slots
        try:
            fd = os.open(name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        if fd >= 0 and os.fstat(fd).st_size != size:
            os.close(fd)
            fd = -1
        if fd < 0:
            fd = _make(name, size)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        gen = _GEN.unpack_from(self._mm, GEN_OFFSET)[0]
        HEAD.pack_into(self._mm, 0, MAGIC, gen + 1 + gen % 2, self.mask)  # gen: odd
        self._counts = memoryview(self._mm)[COUNTS_OFFSET:]
        self._counts[:] = bytes(self.slots)  # after gen went odd: readers ask the keeper

    def add(self, key: tuple[str, str]) -> None:
        """The index gained ``key``."""
        i = slot_of(key[0], key[1], self.mask)
        n = self._counts[i]
        if n < SATURATED:
            self._counts[i] = n + 1

    def remove(self, key: tuple[str, str]) -> None:
        """The index lost ``key``."""
        i = slot_of(key[0], key[1], self.mask)
        n = self._counts[i]
        if 0 < n < SATURATED:
            self._counts[i] = n - 1

    def ready(self) -> None:
        """Every record indexed is counted: workers may trust a zero."""
        gen = _GEN.unpack_from(self._mm, GEN_OFFSET)[0]
        if gen % 2:
            _GEN.pack_into(self._mm, GEN_OFFSET, gen + 1)

    def close(self) -> None:
        self._counts.release()
        self._mm.close()


class FilterReader:
    """A worker's side: :meth:`absent` says which keys no record holds. Maps ``DIR/filter``
    when it first finds it whole (the keeper makes it at its start)."""

    def __init__(self, path: str) -> None:
        self._name = os.path.join(path, FILE)
        self._mm: mmap.mmap | None = None
        self._mask = 0
        self._inode = (0, 0)
        self._next_look = 0.0

    def _map(self) -> mmap.mmap | None:
        """The mapping, looked for again every :data:`RETRY_S`: while there is none, and
        whether the name still points to the file mapped (one made anew meanwhile, by a
        keeper that found it gone: the old one's counts stay as they were, and would
        rule out what the keeper spills from then on)."""
        now = time.monotonic()
        if now < self._next_look:
            return self._mm
        self._next_look = now + RETRY_S
        try:
            fd = os.open(self._name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            self.close()
            return None
        try:
            st = os.fstat(fd)
            if self._mm is not None and (st.st_dev, st.st_ino) == self._inode:
                return self._mm
            self.close()
            if st.st_size <= COUNTS_OFFSET:
                return None
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, _, mask = HEAD.unpack_from(mm, 0)
        if magic != MAGIC or mask + 1 != st.st_size - COUNTS_OFFSET or mask & (mask + 1):
            mm.close()  # not made yet (the keeper writes its head after its size)
            return None
        self._mm, self._mask, self._inode = mm, mask, (st.st_dev, st.st_ino)
        return mm

    def absent(self, namespace: str, addresses: Sequence[str]) -> list[bool]:
        """For each address, True when the disk holds no record of it (its count is 0
        in a filter the keeper has filled); False: ask the keeper."""
        mm = self._map()
        if mm is None:
            return [False] * len(addresses)
        before = _GEN.unpack_from(mm, GEN_OFFSET)[0]
        if not before or before % 2:
            return [False] * len(addresses)
        # (Three reads in order, no barrier: x86 keeps loads in order, as the slab's
        # lock-free reads need too.)
        mask, at, hash_of = self._mask, COUNTS_OFFSET, xxhash.xxh3_64_intdigest
        prefix = f"{namespace}\0"
        out = [not mm[at + (hash_of((prefix + a).encode()) & mask)] for a in addresses]
        if _GEN.unpack_from(mm, GEN_OFFSET)[0] != before:  # the keeper started again
            return [False] * len(addresses)
        return out

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
