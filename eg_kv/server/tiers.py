"""The block routes' way down to the disk tier (``--disk``), when the slab misses.

A GET that misses the slab and finds the block on disk answers it and promotes it (a put
into the slab, with the record's checksum and engine name, and as many references as the
disk's copy held); a promotion the slab refuses (full of leased blocks, the namespace
over its quota) still answers the GET. HEAD, exists and batch exists answer from the
keeper's index without moving bytes. A DELETE that misses the slab releases the disk's
copy; a PUT that creates a block the disk already holds with the same bytes is a dedup
hit (200) and takes its references into the slab. Without a disk tier every function
here answers as a miss at once.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ..disk.tier import Found, Loaded
from ..errors import EgKvError
from .keys import DISK, SLAB
from .tenants import Tenant

log = logging.getLogger("eg_kv.server.tiers")


async def load(request: web.Request, tenant: Tenant, address: str) -> Loaded | None:
    """The block from the disk tier, promoted into the slab; None: not there."""
    tier = request.app.get(DISK)
    if tier is None:
        return None
    got = await tier.load(tenant.namespace, address)
    if got is not None:
        promote(request, tenant, address, got)
    return got


def promote(request: web.Request, tenant: Tenant, address: str, got: Loaded) -> None:
    """Put a block read from disk back into the slab (its copy on disk stays)."""
    slab = request.app[SLAB]
    try:
        if slab.put(address, got.data, tenant.ns, got.checksum, got.engine):
            for _ in range(got.refs - 1):
                slab.add_ref(address, len(got.data), tenant.ns)
    except EgKvError as e:  # served all the same, from the bytes read
        log.info("disk tier: %s not promoted into the slab: %s", address, e)


async def find(request: web.Request, tenant: Tenant, addresses: list[str]) -> list[Found | None]:
    """Where each address lies on disk (None: not there; all None without a disk tier)."""
    tier = request.app.get(DISK)
    if tier is None:
        return [None] * len(addresses)
    return await tier.find(tenant.namespace, addresses)


async def delete(request: web.Request, tenant: Tenant, address: str) -> bool:
    """``DELETE``: release one reference, in the slab if it holds the block, else on disk.
    The slab's last reference takes the disk's copy with it before the answer (the event
    the keeper follows would too, but later: a GET meanwhile would find the copy).
    Returns False when neither tier holds it."""
    slab, tier = request.app[SLAB], request.app.get(DISK)
    if slab.delete(address, tenant.ns):
        if tier is not None and not slab.exists(address, tenant.ns):
            await tier.discard(tenant.namespace, address)
        return True
    return tier is not None and await tier.delete(tenant.namespace, address)


async def adopt(request: web.Request, tenant: Tenant, address: str) -> bool:
    """A PUT created ``address`` in the slab: True if the disk held the same bytes (a
    dedup hit: its references join the slab's)."""
    tier = request.app.get(DISK)
    if tier is None:
        return False
    slab = request.app[SLAB]
    described = slab.describe(address, tenant.ns)
    if described is None:
        return False
    length, checksum = described
    refs = await tier.adopt(tenant.namespace, address, checksum)
    try:
        for _ in range(refs):
            slab.add_ref(address, length, tenant.ns)
    except EgKvError:
        return False
    return refs > 0
