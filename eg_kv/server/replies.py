"""Whole HTTP responses written straight to the connection, for the hot routes.

Building, preparing and finishing an aiohttp ``Response`` costs about as much Python as
everything else a small GET does together (docs/design.md, "Serving", has the
figures). The block routes therefore compose the
response head themselves from a cached prefix, hand head and body to the transport in
one ``writelines`` call, and return a :class:`Written` so that aiohttp, which still
parses requests, routes them and keeps the connection, sees a finished response.

A head looks like this (``Connection`` only where the version's default does not hold)::

    HTTP/1.1 200 OK\\r\\n                       ┐
    Content-Type: application/octet-stream\\r\\n │ cached per (version, status, type,
    Server: eg-kv\\r\\n                          │ keep-alive) and worker pid
    X-EgKv-Worker: 4242\\r\\n                    │
    Connection: close\\r\\n                      ┘
    Content-Length: 4096\\r\\n                   per response (none for 204)
    X-Eg-Kv-Checksum: 9f86d081884c7d65\\r\\n     a block's answer (GET, HEAD)
    Date: Sun, 29 Nov 2026 15:30:00 GMT\\r\\n    cached per second
    \\r\\n

Errors and the service routes keep aiohttp's ``Response``: they are rare, and
:func:`eg_kv.server.answers.label` gives them the same ``Server`` and worker headers.
"""

from __future__ import annotations

import email.utils
import http
import os
import time

from aiohttp import web

from ..wire import ADDRESS_HEADER, BLOCK_PREFIX, CHECKSUM_HEADER, JSON_TYPE, WORKER_HEADER
from ._compat import SentResponse, count_sent

#: The ``Server`` header of every answer.
SERVER = "eg-kv"
#: The type of error lines and other plain answers.
TEXT = "text/plain; charset=utf-8"
#: The type of the server's JSON answers.
JSON = f"{JSON_TYPE}; charset=utf-8"

_CHECKSUM = CHECKSUM_HEADER.encode("ascii")
_ADDRESS = ADDRESS_HEADER.encode("ascii")
_HEADS: dict[tuple[tuple[int, int], int, str, bool], bytes] = {}
_PID = [str(os.getpid())]
#: The Date line and the second it was made for, cached per second.
_DATE_LINE = [b""]
_DATE_AT = [-1]


def set_worker_pid() -> None:
    """Take this process's pid for the worker header (call after ``fork``)."""
    _PID[0] = str(os.getpid())
    _HEADS.clear()


def worker_pid() -> str:
    """The pid the worker header carries."""
    return _PID[0]


class Written(SentResponse):
    """A response that is already on its way: aiohttp's ``prepare`` and ``write_eof``,
    which it calls to finish every response, have nothing left to do.

    Args:
        status: the status that went out (for metrics and the access log).
        keep_alive: whether the connection stays open (False: aiohttp closes it).
        body_length: body bytes that went out.
    """


#: Finished responses, shared: aiohttp only reads one (status, keep-alive, length) after
#: the handler returns it, and a new ``StreamResponse`` cost 0.4 µs of a 27 µs GET.
_WRITTEN: dict[tuple[int, bool, int], Written] = {}
#: Distinct (status, keep-alive, length) kept; beyond it each answer gets its own.
WRITTEN_KEPT = 512


def written(status: int, keep_alive: bool, body_length: int) -> Written:
    """A :class:`Written` for this answer: shared with every answer like it."""
    key = (status, keep_alive, body_length)
    done = _WRITTEN.get(key)
    if done is None:
        done = Written(status, keep_alive, body_length)
        if len(_WRITTEN) < WRITTEN_KEPT:
            _WRITTEN[key] = done
    return done


