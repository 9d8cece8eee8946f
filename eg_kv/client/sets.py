"""A server set as one cache, for threads: :class:`SetConnector`.

It has the methods of the single-server client (:class:`~eg_kv.client.sync.ServerConnector`)
and is what ``RemoteKVConnector`` (:mod:`eg_kv.client.connectors`) builds when ``base_url``
names a set (a list, a ``dns+`` or ``dnssrv+`` URL; :mod:`eg_kv.client.members`). A set of
one plain URL never comes here: the direct client serves it at today's cost.

The plans (placement, the batch's split, merge, deadline and straggler cut, the fall-through
to the previous home, health and probes) are :mod:`eg_kv.client.router`'s; this module does
the I/O around them: one :class:`~eg_kv.client.sync.ServerConnector` per member, a batch's
groups sent on a pool of :data:`MAX_FANOUT_THREADS` threads. Its asyncio twin is
:mod:`eg_kv.client.aio_sets`.

Standard library only for a list of URLs; dnspython only for a DNS entry.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..engine import NO_ENGINE, EngineName
from .bodies import byte_views
from .events import DEFAULT_LIMIT as DEFAULT_EVENTS_LIMIT
from .events import EventBatch, Snapshot
from .lease_homes import NOT_NOTED, delete_answer
from .membership import View
from .placement import prefix_hits
from .rounds import Ask, BatchPlan, Waiting, fetch_steps
from .router import (
    MemberConnectors,
    Router,
    absent,
    set_health,
)
from .rules import KvCacheStats, batches, capped, to_address, to_addresses
from .setstats import MemberStats, member_line, set_stats
from .settings import KvCacheConfig
from .sync import ServerConnector, member_connector

T = TypeVar("T")

#: Threads of the sync connector that send a batch's groups in parallel.
MAX_FANOUT_THREADS = 16


class SetConnector:
    """A server set behind the :class:`~eg_kv.client.sync.ServerConnector` interface.

    Thread-safe, a context manager. Hot-path methods never raise (a miss); ``stats()``
    sums the members that answered and raises :class:`RemoteError` when none did.
    """

    def __init__(self, config: KvCacheConfig) -> None:
        """Args:
            config: the set's config (``base_url`` a list or DNS URL).

        Raises:
            ConfigError: the setting does not parse.
        """
        self.config = config
        self._router = Router(config, member_connector)
        self._members = MemberConnectors(self._router, member_connector)
        self._router.listeners.append(self._members.prune)
        self._fanout = ThreadPoolExecutor(MAX_FANOUT_THREADS, thread_name_prefix="eg-kv-fanout")
        self._closed = False

    @classmethod
    def from_env(cls, **settings: Any) -> SetConnector:
        """A set connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings))

    def __repr__(self) -> str:
        members = len(self._router.view().members)
        return f"SetConnector({self.config.base_url!r}, {members} members)"

    def __enter__(self) -> SetConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def router(self) -> Router:
        return self._router

    def close(self) -> None:
        """Stop the background threads and close every member's connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._router.close()
        self._fanout.shutdown(wait=False, cancel_futures=True)
        for conn in self._members.take_all():
            conn.close()

    # -- one address

    def _home_of(self, key: str | bytes) -> tuple[View, str, str] | None:
        """(the view, ``key``'s home in it, its address); None once closed or with no
        member up."""
        address = to_address(key)
        if self._closed:
            return None
        view, home = self._router.home(address)
        return None if home is None else (view, home, address)

    def _one(self, key: str | bytes, op: Callable[[Any, str], T], miss: Callable[[T], bool],
             ask_previous: bool = True,
             may_start: Callable[[float], bool] | None = None) -> T | None:  # fmt: skip
        at = self._home_of(key)
        if at is None:
            return None
        view, home, address = at
        result = op(self._members.get(view, home), address)
        if ask_previous and miss(result):
            before = self._router.previous(view, address, home)
            # The second request gets a fresh timeout_s: it starts only if the caller's
            # deadline still has room for all of it.
            if before is not None and (may_start is None or may_start(self.config.timeout_s)):
                return op(self._members.get(view, before), address)
        return result

    def fetch(self, key: str | bytes, sink: Callable[..., T],
              may_start: Callable[[float], bool] | None = None,
              release_lease: bool = False, timeout_s: float | None = None) -> T | None:  # fmt: skip
        """``GET`` the block from its home (see :meth:`ServerConnector.fetch`).

        Args:
            key: the block's key or address.
            sink: the body's reader.
            may_start: ``may_start(timeout_s)``: whether a request bounded by ``timeout_s``
                may still start now (:meth:`eg_kv.lmcache.write_gate.WriteGate.can_start`); asked
                before the previous home is, after a miss at the home.
            release_lease: then end one of the caller's leases on the block, at the
                member that granted it (:meth:`release`; a GET's header would end it at
                the members asked: another client's, where the lease was not taken).
            timeout_s: one deadline for both requests, when shorter than the config's
                (:func:`~eg_kv.client.rounds.fetch_steps`).
        """
        bound = capped(timeout_s, self.config.timeout_s)
        op, gate = fetch_steps(sink, may_start, bound)
        got = self._one(key, op, lambda r: r is None, may_start=gate)
        if release_lease:
            self.release([key])
        return got

    get = ServerConnector.get
    get_into = ServerConnector.get_into
    put = ServerConnector.put
    put_parts = ServerConnector.put_parts

    def put_status(
        self, key: str | bytes, parts: Iterable[Any], engine: EngineName = NO_ENGINE,
        timeout_s: float | None = None,
    ) -> int | None:  # fmt: skip
        """``PUT`` at the address's home (its next-ranked member while it is down); the
        member is noted for a DELETE of the reference (:meth:`delete_status`).
        ``timeout_s``: the PUT's deadline, when shorter than the config's."""
        parts = byte_views(parts)  # TypeError: not a miss
        at = self._home_of(key)
        if at is None:
            return None
        view, home, address = at
        status = self._members.get(view, home).put_status(address, parts, engine, timeout_s)
        self._router.put_homes.stored(address, home, status)
        return status

    def contains(self, key: str | bytes) -> bool:
        """``HEAD`` at the home (and the previous home once, right after a change)."""
        return bool(self._one(key, lambda c, a: c.contains(a), lambda r: not r))

    def exists(self, key: str | bytes) -> bool:
        """``GET /exists`` at the home (and the previous home once after a change)."""
        return bool(self._one(key, lambda c, a: c.exists(a), lambda r: not r))

    def delete(self, key: str | bytes) -> bool:
        """``DELETE`` one reference where the block lives (see :meth:`delete_status`)."""
        return self.delete_status(key) == 204

    def delete_status(self, key: str | bytes) -> int | None:
        """``DELETE`` one reference: at the member one of this set's PUTs stored it at
        (:meth:`Router.delete_home`: its home may be another now, whose reference is
        another client's); else where the block lives: its home, else (right after a
        change, and only when the home answered 404) its previous home. A lost answer is
        not sent on: the member may have applied it, and one DELETE releases one
        reference, never two."""
        address = to_address(key)
        if self._closed:
            return None
        view, where = self._router.delete_home(address)
        if where == NOT_NOTED:
            return self._one(key, lambda c, a: c.delete_status(a), absent)
        if where not in view.members:  # noted at a member down now, or gone
            return delete_answer(where)
        status = self._members.get(view, where).delete_status(address)
        self._router.put_homes.delete_answered(address, where, status)
        return status

    # -- batches

    def _ask(
        self, ask: Ask, member_id: str, part: list[str], lease_ms: int | None = None
    ) -> list[bool] | None:
        """One member's share of a batch: a request per 1,024 addresses, each bounded by
        what is left of the batch's deadline (:meth:`Ask.timeout`). None when one failed.
        ``lease_ms``: the member leases its hits."""
        conn = self._members.get(ask.view, member_id)
        out: list[bool] = []
        lease = {"lease_ms": lease_ms} if lease_ms else {}
        try:
            for n, chunk in enumerate(batches(part)):
                timeout_s = ask.timeout(first=n == 0)
                found = (
                    conn.try_exists_addresses(chunk, **lease)
                    if timeout_s is None
                    else conn.try_exists_addresses(chunk, timeout_s=timeout_s, **lease)
                )
                if found is None:
                    return None
                out.extend(found)
        except TimeoutError:
            return None
        return out

    def _parallel(self, ask: Ask, lease_ms: int | None = None) -> dict[str, list[bool] | None]:
        """A round's lookups, one request per member, in parallel threads, all answered by
        the batch's deadline; a member still out when the round stops waiting for it
        (:class:`~eg_kv.client.rounds.Waiting`) is missing from the answer and marked
        down. One group is sent from the caller's thread (nothing to wait for beside it)."""
        jobs = ask.jobs()
        if len(jobs) <= 1:
            return {m: self._ask(ask, m, part, lease_ms) for m, part in jobs}
        wait = Waiting(self._router, ask.deadline)
        began: dict[str, float] = {}  # when each job left the shared pool's queue

        def run(m: str, part: list[str]) -> list[bool] | None:
            began[m] = time.monotonic()
            return self._ask(ask, m, part, lease_ms)

        pending = {self._fanout.submit(run, m, part): m for m, part in jobs}
        out: dict[str, list[bool] | None] = {}
        while pending:
            done, _ = concurrent.futures.wait(
                pending, timeout=wait.timeout(), return_when=concurrent.futures.FIRST_COMPLETED
            )
            if not done:
                break
            for future in done:
                out[pending.pop(future)] = got = future.result()
                wait.answered(got)
        if pending:
            # One still queued is never sent, one sent late in the round had under half
            # of it: the queue is this client's (its callers share the pool), not the
            # member's fault.
            now, half = time.monotonic(), wait.elapsed() / 2
            late = [m for f, m in pending.items()
                    if not f.cancel() and now - began.get(m, now) >= half]  # fmt: skip
            wait.give_up(late)
            for m in late:  # their requests would hold the shared threads a timeout_s each
                self._members.get(ask.view, m)._abort_in_flight()
        return out

    def _lookup(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
    ) -> tuple[list[bool], bool]:
        """(one bool per address in the caller's order, whether any member answered).
        ``lease_ms``: each member leases its hits (its part of the batch)."""
        if self._closed or not addresses:
            return [False] * len(addresses), not self._closed
        plan = BatchPlan(self._router, addresses, timeout_s, lease_ms)
        try:
            for ask in plan:
                plan.take(self._parallel(ask, lease_ms))
        except (RuntimeError, concurrent.futures.CancelledError):
            # close() shut the fan-out pool down (submit raises RuntimeError) or cancelled
            # a group still queued (its result() raises CancelledError): all misses.
            return [False] * len(addresses), False
        return plan.found, plan.answered

    def exists_many(self, keys: Sequence[str | bytes], lease_ms: int | None = None) -> list[bool]:
        """One bool per key; each member asked once (per 1024 keys), in parallel.
        ``lease_ms``: each member leases the hits of its part
        (:meth:`ServerConnector.exists_many`)."""
        return self._lookup(to_addresses(keys), lease_ms=lease_ms)[0]

    def try_exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool] | None:
        """:meth:`exists_many`, or None when no member could be asked."""
        return self.try_exists_addresses(to_addresses(keys), lease_ms=lease_ms)

    def try_exists_addresses(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
        local_only: bool = False,
    ) -> list[bool] | None:
        """Like :meth:`ServerConnector.try_exists_addresses`; a member that failed costs
        its share (its addresses are misses); None only when no member answered.

        Args:
            timeout_s: the batch's one deadline, when shorter than the config's.
            lease_ms: each member leases the hits of its part.
            local_only: None, at once (a set answers from its members, over HTTP).
        """
        if local_only:
            return None
        found, answered = self._lookup(list(addresses), timeout_s, lease_ms)
        return found if answered else None

    def contains_prefix(self, keys: Sequence[str | bytes], lease_ms: int | None = None) -> int:
        """Prefix hits over the merged answer, whichever member holds each key.
        ``lease_ms``: the prefix's blocks are leased; hits past it are released."""
        addresses = to_addresses(keys)
        found = self._lookup(addresses, lease_ms=lease_ms)[0]
        prefix = prefix_hits(found)
        if lease_ms and any(found[prefix:]):
            self.release(
                [a for a, hit in zip(addresses[prefix:], found[prefix:], strict=True) if hit]
            )
        return prefix

    def release(self, keys: Sequence[str | bytes]) -> int:
        """End one lease on each key's block at the member that granted it, else at its
        home (one ``POST /kv/batch/release`` per member, in parallel;
        :mod:`eg_kv.client.lease_homes`). A lease granted by a member that left or is
        down now ends on its own. Never raises.

        Returns:
            How many leases were released.
        """
        if self._closed:
            return 0
        view, by_home = self._router.release_homes(keys)
        try:
            done = self._fanout.map(
                lambda job: self._members.get(view, job[0]).release(job[1]), by_home.items()
            )
            return sum(done)
        except (RuntimeError, concurrent.futures.CancelledError):  # close() shut it down
            return 0

    def events(
        self, since: int = 0, wait: float = 0.0, limit: int = DEFAULT_EVENTS_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch:  # fmt: skip
        """The event log of a set of one member (a ``dnssrv+`` name that resolves to one
        server): that server's; see :meth:`ServerConnector.events
        <eg_kv.client.sync.ServerConnector.events>`.

        Raises:
            ConfigError: the set has several members (each keeps its own log: follow
                each member's URL); else as ``ServerConnector.events``.
        """
        return self._members.get(*self._router.only_member()).events(since, wait, limit, epoch)

    def snapshot(self) -> Snapshot:
        """The snapshot of a set of one member: see :meth:`events`."""
        return self._members.get(*self._router.only_member()).snapshot()

    # -- the set

    @property
    def checksum_failures(self) -> int:
        """Blocks any member's answer failed their checksum (each a miss)."""
        return self._members.checksum_failures.count

    @property
    def forged_blocks(self) -> int:
        """Blocks any member's answer failed their block-key tag (each a miss)."""
        return self._members.forged_blocks.count

    def member_stats(self) -> list[MemberStats]:
        """Each member's stats (in parallel), sorted by member id."""
        if self._closed:  # nothing is asked of a member after close()
            return []
        view = self._router.view()

        def one(member_id: str) -> MemberStats:
            return member_line(view.members[member_id], self._members.get(view, member_id).stats)

        ids = list(view.placement.members)
        return list(self._fanout.map(one, ids)) if ids else []

    def stats(self) -> KvCacheStats:
        """The sum over the members that answered.

        Raises:
            RemoteError: no member answered (the first member's error is named).
        """
        return set_stats(self.member_stats())

    def healthz(self) -> dict[str, Any] | None:
        """``{"status": "ok", "members": K, "members_up": k}`` while a member is up."""
        if self._closed:
            return None
        view, up = self._router.up()
        try:  # in parallel, each bounded by its timeout_s: one hung member costs one
            futures = [self._fanout.submit(self._members.get(view, m).healthz) for m in up]
        except RuntimeError:  # close() shut the pool down
            return None
        done, _ = concurrent.futures.wait(futures, timeout=self.config.timeout_s + 1.0)
        answered = [m for m, f in zip(up, futures, strict=True)
                    if f in done and not f.cancelled() and f.result() is not None]  # fmt: skip
        return set_health(view, answered) if answered else None


#: The name this class had before the set connectors were named for what they serve.
ClusterConnector = SetConnector
