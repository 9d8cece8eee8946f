"""The service routes: ``/kv/stats``, ``/healthz``, ``/metrics`` and ``/kv/local/slab``.

Rare requests, answered with aiohttp's own responses: the slab's counters (the contract's
eight fields first), liveness and the number of workers up, Prometheus text over every
worker, and where the slab is for a client on this host that reads it itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from ..slab.local import LocalInfo
from . import runstate
from .answers import json_answer
from .keys import AUTH, DISK, HEALTH, METRICS, SETTINGS, SLAB
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .tenants import RESERVED_NAMESPACE, Tenant

_V = TypeVar("_V")


async def local_slab(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /kv/local/slab``: where the slab is, for a client on this host that reads it
    itself (:mod:`eg_kv.slab.local`): names, id, layout, the token's namespace id and the
    longest lease granted (local leases keep to it: :mod:`eg_kv.slab.local_leases`).

    Only an admin (any token without a tokens file) may ask; the slab's mode (0600) decides
    who on the host can open it.
    """
    slab = request.app[SLAB]
    settings = request.app[SETTINGS]
    info = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, tenant.ns,
                        settings.lease_ms, settings.disk and os.path.abspath(settings.disk),
                        tenant.namespace)  # fmt: skip
    return json_answer(info)


async def stats(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /kv/stats``: the contract's eight fields first, then the rest.

    With a tokens file, a tenant gets its own namespace's counters; an admin gets the
    whole slab's plus ``namespaces``, one entry per namespace (by name).
    """
    slab = request.app[SLAB]
    if not request.app[AUTH].tenants_mode:
        return json_answer(await _with_disk(request, ordered_stats(slab.stats())))
    if not tenant.is_admin:
        (own,) = slab.namespace_stats(tenant.ns).values()
        return json_answer(ordered_stats(own))
    out: dict[str, object] = dict(ordered_stats(slab.stats()))
    out["namespaces"] = {
        name or RESERVED_NAMESPACE: ordered_stats(one)
        for name, one in slab.namespace_stats().items()
    }
    return json_answer(await _with_disk(request, out))


async def _with_disk(request: web.Request, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the disk tier's counters as ``disk`` (with ``--disk``; ``{"ready":
    false, ...}`` while its keeper does not answer)."""
    tier = request.app.get(DISK)
    if tier is not None:
        out["disk"] = await tier.stats() or {
            "ready": False,
            "unreachable": tier.unreachable,
            "filtered": tier.filtered,
        }
    return out


CONTRACT_FIELDS = (
    "unique_blocks", "total_refs", "resident_bytes", "logical_bytes",
    "dedup_savings_bytes", "dedup_hits", "get_hits", "get_misses",
)  # fmt: skip


def ordered_stats(raw: Mapping[str, _V]) -> dict[str, _V]:
    """The stats with the contract's eight fields first, then the rest as the slab gave them."""
    out = {k: raw[k] for k in CONTRACT_FIELDS}
    out.update((k, v) for k, v in raw.items() if k not in out)
    return out


async def healthz(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /healthz``: liveness, and how many workers the supervisor has up."""
    up, configured = request.app[HEALTH]()
    return json_answer({"status": "ok", "workers_up": up, "workers": configured})


async def metrics(request: web.Request, tenant: Tenant) -> web.Response:
    """``GET /metrics``: Prometheus text over every worker plus the slab's counters.

    Each worker flushes its request counts to the shared files at least every
    :data:`eg_kv.server.metrics.FLUSH_S`; this one flushes its own first.
    """
    request.app[METRICS].flush()
    up, configured = request.app[HEALTH]()
    slab = request.app[SLAB]
    namespaces = slab.namespace_stats() if request.app[AUTH].tenants_mode else None
    tier = request.app.get(DISK)
    disk = (await tier.stats() or {}) if tier is not None else None
    body = request.app[METRICS].render(slab.stats(), up, configured, namespaces, disk)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return resp


def health_from(
    run_dir: str | None, configured: int, window_s: float
) -> Callable[[], tuple[int, int]]:
    """How ``/healthz`` counts workers: the ready ones that beat within ``window_s``.

    A worker that is stopped or wedged still runs, and SO_REUSEPORT still hands it new
    connections, so a live pid is not enough: only a recent heartbeat says it answers.
    """
    if run_dir is None:
        return lambda: (1, 1)
    beats: list[runstate.Heartbeats] = []

    def health() -> tuple[int, int]:
        try:
            n, pids = runstate.read_state(run_dir)
            if not beats:
                beats.append(runstate.Heartbeats.open(run_dir))
        except (OSError, ValueError, KeyError):
            return 1, configured  # this worker answers, so at least one is up
        ages = beats[0].ages()
        return sum(1 for p in pids if ages.get(p, window_s) < window_s), n

    return health
