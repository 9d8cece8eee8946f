"""A block's name as its engine knows it: what a PUT may carry so that the server's KV
events (:mod:`eg_kv.kvevents`) name blocks the way a KV-aware router does.

eg-kv addresses blocks by its clients' addresses (``egv2-...``, an LMCache key, an SGLang
page hash). A router that scores instances by their cached prefixes (vLLM's KV-events
stream, llm-d's indexer, Dynamo's router) knows blocks by the *engine's* block hash, the
hash of its parent block, the block size in tokens and the LoRA id. A PUT may carry them
in four headers; the slab keeps them with the block (the slot's META, and each entry of
the event log), so a removal hours later still names what it removed. A block stored
without them (curl, an older client) is published under its eg-kv address.

=====================================  ==================================================
header                                 value
=====================================  ==================================================
``X-Eg-Kv-Engine-Hash``                the block's hash, 1-32 bytes as lowercase hex
``X-Eg-Kv-Engine-Parent``              its parent block's hash, as above (absent: none)
``X-Eg-Kv-Engine-Block-Size``          tokens in the block, 1 to 2**31 - 1
``X-Eg-Kv-Engine-Lora``                the LoRA id, 0 to 2**63 - 1 (absent or 0: none)
=====================================  ==================================================

Standard library only (the sync client imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from .errors import BadRequest
from .wire import whole_number

__all__ = [
    "ENGINE_HASH_MAX",
    "NO_ENGINE",
    "EngineName",
    "chained_names",
    "engine_from_headers",
    "engine_header_lines",
    "engine_headers",
    "hash_bytes",
]

#: The longest engine hash kept (SHA-256, vLLM's and SGLang's, is 32 bytes).
ENGINE_HASH_MAX = 32
HASH_HEADER = "X-Eg-Kv-Engine-Hash"
PARENT_HEADER = "X-Eg-Kv-Engine-Parent"
BLOCK_SIZE_HEADER = "X-Eg-Kv-Engine-Block-Size"
LORA_HEADER = "X-Eg-Kv-Engine-Lora"
_BLOCK_SIZE_MAX = (1 << 31) - 1
_LORA_MAX = (1 << 63) - 1


class EngineName(NamedTuple):
    """A block's engine identity (all empty: none given)."""

    hash: bytes = b""  #: the engine's block hash (at most ENGINE_HASH_MAX bytes)
    parent: bytes = b""  #: its parent block's hash (b"": a first block, or not given)
    block_size: int = 0  #: tokens in the block (0: not given)
    lora_id: int = 0  #: 0: none


NO_ENGINE = EngineName()


def engine_headers(name: EngineName) -> dict[str, str]:
    """The headers that carry ``name`` on a PUT (none for :data:`NO_ENGINE`)."""
    out: dict[str, str] = {}
    if name.hash:
        out[HASH_HEADER] = name.hash.hex()
    if name.parent:
        out[PARENT_HEADER] = name.parent.hex()
    if name.block_size:
        out[BLOCK_SIZE_HEADER] = str(name.block_size)
    if name.lora_id:
        out[LORA_HEADER] = str(name.lora_id)
    return out


def hash_bytes(h: bytes | int) -> bytes:
    """An engine's block hash as bytes: bytes as they are (their last
    :data:`ENGINE_HASH_MAX`), an int (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) as
    8 big-endian bytes of its two's complement."""
    if isinstance(h, bytes):
        return h[-ENGINE_HASH_MAX:]
    return (int(h) & (1 << 64) - 1).to_bytes(8, "big")


def chained_names(
    hashes: Sequence[bytes | int], block_size: int, parent: bytes | int | None = None
) -> list[EngineName]:
    """Consecutive blocks of one sequence as their engine names them: each hash, the one
    before it as its parent (``parent`` for the first; None: none), the block size.
    An empty hash gives :data:`NO_ENGINE` and the next block no parent."""
    out: list[EngineName] = []
    last = b"" if parent is None else hash_bytes(parent)
    for h in hashes:
        raw = hash_bytes(h)
        out.append(EngineName(raw, last, block_size) if raw else NO_ENGINE)
        last = raw
    return out


def engine_header_lines(name: EngineName) -> bytes:
    """:func:`engine_headers` as HTTP/1.1 header lines (the sync client's form)."""
    return "".join(f"{k}: {v}\r\n" for k, v in engine_headers(name).items()).encode("ascii")


def _hash(header: str, text: str | None) -> bytes:
    if text is None:
        return b""
    try:
        raw = bytes.fromhex(text) if text.isascii() and len(text) % 2 == 0 else b"\0" * 99
    except ValueError:
        raw = b"\0" * 99
    if not 1 <= len(raw) <= ENGINE_HASH_MAX or len(text) != 2 * len(raw):
        raise BadRequest(f"{header}: want 1-{ENGINE_HASH_MAX} bytes as hex digits")
    return raw


def _number(header: str, text: str | None, low: int, high: int) -> int:
    if text is None:
        return 0
    n = whole_number(text)
    if n is None or not low <= n <= high:
        raise BadRequest(f"{header}: want a whole number from {low} to {high}")
    return n


def engine_from_headers(get: Callable[[str], str | None]) -> EngineName:
    """The engine name a PUT carries (``get``: its headers' ``get``).

    Raises:
        BadRequest: a header that is not what the table above says, or engine fields
            without the engine hash they describe.
    """
    h, parent, size, lora = (
        get(HASH_HEADER),
        get(PARENT_HEADER),
        get(BLOCK_SIZE_HEADER),
        get(LORA_HEADER),
    )
    if h is None and parent is None and size is None and lora is None:
        return NO_ENGINE  # most PUTs: no name to parse or compare
    name = EngineName(
        _hash(HASH_HEADER, h),
        _hash(PARENT_HEADER, parent),
        _number(BLOCK_SIZE_HEADER, size, 1, _BLOCK_SIZE_MAX),
        _number(LORA_HEADER, lora, 0, _LORA_MAX),
    )
    if not name.hash and name != NO_ENGINE:
        raise BadRequest(f"{PARENT_HEADER}, {BLOCK_SIZE_HEADER} and {LORA_HEADER} need "
                         f"{HASH_HEADER}: the block they describe")  # fmt: skip
    return name
