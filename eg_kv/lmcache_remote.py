"""LMCache in-engine remote backend: :class:`EgKvRemoteConnector`.

LMCache's ``RemoteBackend`` loads it through ``remote_storage_plugins`` (LMCache config)::

    remote_storage_plugins: ["egkv"]
    extra_config:
      remote_storage_plugin.egkv.module_path: eg_kv.kvcache
      remote_storage_plugin.egkv.class_name: EgKvRemoteConnector
      remote_storage_plugin.egkv.base_url: http://127.0.0.1:9130   # optional
      remote_storage_plugin.egkv.token: ...                         # optional

``base_url``, ``addr``, ``token``, ``timeout_s``, ``num_workers``, ``max_connections`` and
``verify_tls`` are read from ``remote_storage_plugin.<name>.*``; what is missing comes from
the ``EPISTEMIC_GRAPH_KVCACHE_*`` environment. Underneath is the same
:class:`~eg_kv.client.RemoteKVConnector` as everywhere else, run on a small thread pool so
LMCache's event loop never blocks on the network.

Each chunk is stored as LMCache's ``RemoteMetadata`` header (shapes, dtypes, format, so a
partial last chunk loads with its real shape) followed by the KV bytes, under
:func:`eg_kv.address.address_for_key` of ``CacheEngineKey.to_string()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .address import address_for_key
from .client import CONFIG_KEYWORDS, KvCacheConfig, RemoteKVConnector
from .clientcore import Miss as _Miss

log = logging.getLogger("eg_kv.kvcache")

_SETTINGS = CONFIG_KEYWORDS


def _plugin_settings(config: Any, plugin_name: str | None, cls: type) -> dict[str, Any]:
    """``remote_storage_plugin.<name>.<setting>`` values from LMCache's ``extra_config``.

    LMCache builds plugin connectors without telling them their plugin name, so the name
    is the one whose ``class_name`` is this class (or the only plugin configured).
    """
    extra = (getattr(config, "extra_config", None) or {}) if config is not None else {}
    names = list(getattr(config, "remote_storage_plugins", None) or [])
    if plugin_name is None:
        mine = [n for n in names if extra.get(f"remote_storage_plugin.{n}.class_name") in (
            cls.__name__, "EgKvRemoteConnector")]  # fmt: skip
        if len(mine) == 1:
            plugin_name = mine[0]
        elif len(names) == 1:
            plugin_name = names[0]
    if plugin_name is None:
        return {}
    out: dict[str, Any] = {}
    for setting in _SETTINGS:
        value = extra.get(f"remote_storage_plugin.{plugin_name}.{setting}")
        if value is not None and value != "":
            out[setting] = value
    return out


class EgKvRemoteConnector(RemoteConnector):
    """An LMCache ``RemoteConnector`` over eg-kv (loaded via ``remote_storage_plugins``)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        plugin_name: str | None = None,
    ) -> None:
        """Args:
            loop: LMCache's event loop (the coroutines below run on it).
            local_cpu_backend: LMCache's CPU allocator for loaded chunks.
            config: the LMCache engine config (``extra_config`` holds our settings).
            plugin_name: the plugin instance name, when LMCache passes it.

        Raises:
            ConfigError: a setting cannot be used.
        """
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        settings = _plugin_settings(config, plugin_name, type(self))
        self.kv_config = KvCacheConfig.from_env(**settings)
        self.client = RemoteKVConnector(self.kv_config)
        self._pool = ThreadPoolExecutor(
            max_workers=self.kv_config.num_workers, thread_name_prefix="eg-kv-remote"
        )
        log.info("eg-kv remote connector on %s", self.kv_config.base_url)

    def __repr__(self) -> str:
        return f"<EgKvRemoteConnector {self.kv_config.base_url}>"

    @staticmethod
    def _address(key: CacheEngineKey) -> str:
        return address_for_key(key.to_string())

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ existence

    async def exists(self, key: CacheEngineKey) -> bool:
        """``HEAD`` the chunk; False on a miss or any error."""
        return await self._run(self.client.contains, self._address(key))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """``HEAD`` the chunk from the calling thread; False on a miss or any error."""
        return self.client.contains(self._address(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """Prefix hits of ``keys`` with one ``POST /kv/batch/exists`` per 1024 keys."""
        return self.client.contains_prefix([self._address(k) for k in keys])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """Prefix hits of ``keys`` (one batch request), off the event loop."""
        return await self._run(self.batched_contains, keys)

    # ------------------------------------------------------------------ data

    def _get_sync(self, key: CacheEngineKey) -> MemoryObj | None:
        meta_len = self.remote_metadata_bytes if self.save_chunk_meta else 0

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> MemoryObj:
            if self.save_chunk_meta:
                if length < meta_len:
                    raise _Miss("stored chunk is shorter than its header")
                head = bytearray(meta_len)
                read_exact(memoryview(head))
                meta = RemoteMetadata.deserialize(bytes(head))
                obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
            else:
                obj = self.local_cpu_backend.allocate(
                    self.meta_shapes, self.meta_dtypes, self.meta_fmt
                )
            if obj is None:
                raise _Miss("LMCache's CPU backend has no room for the chunk")
            try:
                view = memoryview(obj.byte_array).cast("B")
                body = length - meta_len
                if self.save_chunk_meta and body != len(view):
                    raise _Miss(f"chunk body is {body} bytes, its header says {len(view)}")
                if body > len(view) or body == 0:
                    raise _Miss(f"chunk body of {body} bytes does not fit {len(view)}")
                read_exact(view[:body])
                if not self.save_chunk_meta:
                    obj = self.reshape_partial_chunk(obj, body)
                return obj
            except BaseException:
                obj.ref_count_down()  # give the buffer back: the chunk is a miss
                raise

        return self.client.fetch(self._address(key), sink)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """Load a chunk into a fresh LMCache buffer; None on a miss or any error."""
        return await self._run(self._get_sync, key)

    def _put_sync(self, key: CacheEngineKey, memory_obj: MemoryObj) -> bool:
        data = memory_obj.byte_array
        parts: list[Any] = []
        if self.save_chunk_meta:
            meta = RemoteMetadata(
                len(data),
                memory_obj.get_shapes(),
                memory_obj.get_dtypes(),
                memory_obj.get_memory_format(),
            )
            parts.append(meta.serialize())
        parts.append(data)
        return self.client.put_parts(self._address(key), parts)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Store a chunk (header + bytes, no copy of the bytes). Never raises: a failed
        store is only a later miss."""
        if not await self._run(self._put_sync, key, memory_obj):
            log.debug("eg-kv put of %s failed; it will be a miss", key)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """``DELETE`` the chunk (release one reference); False when it was not there."""
        return self.client.delete(self._address(key))

    async def list(self) -> list[str]:
        """eg-kv stores addresses (digests), not LMCache keys: there is nothing to list."""
        return []

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when ``/healthz`` answers, 1 otherwise."""
        return 0 if await self._run(self.client.healthz) is not None else 1

    async def close(self) -> None:
        """Close connections and the thread pool. Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
