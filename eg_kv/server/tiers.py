"""The block routes' way down to the disk tier (``--disk``), when the slab misses.

A GET that misses the slab and finds the block on disk reserves its pages in the slab,
reads the record straight into them and checks it, sends it from those pages (reserved,
so no eviction can take them during the send, however small the slab), and then
publishes it there (a promotion, with the record's engine name and as many references as
the disk's copy held). A promotion the slab refuses (full of leased blocks, the
namespace over its quota) still answers the GET, from a copy. HEAD, exists and batch
exists answer from the keeper's index without moving bytes. A DELETE that misses the
slab releases the disk's copy; a PUT of a block the disk already holds with the same
bytes is a dedup hit (200), published with the copy's references. Without a disk tier
every function here answers as a miss at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from ..disk import wire
from ..disk.layout import ALIGN
from ..disk.tier import DiskTier, Found, Loaded
from ..errors import Busy, Conflict, EgKvError
from ..slab.store import PutHandle, Slab, conflict_message
from .keys import DISK, SETTINGS, SLAB
from .tenants import Tenant

log = logging.getLogger("eg_kv.server.tiers")


class Promoted:
    """What :func:`load` answers for a block it put into the slab: serve it from there."""


PROMOTED = Promoted()


class Promoting:
    """A block read from disk into pages it has reserved in the slab and verified, not yet
    published: the GET sends it from those pages (nobody else can touch them while they
    are reserved, so it cannot be evicted from under the send, however small the slab)
    and then calls :meth:`publish`.

    Attributes:
        views: the block's bytes, in order (slab memory).
        length, checksum: the block's.
    """

    def __init__(self, handle: PutHandle, views: list[memoryview], found: Found,
                 slab: Slab, tier: DiskTier, tenant: Tenant) -> None:  # fmt: skip
        self._handle, self._found, self._slab = handle, found, slab
        self._tier, self._tenant = tier, tenant
        self.length, self.checksum = found.length, found.checksum
        extra = sum(len(v) for v in views) - found.length  # the alignment past the end
        self.views = [*views[:-1], views[-1][: len(views[-1]) - extra]]

    async def publish(self) -> None:
        """Publish the block (once its bytes are sent, or copied), with the references its
        disk copy holds now: DELETEs that came meanwhile went to the disk's copy, and the
        keeper holds back those that come until the block is in the slab. Nothing is
        published when the copy went meanwhile, or when a PUT or another promotion
        stored the block first (its references are there). Its pages go back unless the
        block is published."""
        h, tier, tenant = self._handle, self._tier, self._tenant
        try:
            refs, mark = await tier.promote(tenant.namespace, h.address, self._found.seq)
            if mark:  # (none: another is committing it, or the copy went)
                try:  # all its copy's references at once, none a dedup hit
                    h.refs = refs
                    h.commit()
                finally:
                    tier.promoted(tenant.namespace, h.address, mark)
        except EgKvError as e:
            log.info("disk tier: %s not promoted into the slab: %s", h.address, e)
        finally:
            h.abort()


async def load(
    request: web.Request, tenant: Tenant, address: str
) -> Loaded | Promoted | Promoting | None:
    """The block from the disk tier, on its way into the slab: a :class:`Promoting` when
    it was read straight into reserved slab pages (send, then publish), :data:`PROMOTED`
    when another request promoted it meanwhile (serve it from the slab), its bytes when
    it was read into memory (the slab would not take it, or its pages are not aligned for
    O_DIRECT), None when the disk does not hold it (or its record failed its checks)."""
    tier = request.app.get(DISK)
    if tier is None:
        return None
    found = await tier.locate(tenant.namespace, address)
    if found is None:
        return None
    slab = request.app[SLAB]
    try:
        handle = slab.begin_put(address, found.length, request.app[SETTINGS].upload_share,
                                tenant.ns, found.checksum)  # fmt: skip
    except EgKvError as e:  # no room now (leases, a quota): served from a copy instead
        log.info("disk tier: %s not promoted into the slab: %s", address, e)
        return await tier.read(tenant.namespace, address, found)
    handed = False
    try:
        if handle.dedup:  # another request promoted it meanwhile
            return PROMOTED
        views = handle.page_views(ALIGN)
        if views is None:  # the slab's pages do not suit O_DIRECT: through a copy
            got = await tier.read(tenant.namespace, address, found)
            if got is None:
                return None
            handle.write(got.data)
            handle.engine, handle.record = got.engine, found.seq
            handed = True
            await Promoting(handle, [memoryview(got.data)], found, slab, tier, tenant).publish()
            return got
        read = await tier.read_into(tenant.namespace, address, found, views, handle.filled)
        if read is None:
            return None
        rec, checksum = read
        if checksum != found.checksum:
            tier.failed(tenant.namespace, address, found)
            return None
        handle.engine, handle.record = rec.engine, found.seq
        handed = True
        return Promoting(handle, views, found, slab, tier, tenant)
    finally:
        if not handed:
            handle.abort()  # a dedup's reference back, or the pages of a failed read


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
    Returns False when neither tier holds it.

    Raises:
        Busy: the slab does not hold it and the disk tier did not answer (a 503: the
            disk may hold it, so it is not a 404), or it kept moving between the tiers.
    """
    slab, tier = request.app[SLAB], request.app.get(DISK)
    for _ in range(3):  # the keeper may find it in the slab since (a promotion, a PUT)
        block = slab.block_ids([address], tenant.ns)[1][0] if tier is not None else 0
        spilled = tier is not None and slab.spilled(address, tenant.ns)
        if slab.delete(address, tenant.ns):
            if tier is not None:
                refs = slab.refs(address, tenant.ns)
                if not refs:  # a copy on disk: its keeper must have the discard
                    await tier.discard(tenant.namespace, address, block, wait=spilled)
                else:
                    tier.count_refs(tenant.namespace, address, refs)
            return True
        if tier is None:
            return False
        on_disk = await tier.delete(tenant.namespace, address)
        if on_disk is None:  # not "not there": the disk may hold it
            raise Busy("the disk tier did not answer (its keeper is down or busy); retry")
        if on_disk != wire.IN_SLAB:
            return bool(on_disk)
    raise Busy(f"block {address} moved between the slab and the disk while deleted; retry")


