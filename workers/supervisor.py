"""The supervisor: owns the slab, forks the workers, replaces the dead, drains on SIGTERM.

Modelled on uvicorn's multiprocess supervisor and gunicorn's arbiter:

* signal handlers only queue the signal and wake the main loop (a self-pipe); one loop
  handles signals, reads worker notifications, reaps children and refills the pool;
* worker deaths are classified: before any worker served, one that exits with
  :data:`BOOT_ERROR` could not start serving (port taken, bad certificate), so the
  supervisor stops with that reason and a non-zero status instead of respawning
  forever, and so do workers that keep dying before they serve. Once the server serves,
  no death stops it (its healthy workers serve on): each is logged with its reason,
  what the dead worker left in the slab is released (its uploads in flight, its
  counters; a full repair only if it died inside the critical section) and a
  replacement is forked at once, or after a backoff in a slot that keeps failing
  (:mod:`.backoff`);
* a watchdog finds the wedged: a worker whose heartbeat (see :mod:`eg_kv.server.runstate`)
  stopped for ``--heartbeat-timeout`` is killed with SIGKILL, and so is a worker that has
  held the slab lock for ``--lock-timeout``. Workers that wait on a lock someone holds
  stop beating too: they are the victims, not the culprit, and are spared while the lock
  is stuck and for one heartbeat timeout after. The supervisor itself only ever tries the
  lock for a bounded time (:data:`LOCK_WAIT_S`) and retries on a later tick;
* workers are forked, so they start in milliseconds from the supervisor's imports; each
  attaches the slab itself, and they inherit the supervisor's stdout and stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import operator
import os
import select
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from eg_kv.config import ENV_TOKEN, Settings, format_size, is_loopback
from eg_kv.errors import ConfigError, EgKvError, SlabError
from eg_kv.procs import pid_alive, pid_state, pid_stopped, uses_file, writers_of
from eg_kv.server import runstate, tenants
from eg_kv.server.hints import tick as tick_hints
from eg_kv.server.metrics_fold import fold_dead_process
from eg_kv.shm import SHM_DIR
from eg_kv.slab import layout as L
from eg_kv.slab.lock import LockTimeout
from eg_kv.slab.segment import ForeignSegment
from eg_kv.slab.store import Slab
from eg_kv.units import human_size

from . import worker as worker_mod
from .backoff import SlotBackoff
from .portclaim import PortClaim, PortTaken
from .worker import BOOT_ERROR, make_ssl_context

log = logging.getLogger("eg_kv.supervisor")

#: Workers that die this many times in a row before any worker served stop the supervisor.
MAX_BOOT_DEATHS = 5
#: A helper that died is started again after this long at the soonest (doubling while
#: it keeps dying, see :mod:`.backoff`).
HELPER_RESTART_S = 1.0
#: Extra time, after the drain timeout, before workers that did not exit are killed.
KILL_GRACE_S = 5.0
#: The main loop wakes at least this often even when nothing happens (the watchdog's
#: sampling period).
TICK_S = 0.25
#: A loop pass that fails is logged at most once this often (a fork refused every tick).
LOOP_FAILED_LOG_S = 10.0
#: How often local readers' hit hints are folded into the slab's reference counts.
FOLD_HINTS_S = 1.0
#: The longest the supervisor waits for the slab lock at once; it retries on a later tick.
LOCK_WAIT_S = 0.2
#: A worker that has not said it serves after this long (or 6 heartbeat timeouts) is
#: killed as wedged at start-up.
BOOT_TIMEOUT_S = 60.0
#: Seconds of lock hold per page the watchdog allows on top of --lock-timeout: a worker
#: that finds a dead holder repairs the whole slab inside the lock, and must not be
#: killed for it (a full repair measured ~0.65 us a page; this leaves a 4x margin).
REPAIR_S_PER_PAGE = 2.6e-6
#: Long start-up steps (creating and prefaulting a slab, repairing a re-attached one) log
#: their progress at most this often, and at least this often while they run.
PROGRESS_EVERY_S = 2.0

_GRACEFUL = (signal.SIGTERM, signal.SIGINT)
#: SIGHUP reloads the tokens file (nginx, gunicorn); it no longer stops the server.
_HANDLED = (*_GRACEFUL, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)


class CannotServe(EgKvError):
    """The server cannot start serving as configured (port taken, bad TLS files)."""


@dataclasses.dataclass
class _Helper:
    """A process of its own beside the workers (the KV-events publisher, the disk keeper):
    started before them, restarted at most once a second when it dies (backing off to
    10 s while it keeps dying), and stopped with them; one that could not start before
    any worker served stops the server (a new one would fail the same way)."""

    name: str  # for the log: "the KV-events publisher"
    run: Callable[[Callable[[], None]], int]  # the child's body, given its beat; its status
    slot: int  # its slot in the heartbeats file (after the workers')
    pid: int = 0
    started: float = 0.0  # when the running one was forked
    killed: bool = False  # the watchdog sent SIGKILL
    due: float = 0.0  # when one that died may be started again


def _how_it_ended(status: int) -> str:
    """A child's end, for the log (any signal: real-time ones have no ``Signals`` name)."""
    if os.WIFSIGNALED(status):
        n = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(n).name}"
        except ValueError:
            return f"killed by signal {n}"
    return f"exited with status {os.WEXITSTATUS(status)}"


@dataclasses.dataclass
class _Worker:
    pid: int
    started: float
    slot: int  # its slot in the heartbeats file
    ready_at: float = 0.0  # when it said it serves (0: not yet)
    killed: bool = False  # the watchdog sent SIGKILL

    @property
    def ready(self) -> bool:
        return self.ready_at > 0


