"""The answers every route shares: one-line errors, eg-kv's headers on aiohttp's
responses, and the block routes' written replies (closing the connection while the worker
drains).

Every error is ``text/plain``, one line that says what was wrong; a 503 always says when
to retry. The block routes write their answers themselves (:mod:`eg_kv.server.replies`);
the rest are aiohttp's, labelled here with the headers every answer carries.
"""

from __future__ import annotations

import json

from aiohttp import web

from ..errors import EgKvError
from ..wire import WORKER_HEADER
from . import replies
from .connections import RETRY_AFTER_S
from .keys import DRAIN
from .replies import TEXT, Written
from .replies import reply as write_reply


def one_line(text: str) -> str:
    """One line of text: an error body never spans lines."""
    return " ".join(str(text).split()) + "\n"


def error_response(status: int, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    """A ``text/plain`` one-line error response; a 503 always carries ``Retry-After``."""
    if status == 503 and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return web.Response(status=status, text=one_line(reason), headers=headers)


def error_answer(e: EgKvError) -> tuple[int, bytes, bytes]:
    """:func:`error_response`'s answer to ``e`` as bytes, for an answer written straight
    to the connection (the fast lane's): (status, one-line body, extra header lines)."""
    extra = b"Retry-After: %d\r\n" % RETRY_AFTER_S if e.status == 503 else b""
    return e.status, one_line(str(e)).encode(), extra


def internal_reason(e: BaseException) -> str:
    """The one line a 500 says: the kind of error, never its text (the log has it)."""
    return f"internal error ({type(e).__name__}); see the server log"


def json_answer(value: object) -> web.Response:
    """A ``200`` JSON answer, ending with a newline (as every JSON answer does: a terminal
    shows the prompt on its own line after ``curl``)."""
    return web.json_response(value, dumps=_json_line)


def _json_line(value: object) -> str:
    return json.dumps(value) + "\n"


def unauthorized(message: str) -> web.Response:
    """A 401 that names the scheme to use (Bearer)."""
    return error_response(401, message, {"WWW-Authenticate": 'Bearer realm="eg-kv"'})


def label(resp: web.StreamResponse) -> web.StreamResponse:
    """Give an aiohttp response the headers every eg-kv response carries."""
    resp.headers[WORKER_HEADER] = replies.worker_pid()
    resp.headers["Server"] = replies.SERVER
    return resp


def closing(request: web.Request) -> bool:
    """Whether this worker is draining: answers then close their connections."""
    return request.app[DRAIN].draining


def reply(
    request: web.Request,
    status: int,
    body: bytes = b"",
    content_type: str = TEXT,
    *,
    length: int | None = None,
    checksum: int | None = None,
) -> Written:
    """:func:`eg_kv.server.replies.reply`, closing the connection while this worker drains."""
    return write_reply(
        request, status, body, content_type, length=length, close=closing(request),
        checksum=checksum,
    )  # fmt: skip


def why(e: BaseException) -> str:
    """What went wrong, short enough for an error line."""
    text = str(e) or type(e).__name__
    return text[:200]
