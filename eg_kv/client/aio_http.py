"""The async client's side of aiohttp: request bodies, reading answers within their
bounds, and the middleware that keeps a PUT or DELETE from being sent twice. Used by
:class:`~eg_kv.client.aio.AsyncServerConnector`; no rule of the contract lives here (they
are in :mod:`eg_kv.client.rules`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp.payload import Payload

from ..wire import (
    LEASE_REFUSED_HEADER,
)
from .core import BLOCK_TYPE
from .events import SNAPSHOT_ANSWER_MAX, Snapshot, SnapshotReader
from .interface import AsyncSink
from .rules import (
    SMALL_ANSWER_MAX,
    Miss,
    check_final,
    compact_answer,
    json_answer,
)

T = TypeVar("T")


class NotResent(aiohttp.ClientError):
    """A request that changes state lost its connection after it went out."""


async def never_resend(
    request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    # aiohttp resends PUT and DELETE once when the connection drops (it counts them
    # idempotent); a DELETE the server applied before dropping would release two
    # references. Its retry catches only these two errors, so renaming them stops it.
    try:
        return await handler(request)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise NotResent(f"{type(exc).__name__}: {exc}") from None


class Parts(Payload):
    """A PUT body made of several buffers, written in order without a copy.

    ``started`` tells whether aiohttp began writing it: with ``Expect: 100-continue`` a
    final answer may come first, and then the body was never sent.
    """

    def __init__(self, parts: list[memoryview]) -> None:
        super().__init__(parts, content_type=BLOCK_TYPE)
        self._size = sum(len(p) for p in parts)
        self.started = False

    async def write(self, writer: Any) -> None:
        self.started = True
        for part in self._value:
            await writer.write(part)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        await self.write(writer)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)


async def read_small(resp: aiohttp.ClientResponse) -> bytes:
    """A non-block body, at most :data:`SMALL_ANSWER_MAX` bytes however it is framed.

    Raises:
        Miss: it is longer.
    """
    if resp.method == "HEAD":
        return b""  # its Content-Length is the block's, and no body follows
    if resp.content_length is not None:
        if resp.content_length > SMALL_ANSWER_MAX:
            raise Miss(f"answer of {resp.content_length} bytes is over {SMALL_ANSWER_MAX}")
        return await resp.read()
    out = bytearray()
    async for chunk in resp.content.iter_any():
        out += chunk
        if len(out) > SMALL_ANSWER_MAX:
            raise Miss(f"answer is over {SMALL_ANSWER_MAX} bytes")
    return bytes(out)


async def drained(resp: aiohttp.ClientResponse) -> int:
    await read_small(resp)
    return resp.status


async def checked_status(resp: aiohttp.ClientResponse) -> int:
    check_final(resp.status)
    return await drained(resp)


async def small_body(resp: aiohttp.ClientResponse) -> tuple[int, bytes]:
    return resp.status, await read_small(resp)


def into_bytes(length: int, read_exact: Callable[[memoryview], None]) -> bytes:
    buf = bytearray(length)
    read_exact(memoryview(buf))
    return bytes(buf)


async def json_body(resp: aiohttp.ClientResponse) -> Any:
    check_final(resp.status)
    return json_answer(resp.status, await read_small(resp))


async def flag_body(n: int, resp: aiohttp.ClientResponse) -> list[bool]:
    """The answer to a compact batch of ``n`` addresses (see
    :func:`~eg_kv.client.rules.compact_answer`)."""
    check_final(resp.status)
    body = await read_small(resp)
    ctype = resp.headers.get("Content-Type")
    return compact_answer(resp.status, None if ctype is None else ctype.encode("latin-1"), body, n)


async def with_refusal(
    parse: Callable[[aiohttp.ClientResponse], Awaitable[T]], resp: aiohttp.ClientResponse
) -> tuple[T, bool]:
    """``parse``'s answer, and whether the server answered a leasing lookup's hits
    unleased (a lease cap: :data:`~eg_kv.wire.LEASE_REFUSED_HEADER`)."""
    return await parse(resp), LEASE_REFUSED_HEADER in resp.headers


async def sink_from_memory(body: bytes, sink: AsyncSink[T]) -> T:
    """Hand a block already in memory (a local read) to an async sink.

    Raises:
        Miss: the sink read past the block or left part of it unread.
    """
    src = memoryview(body)
    taken = 0

    async def read_exact(view: memoryview) -> None:
        nonlocal taken
        view = memoryview(view).cast("B")
        if taken + len(view) > len(src):
            raise Miss("the sink read past the block")
        view[:] = src[taken : taken + len(view)]
        taken += len(view)

    result = await sink(len(src), read_exact)
    if taken != len(src):
        raise Miss("sink left part of the body unread")
    return result


async def snapshot_body(resp: aiohttp.ClientResponse) -> Snapshot:
    """A snapshot answer, read a piece at a time (:class:`~eg_kv.client.events.SnapshotReader`)."""
    check_final(resp.status)
    if resp.status != 200:
        raise Miss(f"HTTP {resp.status}")
    reader, got = SnapshotReader(), 0
    async for piece in resp.content.iter_chunked(1 << 16):
        got += len(piece)
        if got > SNAPSHOT_ANSWER_MAX:
            raise Miss(f"answer of more than {SNAPSHOT_ANSWER_MAX} bytes")
        reader.feed(piece)
    return reader.result()
