"""Block addresses: the connector's token-hash strings, validated once for every layer."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence

import xxhash

from .errors import InvalidAddress

#: The longest address, in ASCII characters (a slot holds it whole: eg_kv/slab/layout.py).
ADDRESS_MAX = 256

#: The characters an address may hold: letters, digits and ``. _ : @ + = -``.
SAFE_CHARS = "A-Za-z0-9._:@+=-"
_ONE = rf"[{SAFE_CHARS}]{{1,{ADDRESS_MAX}}}"
_ADDRESS_RE = re.compile(_ONE)
#: Addresses joined by newlines (which no address holds): a batch checked in one match.
_ADDRESS_LINES_RE = re.compile(rf"(?:{_ONE}\n)*{_ONE}")

#: Words the HTTP routes use under ``/kv/``; they can never be block addresses.
RESERVED = frozenset({"stats", "batch", "exists", "metrics", "healthz", "events"})
#: URL dot segments: clients and proxies rewrite ``/kv/..`` to ``/`` (RFC 3986 5.2.4),
#: so such an address would mean one block to one client and another route to the next.
DOT_SEGMENTS = frozenset({".", ".."})


def validate(address: str) -> bytes:
    """Check an address and return its ASCII bytes.

    Raises:
        InvalidAddress: empty, longer than 256 characters, a character outside
            ``[A-Za-z0-9._:@+=-]``, one of the reserved words, or ``.`` / ``..``.
    """
    if not isinstance(address, str) or not _ADDRESS_RE.fullmatch(address):
        shown = address[:40] + "..." if isinstance(address, str) and len(address) > 40 else address
        raise InvalidAddress(
            f"invalid address {shown!r}: use 1-{ADDRESS_MAX} characters of [{SAFE_CHARS}]"
        )
    if address in RESERVED:
        raise InvalidAddress(f"address {address!r} is reserved for a route; pick another")
    if address in DOT_SEGMENTS:
        raise InvalidAddress(f"address {address!r} is a URL dot segment; pick another")
    return address.encode("ascii")


def all_valid(addresses: Sequence[object]) -> bool:
    """Whether every item is a valid address (:func:`validate`), in one regex over the
    batch (a match per address was a tenth of a 1,024-address lease release)."""
    if not addresses or not all(isinstance(a, str) for a in addresses):
        return False
    joined = "\n".join(addresses)  # type: ignore[arg-type]
    return (
        joined.count("\n") == len(addresses) - 1  # no item split in two by its own newline
        and _ADDRESS_LINES_RE.fullmatch(joined) is not None
        and RESERVED.isdisjoint(addresses)
        and DOT_SEGMENTS.isdisjoint(addresses)
    )


#: A 64-bit hash of an address's bytes, the same in every process (unlike ``hash()``): a
#: slot's home and fingerprint (layout 7: XXH3-64, 0.1 µs, where BLAKE2b took 0.6 µs of
#: each first-seen address of a lookup).
fingerprint: Callable[[bytes], int] = xxhash.xxh3_64_intdigest


def address_for_key(key: str | bytes) -> str:
    """Turn any key (LMCache keys hold ``/``) into a valid address: a stable digest.

    The same key gives the same address in every process and on every host.
    """
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return "k" + hashlib.blake2b(raw, digest_size=20).hexdigest()


class AddressCache:
    """The addresses of keys an engine asks about again and again (a lookup, then its
    load; the same prefixes in every request), each computed once. Bounded: cleared when
    full (no LRU cost on the hot path).
    """

    def __init__(self, address_of: Callable[[str], str], max_entries: int = 65536) -> None:
        """Args:
        address_of: the key -> address function (a digest: about 1 µs a key).
        max_entries: keys remembered before the memory is cleared.
        """
        self._address_of = address_of
        self._max = max_entries
        self._known: dict[str, str] = {}

    def address(self, key: str) -> str:
        """``address_of(key)``, remembered."""
        address = self._known.get(key)
        if address is None:
            if len(self._known) >= self._max:
                self._known.clear()
            address = self._known[key] = self._address_of(key)
        return address

    def addresses(self, keys: Sequence[str]) -> list[str]:
        """:meth:`address` of each key (keys seen before are looked up in C)."""
        out = list(map(self._known.get, keys))
        if None in out:
            for n, address in enumerate(out):
                if address is None:
                    out[n] = self.address(keys[n])
        return out  # type: ignore[return-value]
