"""``PUT /kv/<hash>`` and ``Expect: 100-continue``: a block's body into the slab.

No body larger than one slice ever sits whole in Python memory: a PUT over
:data:`~eg_kv.slab.store.SMALL_PUT` (64 KiB) streams ``request.content`` into the pages it
reserved, a smaller one is gathered and stored in one critical section. A PUT needs a
``Content-Length``, or a chunked body, which is spooled into an anonymous memory file
(``memfd``, capped at the maximum block size, and all of a worker's at
``--chunked-spool``: :class:`eg_kv.server.inflight.SpoolBudget`) because the slab must
know a block's length before it reserves pages. Uploads in flight reserve at most
``--upload-share`` of the slab (503 + ``Retry-After`` beyond it).

An ``Expect: 100-continue`` PUT is answered from its headers when they are enough (a
refusal, a dedup hit) before its body is sent (:func:`put_expect`); every other route's
``Expect`` gets :func:`expect_continue`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping

from aiohttp import HttpVersion11, web

from ..checksum import decode as decode_checksum
from ..engine import EngineName, engine_from_headers
from ..errors import BadRequest, EgKvError, TooLarge
from ..slab.store import SMALL_PUT
from ..units import human_size
from ..wire import CHECKSUM_HEADER, whole_number
from . import tiers
from ._compat import forget_interim
from .answers import error_response, label, reply, unauthorized, why
from .auth import authorize
from .keys import AUTH, EXTRAS, METRICS, SETTINGS, SLAB, SPOOL
from .tenants import Tenant

#: A request's headers, or a parsed message's (case-insensitive in both).
Headers = Mapping[str, str]
#: Slice size for copying a spooled chunked upload into the slab.
SPOOL_SLICE = 1024 * 1024


def announced_length(headers: Headers, max_block: int) -> int | None:
    """The PUT body's length from Content-Length; None for a chunked body.

    Args:
        headers: the request's headers (a request's, or a parsed message's).

    Raises:
        BadRequest: neither a valid Content-Length nor chunked transfer encoding.
        TooLarge: the announced length is over the maximum block size (nothing read).
    """
    raw = headers.get("Content-Length")
    if raw is None:
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            return None
        raise BadRequest("PUT needs a Content-Length header (or a chunked body)")
    n = whole_number(raw)
    if n is None:
        raise BadRequest(f"invalid Content-Length {raw[:40]!r}")
    if n > max_block:
        raise TooLarge(
            f"body of {n:,} bytes is over the maximum block size of {human_size(max_block)} "
            f"({max_block:,} bytes; the server's --max-block-size)"
        )
    return n


def put_fields(headers: Headers, max_block: int) -> tuple[int | None, int | None, EngineName]:
    """What a PUT's headers say of its body: (its length, None if chunked; the checksum
    it carries, None if none; the engine's name for the block). Read the same way by
    :func:`put_block` and the fast lane (:mod:`eg_kv.server.lane`).

    Raises:
        BadRequest: no valid length, an empty body, a malformed checksum or engine
            header. TooLarge: over the maximum block size (nothing read).
    """
    length = announced_length(headers, max_block)
    if length == 0:  # refused before reading: there is nothing to store
        raise BadRequest("empty block (0 bytes): nothing to store")
    return length, decode_checksum(headers.get(CHECKSUM_HEADER)), engine_from_headers(headers.get)


async def put_expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: answer from the headers when they are enough.

    A bad or oversize upload is refused, and a dedup hit (the address resident with the
    announced length: the address names the content) is answered 200 with its reference
    taken, all before the body is sent. Every such final answer closes the connection:
    the client may send the body anyway, and those bytes must never be read as its next
    request. Otherwise the client gets ``100 Continue`` and :func:`put_block` runs. Its
    headers are checked as a PUT's without ``Expect`` (:func:`put_fields`): a malformed
    one is a 400, never a dedup that takes a reference.

    HTTP/1.0 has no interim answers and no expectations (as aiohttp's own handler):
    :func:`put_block` answers it after the body.
    """
    if request.version < HttpVersion11:
        return None
    app, start = request.app, time.perf_counter()
    try:
        tenant = app[AUTH].authenticate(request)
        if isinstance(tenant, str):
            return await _final_answer(request, unauthorized(tenant), start)
        authorize("block", "PUT", tenant, app[AUTH].tenants_mode)
        address = request.match_info["hash"]
        slab = app[SLAB]
        slab.check_address(address, tenant.ns)
        length = put_fields(request.headers, slab.max_block_size)[0]
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await _final_answer(request, _expect_refused(), start)
        if length and (block_id := slab.add_ref(address, length, tenant.ns, hit=False)):
            try:
                answer = await _final_answer(
                    request, web.Response(status=200, text="dedup\n"), start
                )
            except BaseException:  # the 200 never went out (the client left): no reference
                slab.take_back_ref(address, block_id, tenant.ns)
                raise
            slab.count_dedup_hit(tenant.ns)
            tiers.count_dedup(request, tenant, address)  # the disk's copy counts it too
            return answer
    except EgKvError as e:
        return await _final_answer(request, error_response(e.status, str(e)), start)
    await _continue(request)
    return None


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The ``Expect`` handler of every route but ``PUT /kv/<hash>`` (:func:`put_expect`).

    ``100-continue`` gets the interim answer; any other expectation a one-line 417 with
    eg-kv's headers that does not quote it (aiohttp's own echoed the value and kept the
    connection), and the connection closes.
    """
    if request.version < HttpVersion11:  # no interim answers in HTTP/1.0 (as aiohttp)
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        return await _final_answer(request, _expect_refused(), time.perf_counter())
    await _continue(request)
    return None


def _expect_refused() -> web.Response:
    return error_response(417, "only Expect: 100-continue is understood")


async def _continue(request: web.Request) -> None:
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    forget_interim(request)  # the interim response is not part of the final one


async def _final_answer(request: web.Request, resp: web.Response, start: float) -> web.Response:
    """Send ``resp`` as the final answer to an ``Expect: 100-continue`` request, then close
    the connection at once (no lingering read of a body the client may never send).

    The request never reaches :func:`eg_kv.server.app._endpoint`, so it is counted in the
    metrics here.
    """
    label(resp).force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()  # the transport sends what it holds, then closes
    endpoint = request.match_info.route.resource
    endpoint_name = (endpoint.name if endpoint is not None else None) or "unmatched"
    request.app[METRICS].observe(
        endpoint_name, request.method, resp.status, time.perf_counter() - start
    )
    return resp


async def put_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``PUT /kv/<hash>``: stream the body into the slab; 201 new block, 200 dedup hit.

    The body's checksum is computed as it arrives and kept with the block; one the PUT
    carries (``X-Eg-Kv-Checksum``) must match it (400, nothing stored, otherwise). The
    engine's name for the block (:mod:`eg_kv.engine`'s headers), if it carries one, is
    kept with it for the KV events.

    A streamed PUT whose address is resident with its length is a dedup hit from its
    headers: the reference is taken then, and the body is read and dropped chunk by
    chunk (so the connection stays usable); a body that breaks off gives it back. A small
    one is gathered and stored (or deduplicated) in one critical section.
    """
    address = request.match_info["hash"]
    slab, ns = request.app[SLAB], tenant.ns
    slab.check_address(address, ns)
    length, checksum, engine = put_fields(request.headers, slab.max_block_size)
    engine = request.app[EXTRAS](ns, address, engine)  # token ids: to the publisher
    # A Busy (503: upload share or spool full) gets its Retry-After where errors become
    # answers (error_response).
    if length is None:
        created = await _put_chunked(request, tenant, address, checksum, engine)
    elif length <= SMALL_PUT and (
        not tiers.may_hold(request, tenant, address) or slab.exists(address, ns)
    ):
        # Gather a small body, then store it in one critical section (Slab.put): the
        # second lock round trip of a streamed put cost more than holding these bytes.
        # (With a disk tier, only a dedup hit or a block its keeper's filter rules out:
        # another must ask the keeper between its bytes and its publish.)
        body = await _receive_small(request, length)
        new_ok = tiers.no_copy_check(request, tenant, address)
        created = slab.put(address, body, ns, checksum, engine, new_ok)
        if not created:
            tiers.count_dedup(request, tenant, address)  # the disk's copy counts it too
    else:
        share = request.app[SETTINGS].upload_share
        handle = slab.begin_put(address, length, share, ns, checksum, engine)
        try:
            if length <= SMALL_PUT:
                handle.write(await _receive_small(request, length))
            else:
                await _receive(request, handle.write)
            created = await tiers.commit_put(request, tenant, handle)
        finally:
            handle.abort()  # no-op after commit; frees the pages (or the dedup reference)
    return reply(request, 201, b"created\n") if created else reply(request, 200, b"dedup\n")