def _serves(owner: int, name: str) -> bool:
    """Whether ``owner``, the pid a slab records, is a running eg-kv with that slab: alive
    and using it (a pid reused by another process refused every start, --fresh too)."""
    return owner != os.getpid() and pid_alive(owner) and uses_file(owner, SHM_DIR + name)


def check_port_free(host: str, port: int) -> None:
    """Fail early and clearly if something listens on ``host:port`` already.

    The workers bind with ``SO_REUSEPORT``, which would silently share the port with
    another eg-kv of the same user; this probe binds *without* it (but with
    ``SO_REUSEADDR``, so connections in TIME_WAIT from a previous run do not count).

    Raises:
        CannotServe: the address is taken or cannot be bound here.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CannotServe(f"cannot resolve {host}: {e}") from None
    family, _type, _proto, _canon, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            what = "the address is taken by another process" if e.errno == errno.EADDRINUSE else e
            raise CannotServe(f"cannot bind {host}:{port}: {what}") from None


class ProgressLog:
    """A slab step's progress callback: logs ``what: step 42% (done of total)`` at most
    every ``every`` seconds (the first after ``every``: a quick step logs nothing), and
    ``first`` once when the step begins (not before: a slab refused before its first
    byte is allocated logs only the refusal)."""

    def __init__(
        self, what: str, sizes: bool = True, every: float = PROGRESS_EVERY_S, first: str = ""
    ) -> None:
        self.what, self.sizes, self.every, self.first = what, sizes, every, first
        self.started = self._last = time.monotonic()

    def __call__(self, step: str, done: int, total: int) -> None:
        if self.first:
            log.info("%s", self.first)
            self.first = ""
        now = time.monotonic()
        if now - self._last < self.every:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        if self.sizes:
            of = f"{human_size(done)} of {human_size(total)}"
        else:
            of = f"{done:,} of {total:,}"
        log.info("%s: %s %.0f%% (%s, %.0f s so far)", self.what, step, pct, of,
                 now - self.started)  # fmt: skip


def shown_size(n: int) -> str:
    """A configured size for a log line: its exact binary unit (``8GiB``), else a person's
    reading of it with the bytes (``23.9 GiB (25,662,429,593 bytes)``), never ``25662429593B``."""
    exact = format_size(n)
    return exact if exact.endswith("iB") else f"{human_size(n)} ({n:,} bytes)"


def _segment_size(name: str) -> int | None:
    """The size of shared-memory segment ``name`` in /dev/shm, if it can be read."""
    try:
        return os.stat(SHM_DIR + name).st_size
    except OSError:
        return None


def open_disk(settings: Settings) -> int:
    """Check the disk tier's directory, take its lock and make its data file (so a full
    disk, a foreign directory or a second server shows now, as one line). Returns the
    lock's fd, held until the server exits.

    Raises:
        CannotServe: the directory or its file cannot be used (the reason says why).
    """
    from eg_kv.disk import counters, files, keyfilter

    try:
        path = files.check_dir(settings.disk)
        fd = files.lock_dir(path)
        try:
            files.socket_path(path)  # a directory there: the keeper could never bind
            sb = files.make_data(path, settings.disk_capacity)
            counters.reset(path)  # this server's counters count from its start
            # Made anew for this capacity, its room taken now; each keeper fills it.
            keyfilter.make(path, settings.disk_capacity)
        except BaseException:
            os.close(fd)
            raise
    except ConfigError as e:
        raise CannotServe(str(e)) from None
    log.info("disk tier: %s, %s (high water %s)", path, human_size(sb.capacity),
             human_size(sb.high_water))  # fmt: skip
    return fd


#: Beyond ``--drain-timeout``, how long a start waits for a dead server's workers to exit.
WRITERS_GRACE_S = 5.0


def _await_writers(slab: Slab, name: str, owner: int, drain_timeout_s: float) -> None:
    """Wait until no other process writes the slab ``owner`` left: its workers get SIGTERM
    when it dies and drain (up to ``--drain-timeout``) before they exit; one stopped
    (SIGSTOP) or stuck would write blocks and refcounts into the slab while this server
    repairs and serves it.

    Raises:
        SlabError: some still write it after the wait, or are stopped (the slab closed).
    """
    path = SHM_DIR + name
    deadline = time.monotonic() + drain_timeout_s + WRITERS_GRACE_S
    said = False
    while writers := writers_of(path):
        stopped = [pid for pid in writers if pid_stopped(pid)]
        if stopped or time.monotonic() >= deadline:
            slab.close()
            how = f"stopped: {_pids(stopped)}" if stopped else "still running"
            raise SlabError(
                f"slab {name} left by pid {owner} is still written by pid(s) {_pids(writers)} "
                f"({how}): the workers of the server that died. Stop them (kill -9 "
                f"{' '.join(map(str, writers))}) and start again, or give this server "
                "another --slab-name"
            )
        if not said:
            log.info("slab %s: waiting for pid(s) %s, the workers of the server that died "
                     "(pid %d), to exit", name, _pids(writers), owner)  # fmt: skip
            said = True
        time.sleep(0.1)


def _pids(pids: list[int]) -> str:
    return ", ".join(map(str, pids))


def open_slab(settings: Settings) -> tuple[Slab, str, bool]:
    """Create the slab, or re-attach a compatible one whose owner is gone (warm restart).

    Logs before each long step (creating, prefaulting, repairing), its progress every
    :data:`PROGRESS_EVERY_S` while it runs, and what ``--fresh`` dropped.

    Returns:
        (the slab, a sentence for the log saying what happened, whether it was
        re-attached with its blocks).

    Raises:
        SlabError: a live server owns it, or it was made with other sizes (and no
            ``--fresh``), or a segment of that name is not an eg-kv slab (``--fresh``
            removes only eg-kv slabs), or it cannot be created.
        ForeignSegment: the slab or its readers segment is another user's or open to
            group/other (never used, never removed: the message names owner and mode).
    """
    name = settings.slab_name
    if Slab.exists_named(name):
        try:
            slab = Slab.attach(name)
        except ForeignSegment:
            raise  # another user's (or open to others): never used, never removed, --fresh or not
        except SlabError:
            if not settings.fresh:
                raise
            if not Slab.is_eg_kv_segment(name):  # another program's memory: never remove it
                raise SlabError(
                    f"shared-memory segment {name} ({SHM_DIR}{name}) is not an eg-kv slab, so "
                    "--fresh leaves it alone: give this server another --slab-name, or remove "
                    "the segment yourself once you know nothing uses it"
                ) from None
            owner = Slab.segment_owner_pid(name)
            if _serves(owner, name):  # a running eg-kv of another version
                raise SlabError(
                    f"slab {name} ({SHM_DIR}{name}) belongs to a running eg-kv (pid {owner}) "
                    "of another layout version, so --fresh leaves it alone: stop that server "
                    "first, or give this server another --slab-name"
                ) from None
            size = _segment_size(name)
            Slab.unlink_named(name)
            log.info("--fresh: dropped slab %s (%s, not readable by this eg-kv: its blocks "
                     "were not counted)", name,
                     "size unknown" if size is None else human_size(size))  # fmt: skip
        else:
            owner = slab.owner_pid
            if _serves(owner, name):
                slab.close()
                raise SlabError(
                    f"slab {name} belongs to a running eg-kv (pid {owner}): stop it first, "
                    "or give this server another --addr / --slab-name"
                )
            if settings.fresh:
                g = slab.geometry
                try:
                    stats = slab.stats(timeout=LOCK_WAIT_S * 10)
                    held = (f"{stats['unique_blocks']} blocks, "
                            f"{human_size(stats['resident_bytes'])} resident")  # fmt: skip
                except EgKvError as e:  # its lock stuck: dropped all the same
                    held = f"its blocks not counted ({e})"
                slab.close()
                slab.unlink()
                log.info("--fresh: dropped slab %s (%s in %s pages, left by pid %d): %s",
                         name, format_size(g.npages * g.page_size), format_size(g.page_size),
                         owner, held)  # fmt: skip
            else:
                want = L.Geometry.plan(settings.capacity, settings.page_size,
                                       settings.max_block_size)  # fmt: skip
                have = slab.geometry
                # The sizes asked, not the whole layout: a slab whose tables were laid out
                # by an earlier release (fewer reservation entries) keeps its blocks.
                sizes = operator.attrgetter("npages", "page_size", "max_block_size")
                if sizes(want) != sizes(have):
                    slab.close()
                    raise SlabError(
                        f"slab {name} was made with capacity "
                        f"{format_size(have.npages * have.page_size)}, page size "
                        f"{format_size(have.page_size)}, max block "
                        f"{format_size(have.max_block_size)}; this server asks for "
                        f"{format_size(want.npages * want.page_size)} / "
                        f"{format_size(want.page_size)} / {format_size(want.max_block_size)}"
                        ": start with the same sizes to keep its blocks, or --fresh"
                    )
                _await_writers(slab, name, owner, settings.drain_timeout_s)
                slab.claim()
                log.info("re-attaching slab %s (%s) left by pid %d: checking its %d slots",
                         name, format_size(have.npages * have.page_size), owner,
                         have.nslots)  # fmt: skip
                started = time.monotonic()
                problems = slab.repair(progress=ProgressLog(f"re-attaching slab {name}",
                                                            sizes=False))  # fmt: skip
                blocks = slab.stats()["unique_blocks"]
                note = (f"re-attached slab {name} left by pid {owner} in "
                        f"{time.monotonic() - started:.1f} s: {blocks} blocks kept")  # fmt: skip
                if problems:
                    note += f"; repaired {len(problems)} problem(s): {problems[0]}"
                return slab, note, True
    what = (f"slab {name}: {shown_size(settings.capacity)} in "
            f"{shown_size(settings.page_size)} pages, blocks up to "
            f"{shown_size(settings.max_block_size)}")  # fmt: skip
    started = time.monotonic()
    # The first line as the long part begins: allocating takes ~0.25 s a GiB here.
    progress = ProgressLog(f"creating slab {name}", first=f"creating {what} (allocating it)")
    # No prefault: it filled the supervisor's own page tables (workers map the slab with
    # theirs) and zeroed every page up front: 17 s of an 8 GiB start, 2 s of a 4 GiB one,
    # for a first pass of 14 MiB puts 10% faster (2.24-2.30 GiB/s without, 2.52-2.63 with;
    # the second pass the same). scripts/bench_start.py; docs/operations.md.
    slab = Slab.create(name, settings.capacity, settings.page_size, settings.max_block_size,
                       prefault=False, progress=progress)  # fmt: skip
    return slab, f"created {what} in {time.monotonic() - started:.1f} s", False


def open_door_warning(s: Settings) -> str | None:
    """What to warn of a server bound beyond loopback with no token (it still starts: a
    private network may be enough), or None."""
    if s.token or s.tokens_file or is_loopback(s.host):
        return None
    return (
        f"eg-kv: serving {s.bind} with no token: anyone who can reach it may read, write "
        f"and delete every block; set {ENV_TOKEN} (or --tokens) before binding beyond "
        "loopback (docs/security.md)"
    )


class Supervisor:
    """Runs the server described by ``settings`` until a signal stops it.

    Use :meth:`run`; it returns the process exit status.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.workers: dict[int, _Worker] = {}
        self.slab: Slab | None = None
        self.run_dir: str | None = None
        self.stopping = False
        self.stop_deadline = 0.0
        self.exit_code = 0
        self.fatal: str | None = None
        self.boot_deaths = 0
        self.served = False  # a worker has said it serves: failures are no longer fatal
        self._cannot_start: dict[int, str] = {}  # a live worker's start-up failure (its F)
        self._slot_backoff = SlotBackoff()  # workers, by heartbeat slot
        self._helper_backoff = SlotBackoff(first_s=HELPER_RESTART_S)  # helpers, by index
        self._signals: list[int] = []
        self._wake_r = self._wake_w = -1
        self._notify_r = self._notify_w = -1
        self._buf = b""
        self.heartbeats: runstate.Heartbeats | None = None
        self._dead: list[int] = []  # workers whose leftovers are still to be released
        self._unfolded: list[int] = []  # dead workers whose metrics files are still theirs
        self._lock_seen = (0, 0, 0.0)  # (holder, lock entries, first seen) of the lock
        self._lock_stuck_at = -float("inf")  # when the lock was last seen stuck
        self._lock_warned = (0, 0)
        self._watched_at = 0.0  # when the watchdog last ran
        self._resumed_at = -float("inf")  # when it last found a gap in its own clock
        self._loop_failed_said = 0.0
        self._fold_at = 0.0  # when local readers' hit hints are next folded into the slab
        self._tokens_text: str | None = None  # the tokens file in force (validated)
        self._reload_due = False  # a SIGHUP reload put off by a busy slab lock
        self.helpers: list[_Helper] = []  # the publisher, the disk keeper: as settings say
        if settings.kv_events_endpoint:
            self.helpers.append(_Helper("the KV-events publisher", self._run_publisher,
                                        settings.workers + len(self.helpers)))  # fmt: skip
        if settings.disk:
            self.helpers.append(_Helper("the disk keeper", self._run_keeper,
                                        settings.workers + len(self.helpers)))  # fmt: skip
        self._disk_lock = -1  # the disk tier's lock file, held while the server runs
        self._port: PortClaim | None = None  # this port's, held while the server runs
        self._reattached = False  # the slab was found with its blocks (a warm restart)
        self._parent = os.getpid()  # the supervisor's pid, for its children to watch

    # ------------------------------------------------------------------ top level

    def run(self) -> int:
        """Start everything, supervise, clean up. Returns the exit status."""
        s = self.settings
        # Signals first: a SIGTERM while the slab is created (seconds for a large one)
        # must still end in a clean exit that removes it, not in the default death.
        self._install_signals()
        try:
            try:
                self._tokens_text = self._read_tokens() if s.tokens_file else None
                try:
                    self._port = PortClaim(s.host, s.port)
                except PortTaken as e:
                    raise CannotServe(str(e)) from None
                check_port_free(s.host, s.port)
                if s.disk:  # refused here, with its reason, before anything is made
                    self._disk_lock = open_disk(s)
                try:
                    make_ssl_context(s)
                except (OSError, ValueError) as e:
                    filename = getattr(e, "filename", None)
                    where = f" ({filename})" if filename else ""
                    raise CannotServe(
                        f"cannot use the TLS certificate and key{where}: {e}"
                    ) from None
                self.slab, note, self._reattached = open_slab(s)
                # The event log, before any worker attaches (eg_kv.slab.events).
                self.slab.setup_events(s.events)
            except CannotServe as e:
                log.error("eg-kv: %s", e)
                return BOOT_ERROR
            except EgKvError as e:
                log.error("eg-kv: %s", e)
                return 1
            log.info("%s", note)
            self.run_dir = runstate.make_run_dir(s.port)
            if self._tokens_text is not None:
                self._install_tokens(self._tokens_text)
            self.heartbeats = runstate.Heartbeats.create(self.run_dir,
                                                         s.workers + len(self.helpers))  # fmt: skip
            runstate.write_state(self.run_dir, s.workers, [])
            self._warm_imports()
            log.info(
                "eg-kv supervisor %d serving %s://%s with %d workers (auth %s)",
                os.getpid(), s.scheme, s.bind, s.workers,
                "tokens file" if s.tokens_file else "on" if s.token else "off",
            )  # fmt: skip
            warning = open_door_warning(s)
            if warning:
                log.warning("%s", warning)
            if s.kv_events_open:
                log.warning("the KV-events publisher listens beyond loopback (%s): ZMQ has no "
                            "authentication, so anyone who reaches it reads every namespace's "
                            "events; keep it on 127.0.0.1 or behind a NetworkPolicy "
                            "(docs/events.md)", s.kv_events_endpoint)  # fmt: skip
            self._loop()
        finally:
            self._cleanup()
        if self.fatal:
            log.error("eg-kv: stopping: %s", self.fatal)
        else:
            log.info("eg-kv supervisor %d stopped", os.getpid())
        return self.exit_code

    def _warm_imports(self) -> None:
        # Import the worker's modules once here, so each fork starts serving at once.
        import aiohttp.web  # noqa: F401

        import eg_kv.server.app
        import eg_kv.server.protocol  # noqa: F401 (the worker's AppRunner)

        with contextlib.suppress(ImportError):
            import uvloop  # noqa: F401

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._notify_r, self._notify_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._notify_r, False)
        for sig in _HANDLED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        # Only queue and wake the loop: nothing else is safe in a signal handler.
        self._signals.append(signum)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------------ the loop

    # What run() opens before the loop starts: the loop's code may rely on it.
    @property
    def _slab(self) -> Slab:
        assert self.slab is not None, "the slab is opened before the loop runs"
        return self.slab

    @property
    def _run_dir(self) -> str:
        assert self.run_dir is not None, "the run directory is made before the loop runs"
        return self.run_dir

    @property
    def _heartbeats(self) -> runstate.Heartbeats:
        assert self.heartbeats is not None, "heartbeats are made before the loop runs"
        return self.heartbeats

    def _loop(self) -> None:
        while True:
            try:
                if self._pass():
                    return
            except Exception:  # a bug or a refusal (fork: EAGAIN) must not end the server
                if time.monotonic() >= self._loop_failed_said:  # at most one a while
                    self._loop_failed_said = time.monotonic() + LOOP_FAILED_LOG_S
                    log.exception("eg-kv: the supervisor's loop failed; going on")
            # Sleep until a signal, a child's death (SIGCHLD) or a worker's message.
            with contextlib.suppress(InterruptedError):
                select.select([self._wake_r, self._notify_r], [], [], TICK_S)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass

    def _pass(self) -> bool:
        """One pass of the loop: signals, deaths, the watchdog, refills. Returns True once
        the server has stopped."""
        self._read_notifications()
        self._handle_signals()
        self._reap()
        if self.fatal and not self.stopping:
            self.exit_code = BOOT_ERROR
            self._begin_stop(signal.SIGTERM)
        self._release_leftovers()
        if not self.stopping:
            self._watch()
        if self.stopping:
            if not self.workers and not self._helper_pids:
                return True
            if time.monotonic() > self.stop_deadline:
                for pid in list(self.workers):
                    log.warning("worker %d did not drain in time; killing it", pid)
                    self._kill(pid, signal.SIGKILL)
                for pid in self._helper_pids:
                    self._kill(pid, signal.SIGKILL)
                self.stop_deadline = float("inf")
        else:
            self._refill()
            tick_hints(self.slab)  # operator hints (page waste), at most every 5 min
            self._fold_local_hits()
        return False

    def _fold_local_hits(self) -> None:
        """Give the blocks local readers hit their CLOCK reference counts (once a second:
        a hint waits at most that long, and eviction sweeps take longer to come round)."""
        now = time.monotonic()
        if self.slab is not None and now >= self._fold_at:
            self._fold_at = now + FOLD_HINTS_S
            self.slab.fold_local_hits()

    def _handle_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if sig == signal.SIGCHLD:
                continue  # the reap below does the work
            if sig == signal.SIGHUP:
                if not self.stopping:
                    self._reload_tokens()
                continue
            if sig == signal.SIGQUIT or (self.stopping and sig in _GRACEFUL):
                log.warning("eg-kv: %s: stopping now, without draining",
                            signal.Signals(sig).name)  # fmt: skip
                self._begin_stop(signal.SIGKILL)
            else:
                log.info("eg-kv: %s: draining (up to %.0f s)",
                         signal.Signals(sig).name, self.settings.drain_timeout_s)  # fmt: skip
                self._begin_stop(signal.SIGTERM)
        if self._reload_due and not self.stopping:  # a reload the busy lock put off
            self._reload_tokens()

    # ------------------------------------------------------------------ tenants

    def _read_tokens(self) -> str:
        """Read and validate the tokens file; return its text.

        Raises:
            ConfigError: unreadable or invalid (the message names the line).
        """
        path = self.settings.tokens_file
        if path is None:
            raise ConfigError("no tokens file configured (--tokens)")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read tokens file {path}: {e}") from None
        tenants.parse(text, self.settings.capacity, f"tokens file {path}")
        return text

    def _install_tokens(self, text: str) -> None:
        """Bind the namespaces in the slab (ids, quotas) and hand the workers the file.

        Raises:
            ConfigError, SlabError, LockTimeout.
        """
        assert self.slab is not None and self.run_dir is not None  # set up before
        table = tenants.parse(text, self.settings.capacity)
        # The workers' copy first, under a temporary name: one that cannot be written
        # leaves the slab's quotas as they were, as the log then says.
        staged = runstate.stage_tokens_copy(self.run_dir, text)
        try:
            self.slab.bind_namespaces(table.quotas, timeout=LOCK_WAIT_S)
            runstate.commit_tokens_copy(self.run_dir, staged)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            if not isinstance(e, LockTimeout):  # bound, or bound in part ("table full")
                self._rebind_in_force()
            raise
        log.info("tokens file %s: %d tenants in %d namespaces", self.settings.tokens_file,
                 len(table.by_digest), len(table.quotas))  # fmt: skip

    def _restore_tokens_copy(self) -> None:
        """Write the validated tokens copy again if it went (a /tmp cleaner removed it):
        a child must read the tenants in force, never the file's unreloaded edits."""
        if self._tokens_text is None or self.run_dir is None:
            return
        copy = runstate.tokens_copy(self.run_dir)
        if os.path.exists(copy):
            return
        try:
            runstate.commit_tokens_copy(
                self.run_dir, runstate.stage_tokens_copy(self.run_dir, self._tokens_text)
            )
        except OSError as e:  # the child refuses to start, saying why
            log.error("eg-kv: cannot write the tokens copy %s again: %s", copy, e)
            return
        log.warning("the tokens copy %s was gone (a /tmp cleaner?): written again from the "
                    "tokens file in force", copy)  # fmt: skip

    def _rebind_in_force(self) -> None:
        """Put back the quotas of the tokens file in force (a reload that failed after
        its namespaces were bound: its new names keep their entries, unused)."""
        if self._tokens_text is None:
            return
        table = tenants.parse(self._tokens_text, self.settings.capacity)
        try:
            self._slab.bind_namespaces(table.quotas, timeout=LOCK_WAIT_S * 10)
        except EgKvError as e:
            log.error("eg-kv: SIGHUP: cannot put back the quotas in force after a failed "
                      "reload (%s): the slab enforces the new file's; SIGHUP again", e)  # fmt: skip

    def _reload_tokens(self) -> None:
        """SIGHUP: reload the tokens file; a bad one keeps the tenants in force."""
        if not self.settings.tokens_file:
            log.info("eg-kv: SIGHUP: no tokens file to reload (--tokens); nothing to do")
            return
        self._reload_due = False
        try:
            text = self._read_tokens()
            self._install_tokens(text)
        except LockTimeout as e:
            # A process holds the slab lock (one SIGSTOPped inside it: the watchdog ends it
            # soon): the reload is not lost, it runs again on the next tick.
            log.warning("eg-kv: SIGHUP: the slab lock is busy (%s); reloading again shortly", e)
            self._reload_due = True
            return
        except EgKvError as e:
            log.error("eg-kv: SIGHUP: tokens file not reloaded, the old tenants stay: %s", e)
            return
        except OSError as e:  # the workers' copy (a full or cleaned run directory)
            log.error("eg-kv: SIGHUP: tokens file not reloaded, the workers keep the old "
                      "tenants: cannot write their copy: %s; fix it, then SIGHUP", e)  # fmt: skip
            return
        self._tokens_text = text
        for pid in list(self.workers):  # each worker reads the validated copy
            self._kill(pid, signal.SIGHUP)

    def _begin_stop(self, sig: int) -> None:
        self.stopping = True
        grace = 0.0 if sig == signal.SIGKILL else self.settings.drain_timeout_s + KILL_GRACE_S
        self.stop_deadline = time.monotonic() + grace
        for pid in list(self.workers):
            self._kill(pid, sig)
        for pid in self._helper_pids:
            self._kill(pid, sig)

    def _kill(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _read_notifications(self) -> None:
        try:
            while chunk := os.read(self._notify_r, 65536):
                self._buf += chunk
        except BlockingIOError:
            pass
        *lines, self._buf = self._buf.split(b"\n")
        changed = False
        for line in lines:
            kind, _, rest = line.decode("utf-8", "replace").partition(" ")
            pid_text, _, reason = rest.partition(" ")
            pid = int(pid_text) if pid_text.isdigit() else -1
            if kind == "R" and pid in self.workers:
                self.workers[pid].ready_at = time.monotonic()
                self.boot_deaths = 0
                self.served = True
                changed = True
                log.info("worker %d serving", pid)
            elif kind == "F" and not self.served:  # as configured, no worker can serve
                self.fatal = f"worker {pid} could not start: {reason}"
            elif kind == "F" and pid in self.workers:  # said with its death (_classify)
                self._cannot_start[pid] = reason
        if changed:
            self._write_state()

    def _write_state(self) -> None:
        ready = [w.pid for w in self.workers.values() if w.ready]
        with contextlib.suppress(OSError):
            runstate.write_state(self._run_dir, self.settings.workers, ready)

    # ------------------------------------------------------------------ children

    def _reap(self) -> None:
        self._read_notifications()  # a worker's last words come before its death
        died = False
        while self.workers or self._helper_pids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            helper = next((h for h in self.helpers if h.pid == pid), None)
            if helper is not None:
                self._helper_died(helper, status)
                continue
            w = self.workers.pop(pid, None)
            if w is None:
                continue
            died = True
            self._dead.append(pid)
            self._unfolded.append(pid)
            self._heartbeats.clear(w.slot)
            self._classify(w, status)
        if died:
            self._write_state()
            self._release_leftovers()
        self._fold_metrics()

    def _fold_metrics(self) -> None:
        """Fold dead workers' request metrics into the archive files (a scrape in progress
        puts it off to a later pass; :mod:`eg_kv.server.metrics_fold`)."""
        while self._unfolded:
            try:
                if not fold_dead_process(runstate.metrics_dir(self._run_dir), self._unfolded[0]):
                    return
            except OSError as e:  # its files stay, still counted by every scrape
                log.warning("cannot fold worker %d's metrics files into the archive: %s",
                            self._unfolded[0], e)  # fmt: skip
            self._unfolded.pop(0)

    def _classify(self, w: _Worker, status: int) -> None:
        how = _how_it_ended(status)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        why = self._cannot_start.pop(w.pid, None)
        if self.stopping:
            if code != 0:
                log.warning("worker %d %s while stopping", w.pid, how)
            return
        if not self.served:  # the start-up: a configuration no worker can serve with
            if code == BOOT_ERROR:
                if not self.fatal:
                    self.fatal = f"worker {w.pid} could not start ({how})"
                return
            log.warning("worker %d %s after %.1f s; replacing it", w.pid, how,
                        time.monotonic() - w.started)  # fmt: skip
            self.boot_deaths += 1
            if self.boot_deaths >= MAX_BOOT_DEATHS:
                self.fatal = f"{self.boot_deaths} workers in a row died before serving ({how})"
            return
        # Serving: one slot that fails (a certificate mid-rotation, a crash loop) waits
        # and tries again, and the healthy workers keep serving.
        now = time.monotonic()
        what = f"could not start ({how}): {why}" if why else how
        wait = self._slot_backoff.died(w.slot, now - w.ready_at if w.ready else 0.0, now)
        log.warning("worker %d %s after %.1f s; replacing it%s", w.pid, what, now - w.started,
                    f" in {wait:.1f} s (its slot keeps failing)" if wait else "")  # fmt: skip

    def _release_leftovers(self) -> None:
        """Give back what dead workers left in the slab (bounded waits; retried next tick).

        Only what the dead one owned is touched, without walking the slab; if it died
        inside the critical section, taking the lock runs the full repair first.
        """
        while self._dead:
            pid = self._dead[0]
            try:
                left = self._slab.release_process(pid, timeout=LOCK_WAIT_S)
            except LockTimeout:
                return  # the lock is busy or stuck: the watchdog sees to it; retry later
            except Exception as e:
                log.error("cannot release what worker %d left in the slab: %s", pid, e)
            else:
                if left.full_repair is not None:
                    found = left.full_repair
                    log.warning("a process died holding the slab lock: full repair, %d "
                                "problem(s)%s", len(found), f", first: {found[0]}" if found
                                else "")  # fmt: skip
                if left.reservations or left.hits or left.misses:
                    log.info("released what worker %d left: %d upload(s) in flight (%d "
                             "pages), %d hit(s) and %d miss(es) counted", pid,
                             left.reservations, left.pages, left.hits, left.misses)  # fmt: skip
            self._dead.pop(0)

    def _repair(self) -> None:
        """Full repair (at exit with ``--keep``, when no worker is left to stall)."""
        try:
            problems = self._slab.repair(
                timeout=LOCK_WAIT_S * 10,
                progress=ProgressLog(f"repairing slab {self._slab.name}", sizes=False),
            )
        except Exception as e:
            log.error("slab repair failed: %s", e)
            return
        if problems:
            log.warning("slab repaired: %d problem(s), first: %s", len(problems), problems[0])

    # ------------------------------------------------------------------ the watchdog

    def _watch(self) -> None:
        """Kill the worker that wedges the server: the one that holds the lock too long,
        or one whose heartbeat stopped while the lock was not stuck."""
        s, now = self.settings, time.monotonic()
        holder, entries = self._slab.lock_state()
        if self._watched_at and now - self._watched_at > max(s.heartbeat_timeout_s / 2,
                                                             2 * TICK_S):  # fmt: skip
            # The supervisor itself did not run (the whole group stopped, a frozen cgroup,
            # a suspended VM): every clock below counts that gap, and the workers, resumed
            # with it, have not beaten yet. Clocks restart now, for one heartbeat timeout.
            log.warning("eg-kv: the supervisor did not run for %.1f s (stopped or frozen): "
                        "the watchdog's clocks restart", now - self._watched_at)  # fmt: skip
            self._resumed_at = now
            self._lock_seen = (holder, entries, now)
        self._watched_at = now
        seen_holder, seen_entries, since = self._lock_seen
        if holder and (holder, entries) == (seen_holder, seen_entries) and since < now:
            self._lock_stuck_at = now  # one critical section spans two ticks or more
            held = now - since
            if held > self._lock_limit:
                self._lock_held_too_long(holder, entries, held)
        else:
            self._lock_seen = (holder, entries, now)
        for w in list(self.workers.values()):
            if w.killed:
                continue
            if not w.ready:
                if min(now - w.started, now - self._resumed_at) > max(
                        BOOT_TIMEOUT_S, 6 * s.heartbeat_timeout_s):  # fmt: skip
                    self._kill_wedged(w, f"did not start serving in {now - w.started:.0f} s")
                continue
            age = self._heartbeats.age(w.slot, w.pid)
            age = now - w.ready_at if age is None else min(age, now - w.ready_at)
            age = min(age, now - self._resumed_at)
            if age <= s.heartbeat_timeout_s:
                continue
            if self._excused(w.pid, now):
                continue
            self._kill_wedged(w, f"has not beat for {age:.1f} s (stopped or stuck)")
        for h in self.helpers:  # they beat too (workers/disk.py, workers/publisher.py)
            if h.pid and not h.killed:
                self._watch_helper(h, now)

    def _excused(self, pid: int, now: float) -> bool:
        """Whether the silent process ``pid`` is excused by the lock: waiting for a stuck
        one, or running inside it."""
        stuck_lately = now - self._lock_stuck_at < self.settings.heartbeat_timeout_s
        if pid != self._lock_seen[0] and stuck_lately and not pid_stopped(pid):
            return True  # most likely waiting for the lock: the holder is the culprit (a
            # waiter sleeps in F_OFD_SETLKW, state S: a stopped one waits for no lock)
        # Running in the lock (a repair there does not beat): the lock's limit judges it;
        # a stopped holder is the heartbeat's, as any stopped process.
        return (pid == self._lock_seen[0] and now - self._lock_seen[2] <= self._lock_limit
                and not pid_stopped(pid))  # fmt: skip

    def _watch_helper(self, h: _Helper, now: float) -> None:
        """Kill a helper whose loop stopped beating (SIGSTOPped, stuck): the workers had
        marked its tier down for good, silently. It is started again like any dead one."""
        s = self.settings
        since = min(now - h.started, now - self._resumed_at)
        age = self._heartbeats.age(h.slot, h.pid)
        if age is None:  # still starting (it beats once its loop runs)
            if since <= max(BOOT_TIMEOUT_S, 6 * s.heartbeat_timeout_s):
                return
            why = f"did not start its loop in {since:.0f} s"
        else:
            age = min(age, since)
            if age <= s.heartbeat_timeout_s or self._excused(h.pid, now):
                return
            why = f"has not beat for {age:.1f} s ({pid_state(h.pid)}: stopped or stuck)"
        log.error("%s (pid %d) %s: killing it (SIGKILL); it is started again", h.name, h.pid,
                  why)  # fmt: skip
        h.killed = True
        self._kill(h.pid, signal.SIGKILL)

    @property
    def _lock_limit(self) -> float:
        return self.settings.lock_timeout_s + REPAIR_S_PER_PAGE * self._slab.geometry.npages

    def _lock_held_too_long(self, holder: int, entries: int, held: float) -> None:
        w = self.workers.get(holder)
        h = next((h for h in self.helpers if h.pid == holder), None)
        if w is not None:
            if not w.killed:
                self._kill_wedged(w, f"has held the slab lock for {held:.1f} s")
        elif h is None and pid_state(holder) == "T":  # an operator's tool, kill -STOP: not
            # traced ("t": a debugger's, which SIGCONT would not resume)
            log.error("pid %d, not a worker of this server, was stopped holding the slab "
                      "lock for %.1f s: every request waited; continuing it (SIGCONT)",
                      holder, held)  # fmt: skip
            self._kill(holder, signal.SIGCONT)
        elif self._lock_warned == (holder, entries):
            return
        elif h is not None:  # the keeper and the publisher take it too: started again
            self._lock_warned = (holder, entries)
            log.error("%s (pid %d) has held the slab lock for %.1f s: killing it (SIGKILL)",
                      h.name, holder, held)  # fmt: skip
            self._kill(holder, signal.SIGKILL)
        else:
            self._lock_warned = (holder, entries)
            log.error("pid %d, not a worker of this server, has held the slab lock for "
                      "%.1f s: every request waits; stop that process", holder, held)  # fmt: skip

    def _kill_wedged(self, w: _Worker, why: str) -> None:
        log.error("worker %d %s: killing it (SIGKILL)", w.pid, why)
        w.killed = True
        self._kill(w.pid, signal.SIGKILL)

    def _refill(self) -> None:
        now = time.monotonic()
        for h in self.helpers:
            if not h.pid and not self.fatal and now >= h.due:
                self._heartbeats.clear(h.slot)  # not beaten yet: judged as starting
                h.pid, h.started, h.killed = self._fork(self._helper_body(h)), now, False
        taken = {w.slot for w in self.workers.values()}
        for slot in range(self.settings.workers):
            if slot not in taken and not self.fatal and self._slot_backoff.ready(slot, now):
                self._spawn(slot)

    def _helper_body(self, h: _Helper) -> Callable[[], int]:
        """What the forked helper runs: its body, given the beat of its slot."""

        def child() -> int:
            return h.run(functools.partial(self._heartbeats.beat, h.slot, os.getpid()))

        return child

    def _run_publisher(self, beat: Callable[[], None]) -> int:
        try:
            from . import publisher
        except ImportError as e:  # a new process would fail the same way: stop instead
            log.error("eg-kv: the KV-events publisher cannot start: %s (pip install pyzmq "
                      "msgspec)", e)  # fmt: skip
            return BOOT_ERROR
        return publisher.run(self.settings, self._parent, self._run_dir, beat=beat)

    def _run_keeper(self, beat: Callable[[], None]) -> int:
        from . import disk

        return disk.run(self.settings, self._parent, beat=beat)

    @property
    def _helper_pids(self) -> list[int]:
        return [h.pid for h in self.helpers if h.pid]

    def _helper_died(self, h: _Helper, status: int) -> None:
        h.pid = 0
        if self.stopping:
            return
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == BOOT_ERROR and not self.served:
            self.fatal = f"{h.name} could not start (its log says why)"
            return
        now = time.monotonic()
        wait = self._helper_backoff.died(self.helpers.index(h), now - h.started, now)
        wait = max(wait, HELPER_RESTART_S)  # at most one restart a second
        log.warning("%s %s; starting it again in %.1f s", h.name, _how_it_ended(status), wait)
        h.due = now + wait

    def _spawn(self, slot: int) -> None:
        def child() -> int:
            beat = functools.partial(self._heartbeats.beat, slot, os.getpid())
            return worker_mod.run(self.settings, self._run_dir, self._notify_w, self._parent,
                                  heartbeat=beat)  # fmt: skip

        pid = self._fork(child)
        self._heartbeats.beat(slot, pid)
        self.workers[pid] = _Worker(pid, time.monotonic(), slot)

    def _fork(self, child: Callable[[], int]) -> int:
        """Fork a child that runs ``child()`` and exits with its status; returns its pid."""
        self._restore_tokens_copy()
        self._parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        # SIGHUP (a reload) is blocked across the fork, and the worker keeps it blocked
        # until it has read the tokens file and installed its handler (worker._serve): a
        # reload signalled meanwhile stays pending and reaches that handler. Ignoring it
        # until then lost it for good when it came between the read and the handler.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        if pid == 0:  # the child: never returns into the supervisor's code
            code = 1
            try:
                # SIGHUP's default would end the worker, but it stays blocked until the
                # worker's own handler is in (a pending signal survives SIG_DFL, not SIG_IGN).
                for sig in _HANDLED:
                    signal.signal(sig, signal.SIG_DFL)
                for fd in (self._wake_r, self._wake_w, self._notify_r):
                    os.close(fd)
                self._slab.close()  # the supervisor's handle: a child attaches its own
                code = child()
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the supervisor's reloads again
        return pid

    # ------------------------------------------------------------------ the end

    def _cleanup(self) -> None:
        for pid in [*self.workers, *self._helper_pids]:
            self._kill(pid, signal.SIGKILL)  # only after an error in the loop itself
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.workers.clear()
        if self.slab is not None:
            # A slab found with its blocks outlives a start that failed before serving.
            failed_warm = self._reattached and not self.served
            if self.settings.keep or failed_warm:  # left consistent, not only repairable
                self._repair()  # (a slab about to go is not: 10 s of a 4 GiB one's exit)
            self._dead.clear()
            name = self.slab.name
            self.slab.close()
            if self.settings.keep:
                log.info("slab %s kept (--keep): the next eg-kv serve re-attaches it", name)
            elif failed_warm:
                log.info("slab %s left as it was found (this start failed before serving): "
                         "the next eg-kv serve re-attaches it, --fresh drops it", name)  # fmt: skip
            elif self.slab.unlink():  # only the segments this server made or adopted
                log.info("slab %s removed", name)
            else:
                log.warning("slab %s: its name no longer points at this server's segment "
                            "(removed, or taken by another program): left alone", name)  # fmt: skip
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._port is not None:
            self._port.release()
        for fd in (self._wake_r, self._wake_w, self._notify_r, self._notify_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def serve(settings: Settings) -> int:
    """Run the server (the ``eg-kv serve`` command). Returns the exit status."""
    return Supervisor(settings).run()
