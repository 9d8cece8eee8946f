"""Helpers for tests that handle a server's processes: find, stop and watch workers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from helpers.common import ROOT, wait_for

MiB = 1024 * 1024


def workers_of(srv) -> set[int]:
    """Pids of the supervisor's live children (zombies excluded)."""
    out = set()
    for p in psutil.Process(srv.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stopped(pid: int) -> bool:
    """True once ``pid`` is stopped (SIGSTOP delivered), per /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"T", b"t")


def eg_kv_check(slab_name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers", "check", "--slab-name", slab_name],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def upload_in_flight(srv, address: str) -> tuple[socket.socket, int]:
    """Start a PUT that stays in flight; return its socket and the worker serving it."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(b"PUT /kv/%s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
              % (address.encode(), 4 * MiB) + b"u" * MiB)  # fmt: skip
    port = s.getsockname()[1]

    def server_side() -> int | None:
        for pid in workers_of(srv):
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(pid).net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == port:
                        return pid
        return None

    return s, wait_for(server_side, timeout=10, what="the worker serving the upload")


def stop_a_lock_holder(slab, pids: list[int], timeout: float = 40.0) -> int:
    """SIGSTOP the workers in turn until one is stopped inside the slab lock; return it.

    Needs a write load running (every PUT takes the lock). Each miss is resumed at once.
    """
    deadline = time.monotonic() + timeout
    tries = 0
    while time.monotonic() < deadline:
        pid = pids[tries % len(pids)]
        tries += 1
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda p=pid: stopped(p), timeout=5, interval=0.0005, what="SIGSTOP")
        if slab.lock_state()[0] == pid:
            return pid
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError(f"no worker was caught holding the lock in {tries} tries")
