"""The keeper's socket: how workers ask the disk tier's index (``DIR/keeper.sock``).

A frame is a 4-byte little-endian length, then a msgpack array. A request is
``[op, id, *args]``; the keeper answers ``[id, result]`` unless ``id`` is 0 (a report that
wants no answer). The socket lies in ``DIR`` (mode 0700, the server's uid), so only the
server's own processes reach it.

=========  =========================================  ===========================================
op         args                                       result
=========  =========================================  ===========================================
find       namespace, [address, ...], load (bool)     [file id, [[offset, length, seq, checksum,
                                                      refs] or None, ...]]
delete     namespace, address                         whether it was there (one reference goes)
discard    namespace, address                         whether it was there (the copy goes)
adopt      namespace, address, checksum, block id     the refs of a copy with that checksum not
                                                      spilled from that block, or 0 (a copy with
                                                      another checksum is dropped)
stats      (none)                                     the tier's counters (a map)
list       namespace (None: all), listing id (0: new) [listing id, [[namespace, address,
                                                      length], ...] (LIST_PAGE at most), done]
bad        namespace, address, seq                    (report) a record that failed its checks
loaded     bytes, seconds                             (report) a verified read from the file
refs       namespace, address, references             (report) a dedup PUT or a DELETE that left
                                                      references: the resident block's count now
=========  =========================================  ===========================================
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec

FIND, DELETE, DISCARD, ADOPT = "find", "delete", "discard", "adopt"
STATS, BAD, LOADED, REFS, LIST = "stats", "bad", "loaded", "refs", "list"
#: Blocks one ``list`` answer holds at most.
LIST_PAGE = 4096
FRAME = struct.Struct("<I")
#: The largest frame either side accepts (a find of 1,024 addresses is ~300 KiB).
MAX_FRAME = 4 * 1024 * 1024

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def frame(message: list[Any]) -> bytes:
    """One frame holding ``message``."""
    body = _encode(message)
    return FRAME.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message on ``reader``.

    Raises:
        asyncio.IncompleteReadError: the peer closed. ValueError: a frame over
            :data:`MAX_FRAME` or not msgpack.
    """
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME})")
    try:
        return _decode(await reader.readexactly(n))
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
