"""A server set's plans, written once for the sync and the async set connectors: where
each address lives, how a batch is split, merged and waited for, when a miss asks again.

:class:`Router` holds the set's membership (:class:`~eg_kv.client.members.Membership`),
health (:class:`~eg_kv.client.health.Health`) and placement, and its two threads (the
prober and the membership refresh). :class:`MemberConnectors` keeps one connector per
member. The rounds of a call (a batch lookup's, a GET's) are :mod:`eg_kv.client.rounds`.

This module sends nothing and imports no connector: :mod:`eg_kv.client.sets` and
:mod:`eg_kv.client.aio_sets` do the I/O around it (threads or tasks), and the probes run on
the sync single-server connector the set connectors hand the router.

* every address goes to its home, the best-ranked member of weighted HRW
  (:mod:`eg_kv.client.placement`) that is not down; a batch is split by member, the
  groups are sent in parallel (one round trip per member) and the answers merged in the
  caller's order, so prefix hits count over the merged order;
* a batch lookup has one deadline, ``timeout_s`` for all of it; once some members
  answered, the others get at most :data:`STRAGGLER_FACTOR` times as long again (at
  least :data:`STRAGGLER_FLOOR_S`), and the batch is answered without them: their
  addresses are misses and they are marked down, so a slow or hung member costs its
  share of one batch, not every batch's wait;
* a transport error (refused, reset, timed out) of a member's connector marks it down
  (1 s doubling to 30 s); while down, its addresses go to their next-ranked member and no
  request waits on it; the prober probes it when its back-off runs out (``/healthz`` and
  a one-address batch lookup, each bounded by :data:`PROBE_TIMEOUT_S`: a member whose
  health check answers while its data routes stall stays down), and when both answer its
  addresses go home again;
* for one refresh window after a membership change, a miss at an address's new home asks
  its previous home once (:meth:`eg_kv.client.members.View.previous_home`), so a scale-out
  is not a miss storm;
* member weights are each member's ``capacity_bytes`` (its ``/kv/stats``), re-read at
  each refresh and capped at :data:`eg_kv.client.placement.WEIGHT_CAP_FACTOR` times the
  median.

Standard library only for a list of URLs; dnspython only for a DNS entry.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..blockkey import forged_failures
from ..checksum import Failures
from ..config import parse_addr
from ..errors import ConfigError
from .health import Health
from .interface import KvConnector, Unreachable
from .lease_homes import LeaseHomes, PutHomes
from .members import Member, parse_server_set
from .membership import Membership, View
from .rules import to_address, to_addresses
from .settings import KvCacheConfig

log = logging.getLogger(__name__)

#: What tells one member connector from another: a member whose address changed gets a
#: new one.
MemberKey = tuple[str, str, str, int, str, str]
#: ``factory(member_config, on_unreachable)``: a sync connector of one member.
ConnectorFactory = Callable[[KvCacheConfig, "Unreachable | None"], KvConnector]

#: How often the prober looks for members whose back-off ran out.
PROBE_TICK_S = 0.1
#: The bound on one probe or weighing of a member (a dead member costs the prober this).
PROBE_TIMEOUT_S = 1.0
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


def _member_key(member: Member) -> MemberKey:
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
        probe_with: ``probe_with(member_config, on_unreachable)``: a sync single-server
            connector, for the probes and weighings its threads run (the router imports
            no connector; both set connectors pass the sync one).
        wait: wait here for the first resolution and weighing (else the caller calls
            ``membership.wait_started()`` before its first request).

    Raises:
        ConfigError: the setting does not parse.
    """

    def __init__(self, config: KvCacheConfig, probe_with: ConnectorFactory,
                 wait: bool = True) -> None:  # fmt: skip
        self.config = config
        self._connect = probe_with
        self.health = Health()
        #: The member that granted each lease the set's lookups took: releases go there.
        self.lease_homes = LeaseHomes()
        #: The member that took each reference the set's PUTs stored: DELETEs go there.
        self.put_homes = PutHomes()
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
            wait=wait,
        )
        self._prober = threading.Thread(target=self._probe_loop, name="eg-kv-prober", daemon=True)
        self._prober.start()

    # -- placement

    def view(self) -> View:
        return self.membership.view()

    def down(self) -> frozenset[str]:
        return self.health.down()

    def up(self) -> tuple[View, list[str]]:
        """The current view and its members that are not down, in id order (a set's
        ``healthz`` asks them at once)."""
        view = self.membership.view()
        down = self.health.down()
        return view, [m for m in view.placement.members if m not in down]

    def home(self, address: str) -> tuple[View, str | None]:
        """The current view and ``address``'s home in it (None: no member up)."""
        view = self.membership.view()
        return view, view.placement.home(address, self.health.down())

    def previous(self, view: View, address: str, home: str | None) -> str | None:
        """Where to ask once after a miss at ``home``: the previous home, in the window."""
        down = self.health.down()
        before = view.previous_home(address, down)
        return before if before is not None and before != home and before not in down else None

    def release_homes(self, keys: Sequence[str | bytes]) -> tuple[View, dict[str, list[str]]]:
        """The current view and the addresses of ``keys`` grouped by where a release of
        each one's lease goes: the member that granted it (:mod:`eg_kv.client.
        lease_homes`), else its home. Left out: a granting member that left or is down
        now, and keys with no member up (those leases end on their own)."""
        view, down = self.membership.view(), self.health.down()
        addresses = to_addresses(keys)
        by_home: dict[str, list[str]] = {}
        for address, home in zip(addresses, self.lease_homes.take(addresses), strict=True):
            if home is None:
                home = view.placement.home(address, down)
            elif home not in view.members or home in down:
                continue
            if home is not None:
                by_home.setdefault(home, []).append(address)
        return view, by_home

    def delete_home(self, address: str) -> tuple[View, str]:
        """The current view and where a DELETE of ``address`` goes
        (:meth:`PutHomes.where <eg_kv.client.lease_homes.PutHomes.where>`)."""
        view = self.membership.view()
        return view, self.put_homes.where(address, view.members, self.health.down())

    def only_member(self) -> tuple[View, str]:
        """The current view and its one member: what a set's event log is.

        Raises:
            ConfigError: the set has several members; each keeps its own log (its own
                sequence numbers), so a reader follows each member's URL.
        """
        view = self.membership.view()
        members = view.placement.members
        if len(members) != 1:
            raise ConfigError(
                f"a server set of {len(members)} members has one event log per member: "
                "follow each member's URL (eg_kv.client.events.follow on a client of it)"
            )
        return view, members[0]

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
        with self._connect(cfg, unreachable.append) as probe:
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
        with self._connect(cfg, None) as conn:
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
        self._conns: dict[MemberKey, Any] = {}
        #: Blocks any member's answer failed their checksum: one count and one log line
        #: per address for the whole set, whichever member served it.
        self.checksum_failures = Failures("server set")
        #: Blocks any member's answer failed their block-key tag (forged), the same way.
        self.forged_blocks = forged_failures("server set")

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
                conn._core.checksum_failures = self.checksum_failures
                conn._core.forged_blocks = self.forged_blocks
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


def set_health(view: View, up: Sequence[str]) -> dict[str, Any]:
    """A set's ``/healthz`` answer: ``up``, the members that answered (asked at once)."""
    return {"status": "ok", "members": len(view.members), "members_up": len(up)}