async def _receive(
    request: web.Request, sink: Callable[[bytes], object], *, chunked: bool = False
) -> None:
    """Hand the request body to ``sink`` piece by piece, as it arrives.

    Args:
        chunked: the body is chunked: what is buffered goes out joined (``readany``), so
            a body of many tiny HTTP chunks reaches the sink in a few large pieces.
            Otherwise ``readchunk`` hands over each buffered read as it came, without the
            join (which was 11% of a worker's time under 14 MiB PUTs); a Content-Length
            body has no chunk boundaries, so an empty piece is its end.

    Raises:
        BadRequest: the body broke off or was malformed.
        EgKvError: whatever ``sink`` raised.
    """
    content = request.content
    try:
        if chunked:
            while chunk := await content.readany():
                sink(chunk)
        else:
            while chunk := (await content.readchunk())[0]:
                sink(chunk)
    except EgKvError:
        raise
    except Exception as e:  # the client's body broke off or was malformed
        raise BadRequest(f"body cut short or malformed: {why(e)}") from None


async def _receive_small(request: web.Request, length: int) -> bytes:
    """The whole Content-Length body of ``length`` bytes, in one piece.

    One ``readexactly`` (usually all buffered already) rather than :func:`_receive`'s
    loop, whose second ``readchunk`` only found the end: 1 µs of a 4 KiB PUT's 40
    (``scripts/bench_cpu.py``).

    Raises:
        BadRequest: the body broke off or was malformed.
    """
    try:
        return await request.content.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise BadRequest(f"body cut short: {len(e.partial)} of {length} bytes arrived") from None
    except Exception as e:  # the client's body broke off or was malformed
        raise BadRequest(f"body cut short or malformed: {why(e)}") from None


