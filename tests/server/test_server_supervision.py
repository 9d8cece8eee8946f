"""The supervisor's judgement of its own children, with real processes and signals: a
stop of the supervisor itself is not the workers' fault, a worker that cannot start
again once the server serves costs that slot only, a stopped worker is never taken for
a lock waiter, and a stopped helper is replaced."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.common import wait_for
from helpers.server_http import request
from helpers.server_procs import gone, stopped, workers_of

pytestmark = pytest.mark.timeout(90)


def _continue(pids) -> None:
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)


def test_a_stop_of_the_supervisor_with_its_workers_kills_no_worker(server_factory):
    """``kill -STOP -PGID`` (a frozen container): the supervisor, continued first, found
    every heartbeat as old as the stop and SIGKILLed each worker. It now sees the gap in
    its own clock and gives the workers one heartbeat timeout to beat again."""
    srv = server_factory(workers=2, extra=("--heartbeat-timeout", "2"))
    assert request(srv, "PUT", "/kv/before", b"b" * 1000).status == 201
    before = workers_of(srv)
    group = [srv.pid, *before]
    try:
        for pid in group:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(stopped(p) for p in group), timeout=10, what="the stop")
        # The freeze's length (longer than the heartbeat timeout), not a synchronisation.
        time.sleep(3)
        os.kill(srv.pid, signal.SIGCONT)  # the supervisor runs its passes first
        wait_for(lambda: "did not run for" in srv.log() or any(gone(p) for p in before),
                 timeout=10, what="the supervisor's first pass")  # fmt: skip
    finally:
        _continue(group)
    wait_for(lambda: (srv.healthz() or {}).get("workers_up") == 2, timeout=10, what="healthz")
    assert "has not beat" not in srv.log(), srv.log()[-2000:]
    assert workers_of(srv) == before
    assert request(srv, "GET", "/kv/before").body == b"b" * 1000


def test_a_stopped_worker_is_not_spared_as_a_lock_waiter(server_factory):
    """Long critical sections that recur (big evictions, an operator's tool): the lock
    is seen stuck at least once per heartbeat timeout, and every silent worker was
    spared as its waiter, a SIGSTOPped one too, for as long as they recurred (48 s in
    the review) while it kept its share of new connections. A stopped process waits for
    no lock: it is killed after the heartbeat timeout."""
    from eg_kv.slab.store import Slab

    srv = server_factory(workers=2, extra=("--heartbeat-timeout", "2"))
    slab = Slab.attach(srv.slab_name)
    done = threading.Event()

    def long_sections() -> None:  # a 0.6 s hold (3 watchdog ticks) once a second
        while not done.is_set():
            with slab._locked(5.0):
                done.wait(0.6)
            done.wait(0.4)

    holder = threading.Thread(target=long_sections)
    holder.start()
    victim = min(workers_of(srv))
    try:
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: gone(victim), timeout=15, what="the stopped worker to be killed")
        took = time.monotonic() - t0
    finally:
        done.set()
        holder.join(10)
        _continue([victim])
        slab.close()
    print(f"killed {took:.1f} s after its SIGSTOP, with long sections recurring")
    assert f"worker {victim} has not beat" in srv.log()
    wait_for(lambda: (srv.healthz() or {}).get("workers_up") == 2, timeout=10, what="healthz")
