"""The HTTP application every worker runs: its routes, each wrapped once, over the slab.

Routes (reserved words under ``/kv/`` never name a block, see :data:`eg_kv.address.RESERVED`;
the paths are :mod:`eg_kv.wire`'s):

===========================  =============================================================
``GET /kv/<hash>``           200 the block's bytes, 404 if absent
``PUT /kv/<hash>``           201 stored, 200 dedup hit (refcount bumped)
``HEAD /kv/<hash>``          200 with the block's Content-Length, 404 if absent
``DELETE /kv/<hash>``        204 one reference released, 404 if absent
``GET /kv/<hash>/exists``    200 ``{"hash": ..., "exists": bool}``
``POST /kv/batch/exists``    200 ``{"exists": [...], "prefix_hits": n}`` for <= 1024 addresses
``POST /kv/batch/release``   200 ``{"released": [...]}``: one lease per address ended
``GET /kv/stats``            200 the slab's counters (the contract's eight first)
``GET /kv/events``           200 the log of stores and removals after ``since`` (long-poll)
``GET /kv/events/snapshot``  200 the blocks held and the log's seq they match
``GET /metrics``             Prometheus text, summed over every worker
``GET /healthz``             200 ``{"status": "ok", "workers_up": n, "workers": N}``, no auth
===========================  =============================================================

Every error is ``text/plain``, one line that says what was wrong. Every response carries
``X-EgKv-Worker: <pid>``. This module assembles the app (:func:`make_app`): the route
table, the wrapper that gives every handler auth, error mapping and metrics
(:func:`_endpoint`), the answers to paths that name no route, and the worker's
start-up, background tasks and clean-up. The handlers live beside it, one module per
kind: :mod:`~eg_kv.server.blocks` (GET/HEAD/DELETE), :mod:`~eg_kv.server.uploads` (PUT,
``Expect``), :mod:`~eg_kv.server.lookups` (existence), :mod:`~eg_kv.server.service`
(stats, health, metrics, local slab); who may ask is :mod:`~eg_kv.server.auth`'s, what
aiohttp cannot parse :mod:`~eg_kv.server.protocol`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from aiohttp import web

from ..config import Settings
from ..disk.tier import DiskTier
from ..errors import BadRequest, EgKvError, NotFound
from ..slab.store import Slab
from ..wire import (
    BATCH_EXISTS_PATH,
    BATCH_RELEASE_PATH,
    BLOCK_PREFIX,
    EVENTS_PATH,
    EVENTS_SNAPSHOT_PATH,
    EXISTS_SUFFIX,
    HEALTHZ_PATH,
    LOCAL_SLAB_PATH,
    METRICS_PATH,
    STATS_PATH,
)
from . import replies, runstate
from ._compat import replace_default_expect_handler
from .answers import error_response, internal_reason, label, unauthorized
from .auth import auth_from, authorize, roles_refused
from .blocks import delete_block, get_block, head_block
from .connections import Connections, Limits, resolve_max_connections
from .events import event_gates, get_events, get_snapshot
from .extras import ExtrasRelay, extras_endpoint
from .inflight import Drain, SpoolBudget
from .keys import (
    AUTH,
    CONNECTIONS,
    DISK,
    DRAIN,
    EVENT_READS,
    EVENT_WAITERS,
    EXTRAS,
    FLUSH_TASK,
    HEALTH,
    METRICS,
    SETTINGS,
    SLAB,
    SNAPSHOTS,
    SPOOL,
    SWEEP_TASK,
)
from .lookups import batch_exists, batch_release, block_exists
from .metrics import FLUSH_S, Metrics
from .service import health_from, healthz, local_slab, metrics, stats
from .tenants import ANONYMOUS, Tenant
from .uploads import expect_continue, put_block, put_expect

log = logging.getLogger("eg_kv.server.app")

#: A connection's body buffer before reading pauses (aiohttp's 64 KiB default paused and
#: resumed the socket every few reads of a large PUT).
READ_BUFSIZE = 1024 * 1024


#: A route's handler: it gets the request and the tenant the request authenticated as.
Handler = Callable[[web.Request, Tenant], Awaitable[web.StreamResponse]]


def _endpoint(
    app: web.Application, route: str, fn: Handler
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
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
    # The roles authorize() may refuse here: the others skip the check (a call per request).
    checked = roles_refused(route, auth.tenants_mode)
    # A body where the route reads none would sit in aiohttp's buffer (up to 2 MiB) for
    # as long as the handler runs (a large GET's send, a long poll): refused instead.
    bodiless = fn not in _READ_OR_REFUSE

    async def endpoint(request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        drain.inflight += 1
        resp: web.StreamResponse  # an annotation only: no code runs for it
        try:
            if request.protocol.writing_paused:  # earlier answers are still unsent
                await request.writer.drain()
            tenant = ANONYMOUS if open_route else auth.authenticate(request)
            if bodiless and request.body_exists:  # a flag read (no body: aiohttp's EMPTY_PAYLOAD)
                resp = await _refuse_body(request)
            elif isinstance(tenant, str):
                resp = unauthorized(tenant)
            else:
                if tenant.role in checked:
                    authorize(route, request.method, tenant, auth.tenants_mode)
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
            resp = error_response(500, internal_reason(e))
        if not resp.prepared:  # an aiohttp response: replies.Written carries its own
            label(resp)
            if drain.draining:
                resp.force_close()  # the worker is stopping: no next request on this connection
        drain.leave()
        metrics.observe(route, request.method, resp.status, time.perf_counter() - start)
        return resp

    endpoint.__name__, endpoint.__doc__ = fn.__name__, fn.__doc__
    return endpoint


async def _refuse_body(request: web.Request) -> web.Response:
    """400 to a request with a body on a route that reads none, then close the connection
    at once: no lingering read of the body (a send that never ends is the sweeper's)."""
    resp = error_response(400, f"{request.method} {request.path[:200]} takes no request "
                          "body; closing the connection")  # fmt: skip
    label(resp).force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


_BLOCK_METHODS = ("DELETE", "GET", "HEAD", "PUT")
#: The fixed routes under ``/kv/``, as the catch-all's ``rest`` sees them.
_BATCH_EXISTS_REST = BATCH_EXISTS_PATH.removeprefix(BLOCK_PREFIX)
_BATCH_RELEASE_REST = BATCH_RELEASE_PATH.removeprefix(BLOCK_PREFIX)
_STATS_REST = STATS_PATH.removeprefix(BLOCK_PREFIX)
_EVENTS_RESTS = tuple(p.removeprefix(BLOCK_PREFIX) for p in (EVENTS_PATH, EVENTS_SNAPSHOT_PATH))


async def bad_kv_path(request: web.Request, tenant: Tenant) -> web.Response:
    """Any other request under ``/kv/``: a wrong method (405) or an invalid address (400).

    Raises:
        web.HTTPMethodNotAllowed: the path names a route that exists, with another method.
        BadRequest: the address is empty or holds a ``/``.
    """
    rest = request.match_info["rest"]
    allowed: tuple[str, ...] = ()
    if rest in (_BATCH_EXISTS_REST, _BATCH_RELEASE_REST):
        allowed = ("POST",)
    elif rest == _STATS_REST or rest in _EVENTS_RESTS:
        allowed = ("GET",)
    elif rest and "/" not in rest:
        allowed = _BLOCK_METHODS
    elif rest.endswith(EXISTS_SUFFIX) and rest.count("/") == 1 and len(rest) > len(EXISTS_SUFFIX):
        allowed = ("GET",)
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise BadRequest(
        f"invalid address in {request.path[:80]!r}: an address is one path segment of "
        "1-256 characters of [A-Za-z0-9._:@+=-]"
    )


async def healthz_method(request: web.Request, tenant: Tenant) -> web.Response:
    """``/healthz`` with a method other than GET or HEAD: 405, with or without a token.

    Raises:
        web.HTTPMethodNotAllowed: always.
    """
    raise web.HTTPMethodNotAllowed(request.method, ("GET", "HEAD"))


async def no_route(request: web.Request, tenant: Tenant) -> web.Response:
    """Any path outside ``/kv/``: 405 on a known path with another method, else 404.

    Raises:
        web.HTTPMethodNotAllowed, NotFound.
    """
    if request.path == METRICS_PATH:
        raise web.HTTPMethodNotAllowed(request.method, ("GET",))
    raise NotFound(f"no route for {request.path[:200]}")


#: The handlers that read a request body, or answer at once without running on: every
#: other route refuses one (:func:`_endpoint`).
_READ_OR_REFUSE: frozenset[Handler] = frozenset(
    {put_block, batch_exists, batch_release, bad_kv_path, no_route, healthz_method}
)


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
    app[AUTH] = auth_from(settings, run_dir)
    metrics_path = runstate.metrics_dir(run_dir) if run_dir else None
    # With a KV-events publisher, its counters and its extras socket are in the run dir.
    events_dir = run_dir if run_dir and settings.kv_events_endpoint else None
    events_stats = runstate.kv_events_stats(events_dir) if events_dir else None
    app[METRICS] = Metrics(metrics_path, events_stats)
    app[DRAIN] = Drain()
    app[SPOOL] = SpoolBudget(settings.chunked_spool, shared=app[AUTH].tenants_mode)
    app[EVENT_READS], app[EVENT_WAITERS], app[SNAPSHOTS] = event_gates(app[AUTH].tenants_mode)
    app[HEALTH] = health or health_from(
        run_dir, settings.workers, runstate.health_window(settings.heartbeat_timeout_s)
    )
    connections = app[CONNECTIONS] = Connections(limits_from(settings))
    app[METRICS].watch_connections(lambda: (len(connections), connections.closed_by))
    app.cleanup_ctx.append(_slab_ctx)
    app.cleanup_ctx.append(partial(_extras_ctx, extras_endpoint(events_dir) if events_dir else ""))
    if settings.disk:
        app.cleanup_ctx.append(_disk_ctx)
    app.on_startup.append(_start_background)
    app.on_cleanup.append(_stop_background)

    r, E = app.router, partial(_endpoint, app)
    # Fixed paths win over /kv/{hash} (aiohttp tries the longest fixed prefix first), and
    # the reserved words never validate as addresses anyway.
    # /healthz never needs the token, whatever the method: a HEAD probe is answered as
    # a GET, any other method 405 (not a 401 that depends on whether a token is set).
    live = r.add_resource(HEALTHZ_PATH, name="healthz")
    live.add_route("GET", E("healthz", healthz))
    live.add_route("HEAD", E("healthz", healthz))
    live.add_route("*", E("healthz", healthz_method))
    r.add_get(METRICS_PATH, E("metrics", metrics), name="metrics", allow_head=False)
    r.add_get(STATS_PATH, E("stats", stats), name="stats", allow_head=False)
    r.add_post(BATCH_EXISTS_PATH, E("batch_exists", batch_exists), name="batch_exists")
    r.add_post(BATCH_RELEASE_PATH, E("batch_release", batch_release), name="batch_release")
    r.add_get(EVENTS_PATH, E("events", get_events), name="events", allow_head=False)
    r.add_get(EVENTS_SNAPSHOT_PATH, E("events", get_snapshot), name="events_snapshot",
              allow_head=False)  # fmt: skip
    # Two segments: never a block address (one holds no "/"), so "local" stays one.
    r.add_get(LOCAL_SLAB_PATH, E("local", local_slab), name="local", allow_head=False)
    # One resource for the block routes: one path match serves every method. It goes
    # before /kv/{hash}/exists, which it never matches (an address holds no "/"), so the
    # busiest route is the first one tried.
    block = r.add_resource(BLOCK_PREFIX + "{hash}", name="block")
    block.add_route("GET", E("block", get_block))
    block.add_route("HEAD", E("block", head_block))
    block.add_route("PUT", E("block", put_block), expect_handler=put_expect)
    block.add_route("DELETE", E("block", delete_block))
    exists_path = BLOCK_PREFIX + "{hash}" + EXISTS_SUFFIX
    r.add_get(exists_path, E("exists", block_exists), name="exists", allow_head=False)
    # Catch-alls: wrong methods and unknown paths get the same auth and one-line answers.
    r.add_route("*", BLOCK_PREFIX + "{rest:.*}", E("invalid", bad_kv_path), name="invalid")
    r.add_route("*", "/{tail:.*}", E("unmatched", no_route), name="unmatched")
    replace_default_expect_handler(r, expect_continue)  # every route answers Expect alike
    return app


def limits_from(settings: Settings) -> Limits:
    """The connection limits of one worker (the cap resolved against its fd limit)."""
    return Limits(
        header_timeout=settings.header_timeout_s,
        body_timeout=settings.body_timeout_s,
        keepalive_timeout=settings.keepalive_timeout_s,
        min_upload_rate=settings.min_upload_rate,
        max_connections=resolve_max_connections(settings.max_connections),
    )


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


async def _disk_ctx(app: web.Application) -> AsyncIterator[None]:
    """The disk tier's client (``--disk``): its keeper is another process, reached lazily."""
    tier = app[DISK] = DiskTier(os.path.abspath(app[SETTINGS].disk))
    try:
        yield
    finally:
        await tier.close()


async def _extras_ctx(endpoint: str, app: web.Application) -> AsyncIterator[None]:
    """The hand-off of PUTs' engine extras to the KV-events publisher at ``endpoint``
    ("": no publisher, they are dropped)."""
    relay = app[EXTRAS] = ExtrasRelay(endpoint, on_drop=app[METRICS].extras_dropped.inc)
    try:
        yield
    finally:
        relay.close()


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
