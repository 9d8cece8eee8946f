"""Where the L2 adapter stores an LMCache key: :class:`KeyAddresses`.

LMCache's multiprocess server names a chunk ``model@rank@group@hash[@salt]`` and nothing
else: not the model's revision or weights, not the KV cache's element type (an fp16 and a
bf16 engine of one model give the same keys and chunks of the same length). So each key's
address mixes in the engine's binding (:func:`eg_kv.binding.declared_binding`): the model
named in the key, and the ``revision``, ``weights``, ``kv_dtype`` and ``quantization`` the
adapter's ``adapter_params`` declare (one LMCache server serves one binding: give each
binding its own server and params). The weights' identity, when not declared, is what the
model's name shows on the server's host (a local directory's files, or the commit the
Hugging Face cache holds). Two servers whose engines' KV would differ never share an
address; identically configured ones share every chunk.
"""

from __future__ import annotations

from typing import Any

import xxhash

from ..address import AddressCache, address_for_key
from ..binding import declared_binding
from ..engine import ENGINE_HASH_MAX, NO_ENGINE, EngineName
from ..errors import ConfigError

#: The ``adapter_params`` that declare the binding (all optional strings).
BINDING_PARAMS = ("revision", "weights", "kv_dtype", "quantization")
#: Key -> address digests remembered (LMCache asks about the same prefixes again and
#: again; a digest is about 1 µs a key). Cleared when full: bounded, no LRU cost.
MAX_DIGESTS = 65536
#: Models whose binding is remembered (a server serves a few): cleared when full.
MAX_MODELS = 64


def chunk_name(key: str) -> EngineName:
    """The engine's name of the chunk an LMCache key names: its chunk hash (the key's
    fourth field, hex), for the server's KV events (:mod:`eg_kv.engine`); none when the
    key has no such field."""
    parts = key.split("@")
    if len(parts) < 4 or not 2 <= len(parts[3]) <= 2 * ENGINE_HASH_MAX:
        return NO_ENGINE
    try:
        return EngineName(bytes.fromhex(parts[3]))
    except ValueError:
        return NO_ENGINE


def binding_params(adapter_params: dict[str, Any]) -> dict[str, str]:
    """Take the binding's settings out of ``adapter_params`` (they are not the client's).

    Raises:
        ConfigError: one is not a string.
    """
    out = {}
    for name in BINDING_PARAMS:
        value = adapter_params.pop(name, "")
        if not isinstance(value, str):
            raise ConfigError(f"adapter_params {name} must be a string, got {value!r}")
        out[name] = value
    return out


class KeyAddresses(AddressCache):
    """The eg-kv address of each LMCache key under one declared binding (remembered)."""

    def __init__(self, declared: dict[str, str]) -> None:
        """Args:
        declared: :func:`binding_params`' answer.
        """
        super().__init__(self._bound, MAX_DIGESTS)
        self._declared = declared
        self._tags: dict[str, str] = {}  # model -> digest of its binding

    def _tag(self, key: str) -> str:
        model = key.split("@", 1)[0]
        tag = self._tags.get(model)
        if tag is None:
            if len(self._tags) >= MAX_MODELS:
                self._tags.clear()
            described = declared_binding(model, **self._declared).describe()
            tag = self._tags[model] = xxhash.xxh3_128_hexdigest(described.encode())
        return tag

    def _bound(self, key: str) -> str:
        return address_for_key(f"{key}\x00{self._tag(key)}")

    def sized(self, key: str, length: int) -> str:
        """The address of ``key`` stored with ``length`` bytes, when the plain one is
        taken by a chunk of another length."""
        return address_for_key(f"{key}\x00{self._tag(key)}\x00len={length}")
