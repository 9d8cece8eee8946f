"""Server sets for the client tests: several real one-worker servers and the URL that
names them all."""

from __future__ import annotations

#: The SRV name the test DNS server answers for a set.
SRV_NAME = "_http._tcp.eg-kv.test.svc.cluster.local"


def start_set(server_factory, n: int = 3, extra: tuple[str, ...] = ()) -> list:
    return [server_factory(workers=1, capacity="32MiB", extra=extra) for _ in range(n)]


def set_url(servers) -> str:
    return ",".join(s.url for s in servers)
