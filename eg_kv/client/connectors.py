"""The public sync client names: :class:`RemoteKVConnector` and :func:`connect` pick the
connector a ``base_url`` needs (one server, or a server set).

They sit above both connectors so that imports point one way: the single-server client
(:mod:`eg_kv.client.sync`) and the set (:mod:`eg_kv.client.sets`) never import this module.
Standard library only, like the sync client.
"""

from __future__ import annotations

from typing import Any

from .interface import KvConnector
from .sets import SetConnector
from .settings import KvCacheConfig, resolve_config
from .sync import ServerConnector

__all__ = ["RemoteKVConnector", "connect"]


class RemoteKVConnector(ServerConnector):
    """The sync eg-kv client: a :class:`~eg_kv.client.sync.ServerConnector` for one server
    (the direct client, at its cost: this subclass adds nothing to a call), a
    :class:`~eg_kv.client.sets.SetConnector` when ``base_url`` names a server set (a list,
    a ``dns+`` or ``dnssrv+`` URL), with the same methods.

    ``RemoteKVConnector(base_url=..., token=...)``, ``RemoteKVConnector(config)`` and
    ``RemoteKVConnector.from_env()`` all choose.
    """

    def __new__(cls, config: KvCacheConfig | None = None, **settings: Any) -> Any:
        resolved = resolve_config(config, settings)
        if not resolved.single:
            return SetConnector(resolved)
        return super().__new__(cls)


def connect(config: KvCacheConfig) -> KvConnector:
    """The sync client of a config: the direct client for one plain URL (today's path, at
    today's cost), else a :class:`~eg_kv.client.sets.SetConnector`. Every sync user (the
    LMCache plugins included) is built here."""
    return ServerConnector(config) if config.single else SetConnector(config)
