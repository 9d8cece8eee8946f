"""``EgKvConnector``: vLLM's KV connector (``KVConnectorBase_V1``, vLLM 0.32) storing KV
blocks in eg-kv.

One vLLM block (``block_size`` tokens) of one KV shard (a TP/PP rank) is ONE eg-kv
block: the per-layer slices of that block, each moved to "block first" and concatenated
in layer order. Its address is a chain hash of the token ids bound to the format
(:mod:`eg_kv.vllm.addresses`); the worker describes its layout and vLLM's handshake hands
it to the scheduler, so both sides compute the same addresses.

Scheduler side (the engine core process):

* :meth:`get_num_new_matched_tokens` asks which blocks after the locally computed ones are
  stored, with ONE batch lookup (``contains_prefix``: the compact ``POST
  /kv/batch/exists`` per server) over every shard's address of each whole block, never the
  prompt's last token (vLLM must compute one). Its only side effect: the prefix's blocks
  are leased (``lease_ms``, :mod:`eg_kv.slab.leases`) so eviction passes over them until
  the step that loads them is over, when the scheduler releases them itself
  (:mod:`eg_kv.vllm.scheduler_leases`: a lease is ended by the client that took it), or
  the lease ends. It runs in a background
  thread (:mod:`eg_kv.vllm.lookups`): answered in the same call when the server is quick,
  else ``None`` ("ask again next step") until done; a lookup past the client's timeout is
  a miss, never a stuck scheduler.
* :meth:`update_state_after_alloc` notes the tokens to load; :meth:`build_connector_meta`
  turns them into block ids and digests, and lists the blocks this step completes that
  are not stored yet (saved as soon as they are complete, so :meth:`request_finished` has
  nothing left to save: it drops the request's state and returns its counters as
  ``kv_transfer_params``).

Worker side (each model runner): :meth:`start_load_kv` GETs the blocks to load in
parallel into one staging buffer (a local read from the slab on the server's host), then
``index_copy_`` s each layer's slices into the paged KV tensors; a block is stored with its
address's tag after it (:mod:`eg_kv.vllm.trailers`), and one that did not arrive whole,
or is not its address's, is never copied and is reported by
:meth:`get_block_ids_with_load_errors` (vLLM recomputes it with
``kv_load_failure_policy="recompute"``); the blocks of that step and the next computed
after it are not saved (vLLM runs them before it hears of the failure: they attended to
whatever the block held), and the blocks vLLM recomputes are. :meth:`wait_for_save`
copies the completed blocks
out of the paged tensors (``index_select``) and hands the PUTs (``put_status``; bodies over
64 KiB ask ``Expect: 100-continue``, so a block already held moves no body) to a thread
pool: the forward pass never waits on the network for a save; :meth:`shutdown` waits for
the PUTs still in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..client.connectors import connect
from ..client.interface import KvConnector
from ..client.members import parse_server_set
from ..engine import NO_ENGINE, EngineName, chained_names
from .addresses import BlockFormat, block_addresses, connector_format, lookup_addresses, token_chain
from .events import EventRelay, LogFollowers, vllm_events
from .lookups import PendingLookups
from .scheduler_leases import SchedulerLeases
from .settings import ConnectorSettings, settings_from
from .staging import load_rows
from .trailers import address_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("eg_kv.vllm")

__all__ = ["EgKvConnector", "EgKvConnectorMetadata", "EgKvHandshake"]


@dataclasses.dataclass
class EgKvHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once its KV caches are registered: its shard's
    :class:`~eg_kv.vllm.addresses.BlockFormat` (as a dict) and shard index."""

    block_format: dict[str, Any]
    shard: int


@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to load or save: vLLM block ids and their chain digests."""

    req_id: str
    block_ids: list[int]
    digests: list[bytes]
    #: A save's blocks as vLLM names them (its block hashes, parents, block size): the
    #: server's KV events publish them (eg_kv.engine); empty for loads.
    names: list[EngineName] = dataclasses.field(default_factory=list)
    #: A save's: the request's blocks before these. One of them failed to load this step
    #: or the last (vLLM runs the step before it hears, and plans one ahead): these
    #: blocks were computed attending to whatever that block held, and are not saved.
    after: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EgKvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Tracked:
    """The scheduler's state of one request it may load or save blocks for."""

    request: Request
    extras: tuple[str, ...]
    block_ids: list[int] = dataclasses.field(default_factory=list)
    chain: list[bytes] = dataclasses.field(default_factory=list)
    saved_upto: int = 0  # blocks before this one are stored, loaded or planned
    load_tokens: int = 0  # tokens to load at the next build_connector_meta
    loaded_tokens: int = 0  # tokens loaded, less those a failed load rolled back
    loaded_span: tuple[int, int] = (0, 0)  # the last load's tokens [start, end)
    saved_blocks: int = 0


