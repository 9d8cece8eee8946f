"""The sliced live check and the release of a dead process's leftovers, on a real slab
with real writer processes."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from helpers.common import ROOT, wait_for

from eg_kv.errors import SlabError
from eg_kv.slab import layout as L
from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024
FORK = mp.get_context("fork")
#: The issue's bound on how long a check may stall other requests at once.
MAX_HOLD_S = 0.020


def _writer(name: str, seed: int, stop, limit_s: float) -> None:
    """PUT and DELETE small blocks until told to stop (or ``limit_s`` passes)."""
    slab = Slab.attach(name)
    rng, deadline = random.Random(seed), time.monotonic() + limit_s
    while not stop.is_set() and time.monotonic() < deadline:
        n = rng.randrange(5000)
        a = f"w{seed}-{n}"
        if rng.random() < 0.6:  # an address always names the same bytes
            slab.put(a, bytes([seed]) * (1 + n * 7919 % (6 * KiB)))
        else:
            slab.delete(a)
    slab.close()


@contextlib.contextmanager
def _writers(name: str) -> Iterator[list]:
    """Two writer processes on slab ``name`` while the block runs (each stops by itself
    after 60 s); joined on the way out."""
    stop = FORK.Event()
    procs = [FORK.Process(target=_writer, args=(name, s, stop, 60), daemon=True) for s in (1, 2)]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        stop.set()
        for p in procs:
            p.join(30)


@pytest.fixture
def big_slab(slab_name):
    """256 MiB of 4 KiB pages (131,072 slots) holding 30,000 blocks."""
    slab = Slab.create(slab_name, 256 * MiB, page_size=4 * KiB, max_block_size=MiB)
    for i in range(30_000):
        slab.put(f"b{i}", b"d" * (1 + i % (8 * KiB)))
    yield slab
    slab.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_live_check_holds_the_lock_briefly_and_finds_no_false_problems(big_slab):
    # One hold of the lock for the whole walk would stall every writer this long:
    t0 = time.thread_time()
    assert big_slab.check() == []
    whole = time.thread_time() - t0
    assert whole > 5 * MAX_HOLD_S, f"the slab is too small to tell ({whole * 1000:.0f} ms)"

    with _writers(big_slab.name) as writers:
        # Writers attach and start writing before the check begins (on a loaded machine a
        # forked writer can take a while): the check must run while they write.
        start = big_slab._state[L.ST_SEQ]
        wait_for(lambda: big_slab._state[L.ST_SEQ] - start > 100, timeout=60,
                 what="the writers to be writing")  # fmt: skip
        # Up to three checks: a hold the host preempted (a VM's vCPU taken away counts as
        # the thread's CPU time: 24 ms once in CI for 5 ms slices) says nothing of the
        # code, and one hold for the whole walk would fail all three.
        for _ in range(3):
            before = big_slab._state[L.ST_SEQ]
            report = big_slab.check_live()
            assert big_slab._state[L.ST_SEQ] != before, "the writers ran during the check"
            if report.longest_hold_cpu_s < MAX_HOLD_S:
                break
    assert all(p.exitcode == 0 for p in writers), [p.exitcode for p in writers]
    print(f"whole walk {whole * 1000:.0f} ms CPU; live check: {report.slices} holds, longest "
          f"{report.longest_hold_cpu_s * 1000:.1f} ms CPU, {report.longest_hold_s * 1000:.1f} ms "
          "wall")  # fmt: skip
    assert report.problems == [], report.problems[:5]
    assert report.slices > 5
    # CPU time inside the hold: what the check itself costs the others, without the
    # preemptions a loaded test machine adds to the wall clock.
    assert report.longest_hold_cpu_s < MAX_HOLD_S, report
    assert report.unchecked, "what writers may have changed between slices is not claimed"

    quiet = big_slab.check_live()
    assert (quiet.problems, quiet.unchecked) == ([], [])


def test_no_garbage_collection_runs_while_a_slice_holds_the_lock(big_slab, monkeypatch):
    """The walk allocates (a tuple per slot): a collection it set off ran inside a hold,
    and in a process with a large heap a full one held the lock past the slice (21 and
    25 ms CPU for 5 ms slices, CI). Collections wait for the release now."""
    from eg_kv.slab import check

    inside, started_inside = [False], []
    walk = check._SlicedCheck._slots

    def slots(self, i, deadline):  # a slice's walk of the slots: under the lock
        inside[0] = True
        try:
            return walk(self, i, deadline)
        finally:
            inside[0] = False

    def collecting(phase, info):
        if phase == "start" and inside[0]:
            started_inside.append(info["generation"])

    monkeypatch.setattr(check._SlicedCheck, "_slots", slots)
    gc.callbacks.append(collecting)
    try:
        report = big_slab.check_live()
    finally:
        gc.callbacks.remove(collecting)
    assert report.problems == [] and report.slices > 5
    assert started_inside == [], f"{len(started_inside)} collections ran inside holds"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eg_kv_check_of_a_large_slab_under_write_load_slices_its_walk(big_slab):
    """The command itself walks in slices and says how many and how long the longest was."""
    with _writers(big_slab.name):
        cmd = [sys.executable, "-m", "workers", "check", "--slab-name", big_slab.name]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"\((\d+) slices; lock held at most ([\d.]+) ms at a time, ([\d.]+) ms CPU\)",
                  out.stdout)  # fmt: skip
    print(out.stdout)
    assert m, out.stdout
    slices, cpu_ms = int(m.group(1)), float(m.group(3))
    assert slices > 1 and cpu_ms < MAX_HOLD_S * 1000, out.stdout


@pytest.mark.slow
def test_live_check_finds_real_damage(big_slab):
    # Damage one slot's own fields: found whatever else runs (it lies inside one slice).
    _i, s = big_slab._find(*big_slab._key("b77"))
    big_slab._tag[s[5]] = 999_999_999
    problems = big_slab.check_live().problems
    assert any("tag 999999999" in p for p in problems), problems
    big_slab.repair()
    # Damage a global counter: found when no writer ran during the walk.
    big_slab._state[L.ST_FREE_COUNT] -= 3
    report = big_slab.check_live()
    assert report.unchecked == [] and any("free count" in p for p in report.problems), report


def test_eg_kv_check_of_real_damage_exits_1(slab_name):
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        slab.put("a", b"x" * 70_000)
        cmd = [sys.executable, "-m", "workers", "check", "--slab-name", slab_name]
        clean = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert clean.returncode == 0 and "is clean" in clean.stdout, clean.stdout + clean.stderr
        slab._state[L.ST_UNIQUE_BLOCKS] += 1
        bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        slab.close()
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "counter unique_blocks is 2 but the slots say 1" in bad.stdout


def _die_with_an_upload_and_reads(name: str, ready) -> None:
    slab = Slab.attach(name)
    h = slab.begin_put("orphan", 300 * KiB)
    h.write(b"x" * 1000)
    slab.get("kept")
    slab.get("kept")
    slab.get("missing")
    ready.set()
    signal.pause()


def test_release_process_frees_its_leftovers_without_a_walk(slab):
    slab.put("kept", b"k" * 1000)
    ready = FORK.Event()
    p = FORK.Process(target=_die_with_an_upload_and_reads, args=(slab.name, ready))
    p.start()
    assert ready.wait(30)
    with pytest.raises(SlabError, match="still runs"):
        slab.release_process(p.pid)
    assert slab.stats()["reserved_pages"] == 5
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    left = slab.release_process(p.pid, timeout=5)
    assert (left.reservations, left.pages, left.hits, left.misses) == (1, 5, 2, 1)
    assert left.full_repair is None
    st = slab.stats()
    assert (st["reserved_pages"], st["repairs"]) == (0, 0)
    assert (st["get_hits"], st["get_misses"]) == (2, 1)
    assert slab.check() == []
    again = slab.release_process(p.pid, timeout=5)  # nothing left: a no-op
    assert (again.reservations, again.hits) == (0, 0)


def test_live_check_notes_a_dead_writers_reservation_the_offline_check_reports_it(slab):
    """Between a writer's death and the supervisor's release, a live check is not failed."""
    slab.put("kept", b"k" * 1000)
    ready = FORK.Event()
    p = FORK.Process(target=_die_with_an_upload_and_reads, args=(slab.name, ready))
    p.start()
    assert ready.wait(30)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    report = slab.check_live()
    assert report.problems == [], report
    assert report.notes == [f"reservation 0 (pid {p.pid}): writer dead, to be released by "
                            "the supervisor"], report  # fmt: skip
    cmd = [sys.executable, "-m", "workers", "check", "--slab-name", slab.name]
    live = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert live.returncode == 0, live.stdout + live.stderr
    assert "note: reservation 0" in live.stdout and "writer dead" in live.stdout
    # The offline check (and repair) still call it damage.
    assert any("dead" in problem for problem in slab.check()), slab.check()
    assert slab.repair() and slab.check() == []
