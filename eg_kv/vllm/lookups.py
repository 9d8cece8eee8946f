"""Asynchronous prefix lookups for the scheduler side of
:class:`~eg_kv.vllm.connector.EgKvConnector` (no vLLM import).

vLLM 0.32's ``get_num_new_matched_tokens`` may answer ``None`` ("ask me again at a later
step"). :class:`PendingLookups` starts a request's lookup in a background thread on the
first ask, waits for it only a moment (``wait_s``: a fast server answers in the same
call), and otherwise answers ``None`` until the lookup finished. Bounded everywhere:

* a lookup that outlives ``deadline_s`` (a server that never answers, with a client
  whose own timeout did not end it) counts as a miss (0) and is dropped, so the
  scheduler is never stuck on it;
* at most ``max_pending`` lookups are kept: past that a new ask is a miss (0) at once,
  never a lookup on the scheduler's thread (it ran one inline, up to the client's
  timeout, for every request while a silent server filled the table);
* a request's entry is dropped when it is answered, when it asks again for another
  range (its local prefix changed), when it expires, and by :meth:`PendingLookups.drop`
  (the connector calls it from ``request_finished``); a dropped lookup that has not
  started yet is cancelled, so the threads' queue holds only live ones.

A lookup is one batch-exists request; nothing here changes any state but this table. The
lookup the connector hands in leases its hits (:mod:`eg_kv.slab.leases`) and answers what
it leased with its count: the answer of an entry dropped or expired here, when it comes,
goes to ``discard`` (the connector releases its leases: :mod:`eg_kv.vllm.scheduler_leases`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["PendingLookups"]

T = TypeVar("T")


@dataclasses.dataclass
class _Pending(Generic[T]):
    key: Hashable
    future: Future[T]
    started: float


class PendingLookups(Generic[T]):
    """Lookups by request id, answered across scheduler steps (see the module docstring).

    Args:
        deadline_s: a lookup still running this long after it started is a miss.
        wait_s: how long the first ask waits for its own lookup before answering None.
        max_pending: lookups kept at once (past it, a new one is a miss).
        threads: background lookup threads.
        miss: the answer of a miss (a lookup that failed, expired or did not fit).
        discard: called (on a lookup thread) with the answer of a lookup that finished
            after its entry was dropped or expired: nobody reads it.
    """

    def __init__(
        self,
        *,
        deadline_s: float,
        wait_s: float = 0.002,
        max_pending: int = 1024,
        threads: int = 2,
        miss: Any = 0,
        discard: Callable[[T], None] | None = None,
    ) -> None:
        if deadline_s <= 0 or wait_s < 0 or max_pending < 1 or threads < 1:
            raise ValueError("deadline_s > 0, wait_s >= 0, max_pending >= 1, threads >= 1")
        self.deadline_s = deadline_s
        self.wait_s = wait_s
        self.max_pending = max_pending
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._miss: T = miss
        self._discard = discard
        self._pending: dict[str, _Pending[T]] = {}
        self._lock = threading.Lock()
        self.counters = {"started": 0, "deferred": 0, "full": 0, "expired": 0, "failed": 0}

    def __len__(self) -> int:
        return len(self._pending)

    def ask(self, req_id: str, key: Hashable, lookup: Callable[[], T]) -> T | None:
        """The result of ``lookup`` for ``(req_id, key)``, or None while it still runs.

        ``key`` names what is looked up (e.g. the block range): an entry for another key
        is dropped and a new lookup starts. ``lookup`` runs in a background thread; an
        exception it raises counts as 0 (a miss).
        """
        entry = self._pending.get(req_id)
        if entry is not None and entry.key != key:
            self.drop(req_id)
            entry = None
        if entry is None:
            if len(self._pending) >= self.max_pending:
                self.counters["full"] += 1
                return self._miss
            entry = _Pending(key, self._executor().submit(self._safe, lookup), time.monotonic())
            self._pending[req_id] = entry
            self.counters["started"] += 1
            if self.wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    entry.future.result(timeout=self.wait_s)
        if entry.future.done():
            del self._pending[req_id]
            return entry.future.result()
        if time.monotonic() - entry.started >= self.deadline_s:
            del self._pending[req_id]
            self._forget(entry)
            self.counters["expired"] += 1
            return self._miss
        self.counters["deferred"] += 1
        return None

    def drop(self, req_id: str) -> None:
        """Forget a request's lookup (a running one finishes in its thread, unread; one
        not started yet never starts)."""
        entry = self._pending.pop(req_id, None)
        if entry is not None:
            self._forget(entry)

    def _forget(self, entry: _Pending[T]) -> None:
        """An entry nobody will read: never started, or its answer to ``discard``."""
        if entry.future.cancel() or self._discard is None:
            return
        discard = self._discard
        entry.future.add_done_callback(lambda f: f.cancelled() or discard(f.result()))

    def close(self) -> None:
        """Drop every entry and stop the threads without waiting for running lookups."""
        for entry in self._pending.values():
            self._forget(entry)
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="eg-kv-lookup")
        return self._pool

    def _safe(self, lookup: Callable[[], T]) -> T:
        try:
            return lookup()
        except Exception:
            with self._lock:
                self.counters["failed"] += 1
            return self._miss
