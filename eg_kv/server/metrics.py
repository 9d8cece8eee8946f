"""Prometheus metrics for ``GET /metrics``, aggregated over every worker process.

Request counts and latencies live in prometheus_client's multiprocess mode: each worker
writes its own memory-mapped files into the server's metrics directory and any worker
renders the sum of all of them (those of dead workers included, so counters never go
back: the supervisor folds a dead worker's files into one archive per type,
:mod:`.metrics_fold`). The slab's counters are already global (they live in the shared
segment), so they are read straight from the slab at scrape time rather than copied into
per-process files.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from ..disk.store import COUNTERS as _DISK_COUNTERS
from ._compat import histogram_parts
from .metrics_fold import scrape_lock
from .tenants import RESERVED_NAMESPACE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds between flushes of a worker's request counts into the shared files.
FLUSH_S = 1.0

#: Slab counters that only grow; everything else in the stats is a gauge.
_SLAB_COUNTERS = {
    "dedup_hits", "get_hits", "get_misses", "evictions", "evicted_bytes",
    "puts_created", "deletes", "repairs", "leases_taken", "leases_released", "leases_expired",
    "leases_refused", "checksum_failures", "bad_checksum_puts",
}  # fmt: skip
#: Methods kept as label values; anything else a client invents is counted as "other",
#: so a fuzzing client cannot blow up the number of time series.
_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE"})
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
            0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip


class Metrics:
    """Request counters and a latency histogram for one worker process.

    Args:
        multiproc_dir: the server's shared metrics directory; None keeps the metrics in
            this process only (a single-process app, e.g. in a test).
    """

    def __init__(self, multiproc_dir: str | None = None, kv_events_path: str | None = None):
        self.multiproc_dir = multiproc_dir
        #: The KV-events publisher's counters file (eg_kv.kvevents.publisher); None: none.
        self.kv_events_path = kv_events_path
        if multiproc_dir:
            # prometheus_client picks its value class when it is first imported; the
            # supervisor imports it before it knows the directory, so switch explicitly.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
            values.ValueClass = values.MultiProcessValue()
        self.requests = Counter(
            "eg_kv_requests", "HTTP requests answered, by route, method and status",
            ["route", "method", "status"], registry=None,
        )  # fmt: skip
        self.latency = Histogram(
            "eg_kv_request_duration_seconds",
            "Time from the request's headers to the end of its response, by route",
            ["route"], registry=None, buckets=_BUCKETS,
        )  # fmt: skip
        # Requests are counted in plain Python objects and flushed in bulk (flush()):
        # three locked writes into memory-mapped files per request cost about a tenth of
        # a small GET. Pending: counts by label set; per route, bucket counts then the sum.
        self._counts: dict[tuple[str, str, int | str], int] = {}
        self._hist: dict[str, list[float]] = {}
        self._nbuckets = len(_BUCKETS) + 1  # the last one is +Inf
        # Connections (eg_kv.server.connections): set from the worker's counters at each flush.
        self.connections_open = Gauge(
            "eg_kv_connections_open", "Client connections open now",
            registry=None, multiprocess_mode="livesum",
        )  # fmt: skip
        self.connections_shed = Counter(
            "eg_kv_connections_shed",
            "Idle connections closed because their worker was at --max-connections",
            registry=None,
        )  # fmt: skip
        self.connection_timeouts = Counter(
            "eg_kv_connection_timeouts",
            "Connections closed by a time limit: header, body, send (answers not read), "
            "keepalive, rate (a body under --min-upload-rate)", ["limit"], registry=None,
        )  # fmt: skip
        self.extras_dropped = Counter(
            "eg_kv_kv_events_extras_dropped",
            "Blocks whose token ids or LoRA name a worker dropped: the KV-events publisher "
            "was down or behind (the blocks were published without them)", registry=None,
        )  # fmt: skip
        self._connections: Callable[[], tuple[int, dict[str, int]]] | None = None
        self._closed_flushed: dict[str, int] = {}

    def watch_connections(self, source: Callable[[], tuple[int, dict[str, int]]]) -> None:
        """Report connections at each flush: ``source()`` gives (open now, closed by reason).

        The reason ``"shed"`` feeds ``eg_kv_connections_shed_total``; every other reason is a
        time limit of ``eg_kv_connection_timeouts_total``.
        """
        self._connections = source

    def observe(self, route: str, method: str, status: int | str, seconds: float) -> None:
        """Count one answered request and record how long it took (until the next flush)."""
        key = (route, method if method in _METHODS else "other", status)
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1
        h = self._hist.get(route)
        if h is None:
            h = self._hist[route] = [0.0] * (self._nbuckets + 1)
        h[bisect.bisect_left(_BUCKETS, seconds)] += 1  # prometheus: value <= upper bound
        h[-1] += seconds

    def pending(self) -> bool:
        """Whether requests were counted since the last flush."""
        return bool(self._counts)

    def flush(self) -> None:
        """Add the pending counts to the prometheus metrics (the shared files)."""
        if self._connections is not None:
            self._flush_connections(*self._connections())
        counts, self._counts = self._counts, {}
        hists, self._hist = self._hist, {}
        for (route, method, status), n in counts.items():
            self.requests.labels(route, method, str(status)).inc(n)
        for route, h in hists.items():
            child = self.latency.labels(route)
            parts = histogram_parts(child)
            if parts is None or len(parts[0]) != self._nbuckets:
                # prometheus_client changed its internals: replay the observations.
                for i, seen in enumerate(h[:-1]):
                    bound = (*_BUCKETS, float("inf"))[i]
                    for _ in range(int(seen)):
                        child.observe(bound if bound != float("inf") else _BUCKETS[-1] * 2)
                continue
            buckets, total = parts
            for i, seen in enumerate(h[:-1]):
                if seen:
                    buckets[i].inc(seen)
            total.inc(h[-1])

    def _flush_connections(self, open_now: int, closed_by: dict[str, int]) -> None:
        self.connections_open.set(open_now)
        for reason, total in closed_by.items():
            n = total - self._closed_flushed.get(reason, 0)
            if n:
                counter = self.connections_shed if reason == "shed" else None
                (counter or self.connection_timeouts.labels(reason)).inc(n)
        self._closed_flushed = dict(closed_by)

    def render(
        self,
        slab_stats: dict[str, int],
        workers_up: int,
        workers: int,
        namespaces: dict[str, dict[str, int | str]] | None = None,
        disk: dict[str, Any] | None = None,
    ) -> bytes:
        """The Prometheus text exposition: every worker's requests plus the slab's stats,
        and with ``namespaces`` (name -> counters) each namespace's, labelled ``namespace``
        (the default namespace is ``default``); with ``disk`` (the disk tier's counters,
        :mod:`eg_kv.disk`), its ``eg_kv_disk_*`` series."""
        registry = CollectorRegistry(auto_describe=False)
        if self.multiproc_dir:
            MultiProcessCollector(registry, self.multiproc_dir)
        else:
            registry.register(self.requests)
            registry.register(self.latency)
            for metric in (self.connections_open, self.connections_shed,
                           self.connection_timeouts, self.extras_dropped):  # fmt: skip
                registry.register(metric)
        registry.register(_Snapshot(lambda: _slab_families(slab_stats, workers_up, workers)))
        if namespaces:
            registry.register(_Snapshot(lambda: _namespace_families(namespaces)))
        if disk is not None:
            registry.register(_Snapshot(lambda: _disk_families(disk)))
        if self.kv_events_path:
            published = _read_counters(self.kv_events_path)
            if published:
                registry.register(_Snapshot(lambda: _kv_events_families(published)))
        if not self.multiproc_dir:
            return generate_latest(registry)
        with scrape_lock(self.multiproc_dir):  # no fold of a dead worker's files meanwhile
            return generate_latest(registry)


class _Snapshot:
    """A collector that yields metric families computed by a function at scrape time."""

    def __init__(self, families: Callable[[], list]):
        self._families = families

    def collect(self):
        return self._families()


def _slab_families(stats: dict[str, int], workers_up: int, workers: int) -> list:
    out = []
    for key, value in stats.items():
        fam: CounterMetricFamily | GaugeMetricFamily
        if key in _SLAB_COUNTERS:
            fam = CounterMetricFamily(f"eg_kv_{key}", f"slab counter {key}")
        else:
            fam = GaugeMetricFamily(f"eg_kv_{key}", f"slab value {key}")
        fam.add_metric([], value)
        out.append(fam)
    up = GaugeMetricFamily("eg_kv_workers_up", "worker processes serving now")
    up.add_metric([], workers_up)
    conf = GaugeMetricFamily("eg_kv_workers", "worker processes configured")
    conf.add_metric([], workers)
    return [*out, up, conf]


#: The disk tier's series (``eg_kv_disk_<key>``): counters, then gauges; ``up`` is 0 while
#: its keeper does not answer (then only ``up`` is sent).
_DISK_GAUGES = ("blocks", "bytes", "capacity_bytes", "spill_queue")


def _disk_families(disk: dict[str, Any]) -> list:
    up = GaugeMetricFamily("eg_kv_disk_up", "the disk keeper answers (1) or not (0)")
    answered = "spills" in disk
    up.add_metric([], 1 if answered else 0)
    out: list[CounterMetricFamily | GaugeMetricFamily] = [up]
    if not answered:
        return out
    for key in _DISK_COUNTERS:
        c = CounterMetricFamily(f"eg_kv_disk_{key}", f"disk tier counter {key}")
        c.add_metric([], float(disk[key]))
        out.append(c)
    for key in _DISK_GAUGES:
        g = GaugeMetricFamily(f"eg_kv_disk_{key}", f"disk tier value {key}")
        g.add_metric([], float(disk[key]))
        out.append(g)
    ready = GaugeMetricFamily("eg_kv_disk_ready", "the disk index is rebuilt (1) or filling (0)")
    ready.add_metric([], 1 if disk.get("ready") else 0)
    return [*out, ready]


#: The per-namespace series: what quotas and fairness are judged by. ``quota_used_bytes``
#: is what the quota is held against: whole pages, of blocks and of uploads in flight
#: (``reserved_bytes``).
_NS_SERIES = ("resident_bytes", "unique_blocks", "evictions", "evicted_bytes", "quota_bytes",
              "quota_used_bytes", "reserved_bytes", "get_hits", "get_misses",
              "dedup_hits")  # fmt: skip


#: The KV-events publisher's counters, as eg_kv_kv_events_<name>_total.
_KV_EVENTS = {
    "published": "Events the KV-events publisher sent",
    "batches": "Messages the KV-events publisher sent (a batch of one namespace's events each)",
    "skipped": "Log entries the publisher fell behind and skipped (subscribers saw a hole)",
    "burnt": "Topic seq numbers the publisher skipped, the log no longer holding their events",
    "replays": "Replay requests answered",
    "resyncs": "Replays answered by a resync (a walk of the slot table)",
    "resyncs_put_off": "Resyncs asked within a second of the last one, answered later",
    "replays_dropped": "Replay requesters dropped (cut off, or too many waiting)",
    "requests_refused": "Replay requests of more frames than a request has (read uncopied, "
    "then refused)",
    "replay_ms": "Time the publisher spent answering replays and resyncs (at most half "
    "its time, the rest is the live stream's)",
    "extras_late": "Stores published without the token ids their worker sent (late)",
    "extras_bad": "Messages on the extras socket that were not a worker's (dropped)",
}
#: Counters the publisher keeps in ms, exported in seconds (Prometheus' base unit).
_KV_EVENTS_MS = {"replay_ms": "replay_seconds"}


def _read_counters(path: str) -> dict[str, int] | None:
    """A JSON object of counters from ``path``; None when there is none yet (or it
    cannot be read: the publisher writes it again within a second)."""
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def _kv_events_families(counters: dict[str, Any]) -> list:
    out = []
    for name, doc in _KV_EVENTS.items():
        value = counters.get(name)
        if isinstance(value, int):
            seconds = _KV_EVENTS_MS.get(name)
            family = CounterMetricFamily(f"eg_kv_kv_events_{seconds or name}", doc)
            family.add_metric([], value / 1000 if seconds else value)
            out.append(family)
    return out


def _namespace_families(namespaces: dict[str, dict[str, int | str]]) -> list:
    out = []
    for key in _NS_SERIES:
        name, doc = f"eg_kv_namespace_{key}", f"namespace {key}"
        fam = (
            CounterMetricFamily(name, doc, labels=["namespace"])
            if key in _SLAB_COUNTERS
            else GaugeMetricFamily(name, doc, labels=["namespace"])
        )
        for ns_name, one in namespaces.items():
            fam.add_metric([ns_name or RESERVED_NAMESPACE], int(one[key]))
        out.append(fam)
    return out
