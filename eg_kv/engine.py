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
``X-Eg-Kv-Engine-Tokens``              the block's token ids: 1 to 1,024 unsigned 32-bit
                                       ints, little-endian, base64 (standard, padded)
``X-Eg-Kv-Engine-Lora-Name``           the LoRA's name: 1-128 of ``A-Z a-z 0-9 . _ - : / @ +``
=====================================  ==================================================

The token ids and the LoRA name are not kept in the slab (a block's tokens can be larger
than the block's record): a server with a KV-events publisher hands them to it as the PUT
is stored (:func:`extras_message`), and the publisher sends them in the block's
``BlockStored`` (and in a replay while it still holds them: the last
:data:`~eg_kv.kvevents.publisher.EXTRAS_KEPT` blocks'). Without a publisher they are
checked and dropped.

Standard library only (the sync client imports it).
"""

from __future__ import annotations

import array
import base64
import binascii
import re
import struct
import sys
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
    "extras_message",
    "hash_bytes",
    "lora_name_of",
    "packed_tokens",
    "read_extras_message",
    "token_list",
]

#: The longest engine hash kept (SHA-256, vLLM's and SGLang's, is 32 bytes).
ENGINE_HASH_MAX = 32
HASH_HEADER = "X-Eg-Kv-Engine-Hash"
PARENT_HEADER = "X-Eg-Kv-Engine-Parent"
BLOCK_SIZE_HEADER = "X-Eg-Kv-Engine-Block-Size"
LORA_HEADER = "X-Eg-Kv-Engine-Lora"
TOKENS_HEADER = "X-Eg-Kv-Engine-Tokens"
LORA_NAME_HEADER = "X-Eg-Kv-Engine-Lora-Name"
#: The most token ids a block's PUT may carry (a header of 5,464 base64 characters, under
#: aiohttp's 8,190 a header line).
TOKENS_MAX = 1024
_LORA_NAME = re.compile(r"[A-Za-z0-9._\-:/@+]{1,128}")
_BLOCK_SIZE_MAX = (1 << 31) - 1
_LORA_MAX = (1 << 63) - 1


class EngineName(NamedTuple):
    """A block's engine identity (all empty: none given)."""

    hash: bytes = b""  #: the engine's block hash (at most ENGINE_HASH_MAX bytes)
    parent: bytes = b""  #: its parent block's hash (b"": a first block, or not given)
    block_size: int = 0  #: tokens in the block (0: not given)
    lora_id: int = 0  #: 0: none
    #: the block's token ids, packed (uint32 little-endian; b"": not given). Not kept in
    #: the slab: a publisher's (see the module docstring).
    token_ids: bytes = b""
    lora_name: str = ""  #: the LoRA's name ("": none). Not kept in the slab either.


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
    if name.token_ids:
        out[TOKENS_HEADER] = base64.b64encode(name.token_ids).decode("ascii")
    if name.lora_name:
        out[LORA_NAME_HEADER] = name.lora_name
    return out


def packed_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as :attr:`EngineName.token_ids` holds them; b"" for none, more than
    :data:`TOKENS_MAX`, or an id that is not an unsigned 32-bit int (sent as none, not
    refused)."""
    if not 0 < len(tokens) <= TOKENS_MAX:
        return b""
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError):
        return b""
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def token_list(packed: bytes) -> list[int]:
    """:attr:`EngineName.token_ids` as ints."""
    ids = array.array("I")
    ids.frombytes(packed)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def lora_name_of(name: object) -> str:
    """A LoRA's name as a PUT may carry it; "" for none or one the header cannot carry."""
    return name if isinstance(name, str) and _LORA_NAME.fullmatch(name) else ""


def hash_bytes(h: bytes | int) -> bytes:
    """An engine's block hash as bytes: bytes as they are (their last
    :data:`ENGINE_HASH_MAX`), an int (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) as
    8 big-endian bytes of its two's complement."""
    if isinstance(h, bytes):
        return h[-ENGINE_HASH_MAX:]
    return (int(h) & (1 << 64) - 1).to_bytes(8, "big")


def chained_names(
    hashes: Sequence[bytes | int],
    block_size: int,
    parent: bytes | int | None = None,
    tokens: Sequence[int] | None = None,
    lora_id: int = 0,
    lora_name: str = "",
) -> list[EngineName]:
    """Consecutive blocks of one sequence as their engine names them: each hash, the one
    before it as its parent (``parent`` for the first; None: none), the block size.
    An empty hash gives :data:`NO_ENGINE` and the next block no parent.

    Args:
        tokens: the blocks' token ids, the first block's first (``block_size`` each);
            None: not sent.
        lora_id, lora_name: the sequence's LoRA (0, "": none).
    """
    out: list[EngineName] = []
    last = b"" if parent is None else hash_bytes(parent)
    lora_name = lora_name_of(lora_name)
    for i, h in enumerate(hashes):
        raw = hash_bytes(h)
        ids = b""
        if tokens is not None and block_size:
            ids = packed_tokens(tokens[i * block_size : (i + 1) * block_size])
        out.append(EngineName(raw, last, block_size, lora_id, ids, lora_name) if raw else NO_ENGINE)
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


def _tokens(text: str | None) -> bytes:
    if text is None:
        return b""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True) if text.isascii() else b"-"
    except (binascii.Error, ValueError):
        raw = b"-"
    if not raw or len(raw) % 4 or len(raw) > 4 * TOKENS_MAX:
        raise BadRequest(f"{TOKENS_HEADER}: want 1-{TOKENS_MAX} token ids as unsigned 32-bit "
                         "little-endian ints, base64")  # fmt: skip
    return raw


def _lora_name(text: str | None) -> str:
    if text is None:
        return ""
    if not _LORA_NAME.fullmatch(text):
        raise BadRequest(f"{LORA_NAME_HEADER}: want 1-128 of A-Z a-z 0-9 . _ - : / @ +")
    return text


_NONE_GIVEN = (None,) * 6


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
    tokens, lora_name = get(TOKENS_HEADER), get(LORA_NAME_HEADER)
    if (h, parent, size, lora, tokens, lora_name) == _NONE_GIVEN:
        return NO_ENGINE  # most PUTs: no name to parse or compare
    name = EngineName(
        _hash(HASH_HEADER, h),
        _hash(PARENT_HEADER, parent),
        _number(BLOCK_SIZE_HEADER, size, 1, _BLOCK_SIZE_MAX),
        _number(LORA_HEADER, lora, 0, _LORA_MAX),
        _tokens(tokens),
        _lora_name(lora_name),
    )
    if not name.hash and name != NO_ENGINE:
        raise BadRequest(f"{PARENT_HEADER}, {BLOCK_SIZE_HEADER}, {LORA_HEADER}, "
                         f"{TOKENS_HEADER} and {LORA_NAME_HEADER} need {HASH_HEADER}: the "
                         "block they describe")  # fmt: skip
    return name


#: A block's extras on their way to the publisher: namespace id, address length, LoRA
#: name length; then the address, the name, and the packed token ids.
_EXTRAS_HEAD = struct.Struct("<HHB")


def extras_message(ns: int, address: str, name: EngineName) -> bytes:
    """What a worker hands the KV-events publisher for a block it is storing: the token
    ids and LoRA name the slab does not keep (:func:`read_extras_message` reads it)."""
    raw, lora = address.encode("ascii"), name.lora_name.encode("ascii")
    return _EXTRAS_HEAD.pack(ns, len(raw), len(lora)) + raw + lora + name.token_ids


def read_extras_message(msg: bytes) -> tuple[int, bytes, bytes, str]:
    """(namespace id, address as bytes, packed token ids, LoRA name) of an
    :func:`extras_message`.

    Raises:
        ValueError: not one (a peer that is not a worker of this server).
    """
    if len(msg) < _EXTRAS_HEAD.size:
        raise ValueError("an extras message too short for its head")
    ns, alen, llen = _EXTRAS_HEAD.unpack_from(msg)
    at = _EXTRAS_HEAD.size
    tokens = msg[at + alen + llen :]
    if len(tokens) % 4 or len(tokens) > 4 * TOKENS_MAX or at + alen + llen > len(msg):
        raise ValueError("an extras message of another shape")
    return ns, msg[at : at + alen], tokens, msg[at + alen : at + alen + llen].decode("ascii")
