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
``Expect``, whose whole body arrived with its head, on a worker that is not draining and
keeps no access log, to a client that reads its answers, and:

- ``PUT`` of at most :data:`~eg_kv.slab.store.SMALL_PUT` with a ``Content-Length``;
- ``GET`` of a block of at most :data:`~eg_kv.server.blocks.READ_SLICE` (a longer one is
  streamed from the slab), without a lease to release;
- ``HEAD``.

With a disk tier, a request the slab alone cannot answer (a GET or HEAD it misses, a PUT
of a block it lacks) is the lane's only where the keeper's filter rules out a copy on
disk (:mod:`eg_kv.disk.keyfilter`): asking the keeper takes a wait. So is every taken
body's: with a disk tier, no body is taken.

A kept-alive ``PUT`` over ``SMALL_PUT`` whose body has not all arrived (or that asks
``Expect: 100-continue``) is taken too: its pages are reserved, its body read by the
socket straight into them (:mod:`eg_kv.server.intake`), and it is answered when the body
is in. Everything else, and every request after a declined one on its connection, takes
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
from typing import Any

from aiohttp import HttpVersion10, HttpVersion11, streams, web

from ..errors import BadRequest, EgKvError, NotFound
from ..slab.store import SMALL_PUT, PutHandle
from ..slab.view import Longer
from ..wire import BLOCK_PREFIX, BLOCK_TYPE, RELEASE_HEADER
from ._compat import Message, StampedHandler
from .answers import error_answer, internal_reason, one_line
from .auth import authorize, roles_refused
from .blocks import absent, read_small
from .intake import BodyIntake
from .keys import AUTH, DISK, DRAIN, EXTRAS, METRICS, SETTINGS, SLAB
from .replies import TEXT, head_for
from .uploads import put_fields

log = logging.getLogger("eg_kv.server.lane")

