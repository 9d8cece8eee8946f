"""The server's run directory: what the supervisor tells every worker, through files.

The supervisor creates one directory per server (``eg-kv-<port>-*`` under the system's
temporary directory), writes ``workers.json`` there whenever its set of ready workers
changes, and removes the directory when it exits. Workers read the file to answer
``/healthz``; prometheus_client's multiprocess mode keeps its per-process counter files
in the ``metrics`` folder beside it.
"""

from __future__ import annotations

import json
import os
import tempfile

from .slab import pid_alive

STATE_FILE = "workers.json"
METRICS_DIR = "metrics"


def make_run_dir(port: int) -> str:
    """Create a fresh, private run directory for a server on ``port``; return its path."""
    path = tempfile.mkdtemp(prefix=f"eg-kv-{port}-")
    os.mkdir(os.path.join(path, METRICS_DIR), 0o700)
    return path


def metrics_dir(run_dir: str) -> str:
    return os.path.join(run_dir, METRICS_DIR)


def write_state(run_dir: str, configured: int, ready_pids: list[int]) -> None:
    """Record the ready workers atomically (write a temporary file, then rename it)."""
    tmp = os.path.join(run_dir, f".{STATE_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"workers": configured, "pids": sorted(ready_pids)}, f)
    os.replace(tmp, os.path.join(run_dir, STATE_FILE))


def read_state(run_dir: str) -> tuple[int, list[int]]:
    """Return ``(configured workers, pids of ready workers that still run)``.

    A pid the supervisor has not reaped yet but that is dead (or a zombie) is not counted:
    ``/healthz`` must not report a worker that cannot answer.

    Raises:
        OSError, ValueError: the file is missing or unreadable.
    """
    with open(os.path.join(run_dir, STATE_FILE)) as f:
        state = json.load(f)
    return int(state["workers"]), [p for p in state["pids"] if pid_alive(int(p))]
