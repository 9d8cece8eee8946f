"""The byte layout of the shared-memory slab, and the geometry that sizes it.

One POSIX shared-memory segment holds everything; every offset is fixed at creation and
recorded in the header, so a process that attaches needs nothing but the name::

    0        4096           +1 MiB              resv_off+R*32      slots_off+S*384
    ┌────────┬──────────────┬───────────────────┬──────────────────┬────────┬────────┬───────┐
    │ header │ namespaces   │ reservations      │ slot table       │ next   │ tag    │ pages │
    │        │ 4096 × 256 B │ R × RESV (32 B)   │ S × SLOT (384 B) │ P × q  │ P × Q  │ P × ps│
    └────────┴──────────────┴───────────────────┴──────────────────┴────────┴────────┴───────┘
    header:  [0, 128)      GEOMETRY, written once at creation
             [128, 144)    the slab id (16 random bytes): local readers check it
             [256, ..)     STATE: one native int64 per field (lock holder, free list, clock
                           hand, block ids, counters), changed only under the slab lock
             [1024, 4096)  PROCS: 96 x (pid, get hits, get misses, spare) int64: each
                           process counts its lock-free reads in its own entry

* **namespaces**: one entry per namespace (NS_* words: in use, quota, its own CLOCK hand,
  its counters, the pages its uploads in flight hold, then its name). Entry 0 is the
  default namespace. Every slot carries its namespace id, mixed into its fingerprint, so
  the same address in two namespaces is two blocks on two homes.
* **slot table**: open addressing with linear probing (home = fingerprint & (S - 1)) and
  backward-shift deletion, so there are no tombstones. It is the one source of truth for
  which pages hold published blocks. A slot also carries its leases (:mod:`eg_kv.slab.leases`):
  how many are held and when the newest ends; eviction passes over a leased block. A slot
  is three parts (SLOT_META below): the fields every probe reads, the address, and what
  the block is: its checksum, where the disk tier keeps a copy, and the engine's own name
  for it (hash, LoRA, block size), which removals publish.
* **reservations**: pages taken by puts still being written, with the writer's pid, so
  the pages of a writer that died can be given back, and the namespace they are charged
  to (its quota counts them while they are written). One entry per page (R = P).
* **next**: the page chain (a FAT): ``next[p]`` is the page after ``p`` in its block or in
  the free list, -1 at the end. A block of n bytes owns ceil(n / page_size) pages, wherever
  they lie, so there is no external fragmentation.
* **tag**: ``tag[first page of a block] = block id`` while the block is resident, else 0.
  Block ids only grow, so a reader that copied bytes outside the lock checks the tag
  afterwards: unchanged means the bytes it copied were the block's.
"""

from __future__ import annotations

import dataclasses
import struct
import time

from ..address import ADDRESS_MAX

MAGIC = b"EGKVSLB1"
VERSION = 7  # 4: namespaces (a namespace id per slot, the namespace table); 5: quotas
# count pages, uploads in flight included (NS_RESV_PAGES, a namespace per reservation);
# 6: leases (a lease count and the newest lease's expiry per slot: the slot is 320 bytes);
# 7: a slot's META (checksum, disk record, engine hash: the slot is 384 bytes), XXH3
# fingerprints, checksum counters; the readers segment's entries are 16 words
HEADER_SIZE = 4096
STATE_OFFSET = 256
ALIGN = 4096

# magic, version, header size, page size, pages, slots, reservations, max block size,
# offsets of reservations / slots / next / tag / data, total size, creation time
GEOMETRY = struct.Struct("<8sIIQQQQQQQQQQQd")

#: The slab's id: 16 random bytes written at creation, after the geometry. A client that
#: maps a slab by name reads it locally only if this matches what its server said (a slab
#: of the same name on another host, or a newer one, has another id). Zeros: none yet (a
#: slab made before ids; the owner writes one when it attaches).
SLAB_ID_OFFSET = 128
SLAB_ID_SIZE = 16
assert GEOMETRY.size <= SLAB_ID_OFFSET

