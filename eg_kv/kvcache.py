"""eg-kv's Python driver: the public module for clients and the LMCache plugins.

``import eg_kv.kvcache`` needs the standard library only. The names that need more are
loaded on first use: :class:`AsyncRemoteKVConnector` (aiohttp) and
:class:`EgKvRemoteConnector` (the ``lmcache`` package).

* :class:`RemoteKVConnector`: sync client, ``get / put / contains / exists / delete /
  contains_prefix / stats``; hot-path errors are misses.
* :class:`AsyncRemoteKVConnector`: the same as coroutines on an aiohttp session.
* :class:`RemoteKVL2Connector`: LMCache's ``native_plugin`` L2 adapter client::

      {"type": "native_plugin", "module_path": "eg_kv.kvcache",
       "class_name": "RemoteKVL2Connector",
       "adapter_params": {"base_url": "http://127.0.0.1:9130"}}

* :class:`EgKvRemoteConnector`: a ``RemoteConnector`` for LMCache's in-engine
  ``remote_storage_plugins`` path, and :class:`EgKvConnectorAdapter`, the LMCache
  ``ConnectorAdapter`` that builds it on every path (``class_name: EgKvConnectorAdapter``).
* :class:`KvCacheConfig`, :class:`KvCacheStats`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client.connectors import RemoteKVConnector
from .client.rules import KvCacheStats, to_address
from .client.settings import KvCacheConfig
from .lmcache.l2 import RemoteKVL2Connector

if TYPE_CHECKING:
    from .client.aio_connectors import AsyncRemoteKVConnector
    from .lmcache.adapter import EgKvConnectorAdapter
    from .lmcache.remote import EgKvRemoteConnector

__all__ = [
    "AsyncRemoteKVConnector",
    "EgKvConnectorAdapter",
    "EgKvRemoteConnector",
    "KvCacheConfig",
    "KvCacheStats",
    "RemoteKVConnector",
    "RemoteKVL2Connector",
    "to_address",
]


def __getattr__(name: str) -> Any:
    # Lazy: keep the base import free of aiohttp and of lmcache/torch.
    if name == "AsyncRemoteKVConnector":
        from .client.aio_connectors import AsyncRemoteKVConnector

        return AsyncRemoteKVConnector
    if name == "EgKvRemoteConnector":
        from .lmcache.remote import EgKvRemoteConnector

        return EgKvRemoteConnector
    if name == "EgKvConnectorAdapter":
        from .lmcache.adapter import EgKvConnectorAdapter

        return EgKvConnectorAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
