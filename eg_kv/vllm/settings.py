"""The connector's settings: vLLM's ``kv_connector_extra_config`` over the
``EPISTEMIC_GRAPH_KVCACHE_*`` environment.

Every :class:`~eg_kv.client.settings.KvCacheConfig` keyword but the token is accepted
(``base_url``, ``addr``, ``timeout_s``, ``max_connections``, ``verify_tls``, ...; vLLM logs
its config at start, so the token comes from the environment only), with
``url`` as another name for ``base_url``; a server set (``"http://a:9130,http://b:9130"``,
``dns+`` / ``dnssrv+`` URLs) works because the client handles it. The connector's own keys
are in :data:`CONNECTOR_KEYS`. No vLLM import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..blockkey import say_once
from ..client.options import split_options
from ..client.settings import KvCacheConfig
from ..errors import ConfigError

#: The connector's own keys and their defaults.
CONNECTOR_KEYS: dict[str, Any] = {
    # Threads that PUT saved blocks (and GET loaded ones) in parallel.
    "io_threads": 4,
    # Saved blocks waiting for their PUT, in bytes, before a save waits for room.
    "max_pending_bytes": 256 * 1024 * 1024,
    # A step's loads are staged in host memory at most this many bytes at a time (waves):
    # a whole 128k-token prompt of an 8B model, loaded in one step, staged ~16 GiB.
    "max_load_bytes": 256 * 1024 * 1024,
    # The lease a scheduler lookup asks on its hits, in ms (the server grants at most its
    # --lease-ms); the scheduler releases it once the step that loads it is over. 0: no
    # leases (docs/leases.md).
    "lease_ms": 5000,
    # 1: relay eg-kv's event log on vLLM's KV-events stream (eg_kv.vllm.events); 0: off.
    "events": 0,
}
#: Keys that may be 0 (the others must be at least 1).
ZERO_OK = frozenset({"lease_ms", "events"})


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """A connector's client config and its own knobs."""

    client: KvCacheConfig
    io_threads: int = CONNECTOR_KEYS["io_threads"]
    max_pending_bytes: int = CONNECTOR_KEYS["max_pending_bytes"]
    max_load_bytes: int = CONNECTOR_KEYS["max_load_bytes"]
    lease_ms: int = CONNECTOR_KEYS["lease_ms"]
    events: int = CONNECTOR_KEYS["events"]


def settings_from(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Build the settings from ``kv_connector_extra_config`` (``extra``) and the
    environment (``env``, default ``os.environ``): a key given in ``extra`` wins.

    Raises:
        ConfigError: an unknown key (with the known ones), a key given twice (``url`` and
            ``base_url``), or a value the client config refuses.
    """
    client_kw, own = split_options(
        extra, CONNECTOR_KEYS, "EgKvConnector (kv_connector_extra_config)",
        "kv_connector_extra_config",
    )  # fmt: skip
    client = KvCacheConfig.from_env(env, **client_kw)
    say_once(client.block_key)  # what this engine's loads can detect, once
    values: dict[str, Any] = {}
    for name, default in CONNECTOR_KEYS.items():
        raw = own.get(name, default)
        try:
            number = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
        least = 0 if name in ZERO_OK else 1
        if number < least:
            raise ConfigError(f"{name} must be at least {least}, got {number}")
        values[name] = number
    return ConnectorSettings(client=client, **values)
