"""The SGLang backend's settings: SGLang's ``--hicache-storage-backend-extra-config`` over
the ``EPISTEMIC_GRAPH_KVCACHE_*`` environment. No SGLang import.

Every client setting but the token is accepted (``url`` or ``base_url``, ``timeout_s``,
``verify_tls``, ...); the token only from the environment, since SGLang logs its server
arguments. The backend's own keys are :data:`BACKEND_KEYS`.
"""

from __future__ import annotations

from typing import Any

from ..client.options import split_options
from ..client.settings import KvCacheConfig
from ..errors import ConfigError

#: The backend's own keys in the extra config, and their defaults.
BACKEND_KEYS: dict[str, Any] = {
    # The lease batch_exists asks on its hits, in ms (the server grants at most its
    # --lease-ms); the get releases it. 0: no leases.
    "lease_ms": 5000,
    # Threads that move a batch's pages at once.
    "io_threads": 4,
    # What SGLang's config does not say of the engine, for the addresses to bind.
    "revision": "",
    "weights": "",
    "quantization": "",
}
#: Keys SGLang's factory reads from the same config (not ours to check).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "tp_lcm_size"})  # fmt: skip


def backend_options(extra: dict[str, Any] | None) -> tuple[KvCacheConfig, dict[str, Any]]:
    """The client config and the backend's own settings from SGLang's extra config.

    Raises:
        ConfigError: a token in the config, an unknown key, or a bad value.
    """
    options = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
    client_kw, own = split_options(
        options, BACKEND_KEYS, "EgKvHiCacheStorage", "--hicache-storage-backend-extra-config"
    )
    settings = {**BACKEND_KEYS, **own}
    for name in ("lease_ms", "io_threads"):
        try:
            settings[name] = int(settings[name])
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be an integer, got {settings[name]!r}") from None
    if settings["lease_ms"] < 0 or settings["io_threads"] < 1:
        raise ConfigError("lease_ms must be at least 0 and io_threads at least 1")
    return KvCacheConfig.from_env(**client_kw), settings