# State words (native int64, index into the STATE region).
(
    ST_LOCK_HOLDER,  # pid inside the critical section, 0 when none
    ST_OWNER_PID,  # pid of the supervisor (or creator) that owns the slab
    ST_FREE_HEAD,  # first free page, -1 when none
    ST_FREE_COUNT,
    ST_CLOCK_HAND,  # slot index where the eviction sweep resumes
    ST_NEXT_BLOCK_ID,
    ST_RESV_HINT,  # where the search for a free reservation entry starts
    ST_REPAIRS,
    # counters derived from the slots (check() recomputes them)
    ST_UNIQUE_BLOCKS,
    ST_TOTAL_REFS,
    ST_RESIDENT_BYTES,
    ST_LOGICAL_BYTES,
    ST_SLOT_PAGES,  # pages owned by published blocks
    ST_RESV_PAGES,  # pages owned by reservations
    # event counters
    ST_DEDUP_HITS,
    ST_GET_HITS,
    ST_GET_MISSES,
    ST_EVICTIONS,
    ST_EVICTED_BYTES,
    ST_PUTS_CREATED,
    ST_DELETES,
    ST_SEQ,  # odd while a process is inside a writing critical section (a seqlock for readers)
    ST_LOCK_ENTRIES,  # bumped on every entry into the critical section (the watchdog's clock)
    ST_RETIRED,  # 1 once the slab's name was removed: local readers must let it go
    # leases (eg_kv.slab.leases): taken by lookups, released by loads, found expired
    ST_LEASES_TAKEN,
    ST_LEASES_RELEASED,
    ST_LEASES_EXPIRED,
    # the last sweep that found only leased blocks: when the first of them ends, and the
    # stamp (eg_kv.slab.leases) of what could have made one evictable since
    ST_LEASE_WALL_END,
    ST_LEASE_WALL_STAMP,
    # pages of the blocks whose slot counts a lease (ended or not, until it is forgotten),
    # and the latest end of any lease a slot took (eg_kv.slab.leases: the caps)
    ST_LEASED_PAGES,
    ST_LEASE_LATEST_END,
    ST_LEASES_REFUSED,  # hits a lookup answered without leases: a cap was reached
    ST_UNLEASED_HINT,  # 1 + the slot whose last lease a release ended (0: none): a victim
    # integrity (eg_kv.checksum): reads whose bytes failed their block's checksum, found
    # by the server (check --deep, a disk record); PUT bodies refused for not matching
    # the checksum they carried
    ST_CHECKSUM_FAILURES,
    ST_CHECKSUM_REFUSED,
    # the disk tier (eg_kv.disk): blocks its keeper has marked spilled, ever (0: no disk
    # tier yet); and that count when an eviction last looked for a spilled victim and
    # found none (equal: it does not look again until another block is spilled)
    ST_SPILLS,
    ST_SPILL_WALL,
    STATE_WORDS,
) = range(38)

#: Byte offset of the owner pid (state word ST_OWNER_PID, a native int64) in EVERY layout
#: version so far. It must never move: ``--fresh`` reads it from a slab of another
#: version to refuse to remove one whose server still runs.
OWNER_PID_OFFSET = STATE_OFFSET + 8 * ST_OWNER_PID
assert OWNER_PID_OFFSET == 264

DERIVED_COUNTERS = {
    "unique_blocks": ST_UNIQUE_BLOCKS,
    "total_refs": ST_TOTAL_REFS,
    "resident_bytes": ST_RESIDENT_BYTES,
    "logical_bytes": ST_LOGICAL_BYTES,
    "slot_pages": ST_SLOT_PAGES,
    "reserved_pages": ST_RESV_PAGES,
}
EVENT_COUNTERS = {
    "dedup_hits": ST_DEDUP_HITS,
    "get_hits": ST_GET_HITS,
    "get_misses": ST_GET_MISSES,
    "evictions": ST_EVICTIONS,
    "evicted_bytes": ST_EVICTED_BYTES,
    "puts_created": ST_PUTS_CREATED,
    "deletes": ST_DELETES,
    "repairs": ST_REPAIRS,
    "leases_taken": ST_LEASES_TAKEN,
    "leases_released": ST_LEASES_RELEASED,
    "leases_expired": ST_LEASES_EXPIRED,
    "leases_refused": ST_LEASES_REFUSED,
    "checksum_failures": ST_CHECKSUM_FAILURES,
    "bad_checksum_puts": ST_CHECKSUM_REFUSED,
}

# Per-process read counters (see the header picture): one writer each, summed by stats().
PROCS_OFFSET = 1024
PROC_WORDS = 4  # pid, get hits, get misses, spare
NPROCS = (HEADER_SIZE - PROCS_OFFSET) // (8 * PROC_WORDS)  # 96

