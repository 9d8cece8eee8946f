"""The supervisor's judgement of its own children, with real processes and signals: a
stop of the supervisor itself is not the workers' fault, a worker that cannot start
again once the server serves costs that slot only, a stopped worker is never taken for
a lock waiter, and a stopped helper is replaced."""

from __future__ import annotations

import glob
import os
import re
import signal
import threading
import time

import pytest
from helpers.common import free_port, wait_for
from helpers.server_http import request, stats
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


def test_dead_workers_metrics_files_are_folded_and_counters_keep_counting(server_factory):
    """Every replaced worker left its counter and histogram files (64 KiB each) for good,
    and every scrape read them all (455 files after 450 deaths in the review). Now the
    supervisor folds them into one archive per type; the totals never go back."""
    srv = server_factory(workers=1)
    (run_dir,) = glob.glob(f"/tmp/eg-kv-{srv.port}-*")
    files = os.path.join(run_dir, "metrics")
    puts = re.compile(r'^eg_kv_requests_total\{method="PUT",route="block",status="201"\} (\S+)$',
                      re.M)  # fmt: skip
    timed = re.compile(r'^eg_kv_request_duration_seconds_count\{route="block"\} (\S+)$', re.M)
    seen = []
    for k in range(6):
        assert request(srv, "PUT", f"/kv/m{k}", b"x" * 10).status == 201
        text = request(srv, "GET", "/metrics").text  # the worker flushes its own counts first
        seen.append((float(puts.search(text).group(1)), float(timed.search(text).group(1))))
        victim = min(workers_of(srv))
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda v=victim: gone(v) and len(workers_of(srv) - {v}) == 1
                 and (srv.healthz() or {}).get("workers_up") == 1, timeout=20,
                 what="a replacement")  # fmt: skip
    wait_for(lambda: len(glob.glob(os.path.join(files, "counter_*.db"))) <= 2, timeout=10,
             what="the dead workers' files folded")  # fmt: skip
    text = request(srv, "GET", "/metrics").text
    seen.append((float(puts.search(text).group(1)), float(timed.search(text).group(1))))
    print("PUTs and timed PUTs seen:", seen, "files:", sorted(os.listdir(files)))
    assert seen == [(float(k + 1), float(k + 1)) for k in range(6)] + [(6.0, 6.0)]
    assert len(glob.glob(os.path.join(files, "histogram_*.db"))) <= 2


def test_a_stopped_disk_keeper_is_replaced(server_factory, tmp_path):
    """A keeper SIGSTOPped outside the slab lock had no watchdog at all: the workers
    marked the disk tier down (every disk hit a miss, no spills, DELETEs of spilled
    blocks 503) and the supervisor said nothing, for good. Its loop beats now: it is
    killed after the heartbeat timeout and started again."""
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    srv = server_factory(workers=1, capacity="4MiB", extra=(
        "--page-size", "64KiB", "--disk", str(disk), "--disk-capacity", "64MiB",
        "--heartbeat-timeout", "2"))  # fmt: skip
    keeper = wait_for(lambda: stats(srv)["disk"].get("pid"), timeout=30,
                      what="the disk keeper to answer")  # fmt: skip
    os.kill(keeper, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_for(lambda: gone(keeper), timeout=15, what="the stopped keeper to be killed")
        took = time.monotonic() - t0
    finally:
        _continue([keeper])
    wait_for(lambda: stats(srv)["disk"].get("pid") not in (None, keeper), timeout=20,
             what="a new keeper")  # fmt: skip
    print(f"the stopped keeper was killed {took:.1f} s after its SIGSTOP")
    assert f"the disk keeper (pid {keeper}) has not beat" in srv.log()
    assert srv.proc.poll() is None


def test_a_stopped_kv_events_publisher_is_replaced(server_factory):
    """The publisher had no watchdog either: SIGSTOPped, it published nothing, for good,
    and nothing said so. Its loop beats now: killed after the timeout, started again."""
    from helpers.kv_publisher import kv_events_flags

    from eg_kv.server import runstate

    extra = kv_events_flags((free_port(), free_port()), "--heartbeat-timeout", "2")
    srv = server_factory(workers=1, capacity="4MiB", extra=extra)
    (run_dir,) = glob.glob(f"/tmp/eg-kv-{srv.port}-*")

    def publisher() -> int | None:
        helpers = workers_of(srv) - set(runstate.read_state(run_dir)[1])
        return helpers.pop() if len(helpers) == 1 else None

    # Once its loop runs: one stopped while it starts gets the start-up's allowance.
    first = wait_for(lambda: "KV events published on" in srv.log() and publisher(), timeout=10,
                     what="the publisher's loop")  # fmt: skip
    os.kill(first, signal.SIGSTOP)
    try:
        wait_for(lambda: gone(first), timeout=15, what="the stopped publisher to be killed")
    finally:
        _continue([first])
    wait_for(lambda: publisher() not in (None, first), timeout=20, what="a new publisher")
    assert f"the KV-events publisher (pid {first}) has not beat" in srv.log()
    assert srv.proc.poll() is None
