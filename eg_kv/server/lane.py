"""The fast lane: small block requests answered as soon as they are parsed, past
aiohttp's request machinery.

aiohttp turns every parsed request into a ``Request``, a task, a route lookup and a
finished response, and that machinery cost more than a 4 KiB PUT's own work: a worker
spent 69 µs of CPU on one, where a bare aiohttp handler that only drains the body spent
34 (docs/design.md, "Serving"). A connection that waits for its next request hands
each request it parses to :class:`FastLane` first
(:class:`eg_kv.server._compat.StampedHandler`); the lane answers it at once when it is
the plain case, and declines it, untouched, otherwise.

The plain case is a request to ``/kv/<address>`` over HTTP/1.1 or 1.0, kept alive, without
``Expect``, whose whole body arrived with its head, on a worker that is not draining, has
no disk tier and keeps no access log, to a client that reads its answers, and:

- ``PUT`` of at most :data:`~eg_kv.slab.store.SMALL_PUT` with a ``Content-Length``;
- ``GET`` of a block of at most :data:`~eg_kv.server.blocks.READ_SLICE` (a longer one is
  streamed from the slab), without a lease to release;
- ``HEAD``.

Everything else, and every request after a declined one on its connection, takes
aiohttp's way.

The lane runs the same rules as that way, from the same functions: the token
(:meth:`eg_kv.server.auth.Auth.authenticate`), the role (:func:`~eg_kv.server.auth.authorize`),
the address, a PUT's headers (:func:`eg_kv.server.uploads.put_fields`), the store
(:meth:`eg_kv.slab.store.Slab.put`) and the read (:func:`eg_kv.server.blocks.read_small`).
Whatever would make that way answer before the slab is touched (no token, a role that
may not, a bad address or header) is declined, so its answer comes from the one place
that writes it. Past that point the lane answers itself, with the headers every answer
carries (:mod:`eg_kv.server.replies`) and the one-line error of what the slab raised
(:func:`eg_kv.server.answers.error_answer`), counted in the metrics as that way counts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from aiohttp import HttpVersion10, HttpVersion11, streams, web

from ..errors import EgKvError, NotFound
from ..slab.store import SMALL_PUT
from ..slab.view import Longer
from ..wire import BLOCK_PREFIX, BLOCK_TYPE, RELEASE_HEADER
from ._compat import Message, StampedHandler
from .answers import error_answer, internal_reason, one_line
from .auth import authorize, roles_refused
from .blocks import absent, read_small
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
        method = message.method
        if (
            method not in _METHODS
            or not payload.is_eof()
            or message.should_close
            or message.version not in _VERSIONS
            or message.upgrade
            or not message.path.startswith(BLOCK_PREFIX)
            or "Expect" in message.headers  # every route answers it alike, before the body
            or self._drain.draining
            or conn.writing_paused
        ):
            return False
        transport = conn.transport
        if transport is None or transport.is_closing():
            return False
        start = time.perf_counter()
        address = message.path[_PREFIX_LEN:]
        try:
            tenant = self._auth.authenticate(message)
            if isinstance(tenant, str):
                return False
            if tenant.role in self._checked:
                authorize("block", method, tenant, self._auth.tenants_mode)
            self._slab.check_address(address, tenant.ns)
            answer = _ANSWERS[method](self, message, payload, address, tenant.ns)
        except Exception:  # an EgKvError, or a bug: aiohttp's way answers it (a bug: a 500
            return False  # and its traceback), from the one place that does
        if answer is None:
            return False
        # The request is the lane's from here: it is answered below, whatever happens.
        try:
            status, content_type, length, checksum, body = answer()
            extra = b""
        except EgKvError as e:
            status, body, extra = error_answer(e)
            content_type, length, checksum = TEXT, len(body), None
        except Exception as e:  # a bug: answer 500 with one line, keep the worker alive
            log.exception("internal error on %s %s", method, message.path[:200])
            body, extra = one_line(internal_reason(e)).encode(), b""
            status, content_type, length, checksum = 500, TEXT, len(body), None
        head = head_for(message.version, True, status, content_type, length, checksum, extra)
        # A HEAD's answer says the length of the body a GET would get, and sends none.
        transport.writelines((head, body) if body and method != "HEAD" else (head,))
        conn.lane_answered()
        self._metrics.observe("block", method, status, time.perf_counter() - start)
        return True

    # Each route's part: from the request, None (declined, nothing done) or the answer to
    # make once the request is the lane's: (status, type, length, checksum, body).

    def _put(
        self, message: Message, payload: streams.StreamReader, address: str, ns: int
    ) -> Callable[[], _Answer] | None:
        headers = message.headers
        if message.chunked:
            return None
        length, checksum, engine = put_fields(headers, self._slab.max_block_size)
        if length is None or length > SMALL_PUT:
            return None

        def store() -> _Answer:
            body = payload.read_nowait(-1)
            created = self._slab.put(address, body, ns, checksum, engine)
            answer = _CREATED if created else _DEDUP
            return (201 if created else 200), TEXT, len(answer), None, answer

        return store

    def _get(
        self, message: Message, payload: streams.StreamReader, address: str, ns: int
    ) -> Callable[[], _Answer] | None:
        if RELEASE_HEADER in message.headers:
            return None
        try:
            found = read_small(self._slab, address, ns)
        except Longer:
            return None  # streamed from the slab, by aiohttp's way
        except NotFound as e:  # evicted while read: counted, so the lane answers it
            return partial(_fail, e)
        if found is None:  # a counted miss (no disk tier to ask)
            return partial(_fail, absent(address))
        checksum, data = found
        return lambda: (200, BLOCK_TYPE, len(data), checksum, data)

    def _head(
        self, message: Message, payload: streams.StreamReader, address: str, ns: int
    ) -> Callable[[], _Answer] | None:
        found = self._slab.describe(address, ns)
        if found is None:  # no disk tier to ask
            return partial(_fail, absent(address))
        length, checksum = found
        return lambda: (200, BLOCK_TYPE, length, checksum, b"")


def _fail(e: EgKvError) -> _Answer:
    raise e


#: An answer: (status, content type, Content-Length, checksum or None, body).
_Answer = tuple[int, str, int, "int | None", bytes]
_VERSIONS = frozenset({HttpVersion10, HttpVersion11})  # kept alive (HTTP/1.0: if it asked)
_ANSWERS = {"PUT": FastLane._put, "GET": FastLane._get, "HEAD": FastLane._head}
_METHODS = frozenset(_ANSWERS)
