"""The disk tier's file: a superblock, then records written one after another as a ring.

One preallocated file, ``DIR/blocks.egkv``, of ``--disk-capacity`` bytes::

    0          4096                                                        capacity
    ┌──────────┬──────────────┬──────────────┬─────┬──────────────┬────────┐
    │ super    │ record       │ record       │ ... │ record       │ (gap)  │
    └──────────┴──────────────┴──────────────┴─────┴──────────────┴────────┘
    super:   SUPER: magic, version, capacity, created (Unix ms), high water (no record
             was ever written at or past it: a scan stops there), then the file's key
             (32 random bytes, the records' MAC key), zeros to 4096.

    a record, ALIGN-aligned, HEADER + the block padded to ALIGN:
    ┌─────────────────────────────────────────────────────┬─────────────────────────┐
    │ header (4096)                                        │ the block, then padding │
    └─────────────────────────────────────────────────────┴─────────────────────────┘
    header:  0    RECORD: magic, seq, length, checksum, refs, flags, created (ms),
                  namespace length, address length
             64   the namespace's name (NS_NAME_MAX bytes, zero padded)
             128  the address (ADDRESS_MAX bytes, zero padded)
             384  the engine's name of the block (eg_kv.slab.events.ENGINE, 80 bytes)
             512  MAC: keyed BLAKE3 (the file's key) of bytes 0-511, 32 bytes

Records are appended at the head, which wraps to 4096 when the next record does not fit
before the end: the oldest records are overwritten first (the disk's eviction is FIFO in
write order). ``seq`` counts records written since the file was made; a scan that meets
the same address twice keeps the higher.

Why it holds (issue 33): a record proves itself. Its header's MAC is keyed by a secret
only the file holds, so bytes a client stored inside a block can never pass for a header
when a scan steps through them; the header names the block (namespace, address, length,
seq) and carries the checksum of its bytes (:mod:`eg_kv.checksum`, the same XXH3-64 the
slab keeps), so a torn write, a truncated file or a changed byte is a miss, never wrong
bytes. A record is indexed only once its write returned; a deleted record's header is
zeroed. O_DIRECT needs buffers, offsets and sizes aligned to the device's block: ALIGN
(4096) covers every device here.
"""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

import blake3

from ..address import ADDRESS_MAX
from ..engine import NO_ENGINE, EngineName
from ..slab.events import ENGINE
from ..slab.layout import NS_NAME_MAX

DATA_FILE = "blocks.egkv"
LOCK_FILE = "lock"
SOCKET_FILE = "keeper.sock"
ALIGN = 4096
HEADER = 4096
FIRST = HEADER  # where the first record lies (after the superblock)

SUPER_MAGIC = b"EGKVDSK1"
VERSION = 1
#: The superblock: magic, version, capacity, created (ms), high water, the file's key.
SUPER = struct.Struct("<8sIxxxxQQQ32s")
KEY_SIZE = 32

RECORD_MAGIC = b"EGKVREC1"
#: A record's fixed fields: magic, seq, length, checksum, refs, flags, created (ms), the
#: namespace's length, the address's length.
RECORD = struct.Struct("<8sQQQIIQHH")
NS_AT, ADDRESS_AT, ENGINE_AT, MAC_AT = 64, 128, 384, 512
MAC_SIZE = 32
assert RECORD.size <= NS_AT and NS_AT + NS_NAME_MAX <= ADDRESS_AT
assert ADDRESS_AT + ADDRESS_MAX <= ENGINE_AT and ENGINE_AT + ENGINE.size <= MAC_AT


class Super(NamedTuple):
    """The superblock's fields."""

    capacity: int
    created_ms: int
    high_water: int
    key: bytes


class Record(NamedTuple):
    """A record's header, as read back."""

    seq: int
    length: int
    checksum: int
    refs: int
    created_ms: int
    namespace: str
    address: str
    engine: EngineName


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def record_size(length: int) -> int:
    """The bytes a record of a ``length``-byte block takes on disk."""
    return HEADER + align(length)


def pack_super(sb: Super) -> bytes:
    """The superblock's 4096 bytes."""
    head = SUPER.pack(SUPER_MAGIC, VERSION, sb.capacity, sb.created_ms, sb.high_water, sb.key)
    return head + bytes(HEADER - len(head))


def unpack_super(raw: bytes) -> Super | None:
    """The superblock from the file's first bytes; None when they are not one."""
    if len(raw) < SUPER.size:
        return None
    magic, version, capacity, created, high_water, key = SUPER.unpack_from(raw)
    if magic != SUPER_MAGIC or version != VERSION:
        return None
    return Super(capacity, created, high_water, key)


def _mac(key: bytes, head: bytes | memoryview) -> bytes:
    return blake3.blake3(head, key=key).digest(MAC_SIZE)


def pack_header(
    buf: memoryview, key: bytes, seq: int, length: int, checksum: int, namespace: str,
    address: str, refs: int = 1, engine: EngineName = NO_ENGINE,
) -> None:  # fmt: skip
    """Write a record's header into ``buf[:HEADER]`` (whose bytes past the MAC are left
    as they are: nothing reads them)."""
    ns, addr = namespace.encode(), address.encode("ascii")
    buf[:MAC_AT] = bytes(MAC_AT)
    RECORD.pack_into(buf, 0, RECORD_MAGIC, seq, length, checksum, refs, 0, int(time.time() * 1000),
                     len(ns), len(addr))  # fmt: skip
    buf[NS_AT : NS_AT + len(ns)] = ns
    buf[ADDRESS_AT : ADDRESS_AT + len(addr)] = addr
    if engine is not NO_ENGINE:
        h, parent = engine.hash, engine.parent
        ENGINE.pack_into(buf, ENGINE_AT, engine.lora_id, engine.block_size, len(h),
                         len(parent), h, parent)  # fmt: skip
    buf[MAC_AT : MAC_AT + MAC_SIZE] = _mac(key, buf[:MAC_AT])


def unpack_header(raw: bytes | memoryview, key: bytes) -> Record | None:
    """A record's header from its first bytes; None unless its magic and MAC hold."""
    if len(raw) < MAC_AT + MAC_SIZE or bytes(raw[:8]) != RECORD_MAGIC:
        return None
    if bytes(raw[MAC_AT : MAC_AT + MAC_SIZE]) != _mac(key, raw[:MAC_AT]):
        return None
    _, seq, length, checksum, refs, _, created, nlen, alen = RECORD.unpack_from(raw)
    if nlen > NS_NAME_MAX or alen > ADDRESS_MAX:
        return None
    ns = bytes(raw[NS_AT : NS_AT + nlen]).decode("utf-8", "replace")
    address = bytes(raw[ADDRESS_AT : ADDRESS_AT + alen]).decode("ascii", "replace")
    lora, size, hlen, plen, h, parent = ENGINE.unpack_from(raw, ENGINE_AT)
    engine = EngineName(h[:hlen], parent[:plen], size, lora) if hlen else NO_ENGINE
    return Record(seq, length, checksum, refs, created, ns, address, engine)
