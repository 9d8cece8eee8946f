"""A server set as one cache: per-member connectors behind placement, health and membership.

:class:`SetConnector` (sync) and :class:`eg_kv.client.aio_sets.AsyncSetConnector` (asyncio)
have the methods of the single-server clients; ``RemoteKVConnector`` /
``AsyncRemoteKVConnector`` (:mod:`eg_kv.client.connectors`) build them when ``base_url``
names a set (a list, a ``dns+`` or ``dnssrv+`` URL; :mod:`eg_kv.client.members`). A set of
one plain URL never comes here: the direct client serves it at today's cost.

What the two share is :class:`Router` (no request I/O of its own):

* every address goes to its home, the best-ranked member of weighted HRW
  (:mod:`eg_kv.client.placement`) that is not down; a batch is split by member, the groups are
  sent in parallel (one round trip per member) and the answers merged in the caller's
  order, so prefix hits count over the merged order;
* a batch lookup has one deadline, ``timeout_s`` for all of it; once some members
  answered, the others get at most :data:`STRAGGLER_FACTOR` times as long again (at
  least :data:`STRAGGLER_FLOOR_S`), and the batch is answered without them: their
  addresses are misses and they are marked down, so a slow or hung member costs its
  share of one batch, not every batch's wait;
* a transport error (refused, reset, timed out) of a member's connector marks it down
  (:class:`eg_kv.client.members.Health`: 1 s doubling to 30 s); while down, its addresses go to
  their next-ranked member and no request waits on it; a background thread probes it
  when its back-off runs out (``/healthz`` and a one-address batch lookup, each bounded
  by 1 s: a member whose health check answers while its data routes stall stays down),
  and when both answer its addresses go home again;
* for one refresh window after a membership change, a miss at an address's new home asks
  its previous home once (:meth:`eg_kv.client.members.View.previous_home`), so a scale-out is
  not a miss storm;
* member weights are each member's ``capacity_bytes`` (its ``/kv/stats``), re-read at
  each refresh and capped at :data:`eg_kv.client.placement.WEIGHT_CAP_FACTOR` times the median.

Standard library only for a list of URLs; dnspython only for a DNS entry.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..config import parse_addr
from .core import KvCacheConfig, KvCacheStats, batches, to_address
from .interface import Unreachable
from .members import Health, Member, Membership, View, parse_server_set
from .placement import merge, prefix_hits
from .setstats import MemberStats, member_line, set_stats
from .sync import ServerConnector

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How often the prober looks for members whose back-off ran out.
PROBE_TICK_S = 0.1
#: The bound on one probe or weighing of a member (a dead member costs the prober this).
PROBE_TIMEOUT_S = 1.0
#: Threads of the sync connector that send a batch's groups in parallel.
MAX_FANOUT_THREADS = 16
#: Once some members of a batch answered, the others get at most this many times the
#: time taken so far (from the batch's start) ...
STRAGGLER_FACTOR = 4.0
#: ... and never less than this (a loaded host answers in tens of ms, not hundreds);
#: always within the batch's one deadline, ``timeout_s``.
STRAGGLER_FLOOR_S = 0.25
#: The address a probe looks up: any valid address will do, it need not exist.
PROBE_ADDRESS = to_address("eg-kv:probe")

Groups = dict[str, list[int]]


def member_config(config: KvCacheConfig, member: Member, **changes: Any) -> KvCacheConfig:
    """The single-server config of one member (its URL, its TLS name)."""
    tls_name = member.server_name if member.server_name != member.host else None
    return dataclasses.replace(config, base_url=member.base_url, server_name=tls_name, **changes)


def _member_key(member: Member) -> tuple:
    # A member whose address changed (a restarted pod's new IP) gets a new connector.
    return (member.id, member.scheme, member.host, member.port, member.path, member.server_name)


def _nameservers(dns_server: str | None) -> tuple[list[str] | None, int]:
    if not dns_server:
        return None, 53
    host, port = parse_addr(dns_server if ":" in dns_server else f"{dns_server}:53")
    return [host], port


class Router:
    """Membership, health and placement of a set; shared by the sync and async clients.

    Args:
        config: the set's config (``base_url`` is the server setting).

    Raises:
        ConfigError: the setting does not parse.
    """

    def __init__(self, config: KvCacheConfig) -> None:
        self.config = config
        self.health = Health()
        #: Called with each new view after a membership change (from the refresh thread).
        self.listeners: list[Callable[[View], None]] = []
        nameservers, dns_port = _nameservers(config.dns_server)
        self._stop = threading.Event()
        self.membership = Membership(
            parse_server_set(config.base_url),
            refresh_s=config.refresh_s,
            nameservers=nameservers,
            dns_port=dns_port,
            weigh=self._weigh,
            weigh_timeout_s=PROBE_TIMEOUT_S * 2,
            on_change=self._changed,
        )
        self._prober = threading.Thread(target=self._probe_loop, name="eg-kv-prober", daemon=True)
        self._prober.start()

    # -- placement

    def view(self) -> View:
        return self.membership.view()

    def down(self) -> frozenset[str]:
        return self.health.down()

    def home(self, address: str) -> tuple[View, str | None]:
        """The current view and ``address``'s home in it (None: no member up)."""
        view = self.membership.view()
        return view, view.placement.home(address, self.health.down())

    def previous(self, view: View, address: str, home: str | None) -> str | None:
        """Where to ask once after a miss at ``home``: the previous home, in the window."""
        down = self.health.down()
        before = view.previous_home(address, down)
        return before if before is not None and before != home and before not in down else None

    def plan(self, addresses: Sequence[str]) -> tuple[View, Groups]:
        """A batch split by member, down members skipped."""
        view = self.membership.view()
        return view, view.placement.group(addresses, self.health.down())

    def second_plan(self, view: View, addresses: Sequence[str], found: Sequence[bool],
                    groups: Groups) -> Groups:  # fmt: skip
        """The misses to ask their previous home once, grouped by that member."""
        if view.previous is None:
            return {}
        home_of = {i: m for m, idx in groups.items() for i in idx}
        out: Groups = {}
        for i, hit in enumerate(found):
            if not hit:
                before = self.previous(view, addresses[i], home_of.get(i))
                if before is not None:
                    out.setdefault(before, []).append(i)
        return out

    # -- health

    def failed(self, member_id: str) -> None:
        """A request to the member failed to reach it: down (once; the prober doubles)."""
        if member_id not in self.health.down():
            self.health.failed(member_id)

    def late(self, member_ids: Iterable[str], waited_s: float) -> None:
        """Members that had not answered a batch when it was answered without them: down,
        whatever their ``/healthz`` says (a data route that stalls is what costs)."""
        for member_id in member_ids:
            if member_id not in self.health.down():
                backoff = self.health.failed(member_id)
                log.warning(
                    "eg-kv: member %s did not answer a batch lookup within %.3f s; its "
                    "addresses are misses and it is down for %.1f s (then probed)",
                    member_id, waited_s, backoff,
                )  # fmt: skip

    def cut(self, started: float, deadline: float) -> float:
        """When a batch stops waiting for the members that have not answered, given that
        another member just answered (``time.monotonic()`` values)."""
        elapsed = time.monotonic() - started
        return min(deadline, started + max(STRAGGLER_FLOOR_S, STRAGGLER_FACTOR * elapsed))

    def _changed(self, view: View) -> None:
        self.health.forget(view.members)
        for listener in self.listeners:
            listener(view)

    def _probe_loop(self) -> None:
        while not self._stop.wait(PROBE_TICK_S):
            view = self.membership.view()
            for member_id in self.health.due():
                member = view.members.get(member_id)
                if member is None:
                    continue
                if self._probe(member):
                    self.health.succeeded(member_id)
                else:
                    self.health.failed(member_id)

    def _probe(self, member: Member) -> bool:
        """Whether a down member is up again: ``/healthz`` answers and so does a data
        route (a one-address batch lookup), each within the probe's bound. Any HTTP
        answer to the lookup counts (even a refusal of the token): it is the wait that
        is being probed."""
        cfg = member_config(
            self.config, member, timeout_s=min(self.config.timeout_s, PROBE_TIMEOUT_S),
            local_reads=False,
        )  # fmt: skip
        unreachable: list[BaseException] = []
        with ServerConnector(cfg, on_unreachable=unreachable.append) as probe:
            if probe.healthz() is None:
                return False
            # Refused, reset, timed out: the data route does not answer. Any other failure
            # is an answer, if not a usable one.
            probe.try_exists_addresses([PROBE_ADDRESS])
            return not unreachable

    def _weigh(self, member: Member) -> float | None:
        cfg = member_config(
            self.config, member, timeout_s=min(self.config.timeout_s, PROBE_TIMEOUT_S)
        )
        with ServerConnector(cfg) as conn:
            capacity = conn.stats().extra.get("capacity_bytes")
        return float(capacity) if isinstance(capacity, int) and capacity > 0 else None

    def close(self) -> None:
        self._stop.set()
        self.membership.close()
        if self._prober is not threading.current_thread():
            self._prober.join(timeout=PROBE_TIMEOUT_S * 3)


