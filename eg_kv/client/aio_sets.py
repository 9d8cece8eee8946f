"""A server set as one cache, for asyncio: :class:`AsyncSetConnector`.

The async twin of :class:`eg_kv.client.sets.SetConnector`: the same plans
(:mod:`eg_kv.client.router`: placement, a batch's split, merge, deadline and straggler cut,
the fall-through to the previous home; its membership and probe threads run beside the
loop, probing with the sync client), with requests sent on the caller's loop by one
:class:`~eg_kv.client.aio.AsyncServerConnector` per member and a batch's groups gathered in
parallel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ..engine import NO_ENGINE, EngineName
from .aio import AsyncServerConnector
from .bodies import byte_views
from .events import DEFAULT_LIMIT as DEFAULT_EVENTS_LIMIT
from .events import EventBatch, Snapshot
from .interface import AsyncSink, Unreachable
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
from .rules import KvCacheStats, capped, to_address, to_addresses
from .setstats import MemberStats, set_stats
from .settings import KvCacheConfig
from .sync import member_connector

T = TypeVar("T")


class AsyncSetConnector:
    """A server set behind the :class:`~eg_kv.client.aio.AsyncServerConnector` interface.

    Membership, health probes and weighing run in :class:`Router`'s threads; requests run
    on the caller's loop, a batch's groups gathered in parallel.
    """

    def __init__(self, config: KvCacheConfig, *, session: Any = None) -> None:
        """Args:
            config: the set's config.
            session: a caller-owned ``aiohttp.ClientSession`` every member shares.

        Raises:
            ConfigError: the setting does not parse.
        """
        self.config = config
        # Membership's first resolution and weighing (up to a few seconds with a silent
        # member) would block the caller's loop here: the first request awaits it.
        self._router = Router(config, member_connector, wait=False)
        self._started = False
        #: The loop the member connectors (their aiohttp sessions) were built on.
        self._loop: asyncio.AbstractEventLoop | None = None

        def build(cfg: KvCacheConfig, hook: Unreachable) -> AsyncServerConnector:
            self._loop = asyncio.get_running_loop()
            return AsyncServerConnector(cfg, session=session, on_unreachable=hook)

        self._members = MemberConnectors(self._router, build, self._dispose)
        self._router.listeners.append(self._members.prune)
        self._closed = False
        #: Departed members' connectors, closed once their requests are over (their timer).
        self._retired: dict[Any, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Task[Any]] = set()

    def _dispose(self, conn: Any) -> None:
        """Close a departed member's connector on the loop its session lives on (prune
        runs in the membership thread), once the requests in flight on it are over (a
        request is bounded by timeout_s): closed at once, its session ended them (a hit
        about to be answered was a miss, a PUT cut mid-body), where the sync set's finish."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no session was opened on a loop that still runs

        def close_later() -> None:
            self._retired[conn] = loop.call_later(
                self.config.timeout_s + 1.0, self._close_retired, conn
            )

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(close_later)

    def _close_retired(self, conn: Any) -> None:
        if self._retired.pop(conn, None) is not None:
            task = asyncio.ensure_future(conn.close())
            self._closing.add(task)  # held until done: the loop keeps weak references
            task.add_done_callback(self._closing.discard)

    @classmethod
    def from_env(cls, *, session: Any = None, **settings: Any) -> AsyncSetConnector:
        """A set connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings), session=session)

    def __repr__(self) -> str:
        return f"AsyncSetConnector({self.config.base_url!r})"

    async def __aenter__(self) -> AsyncSetConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def router(self) -> Router:
        """The set's router, once its membership started (which a caller reading it
        right after the constructor waits for here, as the sync set's constructor
        does)."""
        self._router.membership.wait_started()
        return self._router

    async def _start(self) -> None:
        """Before the first request: the membership's first refresh, awaited off the
        loop (bounded by its ``start_bound_s``)."""
        if not self._started:
            await asyncio.get_running_loop().run_in_executor(
                None, self._router.membership.wait_started
            )
            self._started = True

    async def close(self) -> None:
        """Stop the background threads and close every member's session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._router.close)
        retired, self._retired = self._retired, {}
        for timer in retired.values():
            timer.cancel()
        for conn in [*self._members.take_all(), *retired]:
            await conn.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _begin(self, key: str | bytes) -> str | None:
        """``key``'s address once the set has started; None once it is closed."""
        address = to_address(key)
        if self._closed:
            return None
        await self._start()
        return address

    async def _home_of(self, key: str | bytes) -> tuple[View, str, str] | None:
        """(the view, ``key``'s home in it, its address); None once closed or with no
        member up."""
        address = await self._begin(key)
        if address is None:
            return None
        view, home = self._router.home(address)
        return None if home is None else (view, home, address)

    async def _one(self, key: str | bytes, op: Callable[[Any, str], Any],
                   miss: Callable[[Any], bool], ask_previous: bool = True,
                   may_start: Callable[[float], bool] | None = None) -> Any:  # fmt: skip
        at = await self._home_of(key)
        if at is None:
            return None
        view, home, address = at
        result = await op(self._members.get(view, home), address)
        if ask_previous and miss(result):
            before = self._router.previous(view, address, home)
            # The second request gets a fresh timeout_s: it starts only if the caller's
            # deadline still has room for all of it.
            if before is not None and (may_start is None or may_start(self.config.timeout_s)):
                return await op(self._members.get(view, before), address)
        return result

    async def fetch(self, key: str | bytes, sink: AsyncSink[T],
                    may_start: Callable[[float], bool] | None = None,
                    release_lease: bool = False, timeout_s: float | None = None,
                    ) -> T | None:  # fmt: skip
        """``GET`` the block from its home (see :meth:`AsyncServerConnector.fetch`); after a
        miss there, right after a change, from its previous home if ``may_start`` allows.
        ``release_lease``: then ends one of the caller's leases at the member that granted
        it (:meth:`release`). ``timeout_s``: one deadline for both requests
        (:func:`~eg_kv.client.rounds.fetch_steps`)."""
        bound = capped(timeout_s, self.config.timeout_s)
        op, gate = fetch_steps(sink, may_start, bound)
        got = await self._one(key, op, lambda r: r is None, may_start=gate)
        if release_lease:
            await self.release([key])
        return got

    async def get(self, key: str | bytes, release_lease: bool = False) -> bytes | None:
        got = await self._one(key, lambda c, a: c.get(a), lambda r: r is None)
        if release_lease:
            await self.release([key])
        return got

    get_into = AsyncServerConnector.get_into
    put = AsyncServerConnector.put
    put_parts = AsyncServerConnector.put_parts

    async def put_status(
        self, key: str | bytes, parts: Iterable[Any], engine: EngineName = NO_ENGINE,
        timeout_s: float | None = None,
    ) -> int | None:  # fmt: skip
        parts = byte_views(parts)  # TypeError: not a miss
        at = await self._home_of(key)
        if at is None:
            return None
        view, home, address = at
        status = await self._members.get(view, home).put_status(address, parts, engine, timeout_s)
        self._router.put_homes.stored(address, home, status)
        return status

    async def contains(self, key: str | bytes) -> bool:
        return bool(await self._one(key, lambda c, a: c.contains(a), lambda r: not r))

    async def exists(self, key: str | bytes) -> bool:
        return bool(await self._one(key, lambda c, a: c.exists(a), lambda r: not r))

    async def delete(self, key: str | bytes) -> bool:
        """Like :meth:`SetConnector.delete <eg_kv.client.sets.SetConnector.delete>`: the
        previous home only after a 404."""
        return await self.delete_status(key) == 204

    async def delete_status(self, key: str | bytes) -> int | None:
        """Like :meth:`SetConnector.delete_status
        <eg_kv.client.sets.SetConnector.delete_status>`."""
        address = await self._begin(key)
        if address is None:
            return None
        view, where = self._router.delete_home(address)
        if where == NOT_NOTED:
            return await self._one(key, lambda c, a: c.delete_status(a), absent)
        if where not in view.members:  # noted at a member down now, or gone
            return delete_answer(where)
        status = await self._members.get(view, where).delete_status(address)
        self._router.put_homes.delete_answered(address, where, status)
        return status

    async def _parallel(
        self, ask: Ask, lease_ms: int | None = None
    ) -> dict[str, list[bool] | None]:
        """A round's lookups, every member's at once on this loop, all answered by the
        batch's deadline; a member still out when the round stops waiting for it
        (:class:`~eg_kv.client.rounds.Waiting`) is cancelled, missing from the answer and
        marked down."""

        async def one(m: str, part: list[str]) -> list[bool] | None:
            # A failed group is None (its share are misses); its error marks the member down.
            try:
                timeout_s = ask.timeout(first=True)
            except TimeoutError:
                return None
            conn = self._members.get(ask.view, m)
            if lease_ms:  # each member leases the hits of its part
                return await conn.try_exists_addresses(part, timeout_s, lease_ms)
            return await conn.try_exists_addresses(part, timeout_s=timeout_s)

        wait = Waiting(self._router, ask.deadline)
        pending = {asyncio.ensure_future(one(m, part)): m for m, part in ask.jobs()}
        out: dict[str, list[bool] | None] = {}
        try:
            while pending:
                done, _ = await asyncio.wait(
                    pending, timeout=wait.timeout(), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break
                for task in done:
                    out[pending.pop(task)] = got = task.result()
                    wait.answered(got)
        finally:
            for task in pending:
                task.cancel()
        if pending:
            wait.give_up(pending.values())
        return out

    async def _lookup(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
    ) -> tuple[list[bool], bool]:
        """(one bool per address in the caller's order, whether any member answered).
        ``lease_ms``: each member leases its hits."""
        if self._closed or not addresses:
            return [False] * len(addresses), not self._closed
        await self._start()
        plan = BatchPlan(self._router, addresses, timeout_s, lease_ms)
        for ask in plan:
            plan.take(await self._parallel(ask, lease_ms))
        return plan.found, plan.answered

    async def exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool]:
        """One bool per key; each member asked once (per 1024 keys), in parallel.
        ``lease_ms``: each member leases the hits of its part."""
        return (await self._lookup(to_addresses(keys), lease_ms=lease_ms))[0]

    async def try_exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool] | None:
        """:meth:`exists_many`, or None when no member could be asked."""
        return await self.try_exists_addresses(to_addresses(keys), lease_ms=lease_ms)

    async def try_exists_addresses(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
        local_only: bool = False,
    ) -> list[bool] | None:
        """Like :meth:`AsyncServerConnector.try_exists_addresses`; a member that failed
        costs its share (its addresses are misses); None only when no member answered.

        Args:
            timeout_s: the batch's one deadline, when shorter than the config's.
            lease_ms: each member leases the hits of its part.
            local_only: None, at once (a set answers from its members, over HTTP).
        """
        if local_only:
            return None
        found, answered = await self._lookup(list(addresses), timeout_s, lease_ms)
        return found if answered else None

    async def contains_prefix(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> int:
        """Prefix hits over the merged answer, whichever member holds each key.
        ``lease_ms``: the prefix's blocks are leased; hits past it are released."""
        addresses = to_addresses(keys)
        found = (await self._lookup(addresses, lease_ms=lease_ms))[0]
        prefix = prefix_hits(found)
        if lease_ms and any(found[prefix:]):
            extra = zip(addresses[prefix:], found[prefix:], strict=True)
            await self.release([a for a, hit in extra if hit])
        return prefix

    async def release(self, keys: Sequence[str | bytes]) -> int:
        """End one lease on each key's block where it was granted (one request per
        member, at once): see :meth:`SetConnector.release <eg_kv.client.sets.SetConnector.release>`.
        Never raises."""
        if self._closed:
            return 0
        await self._start()
        view, by_home = self._router.release_homes(keys)
        done = await asyncio.gather(
            *(self._members.get(view, m).release(part) for m, part in by_home.items())
        )
        return sum(done)

    async def events(
        self, since: int = 0, wait: float = 0.0, limit: int = DEFAULT_EVENTS_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch:  # fmt: skip
        """The event log of a set of one member: see :meth:`SetConnector.events
        <eg_kv.client.sets.SetConnector.events>` (ConfigError for several members)."""
        await self._start()
        member = self._members.get(*self._router.only_member())
        return await member.events(since, wait, limit, epoch)

    async def snapshot(self) -> Snapshot:
        """The snapshot of a set of one member: see :meth:`events`."""
        await self._start()
        return await self._members.get(*self._router.only_member()).snapshot()

    @property
    def checksum_failures(self) -> int:
        """Blocks any member's answer failed their checksum (each a miss)."""
        return self._members.checksum_failures.count

    @property
    def forged_blocks(self) -> int:
        """Blocks any member's answer failed their block-key tag (each a miss)."""
        return self._members.forged_blocks.count

    async def member_stats(self) -> list[MemberStats]:
        """Each member's stats (gathered in parallel), sorted by member id."""
        if self._closed:  # nothing is asked of a member after close()
            return []
        await self._start()
        view = self._router.view()

        async def one(member_id: str) -> MemberStats:
            member = view.members[member_id]
            try:
                stats = await self._members.get(view, member_id).stats()
            except Exception as e:  # one line per member; the set goes on
                return MemberStats(member, False, None, str(e))
            return MemberStats(member, True, stats)

        return list(await asyncio.gather(*(one(m) for m in view.placement.members)))

    async def stats(self) -> KvCacheStats:
        """The sum over the members that answered.

        Raises:
            RemoteError: no member answered (the first member's error is named).
        """
        return set_stats(await self.member_stats())

    async def healthz(self) -> dict[str, Any] | None:
        """``{"status": "ok", "members": K, "members_up": k}`` while a member is up."""
        if self._closed:
            return None
        await self._start()
        view, up = self._router.up()
        got = await asyncio.gather(*(self._members.get(view, m).healthz() for m in up))
        answered = [m for m, answer in zip(up, got, strict=True) if answer is not None]
        return set_health(view, answered) if answered else None


#: The name this class had before the set connectors were named for what they serve.
AsyncClusterConnector = AsyncSetConnector
