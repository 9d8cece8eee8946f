"""A PUT's body as the clients send it: its parts as byte views, no copy, and a clear
error for a value that is not bytes (every client, sync and async, one server or a set)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def byte_views(parts: Iterable[Any]) -> list[memoryview]:
    """A PUT's parts as byte views (no copy).

    Raises:
        TypeError: a part is not a contiguous bytes-like object (``str``, ``int``, ...): a
            programming error, never a miss.
    """
    views = []
    for part in parts:
        try:
            views.append(memoryview(part).cast("B"))
        except TypeError:
            raise TypeError(
                "a block's value must be bytes-like (bytes, bytearray, memoryview, a "
                f"contiguous array), not {type(part).__name__}"
            ) from None
    return views


def into_bytes(length: int, read_exact: Callable[[memoryview], None]) -> bytes:
    """A load's sink that returns the block as ``bytes`` (:meth:`get`'s)."""
    buf = bytearray(length)
    read_exact(memoryview(buf))
    return bytes(buf)
