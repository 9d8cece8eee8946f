"""The fast lane: a small PUT answered as soon as it is parsed, past aiohttp's request
machinery.

aiohttp turns every parsed request into a ``Request``, a task, a route lookup and a
finished response, and that machinery cost more than a 4 KiB PUT's own work: a worker
spent 69 µs of CPU on one, where a bare aiohttp handler that only drains the body spent
34 (scripts/bench_server.py, docs/design.md "Serving"). A connection that waits for its
next request hands each request it parses to :class:`FastLane` first
(:class:`eg_kv.server._compat.StampedHandler`); the lane answers it at once when it is
the plain case, and declines it, untouched, otherwise.

The plain case: ``PUT /kv/<address>`` over HTTP/1.1, kept alive, whose whole body (at
most :data:`~eg_kv.slab.store.SMALL_PUT`, a ``Content-Length``, no ``Expect``) arrived
with its head, from a tenant that may write, on a worker that is not draining, has no
disk tier and keeps no access log, to a client that reads its answers. Everything else,
and every request that comes after a declined one on its connection, takes aiohttp's way.

The lane runs the same rules as that way, from the same functions: the token
(:meth:`eg_kv.server.auth.Auth.authenticate`), the role (:func:`~eg_kv.server.auth.authorize`),
the address, the headers (:func:`eg_kv.server.uploads.put_fields`) and the store
(:meth:`eg_kv.slab.store.Slab.put`). Whatever would make that way answer before the store
(no token, a readonly tenant, a bad address or header) is declined, so its answer comes
from the one place that writes it. Past that point the lane answers itself: 201 or 200,
or the one-line error of what the store raised (:func:`error_answer`), with the headers
every answer carries (:mod:`eg_kv.server.replies`), counted in the metrics as that way
counts it.
"""

from __future__ import annotations

import logging
import time

from aiohttp import HttpVersion11, streams, web

from ..errors import EgKvError
from ..slab.store import SMALL_PUT
from ..wire import BLOCK_PREFIX
from ._compat import Message, StampedHandler
from .answers import error_answer, internal_reason, one_line
from .auth import authorize, roles_refused
from .keys import AUTH, DISK, DRAIN, METRICS, SETTINGS, SLAB
from .replies import TEXT, head_for
from .uploads import put_fields

log = logging.getLogger("eg_kv.server.lane")

_PREFIX_LEN = len(BLOCK_PREFIX)
_CREATED, _DEDUP = b"created\n", b"dedup\n"


class FastLane:
    """The lane of one worker's connections (see the module's docstring).

    Args:
        app: the worker's application, started (its slab attached).
    """

    __slots__ = ("_auth", "_checked", "_drain", "_metrics", "_slab")

    def __init__(self, app: web.Application) -> None:
        self._auth, self._slab, self._drain = app[AUTH], app[SLAB], app[DRAIN]
        self._metrics = app[METRICS]
        # The roles authorize() may refuse on the block route: others skip the call.
        self._checked = roles_refused("block", self._auth.tenants_mode)

    @classmethod
    def of(cls, app: web.Application) -> FastLane | None:
        """The lane for ``app``'s connections; None where it never applies: a disk tier
        (a new block may be the disk's, which takes a wait) or an access log (aiohttp
        writes it)."""
        if app.get(DISK) is not None or app[SETTINGS].access_log:
            return None
        return cls(app)

    def __call__(
        self, conn: StampedHandler, message: Message, payload: streams.StreamReader
    ) -> bool:
        """Answer ``message`` if it is the plain case; True if it was answered.

        False leaves it untouched (nothing read, counted or stored) for aiohttp's way.
        """
        if (
            message.method != "PUT"
            or not payload.is_eof()
            or message.should_close
            or message.version != HttpVersion11
            or message.chunked
            or message.upgrade
            or not message.path.startswith(BLOCK_PREFIX)
            or self._drain.draining
            or conn.writing_paused
        ):
            return False
        transport = conn.transport
        if transport is None or transport.is_closing():
            return False
        start = time.perf_counter()
        headers = message.headers
        slab = self._slab
        address = message.path[_PREFIX_LEN:]
        try:
            tenant = self._auth.authenticate(message)
            if isinstance(tenant, str):
                return False
            if tenant.role in self._checked:
                authorize("block", "PUT", tenant, self._auth.tenants_mode)
            slab.check_address(address, tenant.ns)
            if "Expect" in headers:
                return False
            length, checksum, engine = put_fields(headers, slab.max_block_size)
        except EgKvError:
            return False  # aiohttp's way answers it, from the one place that does
        if length is None or length > SMALL_PUT:
            return False
        # The request is the lane's from here: it is answered below, whatever happens.
        try:
            created = slab.put(address, payload.read_nowait(-1), tenant.ns, checksum, engine)
            status, body, extra = (201, _CREATED, b"") if created else (200, _DEDUP, b"")
        except EgKvError as e:
            status, body, extra = error_answer(e)
        except Exception as e:  # a bug: answer 500 with one line, keep the worker alive
            log.exception("internal error on PUT %s", message.path[:200])
            status, body, extra = 500, one_line(internal_reason(e)).encode(), b""
        transport.writelines(
            (head_for(HttpVersion11, True, status, TEXT, len(body), extra=extra), body)
        )
        conn.lane_answered()
        self._metrics.observe("block", "PUT", status, time.perf_counter() - start)
        return True
