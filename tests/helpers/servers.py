"""Real ``eg-kv serve`` processes for the tests: start one, wait until every worker is up,
stop it by pid and unlink its slab. The fixtures in tests/conftest.py are built on these."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from eg_kv.server.runstate import remove_stale_run_dirs
from eg_kv.slab.store import Slab
from helpers.common import ROOT, free_port, unique_slab_name, wait_for

#: Numbers each server's log file: a restart on the same port keeps the first log.
_LOG_SERIAL = itertools.count()


@dataclasses.dataclass
class Server:
    """A running ``eg-kv serve`` started by :func:`start_server`."""

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


def start_server(
    log_dir: Path,
    workers: int = 2,
    capacity: str = "64MiB",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    port: int | None = None,
    slab_name: str | None = None,
    wait: bool = True,
    ready_s: float = 30,
) -> Server:
    """Start ``eg-kv serve`` on 127.0.0.1 (plain HTTP) with its log in ``log_dir``; with
    ``wait``, return once /healthz reports every worker up (within ``ready_s``: a slab of
    gigabytes is faulted in first, 8-18 s for 4 GiB here, more under a full suite)."""
    port = port or free_port()
    name = slab_name or unique_slab_name("srv")
    log_path = log_dir / f"server-{port}-{next(_LOG_SERIAL)}.log"
    cmd = serve_cmd(
        "--addr", f"127.0.0.1:{port}", "--workers", str(workers),
        "--capacity", capacity, "--slab-name", name, *extra,
    )  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    srv = Server(proc, "127.0.0.1", port, name, log_path, token=full_env.get(
        "EPISTEMIC_GRAPH_KVCACHE_TOKEN"))  # fmt: skip
    if wait:
        try:
            wait_for(
                lambda: (
                    proc.poll() is not None
                    or ((h := srv.healthz()) and h.get("workers_up") == workers)
                ),
                timeout=ready_s,
                what=f"server on port {port} to be healthy",
            )
            assert proc.poll() is None, f"server exited early:\n{srv.log()}"
        except BaseException:
            stop_server(srv)
            raise
    return srv


def stop_server(srv: Server) -> None:
    """Stop ``srv`` by pid (SIGTERM, then SIGKILL past the deadline); unlink its slab, and
    remove the run directory a supervisor its test SIGKILLed left (one stopped removes
    its own; the next server on the port would remove it, but the tests' ports vary)."""
    srv.stop(signal.SIGTERM)
    with contextlib.suppress(Exception):
        Slab.unlink_named(srv.slab_name)
    with contextlib.suppress(Exception):
        remove_stale_run_dirs(srv.port)
