"""One server per port: :class:`PortClaim`, a lock file held for the supervisor's life.

The workers bind with ``SO_REUSEPORT``, so a second eg-kv of the same user started on the
same port would share it silently, each client landing on one of two caches.
:func:`~eg_kv_workers.supervisor.check_port_free` probes the port at start, but nothing
holds it between the probe and the workers' bind (seconds of slab creation): two servers
started together both passed. The claim is an ``flock`` on a file named for the user and
port, taken before the probe and held until the supervisor exits (its forked
processes share it, so a supervisor killed with its workers still serving keeps it until
they exit too); the kernel lets it go with the last of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from eg_kv.errors import EgKvError
from eg_kv.procs import PidFileHeld, lock_pid_file, pid_alive, pid_state, pids_holding

#: Where the claims are: the system's temporary folder, not $TMPDIR (one per host).
CLAIMS_DIR = "/tmp"
#: How long a held claim is tried again before the port is refused: another server's
#: sweep of stale claims (_sweep_stale) holds each for microseconds, a server for its life.
SWEEP_RACE_S = 0.1


class PortTaken(EgKvError):
    """Another eg-kv of this user is starting or serving on the port."""


class PortClaim:
    """The lock file of ``host:port`` for this user, held (see the module docstring).

    Raises:
        PortTaken: another process holds it (the message names its pid).
    """

    def __init__(self, host: str, port: int) -> None:
        # By port alone: one host spelled two ways (localhost, 127.0.0.1, 0.0.0.0) is
        # one port, and two servers on one port of two addresses are rare enough to stop.
        self.path = os.path.join(CLAIMS_DIR, f"eg-kv-{os.getuid()}-port-{port}.lock")
        self._fd = -1
        _sweep_stale(f"eg-kv-{os.getuid()}-")
        for _ in range(5):  # the file may be unlinked by its last holder as we open it
            try:
                fd = _lock_waiting_out_sweeps(self.path)
            except PidFileHeld as e:
                raise PortTaken(f"{host}:{port} is taken by {_held_by(e.holder, self.path)}, "
                                "or pick another --addr") from None  # fmt: skip
            except OSError as e:  # (another user's file of that name, a full /tmp)
                raise PortTaken(
                    f"cannot take the lock file {self.path} of port {port}: {e}"
                ) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return
            os.close(fd)  # locked a file its holder had just unlinked: open the new one
        raise PortTaken(f"the lock file {self.path} keeps changing: is another eg-kv starting?")

    def release(self) -> None:
        """Remove the lock file and let the lock go (the supervisor's clean exit)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # before the lock goes: a newcomer then makes a new file
        os.close(self._fd)
        self._fd = -1


def _held_by(recorded: str, path: str) -> str:
    """Who holds the claim, for the refusal: the supervisor it records while that runs;
    once it is dead, the processes that inherited its lock (its workers, still draining,
    or stopped and so never draining), each with its state and what to do."""
    if recorded.isdigit() and pid_alive(int(recorded)):
        return f"another eg-kv (pid {recorded}), starting or serving: stop it first"
    holders = [p for p in pids_holding(path) if p != os.getpid()]
    if not holders:
        return f"another eg-kv (pid {recorded}, gone), which held it a moment ago: try again"
    named = ", ".join(f"pid {p} ({_what_to_do(p)})" for p in holders)
    return f"a leftover of eg-kv {recorded}, which is dead: {named} still holds its lock {path}"


def _what_to_do(pid: int) -> str:
    state = pid_state(pid)
    if state in ("T", "t"):
        return "stopped: kill -CONT it to let it drain, or kill it"
    return f"state {state}, draining: wait for it, or kill it"


def _lock_waiting_out_sweeps(path: str) -> int:
    """:func:`lock_pid_file`, tried again for :data:`SWEEP_RACE_S` while held: a server
    on another port sweeping stale claims holds this one for a moment (a start on a free
    port was refused then, 72 times in 3000).

    Raises:
        PidFileHeld: still held after that. OSError: it cannot be opened.
    """
    deadline = time.monotonic() + SWEEP_RACE_S
    while True:
        try:
            return lock_pid_file(path, os.O_NOFOLLOW)
        except PidFileHeld:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.002)


def _sweep_stale(prefix: str) -> None:
    """Remove this user's claims nobody holds (their supervisors were killed): each is
    locked first, so a claim being taken is never removed under its taker (who checks,
    once locked, that the file it locked is still the one named)."""
    tmp = CLAIMS_DIR
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(prefix) and n.endswith(".lock")]
    except OSError:
        return
    for name in names:
        path = os.path.join(tmp, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)
        except OSError:  # held: a server on that port
            pass
        finally:
            os.close(fd)
