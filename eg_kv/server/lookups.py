"""The existence routes: ``GET /kv/<hash>/exists`` and ``POST /kv/batch/exists``.

A batch asks about up to :data:`eg_kv.wire.BATCH_EXISTS_MAX` addresses in JSON, or in the
compact body :mod:`eg_kv.wire` describes; the answer comes in the request's format.
"""

from __future__ import annotations

import json

from aiohttp import web

from .. import wire
from ..errors import BadRequest, TooLarge
from ..wire import BATCH_EXISTS_MAX, BATCH_EXISTS_MAX_BYTES
from .answers import reply, why
from .keys import SLAB
from .replies import JSON
from .tenants import Tenant


async def block_exists(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/<hash>/exists``: ``{"hash": ..., "exists": bool}``."""
    address = request.match_info["hash"]
    if address == "batch":  # /kv/batch/exists exists, for POST only
        raise web.HTTPMethodNotAllowed(request.method, ("POST",))
    found = request.app[SLAB].exists(address, tenant.ns)
    body = json.dumps({"hash": address, "exists": found})
    return reply(request, 200, body.encode(), JSON)


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
    if int(raw) > BATCH_EXISTS_MAX_BYTES:
        raise TooLarge(f"batch body of {raw} bytes is over {BATCH_EXISTS_MAX_BYTES}")
    try:
        body = await request.read()
    except Exception as e:
        raise BadRequest(f"batch body cut short: {why(e)}") from None
    content_type = request.headers.get("Content-Type")
    addresses = batch_addresses(content_type, body)
    found = request.app[SLAB].exists_many(addresses, tenant.ns)
    answer, answer_type = batch_answer_body(found, content_type)
    return reply(request, 200, answer, answer_type)


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
            raise BadRequest(f"batch body is not JSON: {why(e)}") from None
        listed = doc.get("addresses") if isinstance(doc, dict) else None
        if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
            raise BadRequest('batch body must be {"addresses": ["<hash>", ...]}')
        addresses = listed
    if len(addresses) > BATCH_EXISTS_MAX:
        raise TooLarge(f"{len(addresses)} addresses in one batch; at most {BATCH_EXISTS_MAX}")
    return addresses


def batch_answer_body(found: list[bool], content_type: str | None) -> tuple[bytes, str]:
    """The answer body and its type for ``found``, in the request's format."""
    if wire.is_compact(content_type):
        return wire.encode_flags(found), wire.FLAGS_TYPE
    prefix = next((i for i, hit in enumerate(found) if not hit), len(found))
    return json.dumps({"exists": found, "prefix_hits": prefix}).encode(), JSON
