"""The lookups of :class:`~eg_kv.vllm.tier.EgKvTier`: every key a scheduler step asks
about goes out in ONE batch-exists at the end of the step (no vLLM import).

vLLM's secondary tiers answer ``lookup(key)`` with HIT, MISS or RETRY ("ask again next
step") and must never block the scheduler. :class:`StepLookups` keeps a verdict per key:

* :meth:`StepLookups.lookup` answers a known verdict, or ``None`` (RETRY) for a key whose
  probe is pending or in flight; a new key joins the step's batch;
* :meth:`StepLookups.flush` (the tier's ``on_schedule_end``) hands the step's batch to a
  background thread as ONE ``probe(addresses)`` call: the client's
  ``try_exists_addresses``, which sends one compact ``POST /kv/batch/exists`` per server
  (a set splits the batch by member) per 1,024 addresses;
* a key stays a RETRY only while its probe runs: a probe still running ``deadline_s`` after
  it was sent (a server that never answers, with a client whose own timeout did not end
  it) makes its keys misses; so does a probe that failed (``None``); past ``max_batches``
  probes in flight, a new step's keys are misses at once instead of queueing behind a
  dead server. A dead server costs misses, never a stuck step;
* a hit older than ``max_age_s`` is probed again (its server-side lease, when it took
  one, may have ended); a miss is kept until no request refers to the key, so a block
  whose load failed (:meth:`StepLookups.mark_miss`) is not offered again and again;
* a hit's probe took a lease on the server when ``probe`` asked for one: the addresses
  of hits not yet loaded are in :attr:`StepLookups.leased`; :meth:`consume` removes the
  ones a load takes (the load ends their leases); :meth:`cleanup` returns those a
  finished request leaves behind, and :meth:`take_unused` those that answered after their
  requests finished or that a refresh leased again (the tier releases both).

Only the scheduler thread calls these methods; the background threads only run
``probe`` and hand back its answer through a future.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["StepLookups"]

#: ``probe(addresses)``: which are resident (one bool each), or None when it could not ask.
Probe = Callable[[list[str]], "list[bool] | None"]


@dataclasses.dataclass
class _Verdict:
    address: str
    generation: int
    result: bool | None = None  # None: pending or in flight
    resolved_at: float = 0.0
    requests: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Batch:
    future: Future[list[bool] | None]
    entries: list[tuple[Hashable, int]]
    sent: float


class StepLookups:
    """Per-step batched existence lookups (see the module docstring).

    Args:
        probe: asks the server(s) which addresses are resident (never raises: an
            exception it raises counts as None).
        address_of: a key's eg-kv address (called once per probed key).
        deadline_s: a probe running this long makes its keys misses.
        max_age_s: a hit this old is probed again.
        max_batches: probes in flight at once; past it a step's keys are misses.
        threads: background threads running probes.
    """

    def __init__(
        self,
        probe: Probe,
        address_of: Callable[[Any], str],
        *,
        deadline_s: float,
        max_age_s: float = 2.0,
        max_batches: int = 4,
        threads: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if deadline_s <= 0 or max_age_s <= 0 or max_batches < 1 or threads < 1:
            raise ValueError("deadline_s > 0, max_age_s > 0, max_batches >= 1, threads >= 1")
        self._probe = probe
        self._address_of = address_of
        self.deadline_s = deadline_s
        self.max_age_s = max_age_s
        self.max_batches = max_batches
        self._clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eg-kv-tier-lookup")
        self._verdicts: dict[Hashable, _Verdict] = {}
        self._by_request: dict[str, set[Hashable]] = {}
        self._step: list[tuple[Hashable, int]] = []
        self._batches: list[_Batch] = []
        self._generation = 0
        #: Addresses whose probe answered hit (a lease, when one was asked) not yet loaded.
        self.leased: set[str] = set()
        #: Leased addresses no request will load: a hit that answered after its requests
        #: finished, or one a refresh leased again (:meth:`take_unused` hands them over).
        self._unused: list[str] = []
        self.counters = {
            "probes": 0,
            "probed_keys": 0,
            "hits": 0,
            "expired": 0,
            "failed": 0,
            "shed": 0,
            "refreshed": 0,
        }

    def __len__(self) -> int:
        """Keys with a verdict (known or awaited)."""
        return len(self._verdicts)

    @property
    def in_flight(self) -> int:
        """Probes sent and not yet applied."""
        return len(self._batches)

    def lookup(self, key: Hashable, req_id: str) -> bool | None:
        """The verdict for ``key`` as ``req_id`` asks: True (hit), False (miss), or None:
        pending, ask again next step. Never blocks."""
        self._apply()
        verdict = self._verdicts.get(key)
        if (
            verdict is not None
            and verdict.result is True
            and self._clock() - verdict.resolved_at > self.max_age_s
        ):
            # A hit this old may have lost its lease: ask the server again.
            self.counters["refreshed"] += 1
            if verdict.address in self.leased:  # its new probe takes a lease of its own
                self.leased.discard(verdict.address)
                self._unused.append(verdict.address)
            verdict = self._renew(key, verdict.address, verdict.requests)
        if verdict is None:
            verdict = self._renew(key, self._address_of(key), set())
        verdict.requests.add(req_id)
        self._by_request.setdefault(req_id, set()).add(key)
        return verdict.result

    def _renew(self, key: Hashable, address: str, requests: set[str]) -> _Verdict:
        verdict = _Verdict(address, self._generation, requests=requests)
        self._generation += 1
        self._verdicts[key] = verdict
        self._step.append((key, verdict.generation))
        return verdict

    def flush(self) -> None:
        """Send this step's new keys as ONE probe (called once per scheduler step)."""
        self._apply()
        step, self._step = self._step, []
        entries = [
            (key, gen)
            for key, gen in step
            if (v := self._verdicts.get(key)) is not None and v.generation == gen
        ]
        if not entries:
            return
        if len(self._batches) >= self.max_batches:
            # Earlier probes are still out (a slow or dead server): do not queue behind them.
            self.counters["shed"] += len(entries)
            self._resolve(entries, None)
            return
        addresses = [self._verdicts[key].address for key, _ in entries]
        future = self._pool.submit(self._safe_probe, addresses)
        self._batches.append(_Batch(future, entries, self._clock()))
        self.counters["probes"] += 1
        self.counters["probed_keys"] += len(entries)

    def _safe_probe(self, addresses: list[str]) -> list[bool] | None:
        try:
            found = self._probe(addresses)
        except Exception:  # a probe that raises is one that could not ask
            return None
        if found is None or len(found) != len(addresses):
            return None
        return [bool(f) for f in found]

    def _apply(self) -> None:
        """Apply the probes that answered; expire the ones past their deadline."""
        if not self._batches:
            return
        now = self._clock()
        keep: list[_Batch] = []
        for batch in self._batches:
            if batch.future.done():
                found = batch.future.result()
                if found is None:
                    self.counters["failed"] += len(batch.entries)
                self._resolve(batch.entries, found)
            elif now - batch.sent >= self.deadline_s:
                # Its thread finishes later, unread; its keys are misses now.
                self.counters["expired"] += len(batch.entries)
                self._resolve(batch.entries, None)
            else:
                keep.append(batch)
        self._batches = keep

    def _resolve(self, entries: list[tuple[Hashable, int]], found: list[bool] | None) -> None:
        now = self._clock()
        for i, (key, gen) in enumerate(entries):
            verdict = self._verdicts.get(key)
            if verdict is None or verdict.generation != gen or verdict.result is not None:
                continue  # dropped, renewed or marked since it was sent
            hit = bool(found[i]) if found is not None else False
            verdict.result = hit
            verdict.resolved_at = now
            if hit:
                self.counters["hits"] += 1
                self.leased.add(verdict.address)
            if not verdict.requests:  # its requests finished while it was asked
                self._unused.extend(self._forget(key, verdict))

    def _forget(self, key: Hashable, verdict: _Verdict) -> list[str]:
        del self._verdicts[key]
        if verdict.address in self.leased:
            self.leased.discard(verdict.address)
            return [verdict.address]
        return []

    def consume(self, addresses: Iterable[str]) -> list[str]:
        """These hits are being loaded: the ones that hold a lease this tier took (each
        at most once), for the load to end; the rest took none (or it was handed on)."""
        taken = [a for a in dict.fromkeys(addresses) if a in self.leased]
        self.leased.difference_update(taken)
        return taken

    def mark_miss(self, keys: Collection[Hashable]) -> None:
        """A load of these keys failed: answer miss for them from now on (until no request
        refers to them), so the scheduler does not promote them again and again."""
        now = self._clock()
        for key in keys:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                verdict.result = False
                verdict.resolved_at = now
                verdict.generation = -1  # a probe in flight for it is not applied
                self.leased.discard(verdict.address)

    def cleanup(self, req_id: str) -> list[str]:
        """``req_id`` finished: drop the verdicts no request refers to any more.

        Returns:
            The addresses of dropped hits that were never loaded (leases to release).
        """
        unused: list[str] = []
        for key in self._by_request.pop(req_id, ()):
            verdict = self._verdicts.get(key)
            if verdict is None:
                continue
            verdict.requests.discard(req_id)
            if not verdict.requests and verdict.result is not None:
                unused.extend(self._forget(key, verdict))
        return unused

    def take_unused(self) -> list[str]:
        """The leased addresses no request will load, found since the last call: hits
        answered after their requests finished, and hits leased again by a refresh (the
        tier releases them)."""
        self._apply()
        unused, self._unused = self._unused, []
        return unused

    def close(self) -> None:
        """Stop the threads without waiting for probes in flight (they only read)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._batches.clear()