# Slot: state, CLOCK reference count, address length, refcount, block length, first page,
# page count, block id, fingerprint (of the address, mixed with the namespace id), namespace
# id, lease count, the newest lease's expiry (CLOCK_MONOTONIC milliseconds: time.monotonic
# is system-wide on Linux, and a /dev/shm slab never outlives a boot); the address itself
# follows (ASCII, padded).
SLOT = struct.Struct("<BBHIQqQQQIIq")
# Where each field lies in a tuple unpacked with SLOT. Plain ints, imported by slab.py as
# module globals: scripts/bench_slab.py (one process) read the same with them as with
# literal indexes (4 KiB put/dedup/get within 1%, exists within 4%: run-to-run noise).
(
    F_STATE,  # SLOT_EMPTY or SLOT_READY
    F_REF,  # CLOCK reference count (REF_NEW, REF_TOUCHED)
    F_ALEN,  # address length in bytes
    F_REFS,  # refcount
    F_LENGTH,  # block length in bytes
    F_FIRST,  # first page
    F_NPAGES,  # page count
    F_BLOCK_ID,
    F_FP,  # the address's 64-bit fingerprint, mixed with the namespace id (ns_fingerprint)
    F_NS,  # namespace id (0: the default namespace)
    F_LEASES,  # leases held (a count; 0 or an expiry in the past: none)
    F_LEASE_END,  # when the newest lease ends (monotonic ms)
    SLOT_FIELDS,
) = range(13)
#: A slot's fields as SLOT unpacks them (index with the F_* constants).
SlotFields = tuple[int, ...]
#: The slot's third part, after the address: what the block is, read only by those who
#: need it (a GET's checksum header, the disk tier, the events), never by a probe.
#:
#:     0          8              16             24          28    29    30   32        64
#:     ┌──────────┬──────────────┬──────────────┬───────────┬─────┬─────┬────┬─────────┐
#:     │ checksum │ disk record  │ engine LoRA  │ engine    │flags│ hash│ -- │ engine  │
#:     │ XXH3-64  │ (0: none)    │ id (q)       │ block size│     │ len │    │ hash 32 │
#:     └──────────┴──────────────┴──────────────┴───────────┴─────┴─────┴────┴─────────┘
#:
#: checksum: of the block's bytes (eg_kv.checksum), set when it is published. disk record:
#: where the disk tier keeps a copy of it (1 + its record's index; 0: none). The engine
#: fields name the block as its engine does (the KV-events wire): its block hash (up to
#: 32 bytes; hash len 0: none, removals name the eg-kv address), the LoRA id and the block
#: size in tokens. flags: META_* bits.
SLOT_META = struct.Struct("<QQqIBB2x32s")
(M_CHECKSUM, M_DISK, M_LORA, M_BLOCK_TOKENS, M_FLAGS, M_HASH_LEN, M_HASH) = range(7)
META_ENGINE_HASH_MAX = 32
#: The byte of a slot's META that holds the engine hash's length (0: none).
META_HASH_LEN_OFFSET = struct.calcsize(SLOT_META.format[:6])  # after "<QQqIB"
META_SPILLED = 1  # the disk tier holds a copy (its record is M_DISK)
#: Where in a slot's META its disk record and its flags lie (the disk tier sets them).
META_DISK_OFFSET = struct.calcsize(SLOT_META.format[:2])  # after "<Q" (the format's "<" counts)
META_FLAGS_OFFSET = struct.calcsize(SLOT_META.format[:5])  # after "<QQqI"
SLOT_META_OFFSET = SLOT.size + ADDRESS_MAX  # 320
SLOT_SIZE = SLOT_META_OFFSET + SLOT_META.size  # 384
#: A slot's checksum alone (the GET path's one extra read).
SLOT_CHECKSUM = struct.Struct("<Q")
SLOT_EMPTY = 0
SLOT_READY = 1
#: A slot's state and block id alone (a lookup checking a block is still where it was).
SLOT_STATE_AND_ID = struct.Struct(f"<B{struct.calcsize(SLOT.format[: 1 + F_BLOCK_ID]) - 1}xQ")
SLOT_REF_OFFSET = 1  # byte offset of the CLOCK reference count inside a slot
#: CLOCK's reference count (one byte): a block is published with REF_NEW, a use (a hit, a
#: dedup PUT, a local reader's hit folded in) sets it to REF_TOUCHED, each pass of the hand
#: takes one off, and the hand evicts a block it finds at 0. The hand walks the slots in
#: a scattered order, not by age, so with a bit (published at 0, used: 1) a block stored a
#: moment ago was as likely a victim as one stored a sweep ago: of the newest tenth of a
#: full slab's blocks, 6% were gone. A count of several passes makes a block's life
#: several sweeps long, give or take one, so its place in the order matters less; a new
#: block's one pass still lets a used one outlive it (scan resistance).
#: scripts/bench_eviction.py; docs/design.md ("Eviction").
REF_NEW, REF_TOUCHED = 1, 3

