"""The async client's side of aiohttp: its transport (a session, the one resend a request
that changes nothing may get), request bodies, reading answers within their bounds, and the
middleware that keeps a PUT or DELETE from being sent twice. Used by
:class:`~eg_kv.client.aio.AsyncServerConnector`; no rule of the contract lives here (they
are in :mod:`eg_kv.client.rules`)."""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp.payload import Payload

from ..blockkey import Opening
from ..errors import RemoteError
from ..wire import ADDRESS_HEADER, CHECKSUM_HEADER, LEASE_REFUSED_HEADER
from .core import BLOCK_TYPE, ClientCore
from .events import SNAPSHOT_ANSWER_MAX, Snapshot, SnapshotReader
from .interface import AsyncSink
from .rules import (
    SMALL_ANSWER_MAX,
    DeadlineSpent,
    Miss,
    OutOfStep,
    block_to_read,
    check_echo,
    check_final,
    compact_answer,
    exists_answer,
    json_answer,
    may_resend,
    own_deadline,
    status_answer,
    wants_continue,
)
from .settings import KvCacheConfig

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


async def block_status(method: str, address: str, resp: aiohttp.ClientResponse) -> int:
    """The status of ``method`` on ``address`` (:func:`~eg_kv.client.rules.status_answer`)."""
    check_final(resp.status)
    return status_answer(method, address, await drained(resp), resp.headers.get(ADDRESS_HEADER))


async def exists_body(address: str, resp: aiohttp.ClientResponse) -> bool:
    """The answer to ``GET /kv/<addr>/exists`` (:func:`~eg_kv.client.rules.exists_answer`),
    checked while the answer is still this call's (an out-of-step one drops the connection)."""
    return exists_answer(address, await json_body(resp))


async def small_body(resp: aiohttp.ClientResponse) -> tuple[int, bytes]:
    return resp.status, await read_small(resp)


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


