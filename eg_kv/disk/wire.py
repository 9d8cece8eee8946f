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
delete     namespace, address, deadline (monotonic   1: it was there (one reference goes), 0: not;
           ms: past it, not applied)                  IN_SLAB: the slab holds it now (delete it
                                                      there); None past its deadline
promote    namespace, address, seq                    [refs to publish record ``seq`` with, mark
                                                      id] ([0, 0]: not: it went, or is being
                                                      committed); DELETEs of it wait for
                                                      ``promoted``, COMMIT_S at most
discard    namespace, address, slab block (0: any)    whether it was there (the copy goes; not
                                                      a copy of a later block)
adopt      namespace, address, checksum, length,      [verdict, number, mark id, seq] on the copy
           deadline (monotonic ms)                    of a block a PUT is about to create (seq:
                                                      its record, for SAME); SAME and OTHER hold
                                                      DELETEs, promotions and ADOPTs of it until
                                                      ``promoted``, COMMIT_S at most
stats      (none)                                     the tier's counters (a map)
list       namespace (None: all), listing id (0: new) [listing id, [[namespace, address,
                                                      length, engine hash, parent, block size,
                                                      LoRA id], ...] (LIST_PAGE at most), done]
bad        namespace, address, seq                    (report) a record that failed its checks
loaded     bytes, seconds                             (report) a verified read from the file
refs       namespace, address, references             (report) a dedup PUT or a DELETE that left
                                                      references: the resident block's count now
promoted   namespace, address, mark id[, refs]        (report) the promotion (or adopting PUT)
                                                      holding that mark is committed, or not;
                                                      ``refs`` join the copy
=========  =========================================  ===========================================
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgspec

FIND, DELETE, DISCARD, ADOPT = "find", "delete", "discard", "adopt"
#: ADOPT's verdicts on the disk's copy of an address a PUT is about to create in the
#: slab, with a number: NEW (no copy), SAME (the same bytes: the PUT publishes the block
#: with the copy's references, its number, and its own), OTHER (the same length, other
#: bytes: the copy stands, as a resident block would, with this PUT's reference; its
#: references), CONFLICT (another length: the copy stands; its length), RESIDENT (the slab
#: holds the block: a dedup hit there), BUSY (the address stayed marked by another's
#: commit, the marks are full, or the answer would come too late: retry).
NEW, SAME, OTHER, CONFLICT = "new", "same", "other", "conflict"
RESIDENT, BUSY = "resident", "busy"
STATS, BAD, LOADED, REFS, LIST = "stats", "bad", "loaded", "refs", "list"
PROMOTE, PROMOTED = "promote", "promoted"
#: A ``delete``'s answer when the slab holds the block now (promoted or PUT meanwhile).
IN_SLAB = 2
#: How long DELETEs of a block being promoted wait for its commit at most (a worker
#: stopped between ``promote`` and ``promoted``); a worker whose ``promote`` answer took
#: over half of it publishes nothing.
COMMIT_S = 1.0
#: How long an ADOPT waits at most for another's commit of its address before it is
#: answered BUSY (well inside the worker's call timeout).
ADOPT_WAIT_S = 0.25
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
    n = _length(await reader.readexactly(FRAME.size))
    return _message(await reader.readexactly(n))


def _length(head: bytes) -> int:
    """A frame's length from its head (at most :data:`MAX_FRAME`, else ValueError)."""
    (n,) = FRAME.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME})")
    return n


def _message(body: bytes) -> Any:
    """A frame's message (not msgpack: ValueError)."""
    try:
        return _decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None


def listing_sync(path: str, namespace: str | None, timeout: float = 5.0) -> Iterator[list[Any]]:
    """The disk's blocks (``namespace``'s, or all) a ``list`` page at a time, asked on the
    keeper's socket at ``path`` without an event loop (the KV-events publisher's resync).

    Ends early (having said less) when the keeper is not there, does not answer within
    ``timeout`` seconds, or answers what is not a page: as the workers' listing does.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            listing = 0
            for call in range(1, 1 << 20):  # bounded: the index is, in pages
                sock.sendall(frame([LIST, call, namespace, listing]))
                answer = _read_frame_sync(sock)
                if not (isinstance(answer, list) and len(answer) == 2 and answer[0] == call):
                    return
                got = answer[1]
                if not (isinstance(got, list) and len(got) == 3):
                    return
                listing, page, done = got
                if page:
                    yield page
                if done:
                    return
        except (OSError, ValueError):
            return


def _read_frame_sync(sock: socket.socket) -> Any:
    """The next message on a blocking socket (:func:`read_frame`'s rules)."""
    return _message(_read_exactly(sock, _length(_read_exactly(sock, FRAME.size))))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionResetError("the keeper closed its socket")
        buf += chunk
    return bytes(buf)
