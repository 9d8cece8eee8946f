"""The servers of a set: parsed from a setting, discovered through DNS, kept fresh.

A server setting (``base_url``, ``EPISTEMIC_GRAPH_KVCACHE_URL``, LMCache's adapter
parameters) is a comma-separated list of entries, each one of:

- ``http://host:port[/prefix]`` or ``https://...``: one member, id ``host:port``;
- ``dnssrv+http://_http._tcp.eg-kv.NS.svc.cluster.local`` (or ``dnssrv+https://``): the SRV
  records of a headless Service, one member per target, id ``target:port`` (a StatefulSet
  pod's stable name, never its IP), connected at the target's address from the same DNS
  server, with the target's name for TLS;
- ``dns+http://eg-kv.NS.svc:9130`` (or ``dns+https://``): the A and AAAA records of a name,
  one member per address, id ``address:port``, with the name for TLS.

A list of one plain URL is today's single server (:attr:`ServerSet.single`). DNS entries are
re-resolved every ``refresh_s`` seconds by a background thread, each round (all its
queries, concurrent) bounded by one ``query_timeout_s`` deadline, at most
:data:`MAX_DNS_MEMBERS` members an entry; an entry whose resolution fails (timeout,
SERVFAIL, NXDOMAIN, no records) keeps its last good members, so a DNS outage never empties the set.

Weights follow each member's capacity when the client gives a ``weigh`` hook (it reads
``capacity_bytes`` from the member's ``/kv/stats``); without one, or until a member
answers, SRV weights (0 counted as 1) or 1.

dnspython is imported only when a DNS entry is used: the sync client imports this module
with the standard library alone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import logging
import math
import re
import threading
import time
import types
import urllib.parse
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..config import format_hostport
from ..errors import ConfigError, EgKvError
from .placement import WEIGHT_CAP_FACTOR, Placement, cap_weights

log = logging.getLogger(__name__)

#: How often DNS entries are re-resolved (the issue's default; Loki and Mimir re-read
#: their memcached SRV records every 10-30 s).
DEFAULT_REFRESH_S = 15.0
#: The bound on one resolution (all its queries and retries); a dead DNS server costs
#: the refresh thread this long, never a request.
DEFAULT_QUERY_TIMEOUT_S = 2.0
#: The bound on one call of the ``weigh`` hook, for all members together.
DEFAULT_WEIGH_TIMEOUT_S = 5.0
#: At most this many weighings at once (and so threads of a hook that hangs).
_WEIGH_THREADS = 8
#: At most this many members are taken from one DNS entry: the first by member id, the
#: same subset in every client (a zone that lists 10,000 targets must not cost 20,000
#: lookups per refresh). Logged when hit.
MAX_DNS_MEMBERS = 256
#: At most this many DNS queries in flight at once for one refresh (the targets' A and
#: AAAA lookups run concurrently, all under one deadline).
_DNS_THREADS = 16
#: What the constructor waits beyond the first refresh's own bounds (for its threads to
#: be scheduled and the view published) before it returns with what is known.
_START_SLACK_S = 0.25

_SCHEMES = ("http", "https")
_GRAMMAR = (
    "http(s)://host:port, dnssrv+http(s)://_http._tcp.NAME or dns+http(s)://NAME:port, "
    "comma-separated"
)


class DiscoveryError(EgKvError):
    """A DNS entry could not be resolved (timeout, no server, no records)."""


@dataclasses.dataclass(frozen=True)
class Member:
    """One server of a set.

    Attributes:
        id: the stable placement id: ``host:port``, ``target:port`` for SRV, or
            ``address:port`` for A/AAAA (IPv6 in brackets).
        scheme: ``http`` or ``https``.
        host: where to connect: a name or an IP address.
        port: the TCP port.
        path: the URL path prefix ("" or ``/prefix``).
        server_name: the name TLS verifies and sends as SNI (the SRV target or the DNS
            name when ``host`` is an address).
        weight: the member's placement weight (its capacity when known).
    """

    id: str
    scheme: str
    host: str
    port: int
    path: str = ""
    server_name: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.server_name:
            object.__setattr__(self, "server_name", self.host)

    @property
    def base_url(self) -> str:
        """``scheme://host:port/prefix``: what a single-server client is given today."""
        return f"{self.scheme}://{format_hostport(self.host, self.port)}{self.path}"

    @property
    def https(self) -> bool:
        return self.scheme == "https"


