"""eg-kv: a shared, content-addressed KV-cache block store for LLM inference fleets.

The public API, loaded on first use (``import eg_kv`` itself imports nothing else, so a
client never pays for the server's packages)::

    from eg_kv import RemoteKVConnector          # sync client (standard library only)
    from eg_kv import AsyncRemoteKVConnector     # the same as coroutines (aiohttp)
    from eg_kv import KvCacheConfig, KvCacheStats, to_address
    from eg_kv import EgKvError, ConfigError, RemoteError   # one exception tree
    from eg_kv import Settings, settings_from_env            # the server's settings

The LMCache plugins keep their documented home, ``eg_kv.kvcache`` (``module_path:
eg_kv.kvcache`` in LMCache configs), which exports the clients too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines (or re-exports) it.
_EXPORTS = {
    **dict.fromkeys(
        (
            "RemoteKVConnector",
            "AsyncRemoteKVConnector",
            "KvCacheConfig",
            "KvCacheStats",
            "to_address",
            "RemoteKVL2Connector",
            "EgKvRemoteConnector",
            "EgKvConnectorAdapter",
        ),
        "eg_kv.kvcache",
    ),
    **dict.fromkeys(
        (
            "EgKvError",
            "BadRequest",
            "InvalidAddress",
            "Unauthorized",
            "Forbidden",
            "NotFound",
            "Conflict",
            "TooLarge",
            "InsufficientStorage",
            "Busy",
            "SlabError",
            "ConfigError",
            "RemoteError",
        ),
        "eg_kv.errors",
    ),
    "Settings": "eg_kv.config",
    "settings_from_env": "eg_kv.config",
}

__all__ = [
    "AsyncRemoteKVConnector",
    "BadRequest",
    "Busy",
    "ConfigError",
    "Conflict",
    "EgKvConnectorAdapter",
    "EgKvError",
    "EgKvRemoteConnector",
    "Forbidden",
    "InsufficientStorage",
    "InvalidAddress",
    "KvCacheConfig",
    "KvCacheStats",
    "NotFound",
    "RemoteError",
    "RemoteKVConnector",
    "RemoteKVL2Connector",
    "Settings",
    "SlabError",
    "TooLarge",
    "Unauthorized",
    "__version__",
    "settings_from_env",
    "to_address",
]  # the same names as _EXPORTS (tests/test_public_api.py)

if TYPE_CHECKING:
    from .config import Settings, settings_from_env
    from .errors import (
        BadRequest,
        Busy,
        ConfigError,
        Conflict,
        EgKvError,
        Forbidden,
        InsufficientStorage,
        InvalidAddress,
        NotFound,
        RemoteError,
        SlabError,
        TooLarge,
        Unauthorized,
    )
    from .kvcache import (
        AsyncRemoteKVConnector,
        EgKvConnectorAdapter,
        EgKvRemoteConnector,
        KvCacheConfig,
        KvCacheStats,
        RemoteKVConnector,
        RemoteKVL2Connector,
        to_address,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eg_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
