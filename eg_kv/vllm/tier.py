"""``EgKvTier``: eg-kv as a secondary tier of vLLM's offloading connector (vLLM 0.32+).

vLLM's ``OffloadingConnector`` with ``spec_name: "TieringOffloadingSpec"`` keeps a CPU
primary tier and cascades every chunk it stores there to its ``secondary_tiers``; a
chunk found in a secondary tier is promoted (copied) into a primary slot before the GPU
reads it. This tier is configured, out of tree, as::

    {"type": "EgKvTier", "module_path": "eg_kv.vllm.tier", "url": "http://kv:9130"}

(every key: :mod:`eg_kv.vllm.tier_settings`). Everything runs in the scheduler process and
never blocks it:

* **lookups** (:mod:`eg_kv.vllm.tier_lookups`): the keys a step asks about go out at the
  step's end as ONE batch-exists per server (``RETRY`` until answered); hits take a
  server-side lease (``lease_ms``), ended by their load, released when a request leaves
  them unloaded, or expired;
* **loads and stores** (:mod:`eg_kv.vllm.tier_copies`): one primary slot is one eg-kv
  block (the slot's bytes and a 16-byte digest); loads copy into the slots (a local read
  on the server's host, else a ``GET`` into the slot), stores ``PUT`` from them with
  ``Expect: 100-continue``; a block that is missing, of another length or not what was
  stored at its address fails its key (vLLM recomputes it), never lands as wrong bytes;
* :meth:`EgKvTier.drain_jobs` waits until no copy runs: no slot is written after it
  returns;
* **addresses** bind the chunk's layout as :mod:`eg_kv.vllm.addresses` does for the
  connector: vLLM's key (its block hash and KV group) mixed with a
  :class:`~eg_kv.vllm.addresses.BlockFormat` (model, dtype, tokens, the layout of a
  slot, the parallel sizes), so engines whose slots differ never share an address, and
  engines whose slots match share blocks (vLLM's block hashes must then agree: its
  default ``sha256`` prefix-caching hash does across processes);
* **events**: with ``enable_kv_events`` (and vLLM's KV events on), :meth:`take_events`
  yields the keys this tier stored, and (one server) the keys whose blocks the server
  removed, from its exact event log (:mod:`eg_kv.vllm.tier_events`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..binding import EngineBinding, current_binding, declared_binding
from ..client.connectors import connect
from ..client.interface import KvConnector
from ..engine import EngineName, hash_bytes
from .addresses import BlockFormat, block_address
from .tier_copies import CopyJobs, FinishedJob
from .tier_events import RemovalRelay
from .tier_lookups import StepLookups
from .tier_settings import TierSettings, tier_settings_from

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("eg_kv.vllm.tier")

__all__ = ["EgKvTier", "tier_binding", "tier_format"]


def tier_binding(spec: OffloadingSpec, settings: TierSettings | None = None) -> EngineBinding:
    """The engine's binding (:mod:`eg_kv.binding`), as the connector builds it: from
    vLLM's current config when one serves this model (a worker; a vLLM that sets it for the
    scheduler), else from the offloading config (the model, the KV element type as
    allocated), the model's weights as its name shows them (:func:`weights_of`) and the
    tier's ``revision``, ``weights`` and ``quantization`` options."""
    config = spec.config
    current = current_binding(config.model.name)
    if current is not None:
        return current
    return declared_binding(
        config.model.name,
        revision=settings.revision if settings else "",
        weights=settings.weights if settings else "",
        kv_dtype=str(config.model.dtype),
        quantization=settings.quantization if settings else "",
    )