class Transport:
    """One server's aiohttp session (the caller's, or one opened on first use in the
    running loop) and the exchange of one request on it."""

    def __init__(
        self, config: KvCacheConfig, headers: dict[str, str], session: aiohttp.ClientSession | None
    ) -> None:
        """Args:
        config: the connector's settings (server, timeout, connections, TLS).
        headers: the fields every request carries (the token among them).
        session: a caller-owned session (left open by :meth:`close`), or None.
        """
        self.config, self.headers = config, headers
        self.session, self.owns_session = session, session is None
        self.closed = False
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        # Request targets carry the base URL's path prefix; this is what goes before them.
        self._origin = urllib.parse.urlsplit(config.base_url)._replace(path="").geturl()
        # A member found through DNS: connected at its address, TLS checks its name.
        self._tls_name = {"server_hostname": config.server_name} if (
            config.server_name and config.base_url.startswith("https")) else {}  # fmt: skip

    def _session(self) -> aiohttp.ClientSession:
        if self.closed:
            raise RemoteError("the connector is closed")
        if self.session is None:
            ssl_arg: Any = None if self.config.verify_tls else False
            connector = aiohttp.TCPConnector(limit=self.config.max_connections, ssl=ssl_arg)
            self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self.session

    async def close(self) -> None:
        """Close the session if this transport opened it. Idempotent."""
        self.closed = True
        if self.owns_session and self.session is not None:
            await self.session.close()
            self.session = None

    async def exchange(
        self,
        method: str,
        target: str,
        on_response: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        *,
        body: Parts | bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> T:
        """One request; ``on_response`` reads and checks the final answer. Raises on error.

        A request that changes nothing (:func:`~eg_kv.client.rules.may_resend`) is sent once
        more when a pooled connection turns out closed; a PUT or DELETE never is.
        ``timeout_s``: this exchange's deadline, when shorter than the config's.
        """
        session = self._session()
        resend = may_resend(method, target, headers)
        expect = isinstance(body, Parts) and wants_continue(method, body.size or 0)
        loop = asyncio.get_running_loop()
        end = loop.time() + (timeout_s or self.config.timeout_s)  # one deadline, both tries
        kw: dict[str, Any] = {
            "headers": {**self.headers, **headers} if headers else self.headers,
            "timeout": aiohttp.ClientTimeout(total=timeout_s) if timeout_s else self._timeout,
            "allow_redirects": False,
            "auto_decompress": False,
            "expect100": expect,
            **self._tls_name,
        }
        if not resend:
            kw["middlewares"] = (never_resend,)
        for attempt in (0, 1):
            try:
                async with session.request(method, self._origin + target, data=body, **kw) as resp:
                    try:
                        result = await on_response(resp)
                    except OutOfStep:
                        _drop(resp)
                        raise
                    except BaseException:
                        resp.close()  # an answer left unread or unusable: framing in doubt
                        raise
                    if isinstance(body, Parts) and not body.started:
                        # A final answer came before 100 Continue: the body was never sent
                        # and whether the server waits for it is unknown.
                        resp.close()
                    return result
            except TimeoutError as exc:  # asyncio's and aiohttp's timeouts included
                if own_deadline(timeout_s, self.config.timeout_s):
                    raise DeadlineSpent(str(exc) or "the call's deadline ran out") from exc
                raise
            except aiohttp.ServerDisconnectedError:
                left = end - loop.time()
                if attempt or not resend or left <= 0:
                    raise
                kw["timeout"] = aiohttp.ClientTimeout(total=left)  # what is left, no more
        raise RemoteError("unreachable")  # pragma: no cover


def _drop(resp: aiohttp.ClientResponse) -> None:
    """Close ``resp``'s connection, even where aiohttp already gave it back to its pool (it
    does as soon as a body is all in, before anyone read it): its next answer, sent out of
    step, must not be read as another request's."""
    resp.close()
    protocol = getattr(resp, "_protocol", None)  # aiohttp 3.14: kept after the release
    transport = getattr(protocol, "transport", None)
    if transport is not None:
        transport.close()


async def whole_block(core: ClientCore, address: str, resp: aiohttp.ClientResponse) -> bytes | None:
    """A block answer read whole, its checksum and block-key tag checked; None for an
    answer that is not a block to read (read to its end first).

    Raises:
        Miss: a body shorter than announced. ChecksumMismatch, ForgedBlock.
    """
    length = resp.content_length
    encoding = resp.headers.get("Content-Encoding")
    if not block_to_read(resp.status, length, encoding, core.config.max_block_size):
        await read_small(resp)
        return None
    check_echo(address, resp.headers.get(ADDRESS_HEADER))
    body = await resp.read()
    if len(body) != length:
        raise Miss(f"body of {len(body)} bytes, {length} announced")
    core.check_body(resp.headers.get(CHECKSUM_HEADER), body)
    return core.opened(address, body)


def _served(opening: Opening) -> Callable[[memoryview], Awaitable[None]]:
    """A small keyed block's ``read_exact`` for an async sink, once its tag is checked."""

    async def read_exact(view: memoryview) -> None:
        opening.serve(view)

    return read_exact


async def block_body(
    core: ClientCore, address: str, sink: AsyncSink[T], resp: aiohttp.ClientResponse
) -> T | None:
    """A block answer handed to ``await sink(length, read_exact)`` as it arrives, its
    checksum and block-key tag checked; None for an answer that is not a block to read.

    Raises:
        Miss: the sink read past the block or left part of it unread, or the body was cut
        short. ChecksumMismatch, ForgedBlock, and what ``sink`` raises.
    """
    length = resp.content_length
    limit = core.config.max_block_size
    if not block_to_read(resp.status, length, resp.headers.get("Content-Encoding"), limit):
        await read_small(resp)
        return None
    check_echo(address, resp.headers.get(ADDRESS_HEADER))
    left = length or 0
    verifier = core.verifier(resp.headers.get(CHECKSUM_HEADER))
    key = core.config.block_key
    opening = None if key is None else key.opening(address, left)
    mac: Callable[[Any], None] | None = None  # a large keyed block's bytes, as they arrive

    async def read_exact(view: memoryview) -> None:
        nonlocal left
        view = memoryview(view).cast("B")
        if len(view) > left:
            raise Miss("the sink read past the block")
        done = 0
        while done < len(view):
            chunk = await resp.content.read(len(view) - done)
            if not chunk:
                raise Miss(f"body cut short: {left - done} of {length} bytes missing")
            view[done : done + len(chunk)] = chunk
            if verifier is not None:
                verifier.add(chunk)  # hashed as it arrives, while in cache
            if mac is not None:
                mac(chunk)
            done += len(chunk)
        left -= done

    if opening is None:
        result = await sink(length or 0, read_exact)
    else:  # as BlockKey.keyed, awaited
        if opening.whole is not None:
            await read_exact(memoryview(opening.whole))
            opening.check()
            result = await sink(opening.data_length, _served(opening))
            opening.served_all()
        else:
            await read_exact(memoryview(opening.salt))
            opening.begin()

            async def read_data(view: memoryview) -> None:
                opening.advance(view)
                await read_exact(view)

            mac = opening.update
            result = await sink(opening.data_length, read_data)
            mac = None
            opening.served_all()
            await read_exact(memoryview(opening.tag))
            opening.check()
    if left:
        raise Miss("sink left part of the body unread")
    if verifier is not None:
        verifier.check()
    return result
