"""Processes as the kernel sees them: a base module every layer may use."""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from typing import Any


def pid_state(pid: int) -> str:
    """``pid``'s state letter in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped, ``Z``
    zombie...), ``X`` when there is no such process."""
    if pid <= 0:
        return "X"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return "X"
    return chr(stat[stat.rfind(b")") + 2])


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (``kill(pid, 0)`` says zombies live)."""
    return pid_state(pid) not in ("Z", "X")


def uses_file(pid: int, path: str) -> bool:
    """Whether process ``pid`` has the file at ``path`` mapped or open (its
    ``/proc/<pid>/maps`` and ``fd``, by device and inode: a slab made under another name
    and linked to this one shows its first name there). A pid that runs but does not use
    a slab is not its owner (pids are reused: a container starts again with small ones).
    True when that cannot be read (another user's process: it may be the owner); False
    when ``path`` is gone.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        if _maps(pid, st, writable=False):
            return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(f"/proc/{pid}/fd/{fd}"), st):
                    return True
        return False
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _maps(pid: int, st: os.stat_result, writable: bool) -> bool:
    """Whether ``/proc/<pid>/maps`` maps the file of ``st`` (writable, if asked).

    Raises:
        OSError: no such process, or not this user's.
    """
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}".encode()
    ino = str(st.st_ino).encode()
    with open(f"/proc/{pid}/maps", "rb") as f:
        for line in f:
            fields = line.split(None, 5)  # address perms offset dev inode path
            if (len(fields) > 4 and fields[4] == ino and fields[3] == dev
                    and (not writable or b"w" in fields[1])):  # fmt: skip
                return True
    return False


def writers_of(path: str) -> list[int]:
    """Pids of this user's processes, other than this one, that map the file at ``path``
    writable (a slab's workers, keeper and publisher; clients map it read-only); empty
    when it is gone. Walks ``/proc/*/maps``: for a start's check, not a hot path."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    me = os.getpid()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's
                if _maps(int(entry), st, writable=True):
                    found.append(int(entry))
    return sorted(found)


def pids_holding(path: str, limit: int = 8) -> list[int]:
    """Pids of this user's processes that have the file at ``path`` open (a lock's
    holders when the pid it records is dead: forked children inherit the fd), at most
    ``limit`` of them; empty when it is gone. Walks ``/proc/*/fd``: for a refusal's
    message, not a hot path."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or len(found) >= limit:
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.path.samestat(os.stat(f"/proc/{entry}/fd/{fd}"), st):
                        found.append(int(entry))
                        break
    return found


def pid_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP, Ctrl-Z) or traced."""
    return pid_state(pid) in ("T", "t")


def private_memory(pid: int) -> int:
    """Bytes of ``pid``'s own memory (heap, buffers): its resident anonymous pages.

    Not USS: a slab page that only this process has touched counts in its USS though it
    is shared memory (the supervisor does not prefault the slab, so a worker is often the
    first and only process to map a page).

    Raises:
        OSError: no such process.
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no RssAnon in /proc/{pid}/status")


class PidFileHeld(Exception):
    """Another process holds the lock of a pid file; ``holder`` is the pid it wrote."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def lock_pid_file(path: str, flags: int = 0) -> int:
    """Open ``path`` (made 0600 if absent), take its ``flock`` without waiting and write
    this process's pid in it; returns its fd (keep it open: closing it, or dying, lets the
    lock go; forked children share it).

    Raises:
        PidFileHeld: another process holds it. OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise PidFileHeld(holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


#: Objects told when this process forks, in the child (while they live).
_FORK_AWARE: weakref.WeakSet[Any] = weakref.WeakSet()


def after_fork_in_child(obj: Any) -> None:
    """Call ``obj.after_fork_in_child()`` in the child of every fork while ``obj`` lives:
    what a parent's thread held at the fork (a lock) or owns (its leases) is not the
    child's."""
    _FORK_AWARE.add(obj)


def _in_child() -> None:
    for obj in list(_FORK_AWARE):
        obj.after_fork_in_child()


os.register_at_fork(after_in_child=_in_child)