def tier_format(
    spec: OffloadingSpec, row_bytes: int, binding: EngineBinding | None = None
) -> BlockFormat:
    """The :class:`BlockFormat` of one primary slot of ``spec``'s engine: what, besides
    vLLM's key, decides a stored slot's bytes (``binding``: :func:`tier_binding`'s)."""
    config = spec.config
    binding = binding or tier_binding(spec)
    parallel = config.parallel
    # Bytes that are the same under any topology may be shared across topologies (as
    # vLLM's own fs tier does); otherwise every parallel size is part of the format.
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    layout = {
        "kind": "vllm-offload-slot",
        "row_bytes": row_bytes,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
    }
    if not agnostic:
        layout.update(
            world_size=parallel.world_size, pcp_size=parallel.pcp_size, dcp_size=parallel.dcp_size
        )
    return BlockFormat(
        model=config.model.name,
        dtype=str(config.model.dtype),
        block_size=max(1, config.cache.tokens_per_hash * config.cache.blocks_per_chunk),
        layout=json.dumps(layout, sort_keys=True, separators=(",", ":")),
        tp_size=1 if agnostic else parallel.tp_size,
        pp_size=1 if agnostic else parallel.pp_size,
        binding=binding.describe(),
    )


#: Whether this vLLM's JobResult can hand a failed load's slots back later (0.34 on): only
#: then is a load past ``load_deadline_s`` reported early (:meth:`EgKvTier.get_finished_jobs`).
DEFERS_RELEASE = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}


def _takes_leases(client: Any) -> bool:
    """Whether ``client``'s batch exists can take leases (``lease_ms``)."""
    try:
        params = inspect.signature(client.try_exists_addresses).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "lease_ms" in params


