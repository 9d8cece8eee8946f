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

import dataclasses
import logging
import math
import urllib.parse
from typing import Any

from ..config import format_hostport
from ..config import shown_url as _shown
from ..errors import ConfigError, EgKvError

log = logging.getLogger(__name__)


_SCHEMES = ("http", "https")
_GRAMMAR = (
    "http(s)://host:port, dnssrv+http(s)://_http._tcp.NAME or dns+http(s)://NAME:port, "
    "comma-separated"
)


def is_positive(value: Any) -> bool:
    """Whether ``value`` is a finite number above 0 (a weight, a bound in seconds)."""
    return isinstance(value, (int, float)) and value > 0 and math.isfinite(value)


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
