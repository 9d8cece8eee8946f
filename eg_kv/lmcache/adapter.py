"""LMCache ``ConnectorAdapter`` for eg-kv: :class:`EgKvConnectorAdapter`.

LMCache builds a plugin's connector through an adapter when ``class_name`` names a
``ConnectorAdapter``: the adapter is made without arguments, asked ``can_parse(url)`` for
``plugin://<name>`` (the legacy ``remote_url: plugin://egkv`` too), and handed a
``ConnectorContext`` with LMCache's config, metadata, loop, CPU backend (or a stand-in)
and the plugin's instance name. That is everything :class:`EgKvRemoteConnector` needs,
on every path, including several named instances (``egkv.a``, ``egkv.b``).

The plugin's type must be ``egkv``: names ``egkv`` or ``egkv.<instance>``.
"""

from __future__ import annotations

from .compat import ConnectorAdapter, ConnectorContext, RemoteConnector, extract_plugin_type
from .remote import EgKvRemoteConnector

#: The plugin type this adapter builds (``remote_storage_plugins: ["egkv", "egkv.b"]``).
PLUGIN_TYPE = "egkv"
_SCHEME = "plugin://"


class EgKvConnectorAdapter(ConnectorAdapter):
    """Builds :class:`EgKvRemoteConnector` for ``plugin://egkv`` and ``plugin://egkv.*``."""

    def __init__(self) -> None:
        super().__init__(f"{_SCHEME}{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        """True for ``plugin://egkv`` and ``plugin://egkv.<instance>``."""
        return url.startswith(_SCHEME) and extract_plugin_type(url[len(_SCHEME) :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        """The connector for ``context``'s plugin instance (its name is in the URL).

        Raises:
            ConfigError: a setting of that instance cannot be used.
        """
        name = context.plugin_name or context.url[len(_SCHEME) :].split("?", 1)[0]
        return EgKvRemoteConnector(
            context.loop,
            context.local_cpu_backend,
            context.config,
            plugin_name=name,
            metadata=context.metadata,
        )
