"""When a client reads its server's slab itself: the rule both clients share.

A connector with ``local_reads`` on asks its server where the slab is
(``GET /kv/local/slab``) on first use and maps it read-only if it can
(:class:`eg_kv.slab.local.LocalSlab`). From then on GETs and existence are served from
the mapping; a read the mapping cannot serve exactly (:class:`LocalUnavailable`) goes
over HTTP, and a retired mapping (the server removed the slab, the process forked) is
let go and the server asked again. A client that could not map the slab (another host,
another user, a tenant that is not an admin, a server that predates local reads) asks
again after :data:`RETRY_S`, and uses HTTP meanwhile. None of this is an error: the
reason is logged at debug level, once per probe.

The sync and the async client differ only in how they send the probe: each calls
:meth:`LocalReads.due`, sends ``GET`` :data:`ROUTE` when it is, and hands the answer to
:meth:`LocalReads.adopt`.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from ..procs import after_fork_in_child
from ..slab.local import LocalInfo, LocalRetired, LocalSlab, LocalUnavailable
from ..wire import LOCAL_SLAB_PATH

log = logging.getLogger("eg_kv.kvcache")

#: Where a server says where its slab is.
ROUTE = LOCAL_SLAB_PATH
#: Seconds before a client that could not read locally asks its server again (a server
#: restarted onto the client's host, a tokens file reloaded with an admin token).
RETRY_S = 30.0


class LocalReads:
    """One connector's local-read state. Thread-safe.

    Args:
        enabled: the config's ``local_reads``; False: never probe, always HTTP.

    Attributes:
        slab: the mapping in use, or None (HTTP).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.slab: LocalSlab | None = None
        self._probe_at = 0.0 if enabled else float("inf")
        self._lock = threading.Lock()
        self._closed = False
        after_fork_in_child(self)

    def after_fork_in_child(self) -> None:
        """A new lock in a forked child: a parent's thread may have held it at the fork
        (the mapping lets itself go there: :meth:`LocalSlab._still_mine`)."""
        self._lock = threading.Lock()

    def due(self) -> bool:
        """Whether to ask the server now. True once per probe: it also starts the wait
        for the next one, so that concurrent callers do not all ask."""
        if self.slab is not None or time.monotonic() < self._probe_at:
            return False
        with self._lock:
            if time.monotonic() < self._probe_at:
                return False
            self._probe_at = time.monotonic() + RETRY_S
            return True

    def adopt(self, status: int, body: bytes) -> None:
        """Take the answer to ``GET`` :data:`ROUTE`: map the slab it names if it can."""
        if status != 200:
            log.debug("eg-kv local reads off: the server answered %d to %s", status, ROUTE)
            return
        try:
            slab = LocalSlab.open(LocalInfo.from_json(json.loads(body)))
        except Exception as e:  # whatever the server said (Infinity, nested too deep): HTTP
            log.debug("eg-kv local reads off: %s", e)
            return
        old: LocalSlab | None = slab  # a probe answered after close(): nobody would unmap it
        with self._lock:
            if not self._closed:
                old, self.slab = self.slab, slab
        if old is not None:
            old.close()
        if self.slab is slab:
            log.debug("eg-kv local reads on: %s", slab.name)

    def step_aside(self, exc: LocalUnavailable) -> None:
        """A local read could not be served (the caller goes over HTTP); a retired mapping
        is let go and the server asked again on the next call."""
        if isinstance(exc, LocalRetired):
            with self._lock:
                old, self.slab = self.slab, None
                self._probe_at = 0.0
            if old is not None:
                old.close()
            log.debug("eg-kv local reads paused: %s", exc)

    def close(self) -> None:
        """Let the mapping go and never probe again."""
        with self._lock:
            old, self.slab = self.slab, None
            self._probe_at = float("inf")
            self._closed = True
        if old is not None:
            old.close()
