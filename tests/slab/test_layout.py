"""The slab's byte layout: each offset the code writes a field at names that field."""

from __future__ import annotations

import struct

from eg_kv.slab import layout as L


def test_each_meta_offset_names_its_field():
    """A field written at its offset reads back as that field of the unpacked META, and
    nothing else changes (the disk record's offset was once the LoRA id's)."""
    values = (0x1111111111111111, 0x2222222222222222, 0x3333333333333333, 0x44444444,
              0x55, 0x20, b"\x66" * 32)  # fmt: skip
    for offset, fmt, field, new in (
        (L.META_DISK_OFFSET, "<Q", L.M_DISK, 0x0123456789ABCDEF),
        (L.META_FLAGS_OFFSET, "<B", L.M_FLAGS, L.META_SPILLED),
        (L.META_HASH_LEN_OFFSET, "<B", L.M_HASH_LEN, 7),
    ):
        buf = bytearray(L.SLOT_META.pack(*values))
        struct.pack_into(fmt, buf, offset, new)
        want = list(values)
        want[field] = new
        assert list(L.SLOT_META.unpack(bytes(buf))) == want


def test_the_slot_state_and_id_read_names_both_fields():
    """The lock-free check of a remembered slot reads its state and block id in one."""
    fields = struct.unpack(L.SLOT.format, bytes(L.SLOT.size))
    slot = [0 if not isinstance(f, bytes) else b"" for f in fields]
    slot[L.F_STATE], slot[L.F_BLOCK_ID] = L.SLOT_READY, 0x0A0B0C0D0E0F1011
    packed = L.SLOT.pack(*slot)
    assert L.SLOT_STATE_AND_ID.unpack_from(packed, 0) == (L.SLOT_READY, 0x0A0B0C0D0E0F1011)
