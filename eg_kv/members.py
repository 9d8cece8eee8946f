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
re-resolved every ``refresh_s`` seconds by a background thread, each query bounded by
``query_timeout_s``; an entry whose resolution fails (timeout, SERVFAIL, NXDOMAIN, no
records) keeps its last good members, so a DNS outage never empties the set.

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

from .config import format_hostport
from .errors import ConfigError, EgKvError
from .placement import Placement

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
#: A member that failed is down for this long, doubling at each failed probe up to the
#: maximum (pymemcache's HashClient and mcrouter retry dead servers the same way).
DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 30.0

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


def resolve(query: DnsQuery, resolver: Any) -> list[Member]:
    """The members a DNS entry names now, sorted by id.

    Raises:
        DiscoveryError: the query failed or found no usable record.
    """
    import dns.exception

    try:
        members = (
            _resolve_srv(query, resolver) if query.kind == "srv" else _resolve_a(query, resolver)
        )
    except dns.exception.DNSException as e:
        raise DiscoveryError(f"cannot resolve {query}: {type(e).__name__}: {e}") from None
    if not members:
        raise DiscoveryError(f"{query} names no server")
    return sorted(members, key=lambda m: m.id)


def _addresses(resolver: Any, name: str, response: Any = None) -> list[str]:
    """The IPv4 then IPv6 addresses of ``name``: from a response's additional section
    when it has them (CoreDNS sends a headless Service's pod addresses there), else
    queried."""
    import dns.exception
    import dns.name
    import dns.rdatatype

    qname = dns.name.from_text(name)
    found: list[str] = []
    if response is not None:
        for rrset in response.additional:
            if rrset.name == qname and rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                found += [r.address for r in rrset]
        if found:
            return _ordered(found)
    for rdtype in ("A", "AAAA"):
        try:
            answer = resolver.resolve(qname, rdtype, search=False)
        except dns.exception.DNSException:
            continue
        found += [r.address for r in answer]
    return _ordered(found)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0 and math.isfinite(value)


def _ordered(addresses: list[str]) -> list[str]:
    unique = {ipaddress.ip_address(a) for a in addresses}
    return [str(a) for a in sorted(unique, key=lambda a: (a.version, a))]


def _resolve_srv(query: DnsQuery, resolver: Any) -> list[Member]:
    import dns.name

    answer = resolver.resolve(dns.name.from_text(query.name), "SRV", search=False)
    records = [r for r in answer if r.target != dns.name.root]  # "." means no service
    if not records:
        return []
    # RFC 2782: only the lowest priority is used; the others are standbys. (A headless
    # Service publishes every ready pod at priority 0.)
    best = min(r.priority for r in records)
    members = {}
    for r in records:
        if r.priority != best:
            continue
        target = r.target.to_text(omit_final_dot=True).lower()
        member_id = format_hostport(target, r.port)
        addresses = _addresses(resolver, target, answer.response)
        host = addresses[0] if addresses else target  # else the system resolves it
        members[member_id] = Member(
            member_id, query.scheme, host, r.port, query.path, target, float(r.weight or 1)
        )
    return list(members.values())


