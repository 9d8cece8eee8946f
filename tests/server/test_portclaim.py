"""The port claim (workers/portclaim.py) with real lock files in /tmp and real processes:
a claim swept by another server's start is not taken for a server, and a claim held by
a dead supervisor's leftover worker names that worker."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading

import pytest
from helpers.common import free_port, wait_for
from helpers.server_procs import stopped

from workers.portclaim import CLAIMS_DIR, PortClaim, PortTaken

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def stale_claim():
    """A claim file left by a SIGKILLed supervisor (its pid dead, nobody holding it):
    yields (port, path); removed afterwards."""
    port = free_port()
    path = os.path.join(CLAIMS_DIR, f"eg-kv-{os.getuid()}-port-{port}.lock")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    with open(path, "w") as f:
        f.write(f"{dead}\n")
    yield port, path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_a_claim_held_for_a_moment_by_a_sweep_is_taken(stale_claim):
    """Another server starting on another port sweeps stale claims: it holds this one
    for a moment. A start then was refused ("taken by another eg-kv (pid <dead>)"); it
    now tries again for 0.1 s and gets the port."""
    port, path = stale_claim
    sweeper = os.open(path, os.O_RDWR)
    fcntl.flock(sweeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
    let_go = threading.Timer(0.02, os.close, (sweeper,))  # the sweep's brief hold
    let_go.start()
    try:
        claim = PortClaim("127.0.0.1", port)
    finally:
        let_go.join()
    claim.release()


def test_a_claim_held_by_a_dead_supervisors_stopped_worker_names_that_worker(stale_claim):
    """A supervisor SIGKILLed while a worker of it was SIGSTOPped: the worker keeps the
    inherited lock (and the port) for good, and every start was refused naming the dead
    supervisor's pid ("stop it first"). The refusal now names the worker, its state and
    what to do."""
    port, path = stale_claim
    with open(path) as f:
        dead = f.read().strip()
    ready_r, ready_w = os.pipe()
    worker = os.fork()
    if worker == 0:  # the leftover worker: holds the inherited lock, then is stopped
        try:
            fd = os.open(path, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(ready_w, b"x")
            os.kill(os.getpid(), signal.SIGSTOP)
        finally:
            os._exit(0)
    try:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"x"
        wait_for(lambda: stopped(worker), timeout=10, what="the worker stopped")
        with pytest.raises(PortTaken) as refused:
            PortClaim("127.0.0.1", port)
    finally:
        os.close(ready_r)
        os.kill(worker, signal.SIGKILL)
        os.waitpid(worker, 0)
    message = str(refused.value)
    print(message)
    assert f"pid {worker} (stopped: kill -CONT it" in message
    assert f"eg-kv {dead}, which is dead" in message
