"""The existence routes (``GET /kv/<hash>/exists``, ``POST /kv/batch/exists``) and the
leases they take (``POST /kv/batch/release``).

A batch asks about up to :data:`eg_kv.wire.BATCH_EXISTS_MAX` addresses in JSON, or in the
compact body :mod:`eg_kv.wire` describes; the answer comes in the request's format.

Leases (:mod:`eg_kv.slab.leases`): a batch exists with ``X-Eg-Kv-Lease-Ms: n`` (JSON or
compact alike) leases each hit for ``n`` ms, at most the server's ``--lease-ms``; the answer
says the ms granted in the same header (0: none taken). A lease ends at the first of:

- the load: ``GET /kv/<hash>`` with ``X-Eg-Kv-Release`` (any value) releases one of the
  caller's leases on the block once the answer is sent (hit or not);
- ``POST /kv/batch/release``, the batch exists' bodies: one lease per address; answers
  ``{"released": [bool, ...]}`` (JSON) or one byte per address (compact), true/1 where a
  lease that had not ended was released;
- its end: nothing to do.

Leases only reach the caller's namespace (its token's), like every lookup. Leases hold at
most ``--lease-share`` of the slab's pages, and of a namespace's quota: a lookup whose new
leases would pass that answers its hits unleased, with ``X-Eg-Kv-Lease-Ms: 0`` and
``X-Eg-Kv-Lease-Refused`` saying why (its hits are not the caller's to release).
"""

from __future__ import annotations

import contextlib
import json

from aiohttp import web

from .. import wire
from ..errors import BadRequest, InvalidAddress, TooLarge
from ..slab.holds import holder_of
from ..wire import (
    BATCH_EXISTS_MAX,
    BATCH_EXISTS_MAX_BYTES,
    LEASE_HEADER,
    LEASE_REFUSED_HEADER,
    whole_number,
)
from . import tiers
from .answers import reply, why
from .keys import DISK, SETTINGS, SLAB
from .replies import JSON
from .tenants import Tenant