def _resolve_a(query: DnsQuery, resolver: Any) -> list[Member]:
    import dns.exception
    import dns.name

    qname = dns.name.from_text(query.name)
    found: list[str] = []
    errors: list[Exception] = []
    for rdtype in ("A", "AAAA"):
        try:
            found += [r.address for r in resolver.resolve(qname, rdtype, search=False)]
        except dns.exception.DNSException as e:
            errors.append(e)
    if not found and errors:
        raise errors[0]
    assert query.port is not None
    return [
        Member(format_hostport(a, query.port), query.scheme, a, query.port, query.path, query.name)
        for a in _ordered(found)
    ]


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
            member not yet weighed (the client reads ``capacity_bytes`` from
            ``/kv/stats``); None or an exception leaves the member unweighed, to be
            retried at the next refresh. An unweighed member counts as the mean of the
            weighed ones, so it takes an equal share meanwhile.
        weigh_timeout_s: the bound on one round of weighing, all members in parallel.
        on_change: called with the new :class:`View` after each change (from the thread
            that made it; keep it short).

    The first resolution runs in the constructor. If every DNS entry fails then, the set
    starts empty (every address a miss) and fills at a later refresh. The thread runs
    only when there is something to refresh (a DNS entry or a ``weigh`` hook) and stops
    on :meth:`close`.

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
        self._weigh = weigh
        self._weigh_timeout_s = float(weigh_timeout_s)
        self._on_change = on_change
        self._resolver = None
        if self.servers.queries:
            self._resolver = make_resolver(nameservers, dns_port, query_timeout_s)
        self._found: dict[DnsQuery, list[Member]] = {}  # last good answer of each entry
        self._failing: set[DnsQuery] = set()
        self._weights: dict[str, float] = {}  # measured weights, by member id
        self._weighing: dict[str, concurrent.futures.Future] = {}  # weighings under way
        self._weigh_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._view = View({}, Placement({}), None, time.monotonic(), self.refresh_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()
        if self.servers.queries or weigh is not None:
            self._thread = threading.Thread(target=self._run, name="eg-kv-membership", daemon=True)
            self._thread.start()

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
            for query in self.servers.queries:
                self._resolve_one(query)
            candidates = self._candidates()
            self._weigh_new(candidates)
            return self._publish(candidates)

    def close(self) -> None:
        """Stop the refresh thread (waits at most one DNS timeout for it)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._join_bound())
        pool, self._weigh_pool = self._weigh_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _join_bound(self) -> float:
        resolver = self._resolver
        return (resolver.lifetime * 3 if resolver is not None else 0.0) + self._weigh_timeout_s

    # -- internals

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # the thread must outlive any surprise; the set stays as it is
                log.exception("eg-kv membership refresh failed; keeping the current set")

    def _resolve_one(self, query: DnsQuery) -> None:
        try:
            members = resolve(query, self._resolver)
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
            if m.id not in self._weights and m.id not in self._weighing:
                self._weighing[m.id] = self._weigh_pool.submit(self._weigh, m)
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
                log.info("eg-kv: cannot weigh %s yet: %s", member_id, e)
                continue
            if member_id in candidates and _positive(weight):
                self._weights[member_id] = float(weight)

    def _publish(self, candidates: dict[str, Member]) -> bool:
        weighed = [self._weights[m] for m in candidates if m in self._weights]
        stand_in = sum(weighed) / len(weighed) if weighed else None
        members = {}
        for member_id, m in candidates.items():
            if member_id in self._weights:
                weight = self._weights[member_id]
            elif stand_in is not None:
                weight = stand_in
            else:
                weight = m.weight
            members[member_id] = dataclasses.replace(m, weight=weight)
        with self._lock:
            old = self._view
            if members == dict(old.members):
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


# --------------------------------------------------------------------------- health


class Health:
    """Which members are down, each with its back-off; thread-safe.

    A member that failed (refused connection, timeout) is down until a probe finds it up:
    pass :meth:`down` as ``skip`` to :meth:`Placement.home` / :meth:`Placement.group`, so
    its addresses go to their next-ranked member and no request waits on it. A background
    prober asks :meth:`due` which members to probe now, probes each (``/healthz``, with a
    short timeout) and reports :meth:`succeeded` or :meth:`failed`; every failure doubles
    the member's back-off, from ``first_s`` up to ``max_s``.

    Args:
        first_s: the back-off after a first failure.
        max_s: the longest back-off.
        clock: a monotonic clock (seconds); tests pass their own.
    """

    def __init__(
        self,
        first_s: float = DEFAULT_BACKOFF_S,
        max_s: float = DEFAULT_MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ConfigError(f"want 0 < first_s <= max_s, not {first_s!r} and {max_s!r}")
        self.first_s = float(first_s)
        self.max_s = float(max_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff: dict[str, float] = {}  # member id -> its current back-off
        self._next_probe: dict[str, float] = {}  # member id -> when to probe it
        self._down: frozenset[str] = frozenset()

    def failed(self, member_id: str) -> float:
        """A request or a probe to the member failed: it is down (again).

        Returns:
            Seconds until it is due for a probe.
        """
        with self._lock:
            backoff = self._backoff.get(member_id)
            backoff = self.first_s if backoff is None else min(backoff * 2, self.max_s)
            self._backoff[member_id] = backoff
            self._next_probe[member_id] = self._clock() + backoff
            self._down = frozenset(self._backoff)
            return backoff

    def succeeded(self, member_id: str) -> bool:
        """A probe (or a request) reached the member: it is up. Returns True if it was down."""
        with self._lock:
            was_down = self._backoff.pop(member_id, None) is not None
            self._next_probe.pop(member_id, None)
            if was_down:
                self._down = frozenset(self._backoff)
            return was_down

    def down(self) -> frozenset[str]:
        """The ids of the members that are down now (one atomic read, no lock)."""
        return self._down

    def due(self) -> list[str]:
        """Members whose back-off has run out, to probe now, sorted. Each is handed out once
        per back-off: it is due again only after the prober reports :meth:`failed`, or
        after another back-off if the prober never reports."""
        with self._lock:
            now = self._clock()
            ready = sorted(m for m, t in self._next_probe.items() if t <= now)
            for m in ready:
                self._next_probe[m] = now + self._backoff[m]
            return ready

    def forget(self, keep: Collection[str]) -> None:
        """Drop the state of members no longer in the set (``keep``: the current ids)."""
        with self._lock:
            for m in [m for m in self._backoff if m not in keep]:
                del self._backoff[m]
                self._next_probe.pop(m, None)
            self._down = frozenset(self._backoff)
