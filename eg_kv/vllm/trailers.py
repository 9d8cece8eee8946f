"""The trailer a vLLM block carries after its bytes: what binds them to their address.

Both vLLM paths store a block as its row (every layer of one shard's block, or one
primary slot) followed by :data:`TRAILER` bytes, and a load uses the row only when the
trailer is the one its address gives, so a block of the right length that is not this
address's (a server that mixed up two slots, a member back with stale state, a proxy,
another service at the URL) is a miss, never KV from another prompt:

- the tier's (:func:`trailer`): the XXH3-128 of the address (its length first) and the
  row, at 50 GB/s (BLAKE2b, before, ran at 0.7: ``scripts/bench_integrity.py``);
- the connector's (:func:`address_tag`): the XXH3-128 of the address alone. The block's
  checksum, which the client checks on every load, vouches for the bytes; the tag only
  has to say whose they are, and hashing the row again cost local loads of 2 MiB rows a
  quarter of their rate (12.3 GiB/s to 9.4, 4 threads).

Neither is a MAC (the block key, :mod:`eg_kv.blockkey`, is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

__all__ = ["TRAILER", "Mismatch", "address_tag", "read_row", "trailer"]

#: Bytes after the row in a stored block: its trailer.
TRAILER = 16


class Mismatch(Exception):
    """A block that is not what was stored at its address (a miss)."""


def _started(address: str) -> Any:
    raw = address.encode("ascii")
    return xxhash.xxh3_128(len(raw).to_bytes(2, "little") + raw)


def trailer(address: str, row: Any) -> bytes:
    """The tier's trailer, stored after ``row`` under ``address``."""
    h = _started(address)
    h.update(row)
    return h.digest()


def address_tag(address: str) -> bytes:
    """The connector's trailer: ``address``'s tag."""
    return _started(address).digest()


def read_row(
    address: str, row: memoryview, length: int, read_exact: Callable[[memoryview], None],
    check: bool = True, tagged: bool = False,
) -> None:  # fmt: skip
    """A fetch sink's body for a block stored as ``row`` and its trailer: read both and
    check the trailer (``check``: False only where something else vouches for it;
    ``tagged``: the connector's :func:`address_tag`, else the tier's :func:`trailer`).

    Raises:
        Mismatch: the block is another length, or not the bytes stored at ``address``
            (``row`` then holds bytes that must not be used).
    """
    if length != len(row) + TRAILER:
        raise Mismatch(f"block of {length} bytes, not {len(row) + TRAILER}")
    read_exact(row)
    tail = bytearray(TRAILER)
    read_exact(memoryview(tail))
    if check and (address_tag(address) if tagged else trailer(address, row)) != tail:
        raise Mismatch("digest differs: not the bytes stored at this address")