async def block_exists(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/<hash>/exists``: ``{"hash": ..., "exists": bool}``."""
    address = request.match_info["hash"]
    if address == "batch":  # /kv/batch/exists exists, for POST only
        raise web.HTTPMethodNotAllowed(request.method, ("POST",))
    found = request.app[SLAB].exists(address, tenant.ns)
    if not found:
        found = (await tiers.find(request, tenant, [address]))[0] is not None
    body = json.dumps({"hash": address, "exists": found})
    return reply(request, 200, body.encode(), JSON)


async def batch_exists(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``POST /kv/batch/exists`` with ``{"addresses": [...]}`` (at most 1024).

    Answers ``{"exists": [bool, ...], "prefix_hits": n}``, ``n`` being the length of the
    leading run of hits (how much of a token prefix is cached). A body of type
    ``application/x-eg-kv-addresses`` gets the compact answer instead
    (:mod:`eg_kv.wire`). With ``X-Eg-Kv-Lease-Ms``, the hits are leased (module docstring).

    Raises:
        BadRequest: a bad body or lease header. TooLarge: over 1024 addresses or 512 KiB.
    """
    lease_ms = granted_lease(request)
    content_type = request.headers.get("Content-Type")
    addresses = batch_addresses(content_type, await _batch_body(request, "exists"))
    slab = request.app[SLAB]
    if lease_ms <= 0:
        found = slab.exists_many(addresses, tenant.ns)
    else:
        share = request.app[SETTINGS].lease_share
        found, leased = slab.exists_leased(
            addresses, tenant.ns, lease_ms, share, holder_of(tenant.name)
        )
    on_disk: list[int] = []
    missed = [i for i, hit in enumerate(found) if not hit] if DISK in request.app else []
    if missed:  # the disk tier answers the slab's misses (found there: hits, not leased)
        places = await tiers.find(request, tenant, [addresses[i] for i in missed])
        on_disk = [i for i, place in zip(missed, places, strict=True) if place is not None]
        for i in on_disk:
            found[i] = True
    answer, answer_type = batch_answer_body(found, content_type, on_disk)
    if LEASE_HEADER not in request.headers:
        return reply(request, 200, answer, answer_type)
    # A leasing lookup takes the lock anyway: aiohttp's response, with the header.
    headers = {"Content-Type": answer_type, LEASE_HEADER: str(lease_ms)}
    if lease_ms > 0 and not leased:
        headers[LEASE_HEADER] = "0"
        headers[LEASE_REFUSED_HEADER] = (
            f"leases hold {share:g} of the slab's pages or of this namespace's quota "
            "(--lease-share), or the table of lease holders is full here: hits answered, "
            "none leased"
        )
    return web.Response(status=200, body=answer, headers=headers)


async def batch_release(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``POST /kv/batch/release``: release one lease on each address (the batch exists'
    bodies); ``{"released": [bool, ...]}``, or one byte per address for a compact body.

    Raises:
        BadRequest: a bad body. TooLarge: over 1024 addresses or 512 KiB.
    """
    content_type = request.headers.get("Content-Type")
    addresses = batch_addresses(content_type, await _batch_body(request, "release"))
    released = request.app[SLAB].release_leases(addresses, tenant.ns, holder_of(tenant.name))
    if wire.is_compact(content_type):
        return reply(request, 200, wire.encode_flags(released), wire.FLAGS_TYPE)
    return reply(request, 200, json.dumps({"released": released}).encode(), JSON)


def granted_lease(request: web.Request) -> int:
    """The lease a batch lookup asks for (``X-Eg-Kv-Lease-Ms``), clamped to the server's
    ``--lease-ms``; 0 without the header.

    Raises:
        BadRequest: the header is not a whole number of ms.
    """
    raw = request.headers.get(LEASE_HEADER)
    if raw is None:
        return 0
    most = request.app[SETTINGS].lease_ms
    value = whole_number(raw.strip(), huge=most)  # a huge ask gets the most
    if value is None:
        raise BadRequest(f"{LEASE_HEADER} must be a whole number of milliseconds (0: none)")
    return min(value, most)


def release_on_load(request: web.Request, tenant: Tenant) -> None:
    """End one of the caller's leases on the block a ``GET`` with ``X-Eg-Kv-Release`` loaded
    (or missed). An invalid address has no lease: the GET answered 400 for it."""
    with contextlib.suppress(InvalidAddress):
        address = request.match_info["hash"]
        request.app[SLAB].release_leases([address], tenant.ns, holder_of(tenant.name))


async def _batch_body(request: web.Request, what: str) -> bytes:
    """A batch request's body, bounded before it is read.

    Raises:
        BadRequest: no Content-Length, or the body broke off. TooLarge: over 512 KiB.
    """
    raw = request.headers.get("Content-Length")
    length = None if raw is None else whole_number(raw)
    if length is None:
        raise BadRequest(f"batch {what} needs a body with a Content-Length")
    if length > BATCH_EXISTS_MAX_BYTES:
        raise TooLarge(
            f"batch body of {raw} bytes is over {BATCH_EXISTS_MAX_BYTES // 1024} KiB: send at "
            f"most {BATCH_EXISTS_MAX} addresses a batch"
        )
    try:
        return await request.read()
    except Exception as e:
        raise BadRequest(f"batch body cut short: {why(e)}") from None


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
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (nested too deep)
            raise BadRequest(f"batch body is not JSON: {why(e)}") from None
        listed = doc.get("addresses") if isinstance(doc, dict) else None
        if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
            raise BadRequest('batch body must be {"addresses": ["<hash>", ...]}')
        addresses = listed
    if len(addresses) > BATCH_EXISTS_MAX:
        raise TooLarge(f"{len(addresses)} addresses in one batch; at most {BATCH_EXISTS_MAX}")
    return addresses


def batch_answer_body(
    found: list[bool], content_type: str | None, on_disk: list[int] | None = None
) -> tuple[bytes, str]:
    """The answer body and its type for ``found``, in the request's format; the JSON one
    lists the hits the disk tier answered (``on_disk``, indexes), when there are any."""
    if wire.is_compact(content_type):
        return wire.encode_flags(found), wire.FLAGS_TYPE
    prefix = next((i for i, hit in enumerate(found) if not hit), len(found))
    body: dict[str, object] = {"exists": found, "prefix_hits": prefix}
    if on_disk:
        body["on_disk"] = on_disk
    return json.dumps(body).encode(), JSON
