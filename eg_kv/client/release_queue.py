"""Lease releases sent on one background thread, bounded: :class:`ReleaseQueue`.

An engine's thread that ends leases (vLLM's scheduler, SGLang's prefetch thread) must not
wait on a server for it: a stalled server held SGLang's thread a whole timeout per
release. The releases go to one thread instead, at most :data:`MAX_QUEUED` batches waiting
(past it a batch is dropped and counted: its leases end on their own within ``lease_ms``),
so a dead server costs dropped releases, never a stuck engine or unbounded memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..procs import after_fork_in_child

__all__ = ["MAX_QUEUED", "ReleaseQueue"]

#: Release batches queued for the release thread at most.
MAX_QUEUED = 64


class ReleaseQueue:
    """Sends ``release(addresses)`` batches on one thread, in order (thread-safe).

    Args:
        release: the client's ``release(addresses) -> int`` (never raises).
        max_queued: batches waiting at most.
    """

    def __init__(
        self, release: Callable[[Sequence[str]], int], max_queued: int = MAX_QUEUED
    ) -> None:
        self._release = release
        self._max = max_queued
        self._pool: ThreadPoolExecutor | None = None
        self._queued = 0
        self._lock = threading.Lock()
        self.counters = {"released": 0, "release_batches": 0, "release_dropped": 0}
        after_fork_in_child(self)

    def after_fork_in_child(self) -> None:
        """In a forked child: the parent's thread and its queue are not the child's."""
        self._pool, self._queued, self._lock = None, 0, threading.Lock()

    def submit(self, addresses: Sequence[str]) -> None:
        """Release ``addresses`` on the release thread (dropped past the bound)."""
        if not addresses:
            return
        with self._lock:
            if self._queued >= self._max:
                self.counters["release_dropped"] += 1
                return
            self._queued += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="eg-kv-release")
            pool = self._pool
        batch = list(addresses)

        def run() -> None:
            released = 0
            try:
                released = int(self._release(batch))
            finally:
                with self._lock:
                    self._queued -= 1
                    self.counters["released"] += released
                    self.counters["release_batches"] += 1

        try:
            pool.submit(run)
        except RuntimeError:  # closed: the leases end on their own
            with self._lock:
                self._queued -= 1

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the releases queued; whether all were sent."""
        pool = self._pool
        if pool is not None:
            try:
                pool.submit(lambda: None).result(timeout=timeout_s)
            except Exception:  # still sending (a slow server), or closed
                return False
        return self._queued == 0

    def close(self, timeout_s: float = 0.0) -> None:
        """Wait up to ``timeout_s`` for the releases queued (the rest end on their own)
        and stop the thread."""
        if timeout_s > 0:
            self.drain(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
