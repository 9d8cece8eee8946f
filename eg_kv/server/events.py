"""The event log's routes: ``GET /kv/events`` (long-poll) and ``GET /kv/events/snapshot``.

``GET /kv/events?since=SEQ&wait=S&limit=N`` answers the entries of the slab's event log
(:mod:`eg_kv.slab.events`) after ``SEQ``, oldest first::

    {"epoch": "<hex>", "events": [{"seq": 7, "kind": "stored", "reason": "put",
     "hash": "<address>", "length": 4096}, ...], "next": 7, "gap": false}

An event of a block whose PUT named it as its engine does (:mod:`eg_kv.engine`) also
carries ``"engine_hash": "<hex>"``. Ask again with ``since=next``. With none yet, the
answer waits up to ``wait`` seconds (at most :data:`MAX_WAIT_S`: a larger one is clamped,
and the answer's ``"wait"`` says what it was) for one. A reader whose ``since`` fell out
of the bounded log, or is beyond it, or whose ``epoch`` (when it sends one) is not the log's
(the server started a new log), gets ``"gap": true`` and ``next`` the newest position: it
fetches ``GET /kv/events/snapshot`` and follows the log from the snapshot's ``seq``.

The snapshot is streamed (:data:`SNAPSHOT_TYPE`, NDJSON: one JSON object per line), so
neither the server nor a reader holds more than a slice of it besides the set it builds::

    {"epoch": "<hex>"}
    {"hash": "<address>", "length": 4096}          one per block (perhaps twice)
    {"kind": "removed", "reason": "evict", "hash": "<address>", "length": 4096}
    {"seq": 42}

The block lines, then the event lines applied over them in order (stored: add, removed:
drop), give the blocks held at ``seq``; a reader keeps a set (a block stored during the
walk may come twice). A stream without its ``seq`` line was cut; one that ends with
``{"error": ...}`` must be taken again.

A tenant sees its own namespace's events and blocks; an admin of a tokens file sees every
namespace's, each named (``"namespace"``). Waiting: each waiter polls the log's newest seq
(a word of shared memory any worker's write moves), every :data:`POLL_MIN_S` at first and
backing off to :data:`POLL_MAX_S`: an event reaches a waiting reader within about 50 ms,
and an idle waiter costs its worker ~20 wake-ups a second. A waiter whose client left
stops waiting at its next look. A draining worker answers its waiters at once.

Bounds (:mod:`eg_kv.server.gates`: beyond one, ``503`` with ``Retry-After``, at once): at
most :data:`MAX_WAITERS` waiters per worker and :data:`MAX_WAITERS_PER_NAMESPACE` of one
namespace, so one tenant's long polls leave room for every other's; at most
:data:`MAX_READS` reads walking the log at once per worker (:data:`MAX_READS_PER_NAMESPACE`
of one namespace), each looking at :data:`READ_STEP` entries between two turns of the
loop and stopping when its client has left; at most :data:`MAX_SNAPSHOTS` snapshots
(:data:`MAX_SNAPSHOTS_PER_NAMESPACE` of one namespace), each walking only its own
namespace's slots in Python and stopping when its client has left.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import re
import time

from aiohttp import web

from ..errors import BadRequest, Busy, NotFound
from ..slab.events import KINDS, REASONS, SCAN_MAX, Event, EventRing, SnapshotPart, SnapshotVoid
from ..slab.store import Slab
from ..wire import whole_number
from .answers import label, reply
from .gates import Gate, client_gone
from .keys import AUTH, DISK, DRAIN, EVENT_READS, EVENT_WAITERS, SLAB, SNAPSHOTS
from .replies import JSON
from .tenants import Tenant

#: The longest a ``GET /kv/events`` waits (a larger ``wait`` is clamped to it).
MAX_WAIT_S = 30.0
#: Entries one answer carries by default, and at most.
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10000
#: The most bytes of events one answer carries (it is written whole, and a client that
#: does not read it pins it: 10,000 events of 256-character addresses were 4 MiB); the
#: answer's ``next`` says where the rest begins. One event always goes.
ANSWER_BYTES = 1024 * 1024
#: Waiting readers per worker, and of one namespace on a worker; one more gets 503.
MAX_WAITERS = 64
MAX_WAITERS_PER_NAMESPACE = 16
#: Reads of the log in flight (between their steps) per worker, and of one namespace.
MAX_READS, MAX_READS_PER_NAMESPACE = 4, 2
#: Snapshots in flight per worker, and of one namespace.
MAX_SNAPSHOTS, MAX_SNAPSHOTS_PER_NAMESPACE = 4, 2
#: Log entries one step of a read looks at: each step holds the loop for under a ms here
#: (a whole read held it for 81-150 ms); a request that needs several turns of the loop
#: (a new connection) waits for a step of each read in flight at each turn.
READ_STEP = 256
#: The snapshot's answer: one JSON object per line (see the module docstring).
SNAPSHOT_TYPE = "application/x-ndjson"
#: How often a waiter looks at the log: first, and at most (it backs off in between).
POLL_MIN_S = 0.005
POLL_MAX_S = 0.05


def event_gates(tenants_mode: bool) -> tuple[Gate, Gate, Gate]:
    """This worker's gates of the log's reads, its waiters and its snapshots.

    The per-namespace caps keep one tenant from taking another's slots: without a tokens
    file (``tenants_mode`` False) there is one namespace and every client reads as the
    admin view, so they would cap the whole worker below its own figures: the worker's
    caps apply alone then.
    """

    def gate(what: str, per_worker: int, per_namespace: int) -> Gate:
        return Gate(what, per_worker, per_namespace if tenants_mode else per_worker)

    return (
        gate("read the event log", MAX_READS, MAX_READS_PER_NAMESPACE),
        gate("wait for events", MAX_WAITERS, MAX_WAITERS_PER_NAMESPACE),
        gate("take a snapshot", MAX_SNAPSHOTS, MAX_SNAPSHOTS_PER_NAMESPACE),
    )


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


def _event_text(ev: Event, names: dict[int, str] | None, seq: bool = True) -> str:
    """One event as its JSON object (formatted directly: a dict and ``json.dumps`` per
    event cost twice as much, most of a read's time); without its ``seq`` in a snapshot."""
    text = (
        (f'{{"seq": {ev.seq}, ' if seq else "{")
        + f'"kind": "{KINDS.get(ev.kind, "?")}", "reason": "{REASONS.get(ev.reason, "?")}", '
        f'"hash": {json.dumps(ev.address.decode("ascii", "replace"))}, "length": {ev.length}'
    )
    if ev.engine.hash:  # the engine's name for it (eg_kv.engine), as the PUT gave it
        text += f', "engine_hash": "{ev.engine.hash.hex()}"'
    if names is None:
        return text + "}"
    return f'{text}, "namespace": {_name_text(names, ev.ns)}}}'


def _name_text(names: dict[int, str], ns: int) -> str:
    """Namespace ``ns``'s name as a JSON string (an id it has no name for: ``id:<n>``)."""
    return json.dumps(names.get(ns, f"id:{ns}"))


def _names(request: web.Request, tenant: Tenant) -> dict[int, str] | None:
    """Namespace names by id for an admin of a tokens file (None otherwise)."""
    auth = request.app[AUTH]
    if not (tenant.is_admin and auth.tenants_mode and auth.table is not None):
        return None
    return {t.ns: t.namespace for t in auth.table.by_digest.values()}


async def get_events(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/events``: the log after ``since`` (see the module docstring).

    Raises:
        BadRequest: a bad argument. NotFound: no event log. Busy: too many reads or
        waiters, on this worker or of this namespace. ConnectionResetError: the client
        left (nobody to answer).
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
        return _answer(request, ring, [], _newest(ring, ns), True, wait)
    with request.app[EVENT_READS].admit(ns):
        events, nxt, gap = await _read(request, ring, since, limit, ns, names)
    if events or gap or wait <= 0:
        return _answer(request, ring, events, nxt, gap, wait)
    with request.app[EVENT_WAITERS].admit(ns):
        drain, deadline, pause = request.app[DRAIN], time.monotonic() + wait, POLL_MIN_S
        while not drain.draining:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(pause, left))
            if client_gone(request):  # its slot is free for a reader that is still there
                raise ConnectionResetError("the reader left while it waited")
            pause = min(pause * 2, POLL_MAX_S)
            if _newest(ring, ns) <= nxt:
                continue
            try:
                with request.app[EVENT_READS].admit(ns):
                    events, nxt, gap = await _read(request, ring, nxt, limit, ns, names)
            except Busy:  # other reads of this namespace walk the log now: look again
                continue
            if events or gap:
                break
    return _answer(request, ring, events, nxt, gap, wait)


async def _read(
    request: web.Request,
    ring: EventRing,
    since: int,
    limit: int,
    ns: int | None,
    names: dict[int, str] | None,
) -> tuple[list[str], int, bool]:
    """The log after ``since`` as JSON texts, one per event, in steps of
    :data:`READ_STEP` entries with the loop free in between (at most
    :data:`~eg_kv.slab.events.SCAN_MAX` entries looked at in all).

    Returns:
        ``(events, next, gap)`` as :meth:`EventRing.read` (a gap after some events
        returns those: the next read finds it).

    Raises:
        ConnectionResetError: the client left between two steps.
    """
    out: list[str] = []
    nxt, budget, room = since, SCAN_MAX, ANSWER_BYTES
    at = (0, 0) if ns is None else ring.ns_position(ns)  # one view of the namespace's log
    if since == _newest(ring, ns, at):
        return out, since, False  # nothing new: no work, no turn of the loop
    # In flight before any work: a burst of reads meets the gate (503), not the loop, and
    # a read whose client already left costs nothing.
    await asyncio.sleep(0)
    if client_gone(request):
        raise ConnectionResetError("the reader left before its read")
    # One namespace's entries: its links walked back once, then read a step at a time.
    steps = None if ns is None else ring.read_ns_steps(since, limit, READ_STEP, ns, at)
    while True:
        if steps is None:  # every namespace's entries, by seq
            step = min(READ_STEP, budget)
            events, after, gap = ring.read(nxt, limit - len(out), None, step)
            budget -= after - nxt
        else:  # one namespace's, by its positions
            events, after, gap = next(steps, ([], nxt, False))
        if gap:
            return (out, nxt, False) if out else ([], after, True)
        texts = [_event_text(ev, names) for ev in events]
        ends = list(itertools.accumulate(len(t) + 2 for t in texts))  # and ", "
        fit = bisect.bisect_right(ends, room) or int(not out)
        if fit < len(texts):  # the answer is full: it ends after the last that fits
            out += texts[:fit]
            if fit:
                nxt = events[fit - 1].seq if steps is None else nxt + fit
            return out, nxt, False
        out += texts
        room -= ends[-1] if ends else 0
        done = after == nxt or len(out) >= limit or budget <= 0 or after >= _newest(ring, ns, at)
        nxt = after
        if done:
            return out, nxt, False
        await asyncio.sleep(0)  # a long read shares the loop with every other request
        if client_gone(request):
            raise ConnectionResetError("the reader left during its read")


def _newest(ring: EventRing, ns: int | None, at: tuple[int, int] | None = None) -> int:
    """The newest position in the log as namespace ``ns``'s reader counts (None: seq);
    ``at``: the namespace's position as the caller read it already."""
    if ns is None:
        return ring.head
    return (at or ring.ns_position(ns))[0]


def _answer(
    request: web.Request,
    ring: EventRing,
    events: list[str],
    nxt: int,
    gap: bool,
    wait: float,
) -> web.StreamResponse:
    """The answer, ``events`` being each event's JSON already."""
    body = (
        f'{{"epoch": "{_epoch_text(ring)}", "events": [{", ".join(events)}], '
        f'"next": {nxt}, "gap": {json.dumps(gap)}, "wait": {json.dumps(wait)}}}'
    )  # "wait" as clamped: the most this answer could have waited
    return reply(request, 200, body.encode(), JSON)


async def get_snapshot(request: web.Request, tenant: Tenant) -> web.StreamResponse:
    """``GET /kv/events/snapshot``: the blocks held (the tenant's namespace's, or every
    namespace's for an admin), streamed as NDJSON (:data:`SNAPSHOT_TYPE`, the module
    docstring): the walk goes slice by slice on a thread
    (:meth:`~eg_kv.slab.events.SlabEventLog.snapshot_stream`), each slice written before
    the next is walked, so the worker holds one slice at a time, whatever the slab.

    Raises:
        NotFound: no event log. Busy: too many snapshots in flight, on this worker or of
        this namespace, or the walk met a repair before it answered. ConnectionResetError:
        the client left (nobody to answer).
    """
    slab = request.app[SLAB]
    ring = _ring(slab)
    names = _names(request, tenant)
    ns = _scope(request, tenant)
    with request.app[SNAPSHOTS].admit(ns):
        await asyncio.sleep(0)  # in flight before any work: a burst meets the gate
        if client_gone(request):
            raise ConnectionResetError("the reader left before its snapshot")
        loop = asyncio.get_running_loop()
        parts = slab.snapshot_stream(ns)
        resp: web.StreamResponse | None = None
        try:
            while (part := await loop.run_in_executor(None, next, parts, None)) is not None:
                if resp is None:  # answered once the walk has begun: errors before are 4xx/5xx
                    resp = label(web.StreamResponse(headers={"Content-Type": SNAPSHOT_TYPE}))
                    await resp.prepare(request)
                    await resp.write(f'{{"epoch": "{ring.epoch:016x}"}}\n'.encode())
                if part.kind == "end":  # the disk tier's blocks, before the end line
                    await _write_disk_blocks(request, tenant, resp, names is not None)
                await resp.write(_part_lines(part, names))
                if client_gone(request):
                    raise ConnectionResetError("the reader left during its snapshot")
        except SnapshotVoid as e:
            if resp is None:
                raise Busy(f"{e}; take it again") from None
            await resp.write(f'{{"error": "{e}; take it again"}}\n'.encode())
        finally:
            parts.close()
        assert resp is not None  # a stream always has its end part
        await resp.write_eof()
        return resp


async def _write_disk_blocks(
    request: web.Request, tenant: Tenant, resp: web.StreamResponse, named: bool
) -> None:
    """With a disk tier, the blocks only the disk holds, as block lines (a block in both
    tiers is listed twice: a set of blocks, not a count). Listed after the slab's walk,
    so a block the disk dropped meanwhile is gone from both (its removal is in the log
    after the snapshot's ``seq``)."""
    tier = request.app.get(DISK)
    if tier is None:
        return
    scope = None if tenant.is_admin else tenant.namespace
    async for page in tier.listing(scope):
        lines = [
            f'{{"hash": {json.dumps(address)}, "length": {length}'
            + (f', "namespace": {json.dumps(ns)}}}' if named else "}")
            for ns, address, length, *_ in page
        ]
        await resp.write("".join(line + "\n" for line in lines).encode())
        if client_gone(request):
            raise ConnectionResetError("the reader left during its snapshot")


def _part_lines(part: SnapshotPart, names: dict[int, str] | None) -> bytes:
    """A snapshot part as NDJSON lines: a block per line, an event per line (with its
    ``kind``), or the end (``seq``)."""
    if part.kind == "end":
        return f'{{"seq": {part.position}}}\n'.encode()
    lines: list[str]
    if part.kind == "events":
        lines = [_event_text(ev, names, seq=False) for ev in part.events]
    else:
        lines = [
            f'{{"hash": {json.dumps(raw.decode("ascii", "replace"))}, "length": {length}'
            + ("}" if names is None else f', "namespace": {_name_text(names, ns)}}}')
            for ns, raw, length in part.blocks
        ]
    return "".join(line + "\n" for line in lines).encode()
