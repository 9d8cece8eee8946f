"""What every connector offers: :class:`KvConnector` (sync) and :class:`AsyncKvConnector`
(the same methods as coroutines), as ``typing.Protocol`` classes.

One server or a server set, a caller holds one of these and never asks which
(``tests/client/test_connector_parity.py`` fails when a public method exists on one
connector only, or a connector does not satisfy its protocol; mypy checks the signatures
where :func:`eg_kv.client.connectors.connect` and
:mod:`eg_kv.client.aio_connectors` name them). Standard library only.

The hot-path methods never raise: a transport or protocol error is a miss (``None`` /
``False`` / ``0``); ``stats()`` raises :class:`~eg_kv.errors.RemoteError` instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..engine import EngineName
from .events import DEFAULT_LIMIT as DEFAULT_EVENTS_LIMIT
from .events import EventBatch, Snapshot
from .rules import KvCacheStats
from .setstats import MemberStats
from .settings import KvCacheConfig

T = TypeVar("T")

#: ``read_exact(view)``: fills ``view`` with the body's next bytes.
ReadExact = Callable[[memoryview], None]
#: ``sink(length, read_exact)``: what :meth:`KvConnector.fetch` hands a block's body.
Sink = Callable[[int, ReadExact], T]
#: ``await read_exact(view)``: fills ``view`` with the body's next bytes.
AsyncReadExact = Callable[[memoryview], Awaitable[None]]
#: ``await sink(length, read_exact)``: what :meth:`AsyncKvConnector.fetch` hands a body.
AsyncSink = Callable[[int, AsyncReadExact], Awaitable[T]]
#: ``may_start(timeout_s)``: whether a request bounded by ``timeout_s`` may still start.
MayStart = Callable[[float], bool]
#: ``on_unreachable(exc)``: a single-server connector's transport error (refused, reset,
#: timed out), for the set that holds it.
Unreachable = Callable[[BaseException], None]


class KvConnector(Protocol):
    """A sync eg-kv connector: one server (:class:`~eg_kv.client.sync.ServerConnector`) or
    a set (:class:`~eg_kv.client.sets.SetConnector`). Thread-safe; a context manager."""

    config: KvCacheConfig

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> None: ...
    def close(self) -> None: ...

    def fetch(
        self,
        key: str | bytes,
        sink: Sink[T],
        may_start: MayStart | None = None,
        release_lease: bool = False,
        timeout_s: float | None = None,
    ) -> T | None:
        """``GET`` a block into ``sink``; ``may_start`` gates a set's second request;
        ``release_lease`` ends one of the caller's leases on it; ``timeout_s`` bounds
        the call (a set's second request included) when shorter than the config's."""

    def get(self, key: str | bytes, release_lease: bool = False) -> bytes | None: ...
    def get_into(
        self, key: str | bytes, buffer: Any, release_lease: bool = False
    ) -> int | None: ...
    def put(self, key: str | bytes, data: Any) -> bool: ...
    def put_parts(self, key: str | bytes, parts: Iterable[Any]) -> bool: ...
    def put_status(
        self, key: str | bytes, parts: Iterable[Any], engine: EngineName = ...,
        timeout_s: float | None = None,
    ) -> int | None: ...  # fmt: skip
    def contains(self, key: str | bytes) -> bool: ...
    def exists(self, key: str | bytes) -> bool: ...
    def delete(self, key: str | bytes) -> bool: ...
    def delete_status(self, key: str | bytes) -> int | None: ...
    def exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool]: ...
    def try_exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool] | None: ...
    def try_exists_addresses(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
        local_only: bool = False,
    ) -> list[bool] | None: ...
    def contains_prefix(self, keys: Sequence[str | bytes], lease_ms: int | None = None) -> int: ...
    def release(self, keys: Sequence[str | bytes]) -> int:
        """End one lease on each key's block (leases come from ``lease_ms`` lookups)."""

    def events(
        self, since: int = 0, wait: float = 0.0, limit: int = DEFAULT_EVENTS_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch:  # fmt: skip
        """The event log after ``since`` (a set: of its one member)."""

    def snapshot(self) -> Snapshot: ...
    def stats(self) -> KvCacheStats: ...
    def healthz(self) -> dict[str, Any] | None: ...
    def member_stats(self) -> list[MemberStats]: ...
    @property
    def checksum_failures(self) -> int: ...


class AsyncKvConnector(Protocol):
    """An asyncio eg-kv connector: one server
    (:class:`~eg_kv.client.aio.AsyncServerConnector`) or a set
    (:class:`~eg_kv.client.aio_sets.AsyncSetConnector`). An async context manager."""

    config: KvCacheConfig

    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: object) -> None: ...
    async def close(self) -> None: ...

    async def fetch(
        self,
        key: str | bytes,
        sink: AsyncSink[T],
        may_start: MayStart | None = None,
        release_lease: bool = False,
        timeout_s: float | None = None,
    ) -> T | None:
        """``GET`` a block into ``sink``; ``may_start`` gates a set's second request;
        ``release_lease`` ends one of the caller's leases on it; ``timeout_s`` bounds
        the call (a set's second request included) when shorter than the config's."""

    async def get(self, key: str | bytes, release_lease: bool = False) -> bytes | None: ...
    async def get_into(
        self, key: str | bytes, buffer: Any, release_lease: bool = False
    ) -> int | None: ...
    async def put(self, key: str | bytes, data: Any) -> bool: ...
    async def put_parts(self, key: str | bytes, parts: Iterable[Any]) -> bool: ...
    async def put_status(
        self, key: str | bytes, parts: Iterable[Any], engine: EngineName = ...,
        timeout_s: float | None = None,
    ) -> int | None: ...  # fmt: skip
    async def contains(self, key: str | bytes) -> bool: ...
    async def exists(self, key: str | bytes) -> bool: ...
    async def delete(self, key: str | bytes) -> bool: ...
    async def delete_status(self, key: str | bytes) -> int | None: ...
    async def exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool]: ...
    async def try_exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool] | None: ...
    async def try_exists_addresses(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
        local_only: bool = False,
    ) -> list[bool] | None: ...
    async def contains_prefix(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> int: ...
    async def release(self, keys: Sequence[str | bytes]) -> int:
        """End one lease on each key's block (leases come from ``lease_ms`` lookups)."""

    async def events(
        self, since: int = 0, wait: float = 0.0, limit: int = DEFAULT_EVENTS_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch:  # fmt: skip
        """The event log after ``since`` (a set: of its one member)."""

    async def snapshot(self) -> Snapshot: ...
    async def stats(self) -> KvCacheStats: ...
    async def healthz(self) -> dict[str, Any] | None: ...
    async def member_stats(self) -> list[MemberStats]: ...
    @property
    def checksum_failures(self) -> int: ...
