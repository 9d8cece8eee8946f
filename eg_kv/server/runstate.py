"""The server's run directory: what the supervisor tells every worker, through files.

The supervisor creates one directory per server (``eg-kv-<port>-*`` under the system's
temporary directory), records its pid in ``owner``, writes ``workers.json`` there whenever
its set of ready workers changes, and removes the directory when it exits. A supervisor
killed with SIGKILL cannot: the next one on that port removes directories whose owner is
dead. Workers read ``workers.json`` and ``heartbeats`` to answer ``/healthz``;
prometheus_client's multiprocess mode keeps its per-process counter files in the
``metrics`` folder beside them.

``heartbeats`` is a small shared file, one slot per worker: (pid, CLOCK_MONOTONIC ns of
its last beat). Each worker's event loop stamps its slot every :func:`beat_interval`
seconds, so a slot that stops moving means a worker whose loop no longer runs (stopped,
blocked, spinning); the supervisor kills such a worker (``--heartbeat-timeout``).
CLOCK_MONOTONIC is one clock for every process of the host, and a store of one aligned
8-byte word is atomic on the platforms eg-kv runs on.
"""

from __future__ import annotations

import contextlib
import glob
import json
import mmap
import os
import shutil
import tempfile
import time

from ..procs import pid_alive

STATE_FILE = "workers.json"
METRICS_DIR = "metrics"
KV_EVENTS_STATS = "kv-events.json"
OWNER_FILE = "owner"
HEARTBEAT_FILE = "heartbeats"
_SLOT_WORDS = 2  # pid, monotonic ns of the last beat
#: /healthz counts a worker up only if it beat within this many seconds (or the heartbeat
#: timeout, if shorter): a worker whose loop stalls that long cannot answer in time either.
HEALTH_WINDOW_S = 2.0


def beat_interval(timeout_s: float) -> float:
    """How often a worker beats, for a supervisor that waits ``timeout_s``: at least four
    beats per timeout, and at most two a second (a beat costs a few microseconds)."""
    return min(0.5, timeout_s / 4)


def health_window(timeout_s: float) -> float:
    """How recent a beat must be for /healthz to count its worker up."""
    return min(HEALTH_WINDOW_S, timeout_s)


def make_run_dir(port: int) -> str:
    """Create a fresh, private run directory for a server on ``port``; return its path.

    First removes the run directories that earlier servers on ``port`` left behind when
    they were killed (those whose recorded owner pid no longer runs).
    """
    remove_stale_run_dirs(port)
    path = tempfile.mkdtemp(prefix=f"eg-kv-{port}-")
    os.mkdir(os.path.join(path, METRICS_DIR), 0o700)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def remove_stale_run_dirs(port: int) -> list[str]:
    """Remove this user's ``eg-kv-<port>-*`` directories whose owner pid is dead.

    A directory without a readable owner file is left alone (it may be being created, or
    belong to something else). Returns the paths removed.
    """
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"eg-kv-{port}-*")):
        try:
            st = os.lstat(path)
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if st.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
            continue
        if owner != os.getpid() and not pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Heartbeats:
    """The ``heartbeats`` file of a run directory, mapped shared.

    The supervisor creates it (:meth:`create`) and forks the workers, which inherit the mapping
    and :meth:`beat` into their slot; anyone may :meth:`open` it to read the :meth:`ages`.
    """

    def __init__(self, path: str, writable: bool):
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._mm = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        self._words = memoryview(self._mm).cast("q")
        self.nslots = len(self._words) // _SLOT_WORDS

    @classmethod
    def create(cls, run_dir: str, nslots: int) -> Heartbeats:
        """Make the file with ``nslots`` empty slots (supervisor)."""
        path = os.path.join(run_dir, HEARTBEAT_FILE)
        with open(path, "wb") as f:
            f.write(bytes(8 * _SLOT_WORDS * nslots))
        return cls(path, writable=True)

    @classmethod
    def open(cls, run_dir: str) -> Heartbeats:
        """Map an existing file read-only (a worker answering /healthz).

        Raises:
            OSError: no such file.
        """
        return cls(os.path.join(run_dir, HEARTBEAT_FILE), writable=False)

    def beat(self, slot: int, pid: int) -> None:
        """Record that ``pid``, the worker in ``slot``, is alive now."""
        w = self._words
        w[slot * _SLOT_WORDS] = pid
        w[slot * _SLOT_WORDS + 1] = time.monotonic_ns()

    def clear(self, slot: int) -> None:
        self._words[slot * _SLOT_WORDS] = 0

    def age(self, slot: int, pid: int) -> float | None:
        """Seconds since ``pid`` last beat in ``slot``; None if the slot is not its."""
        w = self._words
        if w[slot * _SLOT_WORDS] != pid:
            return None
        return (time.monotonic_ns() - w[slot * _SLOT_WORDS + 1]) / 1e9

    def ages(self) -> dict[int, float]:
        """Seconds since each worker's last beat, by pid."""
        w, now = self._words, time.monotonic_ns()
        return {w[k]: (now - w[k + 1]) / 1e9 for k in range(0, len(w), _SLOT_WORDS) if w[k] > 0}

    def close(self) -> None:
        self._words.release()
        with contextlib.suppress(BufferError):
            self._mm.close()


def metrics_dir(run_dir: str) -> str:
    return os.path.join(run_dir, METRICS_DIR)


def kv_events_stats(run_dir: str) -> str:
    """Where the KV-events publisher writes its counters for /metrics."""
    return os.path.join(run_dir, KV_EVENTS_STATS)


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


TOKENS_COPY = "tenants.toml"


def tokens_copy(run_dir: str) -> str:
    """Where the supervisor keeps the tokens file it validated last (workers read it)."""
    return os.path.join(run_dir, TOKENS_COPY)


def stage_tokens_copy(run_dir: str, text: str) -> str:
    """Write the validated tokens file beside its copy (mode 0600: hashes only, but the
    tenants' names and quotas are nobody else's business); returns the temporary path,
    for :func:`commit_tokens_copy` once the slab holds its namespaces (a copy that
    cannot be written must change nothing).

    Raises:
        OSError: the run directory refuses it (full, cleaned up).
    """
    tmp = os.path.join(run_dir, f".{TOKENS_COPY}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return tmp


def commit_tokens_copy(run_dir: str, staged: str) -> None:
    """Put a :func:`stage_tokens_copy` in place for the workers, atomically.

    Raises:
        OSError: the rename failed (the staged file stays: the caller removes it).
    """
    os.replace(staged, tokens_copy(run_dir))
