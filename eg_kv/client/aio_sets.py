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
from typing import Any

from ..errors import RemoteError
from .aio import AsyncServerConnector
from .core import KvCacheConfig, KvCacheStats, to_address
from .members import View
from .placement import merge, prefix_hits
from .sets import Groups, MemberConnectors, Router, absent, sum_stats


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

        def build(cfg: KvCacheConfig) -> AsyncServerConnector:
            self._loop = asyncio.get_running_loop()
            return AsyncServerConnector(cfg, session=session)

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
                   miss: Callable[[Any], bool], ask_previous: bool = True) -> Any:  # fmt: skip
        address = to_address(key)
        if self._closed:
            return None
        view, home = self._router.home(address)
        if home is None:
            return None
        result = await op(self._members.get(view, home), address)
        if ask_previous and miss(result):
            before = self._router.previous(view, address, home)
            if before is not None:
                return await op(self._members.get(view, before), address)
        return result

    async def get(self, key: str | bytes) -> bytes | None:
        return await self._one(key, lambda c, a: c.get(a), lambda r: r is None)

    async def put(self, key: str | bytes, data: Any) -> bool:
        return await self.put_status(key, (data,)) in (200, 201)

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
        return await self._one(key, lambda c, a: c._status("DELETE", a), absent) == 204

    async def _parallel(
        self, view: View, groups: Groups, addresses: Sequence[str], deadline: float
    ) -> dict[str, list[bool] | None]:
        """Like the sync set's: every group at once, all answered by ``deadline``; a
        member still out when the batch stops waiting for it is
        cancelled, missing from the answer and marked down."""

        async def one(m: str, idx: list[int]) -> list[bool] | None:
            # A failed group is all misses (its share); its error marks the member down.
            return await self._members.get(view, m).exists_many([addresses[i] for i in idx])

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

    async def _lookup(self, addresses: Sequence[str]) -> list[bool]:
        if self._closed or not addresses:
            return [False] * len(addresses)
        deadline = time.monotonic() + self.config.timeout_s
        view, groups = self._router.plan(addresses)
        answers = await self._parallel(view, groups, addresses, deadline)
        found = merge(
            len(addresses), groups, {m: a for m, a in answers.items() if a is not None}, False
        )
        again = self._router.second_plan(view, addresses, found, groups)
        if again and time.monotonic() < deadline:
            for m, a in (await self._parallel(view, again, addresses, deadline)).items():
                if a is not None:
                    for i, hit in zip(again[m], a, strict=True):
                        found[i] = found[i] or hit
        return found

    async def exists_many(self, keys: Sequence[str | bytes]) -> list[bool]:
        return await self._lookup([to_address(k) for k in keys])

    async def contains_prefix(self, keys: Sequence[str | bytes]) -> int:
        return prefix_hits(await self._lookup([to_address(k) for k in keys]))

    async def stats(self) -> KvCacheStats:
        view = self._router.view()
        ids = list(view.placement.members)

        async def one(m: str) -> KvCacheStats | None:
            try:
                return await self._members.get(view, m).stats()
            except Exception:  # the sum goes on without it
                return None

        parts = [s for s in await asyncio.gather(*(one(m) for m in ids)) if s is not None]
        if not parts:
            raise RemoteError("cannot read /kv/stats from any member of the set")
        return sum_stats(parts)


#: The name this class had before the set connectors were named for what they serve.
AsyncClusterConnector = AsyncSetConnector