# The namespace table, right after the header: NS_COUNT entries of NS_WORDS int64 words.
# Entry 0 is the default namespace. An entry is in use while its NS_USED word is 1; its
# id never changes while it is (names are bound to ids under the slab lock, so every
# process and every restart agrees). The counters are kept under the lock like the state
# words; check() recomputes the derived ones from the slots.
NS_COUNT = 4096
(
    NS_USED,
    NS_QUOTA,  # bytes; 0 = none
    NS_HAND,  # where this namespace's own CLOCK sweep resumes (a slot index)
    NS_NAME_LEN,
    # derived from the slots (check() recomputes them)
    NS_BLOCKS,
    NS_REFS,
    NS_RESIDENT_BYTES,
    NS_LOGICAL_BYTES,
    NS_PAGES,
    # events
    NS_DEDUP_HITS,
    NS_EVICTIONS,
    NS_EVICTED_BYTES,
    NS_GET_HITS,  # counted without the lock: may lose a count under concurrent readers
    NS_GET_MISSES,
    NS_PUTS_CREATED,
    NS_DELETES,
    # derived from the reservations (check() recomputes it): pages its uploads in flight
    # hold. The quota counts them with NS_PAGES, so uploads cannot overrun it unseen.
    NS_RESV_PAGES,
    # pages of its blocks whose slot counts a lease (ST_LEASED_PAGES, by namespace)
    NS_LEASED_PAGES,
) = range(18)
#: Counters check() recomputes: from the slots, then (the last) from the reservations.
NS_DERIVED = {
    "unique_blocks": NS_BLOCKS,
    "total_refs": NS_REFS,
    "resident_bytes": NS_RESIDENT_BYTES,
    "logical_bytes": NS_LOGICAL_BYTES,
    "slot_pages": NS_PAGES,
    "reserved_pages": NS_RESV_PAGES,
}
NS_EVENTS = {
    "dedup_hits": NS_DEDUP_HITS,
    "get_hits": NS_GET_HITS,
    "get_misses": NS_GET_MISSES,
    "evictions": NS_EVICTIONS,
    "evicted_bytes": NS_EVICTED_BYTES,
    "puts_created": NS_PUTS_CREATED,
    "deletes": NS_DELETES,
}
NS_NAME_MAX = 64
NS_NAME_WORD = 24  # the name's bytes start at this word (18-23: spare, zero)
NS_WORDS = NS_NAME_WORD + NS_NAME_MAX // 8  # 32
NS_ENTRY_SIZE = 8 * NS_WORDS  # 256
NS_OFFSET = HEADER_SIZE
NS_TABLE_SIZE = NS_COUNT * NS_ENTRY_SIZE  # 1 MiB
SLOT_BLOCK_ID_OFFSET = 32  # byte offset of the block id inside a slot (a uint64)
SLOT_FP_OFFSET = 40  # byte offset of the fingerprint inside a slot (a uint64)
SLOT_NS_OFFSET = 48  # byte offset of the namespace id inside a slot (a uint32)
SLOT_LEASES_OFFSET = 52  # byte offset of the lease count inside a slot (a uint32)
SLOT_LEASE_END_OFFSET = 56  # byte offset of the newest lease's expiry (an int64)
assert SLOT_SIZE % 8 == 0 and SLOT.size - 8 == SLOT_LEASE_END_OFFSET
assert SLOT_META.size == 64 and SLOT_META_OFFSET % 8 == 0
assert struct.calcsize("<BBHIQqQ") == SLOT_BLOCK_ID_OFFSET
assert struct.calcsize("<BBHIQqQQ") == SLOT_FP_OFFSET
NS_MIX = 0x9E3779B97F4A7C15


def ns_fingerprint(fp: int, ns: int) -> int:
    """The slot fingerprint of an address whose own fingerprint is ``fp``, in namespace
    ``ns``: the same address in two namespaces lands on two homes and never matches."""
    return fp ^ ((ns * NS_MIX) & 0xFFFFFFFFFFFFFFFF) if ns else fp


