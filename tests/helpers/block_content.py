"""The bytes a test address always names, so any process can check a block it did not
write (the slab tests' children and the warm-attach filler import this)."""

from __future__ import annotations

import hashlib

KiB = 1024


def content(address: str) -> bytes:
    """The bytes an address always names: its length and fill follow from its digest."""
    digest = hashlib.blake2b(address.encode(), digest_size=32).digest()
    length = 1 + int.from_bytes(digest[:4], "little") % (48 * KiB)
    return (digest * (length // 32 + 1))[:length]
