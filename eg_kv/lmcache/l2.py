"""LMCache ``native_plugin`` L2 adapter client: :class:`RemoteKVL2Connector`.

LMCache 0.5.x's multiprocess server loads it from::

    {"type": "native_plugin", "module_path": "eg_kv.kvcache",
     "class_name": "RemoteKVL2Connector", "adapter_params": {"base_url": "http://..."}}

and wraps it in ``NativeConnectorL2Adapter``, which calls the ``submit_batch_*`` methods
under its own lock and polls :meth:`RemoteKVL2Connector.event_fd` from a demux thread.
So every ``submit_batch_*`` only queues work and returns a fresh future id; the network
I/O runs on a thread pool over one shared :class:`~eg_kv.client.sync.ServerConnector`
(standard library only), and each finished batch is queued for
:meth:`RemoteKVL2Connector.drain_completions` with one write to a Linux eventfd.

A batch of stores or loads is spread over the pool key by key (one 14 MiB chunk per
connection at a time, so a batch moves over several connections at once); a batch of
existence checks is one ``POST /kv/batch/exists``, since LMCache's scheduler waits on it.

Each key is stored under its address bound to the engine's binding
(:mod:`eg_kv.lmcache.key_addresses`: the model, and the ``revision``, ``weights``,
``kv_dtype`` and ``quantization`` that ``adapter_params`` declare). LMCache hands
a lookup nothing but the keys, so that address cannot hold the chunk's length; when it is
already taken by a block of another length (409: another LMCache server with another
layout stored it first), the chunk is stored under the address of the key and its length
instead, and a load whose buffer does not match the first address tries that one. So
differently configured servers keep their own chunks and identical ones share one copy.

A delete releases only a reference this connector took: it remembers (for the last
:data:`MAX_STORED` keys it stored) the address each key went to, plain or length-qualified,
and a delete of a key it has no record of (stored before a restart, or forgotten since)
sends nothing and reports False; that reference ages out by eviction. Sending it to the
plain address could release another LMCache server's chunk.

A load never writes into LMCache's buffer after ``close()`` returned or after its batch's
deadline (:mod:`eg_kv.lmcache.write_gate`).

Leases (:mod:`eg_kv.slab.leases`): LMCache's lookup-and-lock is ``submit_batch_exists``, so
each lookup leases its hits for ``lease_ms`` (an ``adapter_params`` key, default
:data:`DEFAULT_LEASE_MS`; the server grants at most its ``--lease-ms``; 0: none), and once
a batch of loads is done, each of its keys that a lookup leased has one lease released, in
one ``release`` for the batch (a local lease on the server's host, taken and released
without HTTP: :mod:`eg_kv.slab.local_leases`; else one request per batch). A load no lookup
of this connector leased releases nothing. LMCache's unlock stays in its adapter (the
plugin never hears of it): a lock released without a load ends when its lease does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..blockkey import say_once
from ..client.connectors import connect
from ..client.lease_record import LeaseRecord
from ..client.settings import KvCacheConfig, resolve_config
from ..errors import ConfigError
from .key_addresses import KeyAddresses, binding_params, chunk_name
from .store_warnings import StoreWarnings
from .write_gate import GateSet, WriteGate, read_through

log = logging.getLogger("eg_kv.kvcache")

#: ``(future_id, ok, error, per_key_results or None)``, as LMCache's adapter unpacks it.
Completion = tuple[int, bool, str, "list[bool] | None"]

#: Keys remembered with the address this connector stored them under (for deletes): a
#: delete releases only a reference it took. 65536 entries of ~200 bytes: ~13 MiB at most.
MAX_STORED = 65536
#: References one key's stores are remembered for (LMCache storing a key again and again
#: without a delete): a delete releases these.
MAX_REFS_PER_KEY = 16

#: Lookups of at most this many keys run on the thread that submits them (LMCache's,
#: under its adapter lock) instead of the pool: the hand-off to a pool thread and back
#: was a third of a 16-key lookup (scripts/bench_lookup.py). Bigger batches go to the
#: pool, so that hashing and the answer never hold LMCache's lock for long.
INLINE_MAX_KEYS = 64
#: An inline lookup's deadline: past it the batch goes to the pool (a lookup without
#: leases changes nothing, so asking again is safe; a leasing one is inline only where the
#: slab mapped here answers it), and LMCache's lock is held no longer than this.
INLINE_TIMEOUT_S = 0.05
#: After an inline lookup failed, lookups go to the pool for this long (a slow or dead
#: server costs the submitting thread one inline deadline per period, not one per batch).
INLINE_BACKOFF_S = 5.0
#: The lease a lookup takes on its hits, in ms, unless ``adapter_params`` says
#: ``lease_ms``: LMCache loads what it locked within a scheduler step or a few.
DEFAULT_LEASE_MS = 5000


def _lease_param(raw: Any) -> int:
    """``adapter_params``' ``lease_ms`` as a whole number of ms (0: no leases).

    Raises:
        ConfigError: not a whole number, or below 0.
    """
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"lease_ms must be a whole number of ms, got {raw!r}") from None
    if value < 0 or isinstance(raw, bool):
        raise ConfigError(f"lease_ms must be 0 (no leases) or more, got {raw!r}")
    return value


class _OtherLength(Exception):
    """Internal: the block at an address has another length than the caller's buffer."""


