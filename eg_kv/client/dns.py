"""DNS discovery for a server set: the members a ``dnssrv+`` or ``dns+`` entry names now
(:mod:`eg_kv.client.members` parses the entries, :mod:`eg_kv.client.membership` keeps them
fresh). Every resolution is bounded by one deadline, its queries concurrent, at most
:data:`MAX_DNS_MEMBERS` members an entry. dnspython is imported only here, and only when
a DNS entry is used."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import time
from collections.abc import Sequence
from typing import Any

from ..config import format_hostport
from ..errors import ConfigError
from .members import DiscoveryError, DnsQuery, Member

log = logging.getLogger(__name__)

#: The bound on one resolution (all its queries and retries); a dead DNS server costs
#: the refresh thread this long, never a request.
DEFAULT_QUERY_TIMEOUT_S = 2.0
#: At most this many members are taken from one DNS entry: the first by member id, the
#: same subset in every client (a zone that lists 10,000 targets must not cost 20,000
#: lookups per refresh). Logged when hit.
MAX_DNS_MEMBERS = 256
#: At most this many DNS queries in flight at once for one refresh (the targets' A and
#: AAAA lookups run concurrently, all under one deadline).
DNS_THREADS = 16


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
            raise dns.resolver.LifetimeTimeout(timeout=0.0, errors=[])  # type: ignore[no-untyped-call]
        return self.resolver.resolve(qname, rdtype, search=False, lifetime=left)

    def addresses(self, qname: Any, rdtype: str) -> list[str]:
        """The addresses of one A or AAAA query; [] when it failed or found none."""
        import dns.exception

        try:
            return [r.address for r in self.query(qname, rdtype)]
        except dns.exception.DNSException:
            return []

    def start(self, qname: Any, rdtype: str) -> concurrent.futures.Future[list[str]]:
        """:meth:`addresses` on the pool (or now, without one)."""
        if self.pool is not None:
            try:
                return self.pool.submit(self.addresses, qname, rdtype)
            except RuntimeError:  # the pool was shut down: close() is under way
                pass
        done: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        done.set_result(self.addresses(qname, rdtype))
        return done

    def result(self, future: concurrent.futures.Future[list[str]]) -> list[str] | None:
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
    pending: dict[str, tuple[concurrent.futures.Future[list[str]], ...]] = {}
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
            errors.append(dns.exception.Timeout(timeout=0.0))  # type: ignore[no-untyped-call]
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


def _start_raising(
    lookups: _Lookups, qname: Any, rdtype: str
) -> concurrent.futures.Future[list[str]]:
    """One A or AAAA query started on the pool; its future raises what the query raised."""

    def run() -> list[str]:
        return [r.address for r in lookups.query(qname, rdtype)]

    if lookups.pool is not None:
        try:
            return lookups.pool.submit(run)
        except RuntimeError:  # the pool was shut down: close() is under way
            pass
    done: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
    try:
        done.set_result(run())
    except Exception as e:
        done.set_exception(e)
    return done
