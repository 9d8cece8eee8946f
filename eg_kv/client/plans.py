"""The calls that take several requests, written once as plans both connectors drive.

A plan is a generator that does no I/O: it yields each request it needs as a step
(:class:`Mapped`, :class:`Batch`, :class:`Release`, :class:`GetJson`,
:class:`GetSnapshot`) and is sent the answer, or thrown the error, by a driver:
:func:`drive` in the sync connector, :func:`drive_async` in the async one, each answering
a step with its own transport (the way h11 leaves the socket to its caller). So the rules
of a batch lookup (local or over HTTP, compact or JSON, split at 1,024 addresses, a failed
batch is a miss or the end of a prefix, the hits past a prefix give their leases back) and
of the JSON routes and the snapshot (which errors raise, which are misses) exist once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from ..errors import EgKvError, InvalidAddress
from ..wire import BATCH_EXISTS_MAX, EVENTS_PATH, EVENTS_SNAPSHOT_PATH, HEALTHZ_PATH, STATS_PATH
from .core import ClientCore
from .events import EventBatch, Snapshot, events_target, parse_events
from .rules import CompactRefused, KvCacheStats, batch_answer, batches, leading_hits

T = TypeVar("T")


class Mapped(NamedTuple):
    """The server's slab as mapped here (answered with it, or None off its host);
    ``probe``: ask the server where it is, if that is due, before answering."""

    probe: bool


#: The two :class:`Mapped` steps, made once.
PROBE, NO_PROBE = Mapped(True), Mapped(False)


class Batch(NamedTuple):
    """One ``POST /kv/batch/exists`` (at most 1,024 addresses) as it is sent: in the
    compact format, answered ``(flags, refused)``, or in JSON, answered ``(document,
    refused)``; ``refused``: the server answered a leasing lookup's hits unleased."""

    addresses: list[str]
    compact: bool
    timeout_s: float | None = None
    lease_ms: int | None = None


class Release(NamedTuple):
    """One ``POST /kv/batch/release`` (at most 1,024 addresses); answered with a flag per
    address (a lease ended)."""

    addresses: list[str]


class GetJson(NamedTuple):
    """One ``GET`` of a JSON route (``target``, prefixed); answered with the decoded body."""

    target: str
    timeout_s: float | None = None


class GetSnapshot(NamedTuple):
    """One ``GET /kv/events/snapshot`` (``target``, prefixed); answered with the parsed
    :class:`~eg_kv.client.events.Snapshot` (each client reads the stream its own way)."""

    target: str


Step = Mapped | Batch | Release | GetJson | GetSnapshot
Plan = Generator[Step, Any, T]


def _advance(plan: Plan[T], got: Any, failed: BaseException | None) -> tuple[bool, Any]:
    """Hand ``plan`` its last answer (or error): (True, its result) once it is done, else
    (False, its next step)."""
    try:
        return False, plan.throw(failed) if failed is not None else plan.send(got)
    except StopIteration as done:
        return True, done.value


def drive(plan: Plan[T], answer: Callable[[Step], Any]) -> T:
    """Run ``plan``, doing each of its steps with ``answer(step)``; what ``answer`` raises
    goes back into the plan (which decides: a miss, or raise)."""
    got, failed = None, None
    while True:
        done, step = _advance(plan, got, failed)
        if done:
            return step  # type: ignore[no-any-return]
        try:
            got, failed = answer(step), None
        except Exception as exc:
            got, failed = None, exc


async def drive_async(plan: Plan[T], answer: Callable[[Step], Awaitable[Any]]) -> T:
    """:func:`drive` for the async connector (``answer`` is a coroutine function)."""
    got, failed = None, None
    while True:
        done, step = _advance(plan, got, failed)
        if done:
            return step  # type: ignore[no-any-return]
        try:
            got, failed = await answer(step), None
        except Exception as exc:  # asyncio.TimeoutError included
            got, failed = None, exc


# --------------------------------------------------------------------------- lookups


def lookup(
    core: ClientCore, addresses: list[str], timeout_s: float | None, lease_ms: int | None
) -> Plan[tuple[list[bool], int]]:
    """One lookup of at most 1,024 addresses: a flag per address and the leading hits.
    Raises on error.

    On the server's host it is answered from its slab. Otherwise it is one ``POST
    /kv/batch/exists`` in the compact format (:mod:`eg_kv.wire`); a server that refuses
    it (one that predates it) is asked again in JSON, and in JSON from then on. A lease
    is the server's to take (``X-Eg-Kv-Lease-Ms``), so a leasing lookup asks it, unless
    the slab says every address is a miss: there is nothing to lease then, and the usual
    answer of a prompt nobody has computed stays a local one. Hits the server answered
    unleased (a cap) are noted, so that their releases are not sent.
    """
    # Asked of the connector (which probes the server for it when that is due) only while
    # none is mapped: a lookup on the server's host takes ~10 µs, a step a tenth of that.
    slab = core.local.slab
    if slab is None:
        slab = yield PROBE if timeout_s is None else NO_PROBE  # mapped for the loads even so
    found = core.local_lookup(slab, addresses, lease_ms)
    if found is not None:
        return found, leading_hits(found)
    if core.compact_batches:
        try:
            flags, refused = yield Batch(addresses, True, timeout_s, lease_ms)
            answer = flags, leading_hits(flags)
        except CompactRefused:
            answer, refused = yield from _json_lookup(addresses, timeout_s, lease_ms)
            core.compact_batches = False  # JSON worked where the compact body did not
    else:
        answer, refused = yield from _json_lookup(addresses, timeout_s, lease_ms)
    if refused:
        core.note_unleased(addresses, answer[0])
    return answer


