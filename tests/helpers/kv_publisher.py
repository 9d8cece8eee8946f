"""A server's KV-events publisher, as the kvevents tests find and name it."""

from __future__ import annotations

import hashlib

import psutil

from helpers.server_procs import workers_of


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
