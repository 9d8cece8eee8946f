"""The small things every test folder needs: the repository root, unique slab names,
free ports, and waiting on a condition with a deadline."""

from __future__ import annotations

import os
import random
import socket
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def unique_slab_name(tag: str = "t") -> str:
    return f"/eg-kv-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _below_ephemeral() -> range:
    """Ports below the kernel's ephemeral range, which ``bind(0)`` and every outgoing
    connection take theirs from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(10000, low - 12000), low)


def free_port() -> int:
    """A free loopback port for a server a test starts, picked at random below the
    ephemeral range: one picked by ``bind(0)`` and bound later was sometimes taken
    meanwhile by another test's socket (in CI, an example server's port answered by
    another test's HTTP server, which both failed)."""
    ports = _below_ephemeral()
    for _ in range(200 if len(ports) > 100 else 0):
        port = random.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no such range here: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