def _head(version: tuple[int, int], status: int, content_type: str, keep: bool) -> bytes:
    key = (version, status, content_type, keep)
    head = _HEADS.get(key)
    if head is None:
        lines = [f"HTTP/{version[0]}.{version[1]} {status} {http.HTTPStatus(status).phrase}"]
        if content_type:
            lines.append(f"Content-Type: {content_type}")
        lines += [f"Server: {SERVER}", f"{WORKER_HEADER}: {_PID[0]}"]
        if keep and version < (1, 1):
            lines.append("Connection: keep-alive")
        elif not keep and version >= (1, 1):
            lines.append("Connection: close")
        head = _HEADS[key] = ("\r\n".join(lines) + "\r\n").encode("ascii")
    return head


def _date() -> bytes:
    now = int(time.time())
    if _DATE_AT[0] != now:
        _DATE_LINE[0] = b"Date: %s\r\n\r\n" % email.utils.formatdate(now, usegmt=True).encode()
        _DATE_AT[0] = now
    return _DATE_LINE[0]


def head(
    request: web.BaseRequest,
    status: int,
    content_type: str,
    length: int | None,
    close: bool,
    checksum: int | None = None,
) -> tuple[bytes, bool]:
    """The response head for ``request``, and whether the connection stays open.

    Args:
        length: the Content-Length to announce; None sends none (204).
        close: the server wants this connection closed after the response (draining).
        checksum: a block's checksum, sent as :data:`~eg_kv.wire.CHECKSUM_HEADER` (with
            the address asked, :data:`~eg_kv.wire.ADDRESS_HEADER`).
    """
    keep = not close and request.keep_alive
    address = "" if checksum is None else request.path[len(BLOCK_PREFIX) :]
    return head_for(
        request.version, keep, status, content_type, length, checksum, address=address
    ), keep


def head_for(
    version: tuple[int, int],
    keep: bool,
    status: int,
    content_type: str,
    length: int | None,
    checksum: int | None = None,
    extra: bytes = b"",
    address: str = "",
) -> bytes:
    """The response head for a request of HTTP ``version`` (:func:`head`'s, without the
    request: the fast lane's answers, :mod:`eg_kv.server.lane`).

    Args:
        keep: the connection stays open after this answer.
        extra: header lines to add, each ending ``\r\n`` (an error's ``Retry-After``).
        address: a block answer's address (with ``checksum``), echoed as
            :data:`~eg_kv.wire.ADDRESS_HEADER`.
    """
    prefix = _head(version, status, content_type, keep)
    if length is None:
        return prefix + extra + _date()
    if checksum is not None:
        return b"%sContent-Length: %d\r\n%s: %016x\r\n%s: %s\r\n%s%s" % (
            prefix, length, _CHECKSUM, checksum, _ADDRESS, address.encode("ascii"), extra,
            _date(),
        )  # fmt: skip
    return b"%sContent-Length: %d\r\n%s%s" % (prefix, length, extra, _date())


def reply(
    request: web.BaseRequest,
    status: int,
    body: bytes = b"",
    content_type: str = TEXT,
    *,
    length: int | None = None,
    close: bool = False,
    checksum: int | None = None,
) -> Written:
    """Write a whole response (head and ``body``) to the connection in one call.

    Args:
        length: the Content-Length when it is not ``len(body)``: a HEAD answer sends the
            block's length and no body. Ignored for 204, which has neither.
        close: close the connection after this response.
        checksum: the block's checksum, for a block's answer (GET, HEAD).

    Returns:
        The finished response, for aiohttp.

    Raises:
        ConnectionResetError: the client has gone.
    """
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away before the response")
    if status == 204:
        head_bytes, keep = head(request, status, "", None, close)
        transport.write(head_bytes)
        sent(request, len(head_bytes))
        return written(status, keep, 0)
    # Every JSON answer ends its line: the newline goes out after the body, not copied on.
    tail = b"\n" if content_type is JSON and body[-1:] != b"\n" else b""
    size = len(body) + len(tail)
    head_bytes, keep = head(
        request, status, content_type, size if length is None else length, close, checksum
    )
    if body:
        transport.writelines((head_bytes, body, tail) if tail else (head_bytes, body))
    else:
        transport.write(head_bytes)
    sent(request, len(head_bytes) + size)
    return written(status, keep, size)


#: Count bytes written past aiohttp's writer, so that aiohttp knows the response began.
sent = count_sent
