"""Reading a record back from the data file, in a worker, and proving it is the block.

The keeper says where a block's record lies; the worker reads it (``preadv``, which
releases the GIL, in a thread) and checks it before a byte is used: the header's MAC,
that it names this namespace, address, length and seq, and the block's checksum. Any
failure is a miss (the record may have been overwritten since the keeper answered, or torn
by a crash, or changed on disk), reported so the keeper drops it.
"""

from __future__ import annotations

import os
import threading

from ..checksum import of as checksum_of
from . import files
from . import layout as D

_local = threading.local()


def _buffer(size: int):
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            buf.close()
        buf = _local.buf = files.buffer(size)
    return buf


def check_header(raw: bytes, key: bytes, seq: int, length: int, namespace: str,
                 address: str) -> D.Record | None:  # fmt: skip
    """The header, if its MAC holds and it names this record; else None."""
    rec = D.unpack_header(raw, key)
    if rec is None or (rec.seq, rec.length, rec.namespace, rec.address) != (
        seq, length, namespace, address,
    ):  # fmt: skip
        return None
    return rec


def read_into(
    fd: int, key: bytes, offset: int, length: int, seq: int, namespace: str, address: str,
    views: list[memoryview],
) -> D.Record | None:  # fmt: skip
    """Read a record's block straight into ``views`` (aligned: the slab's reserved pages)
    and return its header if it names this record; the block's checksum is the caller's
    to check (the slab's commit does). None: a miss."""
    head = _buffer(D.HEADER)
    mv = memoryview(head)
    try:
        if not files.pread_all(fd, [mv[: D.HEADER], *views], offset):
            return None
    except OSError:
        return None
    finally:
        mv.release()
    return check_header(head[: D.HEADER], key, seq, length, namespace, address)


def read_block(
    fd: int, key: bytes, offset: int, length: int, seq: int, namespace: str, address: str
) -> tuple[bytes, D.Record] | None:
    """The block of the record at ``offset``, and its header; None unless every check
    holds (see the module docstring)."""
    size = D.record_size(length)
    buf = _buffer(size)
    mv = memoryview(buf)
    try:
        n = os.preadv(fd, [mv[:size]], offset)
    except OSError:
        return None
    finally:
        mv.release()
    if n < D.HEADER + length:  # the file was cut short
        return None
    rec = check_header(buf[: D.HEADER], key, seq, length, namespace, address)
    if rec is None:
        return None
    data = buf[D.HEADER : D.HEADER + length]
    if checksum_of(data) != rec.checksum:
        return None
    return data, rec
