"""The copies of :class:`~eg_kv.vllm.tier.EgKvTier` between vLLM's primary (CPU) tier and
eg-kv: stores PUT from primary slots, loads GET into them (no vLLM import).

One primary slot (a row of the primary tier's memoryview, ``row_bytes`` long) is ONE
eg-kv block: the row followed by a 16-byte trailer, XXH3-128 of the address and the row
(and, with the engines' block key, the client's 16-byte salt before it all and 16-byte
tag after: :mod:`eg_kv.blockkey`). So a load knows what it got:

* a block of any other length (missing, cut short, too long, a server that answers
  garbage or hangs past the client's timeout) fails before or while it is read;
* a block whose bytes changed after they were stored fails their checksum (the client
  checks it: :mod:`eg_kv.checksum`), and one stored under another address (a server bug
  that serves one block for another) fails the trailer;
* with a block key, a block not stored by a holder of the key (another token holder's
  forgery, a server that lies), or changed since, fails the MAC (which binds the address
  and every byte: the client checks it instead of the checksum, and a load does not check
  the trailer again). Without one, such a forger can have the tier
  load its bytes: the trailer is public (docs/security.md says what holds);

and a failed key is reported as such (vLLM frees its slot and recomputes it). Loads use
the client's ``fetch``: on the server's host it copies from the mapped slab (a local
read), else it is a ``GET`` streamed straight into the slot. Stores use ``put_status``:
a body over 64 KiB asks ``Expect: 100-continue`` first, so a block the server already
holds moves no body.

:class:`CopyJobs` runs each job's blocks on ``threads`` threads and reports a job only
once every one of its copies has ended (so a slot is never written after its job was
reported), except a load past its deadline (:meth:`CopyJobs.overdue`), reported early with
an event set once its copies end (vLLM 0.34 keeps those slots until then);
:meth:`CopyJobs.drain` waits until no copy is running or queued. Every copy ends within
the client's timeout (twice it for a server set's retry).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

from ..engine import NO_ENGINE, EngineName
from .trailers import TRAILER, read_row, trailer

__all__ = ["TRAILER", "CopyJobs", "FinishedJob", "trailer"]


class CopyClient(Protocol):
    """What the copies need of a client (every eg-kv sync client has it)."""

    def fetch(self, key: str | bytes, sink: Any, may_start: Any = None) -> Any: ...
    def put_status(
        self, key: str | bytes, parts: Any, engine: EngineName = NO_ENGINE
    ) -> int | None: ...


@dataclasses.dataclass
class FinishedJob:
    """One job whose copies have all ended.

    Attributes:
        job_id: the caller's job id.
        is_load: a load (eg-kv -> primary) or a store (primary -> eg-kv).
        ok: per block, whether it was copied (a load: the slot holds the block, digest
            checked; a store: the server holds it, 201 or 200).
        seconds: from submission to the last copy's end.
        nbytes: the rows' bytes copied.
        released: None, or for a load reported before its copies ended
            (:meth:`CopyJobs.overdue`): set once no copy of it can write a slot any more
            (``ok`` then says which had ended whole; the others may still be written).
    """

    job_id: int
    is_load: bool
    ok: list[bool]
    seconds: float
    nbytes: int
    released: threading.Event | None = None


@dataclasses.dataclass
class _Job:
    job_id: int
    is_load: bool
    ok: list[bool]
    left: int
    started: float
    #: Copies begun (decided under the jobs' lock) and not ended yet.
    running: int = 0
    #: Set when the job was reported overdue: its end sets it instead of reporting.
    released: threading.Event | None = None


class CopyJobs:
    """Store and load jobs between a primary view and eg-kv (see the module docstring).

    Args:
        client: the eg-kv client (thread-safe).
        view: the primary tier's memoryview (C-contiguous, any shape): slot ``i`` is its
            bytes ``[i * row_bytes, (i + 1) * row_bytes)``.
        row_bytes: a slot's length (the view's row stride).
        threads: copies running at once.
        keyed: the client checks the engines' block key (:mod:`eg_kv.blockkey`), whose
            tag binds the address and every byte: a load does not check the trailer again
            (a store still writes it, so keyed and unkeyed rows keep one layout).
    """

    def __init__(
        self,
        client: CopyClient,
        view: memoryview,
        row_bytes: int,
        *,
        threads: int = 4,
        keyed: bool = False,
    ) -> None:
        if threads < 1 or row_bytes < 1:
            raise ValueError("threads and row_bytes must be at least 1")
        self._client = client
        # One flat byte view: a 2-D memoryview has no row sub-views.
        self._view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        self.row_bytes = row_bytes
        self._check_trailer = not keyed
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eg-kv-tier-io")
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._finished: deque[FinishedJob] = deque()

    @property
    def running(self) -> int:
        """Jobs with a copy running or queued."""
        with self._cond:
            return len(self._jobs)

    def _row(self, index: int) -> memoryview:
        start = int(index) * self.row_bytes
        if index < 0 or start + self.row_bytes > self._view.nbytes:
            raise IndexError(f"slot {index} is outside the primary view")
        return self._view[start : start + self.row_bytes]

    def submit(
        self, job_id: int, is_load: bool, addresses: Sequence[str], rows: Sequence[int],
        names: Sequence[EngineName] | None = None,
    ) -> None:  # fmt: skip
        """Start a job: block ``i`` goes between ``addresses[i]`` and slot ``rows[i]``
        (a store's PUT names it ``names[i]``, the engine's name: :mod:`eg_kv.engine`).
        Returns at once; the job shows up in :meth:`finished` once every copy ended."""
        if len(addresses) != len(rows):
            raise ValueError(f"{len(addresses)} addresses for {len(rows)} slots")
        job = _Job(job_id, is_load, [False] * len(rows), len(rows), time.monotonic())
        with self._cond:
            if job_id in self._jobs:
                raise ValueError(f"job {job_id} is already running")
            self._jobs[job_id] = job
        if not rows:
            self._done(job, -1, False)
            return
        for i, (address, row) in enumerate(zip(addresses, rows, strict=True)):
            name = names[i] if names else NO_ENGINE
            copy = self._load_one if is_load else partial(self._store_one, name=name)
            self._pool.submit(self._run, job, i, copy, address, int(row))

    def _run(
        self, job: _Job, i: int, copy: Callable[[str, int], bool], address: str, row: int
    ) -> None:
        with self._cond:  # begun or not is decided with overdue(), under one lock
            if job.released is not None:
                return  # reported overdue before it began: settled then, never copied
            job.running += 1
        ok = False
        try:
            ok = copy(address, row)
        except Exception:  # a client that raises is a failed block, never a lost job
            ok = False
        finally:
            self._done(job, i, ok)

    def _done(self, job: _Job, i: int, ok: bool) -> None:
        with self._cond:
            if i >= 0:
                job.ok[i] = ok
                job.left -= 1
                job.running -= 1
            if job.left <= 0:
                del self._jobs[job.job_id]
                if job.released is not None:  # reported already: its slots are free now
                    job.released.set()
                    self._cond.notify_all()
                    return
                self._finished.append(
                    FinishedJob(
                        job.job_id,
                        job.is_load,
                        job.ok,
                        time.monotonic() - job.started,
                        sum(job.ok) * self.row_bytes,
                    )
                )
                self._cond.notify_all()

    def _load_one(self, address: str, row: int) -> bool:
        slot = self._row(row)

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> bool:
            read_row(address, slot, length, read_exact, self._check_trailer)
            return True

        return self._client.fetch(address, sink) is True

    def _store_one(self, address: str, row: int, name: EngineName = NO_ENGINE) -> bool:
        slot = self._row(row)
        status = self._client.put_status(address, (slot, trailer(address, slot)), name)
        return status in (200, 201)

    def finished(self) -> list[FinishedJob]:
        """The jobs finished since the last call."""
        with self._cond:
            out = list(self._finished)
            self._finished.clear()
        return out

    def overdue(self, deadline_s: float) -> list[FinishedJob]:
        """The loads running for ``deadline_s`` or more, not reported before: each is
        reported here once, never by :meth:`finished`. Its copies not begun are settled
        now (failed; never made, and not waited for behind other jobs' copies in the
        queue); its ``released`` is set when the copies begun end, at once if none runs
        (each is bounded by the client's timeout)."""
        now, out = time.monotonic(), []
        with self._cond:
            for job in list(self._jobs.values()):
                if job.is_load and job.released is None and now - job.started >= deadline_s:
                    job.released = threading.Event()
                    ok = list(job.ok)
                    out.append(FinishedJob(job.job_id, True, ok, now - job.started,
                                           sum(ok) * self.row_bytes, job.released))  # fmt: skip
                    job.left = job.running  # the rest never begin: _run returns at once
                    self._done(job, -1, False)  # ends it now when none is running
        return out

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until no copy is running or queued (their results stay for
        :meth:`finished`). Returns False only when ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs, timeout_s)

    def close(self) -> None:
        """Wait for the copies, stop the threads and let go of the primary view (vLLM
        closes its mmap next: a view still exported would keep it from closing)."""
        self.drain()
        self._pool.shutdown(wait=True)
        self._view.release()