def may_hold(request: web.Request, tenant: Tenant, address: str) -> bool:
    """Whether the disk tier may hold a copy of ``address`` (False without one, or when
    the keeper's filter rules it out): a PUT of such a block must ask the keeper
    (:func:`commit_put`), a GET or HEAD that misses the slab too."""
    tier = request.app.get(DISK)
    return tier is not None and not tier.absent(tenant.namespace, address)


def no_copy_check(request: web.Request, tenant: Tenant, address: str) -> Callable[[], bool] | None:
    """For a small PUT that :func:`may_hold` let through, stored in one step
    (:meth:`~eg_kv.slab.store.Slab.put`): the check its critical section makes before it
    creates the block (a copy spilled, and the slab's block evicted, since the filter
    was read: the PUT is a 503 to retry). None without a disk tier."""
    tier = request.app.get(DISK)
    return None if tier is None else tier.recheck(tenant.namespace, address)


def count_dedup(request: web.Request, tenant: Tenant, address: str) -> None:
    """A PUT was a dedup hit in the slab: the disk's copy counts the reference too."""
    tier = request.app.get(DISK)
    if tier is not None:
        tier.count_refs(tenant.namespace, address, request.app[SLAB].refs(address, tenant.ns))


async def commit_put(request: web.Request, tenant: Tenant, handle: PutHandle) -> bool:
    """Publish a PUT's block (its bytes all in): True if the PUT created it (201),
    False if it was a dedup hit (200).

    With a disk tier, a PUT that would create the block asks the disk first (ADOPT),
    before the block can be seen, as a resident block would answer: a copy of the same
    bytes makes it a dedup hit, published with the copy's references and its own at
    once; a copy of the same length and other bytes stands, and takes the PUT's
    reference; another length is a 409. The keeper holds back DELETEs and promotions of
    the address until the PUT says it is done (asked after the publish, a DELETE on
    another worker in the round trip took the block's only reference: it went, with the
    copy and every holder's reference). A block the slab holds by then (a promotion
    meanwhile) takes the PUT's reference there. While the keeper does not answer the
    slab goes on alone (docs/disk.md says what that costs). A block the keeper's filter
    rules out (:mod:`eg_kv.disk.keyfilter`) asks nothing, and is published only if the
    filter still rules it out under the slab's lock.

    Raises:
        Conflict (the disk holds another length), Busy (the address is being moved
        between the tiers; retry), and what :meth:`PutHandle.commit` raises.
    """
    tier = request.app.get(DISK)
    if tier is None:
        return handle.commit()
    slab, address, name = request.app[SLAB], handle.address, tenant.namespace
    if not handle.dedup and tier.absent(name, address):
        # No copy (the keeper's filter): no round trip; checked again as it is published.
        handle.new_ok = tier.recheck(name, address)
    elif not handle.dedup:  # (a dedup hit from its head: the slab holds the block)
        for _ in range(ADOPT_TRIES):
            verdict, number, mark, record = await tier.adopt(
                name, address, handle.seal(), handle.length
            )
            if verdict == wire.BUSY:
                raise Busy(f"block {address} is moving between the disk and the slab; retry")
            if verdict == wire.CONFLICT:
                raise Conflict(conflict_message(address, number, handle.length))
            if verdict in (wire.SAME, wire.OTHER):
                _join_copy(slab, handle, verdict, number, record, tier, name, mark)
                return False
            if verdict == wire.NEW:
                break
            # RESIDENT: a dedup hit on the slab's block, never a block of its own (the disk's
            # copy, if the block went meanwhile, would keep references the new one lacked)
            if slab.add_ref(address, handle.length, handle.ns):
                handle.abort()
                count_dedup(request, tenant, address)
                return False
        else:
            raise Busy(f"block {address} is moving between the disk and the slab; retry")
    if handle.commit():
        return True
    count_dedup(request, tenant, address)
    return False


#: ADOPTs one PUT asks at most while the slab's block comes and goes under it.
ADOPT_TRIES = 3


def _join_copy(
    slab: Slab, handle: PutHandle, verdict: str, copy_refs: int, record: int, tier: DiskTier,
    name: str, mark: int,
) -> None:  # fmt: skip
    """A PUT whose block the disk holds (``verdict`` SAME or OTHER, the copy's
    ``copy_refs`` and ``record``): a dedup hit, with no await before the keeper is told."""
    joined = 0
    try:
        if verdict == wire.SAME:  # published with the copy's references and its own, and
            handle.refs, handle.joined = copy_refs + 1, record  # marked as on disk
            if handle.commit():  # (else: a dedup hit on the block published meanwhile)
                slab.count_dedup_hit(handle.ns)
        else:  # other bytes: the copy's stand, and so does a block promoted from it
            handle.abort()
            if not slab.add_ref(handle.address, handle.length, handle.ns):
                slab.count_dedup_hit(handle.ns)
        joined = 1
    finally:
        tier.promoted(name, handle.address, mark, joined)
