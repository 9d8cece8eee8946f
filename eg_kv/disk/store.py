"""The keeper's side of the disk tier: the data file, its index, appends and deletes.

Only the keeper process writes the file (one writer thread appends, deletes zero a
header); workers read it themselves (:mod:`eg_kv.disk.reader`) at offsets the keeper
gives them, and verify what they read. Two locks: ``lock`` guards the index (held for
microseconds, also by the keeper's event loop), ``io`` orders the writes to the file, so
a header is zeroed only while its record is still where the index says (a claim that
passes a record happens under ``io`` too).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..engine import NO_ENGINE, EngineName
from ..units import human_size
from . import counters as counters_file
from . import files
from . import layout as D
from .index import DiskIndex, Entry, Key
from .keyfilter import FilterWriter

log = logging.getLogger("eg_kv.disk")

#: What copies a block into the view it is given (:meth:`DiskStore.append`).
Fill = Callable[[memoryview], None]

#: How far past the head the superblock's high water is moved when the head reaches it
#: (one 4 KiB write per step): a scan after a crash reads at most this far past the last
#: record for nothing.
HIGH_WATER_STEP = 256 * 1024 * 1024
#: Addresses whose discard is remembered for spills in flight (the newest kept).
DISCARDED_KEPT = 4096

COUNTERS = counters_file.NAMES


class DiskStore:
    """One data file under ``path`` of ``capacity`` bytes, for blocks up to ``max_block``.

    Raises:
        ConfigError: the file cannot be made (no room for its capacity).
    """

    def __init__(self, path: str, capacity: int, max_block: int) -> None:
        self.path, self.capacity = path, capacity
        self.sb = files.make_data(path, capacity)
        self.fd, self.direct = files.open_data(path, write=True)
        if not self.direct:
            log.warning("disk tier: %s does not take O_DIRECT (tmpfs?): spills and reads go "
                        "through the page cache", path)  # fmt: skip
        #: The index's keys, counted for the workers (made here: gen odd until the scan).
        self.filter = FilterWriter(path, capacity)
        self.index = DiskIndex(capacity, filter=self.filter)
        self.lock = threading.Lock()
        self.io = threading.Lock()
        self.buf = files.buffer(D.HEADER + D.align(max_block))
        self.zero = files.buffer(D.HEADER)
        #: Kept in DIR, so a keeper started again goes on counting (counters_file).
        self.counters = counters_file.DiskCounters(path)
        self.ready = threading.Event()  # the scan has rebuilt the index
        #: Keys whose slab's last reference went while the scan ran: their records go.
        self.deleted_in_scan: set[Key] = set()
        #: The newest slab block of each address discarded lately (its last reference
        #: went): a spill of it, or of an older block, written meanwhile is not indexed.
        self._discarded: dict[Key, int] = {}
        # Zeroes the headers of records that left the index, off the caller's thread (it
        # waits for a spill's write): one task per record removed, so bounded by the index.
        self._zeroer = ThreadPoolExecutor(1, "disk-zero")
        #: Told of each record that leaves the index for good (not superseded, not
        #: discarded because the slab's last reference went): (entry, deleted: a DELETE
        #: took its last reference). The keeper logs the block's removal there.
        self.on_drop: Callable[[Entry, bool], None] | None = None

    def close(self) -> None:
        self._zeroer.shutdown(wait=True)
        os.close(self.fd)
        self.buf.close()
        self.zero.close()
        self.counters.close()
        self.filter.close()

    # ------------------------------------------------------------------ writes

    def append(
        self, key: Key, length: int, checksum: int, fill: Fill | None = None,
        refs: int = 1, engine: EngineName = NO_ENGINE, quota: int = 0,
        views: list[memoryview] | None = None, still_there: Callable[[], bool] | None = None,
        block: int = 0,
    ) -> Entry | None:  # fmt: skip
        """Write a block's record at the head and index it; None if it could not be.

        The block comes either from ``fill``, which copies its ``length`` bytes into the
        view it is given (and raises, e.g. BlockGone, when it cannot: nothing is written),
        or straight from ``views`` (the slab's pages, aligned: no copy), which
        ``still_there`` vouches for once written (False: the record is undone).

        Args:
            quota: its namespace's quota in bytes (0: none): older records of the
                namespace leave the index until this one fits.
        """
        mv = memoryview(self.buf)
        try:
            with self.io:
                if views is None:
                    assert fill is not None
                    fill(mv[D.HEADER : D.HEADER + length])
                with self.lock:
                    seq = self.index.next_seq
                    self.index.next_seq += 1
                    claimed = self.index.claim(length)
                    if claimed is None:
                        return None
                    offset, lost, given_up = claimed
                    dropped = self.index.trim_namespace(key[0], quota, length)
                self.counters["disk_evictions"] += len(lost)
                self.counters["quota_drops"] += len(dropped)
                self._zero_headers(dropped)
                self._zero_headers(given_up, intact=True)
                self._dropped(lost + dropped)
                end = offset + D.record_size(length)
                if end > self.sb.high_water:
                    self._raise_high_water(end)
                D.pack_header(mv[: D.HEADER], self.sb.key, seq, length, checksum, key[0], key[1],
                              refs, engine)  # fmt: skip
                iov = [mv[: end - offset]] if views is None else [mv[: D.HEADER], *views]
                t0 = time.perf_counter()
                try:
                    files.pwrite_all(self.fd, iov, offset)
                except OSError as e:
                    self.counters["write_errors"] += 1
                    log.warning("disk tier: a write of %s at %d failed: %s",
                                human_size(length), offset, e)  # fmt: skip
                    return None
                self.counters["write_seconds"] += time.perf_counter() - t0
                entry = Entry(key, offset, length, seq, checksum, refs, engine, block=block)
                if still_there is not None and not still_there():
                    self._zero_headers([entry])  # the pages changed hands meanwhile
                    return None
                old: Entry | None = None
                with self.lock:
                    # Deleted while it was written; or other bytes than a copy the disk
                    # holds of an earlier block (a PUT whose ADOPT came before that copy
                    # was indexed): never over the copy, whose holders' GETs would get
                    # the new bytes and whose references would be lost.
                    gone = 0 < block <= self._discarded.get(key, 0)
                    held = self.index.find(key)
                    adopted = held is not None and held.checksum != checksum and held.block < block
                    if not gone and not adopted:
                        self.index.ring.append(entry)
                        old = self.index.add(entry)
                if gone or adopted:  # never indexed
                    self._zero_headers([entry])
                    return None
                if old is not None:  # a copy of the block's older bytes: never again
                    self._zero_headers([old])
                self.counters["spilled_bytes"] += length  # "spills": the caller's, once done
                return entry
        finally:
            mv.release()

    def _raise_high_water(self, end: int) -> None:
        hw = min(self.capacity, end + HIGH_WATER_STEP)
        self.sb = self.sb._replace(high_water=hw)
        files.write_super(self.fd, self.sb)

    def _zero_headers(self, entries: list[Entry], intact: bool = False) -> None:
        """Zero the headers of records that left the index (under ``io``), so a scan
        after a restart does not bring them back; one whose space the head reused is
        left alone. ``intact``: their bytes are known to be theirs still (what a wrap of
        the head gave up, at the wrap), though no longer in the ring."""
        for e in entries:
            if intact or e.in_ring:
                os.pwritev(self.fd, [self.zero], e.offset)

    def zero_later(self, e: Entry) -> None:
        """Zero ``e``'s header on the store's own thread (under ``io``)."""

        def zero() -> None:
            with self.io:
                self._zero_headers([e])

        self._zeroer.submit(zero)

    def zeroed(self) -> Future[None]:
        """Done once every header zeroing queued so far is written (its thread runs them
        in order): a DELETE is answered after its record's header is gone from the file,
        so a crash after the answer cannot bring the block back at the next scan."""
        return self._zeroer.submit(lambda: None)

    def delete(self, key: Key) -> bool | None:
        """Release one reference of ``key``'s record (a ``DELETE`` of a block only the disk
        holds); the last drops it. Returns whether it was there; None while the scan has
        not found it yet (it may be further on: the worker answers 503, retry; a 404 then
        a drop of every reference at the scan was what it did)."""
        with self.lock:
            e = self.index.find(key)
            if e is None:
                return None if not self.ready.is_set() else False
            if e.refs > 1:
                e.refs -= 1
                return True
            self.index.remove(key)
        self.counters["deletes"] += 1
        self.zero_later(e)
        self._dropped([e], deleted=True)
        return True

    def _dropped(self, entries: list[Entry], deleted: bool = False) -> None:
        if self.on_drop is not None:
            for e in entries:
                self.on_drop(e, deleted)

    def discard(self, key: Key, upto_block: int = 0) -> bool:
        """Drop ``key``'s record whatever its refs (the slab's last reference went, or
        the copy is stale); returns whether there was one. ``upto_block`` (0: any): only
        a copy spilled from that slab block or an earlier one (a later block is a later
        PUT of the address, whose copy stays)."""
        with self.lock:
            if upto_block:  # a spill of that block being written now must not be indexed
                self._discarded[key] = max(upto_block, self._discarded.pop(key, 0))
                if len(self._discarded) > DISCARDED_KEPT:
                    del self._discarded[next(iter(self._discarded))]
            e = self.index.find(key)
            if e is not None and upto_block and e.block > upto_block:
                return False
            e = self.index.remove(key)
            if e is None and not self.ready.is_set():
                self.deleted_in_scan.add(key)
        if e is None:
            return False
        self.counters["deletes"] += 1
        self.zero_later(e)
        return True

    def undo(self, e: Entry) -> None:
        """Take back record ``e``, just written, if it is still the one indexed (its block
        left the slab before it was marked spilled)."""
        with self.lock:
            if self.index.find(e.key) is not e:
                return
            self.index.remove(e.key)
        self.zero_later(e)

    def forget(self, key: Key, seq: int) -> bool:
        """Drop ``key``'s record ``seq`` (a reader found it damaged); True if it was the
        indexed one."""
        with self.lock:
            e = self.index.find(key)
            if e is None or e.seq != seq:
                return False
            self.index.remove(key)
        self.counters["checksum_failures"] += 1
        self.zero_later(e)
        self._dropped([e])
        return True

    # ------------------------------------------------------------------ reads

    def stats(self) -> dict[str, float]:
        """The tier's counters and sizes (``/kv/stats``'s ``disk``)."""
        with self.lock:
            idx = self.index
            out: dict[str, float] = {
                "blocks": len(idx.entries), "bytes": idx.blocks_bytes,
                "capacity_bytes": self.capacity, "ready": self.ready.is_set(),
            }  # fmt: skip
        out.update(self.counters)
        return out