@dataclasses.dataclass
class _Layer:
    name: str
    blocks: torch.Tensor  # the layer's KV with vLLM blocks at dim 0
    offset: int  # where its bytes start in a stored block
    nbytes: int  # its bytes per block


def _request_extras(request: Request) -> tuple[str, ...] | None:
    """What besides the tokens changes a request's KV (None: not cacheable here)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None  # multimodal / embedding inputs: the token ids do not name the KV
    extras = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        extras.append(f"cache_salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(f"lora={lora.lora_name}:{getattr(lora, 'lora_path', '')}")
    return tuple(extras)


class EgKvConnector(KVConnectorBase_V1):
    """vLLM's KV connector over eg-kv (see the module docstring).

    ``kv_connector_extra_config``: ``url`` / ``base_url`` (one server or a set), ``token``,
    ``timeout_s``, ... (every :class:`~eg_kv.client.settings.KvCacheConfig` field, over the
    ``EPISTEMIC_GRAPH_KVCACHE_*`` environment), ``io_threads``, ``max_pending_bytes``,
    ``max_load_bytes`` (a step's loads staged at most this many bytes at a time),
    ``lease_ms`` (the lease a lookup takes on its hits, released by the scheduler once the
    step that loads them is over; 0: none),
    ``events`` (1: relay eg-kv's stores and removals on vLLM's KV-events stream, medium
    ``SHARED_STORAGE``: :mod:`eg_kv.vllm.events`).
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._settings: ConnectorSettings = settings_from(extra)
        self._client: KvConnector = connect(self._settings.client)
        self._block_size: int = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        for knob in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            # A block then holds block_size * cp tokens, interleaved over the ranks: an
            # address naming block_size tokens would not name what its bytes depend on.
            if int(getattr(parallel, knob, 1) or 1) > 1:
                raise ValueError(
                    f"EgKvConnector does not support {knob} > 1 (a block's KV would be "
                    f"stored under an address naming fewer tokens); run without it"
                )
        self._tp_size = int(parallel.tensor_parallel_size)
        self._pp_size = int(parallel.pipeline_parallel_size)
        model = vllm_config.model_config
        revision = getattr(model, "revision", None)
        self._model_id = f"{model.model}@{revision}" if revision else str(model.model)
        # What else decides the KV's bytes (connector_format binds it, as the tier does).
        self._vllm_config_seen = vllm_config
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "EgKvConnector: kv_load_failure_policy is %r: a block that fails to load "
                "ends its request with an error; set kv_load_failure_policy='recompute' "
                "to have vLLM recompute it",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # scheduler side
        self._formats: list[BlockFormat] | None = None
        self._tracked: dict[str, _Tracked] = {}
        # The hits' leases, ended by this client (none taken with lease_ms 0). vLLM runs
        # a step's loads before it schedules max_concurrent_batches steps on.
        lag = getattr(vllm_config, "max_concurrent_batches", self._pp_size + 1)
        self._leases: SchedulerLeases | None = None
        if self._settings.lease_ms and role == KVConnectorRole.SCHEDULER:
            self._leases = SchedulerLeases(self._client.release, lag=int(lag))
        # A lookup still running after the client's timeout (twice, for a server set's
        # retry) is a miss: a silent server never holds a request back for long. One
        # answered after it was dropped has its leases released.
        self._lookups: PendingLookups[tuple[int, list[str]]] = PendingLookups(
            deadline_s=2 * self._settings.client.timeout_s + 1.0,
            miss=(0, []),
            discard=self._unread,
        )
        # eg-kv's event log relayed to vLLM's (settings' events), once the formats are known
        self._relay: EventRelay | None = None
        self._followers: LogFollowers | None = None
        # worker side
        self._layers: list[_Layer] = []
        self._block_bytes = 0
        self._salt: bytes | None = None
        self._handshake: EgKvHandshake | None = None
        self._load_errors: set[int] = set()
        #: Block ids that failed to load in this step and the last (BlockTransfer.after).
        self._failed_steps: deque[set[int]] = deque([set(), set()], maxlen=2)
        self._pool: ThreadPoolExecutor | None = None  # saves
        self._load_pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future[int | None], int]] = deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.counters = {
            "lookups": 0,
            "lookup_hit_blocks": 0,
            "loaded_blocks": 0,
            "load_failed_blocks": 0,
            "saved_blocks": 0,
            "deduplicated_blocks": 0,
            "save_failed_blocks": 0,
            "save_skipped_blocks": 0,  # computed after a block that failed to load
            "save_dropped_blocks": 0,  # over max_pending_bytes: the server is behind
        }

    # ------------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' formats, by (pp_rank, tp_rank): the addresses a lookup asks."""
        formats: dict[int, BlockFormat] = {}
        for meta in metadata.values():
            if isinstance(meta, EgKvHandshake):
                formats[meta.shard] = BlockFormat(**meta.block_format)
        shards = self._tp_size * self._pp_size
        if sorted(formats) != list(range(shards)):
            log.error(
                "EgKvConnector: %d of %d workers described their KV layout; lookups are off",
                len(formats),
                shards,
            )
            return
        self._formats = [formats[s] for s in range(shards)]
        if self._settings.events and self._relay is None:
            self._start_relay(shards)

    def _start_relay(self, shards: int) -> None:
        """Follow each static server's event log (:mod:`eg_kv.vllm.events`)."""
        client = self._settings.client
        urls = [m.base_url for m in parse_server_set(client.base_url).static]
        self._relay = EventRelay(shards)
        kw = {"token": client.token, "timeout_s": client.timeout_s, "verify_tls": client.verify_tls}
        self._followers = LogFollowers(self._relay, urls, kw)

    def _vllm_hashes(self, request: Request, first: int, end: int) -> list[Any]:
        """vLLM's hashes of blocks ``first``..``end`` of ``request`` as its events carry
        them ([] when the relay is off)."""
        if self._relay is None:
            return []
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return [maybe_convert_block_hash(h) for h in request.block_hashes[first:end]]

    def _remember(self, request: Request, first: int, chain: Sequence[bytes]) -> None:
        """Map the addresses of ``chain`` (blocks ``first``.. of ``request``) back to its
        vLLM block hashes, for the relay."""
        relay, formats = self._relay, self._formats
        if relay is None or formats is None:
            return
        hashes = self._vllm_hashes(request, first, first + len(chain))
        relay.remember(hashes, lookup_addresses(chain[: len(hashes)], formats))

    def take_events(self) -> Any:
        """eg-kv's stores and removals since the last step, as vLLM's events (none when
        the relay is off)."""
        if self._relay is None:
            return ()
        return vllm_events(self._relay.take(), self._block_size)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, k): v for k, v in metadata.items()})

    def _chain(self, request: Request, extras: Sequence[str], blocks: int) -> list[bytes]:
        tracked = self._tracked.get(request.request_id)
        known = tracked.chain if tracked is not None else ()
        return token_chain(
            request.all_token_ids, self._block_size, extras=extras, max_blocks=blocks, known=known
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` whose whole blocks eg-kv holds (for every
        shard), never the last token; one batch lookup, no state changed but the table
        of lookups in flight.

        The lookup (hashing the chain included) runs in a background thread: a server
        that answers within a couple of milliseconds is answered in this call; otherwise
        this returns ``(None, False)`` ("ask again next step", vLLM 0.32) until it
        finished, and a lookup past the client's timeout is a miss (0)."""
        extras = _request_extras(request)
        formats = self._formats
        if extras is None or formats is None:
            return 0, False
        bs = self._block_size
        first = num_computed_tokens // bs
        limit = (request.num_tokens - 1) // bs  # the last token is always computed
        if limit <= first:
            self._lookups.drop(request.request_id)
            self._not_loaded(request.request_id)
            return 0, False
        tracked = self._tracked.get(request.request_id)
        known = list(tracked.chain) if tracked is not None else []
        tokens = list(request.all_token_ids[: limit * bs])
        hashes = self._vllm_hashes(request, first, limit)

        def lookup() -> tuple[int, list[str]]:
            chain = token_chain(tokens, bs, extras=extras, max_blocks=limit, known=known)
            addresses = lookup_addresses(chain[first:limit], formats)
            if self._relay is not None:
                self._relay.remember(hashes[: len(chain[first:limit])], addresses)
            # The prefix's hits are leased (settings' lease_ms; those past it released):
            # eviction passes over them until this side releases them (docs/leases.md).
            lease = self._settings.lease_ms or None
            prefix = self._client.contains_prefix(addresses, lease_ms=lease)
            return prefix // len(formats), addresses[:prefix] if lease else []

        answer = self._lookups.ask(request.request_id, (first, limit), lookup)
        if answer is None:
            return None, False
        hits, leased = answer
        if self._leases is not None:
            self._leases.looked_up(request.request_id, leased)
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["lookup_hit_blocks"] += hits
        return hits * bs - (num_computed_tokens - first * bs), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        extras = _request_extras(request)
        if extras is None:
            return
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(request, extras)
        tracked.load_tokens = num_external_tokens
        if not num_external_tokens:  # vLLM loads none of the hits: their leases end now
            self._not_loaded(request.request_id)

    def _unread(self, answer: tuple[int, list[str]]) -> None:
        """A lookup answered after it was dropped: its leases end now."""
        if self._leases is not None:
            self._leases.release_now(answer[1])

    def _not_loaded(self, req_id: str) -> None:
        if self._leases is not None:
            self._leases.not_loaded(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._leases is not None:  # the loads of steps that ran: their leases end
            self._leases.step()
        meta = EgKvConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan(tracked, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: what it loaded was used
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
                tracked.loaded_span = (0, 0)
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan(tracked, cached.num_computed_tokens[i], scheduled.get(req_id, 0), meta)
        return meta

    def _plan(
        self, tracked: _Tracked, computed: int, scheduled: int, meta: EgKvConnectorMetadata
    ) -> None:
        """Add one request's loads (noted at allocation) and saves (the blocks this step
        completes that are not stored) to ``meta``."""
        bs = self._block_size
        request = tracked.request
        if tracked.load_tokens:
            first = (computed - tracked.load_tokens) // bs
            end = computed // bs
            tracked.chain = self._chain(request, tracked.extras, end)
            meta.loads.append(
                BlockTransfer(
                    request.request_id, tracked.block_ids[first:end], tracked.chain[first:end]
                )
            )
            tracked.loaded_tokens += tracked.load_tokens
            tracked.loaded_span = (computed - tracked.load_tokens, computed)
            tracked.load_tokens = 0
            if self._leases is not None:
                self._leases.planned(request.request_id)
        else:
            self._rolled_back(tracked, computed)
        # Blocks already computed (local prefix hits, loads) are stored or were planned;
        # fewer than were saved: vLLM rolled the request back (a failed load), and the
        # blocks it recomputes are saved (those computed on the failed one were not).
        tracked.saved_upto = computed // bs
        done = min(computed + scheduled, len(request.all_token_ids))
        complete = min(done // bs, len(tracked.block_ids))
        if complete > tracked.saved_upto:
            tracked.chain = self._chain(request, tracked.extras, complete)
            start = tracked.saved_upto
            hashes = request.block_hashes  # vLLM's names for the blocks, chained
            lora = getattr(request, "lora_request", None)
            names = chained_names(
                hashes[start:complete], bs, hashes[start - 1] if start else None,
                tokens=request.all_token_ids[start * bs : complete * bs],
                lora_id=getattr(lora, "lora_int_id", 0) or 0,
                lora_name=getattr(lora, "lora_name", "") or "",
            )  # fmt: skip
            meta.saves.append(
                BlockTransfer(
                    request.request_id,
                    tracked.block_ids[start:complete],
                    tracked.chain[start:complete],
                    names,
                    tracked.block_ids[:start],
                )
            )
            tracked.saved_blocks += complete - start
            tracked.saved_upto = complete
            self._remember(request, start, tracked.chain[start:complete])

    @staticmethod
    def _rolled_back(tracked: _Tracked, computed: int) -> None:
        """A load failed and vLLM computes again from ``computed``: the tokens loaded
        past it were not used, and ``eg_kv_loaded_tokens`` does not count them."""
        start, end = tracked.loaded_span
        if computed < end:
            tracked.loaded_tokens -= end - max(computed, start)
            tracked.loaded_span = (start, max(computed, start))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are saved as they complete, so nothing is left to save: drop the state,
        free the blocks now, and report what this request loaded and saved."""
        self._lookups.drop(request.request_id)
        self._not_loaded(request.request_id)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        return False, {
            "eg_kv_loaded_tokens": tracked.loaded_tokens,
            "eg_kv_saved_blocks": tracked.saved_blocks,
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map each layer's KV tensor with vLLM blocks at dim 0, and describe the layout."""
        num_blocks = self._kv_cache_config.num_blocks
        layers: list[_Layer] = []
        offset = 0
        described = []
        for name, tensor in kv_caches.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.shape[0] % num_blocks:
                raise ValueError(
                    f"EgKvConnector: layer {name}'s KV tensor {tuple(tensor.shape)} does not "
                    f"hold {num_blocks} blocks at dim 0"
                )
            blocks = (
                tensor if tensor.shape[0] == num_blocks else tensor.unflatten(0, (num_blocks, -1))
            )
            nbytes = math.prod(blocks.shape[1:]) * blocks.element_size()
            layers.append(_Layer(name, blocks, offset, nbytes))
            described.append(f"{name}:{tuple(blocks.shape[1:])}:{blocks.dtype}")
            offset += nbytes
        if not layers:
            raise ValueError("EgKvConnector: vLLM registered no KV tensors")
        self._layers = layers
        self._block_bytes = offset
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = get_tp_group().rank_in_group
        pp_rank = get_pp_group().rank_in_group
        fmt = connector_format(
            self._vllm_config_seen, described, str(layers[0].blocks.dtype).removeprefix("torch.")
        )
        shard = fmt.shard_of(tp_rank, pp_rank)
        self._salt = fmt.salt(shard)
        self._format = fmt
        self._handshake = EgKvHandshake(dataclasses.asdict(fmt), shard)
        self._pool = ThreadPoolExecutor(self._settings.io_threads, thread_name_prefix="eg-kv-io")
        self._load_pool = ThreadPoolExecutor(
            self._settings.io_threads, thread_name_prefix="eg-kv-load"
        )
        log.info(
            "EgKvConnector: %d layers, %d bytes per block, shard %d of %d, server %s",
            len(layers),
            self._block_bytes,
            shard,
            fmt.shards,
            self._settings.client.base_url,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._handshake

    def _addresses(self, digests: Sequence[bytes]) -> list[str]:
        assert self._salt is not None
        return block_addresses(
            digests, self._format, self._handshake.shard if self._handshake else 0
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """GET this step's blocks (in parallel, into a staging buffer of at most
        ``max_load_bytes``: in waves past it), then copy each layer's slices into the
        paged KV; a block that did not arrive whole is reported."""
        meta = self._connector_metadata
        if not isinstance(meta, EgKvConnectorMetadata) or not meta.loads or not self._layers:
            return
        block_ids = [b for t in meta.loads for b in t.block_ids]
        addresses = [a for t in meta.loads for a in self._addresses(t.digests)]
        if not block_ids:
            return
        # One timeout for the whole load, however many waves of GETs it takes: each GET
        # gets what is left of it (eg_kv.vllm.staging.load_rows). The scheduler, whose
        # lookups leased these blocks, releases them.
        deadline = time.monotonic() + self._settings.client.timeout_s
        wave = max(1, self._settings.max_load_bytes // self._block_bytes)
        bad: list[int] = []
        for first in range(0, len(block_ids), wave):
            ids = block_ids[first : first + wave]
            bad += (ids[i] for i in self._load_wave(ids, addresses[first : first + wave],
                                                    deadline))  # fmt: skip
        if bad:
            log.warning(
                "EgKvConnector: %d of %d blocks failed to load (missing, or not %d bytes); "
                "reported for recompute",
                len(bad),
                len(block_ids),
                self._block_bytes,
            )
            self._load_errors.update(bad)
            self._failed_steps[-1].update(bad)
        with self._lock:
            self.counters["loaded_blocks"] += len(block_ids) - len(bad)
            self.counters["load_failed_blocks"] += len(bad)

    def _load_wave(self, block_ids: list[int], addresses: list[str], deadline: float) -> list[int]:
        """Load one wave of blocks into the paged KV; returns the indices that failed."""
        staging = torch.empty((len(block_ids), self._block_bytes), dtype=torch.uint8)
        assert self._load_pool is not None
        # A block counts only when it filled its row exactly (see eg_kv.vllm.staging), on
        # its own threads (saves queued behind would delay the forward pass).
        ok, bad = load_rows(
            self._client, addresses, staging.numpy(), map_fn=self._load_pool.map,
            deadline=deadline,
        )  # fmt: skip
        if not ok:
            return bad
        src_rows = staging[ok] if bad else staging
        for layer in self._layers:
            dst = layer.blocks
            ids = torch.tensor([block_ids[i] for i in ok], dtype=torch.long, device=dst.device)
            part = src_rows[:, layer.offset : layer.offset + layer.nbytes]
            values = part.contiguous().view(dst.dtype).view(len(ok), *dst.shape[1:])
            dst.index_copy_(0, ids, values.to(dst.device))
        return bad

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv` (a stored block holds every layer)."""
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves happen once all layers are written, in :meth:`wait_for_save`."""
        return

    def wait_for_save(self) -> None:
        """Copy this step's completed blocks out of the paged KV and hand their PUTs to
        the I/O threads (the blocks may be reused at once: the bytes are copied)."""
        meta = self._connector_metadata
        failed = set().union(*self._failed_steps)
        self._failed_steps.append(set())  # the step is over: the next one's failures
        if not isinstance(meta, EgKvConnectorMetadata) or not meta.saves or not self._layers:
            return
        saves = [t for t in meta.saves if failed.isdisjoint(t.after)]
        skipped = sum(len(t.block_ids) for t in meta.saves if not failed.isdisjoint(t.after))
        if skipped:
            log.warning(
                "EgKvConnector: %d blocks not saved: computed after a block that failed to "
                "load (vLLM recomputes them)",
                skipped,
            )
            with self._lock:
                self.counters["save_skipped_blocks"] += skipped
        block_ids = [b for t in saves for b in t.block_ids]
        addresses = [a for t in saves for a in self._addresses(t.digests)]
        names = [n for t in saves for n in t.names or [NO_ENGINE] * len(t.digests)]
        if not block_ids:
            return
        n = len(block_ids)
        out = torch.empty((n, self._block_bytes), dtype=torch.uint8)
        for layer in self._layers:
            src = layer.blocks
            ids = torch.tensor(block_ids, dtype=torch.long, device=src.device)
            part = src.index_select(0, ids).reshape(n, -1).view(torch.uint8)
            out[:, layer.offset : layer.offset + layer.nbytes].copy_(part)
        rows = out.numpy()
        assert self._pool is not None
        dropped = 0
        for i in range(n):
            if not self._room_for(self._block_bytes):
                dropped += 1  # the server is not keeping up: a save lost, not a stall
                continue
            future = self._pool.submit(self._put, addresses[i], rows[i], names[i])
            with self._lock:
                self._pending.append((future, self._block_bytes))
                self._pending_bytes += self._block_bytes
        if dropped:
            with self._lock:
                self.counters["save_dropped_blocks"] += dropped
                first = self.counters["save_dropped_blocks"] == dropped
            if first:
                log.warning(
                    "EgKvConnector: saves dropped: %d bytes of PUTs are waiting for the "
                    "server (max_pending_bytes); the forward pass does not wait for them "
                    "(counted in save_dropped_blocks)",
                    self._pending_bytes,
                )

    def _put(self, address: str, row: Any, name: EngineName) -> int | None:
        status = self._client.put_status(address, (row, address_tag(address)), name)
        with self._lock:
            if status == 201:
                self.counters["saved_blocks"] += 1
            elif status == 200:
                self.counters["deduplicated_blocks"] += 1
            else:
                self.counters["save_failed_blocks"] += 1
        return status

    def _room_for(self, nbytes: int) -> bool:
        """Forget finished PUTs; whether ``nbytes`` more fit under ``max_pending_bytes``
        (always, with none pending). Over it a save is dropped, never waited for: a slow
        server costs saves, not the forward pass (it waited for the oldest PUT)."""
        with self._lock:
            if any(future.done() for future, _ in self._pending):
                self._pending = deque(p for p in self._pending if not p[0].done())
                self._pending_bytes = sum(size for _, size in self._pending)
            return (
                not self._pending
                or self._pending_bytes + nbytes <= self._settings.max_pending_bytes
            )

    def flush(self) -> None:
        """Wait until every PUT handed to the I/O threads has finished."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                future, nbytes = self._pending.popleft()
                self._pending_bytes -= nbytes
            future.result()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish the PUTs in flight, then close the client."""
        try:
            self.flush()
        finally:
            self._lookups.close()
            if self._leases is not None:
                self._leases.close(timeout_s=min(1.0, self._settings.client.timeout_s))
            if self._followers is not None:
                self._followers.close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._load_pool is not None:
                self._load_pool.shutdown(wait=True)
                self._load_pool = None
            self._client.close()
            if self._layers:
                log.info("EgKvConnector worker counters: %s", self.counters)
