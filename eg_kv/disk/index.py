"""The disk tier's index: which record holds each block, and where the ring's head is.

Kept in the keeper's memory only (rebuilt from the file at start, :mod:`eg_kv.disk.scan`),
no I/O here: the keeper calls it under its own lock. Records sit in :attr:`DiskIndex.ring`
in the order the head will reach them (the oldest first): claiming room for the next
record drops the records it overlaps from the front, which is what makes the disk's
eviction FIFO. A record dropped from the index (deleted, superseded, over its namespace's
quota) keeps its place in the ring until the head passes it; its bytes no longer count.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..engine import NO_ENGINE, EngineName
from . import layout as D
from .keyfilter import FilterWriter

#: A block's name on disk: (namespace name, address).
Key = tuple[str, str]


@dataclass(eq=False, slots=True)
class Entry:
    """One record: where it lies and what it holds."""

    key: Key
    offset: int
    length: int
    seq: int
    checksum: int
    refs: int = 1
    engine: EngineName = NO_ENGINE
    live: bool = True  #: in the index (False: deleted or superseded; its space not freed yet)
    in_ring: bool = True  #: its bytes are still on disk (False: the head passed it)
    block: int = 0  #: the slab block it was spilled from, by this keeper (0: found by a scan)

    @property
    def size(self) -> int:
        return D.record_size(self.length)


@dataclass(slots=True)
class DiskIndex:
    """The records of one data file of ``capacity`` bytes."""

    capacity: int
    head: int = D.FIRST
    next_seq: int = 1
    entries: dict[Key, Entry] = field(default_factory=dict)
    ring: deque[Entry] = field(default_factory=deque)
    ns_entries: dict[str, deque[Entry]] = field(default_factory=dict)
    ns_bytes: dict[str, int] = field(default_factory=dict)
    blocks_bytes: int = 0  #: the live records' block bytes
    #: Counts the keys indexed for the workers (:mod:`eg_kv.disk.keyfilter`); None: not kept.
    filter: FilterWriter | None = None

    def find(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    def claim(self, length: int) -> tuple[int, list[Entry], list[Entry]] | None:
        """Room for the record of a ``length``-byte block at the head: returns its offset,
        the live entries it overwrites or gives up (dropped from the index here), and
        the records a wrap gave up (the tail past the head, live or not): their bytes stay
        on disk until the head comes round again, so their headers must be zeroed, or a
        scan after a restart would bring back a block deleted or dropped meanwhile.
        None when the record could never fit the file."""
        size = D.record_size(length)
        if size > self.capacity - D.FIRST:
            return None
        lost: list[Entry] = []
        given_up: list[Entry] = []
        ring, head = self.ring, self.head
        if head + size > self.capacity:  # wrap: the tail past the head is given up
            while ring and ring[0].offset >= head:
                e = ring.popleft()
                self._pass(e, lost)
                given_up.append(e)
            head = D.FIRST
        end = head + size
        while ring and head <= ring[0].offset < end:
            self._pass(ring.popleft(), lost)
        self.head = end
        return head, lost, given_up

    def _pass(self, e: Entry, lost: list[Entry]) -> None:
        e.in_ring = False
        if e.live:
            self._drop(e)
            lost.append(e)

    def add(self, e: Entry) -> Entry | None:
        """Index a record just written (or found by a scan); returns the entry it
        supersedes (live no more), if any. A scan's older copy of a block is not indexed."""
        old = self.entries.get(e.key)
        if old is not None:
            if old.seq > e.seq:  # a scan found an older copy: it only takes space
                e.live = False
                return None
            self._drop(old, counted=False)  # the key stays indexed: never a count of 0
        elif self.filter is not None:
            self.filter.add(e.key)  # counted before it can be found
        self.entries[e.key] = e
        ns = e.key[0]
        q = self.ns_entries.setdefault(ns, deque())
        q.append(e)
        while not q[0].live:  # the head passes records in this order too: bounded
            q.popleft()
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + e.length
        self.blocks_bytes += e.length
        self.next_seq = max(self.next_seq, e.seq + 1)
        return old

    def remove(self, key: Key) -> Entry | None:
        """Drop ``key``'s record from the index; returns it (None: absent)."""
        e = self.entries.get(key)
        if e is not None:
            self._drop(e)
        return e

    def _drop(self, e: Entry, counted: bool = True) -> None:
        if not e.live:
            return
        e.live = False
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            if counted and self.filter is not None:
                self.filter.remove(e.key)
        ns = e.key[0]
        self.ns_bytes[ns] -= e.length
        self.blocks_bytes -= e.length

    def trim_namespace(self, ns: str, quota: int, length: int) -> list[Entry]:
        """Drop ``ns``'s oldest records until a ``length``-byte block fits its ``quota``
        (bytes; 0: none); returns those dropped."""
        out: list[Entry] = []
        if not quota:
            return out
        q = self.ns_entries.get(ns)
        while q and self.ns_bytes.get(ns, 0) + length > quota:
            e = q.popleft()
            if e.live:
                self._drop(e)
                out.append(e)
        return out

    def order_ring(self, entries: list[Entry], head: int) -> None:
        """Set the ring from a scan's records: the head is where the newest ends, and
        the ring runs from the first record at or after it, around."""
        self.head = head
        span = self.capacity
        entries.sort(key=lambda e: (e.offset - head) % span)
        self.ring = deque(entries)
        # Each namespace's records oldest first, as its quota drops them: the scan added
        # them in file order, the newest first once the head had wrapped.
        self.ns_entries = {}
        for e in entries:
            if e.live:
                self.ns_entries.setdefault(e.key[0], deque()).append(e)
