"""Rebuild the disk tier's index from its file: what a restart keeps.

The keeper answers at once and scans in a thread: each record found joins the index as
it is found (disk hits appear as the index fills), and the writer starts once the scan
has set the head. The scan walks from the first record to the superblock's high water:
at a valid header (magic and MAC) it indexes the record and jumps past it, reading no
block bytes; elsewhere it reads 1 MiB at a time and looks for the next header at an
aligned offset. Block bytes are verified when a record is read, not here: a record torn
by a crash is a miss then, and is dropped.
"""

from __future__ import annotations

import logging
import os
import time

from ..units import human_size
from . import files
from . import layout as D
from .index import Entry
from .store import DiskStore

log = logging.getLogger("eg_kv.disk")

CHUNK = 1024 * 1024


def rebuild(store: DiskStore) -> int:
    """Index every record of ``store``'s file, set the head after the newest, and mark
    the store ready. Returns the records indexed."""
    t0 = time.monotonic()
    fd, key, cap = store.fd, store.sb.key, store.capacity
    hw = min(store.sb.high_water, cap)
    buf = files.buffer(CHUNK)
    found: list[Entry] = []
    newest: Entry | None = None
    off = D.FIRST
    try:
        while off < hw:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            step, entries = _records(buf, n, key, off, cap)
            stale: list[Entry] = []
            with store.lock:
                for entry in entries:
                    if entry.key not in store.deleted_in_scan:
                        old = store.index.add(entry)
                        if not entry.live:  # older than the copy indexed: only space
                            stale.append(entry)
                        elif old is not None:  # this newer copy supersedes it
                            stale.append(old)
                    else:  # deleted while the scan ran: it goes for good
                        entry.live = False
                        stale.append(entry)
            for e in stale:  # superseded or deleted: its header goes (on the store's thread)
                store.zero_later(e)
            for entry in entries:
                found.append(entry)
                if newest is None or entry.seq > newest.seq:
                    newest = entry
            off += step
    finally:
        buf.close()
    with store.lock:
        head = newest.offset + newest.size if newest is not None else D.FIRST
        store.index.order_ring(found, head)
        store.deleted_in_scan.clear()
        live = len(store.index.entries)
        store.filter.ready()  # every record found is counted: workers may trust a zero
        store.ready.set()
    log.info("disk tier: %d records (%s) found in %.2f s", live,
             human_size(store.index.blocks_bytes), time.monotonic() - t0)  # fmt: skip
    return live


def _records(buf, n: int, key: bytes, base: int, cap: int) -> tuple[int, list[Entry]]:
    """The records whose headers lie in ``buf[:n]`` (read at ``base``), each at an aligned
    offset: a valid header is followed by a jump past its record (its block is not read),
    anything else by a search for the next magic. Returns how far to step (to the first
    byte not looked at) and the records found."""
    out: list[Entry] = []
    pos = 0
    while pos < n:
        j = buf.find(D.RECORD_MAGIC, pos, n)
        if j < 0:
            break
        if j % D.ALIGN:
            pos = D.align(j)
            continue
        if j + D.HEADER > n:  # a header across the chunk's end: read again from it
            return (j or D.ALIGN), out
        rec = D.unpack_header(buf[j : j + D.HEADER], key)
        off = base + j
        if rec is not None and off + D.record_size(rec.length) <= cap:
            e = Entry((rec.namespace, rec.address), off, rec.length, rec.seq, rec.checksum,
                      rec.refs, rec.engine)  # fmt: skip
            out.append(e)
            pos = j + e.size
            if pos >= n:  # the record runs past the chunk: go on from its end
                return pos, out
            continue
        pos = j + D.ALIGN
    return max(D.ALIGN, n - n % D.ALIGN), out
