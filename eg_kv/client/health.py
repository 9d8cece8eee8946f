"""Which members of a server set are down, and when each is probed again: :class:`Health`.

A member that fails is down for a back-off that doubles at each failed probe (from
:data:`DEFAULT_BACKOFF_S` to :data:`DEFAULT_MAX_BACKOFF_S`); :class:`eg_kv.client.router.Router`
skips it when it places addresses and probes it when its back-off runs out. Standard
library only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from ..errors import ConfigError

#: A member that failed is down for this long, doubling at each failed probe up to the
#: maximum (pymemcache's HashClient and mcrouter retry dead servers the same way).
DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 30.0


class Health:
    """Which members are down, each with its back-off; thread-safe.

    A member that failed (refused connection, timeout, a batch's deadline missed) is down
    until a probe finds it up: pass :meth:`down` as ``skip`` to :meth:`Placement.home` /
    :meth:`Placement.group`, so its addresses go to their next-ranked member and no
    request waits on it. A background prober asks :meth:`due` which members to probe
    now, probes each (``/healthz`` and a data route, with a short timeout) and reports
    :meth:`succeeded` or :meth:`failed`; every failure doubles the member's back-off,
    from ``first_s`` up to ``max_s``. A member that fails again within ``max_s`` of
    coming back resumes doubling from where it was (a member that passes its probes and
    then stalls requests is retried less and less often), and starts over from
    ``first_s`` only after ``max_s`` up without a failure.

    Args:
        first_s: the back-off after a first failure.
        max_s: the longest back-off.
        clock: a monotonic clock (seconds); tests pass their own.
    """

    def __init__(
        self,
        first_s: float = DEFAULT_BACKOFF_S,
        max_s: float = DEFAULT_MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ConfigError(f"want 0 < first_s <= max_s, not {first_s!r} and {max_s!r}")
        self.first_s = float(first_s)
        self.max_s = float(max_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff: dict[str, float] = {}  # member id -> its current back-off
        self._next_probe: dict[str, float] = {}  # member id -> when to probe it
        self._recovered: dict[str, tuple[float, float]] = {}  # id -> (back-off, up since)
        self._down: frozenset[str] = frozenset()

    def failed(self, member_id: str) -> float:
        """A request or a probe to the member failed: it is down (again).

        Returns:
            Seconds until it is due for a probe.
        """
        with self._lock:
            now = self._clock()
            backoff = self._backoff.get(member_id)
            if backoff is None:
                last, up_since = self._recovered.pop(member_id, (0.0, now - self.max_s))
                # Back within max_s of recovering: it did not stay up, keep doubling.
                backoff = last if now - up_since < self.max_s else None
            backoff = self.first_s if backoff is None else min(backoff * 2, self.max_s)
            self._backoff[member_id] = backoff
            self._next_probe[member_id] = now + backoff
            self._down = frozenset(self._backoff)
            return backoff

    def succeeded(self, member_id: str) -> bool:
        """A probe (or a request) reached the member: it is up. Returns True if it was down."""
        with self._lock:
            backoff = self._backoff.pop(member_id, None)
            self._next_probe.pop(member_id, None)
            if backoff is not None:
                self._recovered[member_id] = (backoff, self._clock())
                self._down = frozenset(self._backoff)
            return backoff is not None

    def down(self) -> frozenset[str]:
        """The ids of the members that are down now (one atomic read, no lock)."""
        return self._down

    def due(self) -> list[str]:
        """Members whose back-off has run out, to probe now, sorted. Each is handed out once
        per back-off: it is due again only after the prober reports :meth:`failed`, or
        after another back-off if the prober never reports."""
        with self._lock:
            now = self._clock()
            ready = sorted(m for m, t in self._next_probe.items() if t <= now)
            for m in ready:
                self._next_probe[m] = now + self._backoff[m]
            return ready

    def forget(self, keep: Collection[str]) -> None:
        """Drop the state of members no longer in the set (``keep``: the current ids)."""
        with self._lock:
            for m in [m for m in self._backoff if m not in keep]:
                del self._backoff[m]
                self._next_probe.pop(m, None)
            for m in [m for m in self._recovered if m not in keep]:
                del self._recovered[m]
            self._down = frozenset(self._backoff)
