"""The HTTP application every worker runs: the HTTP contract over the shared slab.

Routes (reserved words under ``/kv/`` never name a block, see :data:`eg_kv.address.RESERVED`):

===========================  =============================================================
``GET /kv/<hash>``           200 the block's bytes, 404 if absent
``PUT /kv/<hash>``           201 stored, 200 dedup hit (refcount bumped)
``HEAD /kv/<hash>``          200 with the block's Content-Length, 404 if absent
``DELETE /kv/<hash>``        204 one reference released, 404 if absent
``GET /kv/<hash>/exists``    200 ``{"hash": ..., "exists": bool}``
``POST /kv/batch/exists``    200 ``{"exists": [...], "prefix_hits": n}`` for <= 1024 addresses
``GET /kv/stats``            200 the slab's counters (the contract's eight first)
``GET /metrics``             Prometheus text, summed over every worker
``GET /healthz``             200 ``{"status": "ok", "workers_up": n, "workers": N}``, no auth
===========================  =============================================================

Every error is ``text/plain``, one line that says what was wrong. Every response carries
``X-EgKv-Worker: <pid>``. The block routes write their responses themselves
(:mod:`eg_kv.server.replies`); the rest use aiohttp's.

No body larger than one slice ever sits whole in Python memory: a PUT over
:data:`~eg_kv.slab.store.SMALL_PUT` (64 KiB) streams ``request.content`` into the pages it
reserved, a smaller one is gathered and stored in one critical section; a GET up to
:data:`READ_SLICE` (1 MiB) is one copy, a larger one hands the block's pages to the socket
straight from the slab (:func:`_send_zero_copy`). A PUT needs a ``Content-Length``, or a
chunked body, which is spooled into an anonymous memory file (``memfd``, capped at the
maximum block size, and all of a worker's at ``--chunked-spool``: :class:`SpoolBudget`)
because the slab must know a block's length before it reserves pages. Uploads in flight
reserve at most ``--upload-share`` of the slab (503 + ``Retry-After`` beyond it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import TypeVar

from aiohttp import HttpVersion11, http_exceptions, web

from .. import wire
from ..config import Settings
from ..errors import BadRequest, Busy, ConfigError, EgKvError, Forbidden, NotFound, TooLarge
from ..slab.local import LocalInfo
from ..slab.store import SMALL_PUT, BlockGone, Slab
from . import replies, runstate
from ._compat import (
    HandlerRunner,
    forget_interim,
    replace_default_expect_handler,
    response_started,
)
from .connections import (
    RETRY_AFTER_S,
    Connection,
    Connections,
    Limits,
    resolve_max_connections,
)
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import FLUSH_S, Metrics
from .replies import JSON, OCTETS, WORKER_HEADER, Written, reply, written
from .tenants import ANONYMOUS, ROLES, Tenant, TenantTable, single_token
from .tenants import load as load_tenants

log = logging.getLogger("eg_kv.server.app")
_V = TypeVar("_V")

#: Largest number of addresses one batch existence request may carry.
BATCH_MAX = 1024
#: Largest batch request body: 1024 addresses of 256 characters, quoted, with room to spare.
BATCH_MAX_BYTES = 512 * 1024
#: Blocks up to this size go out in one copy and one write; larger ones are streamed.
#: Also the slice size of the copies a TLS connection is sent.
READ_SLICE = 1024 * 1024
#: Bytes of slab pages handed to the socket per ``writelines`` call of a large GET.
SEND_BATCH = 4 * 1024 * 1024
#: A connection's body buffer before reading pauses (aiohttp's 64 KiB default paused and
#: resumed the socket every few reads of a large PUT).
READ_BUFSIZE = 1024 * 1024
#: Bytes of a large GET that are copied, and sent only after the block's tag is checked.
ZERO_COPY_TAIL = 64 * 1024
#: Slice size for copying a spooled chunked upload into the slab.
SPOOL_SLICE = 1024 * 1024
SETTINGS = web.AppKey("settings", Settings)
SLAB = web.AppKey("slab", Slab)
METRICS = web.AppKey("metrics", Metrics)
#: How /healthz counts workers: () -> (up, configured).
HealthProbe = Callable[[], tuple[int, int]]
HEALTH: web.AppKey[HealthProbe] = web.AppKey("health")
#: Spellings of a tenant's Authorization header a worker remembers (see Auth.authenticate).
SEEN_HEADERS_PER_TENANT = 4


class Auth:
    """Who may do what. ``table`` None: no token configured, anyone is an admin of the
    default namespace (as before tenants). Swapped whole on a reload (SIGHUP).

    Args:
        table: the tenants (namespace ids not yet bound to the slab).
        tokens_file: where the table came from; None for the single token or none.
    """

    def __init__(self, table: TenantTable | None, tokens_file: str | None = None) -> None:
        self.tokens_file = tokens_file
        #: Whether a tokens file is in use (per-namespace stats, admin-only metrics).
        self.tenants_mode = tokens_file is not None
        self.table = table

    @property
    def table(self) -> TenantTable | None:
        return self._table

    @table.setter
    def table(self, table: TenantTable | None) -> None:
        # A new table (bound to the slab, or reloaded) forgets every header it had seen,
        # so a token the reload removed is refused from the next request on.
        self._table = table
        self._seen: dict[str, Tenant] = {}
        self._seen_max = SEEN_HEADERS_PER_TENANT * (len(table.by_digest) if table else 0)

    def authenticate(self, request: web.BaseRequest) -> Tenant | str:
        """The request's tenant, or why there is none (never the token).

        A token is found by its sha256 digest: the lookup compares digests, so how long
        it takes tells nothing about any token. An ``Authorization`` header that has
        found its tenant once is remembered (at most :data:`SEEN_HEADERS_PER_TENANT`
        spellings per tenant) and found again without the digest: hashing the token was
        a tenth of a small GET's CPU in a busy worker. That dict holds only headers that
        authenticated; Python's string hash is keyed per process, so a lookup of any other
        header compares no bytes with a stored one and takes the digest path as before.
        """
        if self._table is None:
            return ANONYMOUS
        header = request.headers.get("Authorization")
        if header is not None and (known := self._seen.get(header)) is not None:
            return known
        found = _authenticate(header, self._table)
        if isinstance(found, Tenant) and header is not None:
            if len(self._seen) >= self._seen_max:
                self._seen.clear()  # a client cycling spellings costs itself the digest
            self._seen[header] = found
        return found

    def bind(self, slab: Slab, table: TenantTable) -> TenantTable:
        """``table`` with its namespaces' ids from the slab (quotas set there too).

        The handle's per-namespace address memos are sized for these namespaces and
        emptied (:meth:`eg_kv.slab.view.SlabView.share_key_cache`).
        """
        ids = slab.bind_namespaces(table.quotas)
        slab.share_key_cache(len(ids))
        return table.with_ids(ids)

    def reload(self, slab: Slab, path: str, capacity: int) -> bool:
        """Load the tokens file at ``path`` again; keep the old tenants if it is bad.

        Returns:
            Whether the new tenants are in force. Logs tenant counts and reasons, never
            a token (the file holds none).
        """
        try:
            table = self.bind(slab, load_tenants(path, capacity))
        except (ConfigError, EgKvError) as e:
            log.error("tokens file not reloaded, the old tenants stay: %s", e)
            return False
        self.table = table
        log.info("tokens file %s reloaded: %d tenants in %d namespaces", path,
                 len(table.by_digest), len(table.quotas))  # fmt: skip
        return True


AUTH = web.AppKey("auth", Auth)
CONNECTIONS = web.AppKey("connections", Connections)


class Drain:
    """Counts requests in flight so a worker can stop gracefully.

    aiohttp's own graceful shutdown marks every connection closing, and a closing
    connection ignores the bytes that still arrive, so an upload in flight could never
    finish. The worker instead closes its listener, sets :attr:`draining` (answers then
    say ``Connection: close``) and waits for :meth:`wait_idle` before aiohttp's shutdown.
    """

    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        self.draining = True
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


DRAIN = web.AppKey("drain", Drain)


class SpoolBudget:
    """Bytes of chunked bodies this worker holds spooled (``--chunked-spool`` bounds them).

    A chunked body's length is known only at its end, so it waits in a memory file
    outside the slab; without a bound, stalled chunked uploads pinned 720 MiB of them.
    """

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, n: int, own: int) -> None:
        """Count ``n`` more bytes of an upload that holds ``own`` bytes already.

        One upload alone may always grow to the maximum block size; beyond the limit
        while others hold spool, it is refused.

        Raises:
            Busy: the worker's spool is full.
        """
        if self.held + n > self.limit and self.held > own:
            raise Busy(
                f"chunked uploads on this worker hold {self.held} of {self.limit} spool bytes "
                "(--chunked-spool); retry shortly, or send a Content-Length"
            )
        self.held += n

    def give_back(self, n: int) -> None:
        self.held -= n


SPOOL = web.AppKey("spool", SpoolBudget)


def _line(text: str) -> str:
    """One line of text: an error body never spans lines."""
    return " ".join(str(text).split()) + "\n"


def error_response(status: int, reason: str, headers: dict[str, str] | None = None):
    """A ``text/plain`` one-line error response; a 503 always carries ``Retry-After``."""
    if status == 503 and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return web.Response(status=status, text=_line(reason), headers=headers)


def _unauthorized(message: str) -> web.Response:
    return error_response(401, message, {"WWW-Authenticate": 'Bearer realm="eg-kv"'})


def _authenticate(header: str | None, table: TenantTable) -> Tenant | str:
    """The tenant whose token ``header`` (an ``Authorization`` value) carries, or why
    there is none (never the token)."""
    if header is None:
        return "authorization required: send Authorization: Bearer <token>"
    scheme, _, cred = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return "authorization required: use the Bearer scheme"
    tenant = table.find(cred.strip().encode("utf-8", "surrogateescape"))
    if tenant is None:
        return "wrong bearer token"
    return tenant


def _allowed(route: str, method: str, tenant: Tenant, tenants_mode: bool) -> None:
    """Raise :class:`Forbidden` unless ``tenant``'s role allows ``method`` on ``route``."""
    if route == "block" and method in ("PUT", "DELETE") and not tenant.can_write:
        raise Forbidden(f"tenant {tenant.name} is readonly: {method} needs role readwrite")
    if route == "metrics" and tenants_mode and not tenant.is_admin:
        raise Forbidden(f"tenant {tenant.name} may not read /metrics: it needs role admin")
    if route == "local" and not tenant.is_admin:
        # A local reader maps the whole slab and no token check stands between it and any
        # namespace's blocks: only a tenant the server would let read everything.
        raise Forbidden(f"tenant {tenant.name} may not read the slab locally: it needs role admin")