# The readers segment, ``<slab name>.readers``: what clients that read the slab locally
# (read-only) may write. Mode 0600 like the slab; created with it and removed with it.
#
#     0        64                         64 + NREADERS * 128       leases_off (8-aligned)
#     ┌────────┬──────────────────────────┬──────────────────────┬──────────────────────────┐
#     │ header │ entries: NREADERS × 16 q │ hit hints: S bytes   │ lease tables:            │
#     │        │                          │                      │ LEASE_READERS × lease_   │
#     │        │                          │                      │ records × (id q, end q)  │
#     └────────┴──────────────────────────┴──────────────────────┴──────────────────────────┘
#     holds_off (after the lease tables)
#     ┌──────────────────────────────────────────────────────────────┐
#     │ lease holders: hold_records × (id q, holder q, count q, end q) │
#     └──────────────────────────────────────────────────────────────┘
#     header:  READERS_HEAD: magic, slab id, entries, slots
#     entry:   pid (informational), namespace id, get hits, get misses, lease records in
#              use (the table's high-water mark), leases taken, leases released, the
#              table's generation (bumped after every change of it: the server rereads a
#              table only when it moved), checksum failures; 7 spare words.
#              An entry is owned by whoever holds an OFD write lock on its first byte (the
#              kernel drops it when the owner dies, in any pid namespace); its counts only
#              grow and stay when the owner dies, so the slab's stats add every entry.
#     hints:   hint[i] = 1: a local reader hit slot i; the owner folds it into the slot's
#              CLOCK reference count and clears it (a moved slot's hint is a second chance
#              it did not earn, as a lock-free reference count may be).
#     leases:  entry e < LEASE_READERS owns table e: the leases its lookups took locally
#              (eg_kv.slab.local_leases), one record per block: the block id (0: free) and
#              when the lease ends (monotonic ms). Eviction passes over a block whose id a
#              record holds with an end still ahead, as over a slot's own lease.
#     holders: who holds the leases servers took (eg_kv.slab.holds): one record per block
#              and holder (a token's tenant), its lease count and when its newest lease
#              ends, so a release ends only a lease its own holder took. Open addressing
#              by block and holder, written under the slab's lock; id 0: never used (a
#              probe stops), -1: freed (a probe goes on); a record whose end has passed
#              holds nothing and may be taken.
READERS_MAGIC = b"EGKVRDR4"  # 2: lease tables, and the entry's lease words; 3: holders;
# 4: 16-word entries (checksum failures; the rest spare)
READERS_HEAD = struct.Struct("<8s16sQQ")  # magic, slab id, entries, slots
READERS_HEADER_SIZE = 64
NREADERS = 1024
READER_WORDS = 16
READER_ENTRY_SIZE = 8 * READER_WORDS
(
    R_PID, R_NS, R_HITS, R_MISSES, R_LEASE_TOP, R_LEASES_TAKEN, R_LEASES_RELEASED, R_LEASE_GEN,
    R_CHECKSUM_FAILURES,  # blocks this reader copied whose bytes failed their checksum
) = range(9)  # fmt: skip
# words 9-15: spare (zero)
READERS_HINTS_OFFSET = READERS_HEADER_SIZE + NREADERS * READER_ENTRY_SIZE
READERS_SUFFIX = ".readers"
#: Reader entries that may lease locally (the rest lease over HTTP: a host runs a few
#: engines), and the most records each holds: 16 batches of 1024 addresses leased at once
#: (LMCache's bench of 1024-key rounds leases 4,096 before its loads), fewer in a slab of
#: fewer blocks (:func:`lease_records`). At most 16 x 16384 x 16 B: 4 MiB, touched only by
#: readers that lease.
LEASE_READERS = 16
LEASE_RECORDS = 16384
LEASE_RECORD_WORDS = 2  # block id, end (monotonic ms)


