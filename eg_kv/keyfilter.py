"""Which blocks the disk tier may hold, readable by every worker, and by every client that
reads the slab itself on the server's host, without asking (the file and its reader; the
keeper's side is :mod:`eg_kv.disk.keyfilter`).

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

A client on the server's host (:mod:`eg_kv.slab.local`) maps it too, as the server's
``GET /kv/local/slab`` names it: a local miss whose count is 0 is a miss, not a question
to the server. It maps the file only if the server's user owns it and no one else may
write it; a file it cannot trust or read costs it the question, never a wrong answer.

The supervisor makes the file anew, its space allocated, when the server starts
(:func:`eg_kv.disk.keyfilter.make`: its size follows ``--disk-capacity``); each keeper
fills it again.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time
from collections.abc import Sequence

import xxhash

FILE = "filter"
MAGIC = b"EGKVFLT1"
HEAD = struct.Struct("<8sQQ")
GEN = struct.Struct("<Q")
GEN_OFFSET = 8
COUNTS_OFFSET = 64
SATURATED = 255
#: How often a reader looks for the file while it is not there (or not made yet).
RETRY_S = 0.5


def slot_of(namespace: str, address: str, mask: int) -> int:
    """The slot of key ``(namespace, address)``."""
    return xxhash.xxh3_64_intdigest(f"{namespace}\0{address}".encode()) & mask


class FilterReader:
    """A reader's side (a worker, or a client on the host): :meth:`absent` says which keys
    no record holds. Maps ``DIR/filter`` when it first finds it whole (the keeper makes it
    at its start).

    Args:
        path: the disk tier's directory.
        uid: map the file only if this user owns it and neither group nor others may
            write it (a client: the server's user); None: any (a worker: its own
            directory, which the supervisor checked).
    """

    def __init__(self, path: str, uid: int | None = None) -> None:
        self._name = os.path.join(path, FILE)
        self._uid = uid
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
            if st.st_size <= COUNTS_OFFSET or not stat.S_ISREG(st.st_mode):
                return None
            if self._uid is not None and (st.st_uid != self._uid or st.st_mode & 0o022):
                return None  # another user's file, or one others may write: ask
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
        before = GEN.unpack_from(mm, GEN_OFFSET)[0]
        if not before or before % 2:
            return [False] * len(addresses)
        # (Three reads in order, no barrier: x86 keeps loads in order, as the slab's
        # lock-free reads need too.)
        mask, at, hash_of = self._mask, COUNTS_OFFSET, xxhash.xxh3_64_intdigest
        prefix = f"{namespace}\0"
        out = [not mm[at + (hash_of((prefix + a).encode()) & mask)] for a in addresses]
        if GEN.unpack_from(mm, GEN_OFFSET)[0] != before:  # the keeper started again
            return [False] * len(addresses)
        return out

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
