"""Fixtures of the client tests: a real DNS server on loopback (dnslib's)."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def dns_server():
    """A DNS server on 127.0.0.1 (UDP and TCP, same port): ``(zone, port)``."""
    pytest.importorskip("dnslib", reason="the DNS discovery tests need dnslib (the dev extra)")
    from dnslib.server import DNSLogger, DNSServer
    from helpers.dns_zone import Zone, free_udp_and_tcp_port

    zone = Zone()
    quiet = DNSLogger(log="-request,-reply,-truncated,-error", logf=lambda *_: None)
    port = free_udp_and_tcp_port()
    servers = [
        DNSServer(zone, address="127.0.0.1", port=port, tcp=tcp, logger=quiet)
        for tcp in (False, True)
    ]
    for server in servers:
        server.start_thread()
    try:
        yield zone, port
    finally:
        # Both at once: each shutdown waits up to socketserver's 0.5 s poll.
        stoppers = [threading.Thread(target=server.stop) for server in servers]
        for t in stoppers:
            t.start()
        for t, server in zip(stoppers, servers, strict=True):
            t.join(timeout=10)
            server.thread.join(timeout=10)
            server.server.server_close()
