"""The event log's routes: ``GET /kv/events`` (long-poll) and ``GET /kv/events/snapshot``.

``GET /kv/events?since=SEQ&wait=S&limit=N`` answers the entries of the slab's event log
(:mod:`eg_kv.slab.events`) after ``SEQ``, oldest first::

    {"epoch": "<hex>", "events": [{"seq": 7, "kind": "stored", "reason": "put",
     "hash": "<address>", "length": 4096}, ...], "next": 7, "gap": false}

Ask again with ``since=next``. With none yet, the answer waits up to ``wait`` seconds
(at most :data:`MAX_WAIT_S`: a larger one is clamped, and the answer's ``"wait"`` says
what it was) for one. A reader whose ``since`` fell out of the
bounded log, or is beyond it, or whose ``epoch`` (when it sends one) is not the log's
(the server started a new log), gets ``"gap": true`` and ``next`` the newest seq: it
fetches ``GET /kv/events/snapshot`` (the blocks held and the ``seq`` they are consistent
with, ``{"epoch", "seq", "blocks": [{"hash", "length"}, ...]}``) and follows the log
from that ``seq``.

A tenant sees its own namespace's events and blocks; an admin of a tokens file sees every
namespace's, each named (``"namespace"``). Waiting: each waiter polls the log's newest seq
(a word of shared memory any worker's write moves), every :data:`POLL_MIN_S` at first and
backing off to :data:`POLL_MAX_S`: an event reaches a waiting reader within about 50 ms,
and an idle waiter costs its worker ~20 wake-ups a second. At most :data:`MAX_WAITERS`
wait at once per worker; one more gets ``503``. A draining worker answers its waiters at
once.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

from aiohttp import web

from ..errors import BadRequest, Busy, NotFound
from ..slab.events import KINDS, REASONS, Event, EventRing
from ..slab.store import Slab
from ..wire import whole_number
from .answers import reply
from .keys import AUTH, DRAIN, SLAB
from .replies import JSON
from .tenants import Tenant

#: The longest a ``GET /kv/events`` waits (a larger ``wait`` is clamped to it).
MAX_WAIT_S = 30.0
#: Entries one answer carries by default, and at most.
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10000
#: Waiting readers per worker; one more gets 503.
MAX_WAITERS = 64
#: How often a waiter looks at the log: first, and at most (it backs off in between).
POLL_MIN_S = 0.005
POLL_MAX_S = 0.05
#: Waiters per worker now (one event loop per worker: a plain counter).
_waiting = [0]


def _int_arg(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    """Query argument ``name`` as an int in [low, high] (clamped above).

    Raises:
        BadRequest: not a non-negative integer, or below ``low``.
    """
    text = request.query.get(name)
    if text is None:
        return default
    value = whole_number(text)
    if value is None:
        raise BadRequest(f"{name}={text[:40]!r}: want a whole number in ASCII digits")
    if value < low:
        raise BadRequest(f"{name}={value}: want at least {low}")
    return min(value, high)


#: What ``wait`` may be: ASCII digits, perhaps a decimal point and more of them.
_SECONDS = re.compile(r"[0-9]{1,64}(?:\.[0-9]{1,64})?")


def _wait_arg(request: web.Request) -> float:
    """``wait`` in seconds, clamped to [0, MAX_WAIT_S].

    Raises:
        BadRequest: not a number.
    """
    text = request.query.get("wait")
    if text is None:
        return 0.0
    if not _SECONDS.fullmatch(text):  # float() reads signs, spaces, "inf", other scripts
        raise BadRequest(f"wait={text[:40]!r}: want seconds in ASCII digits, e.g. 10 or 0.5")
    value = float(text[:24])  # a longer one is past the clamp anyway
    if math.isnan(value) or value < 0:
        raise BadRequest(f"wait={text[:40]!r}: want seconds, at least 0")
    return min(value, MAX_WAIT_S)


def _ring(slab: Slab) -> EventRing:
    ring = slab.events
    if ring is None:
        raise NotFound("this server keeps no event log (it runs with --events 0)")
    return ring


def _scope(request: web.Request, tenant: Tenant) -> int | None:
    """The namespace id whose events ``tenant`` sees; None: every namespace's (an admin
    of a tokens file, or any client of a server without one: it has one namespace)."""
    if tenant.is_admin:
        return None
    return tenant.ns


def _epoch_text(ring: EventRing) -> str:
    return f"{ring.epoch:016x}"


def _event_json(ev: Event, names: dict[int, str] | None) -> dict[str, object]:
    out: dict[str, object] = {
        "seq": ev.seq,
        "kind": KINDS.get(ev.kind, "?"),
        "reason": REASONS.get(ev.reason, "?"),
        "hash": ev.address.decode("ascii", "replace"),
        "length": ev.length,
    }
    if names is not None:
        out["namespace"] = names.get(ev.ns, f"id:{ev.ns}")
    return out


def _names(request: web.Request, tenant: Tenant) -> dict[int, str] | None:
    """Namespace names by id for an admin of a tokens file (None otherwise)."""
    auth = request.app[AUTH]
    if not (tenant.is_admin and auth.tenants_mode and auth.table is not None):
        return None
    return {t.ns: t.namespace for t in auth.table.by_digest.values()}


async def get_events(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/events``: the log after ``since`` (see the module docstring).

    Raises:
        BadRequest: a bad argument. NotFound: no event log. Busy: too many waiters.
    """
    slab = request.app[SLAB]
    ring = _ring(slab)
    since = _int_arg(request, "since", 0, 0, 1 << 62)
    limit = _int_arg(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    wait = _wait_arg(request)
    epoch = request.query.get("epoch")
    ns = _scope(request, tenant)
    names = _names(request, tenant)
    if epoch is not None and epoch != _epoch_text(ring):
        return _answer(request, ring, [], ring.head, True, names, wait)
    events, nxt, gap = ring.read(since, limit, ns)
    if events or gap or wait <= 0:
        return _answer(request, ring, events, nxt, gap, names, wait)
    if _waiting[0] >= MAX_WAITERS:
        raise Busy(f"{MAX_WAITERS} readers already wait for events on this worker; retry")
    _waiting[0] += 1
    try:
        drain, deadline, pause = request.app[DRAIN], time.monotonic() + wait, POLL_MIN_S
        while not drain.draining:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)
            if ring.head <= nxt:
                continue
            events, nxt, gap = ring.read(nxt, limit, ns)
            if events or gap:
                break
    finally:
        _waiting[0] -= 1
    return _answer(request, ring, events, nxt, gap, names, wait)


