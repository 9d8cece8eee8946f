"""Every use eg-kv makes of aiohttp's and prometheus_client's private parts, in one module.

aiohttp offers no hook for what the server needs: its own connection handler class, a
response written past aiohttp's writer, the state a connection is in between requests.
prometheus_client offers no bulk update of a histogram. Each such touch is here, with a
comment on what it assumes. ``pyproject.toml`` declares the versions this was tested
with (:data:`AIOHTTP_TESTED`); ``tests/test_compat.py`` checks every assumption against
the installed versions, so an upgrade that breaks one fails there, loudly, rather than
in production.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Protocol, cast

from aiohttp import streams, web, web_protocol, web_server, web_urldispatcher
from aiohttp.http_parser import RawRequestMessage

#: The aiohttp versions the assumptions below were checked against (pyproject.toml).
AIOHTTP_TESTED = ">=3.14.5,<3.15"

#: aiohttp bounds the parsed requests it queues per connection (32; aiohttp PR #12830,
#: in 3.14.5): a client that pipelines without reading cannot queue more. eg-kv relies
#: on it instead of pausing reads itself; None (unbounded) on older versions.
PIPELINE_QUEUE_MAX: int | None = getattr(web_protocol, "MAX_MSG_QUEUE_SIZE", None)

#: The private attributes of a ``RequestHandler`` read here (checked by the tests).
HANDLER_PRIVATE = (
    "_loop", "_request_count", "_waiter", "_next_keepalive_close_time",
    "_keepalive_timeout", "_current_request", "_reading_paused", "_messages", "_parser",
    "_buffer_paused", "_msg_queue_resume_size", "_keepalive", "_keepalive_handle",
    "_process_keepalive", "_manager", "_force_close", "_close", "_max_msg_queue_size",
    "_pause_reading_for_buffer",
)  # fmt: skip


def _c_message_type() -> type:
    try:
        from aiohttp._http_parser import RawRequestMessage as CMessage  # type: ignore[import-not-found]
    except ImportError:  # no C parser (AIOHTTP_NO_EXTENSIONS, or a pure-Python build)
        return RawRequestMessage
    return CMessage


#: A parsed request as aiohttp's parser hands it over (method, path, version, headers...).
Message = RawRequestMessage
#: The most requests the lane answers from one read: aiohttp's queue of parsed requests
#: (32), about 1.5 ms of a worker's loop at 4 KiB PUTs.
LANE_BURST = PIPELINE_QUEUE_MAX or 32
#: The classes a parsed request comes as: the C parser's (when aiohttp has it) has the
#: same fields as the Python one; anything else on the queue is a parse error's report.
MESSAGE_TYPES: frozenset[type] = frozenset({RawRequestMessage, _c_message_type()})


class Lane(Protocol):
    """A connection's fast lane (:mod:`eg_kv.server.lane`)."""

    def __call__(
        self, conn: StampedHandler, message: Message, payload: streams.StreamReader,
        unfed: int = 0,
    ) -> bool:  # fmt: skip
        """Given a parsed request and its body's reader, answer it at once, or take its
        body (:meth:`StampedHandler.take_body`), and return True; or return False
        (untouched) and aiohttp's request machinery handles it. ``unfed``: bytes of the
        body that arrived but were not handed to the parser yet."""
        ...


class Intake(Protocol):
    """The protocol a connection's transport reads a request body into
    (:class:`eg_kv.server.intake.BodyIntake`): what :class:`StampedHandler` asks of it."""

    #: Whether the whole body arrived (or never will).
    done: bool

    @property
    def received(self) -> int:
        """Body bytes received so far."""
        ...

    def feed(self, data: Any) -> None:
        """Body bytes that arrived before the transport was handed over."""
        ...


