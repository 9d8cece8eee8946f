"""The block routes that read or release: ``GET``, ``HEAD`` and ``DELETE /kv/<hash>``.

A GET up to :data:`READ_SLICE` (1 MiB) is one copy and one write; a larger one hands the
block's pages to the socket straight from the slab (:func:`_send_zero_copy`), so no body
larger than one slice ever sits whole in Python memory, and a block released during the
send can only ever reach the client as a short body (a miss). These handlers are the hot
path: they write their answers themselves (:mod:`eg_kv.server.replies`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from ..disk.tier import Loaded
from ..errors import NotFound
from ..slab.store import BlockGone, Slab
from ..slab.view import BlockReader
from ..wire import BLOCK_TYPE, RELEASE_HEADER
from . import replies, tiers
from .answers import closing, reply
from .keys import AUTH, DISK, SLAB
from .lookups import release_on_load
from .replies import written
from .tenants import Tenant

log = logging.getLogger("eg_kv.server.blocks")

#: Blocks up to this size go out in one copy and one write; larger ones are streamed.
#: Also the slice size of the copies a TLS connection is sent.
READ_SLICE = 1024 * 1024
#: Bytes of slab pages handed to the socket per ``writelines`` call of a large GET.
SEND_BATCH = 4 * 1024 * 1024
#: Bytes of a large GET that are copied, and sent only after the block's tag is checked.
ZERO_COPY_TAIL = 64 * 1024


async def get_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/<hash>``: the block's bytes; 404 if absent. With ``X-Eg-Kv-Release``, the
    load ends one of the caller's leases on it once answered (:mod:`eg_kv.server.lookups`)."""
    if RELEASE_HEADER not in request.headers:
        return await _get_block(request, tenant)
    try:
        return await _get_block(request, tenant)
    finally:
        release_on_load(request, tenant)


async def _get_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    address = request.match_info["hash"]
    try:
        slab, disk = request.app[SLAB], request.app.get(DISK) is not None
        found = slab.read_or_open(address, tenant.ns, miss=not disk)
        if found is None:
            loaded = await tiers.load(request, tenant, address)
            # A hit if the disk served it, else a miss (a promotion another GET made
            # meanwhile is counted by the read below).
            if loaded is not tiers.PROMOTED:
                slab.count_get(tenant.ns, hit=loaded is not None)
            if loaded is None:
                raise absent(address)
            if isinstance(loaded, Loaded):
                return reply(request, 200, loaded.data, BLOCK_TYPE, checksum=loaded.checksum)
            if isinstance(loaded, tiers.Promoting):
                return await _send_promoting(request, loaded)
            found = slab.read_or_open(address, tenant.ns)
            if found is None:
                raise NotFound(f"no block {address} (evicted as soon as it was promoted)")
        checksum, reader = found
        if isinstance(reader, bytes) or reader.length <= READ_SLICE:
            # One copy, one write (a one-page block's bytes are copied already).
            return reply(request, 200, one_copy(reader), BLOCK_TYPE, checksum=checksum)
        n = reader.length
    except BlockGone:
        raise gone(address) from None
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away before the response")
    head, keep = replies.head(request, 200, BLOCK_TYPE, n, closing(request), checksum)
    transport.write(head)
    replies.sent(request, len(head))
    try:
        if transport.get_extra_info("sslcontext") is None and not request.app[AUTH].tenants_mode:
            await _send_zero_copy(request.writer, transport, reader)
        else:
            # TLS buffers plaintext we cannot watch; with tenants, pages freed during a
            # zero-copy send and stored into by another namespace would reach this
            # client before the final check cut the body: send checked copies.
            for chunk in reader.slices(READ_SLICE):
                transport.write(chunk)
                await request.writer.drain()
    except BaseException as e:
        # The head is out: cut the connection, so the client sees a short body (a miss),
        # never a complete-looking response with wrong bytes, nor an error after a body.
        transport.abort()
        if not isinstance(e, BlockGone):
            raise
        log.info("block %s evicted while it was sent; aborting the response", address)
        return written(200, False, 0)
    reader.done()
    replies.sent(request, n)
    return written(200, keep, n)


def absent(address: str) -> NotFound:
    """The 404 of a block that is not there."""
    return NotFound(f"no block {address}")


def gone(address: str) -> NotFound:
    """The 404 of a block evicted or released while it was read."""
    return NotFound(f"no block {address} (evicted while read)")


def one_copy(reader: bytes | BlockReader) -> bytes:
    """A small block's bytes: a one-page block's come copied (and counted) already.

    Raises:
        BlockGone: it went while it was copied (a counted miss).
    """
    if isinstance(reader, bytes):
        return reader
    data = reader.read()
    reader.done()
    return data


def read_small(slab: Slab, address: str, ns: int, miss: bool = True) -> tuple[int, bytes] | None:
    """A GET's one-copy answer, for the fast lane (:mod:`eg_kv.server.lane`): the block's
    (checksum, bytes) when it is at most :data:`READ_SLICE`; None if absent (a counted
    miss; ``miss`` False: the caller's to count, the disk tier may hold it).

    Raises:
        Longer: a longer block (nothing read or counted): it is streamed, by
            :func:`get_block`.
        NotFound: the block was evicted or released while it was read.
    """
    try:
        found = slab.read_or_open(address, ns, READ_SLICE, miss=miss)
        return None if found is None else (found[0], one_copy(found[1]))
    except BlockGone:
        raise gone(address) from None


