"""The slab lock: the one lock every change to a slab's metadata happens under.

It is an open-file-description byte lock on the segment's fd (``F_OFD_SETLKW``), which the
kernel releases when its holder dies. The holder writes its pid into the header on entry
and clears it on exit; whoever next takes the lock and finds a pid there knows a process
died inside the critical section and repairs the slab before going on
(:meth:`eg_kv.slab.check.SlabChecks._repair_locked`). A writing section makes ``ST_SEQ``
odd on entry and even on exit: the seqlock of the lock-free lookups
(:meth:`eg_kv.slab.view.SlabView._read`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import SlabError
from . import layout as L
from .view import SlabView, full_fence

# struct flock for F_OFD_SETLKW: l_type, l_whence, l_start, l_len, l_pid (must be 0).
_FLOCK = struct.Struct("hhqqi4x")
_LOCK = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
_UNLOCK = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
#: How long the owner's one-off operations (claim, repair) wait for the lock by default.
OWNER_LOCK_WAIT_S = 10.0
_SPINS = 50  # non-blocking lock attempts (with a yield between) before sleeping on it


#: What a terminal's job control stops a process with (Ctrl-Z, a background read or
#: write): held back while a check holds the lock, taken at once after.
JOB_STOPS = {signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}


@contextlib.contextmanager
def no_job_stops() -> Iterator[None]:
    """Hold back job-control stops while an operator's tool (``eg-kv check``) holds the
    lock: Ctrl-Z stops it between two holds, never in one (a check stopped inside held
    every worker's request until it was resumed)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class LockTimeout(SlabError):
    """A bounded wait for the slab lock ran out (see :meth:`SlabLocking._locked`)."""


class Held:
    """The slab lock, held for a ``with`` block (see :meth:`SlabLocking._locked`).

    A class rather than ``@contextmanager``: the generator and its two resumptions were
    a third of the 3 µs a lock round trip cost (two ``fcntl`` calls are the rest). The
    handle's thread lock serializes its threads, so one object per handle serves every
    section without arguments.
    """

    __slots__ = ("_slab", "_timeout", "_want_write", "_write")

    def __init__(self, slab: SlabLocking, timeout: float | None, write: bool) -> None:
        self._slab, self._timeout, self._want_write, self._write = slab, timeout, write, write

    def __enter__(self) -> None:
        slab = self._slab
        if slab.closed:
            raise SlabError("the slab handle is closed")
        slab._tlock.acquire()
        try:
            try:  # the usual case, inline: the lock is free
                fcntl.fcntl(slab._fd, fcntl.F_OFD_SETLK, _LOCK)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                slab._acquire(self._timeout)
        except BaseException:
            slab._tlock.release()
            raise
        st = slab._state
        try:
            dead = st[L.ST_LOCK_HOLDER]
            st[L.ST_LOCK_HOLDER] = slab._pid
            st[L.ST_LOCK_ENTRIES] += 1
            self._write = write = self._want_write or bool(dead)
            if write:
                st[L.ST_SEQ] |= 1  # odd: lock-free readers retry (stays odd if holder died)
                full_fence()  # before any read of the readers' leases (Dekker's pattern)
            if dead:
                slab.repaired_on_entry = (dead, slab._repair_locked(count=True))
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        slab = self._slab
        st = slab._state
        try:
            if self._write:
                st[L.ST_SEQ] += 1
            st[L.ST_LOCK_HOLDER] = 0
            fcntl.fcntl(slab._fd, fcntl.F_OFD_SETLKW, _UNLOCK)
        finally:
            slab._tlock.release()


class SlabLocking(SlabView):
    """The lock's part of :class:`eg_kv.slab.store.Slab`: taking it, waiting for it, and
    reading who holds it."""

    if TYPE_CHECKING:
        # Set by SlabSegment.__init__ (eg_kv.slab.segment).
        _fd: int
        _tlock: threading.Lock
        _pid: int
        _held: Held
        closed: bool
        repaired_on_entry: tuple[int, list[str]] | None

        # Defined by SlabChecks (eg_kv.slab.check): entry repairs after a dead holder.
        def _repair_locked(self, count: bool = False) -> list[str]: ...

    def _locked(self, timeout: float | None = None, *, write: bool = True) -> Held:
        """Hold the slab lock (``with``); repair first if the previous holder died inside.

        Args:
            timeout: give up after this many seconds (:class:`LockTimeout`); None waits
                as long as it takes (workers: the supervisor kills a holder that hangs).
            write: False for a section that changes nothing the lock-free readers look
                at: it leaves ``ST_SEQ`` alone, so readers need not retry and a sliced
                check can tell that no writer ran between its slices.

        Raises:
            LockTimeout: ``timeout`` passed and the lock was still taken.
        """
        if timeout is None and write:
            return self._held  # the usual section: one object per handle, not one per call
        return Held(self, timeout, write)

    def _try_lock(self) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _LOCK)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return False
        return True

    def _acquire(self, timeout: float | None = None) -> None:
        # Try without sleeping first: a sleeping waiter is woken only to find the lock
        # taken again by a holder that never left the CPU, and that convoy cut two-process
        # put rates by 10x (measured). Yielding lets the holder finish its few microseconds.
        for _ in range(_SPINS):
            if self._try_lock():
                return
            os.sched_yield()
        if timeout is None:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _LOCK)
            return
        # A bounded wait polls: F_OFD_SETLKW cannot time out, and a signal to break it
        # would need a timer thread. Sleeps grow to 2 ms, so a holder that leaves at once
        # costs the poller little and a long hold costs it ~500 wake-ups a second.
        deadline, pause = time.monotonic() + timeout, 0.0002
        while not self._try_lock():
            if time.monotonic() >= deadline:
                holder = self._state[L.ST_LOCK_HOLDER]
                raise LockTimeout(
                    f"the lock of slab {self.name} stayed taken for {timeout:g} s (holder: pid "
                    f"{holder}): retry later, or stop that process if it hangs"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.002)

    def lock_state(self) -> tuple[int, int]:
        """``(holder pid or 0, lock entries so far)``, read without taking the lock.

        The same non-zero pair seen twice, some time apart, means one critical section
        lasted at least that long (the supervisor's watchdog).
        """
        return self._state[L.ST_LOCK_HOLDER], self._state[L.ST_LOCK_ENTRIES]
