"""A server set as one cache, for asyncio: :class:`AsyncSetConnector`.

The async twin of :class:`eg_kv.client.sets.SetConnector`: the same router (membership,
health, placement and the batch plans, whose threads run beside the loop), with requests
sent on the caller's loop by one :class:`~eg_kv.client.aio.AsyncServerConnector` per
member and a batch's groups gathered in parallel.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from .aio import AsyncServerConnector
from .core import KvCacheConfig, KvCacheStats, to_address
from .interface import AsyncSink, Unreachable
from .members import View
from .placement import merge, prefix_hits
from .sets import Groups, MemberConnectors, Router, absent
from .setstats import MemberStats, set_stats

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
        self._router = Router(config)
        #: The loop the member connectors (their aiohttp sessions) were built on.
        self._loop: asyncio.AbstractEventLoop | None = None

        def build(cfg: KvCacheConfig, hook: Unreachable) -> AsyncServerConnector:
            self._loop = asyncio.get_running_loop()
            return AsyncServerConnector(cfg, session=session, on_unreachable=hook)

        self._members = MemberConnectors(self._router, build, self._dispose)
        self._router.listeners.append(self._members.prune)
        self._closed = False

    def _dispose(self, conn: Any) -> None:
        """Close a departed member's connector on the loop its session lives on (prune
        runs in the membership thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no session was opened on a loop that still runs
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            asyncio.run_coroutine_threadsafe(conn.close(), loop)

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
        return self._router

    async def close(self) -> None:
        """Stop the background threads and close every member's session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._router.close)
        for conn in self._members.take_all():
            await conn.close()

    async def _one(self, key: str | bytes, op: Callable[[Any, str], Any],
                   miss: Callable[[Any], bool], ask_previous: bool = True,
                   may_start: Callable[[float], bool] | None = None) -> Any:  # fmt: skip
        address = to_address(key)
        if self._closed:
            return None
        view, home = self._router.home(address)
        if home is None:
            return None
        result = await op(self._members.get(view, home), address)
        if ask_previous and miss(result):
            before = self._router.previous(view, address, home)
            # The second request gets a fresh timeout_s: it starts only if the caller's
            # deadline still has room for all of it.
            if before is not None and (may_start is None or may_start(self.config.timeout_s)):
                return await op(self._members.get(view, before), address)
        return result

    async def fetch(self, key: str | bytes, sink: AsyncSink[T],
                    may_start: Callable[[float], bool] | None = None) -> T | None:  # fmt: skip
        """``GET`` the block from its home (see :meth:`AsyncServerConnector.fetch`); after a
        miss there, right after a change, from its previous home if ``may_start`` allows."""
        return await self._one(key, lambda c, a: c.fetch(a, sink), lambda r: r is None,
                               may_start=may_start)  # fmt: skip

    async def get(self, key: str | bytes) -> bytes | None:
        return await self._one(key, lambda c, a: c.get(a), lambda r: r is None)

    get_into = AsyncServerConnector.get_into
    put = AsyncServerConnector.put
    put_parts = AsyncServerConnector.put_parts

    async def put_status(self, key: str | bytes, parts: Iterable[Any]) -> int | None:
        parts = list(parts)
        return await self._one(key, lambda c, a: c.put_status(a, parts), lambda _r: False, False)

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
        return await self._one(key, lambda c, a: c.delete_status(a), absent)

    async def _parallel(
        self,
        view: View,
        groups: Groups,
        addresses: Sequence[str],
        deadline: float,
        bounded: bool = False,
    ) -> dict[str, list[bool] | None]:
        """Like the sync set's: every group at once, all answered by ``deadline``; a
        member still out when the batch stops waiting for it is cancelled, missing from
        the answer and marked down."""

        async def one(m: str, idx: list[int]) -> list[bool] | None:
            # A failed group is None (its share are misses); its error marks the member down.
            left = deadline - time.monotonic() if bounded else None
            conn = self._members.get(view, m)
            return await conn.try_exists_addresses([addresses[i] for i in idx], left)

        started = time.monotonic()
        pending = {asyncio.ensure_future(one(m, idx)): m for m, idx in groups.items()}
        out: dict[str, list[bool] | None] = {}
        cut = deadline
        try:
            while pending:
                done, _ = await asyncio.wait(
                    pending, timeout=max(0.0, cut - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                if not done:
                    break
                for task in done:
                    out[pending.pop(task)] = task.result()
                cut = self._router.cut(started, deadline)
        finally:
            for task in pending:
                task.cancel()
        if pending:
            self._router.late(pending.values(), time.monotonic() - started)
        return out

    async def _lookup(
        self, addresses: Sequence[str], timeout_s: float | None = None
    ) -> tuple[list[bool], bool]:
        """(one bool per address in the caller's order, whether any member answered)."""
        if self._closed or not addresses:
            return [False] * len(addresses), not self._closed
        limit = self.config.timeout_s
        wait_s = limit if timeout_s is None else min(timeout_s, limit)
        bounded = wait_s < limit
        deadline = time.monotonic() + wait_s
        view, groups = self._router.plan(addresses)
        answers = await self._parallel(view, groups, addresses, deadline, bounded)
        ok = {m: a for m, a in answers.items() if a is not None}
        found = merge(len(addresses), groups, ok, False)
        again = self._router.second_plan(view, addresses, found, groups)
        if again and time.monotonic() < deadline:
            for m, a in (await self._parallel(view, again, addresses, deadline, bounded)).items():
                if a is not None:
                    for i, hit in zip(again[m], a, strict=True):
                        found[i] = found[i] or hit
        return found, bool(ok)

    async def exists_many(self, keys: Sequence[str | bytes]) -> list[bool]:
        """One bool per key; each member asked once (per 1024 keys), in parallel."""
        return (await self._lookup([to_address(k) for k in keys]))[0]

    async def try_exists_many(self, keys: Sequence[str | bytes]) -> list[bool] | None:
        """:meth:`exists_many`, or None when no member could be asked."""
        return await self.try_exists_addresses([to_address(k) for k in keys])

    async def try_exists_addresses(
        self, addresses: Sequence[str], timeout_s: float | None = None
    ) -> list[bool] | None:
        """Like :meth:`AsyncServerConnector.try_exists_addresses`; a member that failed
        costs its share (its addresses are misses); None only when no member answered.

        Args:
            timeout_s: the batch's one deadline, when shorter than the config's.
        """
        found, answered = await self._lookup(list(addresses), timeout_s)
        return found if answered else None

    async def contains_prefix(self, keys: Sequence[str | bytes]) -> int:
        """Prefix hits over the merged answer, whichever member holds each key."""
        return prefix_hits((await self._lookup([to_address(k) for k in keys]))[0])

    async def member_stats(self) -> list[MemberStats]:
        """Each member's stats (gathered in parallel), sorted by member id."""
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
        view = self._router.view()
        down = self._router.down()
        up = [m for m in view.placement.members if m not in down]
        for member_id in up:
            if await self._members.get(view, member_id).healthz() is not None:
                return {"status": "ok", "members": len(view.members), "members_up": len(up)}
        return None


#: The name this class had before the set connectors were named for what they serve.
AsyncClusterConnector = AsyncSetConnector