class MemberConnectors:
    """One connector per member, built on first use, dropped when the member leaves.

    Args:
        router: the set's router (its config, its health).
        build: ``build(member_config, on_unreachable) -> connector``.
        dispose: ``dispose(connector)`` closes a dropped connector (default: ``close()``).
    """

    def __init__(self, router: Router, build: Callable[[KvCacheConfig, Unreachable], Any],
                 dispose: Callable[[Any], None] | None = None) -> None:  # fmt: skip
        self._router = router
        self._build = build
        self._dispose = dispose or (lambda conn: conn.close())
        self._lock = threading.Lock()
        self._conns: dict[tuple, Any] = {}

    def get(self, view: View, member_id: str) -> Any:
        member = view.members[member_id]
        key = _member_key(member)
        conn = self._conns.get(key)
        if conn is not None:
            return conn
        with self._lock:
            conn = self._conns.get(key)
            if conn is None:
                down = functools.partial(_member_unreachable, self._router, member_id)
                conn = self._build(member_config(self._router.config, member), down)
                self._conns[key] = conn
            return conn

    def prune(self, view: View) -> None:
        """Close the connectors of members that left (or moved to another address);
        a request still running on one finishes, its connection is then closed."""
        keep = {_member_key(m) for m in view.members.values()}
        with self._lock:
            gone = [k for k in self._conns if k not in keep]
            stale = [self._conns.pop(k) for k in gone]
        for conn in stale:
            self._dispose(conn)

    def take_all(self) -> list[Any]:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        return conns


