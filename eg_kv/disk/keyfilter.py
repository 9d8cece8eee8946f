"""The keeper's side of the disk tier's key filter (:mod:`eg_kv.keyfilter`: the file, why
a zero count can be trusted, and its readers): the file made at the server's start, and
counted as the keeper's index gains and loses keys.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

from ..errors import ConfigError
from ..keyfilter import COUNTS_OFFSET, FILE, GEN, GEN_OFFSET, HEAD, MAGIC, SATURATED, slot_of
from ..units import human_size

#: Slots: one per record the file could hold at most (a record is 8 KiB at least: a 4 KiB
#: header and one aligned page), as a power of two within these bounds.
MIN_SLOTS = 1 << 16
MAX_SLOTS = 1 << 26
_MIN_RECORD = 8192


def slots_for(capacity: int) -> int:
    """The filter's slots for a data file of ``capacity`` bytes."""
    want = max(1, capacity // _MIN_RECORD)
    return min(MAX_SLOTS, max(MIN_SLOTS, 1 << (want - 1).bit_length()))


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
        gen = GEN.unpack_from(self._mm, GEN_OFFSET)[0]
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
        gen = GEN.unpack_from(self._mm, GEN_OFFSET)[0]
        if gen % 2:
            GEN.pack_into(self._mm, GEN_OFFSET, gen + 1)

    def close(self) -> None:
        self._counts.release()
        self._mm.close()