@dataclasses.dataclass(frozen=True)
class DnsQuery:
    """One DNS entry of a setting.

    Attributes:
        kind: ``"srv"`` or ``"a"`` (A and AAAA).
        scheme: ``http`` or ``https`` for the members found.
        name: the absolute name queried, without the final dot.
        port: the members' port (``"a"`` only; SRV records carry their own).
        path: the URL path prefix of the members.
    """

    kind: str
    scheme: str
    name: str
    port: int | None = None
    path: str = ""

    def __str__(self) -> str:
        prefix = "dnssrv" if self.kind == "srv" else "dns"
        port = f":{self.port}" if self.port is not None else ""
        return f"{prefix}+{self.scheme}://{self.name}{port}{self.path}"


@dataclasses.dataclass(frozen=True)
class ServerSet:
    """A parsed server setting: fixed members and DNS entries."""

    static: tuple[Member, ...]
    queries: tuple[DnsQuery, ...]

    @property
    def single(self) -> Member | None:
        """The member when the setting is exactly one plain URL (today's single server,
        which a client should serve without placement), else None."""
        return self.static[0] if len(self.static) == 1 and not self.queries else None


def parse_server_set(text: str) -> ServerSet:
    """Parse a server setting (see the module docstring for the grammar).

    Raises:
        ConfigError: an empty setting or entry, an unknown scheme, a missing host, a bad
            port, credentials, a query or a fragment in an entry, a port on a ``dnssrv+``
            entry, or one member listed twice.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"no server given: want {_GRAMMAR}")
    static: list[Member] = []
    queries: list[DnsQuery] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            raise ConfigError(f"empty entry in server list {_shown(text)}: want {_GRAMMAR}")
        member, query = _parse_entry(entry)
        if member is not None:
            if any(m.id == member.id for m in static):
                raise ConfigError(f"server {member.id} is listed twice in {_shown(text)}")
            static.append(member)
        elif query is not None:
            if query in queries:
                raise ConfigError(f"{query} is listed twice in {_shown(text)}")
            queries.append(query)
    return ServerSet(tuple(static), tuple(queries))


_CREDENTIALS = re.compile(r"(?<=://)[^/@]*@")


def _shown(text: str) -> str:
    """An entry as an error message may show it: never a user, password, query or fragment
    (a token pasted into a URL must not reach a log)."""
    return repr(_CREDENTIALS.sub("***@", re.split(r"[?#]", text, maxsplit=1)[0]))


def _parse_entry(entry: str) -> tuple[Member | None, DnsQuery | None]:
    try:
        parts = urllib.parse.urlsplit(entry)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"bad server URL {_shown(entry)}: {e}; want {_GRAMMAR}") from None
    kind, _, scheme = parts.scheme.lower().rpartition("+")
    if scheme not in _SCHEMES or kind not in ("", "dns", "dnssrv"):
        raise ConfigError(f"bad server URL {_shown(entry)}: want {_GRAMMAR}")
    if not parts.hostname:
        raise ConfigError(f"server URL {_shown(entry)} names no host")
    if parts.username or parts.password or parts.query or parts.fragment:
        # A token in a URL ends up in logs; it belongs in the token setting.
        raise ConfigError(
            f"server URL {_shown(entry)} must hold no user, password, query or fragment"
        )
    host = parts.hostname.rstrip(".").lower()
    path = parts.path.rstrip("/")
    default_port = 443 if scheme == "https" else 80
    if kind == "dnssrv":
        if port is not None:
            raise ConfigError(
                f"{_shown(entry)}: a dnssrv+ URL takes its ports from the SRV records; drop :{port}"
            )
        return None, DnsQuery("srv", scheme, host, None, path)
    if kind == "dns":
        return None, DnsQuery("a", scheme, host, port or default_port, path)
    port = port or default_port
    return Member(format_hostport(host, port), scheme, host, port, path), None


# --------------------------------------------------------------------------- DNS


def make_resolver(
    nameservers: Sequence[str] | None = None,
    dns_port: int = 53,
    timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
) -> Any:
    """A dnspython resolver bounded by ``timeout_s`` per resolution.

    Args:
        nameservers: IP addresses of the DNS servers; None reads the system's
            (``/etc/resolv.conf``, which in a Kubernetes pod names the cluster DNS).
        dns_port: their port (tests run a DNS server on a free loopback port).
        timeout_s: the lifetime of one resolution, retries included.
    """
    try:
        import dns.resolver
    except ImportError:
        raise ConfigError(
            "dns+ and dnssrv+ server URLs need dnspython: pip install dnspython"
        ) from None

    resolver = dns.resolver.Resolver(configure=nameservers is None)
    if nameservers is not None:
        resolver.nameservers = list(nameservers)
    resolver.port = dns_port
    resolver.timeout = timeout_s
    resolver.lifetime = timeout_s
    resolver.cache = None  # every refresh must see the records as they are now
    return resolver


def resolve(
    query: DnsQuery,
    resolver: Any,
    deadline: float | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> list[Member]:
    """The members a DNS entry names now, sorted by id, at most :data:`MAX_DNS_MEMBERS`.

    Args:
        query: the DNS entry.
        resolver: from :func:`make_resolver`.
        deadline: ``time.monotonic()`` by which every query of this resolution (the SRV
            record and its targets' addresses) is done; default: the resolver's lifetime
            from now. A lookup still unanswered then counts as failed.
        pool: runs the targets' A and AAAA lookups concurrently (default: one at a time).

    Raises:
        DiscoveryError: the query failed or found no usable record.
    """
    import dns.exception

    if deadline is None:
        deadline = time.monotonic() + resolver.lifetime
    lookups = _Lookups(resolver, deadline, pool)
    try:
        members = (
            _resolve_srv(query, lookups) if query.kind == "srv" else _resolve_a(query, lookups)
        )
    except dns.exception.DNSException as e:
        raise DiscoveryError(f"cannot resolve {query}: {type(e).__name__}: {e}") from None
    if not members:
        raise DiscoveryError(f"{query} names no server")
    return sorted(members, key=lambda m: m.id)


class _Lookups:
    """DNS queries of one resolution, each bounded by what is left of its deadline."""

    def __init__(self, resolver: Any, deadline: float, pool: concurrent.futures.Executor | None):
        self.resolver = resolver
        self.deadline = deadline
        self.pool = pool

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def query(self, qname: Any, rdtype: str) -> Any:
        """One query, its lifetime the time left (raises LifetimeTimeout when none is)."""
        import dns.resolver

        left = self.left()
        if left <= 0:
            raise dns.resolver.LifetimeTimeout(timeout=0.0, errors=[])
        return self.resolver.resolve(qname, rdtype, search=False, lifetime=left)

    def addresses(self, qname: Any, rdtype: str) -> list[str]:
        """The addresses of one A or AAAA query; [] when it failed or found none."""
        import dns.exception

        try:
            return [r.address for r in self.query(qname, rdtype)]
        except dns.exception.DNSException:
            return []

    def start(self, qname: Any, rdtype: str) -> concurrent.futures.Future:
        """:meth:`addresses` on the pool (or now, without one)."""
        if self.pool is not None:
            try:
                return self.pool.submit(self.addresses, qname, rdtype)
            except RuntimeError:  # the pool was shut down: close() is under way
                pass
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self.addresses(qname, rdtype))
        return done

    def result(self, future: concurrent.futures.Future) -> list[str] | None:
        """A started lookup's addresses, None if it is still unanswered at the deadline."""
        try:
            return future.result(timeout=max(0.0, self.left()))
        except concurrent.futures.TimeoutError:
            return None


def _from_additional(name: Any, response: Any) -> list[str]:
    """The addresses of ``name`` in a response's additional section (CoreDNS sends a
    headless Service's pod addresses there)."""
    import dns.rdatatype

    found: list[str] = []
    for rrset in response.additional:
        if rrset.name == name and rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            found += [r.address for r in rrset]
    return found


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0 and math.isfinite(value)


def _ordered(addresses: list[str]) -> list[str]:
    unique = {ipaddress.ip_address(a) for a in addresses}
    return [str(a) for a in sorted(unique, key=lambda a: (a.version, a))]


_CAP_WARNED: set[str] = set()


def _capped(query: DnsQuery, ids: list[str]) -> list[str]:
    """The first :data:`MAX_DNS_MEMBERS` of ``ids`` (sorted: every client takes the same)."""
    ids = sorted(ids)
    if len(ids) > MAX_DNS_MEMBERS:
        # A warning the first time per entry, not every refresh.
        level = logging.DEBUG if str(query) in _CAP_WARNED else logging.WARNING
        _CAP_WARNED.add(str(query))
        log.log(
            level,
            "eg-kv: %s names %d servers; taking the first %d by id (MAX_DNS_MEMBERS)",
            query, len(ids), MAX_DNS_MEMBERS,
        )  # fmt: skip
    return ids[:MAX_DNS_MEMBERS]


def _resolve_srv(query: DnsQuery, lookups: _Lookups) -> list[Member]:
    import dns.name

    answer = lookups.query(dns.name.from_text(query.name), "SRV")
    records = [r for r in answer if r.target != dns.name.root]  # "." means no service
    if not records:
        return []
    # RFC 2782: only the lowest priority is used; the others are standbys. (A headless
    # Service publishes every ready pod at priority 0.)
    best = min(r.priority for r in records)
    chosen: dict[str, Any] = {}
    for r in records:
        if r.priority == best:
            target = r.target.to_text(omit_final_dot=True).lower()
            chosen.setdefault(format_hostport(target, r.port), r)
    # Every target's addresses: from the additional section, else its A and AAAA
    # lookups, all started at once and all bounded by the one deadline.
    pending: dict[str, tuple[concurrent.futures.Future, ...]] = {}
    known: dict[str, list[str]] = {}
    for member_id in _capped(query, list(chosen)):
        name = chosen[member_id].target
        known[member_id] = _from_additional(name, answer.response)
        if not known[member_id]:
            pending[member_id] = (lookups.start(name, "A"), lookups.start(name, "AAAA"))
    for member_id, (v4, v6) in pending.items():
        # IPv4 is preferred (connected first), so once A answered the AAAA lookup is not
        # waited for: a DNS server that drops AAAA queries costs nothing here.
        known[member_id] = lookups.result(v4) or lookups.result(v6) or []
    members = []
    for member_id, found in known.items():
        r = chosen[member_id]
        target = r.target.to_text(omit_final_dot=True).lower()
        addresses = _ordered(found)
        host = addresses[0] if addresses else target  # else the system resolves it
        members.append(
            Member(member_id, query.scheme, host, r.port, query.path, target, float(r.weight or 1))
        )
    return members


def _resolve_a(query: DnsQuery, lookups: _Lookups) -> list[Member]:
    import dns.exception
    import dns.name

    qname = dns.name.from_text(query.name)
    # Both lookups at once, each bounded by the one deadline; the first failure's error
    # is kept for when neither finds anything.
    futures = {rdtype: _start_raising(lookups, qname, rdtype) for rdtype in ("A", "AAAA")}
    found: list[str] = []
    errors: list[BaseException] = []
    for future in futures.values():
        try:
            found += future.result(timeout=max(0.0, lookups.left()))
        except concurrent.futures.TimeoutError:
            errors.append(dns.exception.Timeout(timeout=0.0))
        except Exception as e:
            errors.append(e)
    if not found and errors:
        raise errors[0]
    assert query.port is not None
    members = {
        format_hostport(a, query.port): Member(
            format_hostport(a, query.port), query.scheme, a, query.port, query.path, query.name
        )
        for a in _ordered(found)
    }
    return [members[m] for m in _capped(query, list(members))]


def _start_raising(lookups: _Lookups, qname: Any, rdtype: str) -> concurrent.futures.Future:
    """One A or AAAA query started on the pool; its future raises what the query raised."""

    def run() -> list[str]:
        return [r.address for r in lookups.query(qname, rdtype)]

    if lookups.pool is not None:
        try:
            return lookups.pool.submit(run)
        except RuntimeError:  # the pool was shut down: close() is under way
            pass
    done: concurrent.futures.Future = concurrent.futures.Future()
    try:
        done.set_result(run())
    except Exception as e:
        done.set_exception(e)
    return done


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
    ) -> None:
        for name, value in (("refresh_s", refresh_s), ("query_timeout_s", query_timeout_s),
                            ("weigh_timeout_s", weigh_timeout_s)):  # fmt: skip
            if not _positive(value):
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
                max_workers=_DNS_THREADS, thread_name_prefix="eg-kv-dns"
            )
        self._found: dict[DnsQuery, list[Member]] = {}  # last good answer of each entry
        self._failing: set[DnsQuery] = set()
        self._weights: dict[str, float] = {}  # measured weights, by member id
        self._weighing: dict[str, concurrent.futures.Future] = {}  # weighings under way
        self._weigh_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._capped: set[tuple[str, float]] = set()  # (member, capacity) the cap held: logged
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._view = View({}, Placement({}), None, time.monotonic(), self.refresh_s)
        self._stop = threading.Event()
        self._started = threading.Event()  # the first refresh is done
        self._thread: threading.Thread | None = None
        if not (self.servers.queries or weigh is not None):
            self.refresh()  # listed URLs only: nothing to wait for
            return
        self._thread = threading.Thread(target=self._run, name="eg-kv-membership", daemon=True)
        self._thread.start()
        if not self._started.wait(self.start_bound_s):
            # Start with what is known; the first refresh publishes the rest when it ends.
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
            if member_id in candidates and _positive(weight):
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
        for member_id, weight in weights.items():
            held = (member_id, measured[member_id])
            if weight < measured[member_id] and held not in self._capped:
                self._capped.add(held)
                log.warning(
                    "eg-kv: member %s reports capacity %.0f bytes, over %gx the median; "
                    "weighted as %.0f (WEIGHT_CAP_FACTOR)",
                    member_id, measured[member_id], WEIGHT_CAP_FACTOR, weight,
                )  # fmt: skip
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
