"""The small things every test folder needs: the repository root, unique slab names,
free ports, and waiting on a condition with a deadline."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def unique_slab_name(tag: str = "t") -> str:
    return f"/eg-kv-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def free_port() -> int:
    with socket.socket() as s:
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