def lease_records(nslots: int) -> int:
    """Records in each lease table of a slab with ``nslots`` slots: as many as it can hold
    blocks (half its slots: a block owns a page), at most :data:`LEASE_RECORDS`."""
    return min(LEASE_RECORDS, max(16, nslots // 2))


def now_ms() -> int:
    """The lease clock: ``CLOCK_MONOTONIC`` in milliseconds (system-wide on Linux), the
    unit of every lease end, a slot's or a local reader's."""
    return time.monotonic_ns() // 1_000_000


def readers_leases_offset(nslots: int) -> int:
    """Where the lease tables of a slab with ``nslots`` slots start in its readers segment."""
    return _align(READERS_HINTS_OFFSET + nslots, 8)


#: Lease holder records: one per block leased over HTTP and token holding it, as many as
#: the slab has slots (a power of two), at most HOLD_RECORDS_MAX (32 MiB of them).
HOLD_RECORDS_MAX = 1 << 20
HOLD_RECORD_WORDS = 4  # block id (0: never used, -1: freed), holder, count, end


def hold_records(nslots: int) -> int:
    """Holder records in the readers segment of a slab with ``nslots`` slots."""
    return min(HOLD_RECORDS_MAX, 1 << max(6, (nslots - 1).bit_length()))


def readers_holds_offset(nslots: int) -> int:
    """Where the lease holder records of a slab with ``nslots`` slots start."""
    return readers_leases_offset(nslots) + LEASE_READERS * lease_records(nslots) * 16


def readers_size(nslots: int) -> int:
    """Bytes of the readers segment of a slab with ``nslots`` slots."""
    return readers_holds_offset(nslots) + hold_records(nslots) * HOLD_RECORD_WORDS * 8


# Reservation: writer pid (0 = entry free), first page, page count, namespace id (charged
# with the pages: its quota counts them), block length. The page count and namespace share
# a word as two uint32 (a slab has under 2**32 pages), so an entry stays 32 bytes.
RESV = struct.Struct("<QqIIQ")
RESV_SIZE = RESV.size  # 32

NO_PAGE = -1
#: A reservation entry's first page when it holds no pages but a dedup hit's reference,
#: taken when its put began (its length field is then the block's id): a writer killed
#: before the put ended leaves it, and its reference is taken back (not a page is freed).
RESV_DEDUP = -2
#: Reservation entries after the pages' own, for the references of dedup hits whose
#: bodies are still arriving (RESV_DEDUP), and only for them: one client's stalled dedup
#: PUTs (a connection each, holding no page) filled a table of one entry per page, and
#: every other tenant's large PUT got 503 "the reservation table is full". Past these, a
#: dedup hit goes on without its entry (its reference is then not given back if its writer
#: is killed mid-body: a count one too high, never a block lost or served wrong).
DEDUP_ENTRIES = 4096


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where everything lies in a slab of a given capacity; derived once, then recorded."""

    page_size: int
    npages: int
    nslots: int
    nresv: int
    max_block_size: int
    resv_off: int
    slots_off: int
    next_off: int
    tag_off: int
    data_off: int
    total_size: int

    @classmethod
    def plan(cls, capacity: int, page_size: int, max_block_size: int) -> Geometry:
        """Lay out a slab whose data area holds ``capacity`` bytes (rounded down to pages).

        There are at least twice as many slots as pages (every block owns at least one
        page, empty blocks aside), so the table's load factor stays at or under one half.
        There is one reservation entry per page: every put in flight holds at least one
        page, so the table can never fill before the pages do (a fixed 1024 entries was
        full of 1,024 stalled two-page uploads while the slab was 87% free). At 32 bytes
        per page it costs 0.05% of 64 KiB pages, 0.8% of 4 KiB ones. Then
        :data:`DEDUP_ENTRIES` more for dedup hits in flight (128 KiB).
        """
        npages = capacity // page_size
        nresv = max(1, npages) + DEDUP_ENTRIES
        nslots = 1 << max(4, (2 * npages - 1).bit_length())
        resv_off = NS_OFFSET + NS_TABLE_SIZE
        slots_off = _align(resv_off + nresv * RESV_SIZE)
        next_off = _align(slots_off + nslots * SLOT_SIZE)
        tag_off = _align(next_off + npages * 8)
        data_off = _align(tag_off + npages * 8, max(ALIGN, min(page_size, 2 * 1024 * 1024)))
        total = data_off + npages * page_size
        return cls(
            page_size, npages, nslots, nresv, max_block_size,
            resv_off, slots_off, next_off, tag_off, data_off, total,
        )  # fmt: skip

    def pack(self, created_at: float) -> bytes:
        return GEOMETRY.pack(
            MAGIC, VERSION, HEADER_SIZE, self.page_size, self.npages, self.nslots,
            self.nresv, self.max_block_size, self.resv_off, self.slots_off,
            self.next_off, self.tag_off, self.data_off, self.total_size, created_at,
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes) -> tuple[bytes, int, Geometry]:
        """Return (magic, version, geometry) from the first GEOMETRY.size header bytes."""
        (magic, version, _hdr, ps, np_, ns, nr, mb, ro, so, no, to, do, total, _t) = (
            GEOMETRY.unpack_from(raw)
        )
        return magic, version, cls(ps, np_, ns, nr, mb, ro, so, no, to, do, total)
