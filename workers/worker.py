"""One worker process: the aiohttp app on the shared port, until told to stop.

A worker is forked by the supervisor. It attaches the slab itself (a handle is never
used across ``fork``), binds the port with ``SO_REUSEPORT`` beside its siblings, tells
the supervisor it is ready over a pipe, and serves until SIGTERM; then it stops
accepting, lets in-flight requests finish within the drain timeout, and exits 0.

It exits on its own when the supervisor dies: the kernel sends it SIGTERM
(``PR_SET_PDEATHSIG``), and a once-a-second check of the parent pid covers the window
before that was set up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import ssl
import sys
from collections.abc import Callable

from eg_kv.config import Settings
from eg_kv.server.runstate import beat_interval

log = logging.getLogger("eg_kv.worker")

#: Exit status of a worker that could not start serving (gunicorn's convention): the
#: supervisor stops instead of replacing it, since a replacement would fail the same way.
BOOT_ERROR = 3
_PR_SET_PDEATHSIG = 1


def make_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The server-side TLS context from the certificate and key, or None without TLS.

    Raises:
        OSError, ssl.SSLError: the files cannot be read or do not make a key pair.
    """
    if not settings.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux); harmless elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def beating(beat: Callable[[], None], stop: list[int]) -> Callable[[], bool]:
    """A helper's ``stopped()`` predicate, which its loop calls every step or idle
    wait, that also beats: a helper stopped or stuck in its loop stops beating, and the
    supervisor replaces it. True once SIGTERM appended to ``stop``."""

    def stopped() -> bool:
        beat()
        return bool(stop)

    return stopped


def _notify(fd: int, message: str) -> None:
    """One line to the supervisor; under PIPE_BUF, so the write is atomic."""
    data = (message.replace("\n", " ")[:1000] + "\n").encode("utf-8", "replace")
    with contextlib.suppress(OSError):
        os.write(fd, data)


def run(
    settings: Settings, run_dir: str, notify_fd: int, parent: int,
    heartbeat: Callable[[], None] | None = None,
) -> int:  # fmt: skip
    """Serve until SIGTERM. Returns the exit status (0, or BOOT_ERROR).

    ``heartbeat`` is called every :func:`eg_kv.server.runstate.beat_interval` seconds from the
    event loop, for as long as it runs (the supervisor's watchdog reads the beats).
    """
    _die_with_parent(parent)
    # Ctrl-C reaches the whole process group; the supervisor alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # uvloop is optional: the server runs on asyncio's own loop
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    if heartbeat is not None:
        _beat_every(loop, heartbeat, beat_interval(settings.heartbeat_timeout_s))
    try:
        return loop.run_until_complete(_serve(settings, run_dir, notify_fd, parent))
    finally:
        loop.close()


def _beat_every(loop: asyncio.AbstractEventLoop, beat: Callable[[], None], interval: float) -> None:
    """Beat now and every ``interval`` seconds while the loop runs (a timer, not a task:
    nothing is left pending when the loop closes)."""
    beat()
    loop.call_later(interval, _beat_every, loop, beat, interval)


async def _serve(settings: Settings, run_dir: str, notify_fd: int, parent: int) -> int:
    from aiohttp import web

    from eg_kv.server.app import make_app
    from eg_kv.server.auth import tokens_path
    from eg_kv.server.connections import raise_fd_limit
    from eg_kv.server.keys import AUTH, DRAIN, SLAB
    from eg_kv.server.protocol import AppRunner

    raise_fd_limit()  # before make_app, which derives the connection cap from it
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    pid = os.getpid()
    app = make_app(settings, run_dir=run_dir)
    reload_wanted = asyncio.Event()
    # SIGHUP (sent by the supervisor once it has validated a new tokens file) only sets a
    # flag; the reload itself runs in the loop, between requests.
    loop.add_signal_handler(signal.SIGHUP, reload_wanted.set)
    # The supervisor forks a worker with SIGHUP blocked (Supervisor._spawn). make_app has
    # read the tokens file and the handler is in: a reload signalled since the fork is
    # delivered to it now, so a file read just before that reload is read again.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    runner = AppRunner(
        app,
        handle_signals=False,
        access_log=logging.getLogger("aiohttp.access") if settings.access_log else None,
        # By the time aiohttp's own shutdown runs, requests have drained (see below).
        shutdown_timeout=1.0,
        auto_decompress=False,
    )
    try:
        ssl_context = make_ssl_context(settings)
        await runner.setup()
        site = web.TCPSite(
            runner, settings.host, settings.port, reuse_port=True, ssl_context=ssl_context,
            backlog=1024,
        )  # fmt: skip
        await site.start()
    except Exception as e:
        reason = f"cannot serve on {settings.bind}: {type(e).__name__}: {e}"
        _notify(notify_fd, f"F {pid} {reason}")
        print(f"eg-kv worker {pid}: {reason}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            await runner.cleanup()
        return BOOT_ERROR
    _notify(notify_fd, f"R {pid}")

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("worker %d: supervisor %d is gone; stopping", pid, parent)
        stop.set()

    async def reload_tenants() -> None:
        path = tokens_path(settings, run_dir)
        while True:
            await reload_wanted.wait()
            reload_wanted.clear()
            if path is not None and SLAB in app:
                app[AUTH].reload(app[SLAB], path, settings.capacity)

    watcher = asyncio.ensure_future(watch_parent())
    reloader = asyncio.ensure_future(reload_tenants())
    await stop.wait()
    watcher.cancel()
    reloader.cancel()
    # Stop accepting; let requests in flight finish (uploads keep receiving their bodies)
    # within the drain timeout; then close the connections and the slab handle.
    await site.stop()
    if not await app[DRAIN].wait_idle(settings.drain_timeout_s):
        log.warning("worker %d: requests still in flight after %.0f s; cutting them",
                    pid, settings.drain_timeout_s)  # fmt: skip
    await runner.cleanup()
    return 0
