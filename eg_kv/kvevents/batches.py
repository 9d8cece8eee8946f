"""The KV-events publisher's batch index: which log positions each published message held.

A message of the stream carries a batch of one namespace's events, and its ``seq`` is the
log's base plus the batch's number in that namespace's topic (``k``: 0, 1, 2... with no
hole). To answer a replay from a ``seq``, and to go on numbering after a restart of the
publisher, the numbers must outlive the publisher: they live in a shared-memory segment
beside the slab's event log, ``<slab>.kvbatches`` (mode 0600, this user's only), removed
with the slab.

Layout (little-endian)::

    0        64                          64 + 4096 * 16                 + R * 32
    +--------+---------------------------+------------------------------+
    | header | namespaces (4096 x 16 B)  | records (a ring of R x 32 B) |
    +--------+---------------------------+------------------------------+
    header:     magic "EGKVBAT1", log epoch u64, log created (ms) u64, R u64, written u64
    namespace:  next batch number u64, last position published u64
    record:     namespace u32, 0 u32, batch number u64, first position u64, last u64
                (first = last = 0: the batch was ``[AllBlocksCleared]``)

Written ahead of the send, in this order: the record, the namespace's words, ``written``.
A publisher killed between two of them loses at most one number: a hole its subscribers
see, whose replay finds no record and is answered by a resync. A header that does not
name the log it sits beside (a new log: ``--fresh``, a new slab) resets the index.
"""

from __future__ import annotations

import mmap
import struct

import posix_ipc

from ..errors import SlabError
from ..slab.events import EVENTS_NAMESPACES
from ..slab.segment import _check_owned, _reserve

__all__ = ["BatchIndex"]

MAGIC = b"EGKVBAT1"
HEAD = struct.Struct("<8sQQQ")  # magic, log epoch, log created (ms), records
HEAD_SIZE = 64
_W_WRITTEN = 4  # the header's fifth word: records written
NAMESPACES_OFFSET = HEAD_SIZE
RECORDS_OFFSET = NAMESPACES_OFFSET + EVENTS_NAMESPACES * 16
RECORD = struct.Struct("<IIQQQ")
#: Batches remembered for replay (all namespaces together): with up to
#: :data:`~eg_kv.kvevents.publisher.BATCH_EVENTS` events each, more than the log's reach.
RECORDS = 65_536


def index_size(records: int = RECORDS) -> int:
    """The segment's bytes for ``records`` records."""
    return RECORDS_OFFSET + records * RECORD.size


class BatchIndex:
    """One publisher's mapping of the batch index (see the module docstring).

    Args:
        name: the segment's name (:func:`eg_kv.slab.events.batches_name`).
        epoch, created_ms: the event log's, which the index must name (else it is reset).

    Raises:
        ForeignSegment: the segment is another user's. SlabError: no room in /dev/shm.
    """

    def __init__(self, name: str, epoch: int, created_ms: int, records: int = RECORDS) -> None:
        self.name, self.records = name, records
        size = index_size(records)
        try:  # created exclusively, or the last publisher's: whose it is is checked below
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            shm = posix_ipc.SharedMemory(name)
        try:
            _check_owned(shm.fd, name)
            try:
                _reserve(shm.fd, size, 0)
            except OSError as e:
                raise SlabError(f"/dev/shm has no room for the KV-events index {name}: {e}") from e
            self._mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        mv = memoryview(self._mm)
        self._head = mv[:HEAD_SIZE].cast("Q")
        self._ns = mv[NAMESPACES_OFFSET:RECORDS_OFFSET].cast("Q")
        self._records = mv[RECORDS_OFFSET:]
        if HEAD.unpack_from(self._mm) != (MAGIC, epoch, created_ms, records):  # new or reset
            self._mm[:] = bytes(size)
            HEAD.pack_into(self._mm, 0, MAGIC, epoch, created_ms, records)
        #: (namespace, batch number) -> (first position, last position), as recorded.
        self._spans: dict[tuple[int, int], tuple[int, int]] = {}
        written = self._head[_W_WRITTEN]
        for w in range(max(0, written - records), written):
            ns, _, k, first, last = RECORD.unpack_from(self._records, w % records * RECORD.size)
            if ns < EVENTS_NAMESPACES and k < self._ns[2 * ns] and first <= last:
                self._spans[ns, k] = (first, last)

    def position(self, ns: int) -> tuple[int, int]:
        """Namespace ``ns``'s next batch number and the last log position it published."""
        return self._ns[2 * ns], self._ns[2 * ns + 1]

    def span(self, ns: int, k: int) -> tuple[int, int] | None:
        """Batch ``k`` of namespace ``ns``: its first and last position ((0, 0): the
        ``AllBlocksCleared`` batch), or None: not recorded (burnt, or gone from the ring)."""
        return self._spans.get((ns, k))

    def record(self, ns: int, first: int, last: int) -> int:
        """Number a batch of namespace ``ns`` holding positions ``first..last`` (0, 0: a
        clear), before it is sent. Returns its number."""
        k = self._ns[2 * ns]
        w = self._head[_W_WRITTEN]
        off = w % self.records * RECORD.size
        if w >= self.records:  # the ring's oldest record goes
            old_ns, _, old_k, _, _ = RECORD.unpack_from(self._records, off)
            self._spans.pop((old_ns, old_k), None)
        RECORD.pack_into(self._records, off, ns, 0, k, first, last)
        self._spans[ns, k] = (first, last)
        # The number before the position: a publisher killed between the two has spent
        # a number (a hole its subscribers replay), never published positions under one
        # the next would give again (a loss no subscriber could see).
        self._ns[2 * ns] = k + 1
        self._ns[2 * ns + 1] = last or self._ns[2 * ns + 1]
        self._head[_W_WRITTEN] = w + 1
        return k

    def burn(self, ns: int, last: int) -> None:
        """Skip a number of namespace ``ns`` (entries up to position ``last`` were lost to
        it): its subscribers see the hole and replay, which resyncs them."""
        self.start_at(ns, self._ns[2 * ns] + 1, last)

    def start_at(self, ns: int, next_k: int, last: int) -> None:
        """Begin namespace ``ns`` at batch number ``next_k``, after position ``last`` (a
        log the index met with entries in it: those are reached by a resync)."""
        self._ns[2 * ns] = next_k  # the number first, as in record()
        self._ns[2 * ns + 1] = last

    def close(self) -> None:
        """Unmap (the segment stays for the next publisher)."""
        self._head.release()
        self._ns.release()
        self._records.release()
        self._mm.close()
