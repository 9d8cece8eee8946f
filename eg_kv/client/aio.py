"""The asyncio client of one server: :class:`AsyncServerConnector` on an ``aiohttp`` session.

The same methods as :class:`eg_kv.client.sync.ServerConnector`, as coroutines, with the same
rules (:mod:`eg_kv.client.core`, :mod:`eg_kv.client.plans`): the hot path (``get``,
``put``, ``contains``, ``exists``, ``delete``, ``contains_prefix``, ``exists_many``) turns
every transport or protocol error into a miss and never waits past the timeout;
``stats()`` raises a clear error.

What aiohttp would do on its own and a client that trusts nothing must not: follow
redirects (``allow_redirects=False``), decompress (``auto_decompress=False``), resend a
``PUT`` or ``DELETE`` after a dropped connection (a per-request middleware stops its
retry), and send a body after the server answered its head (the connection is closed).

The public name, :class:`eg_kv.client.aio_connectors.AsyncRemoteKVConnector`, is this class
when ``base_url`` names one server and :class:`eg_kv.client.aio_sets.AsyncSetConnector`
otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

import aiohttp

from ..engine import NO_ENGINE, EngineName, engine_headers
from ..slab.local import LocalSlab
from ..slab.view import BlockReader
from ..wire import (
    ADDRESSES_TYPE,
    BATCH_EXISTS_PATH,
    BATCH_RELEASE_PATH,
    CHECKSUM_HEADER,
    LEASE_HEADER,
    RELEASE_HEADER,
    encode_addresses,
)
from . import plans
from .aio_http import (
    Parts,
    Transport,
    block_body,
    block_status,
    drained,
    exists_body,
    flag_body,
    json_body,
    sink_from_memory,
    small_body,
    snapshot_body,
    whole_block,
    with_refusal,
)
from .bodies import byte_views, into_bytes
from .core import JSON_TYPE, OVER_HTTP, OneServer
from .events import DEFAULT_LIMIT as DEFAULT_EVENTS_LIMIT
from .events import (
    EventBatch,
    Snapshot,
)
from .interface import AsyncReadExact, AsyncSink, MayStart, Unreachable
from .localreads import ROUTE as LOCAL_ROUTE
from .members import parse_server_set
from .plans import drive_async
from .rules import (
    KvCacheStats,
    Miss,
    ProbeUnanswered,
    batch_body,
    capped,
    parts_checksum,
    to_address,
    to_addresses,
)
from .setstats import MemberStats
from .settings import KvCacheConfig

#: Local reads of blocks up to this many bytes are copied in the event loop; larger ones
#: on a thread, whose copy releases the GIL. A hop to a thread and back costs about what
#: copying 1 MiB does.
LOCAL_COPY_IN_LOOP = 1024 * 1024
#: A GET's header that ends one of the caller's leases on the block (eg_kv.server.lookups).
_RELEASE = {RELEASE_HEADER: "1"}


T = TypeVar("T")
C = TypeVar("C", bound="AsyncServerConnector")


class AsyncServerConnector(OneServer):
    """Asyncio client of one eg-kv server. An async context manager.

    Pass ``session=`` to share a caller-owned ``aiohttp.ClientSession`` (the caller keeps
    owning it: :meth:`close` leaves it open); otherwise the connector opens its own on
    first use, in the running loop, and closes it in :meth:`close`. Requests set their own
    redirect, decompression and (for PUT and DELETE) middleware options, whatever the
    session's defaults.
    """

    def __init__(
        self,
        config: KvCacheConfig | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        on_unreachable: Unreachable | None = None,
        **settings: Any,
    ) -> None:
        """Args:
            config: a ready config, or leave it out and pass ``settings``.
            session: a caller-owned session to send requests on.
            on_unreachable: called with each transport error (refused, reset, timed
                out): a server set marks its member down.
            **settings: ``base_url``, ``addr``, ``token``, ``timeout_s``,
                ``max_connections``, ``verify_tls``, ``max_block_size`` (others are
                accepted and unused); what is left out comes from the environment.

        Raises:
            ConfigError: a setting cannot be used, or it names a server set.
        """
        self._start(config, settings, on_unreachable, "AsyncRemoteKVConnector or AsyncSetConnector")
        self._http = Transport(self.config, self._core.headers, session)
        self._exchange = self._http.exchange
        self._probes: set[asyncio.Future[Exception | None]] = set()

    @classmethod
    def from_env(
        cls: type[C], *, session: aiohttp.ClientSession | None = None, **settings: Any
    ) -> C:
        """A connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings), session=session)

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session if this connector opened it. Idempotent."""
        self._core.local.close()
        await self._http.close()

    async def _local(self, probe: bool = True) -> LocalSlab | None:
        """The server's slab mapped here, when this client is on its host (else None).

        Args:
            probe: ask the server where its slab is now if that is due; False for a call
                with a deadline shorter than the config's: the probe then runs as a task
                of its own instead. Raises ProbeUnanswered: it got no answer (a miss).
        """
        local = self._core.local
        if local.due():
            if probe and self._core.probes_inline:
                self._core.probed(await self._probe())
            else:
                task = asyncio.ensure_future(self._probe())
                self._probes.add(task)  # held until done: the loop keeps weak references
                task.add_done_callback(self._probes.discard)
        return local.slab

    async def _probe(self) -> Exception | None:
        """Ask the server where its slab is (``GET /kv/local/slab``) and map it if it can;
        the error of a probe that got no answer."""
        try:
            answer = await self._exchange("GET", self._core.path(LOCAL_ROUTE), small_body)
        except Exception as exc:  # asyncio.TimeoutError included
            self._core.miss("GET", LOCAL_ROUTE, exc)
            return exc
        self._core.local.adopt(*answer)
        return None

    async def get(self, key: str | bytes, release_lease: bool = False) -> bytes | None:
        """``GET /kv/<addr>``: the block's bytes, or None on a miss or any error.

        A body shorter than its ``Content-Length`` (block evicted mid-stream), longer than
        ``max_block_size``, unframed or encoded is a miss. On the server's host the block
        is copied from its slab: in the event loop up to :data:`LOCAL_COPY_IN_LOOP` bytes,
        on the loop's default executor beyond (a 14 MiB copy held the loop 0.4 ms).

        ``release_lease``: the load ends one of this client's leases on the block (see
        :meth:`eg_kv.client.sync.ServerConnector.fetch`).
        """
        address = to_address(key)
        try:
            local = await self._local_block(address)
        except ProbeUnanswered:
            return None
        slab = self._core.local.slab
        if local is not OVER_HTTP:
            if release_lease:
                await self.release([address])
            return local  # type: ignore[no-any-return]
        read = partial(whole_block, self._core, address)
        return await self._over_http(address, read, slab, release_lease)

    async def _over_http(
        self,
        address: str,
        read: Callable[[aiohttp.ClientResponse], Awaitable[T | None]],
        slab: LocalSlab | None,
        release_lease: bool,
        timeout_s: float | None = None,
    ) -> T | None:
        """``GET /kv/<addr>`` with ``read`` taking the answer (:meth:`get`'s, :meth:`fetch`'s);
        None on any error. ``release_lease``: as :meth:`get`'s; ``timeout_s``: the GET's
        deadline, when shorter than the config's."""
        core = self._core
        release_header = core.release_header(slab, address, release_lease)
        try:
            return await self._exchange(
                "GET",
                core.block_path(address),
                read,
                headers=_RELEASE if release_header else None,
                timeout_s=capped(timeout_s, self.config.timeout_s),
            )
        except Exception as exc:  # asyncio.TimeoutError included
            core.miss("GET", address, exc)
            return None
        finally:
            if release_lease and not release_header:
                await self.release([address])  # this client's local lease: no request

    async def _local_block(self, address: str, probe: bool = True) -> Any:
        """The block from the slab on the server's host: its bytes, None (a miss), or
        ``OVER_HTTP`` when it must be asked over HTTP. A copy of up to
        :data:`LOCAL_COPY_IN_LOOP` bytes runs in the event loop, a bigger one on the
        loop's default executor (a 14 MiB copy held the loop 0.4 ms). Raises as :meth:`_local`."""
        slab, core = await self._local(probe), self._core
        local = core.local_open(slab, address)
        if slab is None or not isinstance(local, BlockReader):
            return local
        into = core.keyed(address, into_bytes)
        if local.length > LOCAL_COPY_IN_LOOP:
            return await asyncio.get_running_loop().run_in_executor(
                None, core.local_copy, slab, local, address, into
            )
        return core.local_copy(slab, local, address, into)

    async def fetch(
        self,
        key: str | bytes,
        sink: AsyncSink[T],
        may_start: MayStart | None = None,
        release_lease: bool = False,
        timeout_s: float | None = None,
    ) -> T | None:
        """``GET /kv/<addr>`` and hand the body to ``await sink(length, read_exact)``; None
        on a miss. ``release_lease``: as :meth:`get`'s; ``timeout_s``: the GET's deadline,
        when shorter than the config's.

        ``sink`` must await ``read_exact(view)`` with views that add up to ``length`` bytes
        (in order) and return its result; if it raises, the block is a miss. A body cut
        short, over ``max_block_size`` or unframed is a miss, never partial bytes (the
        rules of :meth:`eg_kv.client.sync.ServerConnector.fetch`). On the server's host the
        block is copied from its slab first (as :meth:`get` does), then handed over.

        ``may_start`` is for a server set's second request; one server is asked once.
        Never raises on a transport or protocol error.
        """
        address, core = to_address(key), self._core
        try:  # a call with its own deadline: probed beside
            local = await self._local_block(address, probe=timeout_s is None)
        except ProbeUnanswered:
            return None
        slab = core.local.slab
        if local is not OVER_HTTP and release_lease:
            await self.release([address])
        if isinstance(local, bytes):
            try:
                return await sink_from_memory(local, sink)
            except Exception as exc:
                core.miss("GET", address, exc)
                return None
        if local is not OVER_HTTP:
            return None  # a miss
        return await self._over_http(
            address, partial(block_body, core, address, sink), slab, release_lease, timeout_s
        )

    async def get_into(
        self, key: str | bytes, buffer: Any, release_lease: bool = False
    ) -> int | None:
        """``GET /kv/<addr>`` into ``buffer`` (a writable buffer). ``release_lease``: as
        :meth:`get`'s.

        Returns:
            The block's length when it fits in ``buffer`` (its first bytes now hold it);
            None on a miss, an error, or a block larger than ``buffer``.
        """
        view = memoryview(buffer).cast("B")

        async def sink(length: int, read_exact: AsyncReadExact) -> int:
            if length > len(view):
                raise Miss(f"block of {length} bytes does not fit a {len(view)}-byte buffer")
            await read_exact(view[:length])
            return length

        return await self.fetch(key, sink, release_lease=release_lease)

    async def put(self, key: str | bytes, data: Any) -> bool:
        """``PUT /kv/<addr>``. True when stored (201) or deduplicated (200); else False."""
        return await self.put_status(key, (data,)) in (200, 201)

    async def put_parts(self, key: str | bytes, parts: Iterable[Any]) -> bool:
        """``PUT /kv/<addr>`` of the concatenation of ``parts``, each sent without a copy.

        Returns:
            True on 200/201, False on any refusal or error.
        """
        return await self.put_status(key, parts) in (200, 201)

    async def put_status(
        self, key: str | bytes, parts: Iterable[Any], engine: EngineName = NO_ENGINE,
        timeout_s: float | None = None,
    ) -> int | None:  # fmt: skip
        """``PUT /kv/<addr>`` of the concatenation of ``parts`` (bytes-like, no copy).

        Returns:
            The final HTTP status, or None when no usable answer came. See
            :meth:`eg_kv.client.sync.ServerConnector.put_status`.
        """
        address = to_address(key)
        views = self._core.sealed(address, byte_views(parts))  # TypeError: not a miss
        try:
            status = await self._exchange(
                "PUT", self._core.block_path(address), drained, body=Parts(views),
                headers={CHECKSUM_HEADER: parts_checksum(views), **engine_headers(engine)},
                timeout_s=capped(timeout_s, self.config.timeout_s),
            )  # fmt: skip
        except Exception as exc:  # asyncio.TimeoutError included
            self._core.miss("PUT", address, exc)
            return None
        if status == 401:
            self._core.warn_unauthorized()
        return status

    async def _status(self, method: str, address: str) -> int | None:
        try:
            parse = partial(block_status, method, address)
            return await self._exchange(method, self._core.block_path(address), parse)
        except Exception as exc:  # asyncio.TimeoutError included
            self._core.miss(method, address, exc)
            return None

    async def contains(self, key: str | bytes) -> bool:
        """``HEAD /kv/<addr>``: True when resident; False on a miss or any error."""
        address = to_address(key)
        try:
            found = self._core.local_has(await self._local(), "HEAD", address)
        except ProbeUnanswered:
            return False
        return found if found is not None else await self._status("HEAD", address) == 200

    async def delete(self, key: str | bytes) -> bool:
        """``DELETE /kv/<addr>``: True on 204; False otherwise. Never sent twice."""
        return await self._status("DELETE", to_address(key)) == 204

    async def delete_status(self, key: str | bytes) -> int | None:
        """:meth:`delete`'s final HTTP status (204 released, 404 absent, ...), or None when
        no usable answer came (it may have been applied)."""
        return await self._status("DELETE", to_address(key))

    async def exists(self, key: str | bytes) -> bool:
        """``GET /kv/<addr>/exists``: True when resident; False on a miss or any error."""
        address = to_address(key)
        try:
            found = self._core.local_has(await self._local(), "exists", address)
        except ProbeUnanswered:
            return False
        if found is not None:
            return found
        try:
            path = self._core.block_path(address, "/exists")
            return await self._exchange("GET", path, partial(exists_body, address))
        except Exception as exc:  # asyncio.TimeoutError included
            self._core.miss("exists", address, exc)
            return False

    async def exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool]:
        """One bool per key (one batch request per 1024 keys); False where a batch failed.
        ``lease_ms``: lease the hits (:meth:`eg_kv.client.sync.ServerConnector.exists_many`)."""
        plan = plans.exists_many(self._core, to_addresses(keys), lease_ms)
        return await drive_async(plan, self._answer)

    async def try_exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool] | None:
        """Like :meth:`exists_many`, but None when any batch request failed (so a caller
        can tell "absent" from "could not ask"). Never raises."""
        return await self.try_exists_addresses(to_addresses(keys), lease_ms=lease_ms)

    async def try_exists_addresses(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
        local_only: bool = False,
    ) -> list[bool] | None:
        """:meth:`try_exists_many` for ready-made addresses; the arguments of
        :meth:`eg_kv.client.sync.ServerConnector.try_exists_addresses`. Never raises."""
        plan = plans.try_exists(self._core, addresses, timeout_s, lease_ms, local_only)
        return await drive_async(plan, self._answer)

    async def contains_prefix(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> int:
        """How many keys, from the first, are resident without a gap; 0 on any error.
        ``lease_ms``: lease the prefix's blocks; hits past it are released at once."""
        plan = plans.contains_prefix(self._core, to_addresses(keys), lease_ms)
        return await drive_async(plan, self._answer)

    async def release(self, keys: Sequence[str | bytes]) -> int:
        """End one lease on each key's block (here for a lease taken on the local slab, else
        ``POST /kv/batch/release``, one per 1024): how many were released, 0 for a batch
        that failed. Never raises."""
        return await drive_async(plans.release(self._core, to_addresses(keys)), self._answer)

    async def _answer(self, step: plans.Step) -> Any:
        """Send the request a plan asks for (:mod:`eg_kv.client.plans`); its answer."""
        if isinstance(step, plans.Mapped):
            return await self._local(probe=step.probe)
        if isinstance(step, plans.Batch):
            head = {"Content-Type": ADDRESSES_TYPE if step.compact else JSON_TYPE}
            if step.lease_ms and step.lease_ms > 0:
                head[LEASE_HEADER] = str(step.lease_ms)
            compact, n = step.compact, len(step.addresses)
            return await self._exchange(
                "POST",
                self._core.path(BATCH_EXISTS_PATH),
                partial(with_refusal, partial(flag_body, n) if compact else json_body),
                body=encode_addresses(step.addresses) if compact else batch_body(step.addresses),
                headers=head,
                timeout_s=step.timeout_s,
            )
        if isinstance(step, plans.Release):
            return await self._exchange(
                "POST",
                self._core.path(BATCH_RELEASE_PATH),
                partial(flag_body, len(step.addresses)),
                body=encode_addresses(step.addresses),
                headers={"Content-Type": ADDRESSES_TYPE},
            )
        if isinstance(step, plans.GetSnapshot):
            return await self._exchange("GET", step.target, snapshot_body)
        return await self._exchange("GET", step.target, json_body, timeout_s=step.timeout_s)

    async def stats(self) -> KvCacheStats:
        """``GET /kv/stats``.

        Raises:
            Unauthorized: the server refused the token.
            RemoteError: the server is unreachable or answered something unusable.
        """
        return await drive_async(plans.stats(self._core), self._answer)

    async def healthz(self) -> dict[str, Any] | None:
        """``GET /healthz``: the decoded answer, or None when the server is not healthy."""
        return await drive_async(plans.healthz(self._core), self._answer)

    async def events(
        self, since: int = 0, wait: float = 0.0, limit: int = DEFAULT_EVENTS_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch:  # fmt: skip
        """``GET /kv/events``, as :meth:`eg_kv.client.sync.ServerConnector.events`.

        Raises:
            Unauthorized: the server refused the token.
            RemoteError: unreachable, no event log, too many waiters, an unusable answer.
        """
        plan = plans.events(self._core, since, wait, limit, epoch)
        return await drive_async(plan, self._answer)

    async def snapshot(self) -> Snapshot:
        """``GET /kv/events/snapshot``: the blocks held and the log's seq they match, read a
        piece at a time (:class:`~eg_kv.client.events.SnapshotReader`).

        Raises:
            The same as :meth:`events`.
        """
        return await drive_async(plans.snapshot(self._core), self._answer)

    async def member_stats(self) -> list[MemberStats]:
        """This server's line, as a set of one: up with its stats, or down with the error."""
        member = parse_server_set(self.config.base_url).single
        assert member is not None  # a single-server config (checked when built)
        try:
            stats = await self.stats()
        except Exception as exc:  # one line per member, as a set's
            return [MemberStats(member, False, None, str(exc))]
        return [MemberStats(member, True, stats)]
