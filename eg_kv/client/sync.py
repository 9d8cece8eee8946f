"""The synchronous client of one server: standard library only, kept-alive pooled connections.

:class:`ServerConnector` speaks the HTTP contract (``GET/PUT/HEAD/DELETE /kv/<addr>``,
``GET /kv/<addr>/exists``, ``POST /kv/batch/exists``, ``GET /kv/stats``) over HTTP/1.1
connections (:mod:`eg_kv.client.http11`, standard library only) that are kept alive and reused
from a small thread-safe pool.

The hot path (``get``, ``get_into``, ``put``, ``contains``, ``exists``, ``delete``,
``contains_prefix``, ``exists_many``) never raises: any transport or protocol error is a
miss (``None`` / ``False`` / ``0``), and no call waits longer than about the configured
timeout. ``stats()`` raises :class:`~eg_kv.errors.RemoteError` (or
:class:`~eg_kv.errors.Unauthorized`) with a one-line message instead.

The bearer token is sent in a header only; it never appears in a URL, a log line, a
``repr`` or an error message.

The public name, :class:`eg_kv.client.connectors.RemoteKVConnector`, is this class when
``base_url`` names one server and a set connector (:mod:`eg_kv.client.sets`) otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

from ..engine import NO_ENGINE, EngineName, engine_header_lines
from ..slab.local import LocalSlab
from ..wire import BATCH_EXISTS_PATH, BATCH_RELEASE_PATH, encode_addresses
from . import plans
from .bodies import byte_views, into_bytes
from .core import OVER_HTTP, OneServer
from .events import DEFAULT_LIMIT as DEFAULT_EVENTS_LIMIT
from .events import EventBatch, Snapshot
from .interface import MayStart, ReadExact, Sink, Unreachable
from .localreads import ROUTE as LOCAL_ROUTE
from .members import parse_server_set
from .plans import drive
from .rules import (
    KvCacheStats,
    Miss,
    ProbeUnanswered,
    batch_body,
    capped,
    checksum_line,
    to_address,
    to_addresses,
)
from .setstats import MemberStats, member_line
from .settings import KvCacheConfig
from .sync_http import (
    COMPACT_HEAD,
    JSON_HEAD,
    PUT_HEAD,
    RELEASE_HEAD,
    Transport,
    block_body,
    block_status,
    drained,
    exists_body,
    flag_body,
    json_body,
    lease_line,
    small_body,
    snapshot_body,
    with_refusal,
)

__all__ = ["ServerConnector", "member_connector"]

T = TypeVar("T")
C = TypeVar("C", bound="ServerConnector")


class ServerConnector(OneServer):
    """Synchronous client of one eg-kv server (standard library only). Thread-safe; a
    context manager.

    Build it with keywords (``ServerConnector(base_url=..., token=...)``), with a
    :class:`KvCacheConfig`, or from the environment with :meth:`from_env`.

    Keys: a string that is a valid address (a token hash) is used verbatim; any other key
    (an LMCache key with ``/``, bytes) is mapped to a stable digest (:func:`to_address`).
    """

    def __init__(
        self,
        config: KvCacheConfig | None = None,
        *,
        on_unreachable: Unreachable | None = None,
        **settings: Any,
    ) -> None:
        """Args:
            config: a ready config; or leave it out and pass ``settings``.
            on_unreachable: called with each transport error (refused, reset, timed
                out): a server set marks its member down.
            **settings: ``base_url``, ``addr``, ``token``, ``timeout_s``, ``num_workers``,
                ``max_connections``, ``verify_tls``, ``max_block_size``; what is left out
                comes from the environment (:meth:`KvCacheConfig.from_env`).

        Raises:
            ConfigError: a setting cannot be used, or it names a server set.
        """
        self._start(config, settings, on_unreachable, "RemoteKVConnector or SetConnector")
        self._http = Transport(self.config, self._core.headers)
        self._exchange = self._http.exchange

    @classmethod
    def from_env(cls: type[C], **settings: Any) -> C:
        """A connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings))

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection. Idempotent; later calls are misses."""
        self._http.close()
        self._core.local.close()

    def _abort_in_flight(self) -> int:
        """End this connector's requests in flight now (each is a miss, never resent): a
        server set that cut this member as a straggler frees the threads waiting on it.
        Returns how many were ended."""
        return self._http.abort_in_flight()

    def fetch(
        self,
        key: str | bytes,
        sink: Sink[T],
        may_start: MayStart | None = None,
        release_lease: bool = False,
        timeout_s: float | None = None,
    ) -> T | None:
        """GET a block and hand its body to ``sink(length, read_exact)``; None on a miss.

        ``sink`` must call ``read_exact(view)`` with views that add up to ``length`` bytes
        (in order) and return its result; if it raises, the block is a miss. A body cut
        short (the server evicted the block mid-stream) is a miss, never partial bytes;
        so is one over ``max_block_size`` or without a Content-Length, before ``sink``
        is called (nothing is allocated for it).

        ``may_start(timeout_s)`` is asked before a server set sends a second request (to
        the previous home); one server is asked once, so it is not used here.

        ``release_lease``: this load ends one of this client's leases on the block (from
        a leasing lookup: ``exists_many(..., lease_ms=...)``), hit or miss. Over HTTP it
        is a header on the GET; a local read (which cannot write the slab) releases it
        with one ``POST /kv/batch/release`` afterwards.

        ``timeout_s``: the GET's deadline, when shorter than the config's (a load's own
        deadline: a GET started just before it ran a whole ``timeout_s`` past it).

        Never raises on a transport or protocol error.
        """
        address, core = to_address(key), self._core
        try:
            slab = self._local(probe=timeout_s is None)  # its own deadline: probed beside
        except ProbeUnanswered:
            return None
        sink = core.keyed(address, sink)
        local = core.local_fetch(slab, address, sink)
        if local is not OVER_HTTP:
            if release_lease:
                self.release([address])  # here, if the lease was taken here
            return local  # type: ignore[no-any-return]
        release_header = core.release_header(slab, address, release_lease)
        try:
            return self._exchange(
                "GET",
                core.block_path(address),
                partial(block_body, core, address, sink),
                headers=RELEASE_HEAD if release_header else b"",
                timeout_s=capped(timeout_s, self.config.timeout_s),
            )
        except Exception as exc:
            core.miss("GET", address, exc)
            return None
        finally:
            if release_lease and not release_header:
                self.release([address])  # this client's local lease: no request

    @property
    def reads_locally(self) -> bool:
        """Whether this client's reads are copies from the server's slab (it is on the
        server's host and has mapped it): a batch of small reads then runs fastest one
        after another on one thread (no hand-off, no GIL contention)."""
        try:
            return self._local() is not None
        except ProbeUnanswered:
            return False

    def _local(self, probe: bool = True) -> LocalSlab | None:
        """The server's slab mapped here, when this client is on its host (else None).

        Args:
            probe: ask the server where its slab is now if that is due; False for a call
                with a deadline shorter than the config's (an inline lookup): the probe
                is not its to pay, and runs on a thread of its own instead.

        Raises:
            ProbeUnanswered: the probe got no answer (the call's miss).
        """
        local = self._core.local
        if local.due():
            if probe and self._core.probes_inline:
                self._core.probed(self._probe())
            else:
                threading.Thread(target=self._probe, name="eg-kv-local-probe", daemon=True).start()
        return local.slab

    def _probe(self) -> Exception | None:
        """Ask the server where its slab is (``GET /kv/local/slab``) and map it if it can;
        the error of a probe that got no answer."""
        try:
            answer = self._exchange("GET", self._core.path(LOCAL_ROUTE), small_body)
        except Exception as exc:
            self._core.miss("GET", LOCAL_ROUTE, exc)
            return exc
        self._core.local.adopt(*answer)
        return None

    # ------------------------------------------------------------------ the API

    def get(self, key: str | bytes, release_lease: bool = False) -> bytes | None:
        """``GET /kv/<addr>``: the block's bytes, or None on a miss or any error.

        ``release_lease``: the load ends one of this client's leases on it (see
        :meth:`fetch`)."""
        return self.fetch(key, into_bytes, release_lease=release_lease)

    def get_into(self, key: str | bytes, buffer: Any, release_lease: bool = False) -> int | None:
        """``GET /kv/<addr>`` straight into ``buffer`` (a writable buffer, no extra copy).

        ``release_lease``: the load ends one of this client's leases on it (see
        :meth:`fetch`).

        Returns:
            The block's length when it fits in ``buffer`` (the first bytes of ``buffer``
            now hold it); None on a miss, an error, or a block larger than ``buffer``.
        """
        view = memoryview(buffer).cast("B")

        def sink(length: int, read_exact: ReadExact) -> int:
            if length > len(view):
                raise Miss(f"block of {length} bytes does not fit a {len(view)}-byte buffer")
            read_exact(view[:length])
            return length

        return self.fetch(key, sink, release_lease=release_lease)

    def put(self, key: str | bytes, data: Any) -> bool:
        """``PUT /kv/<addr>``: store ``data`` (any bytes-like object; sent without a copy).

        Returns:
            True when the server holds the block (201 new, 200 deduplicated); False on any
            refusal or error.
        """
        return self.put_status(key, (data,)) in (200, 201)

    def put_parts(self, key: str | bytes, parts: Iterable[Any]) -> bool:
        """``PUT /kv/<addr>`` of the concatenation of ``parts``, each sent without a copy.

        Returns:
            True on 200/201, False on any refusal or error.
        """
        return self.put_status(key, parts) in (200, 201)

    def put_status(
        self, key: str | bytes, parts: Iterable[Any], engine: EngineName = NO_ENGINE,
        timeout_s: float | None = None,
    ) -> int | None:  # fmt: skip
        """``PUT /kv/<addr>`` of the concatenation of ``parts`` (bytes-like, no copy).

        A body over 64 KiB asks ``Expect: 100-continue`` first: a server that answers from
        the head alone (a dedup hit, a refusal) is never sent it. A PUT is never sent
        twice. ``engine``: the block's name as its engine knows it (:mod:`eg_kv.engine`),
        which the server's KV events publish. ``timeout_s``: the PUT's deadline, when
        shorter than the config's (what is left of an engine's batch).

        Returns:
            The final HTTP status (201 stored, 200 deduplicated, 409, 413, 503, 507, 401,
            ...), or None when no usable answer came (transport or protocol failure).
        """
        address = to_address(key)
        views = self._core.sealed(address, byte_views(parts))  # TypeError: not a miss
        try:
            status = self._exchange(
                "PUT",
                self._core.block_path(address),
                drained,
                body=views,
                headers=PUT_HEAD + checksum_line(views) + engine_header_lines(engine),
                timeout_s=capped(timeout_s, self.config.timeout_s),
            )
        except Exception as exc:
            self._core.miss("PUT", address, exc)
            return None
        if status == 401:
            self._core.warn_unauthorized()
        return status

    def _status(self, method: str, address: str) -> int | None:
        try:
            parse = partial(block_status, method, address)
            return self._exchange(method, self._core.block_path(address), parse)
        except Exception as exc:
            self._core.miss(method, address, exc)
            return None

    def contains(self, key: str | bytes) -> bool:
        """``HEAD /kv/<addr>``: True when the block is resident; False on a miss or error."""
        address = to_address(key)
        try:
            found = self._core.local_has(self._local(), "HEAD", address)
        except ProbeUnanswered:
            return False
        return found if found is not None else self._status("HEAD", address) == 200

    def delete(self, key: str | bytes) -> bool:
        """``DELETE /kv/<addr>``: release one reference. True on 204; False otherwise.

        Never sent twice: a connection lost after the request went out is a False."""
        return self._status("DELETE", to_address(key)) == 204

    def delete_status(self, key: str | bytes) -> int | None:
        """:meth:`delete`'s final HTTP status (204 released, 404 absent, ...), or None when
        no usable answer came (it may have been applied)."""
        return self._status("DELETE", to_address(key))

    def exists(self, key: str | bytes) -> bool:
        """``GET /kv/<addr>/exists``: True when resident; False on a miss or any error."""
        address = to_address(key)
        try:
            found = self._core.local_has(self._local(), "exists", address)
        except ProbeUnanswered:
            return False
        if found is not None:
            return found
        try:
            path = self._core.block_path(address, "/exists")
            return self._exchange("GET", path, partial(exists_body, address))
        except Exception as exc:
            self._core.miss("exists", address, exc)
            return False

    def exists_many(self, keys: Sequence[str | bytes], lease_ms: int | None = None) -> list[bool]:
        """Which keys are resident: one batch request per 1024 keys.

        Args:
            lease_ms: lease every hit for this many ms (the server grants at most its
                ``--lease-ms``): eviction passes over it until a load with
                ``release_lease=True``, :meth:`release`, or the lease's end. None or 0:
                no lease (and a local lookup on the server's host).

        Returns:
            One bool per key; all False for a batch that failed.
        """
        return drive(plans.exists_many(self._core, to_addresses(keys), lease_ms), self._answer)

    def try_exists_many(
        self, keys: Sequence[str | bytes], lease_ms: int | None = None
    ) -> list[bool] | None:
        """Like :meth:`exists_many`, but None when any batch request failed (so a caller
        can tell "absent" from "could not ask"). Never raises."""
        return self.try_exists_addresses(to_addresses(keys), lease_ms=lease_ms)

    def try_exists_addresses(
        self,
        addresses: Sequence[str],
        timeout_s: float | None = None,
        lease_ms: int | None = None,
        local_only: bool = False,
    ) -> list[bool] | None:
        """:meth:`try_exists_many` for ready-made addresses (no per-key mapping: the L2
        connector's lookups are latency-bound). Never raises.

        Args:
            timeout_s: the deadline of each request, when shorter than the config's.
            lease_ms: lease the hits (see :meth:`exists_many`).
            local_only: answer from the server's slab mapped here, or None with no
                lookup sent (on another host, before the slab is mapped, or where the
                server must answer): for a caller that may not wait for a request. (A
                probe of where the slab is may go out on a thread of its own.)
        """
        plan = plans.try_exists(self._core, addresses, timeout_s, lease_ms, local_only)
        return drive(plan, self._answer)

    def contains_prefix(self, keys: Sequence[str | bytes], lease_ms: int | None = None) -> int:
        """How many of ``keys``, from the first, are resident without a gap (prefix hits).

        Args:
            lease_ms: lease the prefix's blocks (see :meth:`exists_many`); hits past the
                prefix, which no one will load, are released at once.

        Returns:
            The prefix length; 0 on any error.
        """
        plan = plans.contains_prefix(self._core, to_addresses(keys), lease_ms)
        return drive(plan, self._answer)

    def release(self, keys: Sequence[str | bytes]) -> int:
        """End one lease on each key's block: here, for a lease this client took on the
        local slab; else ``POST /kv/batch/release``, one per 1024.

        Returns:
            How many leases were released (one that had ended, or none held, counts 0);
            0 for a batch that failed. Never raises.
        """
        return drive(plans.release(self._core, to_addresses(keys)), self._answer)

    def _answer(self, step: plans.Step) -> Any:
        """Send the request a plan asks for (:mod:`eg_kv.client.plans`); its answer."""
        if isinstance(step, plans.Mapped):
            return self._local(probe=step.probe)
        if isinstance(step, plans.Batch):
            n, compact = len(step.addresses), step.compact
            return self._exchange(
                "POST",
                self._core.path(BATCH_EXISTS_PATH),
                partial(with_refusal, partial(flag_body, n) if compact else json_body),
                body=(encode_addresses(step.addresses) if compact else batch_body(step.addresses),),
                headers=(COMPACT_HEAD if compact else JSON_HEAD) + lease_line(step.lease_ms),
                timeout_s=step.timeout_s,
            )
        if isinstance(step, plans.Release):
            return self._exchange(
                "POST",
                self._core.path(BATCH_RELEASE_PATH),
                partial(flag_body, len(step.addresses)),
                body=(encode_addresses(step.addresses),),
                headers=COMPACT_HEAD,
            )
        if isinstance(step, plans.GetSnapshot):
            return self._exchange("GET", step.target, snapshot_body)
        return self._exchange("GET", step.target, json_body, timeout_s=step.timeout_s)

    def stats(self) -> KvCacheStats:
        """``GET /kv/stats``.

        Raises:
            Unauthorized: the server refused the token.
            RemoteError: the server is unreachable or answered something unusable.
        """
        return drive(plans.stats(self._core), self._answer)

    def healthz(self) -> dict[str, Any] | None:
        """``GET /healthz``: the decoded answer, or None when the server is not healthy."""
        return drive(plans.healthz(self._core), self._answer)

    def events(
        self, since: int = 0, wait: float = 0.0, limit: int = DEFAULT_EVENTS_LIMIT,
        epoch: str | None = None,
    ) -> EventBatch:  # fmt: skip
        """``GET /kv/events``: the log's events after ``since`` (waiting up to ``wait``
        seconds for one), in order; see :mod:`eg_kv.client.events` (and :func:`follow`).

        Raises:
            Unauthorized: the server refused the token.
            RemoteError: unreachable, no event log there (``--events 0``), too many
                readers waiting on its worker (503), or an unusable answer.
        """
        return drive(plans.events(self._core, since, wait, limit, epoch), self._answer)

    def snapshot(self) -> Snapshot:
        """``GET /kv/events/snapshot``: the blocks held and the log's seq they match.

        Raises:
            The same as :meth:`events`.
        """
        return drive(plans.snapshot(self._core), self._answer)

    def member_stats(self) -> list[MemberStats]:
        """This server's line, as a set of one: up with its stats, or down with the error."""
        member = parse_server_set(self.config.base_url).single
        assert member is not None  # a single-server config (checked when built)
        return [member_line(member, self.stats)]


def member_connector(config: KvCacheConfig, on_unreachable: Unreachable | None) -> ServerConnector:
    """The sync connector of one member of a server set (and of a set's probes, which run
    on threads for the async set too): the direct client, reporting its transport errors."""
    return ServerConnector(config, on_unreachable=on_unreachable)