class EgKvTier(SecondaryTierManager):
    """A vLLM secondary tier on eg-kv (see the module docstring).

    Args:
        offloading_spec: the engine's offloading spec (its format binds the addresses).
        primary_kv_view: the primary tier's memoryview, one slot per row.
        tier_type: the name vLLM registered this tier under (``EgKvTier``).
        backpressure_detector: vLLM's optional back-pressure detector.
        **options: the tier entry's keys (:mod:`eg_kv.vllm.tier_settings`).

    Raises:
        ConfigError: an unknown or invalid option.
    """

    medium: ClassVar[Medium] = Medium.CPU  # eg-kv holds blocks in (shared) memory
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    # vLLM 0.34's manager may poll this tier from its own thread between steps (a load
    # that ends is reported then, not at the next step). Safe: vLLM calls every method
    # under its manager lock, and the tier's state keeps no thread of its own (the
    # copies, lookups and releases run on the tier's threads, behind their own locks).
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings: TierSettings = tier_settings_from(options)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        row_bytes = self.block_size_bytes
        self.format = tier_format(
            offloading_spec, row_bytes, tier_binding(offloading_spec, self.settings)
        )
        self._salt = self.format.salt(0)
        self._client: KvConnector = connect(self.settings.client)
        lease_ms = self.settings.lease_ms
        if lease_ms and not _takes_leases(self._client):
            log.warning("EgKvTier: this eg-kv client takes no leases; lookups take none")
            lease_ms = 0
        self._lease_ms = lease_ms
        self._lookups = StepLookups(
            self._probe,
            self.address,
            deadline_s=self.settings.lookup_deadline_s,
            # A hit older than half its lease is asked again before it is promoted.
            max_age_s=max(0.05, lease_ms / 2000) if lease_ms else 2.0,
            max_batches=self.settings.max_lookup_batches,
        )
        self._copies = CopyJobs(
            self._client,
            primary_kv_view,
            row_bytes,
            threads=self.settings.io_threads,
            keyed=self.settings.client.block_key is not None,
        )
        self._job_keys: dict[int, tuple[bool, list[OffloadKey]]] = {}
        self._load_leases: dict[int, list[str]] = {}
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="eg-kv-tier-release")
        self._to_release: list[str] = []
        self._lock = threading.Lock()
        self.events: list[OffloadingEvent] | None = None
        self._removals: RemovalRelay | None = None
        if self.settings.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
                self._removals = self._follow_removals()
            else:
                log.warning(
                    "EgKvTier: enable_kv_events is set but vLLM's KV cache events are off; "
                    "the tier emits none"
                )
        self.counters = {
            "stored_blocks": 0,
            "store_failed_blocks": 0,
            "loaded_blocks": 0,
            "load_failed_blocks": 0,
            "loads_cut": 0,
            "leases_released": 0,
        }
        log.info(
            "EgKvTier %s: %d-byte slots, server %s, lease %d ms",
            tier_type,
            row_bytes,
            self.settings.client.base_url,
            lease_ms,
        )

    def _follow_removals(self) -> RemovalRelay | None:
        """Follow the server's event log for removals (one server with a log: a set's
        members each keep their own, not followed here)."""
        if not self.settings.client.single:
            log.info("EgKvTier: relaying the tier's stores; removals only with one server")
            return None
        return RemovalRelay(
            lambda: connect(self.settings.client),
            wait_s=min(5.0, self.settings.client.timeout_s),
        )

    # ---------------------------------------------------------------- addresses, probes

    def address(self, key: OffloadKey) -> str:
        """The eg-kv address of ``key`` (vLLM's block hash and group, bound to the format)."""
        return block_address(bytes(key), self._salt)

    def _probe(self, addresses: list[str]) -> list[bool] | None:
        """One batch-exists per server for one step's lookups (on a lookup thread)."""
        client: Any = self._client
        if self._lease_ms:
            found: list[bool] | None = client.try_exists_addresses(
                addresses, lease_ms=self._lease_ms
            )
            return found
        result: list[bool] | None = client.try_exists_addresses(addresses)
        return result

    def _release(self, addresses: list[str]) -> None:
        """End the leases of hits that will not be loaded (in the background)."""
        release = getattr(self._client, "release", None)
        if not addresses or release is None or not self._lease_ms:
            return

        def run() -> None:
            try:  # the count the server ended (0: the request failed; they expire anyway)
                ended = int(release(addresses))
            except Exception as exc:  # the leases expire on their own
                log.debug("EgKvTier: releasing %d leases failed: %s", len(addresses), exc)
            else:
                with self._lock:
                    self.counters["leases_released"] += ended

        self._releases.submit(run)

    # ---------------------------------------------------------------- vLLM's contract

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from this step's batch, RETRY while it is in flight. Never blocks."""
        found = self._lookups.lookup(key, req_context.req_id)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """PUT the job's primary slots (pinned until the job is reported)."""
        keys = list(job_metadata.keys)
        self._job_keys[job_metadata.job_id] = (False, keys)
        addresses = [self.address(k) for k in keys]
        # vLLM's block hash is the key less its group: the server's KV events name the
        # block by it, as the engine's own stream does.
        names = [EngineName(hash_bytes(get_offload_block_hash(k)), b"", self.format.block_size)
                 for k in keys]  # fmt: skip
        self._copies.submit(
            job_metadata.job_id, False, addresses, list(job_metadata.chunk_ids), names
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Copy the job's blocks into its primary slots (the loads end their leases)."""
        keys = list(job_metadata.keys)
        self._job_keys[job_metadata.job_id] = (True, keys)
        addresses = [self.address(k) for k in keys]
        # Only the leases this tier's lookups took are released after the load: a count
        # released twice would end another holder's lease on the same block.
        self._load_leases[job_metadata.job_id] = self._lookups.consume(addresses)
        self._copies.submit(job_metadata.job_id, True, addresses, list(job_metadata.chunk_ids))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs whose copies have all ended since the last call, and (vLLM 0.34 on)
        the loads running past ``load_deadline_s``: reported failed now (vLLM recomputes
        them rather than wait), the blocks copied whole as loaded, the others' slots
        handed back when the copies still writing them end (``deferred_release``, each
        copy bounded by the client's timeout; ``drain_jobs`` waits for them)."""
        done = self._copies.finished()
        deadline = self.settings.load_deadline_s
        if DEFERS_RELEASE and deadline:
            done += self._copies.overdue(deadline)
        return [self._result(job) for job in done]

    def _result(self, done: FinishedJob) -> JobResult:
        is_load, keys = self._job_keys.pop(done.job_id)
        ok_keys = [k for k, ok in zip(keys, done.ok, strict=True) if ok]
        failed = [k for k, ok in zip(keys, done.ok, strict=True) if not ok]
        with self._lock:
            if is_load:
                self.counters["loaded_blocks"] += len(ok_keys)
                self.counters["load_failed_blocks"] += len(failed)
                if done.released is not None:  # reported before its copies ended
                    self.counters["loads_cut"] += 1
            else:
                self.counters["stored_blocks"] += len(ok_keys)
                self.counters["store_failed_blocks"] += len(failed)
        if self._removals is not None:
            for key in ok_keys:  # held by eg-kv: report when the server removes it
                self._removals.watch(self.address(key), key)
        if is_load:
            # The loads read their blocks under the leases their lookups took: end them.
            self._release(self._load_leases.pop(done.job_id, []))
            if failed:
                # Answer miss from now on: no promotion livelock on a block that fails.
                self._lookups.mark_miss(failed)
        elif self.events is not None and ok_keys:
            self.events.append(
                OffloadingEvent(
                    keys=ok_keys,
                    medium=self.medium,
                    removed=False,
                    locality=self.locality,
                    ownership=self.tier_type,
                )
            )
        # A load past its deadline (vLLM 0.34's deferred release: only then is it set).
        late = {} if done.released is None else {"deferred_release": done.released}
        if late:
            log.info("EgKvTier: a load of %d blocks still copying after %.1f s (load_deadline_s "
                     "%g): %d failed early", len(keys), done.seconds,
                     self.settings.load_deadline_s, len(failed))  # fmt: skip
        success = all(done.ok)
        return JobResult(
            job_id=done.job_id,
            success=success,
            # A partly failed load keeps the blocks that arrived whole.
            successful_keys=tuple(ok_keys) if is_load and not success and ok_keys else None,
            transfer_time=done.seconds,
            transfer_bytes=done.nbytes,
            **late,
        )

    def has_pending_work(self) -> bool:
        """True while a job is submitted and not yet reported."""
        return bool(self._job_keys)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """With ``enable_kv_events``: the tier's stores since the last call, and the
        server's removals of blocks the tier stored or loaded (one server)."""
        if self._removals is not None:
            removed = self._removals.take()
            if removed:
                assert self.events is not None
                self.events.append(
                    OffloadingEvent(
                        keys=removed,
                        medium=self.medium,
                        removed=True,
                        locality=self.locality,
                        ownership=self.tier_type,
                    )
                )
        if self.events:
            events, self.events = self.events, []
            yield from events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop the request's lookups; its unloaded hits' leases are released."""
        self._to_release.extend(self._lookups.cleanup(req_context.req_id))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's lookups as one batch; release the leases left behind."""
        self._lookups.flush()
        self._to_release.extend(self._lookups.take_unused())
        if self._to_release:
            addresses, self._to_release = self._to_release, []
            self._release(addresses)

    def drain_jobs(self) -> None:
        """Wait until every copy has ended (each within the client's timeout): no primary
        slot is written after this returns; the results stay for get_finished_jobs."""
        self._copies.drain()

    def shutdown(self) -> None:
        """Wait for the copies, stop the threads, close the client."""
        try:
            self._copies.close()
        finally:
            if self._removals is not None:
                self._removals.close(timeout_s=0.5)
            self._lookups.close()
            self._releases.shutdown(wait=True)
            self._client.close()

    def stats(self) -> dict[str, int]:
        """The tier's counters and its lookups' (for logs and tests)."""
        with self._lock:
            out = dict(self.counters)
        out.update({f"lookup_{k}": v for k, v in self._lookups.counters.items()})
        return out

    def describe(self) -> dict[str, Any]:
        """The format its addresses bind (for logs and tests)."""
        return dataclasses.asdict(self.format)
