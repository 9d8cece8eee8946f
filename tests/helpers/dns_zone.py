"""A real DNS server's zone for the discovery tests: the SRV, A and AAAA records that
dnslib's server on loopback answers with (the tests change them live), and the names of
a test set's pods. The ``dns_server`` fixture (tests/client/conftest.py) serves it."""

from __future__ import annotations

import socket
import threading
from collections import Counter

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSError

NS = "test"


def pod(i: int) -> str:
    return f"eg-kv-{i}.eg-kv.{NS}.svc.cluster.local"


class Zone:
    """The records the test DNS server answers with; the tests change them live.

    ``mode``: ``"answer"``, ``"silent"`` (receives and never replies), ``"servfail"``.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.srv: dict[str, list[tuple[int, int, int, str]]] = {}
        self.a: dict[str, list[str]] = {}
        self.aaaa: dict[str, list[str]] = {}
        self.mode = "answer"
        self.additional = True  # put the targets' addresses in the SRV answer, as CoreDNS
        self.drop: set[str] = set()  # query types received and never answered
        self.queries: Counter = Counter()

    def set(self, **changes) -> None:
        with self.lock:
            for key, value in changes.items():
                setattr(self, key, value)

    def resolve(self, request, handler):  # dnslib's resolver interface
        qname = str(request.q.qname).rstrip(".").lower()
        qtype = QTYPE[request.q.qtype]
        with self.lock:
            self.queries[(qname, qtype)] += 1
            if self.mode == "silent" or qtype in self.drop:
                raise DNSError("silent: the test server drops this query")
            reply = request.reply()
            if self.mode == "servfail":
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            known = qname in self.srv or qname in self.a or qname in self.aaaa
            if not known:
                reply.header.rcode = RCODE.NXDOMAIN
            if qtype == "SRV":
                for prio, weight, port, target in self.srv.get(qname, []):
                    reply.add_answer(
                        RR(qname, QTYPE.SRV, ttl=5, rdata=SRV(prio, weight, port, target))
                    )
                    if self.additional:
                        for ip in self.a.get(target, []):
                            reply.add_ar(RR(target, QTYPE.A, ttl=5, rdata=A(ip)))
            elif qtype == "A":
                for ip in self.a.get(qname, []):
                    reply.add_answer(RR(qname, QTYPE.A, ttl=5, rdata=A(ip)))
            elif qtype == "AAAA":
                for ip in self.aaaa.get(qname, []):
                    reply.add_answer(RR(qname, QTYPE.AAAA, ttl=5, rdata=AAAA(ip)))
            return reply

    def count(self, qname: str, qtype: str) -> int:
        with self.lock:
            return self.queries[(qname.lower(), qtype)]


def free_udp_and_tcp_port() -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no port free for both UDP and TCP")
