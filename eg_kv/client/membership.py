"""A server set's live member list: re-resolved in the background, weighed by capacity,
published as immutable :class:`View` objects (see :mod:`eg_kv.client.members` for the
entries and their refresh rules)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from .dns import DEFAULT_QUERY_TIMEOUT_S, DNS_THREADS, make_resolver, resolve
from .members import DiscoveryError, DnsQuery, Member, ServerSet, is_positive, parse_server_set
from .placement import WEIGHT_CAP_FACTOR, Placement, cap_weights

log = logging.getLogger(__name__)

#: How often DNS entries are re-resolved (the issue's default; Loki and Mimir re-read
#: their memcached SRV records every 10-30 s).
DEFAULT_REFRESH_S = 15.0
#: The bound on one call of the ``weigh`` hook, for all members together.
DEFAULT_WEIGH_TIMEOUT_S = 5.0
#: At most this many weighings at once (and so threads of a hook that hangs).
_WEIGH_THREADS = 8
#: What the constructor waits beyond the first refresh's own bounds (for its threads to
#: be scheduled and the view published) before it returns with what is known.
_START_SLACK_S = 0.25


# --------------------------------------------------------------------------- membership


@dataclasses.dataclass(frozen=True)
class View:
    """The set as it stands at one moment; immutable, so a batch places every address
    against the same set however the membership changes meanwhile.

    Attributes:
        members: ``{member_id: Member}``.
        placement: HRW over the members' ids and weights.
        previous: the placement before the last change, or None.
        changed_at: ``time.monotonic()`` of the last change.
        window_s: how long after a change :meth:`previous_home` answers (one refresh).
    """

    members: Mapping[str, Member]
    placement: Placement
    previous: Placement | None = None
    changed_at: float = 0.0
    window_s: float = DEFAULT_REFRESH_S

    def previous_home(
        self, address: str, skip: Collection[str] = (), now: float | None = None
    ) -> str | None:
        """Where ``address`` lived before the last change, if that was less than one
        window ago, that member is still in the set, and it is not the current home: on a
        miss at the new home, ask there once (so a scale-out is not a miss storm).

        Args:
            address: the block address.
            skip: member ids known to be down.
            now: ``time.monotonic()`` (for tests).
        """
        if self.previous is None:
            return None
        now = time.monotonic() if now is None else now
        if now - self.changed_at >= self.window_s:
            return None
        before = self.previous.home(address, skip)
        if (
            before is None
            or before not in self.members
            or before == self.placement.home(address, skip)
        ):
            return None
        return before


Weigh = Callable[[Member], "float | None"]


class Membership:
    """The live member list of a server setting, re-resolved in the background.

    Args:
        setting: a server setting string or a parsed :class:`ServerSet`.
        refresh_s: seconds between re-resolutions of the DNS entries (and retries of
            members not yet weighed); also the window of :meth:`View.previous_home`.
        query_timeout_s: the bound on each DNS resolution.
        nameservers, dns_port: the DNS servers to ask (default: the system's).
        weigh: ``weigh(member) -> weight | None``, called from a worker thread for each
            member at each refresh (the client reads ``capacity_bytes`` from
            ``/kv/stats``); None or an exception leaves the member's last weight (or
            unweighed), to be retried at the next refresh. An unweighed member counts as
            the mean of the weighed ones, so it takes an equal share meanwhile. No
            weight counts for more than :data:`~eg_kv.client.placement.WEIGHT_CAP_FACTOR`
            times the (lower) median (:func:`~eg_kv.client.placement.cap_weights`); a member
            held by the cap, or whose weight moves by more than that factor, is logged.
        weigh_timeout_s: the bound on one round of weighing, all members in parallel.
        on_change: called with the new :class:`View` after each change (from the thread
            that made it; keep it short).
        wait: whether the constructor waits for the first refresh (below); with False
            the caller calls :meth:`wait_started` before it first reads the view.

    The first resolution and weighing run as the constructor starts, and it waits for
    them at most :attr:`start_bound_s` (``query_timeout_s``, plus ``weigh_timeout_s``
    with a ``weigh`` hook, plus 0.25 s): all DNS entries together, every SRV target's A and AAAA
    lookups concurrently, under one ``query_timeout_s`` deadline. Past the bound it
    returns with what is known (the listed URLs) and the members fill in when the
    resolution ends. If every DNS entry fails, the set starts empty (every address a
    miss) and fills at a later refresh. The thread runs only when there is something to
    refresh (a DNS entry or a ``weigh`` hook) and stops on :meth:`close`.

    Raises:
        ConfigError: the setting does not parse, or a bound is not a positive number.
    """

    def __init__(
        self,
        setting: str | ServerSet,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
        nameservers: Sequence[str] | None = None,
        dns_port: int = 53,
        weigh: Weigh | None = None,
        weigh_timeout_s: float = DEFAULT_WEIGH_TIMEOUT_S,
        on_change: Callable[[View], None] | None = None,
        wait: bool = True,
    ) -> None:
        for name, value in (("refresh_s", refresh_s), ("query_timeout_s", query_timeout_s),
                            ("weigh_timeout_s", weigh_timeout_s)):  # fmt: skip
            if not is_positive(value):
                raise ConfigError(f"{name} must be a positive number of seconds, not {value!r}")
        self.servers = setting if isinstance(setting, ServerSet) else parse_server_set(setting)
        self.refresh_s = float(refresh_s)
        self._query_timeout_s = float(query_timeout_s)
        self._weigh = weigh
        self._weigh_timeout_s = float(weigh_timeout_s)
        #: The longest the constructor waits for the first resolution and weighing.
        self.start_bound_s = (
            self._query_timeout_s * bool(self.servers.queries)
            + (self._weigh_timeout_s if weigh is not None else 0.0)
            + _START_SLACK_S
        )
        self._on_change = on_change
        self._resolver = None
        self._dns_pool: concurrent.futures.ThreadPoolExecutor | None = None
        if self.servers.queries:
            self._resolver = make_resolver(nameservers, dns_port, query_timeout_s)
            self._dns_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=DNS_THREADS, thread_name_prefix="eg-kv-dns"
            )
        self._found: dict[DnsQuery, list[Member]] = {}  # last good answer of each entry
        self._failing: set[DnsQuery] = set()
        self._weights: dict[str, float] = {}  # measured weights, by member id
        self._weighing: dict[str, concurrent.futures.Future[Any]] = {}  # weighings under way
        self._weigh_pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: Members the weight cap holds now, logged once each (one whose reported capacity
        #: changed at every refresh logged, and was kept, once per refresh for good).
        self._capped: set[str] = set()
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._view = View({}, Placement({}), None, time.monotonic(), self.refresh_s)
        self._stop = threading.Event()
        self._started = threading.Event()  # the first refresh is done
        self._thread: threading.Thread | None = None
        if not (self.servers.queries or weigh is not None):
            self.refresh()  # listed URLs only: nothing to wait for
            return
        self._start_by = time.monotonic() + self.start_bound_s
        self._thread = threading.Thread(target=self._run, name="eg-kv-membership", daemon=True)
        self._thread.start()
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait for the first refresh, at most until :attr:`start_bound_s` after the
        constructor began (the constructor does, unless told ``wait=False``: an async
        caller waits off its loop); past it, start with what is known: the first
        refresh publishes the rest when it ends."""
        if self._thread is None or self._started.is_set():
            return
        if not self._started.wait(max(0.0, self._start_by - time.monotonic())):
            self._publish(self._candidates(), only_if_empty=True)

    def __repr__(self) -> str:
        return f"Membership({len(self._view.members)} members)"

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def view(self) -> View:
        """The current :class:`View` (one atomic read)."""
        return self._view

    @property
    def members(self) -> tuple[Member, ...]:
        """The current members, sorted by id."""
        view = self._view
        return tuple(view.members[m] for m in view.placement.members)

    def refresh(self) -> bool:
        """Resolve every DNS entry and weigh new members now.

        Returns:
            True when the member list or a weight changed.
        """
        with self._refresh_lock:
            # One deadline for every entry: a DNS server that drops some queries costs
            # the refresh query_timeout_s at most, never that much per target.
            deadline = time.monotonic() + self._query_timeout_s
            for query in self.servers.queries:
                self._resolve_one(query, deadline)
            candidates = self._candidates()
            self._weigh_new(candidates)
            return self._publish(candidates)

    def close(self) -> None:
        """Stop the refresh thread (waits at most one DNS timeout for it)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._join_bound())
        for name in ("_weigh_pool", "_dns_pool"):
            pool = getattr(self, name)
            setattr(self, name, None)
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _join_bound(self) -> float:
        return self.start_bound_s + self._query_timeout_s

    # -- internals

    def _run(self) -> None:
        first = True
        while first or not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # the thread must outlive any surprise; the set stays as it is
                log.exception("eg-kv membership refresh failed; keeping the current set")
            if first:
                first = False
                self._started.set()

    def _resolve_one(self, query: DnsQuery, deadline: float) -> None:
        try:
            members = resolve(query, self._resolver, deadline, self._dns_pool)
        except DiscoveryError as e:
            if query not in self._failing:  # once per outage, not every refresh
                kept = len(self._found.get(query, ()))
                log.warning("eg-kv: %s; keeping its last %d member(s)", e, kept)
                self._failing.add(query)
            return
        if query in self._failing:
            log.info("eg-kv: %s resolves again: %d member(s)", query, len(members))
            self._failing.discard(query)
        # An SRV target whose address lookup failed this time keeps its last address
        # rather than falling back to the system resolver for one refresh.
        before = {m.id: m for m in self._found.get(query, ())}
        self._found[query] = [
            dataclasses.replace(m, host=before[m.id].host)
            if m.host == m.server_name and m.id in before
            else m
            for m in members
        ]

    def _candidates(self) -> dict[str, Member]:
        """Static members first, then each DNS entry's; the first with an id wins."""
        out: dict[str, Member] = {}
        for m in self.servers.static:
            out.setdefault(m.id, m)
        for query in self.servers.queries:
            for m in self._found.get(query, ()):
                out.setdefault(m.id, m)
        return out

    def _weigh_new(self, candidates: dict[str, Member]) -> None:
        """Weigh every member (again: a capacity that changes is seen within a refresh),
        all at once, bounded by ``weigh_timeout_s``; a member whose weighing fails keeps
        its last weight."""
        # Forget members that left: one that comes back may have another capacity.
        for member_id in list(self._weights):
            if member_id not in candidates:
                del self._weights[member_id]
        if self._weigh is None:
            return
        if self._weigh_pool is None:
            self._weigh_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=_WEIGH_THREADS, thread_name_prefix="eg-kv-weigh"
            )
        # A member whose last weighing still runs (a hook that hangs) is not asked again:
        # the threads stay bounded however long the hook takes.
        for m in candidates.values():
            if m.id not in self._weighing:
                try:
                    self._weighing[m.id] = self._weigh_pool.submit(self._weigh, m)
                except RuntimeError:  # close() shut the pool down meanwhile
                    return
        if not self._weighing:
            return
        concurrent.futures.wait(self._weighing.values(), timeout=self._weigh_timeout_s)
        for member_id, future in list(self._weighing.items()):
            if not future.done():
                continue
            del self._weighing[member_id]
            try:
                weight = future.result()
            except Exception as e:
                level = logging.DEBUG if member_id in self._weights else logging.INFO
                log.log(level, "eg-kv: cannot weigh %s yet: %s", member_id, e)
                continue
            if member_id in candidates and is_positive(weight):
                self._reweighed(member_id, float(weight))

    def _reweighed(self, member_id: str, weight: float) -> None:
        """Keep a member's new weight; log one that moved by more than the cap allows
        (a capacity that jumps so far is a misconfigured or lying server)."""
        before = self._weights.get(member_id)
        if before is not None and max(weight / before, before / weight) > WEIGHT_CAP_FACTOR:
            log.warning(
                "eg-kv: member %s now reports capacity %.0f bytes, was %.0f (over %gx apart);"
                " check its --capacity",
                member_id, weight, before, WEIGHT_CAP_FACTOR,
            )  # fmt: skip
        self._weights[member_id] = weight

    def _publish(self, candidates: dict[str, Member], only_if_empty: bool = False) -> bool:
        """Make the candidates (with their weights) the current view if anything changed.

        Args:
            candidates: ``{member_id: Member}`` from :meth:`_candidates`.
            only_if_empty: publish only if no view has members yet (the constructor's
                fallback must not replace a refresh that ended meanwhile).

        Returns:
            True when the view changed.
        """
        measured = {m: self._weights[m] for m in candidates if m in self._weights}
        weights = cap_weights(measured, WEIGHT_CAP_FACTOR)
        capped = {m for m, weight in weights.items() if weight < measured[m]}
        for member_id in capped - self._capped:
            weight = weights[member_id]
            log.warning(
                "eg-kv: member %s reports capacity %.0f bytes, over %gx the median; "
                "weighted as %.0f (WEIGHT_CAP_FACTOR)",
                member_id, measured[member_id], WEIGHT_CAP_FACTOR, weight,
            )  # fmt: skip
        self._capped = capped  # a member no longer held (or gone) is said again if it is
        stand_in = sum(weights.values()) / len(weights) if weights else None
        members = {}
        for member_id, m in candidates.items():
            if member_id in weights:
                weight = weights[member_id]
            elif stand_in is not None:
                weight = stand_in
            else:
                weight = m.weight
            members[member_id] = dataclasses.replace(m, weight=weight)
        with self._lock:
            old = self._view
            if members == dict(old.members) or (only_if_empty and old.members):
                return False
            placement = Placement({m.id: m.weight for m in members.values()})
            previous = old.placement if old.members else None
            view = View(
                types.MappingProxyType(members),
                placement,
                previous,
                time.monotonic(),
                self.refresh_s,
            )
            self._view = view
        if old.members:
            log.info(
                "eg-kv: server set changed: %d -> %d member(s)", len(old.members), len(members)
            )
        if self._on_change is not None:
            self._on_change(view)
        return True
