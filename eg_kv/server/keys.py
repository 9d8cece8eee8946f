"""The typed keys of what one worker's application holds (``app[KEY]``).

Apart from the modules that make what they hold, so that every handler module can read
them without importing the app that assembles the handlers (no import cycle).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from ..config import Settings
from ..disk.tier import DiskTier
from ..slab.store import Slab
from .auth import Auth
from .connections import Connections
from .extras import ExtrasRelay
from .gates import Gate
from .inflight import Drain, SpoolBudget
from .metrics import Metrics

SETTINGS = web.AppKey("settings", Settings)
SLAB = web.AppKey("slab", Slab)
METRICS = web.AppKey("metrics", Metrics)
#: How /healthz counts workers: () -> (up, configured).
HealthProbe = Callable[[], tuple[int, int]]
HEALTH: web.AppKey[HealthProbe] = web.AppKey("health")
AUTH = web.AppKey("auth", Auth)
CONNECTIONS = web.AppKey("connections", Connections)
DRAIN = web.AppKey("drain", Drain)
SPOOL = web.AppKey("spool", SpoolBudget)
#: The background tasks a worker runs (:mod:`eg_kv.server.app`).
FLUSH_TASK = web.AppKey("metrics_flush", asyncio.Task)
SWEEP_TASK = web.AppKey("connection_sweep", asyncio.Task)
#: The gates of the event log's costly requests (:mod:`eg_kv.server.gates`).
EVENT_READS = web.AppKey("event_reads", Gate)
EVENT_WAITERS = web.AppKey("event_waiters", Gate)
SNAPSHOTS = web.AppKey("snapshots", Gate)
#: The disk tier's client (:mod:`eg_kv.disk.tier`), with ``--disk`` only.
DISK = web.AppKey("disk", DiskTier)
#: Hands a PUT's engine extras to the KV-events publisher (:mod:`eg_kv.server.extras`).
EXTRAS = web.AppKey("extras", ExtrasRelay)