async def _put_chunked(
    request: web.Request, tenant: Tenant, address: str, checksum: int | None,
    engine: EngineName,
) -> bool:  # fmt: skip
    """Spool a chunked body into a memfd, then copy it into the slab.

    The body may be at most the maximum block size (413 beyond), and the worker's chunked
    bodies together at most its ``--chunked-spool`` (503 beyond, see
    :class:`~eg_kv.server.inflight.SpoolBudget`).
    """
    slab, ns = request.app[SLAB], tenant.ns
    limit, budget = slab.max_block_size, request.app[SPOOL]
    fd = os.memfd_create("eg-kv-put", os.MFD_CLOEXEC)
    total = 0
    try:

        def spool(chunk: bytes) -> None:
            nonlocal total
            if total + len(chunk) > limit:
                raise TooLarge(
                    f"chunked body is over the maximum block size of {human_size(limit)} "
                    "(the server's --max-block-size)"
                )
            budget.take(len(chunk), total, ns)
            total += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]

        await _receive(request, spool, chunked=True)
        share = request.app[SETTINGS].upload_share
        handle = slab.begin_put(address, total, share, ns, checksum, engine)
        try:
            pos = 0
            while pos < total:
                piece = os.pread(fd, min(SPOOL_SLICE, total - pos), pos)
                handle.write(piece)
                pos += len(piece)
            return await tiers.commit_put(request, tenant, handle)
        finally:
            handle.abort()
    finally:
        budget.give_back(total, ns)
        os.close(fd)