def _answer(
    request: web.Request,
    ring: EventRing,
    events: list[Event],
    nxt: int,
    gap: bool,
    names: dict[int, str] | None,
    wait: float,
) -> web.StreamResponse:
    body = {
        "epoch": _epoch_text(ring),
        "events": [_event_json(ev, names) for ev in events],
        "next": nxt,
        "gap": gap,
        "wait": wait,  # as clamped: the most this answer could have waited
    }
    return reply(request, 200, json.dumps(body).encode(), JSON)


async def get_snapshot(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/events/snapshot``: the blocks held (the tenant's namespace's, or every
    namespace's for an admin) and the seq of the log they are consistent with.

    Raises:
        NotFound: no event log.
    """
    slab = request.app[SLAB]
    _ring(slab)
    names = _names(request, tenant)
    # On a thread: the walk takes the slab lock slice by slice (ms each) and lasts
    # ~2 µs a block; this worker's other requests go on meanwhile.
    loop = asyncio.get_running_loop()
    epoch, seq, blocks = await loop.run_in_executor(
        None, slab.events_snapshot, _scope(request, tenant)
    )
    listed: list[dict[str, object]] = []
    for ns, address, length in blocks:
        item: dict[str, object] = {"hash": address, "length": length}
        if names is not None:
            item["namespace"] = names.get(ns, f"id:{ns}")
        listed.append(item)
    body = {"epoch": f"{epoch:016x}", "seq": seq, "blocks": listed}
    return reply(request, 200, json.dumps(body).encode(), JSON)