def _roles_refused(route: str, tenants_mode: bool) -> frozenset[str]:
    """The roles :func:`_allowed` refuses some method on ``route`` (asked of it)."""
    refused = set()
    for role in ROLES:
        for method in ("GET", "HEAD", "PUT", "DELETE", "POST"):
            try:
                _allowed(route, method, Tenant("-", role), tenants_mode)
            except Forbidden:
                refused.add(role)
    return frozenset(refused)


# ---------------------------------------------------------------------------- middleware


def _endpoint(app: web.Application, route: str, fn: Callable) -> Callable:
    """Wrap a handler with auth, error mapping, the worker header and metrics.

    ``fn(request, tenant)`` gets the tenant the request authenticated as (an argument:
    ``request[key]`` is two calls to set and two to read).

    A wrapper per handler rather than an aiohttp middleware: a middleware makes aiohttp add
    a second layer of its own to every request, and together they cost a tenth of a small
    GET. The app's drain counter, metrics and token are bound here once, not looked up per
    request. Catch-all routes send every request that matches no route through a wrapped
    handler as well, so nothing bypasses the auth check or the one-line errors.

    Back-pressure: a request is handled only once the answers before it have left the
    transport's buffer (below its low-water mark), so a client that pipelines requests
    and never reads pins one answer, not all of them. The block routes write straight to
    the transport and aiohttp's writer drains only past 64 KiB; waiting here covers both.
    The check is a flag read; the wait is bounded by the send time limit
    (:mod:`eg_kv.server.connections`).
    """
    drain, metrics, auth = app[DRAIN], app[METRICS], app[AUTH]
    open_route = route == "healthz"  # liveness needs no auth
    # The roles _allowed may refuse here: the others skip the check (a call per request).
    checked = _roles_refused(route, auth.tenants_mode)

    async def endpoint(request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        drain.inflight += 1
        try:
            if request.protocol.writing_paused:  # earlier answers are still unsent
                await request.writer.drain()
            tenant = ANONYMOUS if open_route else auth.authenticate(request)
            if isinstance(tenant, str):
                resp = _unauthorized(tenant)
            else:
                if tenant.role in checked:
                    _allowed(route, request.method, tenant, auth.tenants_mode)
                resp = await fn(request, tenant)
        except EgKvError as e:
            resp = error_response(e.status, str(e))
        except web.HTTPMethodNotAllowed as e:
            allowed = ", ".join(sorted(e.allowed_methods))
            resp = error_response(
                405,
                f"method {e.method} is not allowed on {request.path[:200]}; allowed: {allowed}",
                {"Allow": allowed},
            )
        except (asyncio.CancelledError, ConnectionError):
            # The client left (aiohttp drops the connection quietly), or the drain timed out.
            drain.leave()
            metrics.observe(route, request.method, "cancelled", time.perf_counter() - start)
            raise
        except Exception as e:  # a bug: answer 500 with one line, keep the worker alive
            log.exception("internal error on %s %s", request.method, request.path[:200])
            resp = error_response(500, f"internal error ({type(e).__name__}); see the server log")
        if not resp.prepared:  # an aiohttp response: replies.Written carries its own
            _label(resp)
            if drain.draining:
                resp.force_close()  # the worker is stopping: no next request on this connection
        drain.leave()
        metrics.observe(route, request.method, resp.status, time.perf_counter() - start)
        return resp

    endpoint.__name__, endpoint.__doc__ = fn.__name__, fn.__doc__
    return endpoint


def _label(resp: web.StreamResponse) -> web.StreamResponse:
    """Give an aiohttp response the headers every eg-kv response carries."""
    resp.headers[WORKER_HEADER] = replies.worker_pid()
    resp.headers["Server"] = replies.SERVER
    return resp


def _closing(request: web.Request) -> bool:
    """Whether this worker is draining: answers then close their connections."""
    return request.app[DRAIN].draining


def _reply(request: web.Request, status: int, body: bytes = b"", *args, **kwargs) -> Written:
    """:func:`eg_kv.server.replies.reply`, closing the connection while this worker drains."""
    return reply(request, status, body, *args, close=_closing(request), **kwargs)


# ---------------------------------------------------------------------------- blocks


async def get_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/<hash>``: the block's bytes; 404 if absent."""
    address = request.match_info["hash"]
    try:
        reader = request.app[SLAB].read_or_open(address, tenant.ns)
        if reader is None:
            raise NotFound(f"no block {address}")
        if isinstance(reader, bytes):  # one page, copied: the fast path for small blocks
            return _reply(request, 200, reader, OCTETS)
        n = reader.length
        if n <= READ_SLICE:
            # One copy, one write, for blocks of a few pages too.
            return _reply(request, 200, reader.read(), OCTETS)
    except BlockGone:
        raise NotFound(f"no block {address} (evicted while read)") from None
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away before the response")
    head, keep = replies.head(request, 200, OCTETS, n, _closing(request))
    transport.write(head)
    replies.sent(request, len(head))
    try:
        if transport.get_extra_info("sslcontext") is None:
            await _send_zero_copy(request.writer, transport, reader)
        else:  # TLS buffers plaintext we cannot watch: send copies
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
    replies.sent(request, n)
    return written(200, keep, n)


async def _send_zero_copy(writer, transport, reader) -> None:
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


def _write_views(transport, views: list[memoryview]) -> None:
    """One ``writelines``; a closed uvloop transport raises RuntimeError, so check first.

    Raises:
        ConnectionResetError: the connection is closing.
    """
    if transport.is_closing():
        raise ConnectionResetError("the client went away during the send")
    transport.writelines(views)


async def _flushed(transport, writer) -> None:
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
    """``HEAD /kv/<hash>``: 200 with the block's Content-Length, 404 if absent."""
    address = request.match_info["hash"]
    n = request.app[SLAB].length(address, tenant.ns)
    if n is None:
        raise NotFound(f"no block {address}")
    return _reply(request, 200, b"", OCTETS, length=n)


def _announced_length(request: web.BaseRequest, max_block: int) -> int | None:
    """The PUT body's length from Content-Length; None for a chunked body.

    Raises:
        BadRequest: neither a valid Content-Length nor chunked transfer encoding.
        TooLarge: the announced length is over the maximum block size (nothing read).
    """
    raw = request.headers.get("Content-Length")
    if raw is None:
        if "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            return None
        raise BadRequest("PUT needs a Content-Length header (or a chunked body)")
    if not raw.isdigit():
        raise BadRequest(f"invalid Content-Length {raw[:40]!r}")
    n = int(raw)
    if n > max_block:
        raise TooLarge(f"body of {n} bytes is over the maximum block size of {max_block}")
    return n


async def put_expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: answer from the headers when they are enough.

    A bad or oversize upload is refused, and a dedup hit (the address resident with the
    announced length: the address names the content) is answered 200 with its reference
    taken, all before the body is sent. Every such final answer closes the connection:
    the client may send the body anyway, and those bytes must never be read as its next
    request. Otherwise the client gets ``100 Continue`` and :func:`put_block` runs.
    """
    app, start = request.app, time.perf_counter()
    try:
        tenant = app[AUTH].authenticate(request)
        if isinstance(tenant, str):
            return await _final_answer(request, _unauthorized(tenant), start)
        _allowed("block", "PUT", tenant, app[AUTH].tenants_mode)
        address = request.match_info["hash"]
        slab = app[SLAB]
        slab.check_address(address, tenant.ns)
        length = _announced_length(request, slab.max_block_size)
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await _final_answer(request, _expect_refused(), start)
        if length and slab.add_ref(address, length, tenant.ns):
            try:
                return await _final_answer(request, web.Response(status=200, text="dedup\n"), start)
            except BaseException:  # the 200 never went out (the client left): no reference
                slab.delete(address, tenant.ns)
                raise
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

    The request never reaches :func:`_endpoint`, so it is counted in the metrics here.
    """
    _label(resp).force_close()
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

    A streamed PUT whose address is resident with its length is a dedup hit from its
    headers: the reference is taken then, and the body is read and dropped chunk by
    chunk (so the connection stays usable); a body that breaks off gives it back. A small
    one is gathered and stored (or deduplicated) in one critical section.
    """
    address = request.match_info["hash"]
    slab, ns = request.app[SLAB], tenant.ns
    slab.check_address(address, ns)
    length = _announced_length(request, slab.max_block_size)
    if length == 0:  # refused before reading: there is nothing to store
        raise BadRequest("empty block (0 bytes): nothing to store")
    # A Busy (503: upload share or spool full) gets its Retry-After where errors become
    # answers (error_response).
    if length is None:
        created = await _put_chunked(request, slab, address, ns)
    elif length <= SMALL_PUT:
        # Gather a small body, then store it in one critical section (Slab.put): the
        # second lock round trip of a streamed put cost more than holding these bytes.
        created = slab.put(address, await _receive_small(request, length), ns)
    else:
        handle = slab.begin_put(address, length, request.app[SETTINGS].upload_share, ns)
        try:
            await _receive(request, handle.write)
            created = handle.commit()
        finally:
            handle.abort()  # no-op after commit; frees the pages (or the dedup reference)
    if created:
        return _reply(request, 201, b"created\n")
    return _reply(request, 200, b"dedup\n")


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
        raise BadRequest(f"body cut short or malformed: {_why(e)}") from None


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
        raise BadRequest(f"body cut short or malformed: {_why(e)}") from None


async def _put_chunked(request: web.Request, slab: Slab, address: str, ns: int) -> bool:
    """Spool a chunked body into a memfd, then copy it into the slab.

    The body may be at most the maximum block size (413 beyond), and the worker's chunked
    bodies together at most its ``--chunked-spool`` (503 beyond, see :class:`SpoolBudget`).
    """
    limit, budget = slab.max_block_size, request.app[SPOOL]
    fd = os.memfd_create("eg-kv-put", os.MFD_CLOEXEC)
    total = 0
    try:

        def spool(chunk: bytes) -> None:
            nonlocal total
            if total + len(chunk) > limit:
                raise TooLarge(f"chunked body is over the maximum block size of {limit} bytes")
            budget.take(len(chunk), total)
            total += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]

        await _receive(request, spool, chunked=True)
        handle = slab.begin_put(address, total, request.app[SETTINGS].upload_share, ns)
        try:
            pos = 0
            while pos < total:
                piece = os.pread(fd, min(SPOOL_SLICE, total - pos), pos)
                handle.write(piece)
                pos += len(piece)
            return handle.commit()
        finally:
            handle.abort()
    finally:
        budget.give_back(total)
        os.close(fd)


def _why(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text[:200]


async def delete_block(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``DELETE /kv/<hash>``: release one reference; 204, or 404 if absent."""
    address = request.match_info["hash"]
    if not request.app[SLAB].delete(address, tenant.ns):
        raise NotFound(f"no block {address}")
    return _reply(request, 204)


async def block_exists(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/<hash>/exists``: ``{"hash": ..., "exists": bool}``."""
    address = request.match_info["hash"]
    if address == "batch":  # /kv/batch/exists exists, for POST only
        raise web.HTTPMethodNotAllowed(request.method, ("POST",))
    found = request.app[SLAB].exists(address, tenant.ns)
    body = json.dumps({"hash": address, "exists": found})
    return _reply(request, 200, body.encode(), JSON)


async def batch_exists(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``POST /kv/batch/exists`` with ``{"addresses": [...]}`` (at most 1024).

    Answers ``{"exists": [bool, ...], "prefix_hits": n}``, ``n`` being the length of the
    leading run of hits (how much of a token prefix is cached). A body of type
    ``application/x-eg-kv-addresses`` gets the compact answer instead
    (:mod:`eg_kv.wire`).
    """
    raw = request.headers.get("Content-Length")
    if raw is None or not raw.isdigit():
        raise BadRequest("batch exists needs a body with a Content-Length")
    if int(raw) > BATCH_MAX_BYTES:
        raise TooLarge(f"batch body of {raw} bytes is over {BATCH_MAX_BYTES}")
    try:
        body = await request.read()
    except Exception as e:
        raise BadRequest(f"batch body cut short: {_why(e)}") from None
    content_type = request.headers.get("Content-Type")
    addresses = batch_addresses(content_type, body)
    found = request.app[SLAB].exists_many(addresses, tenant.ns)
    answer, answer_type = batch_answer_body(found, content_type)
    return _reply(request, 200, answer, answer_type)


def batch_addresses(content_type: str | None, body: bytes) -> list[str]:
    """The addresses a ``POST /kv/batch/exists`` body asks about (JSON or compact).

    Raises:
        BadRequest: a body that is neither; TooLarge: over 1024 addresses.
    """
    if wire.is_compact(content_type):
        addresses = wire.decode_addresses(body)
    else:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"batch body is not JSON: {_why(e)}") from None
        listed = doc.get("addresses") if isinstance(doc, dict) else None
        if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
            raise BadRequest('batch body must be {"addresses": ["<hash>", ...]}')
        addresses = listed
    if len(addresses) > BATCH_MAX:
        raise TooLarge(f"{len(addresses)} addresses in one batch; at most {BATCH_MAX}")
    return addresses


def batch_answer_body(found: list[bool], content_type: str | None) -> tuple[bytes, str]:
    """The answer body and its type for ``found``, in the request's format."""
    if wire.is_compact(content_type):
        return wire.encode_flags(found), wire.FLAGS_TYPE
    prefix = next((i for i, hit in enumerate(found) if not hit), len(found))
    return json.dumps({"exists": found, "prefix_hits": prefix}).encode(), JSON


_BLOCK_METHODS = ("DELETE", "GET", "HEAD", "PUT")


async def bad_kv_path(request: web.Request, tenant: Tenant) -> web.Response:
    """Any other request under ``/kv/``: a wrong method (405) or an invalid address (400).

    Raises:
        web.HTTPMethodNotAllowed: the path names a route that exists, with another method.
        BadRequest: the address is empty or holds a ``/``.
    """
    rest = request.match_info["rest"]
    allowed: tuple[str, ...] = ()
    if rest == "batch/exists":
        allowed = ("POST",)
    elif rest == "stats":
        allowed = ("GET",)
    elif rest and "/" not in rest:
        allowed = _BLOCK_METHODS
    elif rest.endswith("/exists") and rest.count("/") == 1 and len(rest) > 7:
        allowed = ("GET",)
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise BadRequest(
        f"invalid address in {request.path[:80]!r}: an address is one path segment of "
        "1-256 characters of [A-Za-z0-9._:@+=-]"
    )


async def no_route(request: web.Request, tenant: Tenant) -> web.Response:
    """Any path outside ``/kv/``: 405 on a known path with another method, else 404.

    Raises:
        web.HTTPMethodNotAllowed, NotFound.
    """
    if request.path in ("/healthz", "/metrics"):
        raise web.HTTPMethodNotAllowed(request.method, ("GET",))
    raise NotFound(f"no route for {request.path[:200]}")


# ---------------------------------------------------------------------------- service routes


async def local_slab(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /kv/local/slab``: where the slab is, for a client on this host that reads it
    itself (:mod:`eg_kv.slab.local`): names, id, layout and the token's namespace id.

    Only an admin (any token without a tokens file) may ask; the slab's mode (0600) decides
    who on the host can open it.
    """
    slab = request.app[SLAB]
    info = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, tenant.ns)
    return web.json_response(info)


async def stats(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /kv/stats``: the contract's eight fields first, then the rest.

    With a tokens file, a tenant gets its own namespace's counters; an admin gets the
    whole slab's plus ``namespaces``, one entry per namespace (by name).
    """
    slab = request.app[SLAB]
    if not request.app[AUTH].tenants_mode:
        return web.json_response(ordered_stats(slab.stats()))
    if not tenant.is_admin:
        (own,) = slab.namespace_stats(tenant.ns).values()
        return web.json_response(ordered_stats(own))
    out: dict[str, object] = dict(ordered_stats(slab.stats()))
    out["namespaces"] = {
        name or "default": ordered_stats(one) for name, one in slab.namespace_stats().items()
    }
    return web.json_response(out)


CONTRACT_FIELDS = (
    "unique_blocks", "total_refs", "resident_bytes", "logical_bytes",
    "dedup_savings_bytes", "dedup_hits", "get_hits", "get_misses",
)  # fmt: skip


def ordered_stats(raw: Mapping[str, _V]) -> dict[str, _V]:
    """The stats with the contract's eight fields first, then the rest as the slab gave them."""
    out = {k: raw[k] for k in CONTRACT_FIELDS}
    out.update((k, v) for k, v in raw.items() if k not in out)
    return out


async def healthz(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /healthz``: liveness, and how many workers the supervisor has up."""
    up, configured = request.app[HEALTH]()
    return web.json_response({"status": "ok", "workers_up": up, "workers": configured})


async def metrics(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /metrics``: Prometheus text over every worker plus the slab's counters.

    Each worker flushes its request counts to the shared files at least every
    :data:`eg_kv.server.metrics.FLUSH_S`; this one flushes its own first.
    """
    request.app[METRICS].flush()
    up, configured = request.app[HEALTH]()
    slab = request.app[SLAB]
    namespaces = slab.namespace_stats() if request.app[AUTH].tenants_mode else None
    body = request.app[METRICS].render(slab.stats(), up, configured, namespaces)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return resp


# ---------------------------------------------------------------------------- the app


def _health_from(
    run_dir: str | None, configured: int, window_s: float
) -> Callable[[], tuple[int, int]]:
    """How ``/healthz`` counts workers: the ready ones that beat within ``window_s``.

    A worker that is stopped or wedged still runs, and SO_REUSEPORT still hands it new
    connections, so a live pid is not enough: only a recent heartbeat says it answers.
    """
    if run_dir is None:
        return lambda: (1, 1)
    beats: list[runstate.Heartbeats] = []

    def health() -> tuple[int, int]:
        try:
            n, pids = runstate.read_state(run_dir)
            if not beats:
                beats.append(runstate.Heartbeats.open(run_dir))
        except (OSError, ValueError, KeyError):
            return 1, configured  # this worker answers, so at least one is up
        ages = beats[0].ages()
        return sum(1 for p in pids if ages.get(p, window_s) < window_s), n

    return health


def tokens_path(settings: Settings, run_dir: str | None) -> str | None:
    """The tokens file a worker reads: the supervisor's validated copy in the run
    directory if there is one, else the configured file (None without one)."""
    if not settings.tokens_file:
        return None
    if run_dir is not None:
        copy = runstate.tokens_copy(run_dir)
        if os.path.exists(copy):
            return copy
    return settings.tokens_file


def _auth_from(settings: Settings, run_dir: str | None) -> Auth:
    """The tenants at start-up: a tokens file, the single token, or nobody (anonymous).

    Raises:
        ConfigError: the tokens file is bad (the message names the line).
    """
    path = tokens_path(settings, run_dir)
    if path is not None:
        return Auth(load_tenants(path, settings.capacity), path)
    if settings.token:
        return Auth(single_token(settings.token))
    return Auth(None)


def make_app(
    settings: Settings,
    *,
    run_dir: str | None = None,
    health: Callable[[], tuple[int, int]] | None = None,
) -> web.Application:
    """Build the application for one worker process.

    Args:
        settings: the server's settings (slab name, token, limits).
        run_dir: the supervisor's run directory (worker list, shared metrics); None for a
            stand-alone app that reports one worker and keeps its metrics to itself.
        health: overrides how ``/healthz`` counts workers: returns (up, configured).

    Returns:
        The application; it attaches the slab on start-up and closes it on clean-up.
    """
    app = web.Application(handler_args={"auto_decompress": False, "read_bufsize": READ_BUFSIZE})
    app[SETTINGS] = settings
    app[AUTH] = _auth_from(settings, run_dir)
    metrics_path = runstate.metrics_dir(run_dir) if run_dir else None
    app[METRICS] = Metrics(metrics_path)
    app[DRAIN] = Drain()
    app[SPOOL] = SpoolBudget(settings.chunked_spool)
    app[HEALTH] = health or _health_from(
        run_dir, settings.workers, runstate.health_window(settings.heartbeat_timeout_s)
    )
    connections = app[CONNECTIONS] = Connections(limits_from(settings))
    app[METRICS].watch_connections(lambda: (len(connections), connections.closed_by))
    app.cleanup_ctx.append(_slab_ctx)
    app.on_startup.append(_start_background)
    app.on_cleanup.append(_stop_background)

    r, E = app.router, partial(_endpoint, app)
    # Fixed paths win over /kv/{hash} (aiohttp tries the longest fixed prefix first), and
    # the reserved words never validate as addresses anyway.
    r.add_get("/healthz", E("healthz", healthz), name="healthz", allow_head=False)
    r.add_get("/metrics", E("metrics", metrics), name="metrics", allow_head=False)
    r.add_get("/kv/stats", E("stats", stats), name="stats", allow_head=False)
    r.add_post("/kv/batch/exists", E("batch_exists", batch_exists), name="batch_exists")
    # Two segments: never a block address (one holds no "/"), so "local" stays one.
    r.add_get("/kv/local/slab", E("local", local_slab), name="local", allow_head=False)
    # One resource for the block routes: one path match serves every method. It goes
    # before /kv/{hash}/exists, which it never matches (an address holds no "/"), so the
    # busiest route is the first one tried.
    block = r.add_resource("/kv/{hash}", name="block")
    block.add_route("GET", E("block", get_block))
    block.add_route("HEAD", E("block", head_block))
    block.add_route("PUT", E("block", put_block), expect_handler=put_expect)
    block.add_route("DELETE", E("block", delete_block))
    r.add_get("/kv/{hash}/exists", E("exists", block_exists), name="exists", allow_head=False)
    # Catch-alls: wrong methods and unknown paths get the same auth and one-line answers.
    r.add_route("*", "/kv/{rest:.*}", E("invalid", bad_kv_path), name="invalid")
    r.add_route("*", "/{tail:.*}", E("unmatched", no_route), name="unmatched")
    replace_default_expect_handler(r, expect_continue)  # every route answers Expect alike
    return app


#: The one-line reason a request aiohttp cannot parse gets, by kind of parse error, most
#: specific first. Never the parser's own message: it quotes the request's bytes
#: (headers, the Authorization header included).
_PARSE_ERRORS = (
    (http_exceptions.LineTooLong, "a request line or header is too long (at most 8190 bytes)"),
    (http_exceptions.BadHttpMethod, "invalid method"),
    (http_exceptions.BadStatusLine, "invalid request line (method, path or HTTP version)"),
    (http_exceptions.InvalidURLError, "invalid URL"),
    (http_exceptions.InvalidHeader, "invalid header name or value"),
    (http_exceptions.ContentLengthError, "invalid Content-Length or body length"),
    (http_exceptions.TransferEncodingError, "invalid chunked transfer encoding"),
    (http_exceptions.ContentEncodingError, "invalid Content-Encoding"),
)


#: aiohttp's messages that are fixed text (they quote nothing of the request): passed on.
_FIXED_PARSE_MESSAGES = frozenset({
    "Missing 'Host' header in request.", "Too many headers received",
    "Data after `Connection: close`", "Bad line ending, expected CRLF",
    "Request has invalid `Transfer-Encoding`", "Too many trailers received",
})  # fmt: skip


def parse_error_reason(exc: BaseException | None) -> str:
    """A generic one-line reason for a parse error: its kind, none of the request's bytes."""
    for kind, reason in _PARSE_ERRORS:
        if isinstance(exc, kind):
            return reason
    message = getattr(exc, "message", None)
    if message in _FIXED_PARSE_MESSAGES:
        return message
    return "not valid HTTP (bytes out of place)"


class _OneLineErrorHandler(Connection):
    """aiohttp's connection handler, answering unparsable requests with one-line reasons.

    aiohttp's own answer to a request it cannot parse is a multi-line body that quotes the
    offending bytes (a caret under them), and a traceback in the log for each; a fuzzing
    or confused client would flood the log, and the quote can hold a secret header. Here
    it is a generic line per kind of error, and a debug line naming only the kind.
    """

    __slots__ = ()

    def handle_error(self, request, status=500, exc=None, message=None):
        if isinstance(exc, ConnectionError):  # the client left: nobody to answer
            log.debug("client went away: %s", type(exc).__name__)
            raise ConnectionResetError("the client went away")
        if status >= 500:
            self.log_exception("error handling request", exc_info=exc)
        else:
            log.debug("malformed request (%d): %s", status, type(exc).__name__)
        if response_started(request):  # the response had begun: only closing is left
            raise ConnectionError("response already started; cannot send the error")
        if status >= 500:
            reason = f"internal error ({type(exc).__name__ if exc else status}); see the log"
        else:
            reason = f"malformed request: {parse_error_reason(exc)}"
        resp = _label(error_response(status, reason))
        resp.force_close()
        return resp


class AppRunner(HandlerRunner):
    """``aiohttp.web.AppRunner`` whose connections are :class:`eg_kv.server.connections.Connection`.

    They answer unparsable requests in one line and are held to the app's connection
    limits (its :data:`CONNECTIONS`); aiohttp's own keep-alive timer stays as a backstop.
    tests/test_server_badinput.py checks the bodies.
    """

    handler_class = _OneLineErrorHandler

    def __init__(self, app: web.Application, **kwargs) -> None:
        kwargs.setdefault("keepalive_timeout", app[CONNECTIONS].limits.aiohttp_keepalive)
        super().__init__(app, **kwargs)

    def handler_kwargs(self) -> dict:
        return {"registry": self.app[CONNECTIONS]}


def limits_from(settings: Settings) -> Limits:
    """The connection limits of one worker (the cap resolved against its fd limit)."""
    return Limits(
        header_timeout=settings.header_timeout_s,
        body_timeout=settings.body_timeout_s,
        keepalive_timeout=settings.keepalive_timeout_s,
        min_upload_rate=settings.min_upload_rate,
        max_connections=resolve_max_connections(settings.max_connections),
    )


FLUSH_TASK = web.AppKey("metrics_flush", asyncio.Task)
SWEEP_TASK = web.AppKey("connection_sweep", asyncio.Task)


def _malloc_trim() -> Callable[[int], object] | None:
    """glibc's ``malloc_trim(0)``, or None where there is none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


async def _start_background(app: web.Application) -> None:
    trim = _malloc_trim()

    async def flush_forever() -> None:
        busy = False
        while True:
            await asyncio.sleep(FLUSH_S)
            metrics = app[METRICS]
            counted = metrics.pending()
            metrics.flush()
            # Bodies pass through in MiB-sized buffers that glibc keeps in its heap once
            # freed. After a quiet second following traffic, hand them back, so a worker's
            # private memory returns to its idle level.
            if counted:
                busy = True
            elif busy and trim is not None and app[DRAIN].inflight == 0:
                busy = False
                trim(0)

    loop = asyncio.get_running_loop()
    app[FLUSH_TASK] = loop.create_task(flush_forever())
    app[SWEEP_TASK] = loop.create_task(app[CONNECTIONS].run_sweeper())


async def _stop_background(app: web.Application) -> None:
    app[FLUSH_TASK].cancel()
    app[SWEEP_TASK].cancel()
    app[METRICS].flush()


async def _slab_ctx(app: web.Application) -> AsyncIterator[None]:
    """Attach the slab in this process when the app starts; close the handle at clean-up."""
    replies.set_worker_pid()
    slab = Slab.attach(app[SETTINGS].slab_name)
    app[SLAB] = slab
    auth = app[AUTH]
    if auth.table is not None and auth.tenants_mode:
        auth.table = auth.bind(slab, auth.table)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            slab.close()