_PREFIX_LEN = len(BLOCK_PREFIX)
_CREATED, _DEDUP = b"created\n", b"dedup\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class FastLane:
    """The lane of one worker's connections (see the module's docstring).

    Args:
        app: the worker's application, started (its slab attached).
    """

    __slots__ = ("_auth", "_checked", "_drain", "_extras", "_metrics", "_share", "_slab", "_tier")

    def __init__(self, app: web.Application) -> None:
        self._auth, self._slab, self._drain = app[AUTH], app[SLAB], app[DRAIN]
        self._metrics, self._share = app[METRICS], app[SETTINGS].upload_share
        self._extras, self._tier = app[EXTRAS], app.get(DISK)
        # The roles authorize() may refuse on the block route: others skip the call.
        self._checked = roles_refused("block", self._auth.tenants_mode)

    @classmethod
    def of(cls, app: web.Application) -> FastLane | None:
        """The lane for ``app``'s connections; None where it never applies: an access log
        (aiohttp writes it)."""
        if app[SETTINGS].access_log:
            return None
        return cls(app)

    def __call__(
        self, conn: StampedHandler, message: Message, payload: streams.StreamReader,
        unfed: int = 0,
    ) -> bool:  # fmt: skip
        """Answer ``message`` if it is the plain case, or take its body (a large PUT's:
        :mod:`eg_kv.server.intake`); True if it did.

        False leaves it untouched (nothing read, counted or stored) for aiohttp's way.

        Args:
            unfed: bytes of the body that arrived but were not handed to the parser.
        """
        method = message.method
        if (
            method not in _METHODS
            or message.should_close
            or message.version not in _VERSIONS
            or message.upgrade
            or not message.path.startswith(BLOCK_PREFIX)
            or self._drain.draining
            or conn.writing_paused
        ):
            return False
        # A body still arriving, or asked for (every other route answers Expect alike,
        # before the body), is taken only for a large PUT.
        whole = payload.is_eof() and "Expect" not in message.headers
        if not whole and method != "PUT":
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
            if not whole:
                return self._take_body(conn, message, payload, unfed, address, tenant.ns, start)
            answer = _ANSWERS[method](self, message, payload, address, tenant.ns,
                                      tenant.namespace)  # fmt: skip
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
        self._send(conn, message.version, method, status, content_type, length, checksum,
                   body, extra, start, address=address)  # fmt: skip
        return True

    def _send(
        self, conn: StampedHandler, version: Any, method: str, status: int, content_type: str,
        length: int, checksum: int | None, body: bytes, extra: bytes, start: float,
        keep: bool = True, address: str = "",
    ) -> None:  # fmt: skip
        """Write an answer, count it, and keep the connection for the next request (or
        close it once the answer is out: ``keep`` False). ``address``: a block answer's
        (one with a ``checksum``), echoed."""
        head = head_for(version, keep, status, content_type, length, checksum, extra, address)
        transport = conn.transport
        if transport is not None:
            # A HEAD's answer says the length of the body a GET would get, and sends none.
            transport.writelines((head, body) if body and method != "HEAD" else (head,))
        if keep:
            conn.lane_answered()
        else:
            conn.force_close()
        self._metrics.observe("block", method, status, time.perf_counter() - start)

    def _take_body(
        self, conn: StampedHandler, message: Message, payload: streams.StreamReader,
        unfed: int, address: str, ns: int, start: float,
    ) -> bool:  # fmt: skip
        """A PUT whose body has not all arrived (or waits for ``100 Continue``): over
        :data:`~eg_kv.slab.store.SMALL_PUT`, its body goes straight into the pages it
        reserves (:mod:`eg_kv.server.intake`), and True; otherwise False, untouched.

        Raises (before anything is done, so aiohttp's way answers it): what
        :func:`~eg_kv.server.uploads.put_fields` and
        :meth:`~eg_kv.slab.store.Slab.begin_put` raise.
        """
        expect = message.headers.get("Expect")
        if message.chunked or conn.reading_held():  # (held: the parser kept bytes back)
            return False
        if self._tier is not None:  # its publish asks the keeper (tiers.commit_put): a wait
            return False
        transport = conn.transport
        if expect is not None and (
            expect.lower() != "100-continue" or message.version != HttpVersion11
            or payload.total_bytes or unfed  # a body sent before it was asked for
            # Answers still queued: the interim answer could pause writing, and a paused
            # connection is swept for its answers, not its body (aiohttp's way drains
            # first and reserves only then).
            or (transport is not None and transport.get_write_buffer_size())
        ):  # fmt: skip
            return False
        length, checksum, engine = put_fields(message.headers, self._slab.max_block_size)
        if length is None or length <= SMALL_PUT or length <= payload.total_bytes + unfed:
            return False  # a small body, or a whole one: answered once it is all in
        version = message.version
        if expect is not None and self._slab.add_ref(address, length, ns):
            # A dedup hit from the head (the address names the content): answered before
            # the body, and the connection closes, whether or not the client sends it.
            self._send(conn, version, "PUT", 200, TEXT, len(_DEDUP), None, _DEDUP, b"", start,
                       keep=False)  # fmt: skip
            return True
        engine = self._extras(ns, address, engine)  # token ids: to the publisher
        handle = self._slab.begin_put(address, length, self._share, ns, checksum, engine)
        # The request is the lane's from here: answered when its body is in.
        self._drain.enter()
        intake = BodyIntake(conn, handle, partial(self._put_ended, conn, handle, version, start))
        try:
            if expect is not None and transport is not None:
                transport.write(_CONTINUE)
            conn.take_body(intake)
            if payload.total_bytes:
                intake.feed(payload.read_nowait(-1))
        except Exception as e:  # a bug: answer 500 with one line, keep the worker alive
            log.exception("internal error taking the body of PUT %s", message.path[:200])
            if not intake.done:
                intake.done = True
                conn.give_body_back(read_on=False)
                self._drain.leave()
                handle.abort()
                body = one_line(internal_reason(e)).encode()
                self._send(conn, version, "PUT", 500, TEXT, len(body), None, body, b"", start,
                           keep=False)  # fmt: skip
            else:  # answered already: whatever failed after, the connection ends
                conn.force_close()
        return True

    def _put_ended(
        self, conn: StampedHandler, handle: PutHandle, version: Any, start: float,
        why: str | None, lost: bool,
    ) -> None:  # fmt: skip
        """A taken body is in (``why`` None), cut short (``why``), or its connection was
        lost: commit or abort the put, and answer."""
        self._drain.leave()
        if lost:
            handle.abort()
            self._metrics.observe("block", "PUT", "cancelled", time.perf_counter() - start)
            return
        extra = b""
        try:
            if why is not None:
                raise BadRequest(why)
            created = handle.commit()
            body, status = (_CREATED, 201) if created else (_DEDUP, 200)
        except EgKvError as e:
            status, body, extra = error_answer(e)
        except Exception as e:  # a bug: answer 500 with one line, keep the worker alive
            log.exception("internal error on PUT of %s", handle.address[:200])
            status, body = 500, one_line(internal_reason(e)).encode()
        finally:
            handle.abort()  # no-op after commit; frees the pages (or the dedup reference)
        keep = why is None and not self._drain.draining
        self._send(conn, version, "PUT", status, TEXT, len(body), None, body, extra, start, keep)

    # Each route's part: from the request, None (declined, nothing done) or the answer to
    # make once the request is the lane's: (status, type, length, checksum, body).

    def _put(
        self, message: Message, payload: streams.StreamReader, address: str, ns: int, name: str
    ) -> Callable[[], _Answer] | None:
        headers = message.headers
        if message.chunked:
            return None
        length, checksum, engine = put_fields(headers, self._slab.max_block_size)
        if length is None or length > SMALL_PUT:
            return None
        tier, new_ok = self._tier, None
        if tier is not None:
            if not self._slab.exists(address, ns) and not tier.absent(name, address):
                return None  # a new block the disk may hold: the PUT asks the keeper
            # (A dedup hit, or a block no copy of which was spilled: still so under the
            # lock, or the put is a 503 to retry.)
            new_ok = tier.recheck(name, address)

        def store() -> _Answer:
            body = payload.read_nowait(-1)
            named = self._extras(ns, address, engine)  # token ids: to the publisher
            created = self._slab.put(address, body, ns, checksum, named, new_ok)
            if not created and tier is not None:  # the disk's copy counts it too
                tier.count_refs(name, address, self._slab.refs(address, ns))
            answer = _CREATED if created else _DEDUP
            return (201 if created else 200), TEXT, len(answer), None, answer

        return store

    def _get(
        self, message: Message, payload: streams.StreamReader, address: str, ns: int, name: str
    ) -> Callable[[], _Answer] | None:
        if RELEASE_HEADER in message.headers:
            return None
        tier = self._tier
        try:
            found = read_small(self._slab, address, ns, miss=tier is None)
        except Longer:
            return None  # streamed from the slab, by aiohttp's way
        except NotFound as e:  # evicted while read: counted, so the lane answers it
            return partial(_fail, e)
        if found is None:
            if tier is not None:  # not counted yet: the disk may hold it
                if not tier.absent(name, address):
                    return None  # ask the keeper, by aiohttp's way
                self._slab.count_get(ns, hit=False)
            return partial(_fail, absent(address))
        checksum, data = found
        return lambda: (200, BLOCK_TYPE, len(data), checksum, data)

    def _head(
        self, message: Message, payload: streams.StreamReader, address: str, ns: int, name: str
    ) -> Callable[[], _Answer] | None:
        found = self._slab.describe(address, ns)
        if found is None:
            if self._tier is not None and not self._tier.absent(name, address):
                return None  # the disk may hold it: ask the keeper, by aiohttp's way
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
