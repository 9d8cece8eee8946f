"""The public asyncio client name: :class:`AsyncRemoteKVConnector` picks the connector a
``base_url`` needs (one server, or a server set).

It sits above both async connectors so that imports point one way: neither
:mod:`eg_kv.client.aio` nor :mod:`eg_kv.client.aio_sets` imports this module. Needs aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

from .aio import AsyncServerConnector
from .aio_sets import AsyncSetConnector
from .interface import AsyncKvConnector
from .settings import KvCacheConfig, resolve_config

__all__ = ["AsyncRemoteKVConnector"]


class AsyncRemoteKVConnector(AsyncServerConnector):
    """The asyncio eg-kv client: an :class:`~eg_kv.client.aio.AsyncServerConnector` for one
    server (this subclass adds nothing to a call), an
    :class:`~eg_kv.client.aio_sets.AsyncSetConnector` when ``base_url`` names a server set,
    with the same coroutines.
    """

    def __new__(
        cls,
        config: KvCacheConfig | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        **settings: Any,
    ) -> Any:
        resolved = resolve_config(config, settings)
        if not resolved.single:
            return AsyncSetConnector(resolved, session=session)
        return super().__new__(cls)


if TYPE_CHECKING:
    # mypy checks here that both async connectors satisfy AsyncKvConnector (the sync ones
    # are checked by connect()'s return type).
    def _satisfy(one: AsyncServerConnector, many: AsyncSetConnector) -> list[AsyncKvConnector]:
        return [one, many]
