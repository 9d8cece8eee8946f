"""Shared fixtures: a slab per test, and a real multi-worker server per test.

Every fixture removes what it created: segments are unlinked, servers are stopped by pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from eg_kv.slab.store import Slab

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


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


@pytest.fixture
def slab_name():
    name = unique_slab_name()
    yield name
    Slab.unlink_named(name)


@pytest.fixture
def slab(slab_name):
    """A small slab: 4 MiB of 64 KiB pages, blocks up to 1 MiB."""
    s = Slab.create(slab_name, 4 * 1024 * 1024, page_size=64 * 1024, max_block_size=1024 * 1024)
    yield s
    s.close()


@dataclasses.dataclass
class Server:
    """A running ``eg-kv serve`` started by the ``server_factory`` fixture."""

    proc: subprocess.Popen
    host: str
    port: int
    slab_name: str
    log_path: Path
    scheme: str = "http"
    token: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthz(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "workers", "serve", *args]


@pytest.fixture
def server_factory(tmp_path):
    """Start real servers: ``server_factory(workers=2, capacity="64MiB", extra=[...])``.

    Waits until /healthz reports every worker up (plain HTTP, no TLS); stops each server
    by pid and unlinks its slab afterwards.
    """
    started: list[Server] = []

    def start(
        workers: int = 2,
        capacity: str = "64MiB",
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        slab_name: str | None = None,
        wait: bool = True,
    ) -> Server:
        port = port or free_port()
        name = slab_name or unique_slab_name("srv")
        log_path = tmp_path / f"server-{port}-{len(started)}.log"
        cmd = serve_cmd(
            "--addr", f"127.0.0.1:{port}", "--workers", str(workers),
            "--capacity", capacity, "--slab-name", name, *extra,
        )  # fmt: skip
        full_env = {**os.environ, **(env or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT
            )
        srv = Server(proc, "127.0.0.1", port, name, log_path, token=full_env.get(
            "EPISTEMIC_GRAPH_KVCACHE_TOKEN"))  # fmt: skip
        started.append(srv)
        if wait:
            wait_for(
                lambda: (
                    proc.poll() is not None
                    or ((h := srv.healthz()) and h.get("workers_up") == workers)
                ),
                timeout=30,
                what=f"server on port {port} to be healthy",
            )
            assert proc.poll() is None, f"server exited early:\n{srv.log()}"
        return srv

    yield start
    for srv in started:
        srv.stop(signal.SIGTERM)
        with contextlib.suppress(Exception):
            Slab.unlink_named(srv.slab_name)