def _member_unreachable(router: Router, member_id: str, _exc: BaseException) -> None:
    router.failed(member_id)


def absent(status: int | None) -> bool:
    # Only a definite 404 sends a DELETE on to the previous home; a lost answer (None)
    # may have been applied.
    return status == 404


class SetConnector:
    """A server set behind the :class:`~eg_kv.client.sync.ServerConnector` interface.

    Thread-safe, a context manager. Hot-path methods never raise (a miss); ``stats()``
    sums the members that answered and raises :class:`RemoteError` when none did.
    """

    def __init__(self, config: KvCacheConfig) -> None:
        """Args:
            config: the set's config (``base_url`` a list or DNS URL).

        Raises:
            ConfigError: the setting does not parse.
        """
        self.config = config
        self._router = Router(config)
        self._members = MemberConnectors(
            self._router, lambda cfg, hook: ServerConnector(cfg, on_unreachable=hook)
        )
        self._router.listeners.append(self._members.prune)
        self._fanout = ThreadPoolExecutor(MAX_FANOUT_THREADS, thread_name_prefix="eg-kv-fanout")
        self._closed = False

    @classmethod
    def from_env(cls, **settings: Any) -> SetConnector:
        """A set connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings))

    def __repr__(self) -> str:
        members = len(self._router.view().members)
        return f"SetConnector({self.config.base_url!r}, {members} members)"

    def __enter__(self) -> SetConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def router(self) -> Router:
        return self._router

    def close(self) -> None:
        """Stop the background threads and close every member's connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._router.close()
        self._fanout.shutdown(wait=False, cancel_futures=True)
        for conn in self._members.take_all():
            conn.close()

    # -- one address

    def _one(self, key: str | bytes, op: Callable[[Any, str], T], miss: Callable[[T], bool],
             ask_previous: bool = True,
             may_start: Callable[[float], bool] | None = None) -> T | None:  # fmt: skip
        address = to_address(key)
        if self._closed:
            return None
        view, home = self._router.home(address)
        if home is None:
            return None
        result = op(self._members.get(view, home), address)
        if ask_previous and miss(result):
            before = self._router.previous(view, address, home)
            # The second request gets a fresh timeout_s: it starts only if the caller's
            # deadline still has room for all of it.
            if before is not None and (may_start is None or may_start(self.config.timeout_s)):
                return op(self._members.get(view, before), address)
        return result

    def fetch(self, key: str | bytes, sink: Callable[..., T],
              may_start: Callable[[float], bool] | None = None) -> T | None:  # fmt: skip
        """``GET`` the block from its home (see :meth:`ServerConnector.fetch`).

        Args:
            key: the block's key or address.
            sink: the body's reader.
            may_start: ``may_start(timeout_s)``: whether a request bounded by ``timeout_s``
                may still start now (:meth:`eg_kv.lmcache.write_gate.WriteGate.can_start`); asked
                before the previous home is, after a miss at the home.
        """
        return self._one(key, lambda c, a: c.fetch(a, sink), lambda r: r is None,
                         may_start=may_start)  # fmt: skip

    get = ServerConnector.get
    get_into = ServerConnector.get_into
    put = ServerConnector.put
    put_parts = ServerConnector.put_parts

    def put_status(self, key: str | bytes, parts: Iterable[Any]) -> int | None:
        """``PUT`` at the address's home (its next-ranked member while it is down)."""
        parts = list(parts)
        return self._one(key, lambda c, a: c.put_status(a, parts), lambda _r: False, False)

    def contains(self, key: str | bytes) -> bool:
        """``HEAD`` at the home (and the previous home once, right after a change)."""
        return bool(self._one(key, lambda c, a: c.contains(a), lambda r: not r))

    def exists(self, key: str | bytes) -> bool:
        """``GET /exists`` at the home (and the previous home once after a change)."""
        return bool(self._one(key, lambda c, a: c.exists(a), lambda r: not r))

    def delete(self, key: str | bytes) -> bool:
        """``DELETE`` one reference where the block lives (see :meth:`delete_status`)."""
        return self.delete_status(key) == 204

    def delete_status(self, key: str | bytes) -> int | None:
        """``DELETE`` one reference where the block lives: its home, else (right after a
        change, and only when the home answered 404) its previous home. A lost answer at
        the home is not sent on: the home may have applied it, and one DELETE releases
        one reference, never two."""
        return self._one(key, lambda c, a: c.delete_status(a), absent)

    # -- batches

    def _ask(
        self, view: View, member_id: str, part: list[str], deadline: float, bounded: bool
    ) -> Any:
        """One member's share of a batch: a request per 1,024 addresses, the later ones
        (all of them when the caller ``bounded`` the batch's deadline) bounded by what is
        left of it. None when one failed."""
        conn = self._members.get(view, member_id)
        out: list[bool] = []
        for n, chunk in enumerate(batches(part)):
            left = deadline - time.monotonic()
            if n and left <= 0:
                return None
            found = conn.try_exists_addresses(chunk, timeout_s=left) if n or bounded else (
                conn.try_exists_addresses(chunk))  # fmt: skip
            if found is None:
                return None
            out.extend(found)
        return out

    def _parallel(
        self,
        view: View,
        groups: Groups,
        addresses: Sequence[str],
        deadline: float,
        bounded: bool = False,
    ) -> dict[str, list[bool] | None]:
        """Each group's lookup, one request per member, in parallel, all answered by
        ``deadline``; a member still out when the batch stops waiting for it
        (:meth:`Router.cut`) is missing from the answer and marked down.

        One group is sent from the caller's thread (nothing to wait for beside it)."""
        jobs = [(m, [addresses[i] for i in idx]) for m, idx in groups.items()]
        if len(jobs) <= 1:
            return {m: self._ask(view, m, part, deadline, bounded) for m, part in jobs}
        started = time.monotonic()
        pending = {
            self._fanout.submit(self._ask, view, m, part, deadline, bounded): m for m, part in jobs
        }
        out: dict[str, list[bool] | None] = {}
        cut = deadline
        while pending:
            done, _ = concurrent.futures.wait(
                pending, timeout=max(0.0, cut - time.monotonic()),
                return_when=concurrent.futures.FIRST_COMPLETED,
            )  # fmt: skip
            if not done:
                break
            for future in done:
                out[pending.pop(future)] = future.result()
            cut = self._router.cut(started, deadline)
        if pending:
            for future in pending:
                future.cancel()  # one still queued is never sent
            self._router.late(pending.values(), time.monotonic() - started)
        return out

    def _lookup(
        self, addresses: Sequence[str], timeout_s: float | None = None
    ) -> tuple[list[bool], bool]:
        """(one bool per address in the caller's order, whether any member answered)."""
        if self._closed or not addresses:
            return [False] * len(addresses), not self._closed
        limit = self.config.timeout_s
        wait_s = limit if timeout_s is None else min(timeout_s, limit)
        bounded = wait_s < limit
        deadline = time.monotonic() + wait_s
        try:
            view, groups = self._router.plan(addresses)
            answers = self._parallel(view, groups, addresses, deadline, bounded)
            ok = {m: a for m, a in answers.items() if a is not None}
            found = merge(len(addresses), groups, ok, False)
            again = self._router.second_plan(view, addresses, found, groups)
            if again and time.monotonic() < deadline:
                for m, a in self._parallel(view, again, addresses, deadline, bounded).items():
                    if a is not None:
                        for i, hit in zip(again[m], a, strict=True):
                            found[i] = found[i] or hit
        except (RuntimeError, concurrent.futures.CancelledError):
            # close() shut the fan-out pool down (submit raises RuntimeError) or cancelled
            # a group still queued (its result() raises CancelledError): all misses.
            return [False] * len(addresses), False
        return found, bool(ok)

    def exists_many(self, keys: Sequence[str | bytes]) -> list[bool]:
        """One bool per key; each member asked once (per 1024 keys), in parallel."""
        return self._lookup([to_address(k) for k in keys])[0]

    def try_exists_many(self, keys: Sequence[str | bytes]) -> list[bool] | None:
        """:meth:`exists_many`, or None when no member could be asked."""
        return self.try_exists_addresses([to_address(k) for k in keys])

    def try_exists_addresses(
        self, addresses: Sequence[str], timeout_s: float | None = None
    ) -> list[bool] | None:
        """Like :meth:`ServerConnector.try_exists_addresses`; a member that failed costs
        its share (its addresses are misses); None only when no member answered.

        Args:
            timeout_s: the batch's one deadline, when shorter than the config's.
        """
        found, answered = self._lookup(list(addresses), timeout_s)
        return found if answered else None

    def contains_prefix(self, keys: Sequence[str | bytes]) -> int:
        """Prefix hits over the merged answer, whichever member holds each key."""
        return prefix_hits(self._lookup([to_address(k) for k in keys])[0])

    # -- the set

    def member_stats(self) -> list[MemberStats]:
        """Each member's stats (in parallel), sorted by member id."""
        view = self._router.view()

        def one(member_id: str) -> MemberStats:
            return member_line(view.members[member_id], self._members.get(view, member_id).stats)

        ids = list(view.placement.members)
        return list(self._fanout.map(one, ids)) if ids else []

    def stats(self) -> KvCacheStats:
        """The sum over the members that answered.

        Raises:
            RemoteError: no member answered (the first member's error is named).
        """
        return set_stats(self.member_stats())

    def healthz(self) -> dict[str, Any] | None:
        """``{"status": "ok", "members": K, "members_up": k}`` while a member is up."""
        view = self._router.view()
        down = self._router.down()
        up = [m for m in view.placement.members if m not in down]
        for member_id in up:
            if self._members.get(view, member_id).healthz() is not None:
                return {"status": "ok", "members": len(view.members), "members_up": len(up)}
        return None


#: The name this class had before the set connectors were named for what they serve.
ClusterConnector = SetConnector
