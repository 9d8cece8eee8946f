"""The slab's counters: exact totals over the whole slab, read under the lock."""

from __future__ import annotations

from . import layout as L
from .events import SlabEventLog


class SlabStats(SlabEventLog):
    """The counters' part of :class:`eg_kv.slab.store.Slab`."""

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """Exact counters over the whole slab (the contract's eight fields and more).

        Args:
            timeout: wait at most this long for the lock (the supervisor never blocks).

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        with self._locked(timeout, write=False):
            out = self._counters_locked()
        return self._stats_from(out, self._reader_counts())

    def _counters_locked(self) -> dict[str, int]:
        """The counters the lock guards (call it holding the lock), with the default
        namespace's get hits and misses (its processes' own words): :meth:`stats` then
        adds what is counted without it (:meth:`_stats_from`)."""
        st, procs = self._state, self._procs
        out = {k: st[i] for k, i in L.DERIVED_COUNTERS.items()}
        out.update({k: st[i] for k, i in L.EVENT_COUNTERS.items()})
        out["free_pages"] = st[L.ST_FREE_COUNT]
        for e in range(0, L.NPROCS * L.PROC_WORDS, L.PROC_WORDS):
            out["get_hits"] += procs[e + 1]
            out["get_misses"] += procs[e + 2]
        return out

    def _stats_from(self, out: dict[str, int], local: dict[int, tuple[int, int]]) -> dict[str, int]:
        """:meth:`stats` from what :meth:`_counters_locked` read, and the local readers'
        counts (``local``: :meth:`_reader_counts`)."""
        ps, free = self.page_size, out.pop("free_pages")
        # The named namespaces' reads, counted in their entries (summed in C).
        nsw, step = self._nsw, L.NS_WORDS
        out["get_hits"] += sum(nsw[L.NS_GET_HITS : L.NS_COUNT * step : step])
        out["get_misses"] += sum(nsw[L.NS_GET_MISSES : L.NS_COUNT * step : step])
        # Local readers' counts, as if their reads had come over HTTP.
        for hits, misses in local.values():
            out["get_hits"] += hits
            out["get_misses"] += misses
        out["checksum_failures"] += self._reader_checksum_failures()
        out["dedup_savings_bytes"] = out["logical_bytes"] - out["resident_bytes"]
        out["capacity_bytes"] = self.geometry.npages * ps
        out["free_bytes"] = free * ps
        out["page_size"] = ps
        out["max_block_size"] = self.max_block_size
        # Every block takes whole pages: what its last page leaves empty is lost. Small
        # blocks in big pages waste most of the slab (1 KiB chunks in 64 KiB pages: 98%).
        out["pages_used_bytes"] = out["slot_pages"] * ps
        out["page_waste_bytes"] = out["pages_used_bytes"] - out["resident_bytes"]
        return out
