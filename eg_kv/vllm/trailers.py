"""The trailer a vLLM block carries after its bytes: what binds them to their address.

Both vLLM paths store a block as its row (every layer of one shard's block, or one
primary slot) followed by :data:`TRAILER` bytes: the XXH3-128 of the address (its length
first) and the row. A load reads the row and the trailer and uses the row only when the
trailer is the one its address and bytes give, so a block of the right length that is not
this address's (a server that mixed up two slots, a member back with stale state, a proxy,
another service at the URL) is a miss, never KV from another prompt. It runs at 50 GB/s
(BLAKE2b, before, ran at 0.7: ``scripts/bench_integrity.py``); it is no MAC (the block
key, :mod:`eg_kv.blockkey`, is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

__all__ = ["TRAILER", "Mismatch", "read_row", "trailer"]

#: Bytes after the row in a stored block: its trailer.
TRAILER = 16


class Mismatch(Exception):
    """A block that is not what was stored at its address (a miss)."""


def trailer(address: str, row: Any) -> bytes:
    """The trailer stored after ``row`` under ``address``."""
    raw = address.encode("ascii")
    h = xxhash.xxh3_128(len(raw).to_bytes(2, "little") + raw)
    h.update(row)
    return h.digest()


def read_row(
    address: str, row: memoryview, length: int, read_exact: Callable[[memoryview], None],
    check: bool = True,
) -> None:  # fmt: skip
    """A fetch sink's body for a block stored as ``row`` and its trailer: read both and
    check the trailer (``check``: False only where something else vouches for it).

    Raises:
        Mismatch: the block is another length, or not the bytes stored at ``address``
            (``row`` then holds bytes that must not be used).
    """
    if length != len(row) + TRAILER:
        raise Mismatch(f"block of {length} bytes, not {len(row) + TRAILER}")
    read_exact(row)
    tail = bytearray(TRAILER)
    read_exact(memoryview(tail))
    if check and trailer(address, row) != tail:
        raise Mismatch("digest differs: not the bytes stored at this address")
