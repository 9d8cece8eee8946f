"""The disk keeper's process (``eg-kv serve --disk DIR``).

Forked by the supervisor before the workers, and again if it dies: it attaches the slab,
opens the data file, rebuilds its index in a thread, spills what the event log says was
stored, and answers the workers' questions on ``DIR/keeper.sock``
(:mod:`eg_kv.disk.keeper`) until SIGTERM or its parent's death. It takes the slab lock
only for a moment, to mark a spill or a drop in a block's slot: one SIGSTOPped inside it
is killed by the supervisor's watchdog (``--lock-timeout``) and started again, so a
SIGKILL or SIGSTOP of it costs disk hits and spills, and the slab at most that wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from eg_kv.config import Settings
from eg_kv.disk.files import check_dir
from eg_kv.disk.keeper import Keeper
from eg_kv.disk.store import DiskStore
from eg_kv.errors import ConfigError
from eg_kv.slab.store import Slab

from .worker import BOOT_ERROR, _die_with_parent, beating

log = logging.getLogger("eg_kv.disk")


def run(settings: Settings, parent: int, beat: Callable[[], None] = lambda: None) -> int:
    """Keep the disk tier until SIGTERM, calling ``beat`` from its loop (at least every
    32 ms: the supervisor kills a keeper that stops beating). Returns the exit status (0,
    or BOOT_ERROR: a directory or file a new process could not use either)."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    slab = Slab.attach(settings.slab_name)
    try:
        try:
            store = DiskStore(check_dir(settings.disk), settings.disk_capacity,
                              settings.max_block_size)  # fmt: skip
            keeper = Keeper(slab, store)
        except (ConfigError, ValueError, OSError) as e:
            log.error("eg-kv: the disk keeper cannot start: %s", e)
            return BOOT_ERROR
        try:
            asyncio.run(keeper.run(beating(beat, stop)))
        finally:
            store.close()
        return 0
    finally:
        slab.close()
