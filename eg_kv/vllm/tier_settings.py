"""The settings of :class:`~eg_kv.vllm.tier.EgKvTier`: its entry in vLLM's
``secondary_tiers`` over the ``EPISTEMIC_GRAPH_KVCACHE_*`` environment (no vLLM import).

A tier entry is ``{"type": "EgKvTier", "module_path": "eg_kv.vllm.tier", "url": ...}``;
vLLM hands every key but ``type``, ``module_path`` and ``backpressure`` to the tier. Every
:class:`~eg_kv.client.settings.KvCacheConfig` keyword but the token is accepted (``url``
is ``base_url``: one server, a list, ``dns+`` / ``dnssrv+``; ``timeout_s``, ...; vLLM logs
its config, so the token comes from ``EPISTEMIC_GRAPH_KVCACHE_TOKEN`` only), and the
tier's own keys in
:data:`TIER_KEYS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..blockkey import say_once
from ..client.options import split_options
from ..client.settings import KvCacheConfig
from ..errors import ConfigError

__all__ = ["TIER_KEYS", "TierSettings", "tier_settings_from"]

#: The tier's own keys and their defaults.
TIER_KEYS: dict[str, Any] = {
    # Threads copying blocks between the primary tier and eg-kv.
    "io_threads": 4,
    # The lease a lookup's hits take on the server (ms, clamped by the server's
    # EPISTEMIC_GRAPH_KVCACHE_LEASE_MS); 0 takes none.
    "lease_ms": 5000,
    # A lookup batch still unanswered after this long is a miss (None: 2 x timeout_s + 1).
    "lookup_deadline_s": None,
    # A load (promotion) still running after this long is reported failed at once, its
    # slots handed back when its copies end (vLLM 0.34's deferred release; None: 2 x
    # timeout_s + 1; 0: never early). Older vLLM waits for the copies, each bounded.
    "load_deadline_s": None,
    # Lookup batches in flight at once; past it a step's lookups are misses.
    "max_lookup_batches": 4,
    # Relay the tier's stores (and the server's removals, when it keeps an event log) on
    # vLLM's KV-events stream (needs kv_events_config.enable_kv_cache_events).
    "enable_kv_events": False,
    # "LOCAL" or "REMOTE": where eg-kv is, relative to this vLLM instance (or None).
    "locality": None,
    # What vLLM's offloading config does not tell the tier, for its addresses to bind
    # (eg_kv.binding): the model's revision, its weights' identity and their
    # quantization. Taken from vLLM's own config where the tier can see one.
    "revision": "",
    "weights": "",
    "quantization": "",
}


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """A tier's client config and its own knobs (see :data:`TIER_KEYS`)."""

    client: KvCacheConfig
    io_threads: int = 4
    lease_ms: int = 5000
    lookup_deadline_s: float = 1.0
    load_deadline_s: float = 0.0
    max_lookup_batches: int = 4
    enable_kv_events: bool = False
    locality: str | None = None
    revision: str = ""
    weights: str = ""
    quantization: str = ""


def _int(name: str, raw: Any, low: int) -> int:
    try:
        number = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"EgKvTier: {name} must be an integer, got {raw!r}") from None
    if number < low or isinstance(raw, bool):
        raise ConfigError(f"EgKvTier: {name} must be an integer of at least {low}, got {raw!r}")
    return number


def _seconds(own: Mapping[str, Any], name: str, default: float, *, zero: bool) -> float:
    """Option ``name`` in seconds (``default`` when absent or None).

    Raises:
        ConfigError: not a number, negative, or 0 where ``zero`` is False.
    """
    raw = own.get(name)
    if raw is None:
        return default
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"EgKvTier: {name} must be seconds, got {raw!r}") from None
    if not (seconds >= 0 if zero else seconds > 0) or isinstance(raw, bool):
        least = "0 or more" if zero else "over 0"
        raise ConfigError(f"EgKvTier: {name} must be {least}, got {raw!r}")
    if not math.isfinite(seconds):  # inf is no deadline: where there may be none, 0 says it
        never = " (0: never)" if zero else ""
        raise ConfigError(f"EgKvTier: {name} must be a finite number of seconds{never}, "
                          f"got {raw!r}")  # fmt: skip
    return seconds


def tier_settings_from(
    options: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> TierSettings:
    """Build the settings from a tier entry's options and the environment (``env``,
    default ``os.environ``): a key given in ``options`` wins.

    Raises:
        ConfigError: an unknown key (naming the known ones), a key given twice (``url``
            and ``base_url``), a value out of range, or one the client config refuses.
    """
    client_kw, own = split_options(
        options, TIER_KEYS, "EgKvTier", "kv_connector_extra_config (the tier's entry)"
    )
    client = KvCacheConfig.from_env(env, **client_kw)
    say_once(client.block_key)  # what this engine's loads can detect, once
    # A set's fall-through can take two timeouts.
    lookup_deadline = _seconds(own, "lookup_deadline_s", 2 * client.timeout_s + 1.0, zero=False)
    load_deadline = _seconds(own, "load_deadline_s", 2 * client.timeout_s + 1.0, zero=True)
    locality = own.get("locality")
    if locality is not None and locality not in ("LOCAL", "REMOTE"):
        raise ConfigError(f"EgKvTier: locality must be LOCAL or REMOTE, got {locality!r}")
    events = own.get("enable_kv_events", False)
    if not isinstance(events, bool):
        raise ConfigError(f"EgKvTier: enable_kv_events must be true or false, got {events!r}")
    return TierSettings(
        client=client,
        io_threads=_int("io_threads", own.get("io_threads", TIER_KEYS["io_threads"]), 1),
        lease_ms=_int("lease_ms", own.get("lease_ms", TIER_KEYS["lease_ms"]), 0),
        lookup_deadline_s=lookup_deadline,
        load_deadline_s=load_deadline,
        max_lookup_batches=_int(
            "max_lookup_batches",
            own.get("max_lookup_batches", TIER_KEYS["max_lookup_batches"]),
            1,
        ),
        enable_kv_events=events,
        revision=str(own.get("revision") or ""),
        weights=str(own.get("weights") or ""),
        quantization=str(own.get("quantization") or ""),
        locality=locality,
    )
