"""The slab's namespace table: names to ids, quotas, and each namespace's counters.

Ids live in the slab, so every process and every restart of a kept slab agrees on them.
The default namespace ``""`` is id 0; its counters are derived (the slab's less the named
ones'), so the hot paths of a server without tenants pay nothing for namespaces.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Mapping

from ..errors import SlabError
from . import layout as L
from .lock import OWNER_LOCK_WAIT_S
from .stats import SlabStats

_NS_WORDS = L.NS_WORDS
_NS_QUOTA = L.NS_QUOTA


class SlabNamespaces(SlabStats):
    """The namespace table's part of :class:`eg_kv.slab.store.Slab`."""

    def namespace_name(self, ns: int) -> str | None:
        """The name bound to namespace id ``ns`` (None: no namespace of that id in use)."""
        if not 0 <= ns < L.NS_COUNT or (ns and not self._nsw[ns * _NS_WORDS + L.NS_USED]):
            return None
        return self._ns_name(ns) if ns else ""

    def namespace_quota(self, ns: int) -> int:
        """Namespace id ``ns``'s quota in bytes (0: none, or no such namespace)."""
        if not 0 < ns < L.NS_COUNT:
            return 0
        return int(self._nsw[ns * _NS_WORDS + L.NS_QUOTA])

    def _ns_name(self, ns: int) -> str:
        e = self._nsw
        off = L.NS_OFFSET + 8 * (ns * _NS_WORDS + L.NS_NAME_WORD)
        n = min(e[ns * _NS_WORDS + L.NS_NAME_LEN], L.NS_NAME_MAX)
        return self._mm[off : off + n].decode("utf-8", "replace")

    def bind_namespaces(
        self, quotas: Mapping[str, int], timeout: float | None = OWNER_LOCK_WAIT_S
    ) -> dict[str, int]:
        """Give each namespace name its id, and set its quota (bytes; 0 = none).

        A name already in the namespace table keeps its id (so every process and every
        restart of a kept slab agrees); a new one takes a free entry. The default
        namespace ``""`` is id 0. Names no longer given keep their entries and blocks.

        Returns:
            name -> namespace id.

        Raises:
            SlabError: the table's :data:`layout.NS_COUNT` entries are all taken, or a
                name is longer than :data:`layout.NS_NAME_MAX` bytes.
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        nsw, out = self._nsw, {}
        with self._locked(timeout):
            known, free = {}, []
            for ns in range(1, L.NS_COUNT):
                if nsw[ns * _NS_WORDS + L.NS_USED]:
                    known[self._ns_name(ns)] = ns
                else:
                    free.append(ns)
            free.reverse()
            for name, quota in quotas.items():
                raw = name.encode("utf-8")
                if len(raw) > L.NS_NAME_MAX:
                    raise SlabError(f"namespace name {name[:80]!r} is over {L.NS_NAME_MAX} bytes")
                ns = 0 if not name else known.get(name, -1)
                if ns < 0:
                    if not free:
                        raise SlabError(
                            f"the namespace table is full ({L.NS_COUNT - 1} namespaces): "
                            "restart with --fresh to drop namespaces no longer used"
                        )
                    ns = free.pop()
                    e = ns * _NS_WORDS
                    nsw[e : e + _NS_WORDS] = array.array("q", bytes(L.NS_ENTRY_SIZE))
                    off = L.NS_OFFSET + 8 * (e + L.NS_NAME_WORD)
                    self._mm[off : off + len(raw)] = raw
                    nsw[e + L.NS_NAME_LEN] = len(raw)
                    nsw[e + L.NS_USED] = 1
                    known[name] = ns
                nsw[ns * _NS_WORDS + _NS_QUOTA] = quota
                out[name] = ns
        return out

    def namespace_stats(
        self, only: int | None = None, timeout: float | None = None
    ) -> dict[str, dict[str, int | str]]:
        """Each namespace's counters by name (the contract's eight fields first), or only
        namespace ``only``'s. The default namespace's counters are the slab's less the
        named ones', read in one hold of the lock; its get hits and misses are its own
        (:meth:`~eg_kv.slab.store.Slab._count_read`), as each named one's.

        Raises:
            LockTimeout: the lock stayed taken for ``timeout`` seconds.
        """
        nsw, out = self._nsw, {}
        local = self._reader_counts()
        # The namespaces in use, looked for outside the lock (bound rarely, and checked
        # again inside), in C: a loop over all 4,096 entries under the lock was 0.6 ms of
        # every worker's PUTs waiting per /kv/stats, a tenant's own included.
        if only:  # a named namespace's own counters: its entry alone
            names = [only]
        else:
            flags = nsw[L.NS_USED : L.NS_COUNT * _NS_WORDS : _NS_WORDS].tolist()
            names = list(itertools.compress(range(L.NS_COUNT), flags))
        total = None
        with self._locked(timeout, write=False):
            # The slab's totals in the same hold as the namespaces' (apart, a PUT between
            # the two made the default namespace's counts -1 and back: a counter reset).
            if not only:
                total = self._counters_locked()
            for ns in names:
                e = ns * _NS_WORDS
                if not nsw[e + L.NS_USED]:
                    continue
                one: dict[str, int | str] = {k: nsw[e + i] for k, i in L.NS_DERIVED.items()}
                one.update({k: nsw[e + i] for k, i in L.NS_EVENTS.items()})
                one["quota_bytes"] = nsw[e + _NS_QUOTA]
                one["quota_used_bytes"] = one["reserved_bytes"] = 0  # set below
                if ns:  # the default namespace's are set below
                    hits, misses = local.get(ns, (0, 0))
                    one["get_hits"] = int(one["get_hits"]) + hits
                    one["get_misses"] = int(one["get_misses"]) + misses
                one["dedup_savings_bytes"] = int(one["logical_bytes"]) - int(one["resident_bytes"])
                one["namespace"] = name = self._ns_name(ns)
                out[name] = (ns, one)
        # The default namespace's counters are the slab's less the named ones' (the hot
        # paths of a server without tenants then pay nothing for namespaces).
        if total is not None:
            hits, misses = local.get(0, (0, 0))
            own = {"get_hits": total["get_hits"] + hits, "get_misses": total["get_misses"] + misses}
            total = self._stats_from(total, local)
            default = out[""][1]
            for key in (*L.NS_DERIVED, *L.NS_EVENTS):
                if key in own:  # counted where the read was: never a difference
                    default[key] = own[key]
                else:  # counted under the lock, read in the same hold: exact
                    default[key] = total[key] - sum(int(v[key]) for k, (_, v) in out.items() if k)
            default["dedup_savings_bytes"] = int(default["logical_bytes"]) - int(
                default["resident_bytes"]
            )
        ps = self.page_size
        for _ns, one in out.values():
            # What the quota counts: whole pages, of published blocks and uploads in flight.
            one["reserved_bytes"] = int(one["reserved_pages"]) * ps
            one["quota_used_bytes"] = (int(one["slot_pages"]) + int(one["reserved_pages"])) * ps
        return {k: v for k, (ns, v) in out.items() if only is None or ns == only}
