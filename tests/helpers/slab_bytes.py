"""Change a stored block's bytes where they lie, in the slab's file in ``/dev/shm`` (as the
server's user: the tests'), the way a bit flip or a stray writer would."""

from __future__ import annotations

import mmap
from pathlib import Path

KiB = 1024


def change_one_byte(srv, data: bytes, at: int) -> bool:
    """Flip the bits of byte ``at`` of the block whose bytes start with ``data``'s first
    4 KiB, in ``srv``'s slab. False if ``srv`` does not hold it."""
    path = Path("/dev/shm") / srv.slab_name.lstrip("/")
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        head = data[: 4 * KiB]
        pos = mm.find(head)
        if pos < 0:
            return False
        assert mm.find(head, pos + 1) == -1, "the block's bytes are not unique"
        mm[pos + at] ^= 0xFF
        return True
