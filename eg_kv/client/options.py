"""An engine integration's options: client keywords and the integration's own keys, split
once for every integration (:func:`split_options`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .settings import CONFIG_KEYWORDS

#: ``url`` is the name engine users expect; it means ``base_url``.
ALIASES = {"url": "base_url"}


def split_options(
    options: Mapping[str, Any] | None, own_keys: Mapping[str, Any], who: str, where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a component's options into client keywords and its own keys (``url`` is
    ``base_url``): the vLLM connector and tier and the SGLang backend share it.

    A ``token`` is refused: each engine logs these options at start (vLLM its
    ``non-default args``, SGLang its server args), so the token comes from the
    environment only.

    Args:
        who: the component, first in every message. where: the engine's name for the
            options, for the token's message.

    Returns:
        ``(client_kw, own)``: :class:`KvCacheConfig` keywords, and the keys of ``own_keys``.

    Raises:
        ConfigError: a token, an unknown key (naming the known ones) or one given twice
            (``url`` and ``base_url``); the message starts with ``who``.
    """
    if options and "token" in options:
        raise ConfigError(
            f"{who}: the engine logs its {where} at start, so the token is read only from "
            f"EPISTEMIC_GRAPH_KVCACHE_TOKEN: take it out of the {where}"
        )
    client_kw: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for key, value in (options or {}).items():
        name = ALIASES.get(key, key)
        if name in own_keys:
            own[name] = value
        elif name in CONFIG_KEYWORDS:
            if name in client_kw:
                raise ConfigError(f"{who}: {name!r} is given twice (url is base_url)")
            client_kw[name] = value
        else:
            known = sorted({*CONFIG_KEYWORDS, *own_keys, *ALIASES})
            raise ConfigError(f"{who}: unknown key {key!r}; known: {', '.join(known)}")
    return client_kw, own
