"""LMCache in-engine remote backend: :class:`EgKvRemoteConnector`.

LMCache's ``RemoteBackend`` builds it through a connector adapter, preferably ours
(:class:`eg_kv.lmcache.adapter.EgKvConnectorAdapter`), which hands over what LMCache gives
an adapter: its config, its metadata and the plugin's name::

    remote_storage_plugins: ["egkv"]            # or ["egkv.a", "egkv.b"]: one per server
    extra_config:
      remote_storage_plugin.egkv.module_path: eg_kv.kvcache
      remote_storage_plugin.egkv.class_name: EgKvConnectorAdapter
      remote_storage_plugin.egkv.base_url: http://127.0.0.1:9130   # optional

``class_name: EgKvRemoteConnector`` also works for one instance with a CPU backend:
LMCache then builds the connector itself and tells it neither its name nor its metadata,
so the name is found from the config (refused when several instances use this class).

``base_url``, ``addr``, ``timeout_s``, ``num_workers``, ``max_connections`` and
``verify_tls`` are read from ``remote_storage_plugin.<name>.*``; what is missing comes from
the ``EPISTEMIC_GRAPH_KVCACHE_*`` environment. The token comes from the environment only:
``EPISTEMIC_GRAPH_KVCACHE_TOKEN``, or the variable ``remote_storage_plugin.<name>.token_env``
names (one per instance). LMCache logs ``extra_config`` verbatim, so a
``remote_storage_plugin.<name>.token`` is refused. Underneath is the same
:class:`~eg_kv.client.sync.ServerConnector` as everywhere else, run on a small thread pool so
LMCache's event loop never blocks on the network.

Each chunk is stored as LMCache's ``RemoteMetadata`` header (shapes, dtypes, format, so a
partial last chunk loads with its real shape) followed by the KV bytes, under
:func:`eg_kv.address.address_for_key` of ``CacheEngineKey.to_string()`` and of what
changes a chunk's bytes (:attr:`EgKvRemoteConnector.layout_tag`: serde, chunk header on or
off, memory format, dtypes, shapes, and the engine's binding: :mod:`eg_kv.binding`, from
vLLM's current config where it has one, else from the model LMCache names and
``remote_storage_plugin.<name>.revision``, ``.weights`` and ``.quantization``), so
differently configured engines never collide on an address and identically configured
ones share.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..address import address_for_key
from ..binding import current_binding, declared_binding
from ..blockkey import say_once
from ..client.connectors import connect
from ..client.rules import Miss
from ..client.settings import CONFIG_KEYWORDS, KvCacheConfig
from ..engine import NO_ENGINE, EngineName, hash_bytes
from ..errors import ConfigError
from .compat import CacheEngineKey, MemoryObj, RemoteConnector, RemoteMetadata
from .store_warnings import StoreWarnings
from .write_gate import GateClosed, GateSet, read_through

log = logging.getLogger("eg_kv.kvcache")

_SETTINGS = CONFIG_KEYWORDS
#: What an engine declares of its binding where vLLM's config does not say it.
_DECLARED = ("revision", "weights", "quantization")
#: ``class_name`` values that build this connector.
_OUR_CLASSES = ("EgKvRemoteConnector", "EgKvConnectorAdapter")


def plugin_name_from_config(config: Any) -> str | None:
    """The plugin instance that builds eg-kv, when LMCache did not say which.

    Returns:
        The one name in ``remote_storage_plugins`` whose ``class_name`` is ours (or the
        only plugin configured); None when there is none.

    Raises:
        ConfigError: several instances use eg-kv, so which one is being built is unknown.
    """
    extra = (getattr(config, "extra_config", None) or {}) if config is not None else {}
    names = list(getattr(config, "remote_storage_plugins", None) or [])
    mine = [n for n in names if extra.get(f"remote_storage_plugin.{n}.class_name") in _OUR_CLASSES]
    if len(mine) > 1:
        raise ConfigError(
            f"remote_storage_plugins {mine} all use eg-kv, and LMCache does not tell "
            "EgKvRemoteConnector which one it builds: set "
            "remote_storage_plugin.<name>.class_name to EgKvConnectorAdapter"
        )
    if mine:
        return mine[0]
    return names[0] if len(names) == 1 else None


def plugin_settings(
    config: Any, plugin_name: str | None, settings: tuple[str, ...] = _SETTINGS
) -> dict[str, Any]:
    """``remote_storage_plugin.<name>.<setting>`` values from LMCache's ``extra_config``,
    for each of ``settings`` (default: the client's)."""
    extra = (getattr(config, "extra_config", None) or {}) if config is not None else {}
    if plugin_name is None:
        return {}
    out: dict[str, Any] = {}
    for setting in settings:
        value = extra.get(f"remote_storage_plugin.{plugin_name}.{setting}")
        if value is not None and value != "":
            out[setting] = value
    return out


def _give_back(loading: Future[Any]) -> None:
    """The buffer a load nobody waits for any more filled goes back to LMCache."""
    obj = None if loading.cancelled() or loading.exception() else loading.result()
    if obj is not None:
        obj.ref_count_down()


def _header(head: bytes, body: int) -> Any:
    """A stored chunk's header (LMCache's ``RemoteMetadata``), believed only where the
    ``body`` bytes after it hold exactly what it declares: a header damaged or forged to
    declare more would have LMCache allocate it (and wait for room that never comes)
    before the body's checksum and tag could make the chunk a miss.

    Raises:
        Miss: the header does not parse, or declares another size than the body's.
    """
    try:
        meta = RemoteMetadata.deserialize(head)
        declared = sum(math.prod(shape) * dtype.itemsize
                       for shape, dtype in zip(meta.shapes, meta.dtypes, strict=True))  # fmt: skip
    except Exception as e:  # struct, enum, dtype table: whatever a damaged header breaks
        raise Miss(f"stored chunk's header does not parse: {e}") from None
    if declared != body or meta.length != body:
        raise Miss(f"stored chunk's header declares {declared} bytes, its body is {body}")
    return meta


class EgKvRemoteConnector(RemoteConnector):
    """An LMCache ``RemoteConnector`` over eg-kv (loaded via ``remote_storage_plugins``)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any = None,
        plugin_name: str | None = None,
        metadata: Any = None,
    ) -> None:
        """Args:
            loop: LMCache's event loop (the coroutines below run on it).
            local_cpu_backend: LMCache's CPU allocator for loaded chunks (a stand-in
                without ``.config``/``.metadata`` where LMCache has none: lookups work,
                loads are misses).
            config: the LMCache engine config (``extra_config`` holds our settings);
                default the CPU backend's.
            plugin_name: the plugin instance name (``egkv``, ``egkv.a``); when None it is
                found from ``config`` (:func:`plugin_name_from_config`).
            metadata: the LMCache engine metadata; default the CPU backend's.

        Raises:
            ConfigError: a setting cannot be used, the instance is ambiguous, or LMCache
                handed no metadata.
        """
        config = config if config is not None else getattr(local_cpu_backend, "config", None)
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if config is None or metadata is None:
            raise ConfigError(
                "LMCache handed EgKvRemoteConnector no config or metadata (no CPU backend): "
                "set remote_storage_plugin.<name>.class_name to EgKvConnectorAdapter"
            )
        super().__init__(config, metadata)
        if plugin_name is None:
            plugin_name = plugin_name_from_config(config)
        if plugin_name is None:
            # One connector, once: LMCache builds it once per backend.
            log.warning(
                "eg-kv: cannot tell which remote_storage_plugins entry builds "
                "EgKvRemoteConnector, so no remote_storage_plugin.<name>.* setting is read "
                "(only EPISTEMIC_GRAPH_KVCACHE_*): set class_name to EgKvConnectorAdapter"
            )
        self.plugin_name = plugin_name
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        settings = plugin_settings(config, plugin_name)
        if "token" in settings:  # LMCache logs extra_config verbatim at start
            raise ConfigError(
                f"remote_storage_plugin.{plugin_name}.token would be written to LMCache's "
                "log (it logs extra_config): set EPISTEMIC_GRAPH_KVCACHE_TOKEN in the "
                f"engine's environment, or remote_storage_plugin.{plugin_name}.token_env "
                "to the name of a variable that holds this instance's token"
            )
        token_env = plugin_settings(config, plugin_name, ("token_env",)).get("token_env")
        if token_env:
            token = os.environ.get(str(token_env))
            if not token:
                raise ConfigError(
                    f"remote_storage_plugin.{plugin_name}.token_env names {token_env}, "
                    "which is not set in the engine's environment"
                )
            settings["token"] = token
        self.kv_config = KvCacheConfig.from_env(**settings)
        say_once(self.kv_config.block_key)  # what this engine's loads can detect, once
        self.client = connect(self.kv_config)  # one server, or a set (eg_kv.client.sets)
        self.binding = current_binding(str(metadata.model_name)) or declared_binding(
            str(metadata.model_name),
            kv_dtype=str(metadata.kv_dtype),
            **{k: str(v) for k, v in plugin_settings(config, plugin_name, _DECLARED).items()},
        )
        self.layout_tag = self._layout_tag(config)
        self._chunk_tokens = int(getattr(config, "chunk_size", 0) or 0)  # its KV events'
        self._pool = ThreadPoolExecutor(
            max_workers=self.kv_config.num_workers, thread_name_prefix="eg-kv-remote"
        )
        self._gates = GateSet()
        self._warn = StoreWarnings(self.client, f"eg-kv LMCache plugin {plugin_name}")
        log.info("eg-kv remote connector %s on %s", plugin_name, self.kv_config.base_url)

    def _layout_tag(self, config: Any) -> str:
        """What changes a stored chunk's bytes besides its key: it goes into the address."""
        shapes = ";".join("x".join(map(str, s)) for s in self.meta_shapes)
        dtypes = ";".join(str(d).removeprefix("torch.") for d in self.meta_dtypes)
        serde = getattr(config, "remote_serde", None) or "naive"
        return (
            f"serde={serde}|meta={int(bool(self.save_chunk_meta))}|fmt={self.meta_fmt.name}"
            f"|dtypes={dtypes}|shapes={shapes}|binding={self.binding.describe()}"
        )

    def __repr__(self) -> str:
        return f"<EgKvRemoteConnector {self.plugin_name} {self.kv_config.base_url}>"

    def _engine_name(self, key: CacheEngineKey) -> EngineName:
        """The chunk as LMCache names it, for the server's KV events: its chunk hash (an int
        as 8 big-endian bytes) and the chunk size in tokens."""
        chunk_hash = getattr(key, "chunk_hash", None)
        if not isinstance(chunk_hash, (int, bytes)):
            return NO_ENGINE
        return EngineName(hash_bytes(chunk_hash), b"", self._chunk_tokens)

    def _address(self, key: CacheEngineKey) -> str:
        return address_for_key(f"{key.to_string()}\x00{self.layout_tag}")

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
        gate = self._gates.open(time.monotonic() + self.kv_config.timeout_s)

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> MemoryObj:
            if self.save_chunk_meta:
                if length < meta_len:
                    raise Miss("stored chunk is shorter than its header")
                head = bytearray(meta_len)
                read_exact(memoryview(head))
                meta = _header(bytes(head), length - meta_len)
                shapes, dtypes, fmt = meta.shapes, meta.dtypes, meta.fmt
            else:
                shapes, dtypes, fmt = self.meta_shapes, self.meta_dtypes, self.meta_fmt
            if not gate.is_open:
                raise GateClosed("the connector is closed")
            while filled:  # a set asks the previous home with the same sink after a body
                filled.pop().ref_count_down()  # that failed its check: that buffer goes back
            # No busy loop: a full L1 is a miss now, not a wait LMCache never ends.
            obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)
            if obj is None:
                raise Miss("LMCache's CPU backend has no room for the chunk")
            try:
                view = memoryview(obj.byte_array).cast("B")
                body = length - meta_len
                if self.save_chunk_meta and body != len(view):
                    raise Miss(f"chunk body is {body} bytes, its header says {len(view)}")
                if body > len(view) or body == 0:
                    raise Miss(f"chunk body of {body} bytes does not fit {len(view)}")
                # In slices, checking the gate: close() stops it at the next one.
                read_through(read_exact, view[:body], gate)
                if not self.save_chunk_meta:
                    obj = self.reshape_partial_chunk(obj, body)
                filled.append(obj)
                return obj
            except BaseException:
                obj.ref_count_down()  # give the buffer back: the chunk is a miss
                raise

        filled: list[MemoryObj] = []
        try:
            got = self.client.fetch(self._address(key), sink)
        finally:
            self._gates.release(gate)
        for obj in filled:  # checked after the sink (checksum, tag, whole body): a miss
            if obj is not got:
                obj.ref_count_down()
        return got

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """Load a chunk into a fresh LMCache buffer; None on a miss or any error. A get
        LMCache stops waiting for (its blocking timeout cancels it) gives the buffer its
        load fills back to LMCache: nobody else would."""
        loading = self._pool.submit(self._get_sync, key)
        try:
            return await asyncio.wrap_future(loading)
        except asyncio.CancelledError:
            loading.add_done_callback(_give_back)
            raise

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
        status = self.client.put_status(self._address(key), parts, self._engine_name(key))
        if status == 413:
            self._warn.too_large(sum(memoryview(p).nbytes for p in parts))
        elif status == 409:
            self._warn.conflict(
                sum(memoryview(p).nbytes for p in parts),
                "This chunk is not stored (an engine with this plugin's settings never "
                "shares an address with another layout, so this is another writer).",
            )
        return status in (200, 201)

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
        """Stop writing into LMCache's memory, end the transfers, close connections.

        No thread writes into a buffer LMCache handed out once this returns; transfers
        still running end within about ``timeout_s`` (their deadline) and are waited for
        off the event loop. Idempotent.
        """
        self._gates.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self.client.close()
