"""A server's KV-events publisher, as the kvevents tests find and name it."""

from __future__ import annotations

import hashlib
import json
import subprocess

import psutil

from eg_kv.client.sync import ServerConnector
from helpers.common import ROOT
from helpers.server_procs import workers_of

SUBSCRIBER = ROOT / "tests" / "kvevents" / "subscriber.py"


def engine_hash(address: str) -> bytes:
    """The engine hash the test's "engine" gives each block: SHA-256, as vLLM's."""
    return hashlib.sha256(address.encode()).digest()


def publisher_of(srv, port: int) -> int | None:
    """The child of the server that listens on the publisher's port."""
    for pid in workers_of(srv):
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return pid
    return None


def kv_events_flags(ports: tuple[int, int], *more: str) -> tuple[str, ...]:
    return ("--kv-events-endpoint", f"tcp://127.0.0.1:{ports[0]}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{ports[1]}",
            "--kv-events-pool", "node:test", "--kv-events-model", "tiny", *more)  # fmt: skip


class Subscriber:
    """tests/kvevents/subscriber.py in a process of its own."""

    def __init__(self, python, ports: tuple[int, int], topic: str, decode: str) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(SUBSCRIBER), f"tcp://127.0.0.1:{ports[0]}",
             f"tcp://127.0.0.1:{ports[1]}", topic, "--decode", decode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={"LMCACHE_TRACK_USAGE": "false", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip

    def dump(self) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("dump\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the subscriber ended (status {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def held_by(srv, token: str | None = None) -> set[str]:
    """The addresses the server holds now."""
    c = ServerConnector(base_url=srv.url, local_reads=False, token=token, timeout_s=10)
    try:
        snap = c.snapshot()
    finally:
        c.close()
    return {b.hash for b in snap.blocks}
