"""The KV-events publisher's process (``eg-kv serve --kv-events-endpoint``).

Forked by the supervisor before the workers, and again if it dies: it attaches the slab,
follows its event log and publishes it (:mod:`eg_kv.kvevents.publisher`) until SIGTERM,
or until its parent dies (``PR_SET_PDEATHSIG``, as a worker). It never takes the slab
lock on its live path (a resync walks the slot table under it, in slices), so a SIGKILL
or a SIGSTOP of it costs its subscribers, and one stopped inside the lock is killed by
the supervisor's watchdog (``--lock-timeout``) and started again.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from functools import partial

from eg_kv.config import Settings
from eg_kv.disk.layout import SOCKET_FILE
from eg_kv.disk.wire import listing_sync
from eg_kv.errors import ConfigError
from eg_kv.kvevents.publisher import Publisher, PublisherOptions
from eg_kv.server.auth import tokens_path
from eg_kv.server.extras import extras_endpoint
from eg_kv.server.runstate import kv_events_stats
from eg_kv.server.tenants import load
from eg_kv.slab.store import Slab

from .worker import BOOT_ERROR, _die_with_parent, beating

log = logging.getLogger("eg_kv.kvevents")


def options_of(s: Settings, run_dir: str = "") -> PublisherOptions:
    """The publisher's options from the server's settings (and its run directory, where
    the workers hand it PUTs' token ids: :mod:`eg_kv.server.extras`)."""
    return PublisherOptions(
        endpoint=s.kv_events_endpoint, replay_endpoint=s.kv_events_replay_endpoint,
        medium=s.kv_events_medium, locality=s.kv_events_locality, pool=s.kv_events_pool,
        model=s.kv_events_model, form="arrays" if s.kv_events_arrays else "maps",
        extras_endpoint=extras_endpoint(run_dir) if run_dir else "",
        stats_path=kv_events_stats(run_dir) if run_dir else "",
    )  # fmt: skip


class NamespaceModels:
    """The tokens file's ``model`` of each namespace, read again when the file changes
    (the supervisor replaces its validated copy on a reload): a callable for
    :class:`~eg_kv.kvevents.publisher.Topics`, which is asked about once a second."""

    def __init__(self, settings: Settings, run_dir: str) -> None:
        self._settings, self._run_dir = settings, run_dir
        self._stamp: tuple[str, float] | None = None
        self._models: Mapping[str, str] = {}

    def __call__(self) -> Mapping[str, str]:
        try:
            path = tokens_path(self._settings, self._run_dir or None)
            if path is None:
                return self._models
            stamp = (path, os.stat(path).st_mtime)
        except (ConfigError, OSError):  # the copy gone: the supervisor writes it again
            return self._models
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._models = load(path, self._settings.capacity).models
            except ConfigError as e:  # the supervisor validated it: a file being replaced
                log.debug("KV events: the tokens file cannot be read now: %s", e)
                self._stamp = None
        return self._models


def run(
    settings: Settings, parent: int, run_dir: str = "", beat: Callable[[], None] = lambda: None
) -> int:
    """Publish until SIGTERM, calling ``beat`` from its loop (each step: the supervisor
    kills a publisher that stops beating). Returns the exit status (0, or BOOT_ERROR: a
    socket that cannot be bound, which a new process would not bind either)."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    slab = Slab.attach(settings.slab_name)
    try:
        try:
            models = NamespaceModels(settings, run_dir)
            listing = None
            if settings.disk:  # a resync names the blocks only the disk tier holds too
                listing = partial(
                    listing_sync, os.path.join(os.path.abspath(settings.disk), SOCKET_FILE)
                )
            publisher = Publisher(slab, options_of(settings, run_dir), models=models,
                                  disk_listing=listing)  # fmt: skip
        except Exception as e:  # zmq.ZMQError: the address is taken or not ours
            log.error("eg-kv: the KV-events publisher cannot start: %s", e)
            return BOOT_ERROR
        log.info("KV events published on %s%s (topic %s)", settings.kv_events_endpoint,
                 f", replay on {settings.kv_events_replay_endpoint}"
                 if settings.kv_events_replay_endpoint else "",
                 (publisher.topics.of(0) or b"").decode())  # fmt: skip
        try:
            publisher.run(beating(beat, stop))
        finally:
            publisher.close()
        return 0
    finally:
        slab.close()