async def _send_promoting(request: web.Request, p: tiers.Promoting) -> web.StreamResponse:
    """Send a block read from disk from the slab pages it reserved, then publish it: the
    pages stay reserved until the kernel has taken every byte, so no eviction can reach
    them meanwhile (module :mod:`eg_kv.server.tiers`)."""
    try:
        if p.length <= READ_SLICE:  # one copy, then the block is the slab's
            return reply(request, 200, b"".join(p.views), BLOCK_TYPE, checksum=p.checksum)
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away before the response")
        head, keep = replies.head(request, 200, BLOCK_TYPE, p.length, closing(request),
                                  p.checksum)  # fmt: skip
        transport.write(head)
        replies.sent(request, len(head))
        tls = transport.get_extra_info("sslcontext") is not None
        try:
            batch: list[bytes | memoryview] = []
            batched = 0
            for view in p.views:
                batch.append(bytes(view) if tls else view)  # TLS buffers plaintext: copies
                batched += len(view)
                if batched >= SEND_BATCH:
                    _write_views(transport, batch)
                    batch, batched = [], 0
                    await request.writer.drain()
            if batch:
                _write_views(transport, batch)
            await _flushed(transport, request.writer)  # the pages are the kernel's no more
        except BaseException:
            transport.abort()  # a short body: the client sees a miss
            raise
        replies.sent(request, p.length)
        return written(200, keep, p.length)
    finally:
        await p.publish()


async def _send_zero_copy(
    writer: AbstractStreamWriter, transport: asyncio.Transport, reader: BlockReader
) -> None:
    """Send a block straight from slab memory, withholding its tail until that is safe.

    A transport keeps a reference to bytes the kernel has not taken yet, so slab memory
    reused meanwhile could go out as the new owner's bytes. The last ``ZERO_COPY_TAIL``
    bytes are therefore copied out first; once everything before them has been taken by
    the kernel, the block's tag is checked, and only then does the tail go. Had the block
    been released during the send, the check fails before the body is complete and the
    connection is cut: the client sees a short body (a miss), never a whole body with
    wrong bytes. The pages go out in ``writelines`` batches, one scatter-gather ``writev``
    each under uvloop, however scattered they lie (scripts/bench_server.py).

    Args:
        writer: aiohttp's writer of this request (its ``drain()`` waits out back-pressure).

    Raises:
        BlockGone: the block was evicted or released during the send.
        ConnectionResetError: the client went away.
    """
    head = reader.length - min(ZERO_COPY_TAIL, reader.length)
    sent, tail, batch, batched = 0, [], [], 0
    for view in reader.views(READ_SLICE):
        cut = max(0, min(len(view), head - sent))
        if cut:
            batch.append(view[:cut])
            batched += cut
        if cut < len(view):
            tail.append(view[cut:])
        sent += len(view)
        if batched >= SEND_BATCH:
            _write_views(transport, batch)
            batch, batched = [], 0
            await writer.drain()
    if batch:
        _write_views(transport, batch)
    tail_bytes = b"".join(tail)  # the copy, taken before the check that vouches for it
    await _flushed(transport, writer)
    reader.verify()
    transport.write(tail_bytes)


def _write_views(transport: asyncio.Transport, views: Sequence[bytes | memoryview]) -> None:
    """One ``writelines``; a closed uvloop transport raises RuntimeError, so check first.

    Raises:
        ConnectionResetError: the connection is closing.
    """
    if transport.is_closing():
        raise ConnectionResetError("the client went away during the send")
    transport.writelines(views)


async def _flushed(transport: asyncio.Transport, writer: AbstractStreamWriter) -> None:
    """Wait until the transport has handed every byte written so far to the kernel.

    Raises:
        ConnectionResetError: the connection closed first.
    """
    if transport.is_closing():
        raise ConnectionResetError("the client went away during the send")
    low, high = transport.get_write_buffer_limits()
    transport.set_write_buffer_limits(high=0, low=0)  # pause writing until the buffer is empty
    try:
        while transport.get_write_buffer_size() and not transport.is_closing():
            await writer.drain()
            if transport.get_write_buffer_size():
                await asyncio.sleep(0.001)  # not paused yet: poll, briefly
    finally:
        if not transport.is_closing():
            transport.set_write_buffer_limits(high=high, low=low)
    if transport.is_closing():
        raise ConnectionResetError("the client went away during the send")


async def head_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``HEAD /kv/<hash>``: 200 with the block's Content-Length and checksum, 404 if absent."""
    address = request.match_info["hash"]
    found = request.app[SLAB].describe(address, tenant.ns)
    if found is None:
        (on_disk,) = await tiers.find(request, tenant, [address])
        if on_disk is None:
            raise absent(address)
        found = (on_disk.length, on_disk.checksum)
    return reply(request, 200, b"", BLOCK_TYPE, length=found[0], checksum=found[1])


async def delete_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``DELETE /kv/<hash>``: release one reference; 204, or 404 if absent."""
    address = request.match_info["hash"]
    if not await tiers.delete(request, tenant, address):
        raise absent(address)
    return reply(request, 204)
