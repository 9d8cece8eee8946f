"""Processes as the kernel sees them: a base module every layer may use."""

from __future__ import annotations


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (``kill(pid, 0)`` says zombies live)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
