"""Run by tests/client/test_dial.py inside ``unshare -r -m -n`` (a private network and
mount namespace: nothing outside is touched), with /etc/resolv.conf naming a DNS server on
127.0.0.1 that never answers and /etc/hosts naming kv.test at three loopback addresses
whose listeners drop every SYN (full backlogs). Prints one JSON line: how long the sync
client's get() took against each, with timeout_s=1."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eg_kv.client.connectors import connect
from eg_kv.client.settings import KvCacheConfig

PORT = 9130


def took(host: str) -> float:
    with connect(KvCacheConfig(base_url=f"http://{host}:{PORT}", timeout_s=1.0,
                               local_reads=False)) as kv:  # fmt: skip
        t0 = time.monotonic()
        assert kv.get("abc123") is None
        return time.monotonic() - t0


def main() -> None:
    faulthandler.dump_traceback_later(30, exit=True)  # where it hangs, if it does
    silent_dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent_dns.bind(("127.0.0.1", 53))  # takes the queries, never answers
    held = [silent_dns]
    for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        listener = socket.socket()
        listener.bind((ip, PORT))
        listener.listen(0)
        held.append(listener)
        for _ in range(3):  # fill the backlog: later SYNs go unanswered
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((ip, PORT))
            held.append(s)
    addresses = {a[4][0] for a in socket.getaddrinfo("kv.test", PORT, type=socket.SOCK_STREAM)}
    out = {"addresses": len(addresses), "dns": took("kv.example.internal"),
           "addresses_dropping": took("kv.test")}  # fmt: skip
    for s in held:
        s.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
