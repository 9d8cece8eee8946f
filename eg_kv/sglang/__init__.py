"""eg-kv as SGLang's HiCache storage backend: :class:`EgKvHiCacheStorage`
(:mod:`eg_kv.sglang.hicache`), which SGLang's ``dynamic`` backend loads with
``"module_path": "eg_kv.sglang", "class_name": "EgKvHiCacheStorage"``.

Importing this package needs no SGLang: :mod:`eg_kv.sglang.pages` (the pages' bytes and
addresses) and :mod:`eg_kv.sglang.settings` are plain Python; the backend class (and SGLang
with it) is imported when it is first asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EgKvHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "EgKvHiCacheStorage":
        from .hicache import EgKvHiCacheStorage

        return EgKvHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
