"""How a worker's connections answer what aiohttp cannot parse, and the runner that makes
those connections.

aiohttp's own answer to a request it cannot parse quotes the request's bytes; here it is
one generic line per kind of parse error (:func:`parse_error_reason`), never the bytes.
:class:`AppRunner` is ``aiohttp.web.AppRunner`` with these connections, held to the app's
connection limits (:mod:`eg_kv.server.connections`).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import http_exceptions, web

from ._compat import HandlerRunner, response_started
from .answers import error_response, label
from .connections import Connection
from .keys import CONNECTIONS
from .lane import FastLane

log = logging.getLogger("eg_kv.server.protocol")


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
    if isinstance(message, str) and message in _FIXED_PARSE_MESSAGES:
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

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
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
        resp = label(error_response(status, reason))
        resp.force_close()
        return resp


class AppRunner(HandlerRunner):
    """``aiohttp.web.AppRunner`` whose connections are :class:`eg_kv.server.connections.Connection`.

    They answer unparsable requests in one line and are held to the app's connection
    limits (its :data:`~eg_kv.server.keys.CONNECTIONS`); aiohttp's own keep-alive timer
    stays as a backstop. tests/server/test_server_badinput.py checks the bodies.
    """

    handler_class = _OneLineErrorHandler

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", app[CONNECTIONS].limits.aiohttp_keepalive)
        super().__init__(app, **kwargs)

    def handler_kwargs(self) -> dict[str, Any]:
        # Called once the app has started (its slab attached): the lane needs it.
        return {"registry": self.app[CONNECTIONS], "lane": FastLane.of(self.app)}