class _Batch:
    """Per-key results of one submitted batch; the last key to finish completes it."""

    __slots__ = ("fid", "lock", "pending", "results")

    def __init__(self, fid: int, n: int) -> None:
        self.fid = fid
        self.results = [False] * n
        self.pending = n
        self.lock = threading.Lock()

    def done(self, i: int, ok: bool) -> bool:
        """Record key ``i``; True for the call that finished the batch."""
        with self.lock:
            self.results[i] = ok
            self.pending -= 1
            return self.pending == 0


class RemoteKVL2Connector:
    """The eg-kv client in the shape LMCache's ``native_plugin`` L2 adapter requires.

    Keys are LMCache key strings (``model@rank@group@hash``, which may hold ``/``); each is
    stored under :meth:`address`: the same address in every process and on every host
    that declares the same binding.
    """

    def __init__(self, config: KvCacheConfig | None = None, **adapter_params: Any) -> None:
        """Args:
            config: a ready :class:`KvCacheConfig`, or leave it out and pass keywords.
            **adapter_params: LMCache's ``adapter_params``: ``base_url``, ``addr``,
                ``token``, ``timeout_s``, ``num_workers``, ``max_connections``,
                ``verify_tls``, ``lease_ms`` (see the module docstring), the binding's
                ``revision``, ``weights``, ``kv_dtype`` and ``quantization``
                (:mod:`eg_kv.lmcache.key_addresses`), all optional; the rest comes from
                the environment.

        Raises:
            ConfigError: a parameter cannot be used.
        """
        lease_ms = _lease_param(adapter_params.pop("lease_ms", DEFAULT_LEASE_MS))
        self.addresses = KeyAddresses(binding_params(adapter_params))
        if adapter_params.get("token"):
            # LMCache logs adapter_params verbatim when it builds the adapter.
            log.warning(
                "eg-kv: a token in adapter_params ends up in LMCache's log; "
                "set EPISTEMIC_GRAPH_KVCACHE_TOKEN in the environment instead"
            )
        self.config = resolve_config(config, adapter_params)
        say_once(self.config.block_key)  # what this engine's loads can detect, once
        self._client = connect(self.config)  # one server, or a set (eg_kv.client.sets)
        # Non-blocking so drain_completions() can reset it without waiting; the counter
        # semantics let several completions share one wake-up.
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool = ThreadPoolExecutor(
            max_workers=self.config.num_workers, thread_name_prefix="eg-kv-l2"
        )
        self._ids = itertools.count(1)
        self._done: deque[Completion] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._efd_open = True
        self._gates = GateSet()
        self._warn = StoreWarnings(self._client, "eg-kv LMCache L2 adapter")
        #: key -> the address of each reference its stores took (a key stored twice holds
        #: two: a delete releases both), newest keys last.
        self._stored: OrderedDict[str, list[str]] = OrderedDict()
        # Only leases this connector's lookups took are released (eg_kv.client.lease_record).
        self._leases = LeaseRecord(self._client, lease_ms)
        self._inline_after = 0.0  # monotonic time before which lookups use the pool
        self._lookup_warned = False  # a lookup that failed without a request was logged

    def __repr__(self) -> str:
        return f"RemoteKVL2Connector({self.config.base_url!r})"

    # ------------------------------------------------------------------ interface

    def event_fd(self) -> int:
        """The eventfd that turns readable while completions wait to be drained."""
        return self._efd

    def submit_batch_set(self, keys: Sequence[str], memoryviews: Sequence[Any]) -> int:
        """Store each ``memoryviews[i]`` under ``keys[i]``; never blocks.

        The key list and the list of views are copied here (LMCache may reuse its lists);
        the views themselves stay LMCache's and are read on the pool.

        Returns:
            The future id its completion will carry (per-key: stored or not).
        """
        views = list(memoryviews)
        return self._submit_per_key(keys, lambda i, key, _gate: self._store(key, views[i]),
                                    len(views))  # fmt: skip

    def submit_batch_get(self, keys: Sequence[str], memoryviews: Sequence[Any]) -> int:
        """Load each ``keys[i]`` into ``memoryviews[i]`` in place; never blocks.

        A key counts as loaded only when the block filled its buffer exactly (a block of
        another length is a miss: LMCache would read garbage from the rest). No byte is
        written into a buffer after :meth:`close` returned or after the batch's deadline
        (``timeout_s`` x (ceil(keys / num_workers) + 1) after submit): a key starts only
        if its transfer ends before it.

        Returns:
            The future id its completion will carry (per-key: loaded or not).
        """
        views = list(memoryviews)
        return self._submit_per_key(
            keys,
            lambda i, key, gate: self._load(key, views[i], gate),
            len(views),
            after=self._release_leases,
        )

    def _store(self, key: str, data: Any) -> bool:
        size = memoryview(data).nbytes
        address, name = self.addresses.address(key), chunk_name(key)
        status = self._client.put_status(address, (data,), name)
        if status == 409:
            self._warn.conflict(size, "Its chunks go to addresses that also hold their "
                                      "length, so both keep their own copies.")  # fmt: skip
            address = self.addresses.sized(key, size)
            status = self._client.put_status(address, (data,), name)
        if status == 413:
            self._warn.too_large(size)
        if status not in (200, 201):
            return False
        with self._lock:
            refs = self._stored.pop(key, [])
            if len(refs) < MAX_REFS_PER_KEY:  # past it, the rest age out by eviction
                refs.append(address)
            self._stored[key] = refs
            while len(self._stored) > MAX_STORED:
                self._stored.popitem(last=False)
        return True

    def _load(self, key: str, buffer: Any, gate: WriteGate) -> bool:
        view = memoryview(buffer).cast("B")
        other_length = False

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> bool:
            nonlocal other_length
            if length != len(view):
                other_length = True
                raise _OtherLength(f"{length} bytes for a {len(view)}-byte buffer")
            read_through(read_exact, view, gate)
            return True

        if self._fetch(self.addresses.address(key), sink, gate):
            return True
        if other_length and gate.can_start(self.config.timeout_s):
            return bool(self._fetch(self.addresses.sized(key, len(view)), sink, gate))
        return False

    def _fetch(self, address: str, sink: Callable[..., bool], gate: WriteGate) -> bool | None:
        # Over a set a miss may ask the previous home with a fresh timeout_s: only while
        # the batch's deadline still has room for it (the same gate). Its lease is
        # released with the batch's (_release_leases).
        return self._client.fetch(address, sink, may_start=gate.can_start)

    def _release_leases(self, keys: list[str]) -> None:
        """End the leases this connector's lookups took on a finished load batch's keys;
        none once closed (they end by themselves within ``lease_ms``: a release per queued
        batch, against a stalled server, made close() wait a timeout each)."""
        if self._leases.lease_ms > 0 and not self._closed:
            self._leases.release(self.addresses.addresses(keys))

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        """Release each key's reference on the server; never blocks.

        Only a reference this connector took is released, at the address it stored the
        key under; a key it has no record of (stored before a restart, or one of more
        than :data:`MAX_STORED` since) is not sent and reports False: its reference ages
        out by eviction (the plain address may be another LMCache server's chunk).

        Returns:
            The future id its completion will carry (per-key: deleted or not).
        """
        return self._submit_per_key(keys, lambda _i, key, gate: self._delete(key, gate), len(keys))

    def _delete(self, key: str, gate: WriteGate) -> bool:
        with self._lock:
            refs = self._stored.pop(key, [])
        # One DELETE per reference, each only while the batch's deadline has room for it
        # (a key stored 16 times took 16 timeouts of a stalled server: 80 s at the
        # defaults); those not sent are kept for a later delete.
        answers: list[int | None] = []
        for address in refs:
            if not gate.can_start(self.config.timeout_s):
                break
            answers.append(self._client.delete_status(address))
        unsent = refs[len(answers) :]
        # Not applied (503): still ours, for a later delete. A lost answer may have been
        # applied: never sent again (it could end another client's reference).
        kept = [a for a, st in zip(refs, answers, strict=False) if st == 503] + unsent
        if kept:
            with self._lock:
                self._stored[key] = kept + self._stored.pop(key, [])
        return bool(refs) and not unsent and all(st == 204 for st in answers)

    def submit_batch_exists(self, keys: Sequence[str]) -> int:
        """Ask which keys are resident with one ``POST /kv/batch/exists``.

        A batch of at most :data:`INLINE_MAX_KEYS` keys to one server (not a set of
        them) is asked on the calling thread,
        within :data:`INLINE_TIMEOUT_S`; a bigger one, or one that could not be answered
        in that time, goes to the pool. So this returns within about ``INLINE_TIMEOUT_S``.

        Returns:
            The future id its completion will carry (per-key: resident or not).
        """
        fid = next(self._ids)
        keys = list(keys)  # LMCache may reuse its list after submit returns
        if not keys:
            self._complete(fid, True, "", [])
            return fid
        if self._closed:
            self._complete(fid, False, "eg-kv connector is closed", [False] * len(keys))
            return fid
        client, leasing = self._client, self._leases.asked
        # Inline only against one server (connect() built the direct client for it): a
        # set's lookup fans out over several members.
        if (
            self.config.single
            and len(keys) <= INLINE_MAX_KEYS
            and time.monotonic() >= self._inline_after
        ):
            try:
                addresses = self.addresses.addresses(keys)
            except Exception as exc:  # an error is a failed lookup, never LMCache's to catch
                self._lookup_failed(fid, len(keys), exc)
                return fid
            if leasing:
                # A leasing lookup changes state: never sent twice. Inline only where the
                # slab mapped here answers it (no request); else one request, on the pool.
                # (One timed out inline and asked again took every hit's lease twice.)
                found = client.try_exists_addresses(addresses, lease_ms=leasing, local_only=True)
            else:
                found = client.try_exists_addresses(
                    addresses, min(INLINE_TIMEOUT_S, self.config.timeout_s)
                )
                if found is None:
                    self._inline_after = time.monotonic() + INLINE_BACKOFF_S
            if found is not None:
                self._complete(fid, True, "", self._leases.note(addresses, found))
                return fid

        def run() -> None:
            try:
                if self._closed:
                    raise ConnectionAbortedError("eg-kv connector is closed")
                addresses = self.addresses.addresses(keys)
                found = self._client.try_exists_addresses(addresses, lease_ms=leasing)
            except Exception as exc:  # a completion whatever happens: LMCache waits for it
                self._lookup_failed(fid, len(keys), exc)
                return
            if found is None:  # could not ask: a failed lookup, which LMCache counts as misses
                self._complete(fid, False, "eg-kv batch exists failed", [False] * len(keys))
            else:
                self._complete(fid, True, "", self._leases.note(addresses, found))

        self._spawn(fid, run)
        return fid

    def _lookup_failed(self, fid: int, n: int, exc: BaseException) -> None:
        """Complete lookup ``fid`` of ``n`` keys as failed (LMCache counts misses), for an
        error no request raised (a model whose weights cannot be read, to bind them)."""
        if not self._lookup_warned:  # once: every lookup would say the same
            self._lookup_warned = True
            log.warning("eg-kv lookups fail: %s: %s (each a miss; warned once)",
                        type(exc).__name__, exc)  # fmt: skip
        self._complete(fid, False, f"eg-kv lookup failed: {type(exc).__name__}", [False] * n)

    def drain_completions(self) -> list[Completion]:
        """Every completion queued so far, oldest first; resets the eventfd.

        Returns:
            ``[(future_id, ok, error, per_key_bools), ...]``.
        """
        out: list[Completion] = []
        with self._lock:
            if self._efd_open:
                # Reset before taking the queue: a completion queued after this re-arms
                # the fd, so it is never missed (at worst one empty drain later).
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._efd)
            while self._done:
                out.append(self._done.popleft())
        return out

    def close(self) -> None:
        """Stop writing into LMCache's buffers at once, end the transfers, close the
        connections and the eventfd.

        Loads stop at their next 1 MiB slice; transfers still waiting on the network end
        within about ``timeout_s`` (their deadline), and close waits for them all, so once
        it returns no thread writes into a buffer of a submitted batch again. Idempotent.
        Batches submitted after close complete at once as failures.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gates.close()
        # Queued work runs, each failing at once (closed gates, a closed lookup): a
        # cancelled one would never complete, and LMCache waits on every future id.
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._client.close()
        with self._lock:
            # Under the lock: no completion can write to the number once it is closed
            # (and perhaps reused by an unrelated file).
            self._efd_open = False
            os.close(self._efd)

    # ------------------------------------------------------------------ internals

    def _complete(self, fid: int, ok: bool, error: str, results: list[bool] | None) -> None:
        with self._lock:
            self._done.append((fid, ok, error, results))
            if self._efd_open:
                os.eventfd_write(self._efd, 1)

    def _spawn(self, fid: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the pool; if the pool is gone, fail the batch at once."""
        try:
            self._pool.submit(fn)
        except RuntimeError:  # shut down
            self._complete(fid, False, "eg-kv connector is closed", None)

    def _submit_per_key(
        self,
        keys: Sequence[str],
        op: Callable[[int, str, WriteGate], bool],
        n_views: int,
        after: Callable[[list[str]], None] | None = None,
    ) -> int:
        """Run ``op`` on the pool for each key; the last to finish runs ``after(keys)``,
        then completes the batch (a load's leases are released when LMCache hears of it:
        locally a few µs, else one request for the batch)."""
        fid = next(self._ids)
        keys = list(keys)  # LMCache may reuse its list after submit returns
        n = len(keys)
        if n != n_views:
            self._complete(fid, False, f"{n} keys but {n_views} buffers", [False] * n)
            return fid
        if n == 0:
            self._complete(fid, True, "", [])
            return fid
        if self._closed:
            self._complete(fid, False, "eg-kv connector is closed", [False] * n)
            return fid
        batch = _Batch(fid, n)
        # The batch gets the time its keys would take if each waited the whole timeout,
        # num_workers at a time, plus one timeout of queueing behind other batches; past
        # that LMCache may have moved on from its buffers.
        timeout_s = self.config.timeout_s
        waves = math.ceil(n / self.config.num_workers)
        gate = self._gates.open(time.monotonic() + timeout_s * (waves + 1))

        def finish() -> None:
            self._gates.release(gate)
            results = batch.results
            if after is not None:
                try:
                    after(keys)
                except Exception:  # never raises into the pool; a lease left ends anyway
                    log.exception("eg-kv L2 batch follow-up failed")
            ok = all(results)
            error = "" if ok else f"{results.count(False)} of {n} keys failed"
            self._complete(fid, ok, error, list(results))

        def run(i: int, key: str) -> None:
            ok = False
            try:
                # Started only if it ends before the batch's deadline: LMCache may reuse
                # the buffers after it.
                if gate.can_start(timeout_s):
                    ok = bool(op(i, key, gate))
            except Exception:  # the client never raises; this guards LMCache's buffers
                log.exception("eg-kv L2 operation failed")
            if batch.done(i, ok):
                finish()

        # num_workers tasks share the batch, each taking the next key as it finishes one
        # (a range iterator steps atomically): a pool task per key cost a 1,024 x 64 KiB
        # local load 3x its serial time in futures and hand-offs. The key is hashed on
        # the pool thread: submit runs under LMCache's adapter lock.
        todo = iter(range(n))

        def drain() -> None:
            for i in todo:
                run(i, keys[i])

        for _ in range(min(n, self.config.num_workers)):
            try:
                self._pool.submit(drain)
            except RuntimeError:  # closed between the check and here: no task took them
                break
        else:
            return fid
        for i in todo:  # the keys no task will take (each taken once: the iterator)
            if batch.done(i, False):
                finish()
        return fid