#: A large PUT's head arrives with more of its body than this in one read: the head is
#: parsed alone, so the body can go straight to the slab (:meth:`StampedHandler.take_body`)
#: rather than through the parser's copies. Under the body reader's limit (aiohttp's
#: default 64 KiB; eg-kv's 1 MiB), so what reaches the parser never pauses it (a paused
#: parser keeps bytes back: :meth:`StampedHandler.reading_held` declines then).
SPLIT_READS_OVER = 64 * 1024
#: How far into a read the end of a PUT's head is looked for.
HEAD_SCAN = 16 * 1024
#: The most bytes a connection may send while no request completes (a head that never
#: ends): past it reading stops, and the sweeper answers 431 and closes. aiohttp's own
#: limits (128 lines of 8 KiB) let one head hold ~2 MiB of a worker's memory until the
#: header timeout, times every connection; eg-kv's longest legitimate head (an engine's
#: token ids, 1,024 of them) is about 12 KiB.
MAX_HEAD_BYTES = 64 * 1024
_PUT, _HEAD_END = b"PUT ", b"\r\n\r\n"
_LENGTH_HEADERS = (b"\r\nContent-Length:", b"\r\ncontent-length:")
#: The arguments of aiohttp's request parser that a connection handler takes, with its
#: defaults: a handler whose parser is replaced builds the new one alike.
_PARSER_ARGS = {
    name: inspect.signature(web_protocol.RequestHandler.__init__).parameters[name].default
    for name in ("read_bufsize", "max_line_size", "max_field_size", "max_headers",
                 "auto_decompress")
}  # fmt: skip


def peek_length(data: bytes, end: int) -> int:
    """A hint of a PUT's body length from its raw head (``data[:end]``): the
    Content-Length in its usual spelling, or -1. The parser stays the judge of the head;
    a wrong hint only sends the body the slower way."""
    for name in _LENGTH_HEADERS:
        i = data.find(name, 0, end)
        if i >= 0:
            i += len(name)
            j = data.find(b"\r\n", i, end + 2)
            try:
                return int(data[i:j])
            except ValueError:
                return -1
    return -1


# ---------------------------------------------------------------------------- responses


class SentResponse(web.StreamResponse):
    """A response already written to the transport: aiohttp has nothing left to send.

    aiohttp finishes every response with ``prepare`` and ``write_eof`` (no-ops here),
    reads ``keep_alive`` to decide whether the connection stays open, and ``body_length``
    for the access log; this sets the private fields behind them (``_keep_alive``,
    ``_body_length``) and ``_eof_sent``, which makes ``prepared`` true.

    Args:
        status: the status that went out.
        keep_alive: whether the connection stays open (False: aiohttp closes it).
        body_length: body bytes that went out.
    """

    def __init__(self, status: int, keep_alive: bool, body_length: int):
        super().__init__(status=status)
        self._keep_alive, self._body_length, self._eof_sent = keep_alive, body_length, True

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


def count_sent(request: web.BaseRequest, nbytes: int) -> None:
    """Count bytes written past aiohttp's writer in its ``output_size``.

    aiohttp takes ``output_size > 0`` to mean the response has begun: an error raised
    after that closes the connection instead of appending an error response to bytes
    already sent (see :func:`response_started`).
    """
    request.writer.output_size += nbytes


def forget_interim(request: web.BaseRequest) -> None:
    """Zero ``output_size`` after an interim response (``100 Continue``) went out.

    The final response has not begun (see :func:`response_started`).
    """
    request.writer.output_size = 0


def replace_default_expect_handler(router: web.UrlDispatcher, handler) -> None:
    """Give every route of ``router`` still on aiohttp's default ``Expect`` handler
    ``handler`` instead (aiohttp takes it only per route, at ``add_route``).
    """
    for route in router.routes():
        if route._expect_handler is web_urldispatcher._default_expect_handler:
            route._expect_handler = handler


def response_started(request: web.BaseRequest) -> bool:
    """Whether bytes of a response to ``request`` went out (``output_size``, above)."""
    return request.writer.output_size > 0


# ---------------------------------------------------------------------------- connections


_data_received = web_protocol.RequestHandler.data_received


class StampedHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, stamping what a sweeper needs to judge it.

    ``rx_at``: when bytes last arrived; ``head_at``: when the first bytes of a head
    arrived while the connection waited for a request, and ``head_of``: how many requests
    had been parsed then (a head is still arriving while that count has not moved; a
    count, not a time, since the loop's clock has millisecond steps); ``wpaused_at``: when
    writing last paused; ``held_at``: when the sweeper last saw the server itself holding
    reading (a handler not consuming its body); ``body_req``, ``body_at``, ``body_seen``:
    the request whose body :meth:`body_behind` times, since when, and its last look.
    Times are the event loop's.

    A stamp costs one clock read per read from the socket, not per request (its cost is
    in docs/design.md, "Serving"). Nothing is
    stamped in ``resume_reading``: aiohttp calls it (and ``data_received(b"")``) after
    every read of a body, and stamping there cost a 4 KiB PUT 5% more CPU.
    """

    __slots__ = (
        "body_at", "body_pending", "body_req", "body_seen", "head_at", "head_bytes", "head_of",
        "head_over", "held_at", "in_lane", "intake", "lane", "rx_at", "wpaused_at",
        "wpaused_size",
    )  # fmt: skip

    def __init__(self, manager: web_server.Server, *, lane: Lane | None = None, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.lane, self.in_lane = lane, False
        #: The body being read past the parser (:meth:`take_body`), if any.
        self.intake: Intake | None = None
        self.rx_at = self.head_at = self.wpaused_at = self.held_at = -math.inf
        self.head_of = -1
        self.wpaused_size = 0
        self.body_req: object = None  # a request, or an intake (take_body)
        self.body_at = self.body_seen = -math.inf
        #: Bytes read since a request last completed, and whether that passed
        #: :data:`MAX_HEAD_BYTES` (reading stopped; the sweeper answers 431).
        self.head_bytes, self.head_over = 0, False
        #: Whether the request parsed last has body still to come: the bytes read are
        #: its then; after, the next request's head.
        self.body_pending = False

    def data_received(self, data: bytes) -> None:
        if not data:  # aiohttp re-parsing what it buffered, on resume_reading
            parsed = self._request_count
            self._parse(data)
            if self._request_count != parsed:
                self._note_newest_body()
            return
        now = self._loop.time()
        self.rx_at = now
        parsed = self._request_count  # requests parsed on this connection so far
        # Bytes after a request whose body is all in are the next request's head, however
        # busy the connection is (waiting, handling, lingering): a head queued behind a
        # long poll was neither timed nor counted (1.8 MiB of header lines a connection).
        # The empty lines a client may send between requests start no head's clock.
        head = self.intake is None and not self.body_pending
        if head and self.head_of != parsed and data.strip(b"\r\n"):
            self.head_of, self.head_at = parsed, now  # the first bytes of a head
        self._parse(data)
        messages, waiter = self._messages, self._waiter
        if (
            messages and waiter is None and not self._buffer_paused
            and not messages[-1][1].is_eof()
        ):  # fmt: skip
            # A request whose body is still coming, queued behind one being handled:
            # nothing reads that body until start() takes the request, and aiohttp would
            # buffer 2 MiB of it (per connection) meanwhile. Reading stops, as for its
            # own full queue, and start() resumes it when it takes the request.
            self._pause_reading_for_buffer()
        count = self._request_count  # aiohttp counts a request as it parses its head
        if count != parsed:
            self._note_newest_body()
        if count != parsed or not head:
            # A request completed in this read, or these were a body (its handler's to
            # bound): no head is piling up.
            self.head_bytes = 0
        else:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES and not self.head_over:
                self.head_over = True
                if self.transport is not None:
                    self.transport.pause_reading()

    def _note_newest_body(self) -> None:
        """Note whether the newest request parsed has body still to come (the next bytes
        are its), until its end arrives (a callback: no reference to the body is kept, whose
        unread bytes a kept one held for the keep-alive's 75 s)."""
        messages = self._messages
        payload = messages[-1][1] if messages else None  # none queued: the lane's, all in
        self.body_pending = payload is not None and not payload.is_eof()
        if payload is not None and self.body_pending:
            payload.on_eof(self._body_in)

    def _body_in(self) -> None:
        self.body_pending = False

    def _parse(self, data: bytes) -> None:
        """Hand ``data`` to aiohttp's parser, or to the lane."""
        # The lane looks only while start() waits for the next request (or has not run:
        # no request was parsed yet); otherwise one is queued or handled: aiohttp's turn.
        waiter, lane = self._waiter, self.lane
        if (
            lane is None or self.in_lane or self._messages
            or (waiter.done() if waiter is not None else self._request_count)
        ):  # fmt: skip
            _data_received(self, data)
            return
        if len(data) > SPLIT_READS_OVER and data.startswith(_PUT):
            end = data.find(_HEAD_END, 0, HEAD_SCAN)
            if end > 0 and peek_length(data, end) > len(data) - end - 4:
                self._lane_split(data, end + 4, waiter, lane)
                return
        self._lane(data, waiter, lane)

    def _lane_split(self, data: bytes, end: int, waiter: Any, lane: Lane) -> None:
        """A large PUT's head, and part of its body, in one read (``data[:end]`` the head):
        the lane sees the head alone, and may take the body (:meth:`take_body`);
        otherwise the rest goes to the parser, and on as :meth:`_lane` goes."""
        self._waiter, self.in_lane = None, True
        try:
            _data_received(self, data[:end])
            messages = self._messages
            parsed = len(messages) == 1 and type(messages[0][0]) in MESSAGE_TYPES
            if parsed:
                message, payload = messages[0]
                if lane(self, cast(Message, message), payload, len(data) - end):
                    messages.popleft()  # its body taken (or the connection closing)
                    if self.intake is not None:
                        self.intake.feed(memoryview(data)[end:])
                    return
        finally:
            self._waiter, self.in_lane = waiter, False
        if parsed or not self._messages:
            self._lane(data[end:], waiter, lane)  # declined: it stays first in the queue
        elif waiter is not None and not waiter.done():
            waiter.set_result(None)  # a head that did not parse: answered, then closed

    def _lane(self, data: bytes, waiter: Any, lane: Lane) -> None:
        """Parse ``data`` while ``start()`` waits for the next request (``waiter``; None:
        it has not run yet), and let the lane answer what it can, in order; wake
        ``start()`` only for what is left.

        aiohttp's ``data_received`` wakes ``start()`` through ``_waiter`` as soon as it
        parsed a request: it is held back (None) while the parser runs, and set again
        after. A request the lane declines stops it: that one and every one behind it
        go to ``start()``, so answers leave in the order their requests came; so do the
        requests after the first :data:`LANE_BURST` of one read (a client that pipelines
        thousands of small PUTs in one write holds the event loop for one burst, and
        ``start()`` answers the rest a request per loop turn). Taking a
        request off the queue frees its parser slot, and reading paused on a full queue
        resumes as ``start()`` would (its re-parse of what was buffered comes back here,
        plain, while ``in_lane`` is set, and the loop answers what it queued).
        """
        self._waiter, self.in_lane = None, True
        try:
            _data_received(self, data)
            messages, answered = self._messages, 0
            while messages and not (self._force_close or self._close):
                message, payload = messages[0]
                if (
                    answered == LANE_BURST
                    or type(message) not in MESSAGE_TYPES
                    or not lane(self, cast(Message, message), payload)
                ):
                    break
                answered += 1
                messages.popleft()
                if self.intake is not None:  # its body is read past the parser: nothing follows
                    break
                if self._parser is not None:  # None only once the connection is lost
                    self._parser.message_consumed()
                if self._buffer_paused and len(messages) <= self._msg_queue_resume_size:
                    self._resume_reading_if_drained()
        finally:
            self._waiter, self.in_lane = waiter, False
        if self._messages and waiter is not None and not waiter.done():
            waiter.set_result(None)  # (one that has not run finds them when it does)

    def take_body(self, intake: Intake) -> None:
        """Read the rest of the request body being parsed into ``intake`` (a
        ``BufferedProtocol``: the socket reads straight into its buffers), until
        :meth:`give_body_back`.

        The parser, midway through that body, is replaced by a fresh one for the requests
        after it (aiohttp's parser cannot skip a body). aiohttp's keep-alive timer is
        off meanwhile: the connection is busy, and the sweeper times the body
        (:meth:`body_stalled_since`). The transport takes the new protocol between two
        reads: stopping and restarting reading makes uvloop pick its buffered reads.
        """
        transport, manager = self.transport, self._manager
        assert transport is not None and self._parser is not None and manager is not None
        # The server's handler arguments, as this handler was built with (once per large
        # PUT, not per connection).
        args = {k: manager._kwargs.get(k, v) for k, v in _PARSER_ARGS.items()}
        self._parser = type(self._parser)(
            self,
            self._loop,
            args.pop("read_bufsize"),
            **args,
            payload_exception=web_protocol.RequestPayloadError,
            max_msg_queue_size=self._max_msg_queue_size,
        )
        self.intake, self._keepalive = intake, False
        self.body_req = None
        _switch_protocol(transport, intake)

    def stamp_rx(self) -> None:
        """Bytes arrived now (for a body read past :meth:`data_received`: take_body)."""
        self.rx_at = self._loop.time()

    def give_body_back(self, read_on: bool = True) -> None:
        """The body :meth:`take_body` handed over is in, or never will be: this handler
        is the transport's protocol again, and reads on if ``read_on`` (else the
        connection is ending)."""
        self.intake = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if read_on:
            _switch_protocol(transport, self)
        else:
            transport.set_protocol(self)

    def lane_answered(self) -> None:
        """What ``start()`` does after a kept-alive answer, for one the lane wrote: count
        the request, and restart the keep-alive clock from now."""
        if self._manager is not None:  # None only once the connection is lost
            self._manager.requests_count += 1
        self._keepalive = True
        close_time = self._loop.time() + self._keepalive_timeout
        self._next_keepalive_close_time = close_time
        if self._keepalive_handle is None:
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)

    def pause_writing(self) -> None:
        # The sweeper restarts this clock whenever the write buffer shrank since its last
        # look (``wpaused_size``): a slow reader that drains is making progress.
        self.wpaused_at = self._loop.time()
        transport = self.transport
        self.wpaused_size = transport.get_write_buffer_size() if transport else 0
        super().pause_writing()

    def waiting(self) -> bool:
        """Whether the connection waits for its next request (or has not begun).

        aiohttp's ``start()`` loop awaits ``_waiter`` between requests only; it is None
        while a request is queued, handled, or its unread body drained (lingering).
        """
        return self.intake is None and (self._waiter is not None or not self._request_count)

    def reading_held(self) -> bool:
        """Whether aiohttp holds reading: a full buffer or message queue (the parser may
        keep bytes back then)."""
        return self._reading_paused or self._buffer_paused

    def head_arriving(self) -> bool:
        """Whether a head has begun and not been parsed yet (while the connection waits,
        or behind requests it still handles)."""
        return self.head_of == self._request_count

    def idle_since(self) -> float:
        """When the connection was opened or last finished an answer.

        aiohttp sets ``_next_keepalive_close_time`` to that moment plus
        ``_keepalive_timeout`` at ``connection_made`` and after every kept-alive answer.
        """
        return self._next_keepalive_close_time - self._keepalive_timeout

    def body_stalled_since(self, now: float) -> float | None:
        """Since when the body of the request being handled is waited for; None if not.

        None when no handler runs (``_current_request``) or the whole body arrived. While
        the server itself holds reading (``_reading_paused``: a handler not consuming its
        body) the client is not to blame: that is noted as of ``now``, and the wait counts
        from the later of the last byte and the last time the hold was seen (so at most
        one sweep early after a hold ends).
        """
        if self.intake is not None:  # read past aiohttp (take_body): never held
            return None if self.intake.done else self.rx_at
        req = self._current_request
        if req is None or req.content.is_eof():
            return None
        if self._reading_paused:
            self.held_at = now
            return None
        return max(self.rx_at, self.held_at)

    def body_behind(self, now: float, grace: float, rate: float) -> bool:
        """Whether the body of the request being handled arrives slower than ``rate``
        bytes a second on average, beyond a head start of ``grace`` seconds (Apache
        mod_reqtimeout's ``MinRate``): it may take ``grace`` plus a second per ``rate``
        bytes received (``StreamReader.total_bytes``).

        The clock starts at the first look (a sweeper's: at most one sweep late, never
        early) and stops while the server itself holds reading (``_reading_paused``): a
        handler not consuming its body is not the client's delay.

        Args:
            now: the event loop's time.
            grace: seconds any body may take regardless of its rate.
            rate: bytes a second (more than 0).

        Returns:
            False when no handler runs or its whole body arrived.
        """
        intake = self.intake
        body: Any = intake if intake is not None else self._current_request
        if body is None or (intake.done if intake is not None else body.content.is_eof()):
            self.body_req = None  # no reference kept to a finished request
            return False
        if body is not self.body_req:
            self.body_req, self.body_at = body, now
        elif self._reading_paused and intake is None:
            self.body_at += now - self.body_seen  # the server held reading since the last look
        self.body_seen = now
        got = intake.received if intake is not None else body.content.total_bytes
        return now - self.body_at > grace + got / rate


def _switch_protocol(transport: Any, protocol: Any) -> None:
    """Make ``protocol`` the one ``transport`` reads into, from its next read on.

    asyncio's transports choose between ``data_received`` and a ``BufferedProtocol``'s
    ``get_buffer`` in ``set_protocol``; uvloop's when reading starts, so reading is
    stopped and started again (between two reads: this runs inside one's callback).
    """
    transport.set_protocol(protocol)
    transport.pause_reading()
    transport.resume_reading()


class HandlerRunner(web.AppRunner):
    """``aiohttp.web.AppRunner`` whose connections are ``handler_class(**handler_kwargs)``.

    aiohttp offers no hook for the handler class. Its ``Server`` builds handlers in
    ``__call__`` from its ``_loop`` and ``_kwargs`` and has no ``__slots__``; the server
    made by ``AppRunner._make_server`` is switched to a subclass that only overrides
    ``__call__``.
    """

    handler_class: type[web_protocol.RequestHandler] = web_protocol.RequestHandler

    def handler_kwargs(self) -> dict:
        """Extra keyword arguments for each handler (override)."""
        return {}

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _server_class(self.handler_class)
        server.handler_extra = self.handler_kwargs()  # type: ignore[attr-defined]
        return server


_SERVER_CLASSES: dict[type, type] = {}


def _server_class(handler_class: type) -> type[web_server.Server]:
    cls = _SERVER_CLASSES.get(handler_class)
    if cls is None:

        class _Server(web_server.Server):
            handler_extra: dict

            def __call__(self) -> web_protocol.RequestHandler:
                return handler_class(self, loop=self._loop, **self.handler_extra, **self._kwargs)

        cls = _SERVER_CLASSES[handler_class] = _Server
    return cls


# ---------------------------------------------------------------------------- prometheus


def histogram_parts(child: Any) -> tuple[list[Any], Any] | None:
    """A histogram child's bucket counters and sum counter, to add observations in bulk.

    prometheus_client keeps them in ``_buckets`` (one per bound, +Inf last) and ``_sum``;
    None if that is no longer so (the caller then replays observations one by one).
    """
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if buckets is None or total is None:
        return None
    return buckets, total
