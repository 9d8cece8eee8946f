"""eg-kv as SGLang's HiCache storage backend (its L3): :class:`EgKvHiCacheStorage`.

SGLang builds it through its own ``StorageBackendFactory`` from one line of config::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "eg-kv", "module_path": "eg_kv.sglang", "class_name": "EgKvHiCacheStorage",
      "interface_v1": 1, "url": "http://127.0.0.1:9130"}'

``url`` (or ``base_url``; a server set works too) and every other client setting but the
token come from that config or the ``EPISTEMIC_GRAPH_KVCACHE_*`` environment; the token
only from the environment (``EPISTEMIC_GRAPH_KVCACHE_TOKEN``: SGLang logs its server
arguments). The backend's own keys are :data:`eg_kv.sglang.settings.BACKEND_KEYS`.

One instance per rank. Each page SGLang names is one eg-kv block (:mod:`eg_kv.sglang.pages`:
the page in SGLang's flat order, under an address that binds the engine and the rank):

* ``batch_exists`` is one ``POST /kv/batch/exists`` per call (a local read of the slab on
  the server's host), answers the leading run of hits and leases it until the get;
* ``batch_get_v1`` reads each page straight into its slots of the host pool (a local
  copy from the slab where it is mapped, else the GET's body read into the page), checks
  the checksum (and the block key's tag, when the engine has one) and ends the leases; a
  page that fails any check is ``False``, its slots never used by SGLang;
* ``batch_set_v1`` asks once which pages eg-kv holds already (they move no body) and PUTs
  the others from the host pool's own buffers (no copy).

Every call answers: a dead or slow server makes pages misses (``False``, 0) within the
client's timeout, never an exception into SGLang's threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from ..address import AddressCache
from ..binding import declared_binding
from ..blockkey import say_once
from ..client.connectors import connect
from ..client.lease_record import LeaseRecord
from ..client.release_queue import ReleaseQueue
from ..client.rounds import MIN_LEFT_S
from ..engine import EngineName
from .pages import PageFormat, engine_names, page_format, page_views, view_at
from .settings import backend_options

log = logging.getLogger("eg_kv.sglang")


class _Counters:
    """What the backend did, for ``get_stats`` (thread-safe)."""

    NAMES = ("lookups", "hit_pages", "loaded_pages", "missed_pages", "stored_pages",
             "held_pages", "failed_pages")  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.NAMES, 0)
        self.loads: list[tuple[int, float]] = []  # (pages, bytes/s) per get since last stats
        self.stores: list[tuple[int, float]] = []

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self.values[name] += n

    def timed(self, into: list[tuple[int, float]], pages: int, nbytes: int, t0: float) -> None:
        elapsed = max(time.perf_counter() - t0, 1e-9)
        with self._lock:
            if len(into) < 4096:  # bounded between two get_stats calls
                into.append((pages, nbytes / elapsed))

    def drain(self) -> tuple[dict[str, int], list[tuple[int, float]], list[tuple[int, float]]]:
        with self._lock:
            loads, stores = self.loads, self.stores
            self.loads, self.stores = [], []
            return dict(self.values), loads, stores


class EgKvHiCacheStorage(HiCacheStorage):
    """SGLang's HiCache storage (L3) over eg-kv; built by SGLang's factory."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        """Args:
            storage_config: SGLang's ``HiCacheStorageConfig`` for this rank (its
                ``extra_config`` holds the settings).
            kwargs: what the factory passes besides (unused).

        Raises:
            ConfigError: a setting cannot be used (SGLang then fails to start, saying it).
        """
        self.storage_config = storage_config
        self.config, self.settings = backend_options(storage_config.extra_config)
        say_once(self.config.block_key)  # what this engine's loads can detect, once
        self.client = connect(self.config)  # one server, or a set (eg_kv.client.sets)
        # Releases go on a thread of their own: SGLang's threads never wait on a server.
        self._releases = ReleaseQueue(self.client.release)
        self._leases = LeaseRecord(
            self.client, self.settings["lease_ms"], send=self._releases.submit
        )
        self._pool = ThreadPoolExecutor(
            max_workers=self.settings["io_threads"], thread_name_prefix="eg-kv-hicache"
        )
        self._counters = _Counters()
        self.format: PageFormat | None = None
        self._address_cache: AddressCache | None = None
        self.mem_pool_host: Any = None
        log.info("eg-kv HiCache storage on %s (rank %s)", self.config.base_url,
                 getattr(storage_config, "tp_rank", 0))  # fmt: skip

    def __repr__(self) -> str:
        return f"<EgKvHiCacheStorage {self.config.base_url}>"

    # ------------------------------------------------------------------ host pools

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the KV host pool: its pages' format and so every address.

        Raises:
            ConfigError: the pool's layout is not one this backend reads.
        """
        super().register_mem_pool_host(mem_pool_host)
        model = str(self.storage_config.model_name or "")
        binding = declared_binding(
            model,
            revision=self.settings["revision"],
            weights=self.settings["weights"],
            kv_dtype=str(mem_pool_host.dtype),
            quantization=self.settings["quantization"],
        )
        self.format = page_format(self.storage_config, mem_pool_host, binding)
        self._address_cache = AddressCache(self.format.address)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's pool-group registration: the ``kv`` pool is the one pages come from
        (others, sidecars such as Mamba states, are not stored here)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(getattr(host_pool_name, "value", host_pool_name)) == "kv" and self.format is None:
            self.register_mem_pool_host(host_pool)

    def _addresses(self, keys: Sequence[str]) -> list[str] | None:
        """Each key's address (remembered: a lookup's keys are its load's), or None
        before SGLang registered the host pool."""
        cache = self._address_cache
        return None if cache is None else cache.addresses(keys)

    # ------------------------------------------------------------------ lookups

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, eg-kv holds: one batch request. The run
        is leased until :meth:`batch_get_v1` loads it; hits after a gap are released at
        once (SGLang loads only the run)."""
        addresses = self._addresses(keys)
        if not keys or addresses is None:
            return 0
        found = self.client.try_exists_addresses(addresses, lease_ms=self._leases.asked)
        if found is None:
            return 0
        run = found.index(False) if False in found else len(found)
        self._leases.note(addresses[:run], found[:run])
        if self._leases.asked and any(found[run:]):
            self._releases.submit(
                [a for a, hit in zip(addresses[run:], found[run:], strict=True) if hit]
            )
        self._counters.add(lookups=1, hit_pages=run)
        return run

    def exists(self, key: str) -> bool:
        """Whether eg-kv holds the page (no lease: the legacy path loads it by ``get``)."""
        addresses = self._addresses([key])
        found = None if addresses is None else self.client.try_exists_addresses(addresses)
        return bool(found and found[0])

    # ------------------------------------------------------------------ loads

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Read each page into its slots of the host pool; ``True`` per page loaded whole
        and checked. A page that misses or fails a check is ``False`` (SGLang uses the
        leading run only)."""
        views = self._views(keys, host_indices)
        if views is None:
            return [False] * len(keys)
        return self._load(keys, views)

    def _views(self, keys: list[str], host_indices: Any) -> list[list[memoryview]] | None:
        pool = self.mem_pool_host
        if not keys or pool is None or self.format is None:
            return None
        try:
            pointers, sizes = pool.get_page_buffer_meta(host_indices)
            views = page_views(pointers, sizes, len(keys), self.format.mla)
        except Exception as exc:  # SGLang's own bookkeeping: a miss, said once per call
            log.warning("eg-kv HiCache: cannot map %d pages of the host pool: %s", len(keys), exc)
            return None
        if any(sum(map(len, page)) != self.format.page_bytes for page in views):
            log.warning("eg-kv HiCache: host pool pages are not %d bytes", self.format.page_bytes)
            return None
        return views

    def _load(self, keys: list[str], views: list[list[memoryview]]) -> list[bool]:
        addresses = self._addresses(keys) or []
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout_s

        def load(address: str, page: list[memoryview]) -> bool:
            left = deadline - time.monotonic()
            if left < MIN_LEFT_S:  # the batch ran out of time: a miss, unsent
                return False
            return bool(self.client.fetch(address, _page_sink(page), timeout_s=left))

        done = self._each(load, addresses, views, local=True)
        self._leases.release(addresses)
        loaded = sum(done)
        self._counters.add(loaded_pages=loaded, missed_pages=len(done) - loaded)
        self._counters.timed(self._counters.loads, loaded, loaded * self._page_bytes, t0)
        return done

    def _each(
        self,
        fn: Callable[[str, Any], bool],
        addresses: list[str],
        items: list[Any],
        local: bool = False,
    ) -> list[bool]:
        """``fn`` over each page, on the backend's threads (``local``: reads, on this
        thread when they are copies from the slab); every one has finished (and so
        stopped writing into the host pool) when this returns. Never raises."""

        def safe(address: str, item: Any) -> bool:
            try:
                return fn(address, item)
            except Exception as exc:  # never into SGLang's threads
                log.debug("eg-kv HiCache: %s: %s", address, exc)
                return False

        # Local reads are memory copies: threads would only contend for the GIL (a batch
        # of 128 64 KiB pages took 6.4 ms on 4 threads, 3.6 ms on one: bench_sglang.py).
        if len(addresses) == 1 or (local and getattr(self.client, "reads_locally", False)):
            return list(map(safe, addresses, items))
        return list(self._pool.map(safe, addresses, items))

    @property
    def _page_bytes(self) -> int:
        return self.format.page_bytes if self.format else 0

    # ------------------------------------------------------------------ stores

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store each page from its slots of the host pool; ``True`` per page eg-kv holds
        after the call. Pages eg-kv holds already move no body (one batch request asks);
        an MLA rank that is not the writer stores nothing (the writer stores the one
        copy)."""
        if not getattr(self.storage_config, "is_storage_writer", True):
            return [True] * len(keys)
        views = self._views(keys, host_indices)
        if views is None:
            return [False] * len(keys)
        return self._store(keys, views)

    def _store(self, keys: list[str], pages: list[list[memoryview]]) -> list[bool]:
        addresses = self._addresses(keys) or []
        t0 = time.perf_counter()
        # One timeout for the whole batch, as a load has: SGLang's backup thread (and its
        # detach, which waits 10 s for it) must not wait a timeout per page.
        deadline = time.monotonic() + self.config.timeout_s
        held = self.client.try_exists_addresses(addresses)
        if held is None:  # no server answered: the PUTs would wait on it too
            self._counters.add(failed_pages=len(keys))
            return [False] * len(keys)
        todo = [n for n, hit in enumerate(held) if not hit]
        names = engine_names(keys, self.format.page_tokens if self.format else 0)

        def put(address: str, item: tuple[list[memoryview], EngineName]) -> bool:
            left = deadline - time.monotonic()
            if left < MIN_LEFT_S:  # the batch ran out of time: not stored, unsent
                return False
            return self.client.put_status(address, item[0], item[1], left) in (200, 201)

        items = [(pages[n], names[n]) for n in todo]
        stored = self._each(put, [addresses[n] for n in todo], items)
        out = list(held)
        for n, ok in zip(todo, stored, strict=True):
            out[n] = ok
        self._counters.add(stored_pages=sum(stored), held_pages=len(keys) - len(todo),
                           failed_pages=len(stored) - sum(stored))  # fmt: skip
        self._counters.timed(self._counters.stores, sum(stored), sum(stored) * self._page_bytes, t0)
        return out

    # ------------------------------------------------------------------ legacy copy path

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The legacy path: read the page into ``target_location`` (a flat page tensor;
        a new one when None); None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """The legacy path: each page into its flat page tensor, or None."""
        if self.mem_pool_host is None or self.format is None:
            return [None] * len(keys)
        targets = list(target_locations or [None] * len(keys))
        for n, target in enumerate(targets):
            if target is None:
                try:
                    targets[n] = self.mem_pool_host.get_dummy_flat_data_page()
                except NotImplementedError:  # a pool without flat pages (K, V dims differ)
                    return [None] * len(keys)
            elif not target.is_contiguous() or target.device.type != "cpu":
                # Its bytes are not where a flat view of it says: the read would land in
                # whatever lies after it (other pages of the pool). A miss instead.
                targets[n] = None
        views = [[_tensor_view(t)] if t is not None else [] for t in targets]
        done = self._load(keys, views)
        return [t if ok else None for t, ok in zip(targets, done, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """The legacy path: store one flat page tensor."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """The legacy path: store flat page tensors; True when eg-kv holds every one."""
        if self.format is None or values is None or len(values) != len(keys):
            return False
        if not getattr(self.storage_config, "is_storage_writer", True):
            return True
        # The views hold no reference: ``tensors`` keeps the contiguous copies alive until
        # the PUTs end (a temporary was freed before its PUT read it).
        tensors = [v.contiguous() for v in values]
        pages = [[_tensor_view(t)] for t in tensors]
        if any(len(p[0]) != self.format.page_bytes for p in pages):
            return False
        return all(self._store(keys, pages))

    # ------------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Nothing: eg-kv is shared with other engines, whose pages a flush of this one's
        cache must not take away (pages age out by the server's eviction)."""
        log.info("eg-kv HiCache: clear() leaves the shared store as it is")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the pages moved since the last call, with the
        backend's counters as its ``eg_kv`` attribute (a dict: lookups, hit, loaded,
        missed, stored, held and failed pages, and the client's checksum failures and
        forged blocks)."""
        values, loads, stores = self._counters.drain()
        values["checksum_failures"] = int(getattr(self.client, "checksum_failures", 0))
        values["forged_blocks"] = int(getattr(self.client, "forged_blocks", 0))
        metrics = _storage_metrics()
        metrics.prefetch_pgs = [p for p, _ in loads]
        metrics.prefetch_bandwidth = [b / 1e9 for _, b in loads]  # GB/s, as SGLang's
        metrics.backup_pgs = [p for p, _ in stores]
        metrics.backup_bandwidth = [b / 1e9 for _, b in stores]
        metrics.eg_kv = values
        return metrics

    def close(self) -> None:
        """Stop the threads and close the connections (idempotent)."""
        self._pool.shutdown(wait=True)
        self._releases.close()  # releases still queued end on their own
        self.client.close()


def _page_sink(page: list[memoryview]) -> Callable[[int, Callable[[memoryview], None]], bool]:
    """A fetch sink that reads a block into the page's pieces, in order; a block of
    another length is a miss before a byte is written."""
    total = sum(map(len, page))

    def sink(length: int, read_exact: Callable[[memoryview], None]) -> bool:
        if length != total:
            raise ValueError(f"a {length}-byte block for a {total}-byte page")
        for view in page:
            read_exact(view)
        return True

    return sink


def _tensor_view(tensor: Any) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy)."""
    return view_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _storage_metrics() -> Any:
    """SGLang's ``StorageMetrics``, or a plain object with its fields where the module
    that holds it does not import (it pulls in SGLang's whole model-config tree)."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception:  # an SGLang install without its multimodal extras

        class StorageMetrics:  # type: ignore[no-redef]
            pass

    return StorageMetrics()