def _json_lookup(
    addresses: list[str], timeout_s: float | None, lease_ms: int | None
) -> Plan[tuple[tuple[list[bool], int], bool]]:
    doc, refused = yield Batch(addresses, False, timeout_s, lease_ms)
    return batch_answer(doc, len(addresses)), refused


def _try_batch(
    core: ClientCore, chunk: list[str], timeout_s: float | None, lease_ms: int | None
) -> Plan[list[bool] | None]:
    try:
        found, _prefix = yield from lookup(core, chunk, timeout_s, lease_ms)
    except Exception as exc:
        core.miss("batch/exists", f"[{len(chunk)} addresses]", exc)
        return None
    return found


def exists_many(core: ClientCore, addresses: list[str], lease_ms: int | None) -> Plan[list[bool]]:
    """A flag per address, one batch per 1,024; a batch that failed is all misses."""
    out: list[bool] = []
    for chunk in batches(addresses):
        found = yield from _try_batch(core, chunk, None, lease_ms)
        out.extend(found if found is not None else [False] * len(chunk))
    return out


def try_exists(
    core: ClientCore,
    addresses: Sequence[str],
    timeout_s: float | None,
    lease_ms: int | None,
    local_only: bool = False,
) -> Plan[list[bool] | None]:
    """A flag per address, or None when any batch failed ("could not ask"). With
    ``local_only``: answered from the slab mapped here, or None with no lookup sent (a
    caller that cannot wait for a request, and must not send a leasing one twice)."""
    if local_only:
        slab = core.local.slab  # asked of the connector only while none is mapped (lookup())
        if slab is None:
            slab = yield NO_PROBE
        if slab is None or len(addresses) > BATCH_EXISTS_MAX:
            return None
        try:
            return core.local_lookup(slab, list(addresses), lease_ms)
        except InvalidAddress:
            return None
    out: list[bool] = []
    for chunk in batches(addresses):
        found = yield from _try_batch(core, chunk, timeout_s, lease_ms)
        if found is None:
            return None
        out.extend(found)
    return out


def contains_prefix(core: ClientCore, addresses: list[str], lease_ms: int | None) -> Plan[int]:
    """The leading hits without a gap; a failed batch ends the prefix. With ``lease_ms``,
    the hits past the prefix, which no one will load, give their leases back at once."""
    total = 0
    for chunk in batches(addresses):
        try:
            found, prefix = yield from lookup(core, chunk, None, lease_ms)
        except Exception as exc:
            core.miss("batch/exists", f"[{len(chunk)} addresses]", exc)
            return total
        total += prefix
        if prefix < len(chunk):
            if lease_ms:
                extra = zip(chunk[prefix:], found[prefix:], strict=True)
                yield from release(core, [a for a, hit in extra if hit])
            break
    return total


def release(core: ClientCore, addresses: list[str]) -> Plan[int]:
    """End one lease on each address's block: here for a lease this client took on the
    local slab (no request), else one batch per 1,024. Returns the leases ended; a batch
    that failed counts 0."""
    released, remote = core.local_release(addresses)
    for chunk in batches(remote):
        try:
            found = yield Release(chunk)
        except Exception as exc:
            core.miss("batch/release", f"[{len(chunk)} addresses]", exc)
            continue
        released += sum(found)
    return released


# --------------------------------------------------------------------------- JSON routes


def _read(core: ClientCore, route: str, step: GetJson | GetSnapshot | None = None) -> Plan[Any]:
    """The answer to ``step`` (default: ``GET route``'s JSON); our own errors (401 among
    them) raise as they are, any other failure as :class:`~eg_kv.errors.RemoteError`
    naming the route."""
    try:
        return (yield step or GetJson(core.path(route)))
    except EgKvError:
        raise
    except Exception as exc:
        raise core.unreachable(route, exc) from None


def stats(core: ClientCore) -> Plan[KvCacheStats]:
    """``GET /kv/stats``, checked (raises as :func:`_read`)."""
    return KvCacheStats.from_json((yield from _read(core, STATS_PATH)))


def healthz(core: ClientCore) -> Plan[dict[str, Any] | None]:
    """``GET /healthz``'s answer, or None when the server is not healthy (never raises)."""
    try:
        doc = yield GetJson(core.path(HEALTHZ_PATH))
    except Exception as exc:
        core.miss("healthz", "-", exc)
        return None
    return doc if isinstance(doc, dict) else None


def events(
    core: ClientCore, since: int, wait: float, limit: int, epoch: str | None
) -> Plan[EventBatch]:
    """``GET /kv/events`` (waiting up to ``wait`` seconds for an event), parsed."""
    step = GetJson(
        core.path(events_target(since, wait, limit, epoch)), wait + core.config.timeout_s
    )
    return parse_events((yield from _read(core, EVENTS_PATH, step)))


def snapshot(core: ClientCore) -> Plan[Snapshot]:
    """``GET /kv/events/snapshot``: the blocks held and the log's seq they match (raises as
    :func:`_read`)."""
    snap: Snapshot = yield from _read(
        core, EVENTS_SNAPSHOT_PATH, GetSnapshot(core.path(EVENTS_SNAPSHOT_PATH))
    )
    return snap
