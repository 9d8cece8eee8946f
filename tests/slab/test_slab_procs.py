"""The slab across real processes: exact counters, SIGKILL torture, warm attach."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from helpers.block_content import content
from helpers.common import ROOT, wait_for

from eg_kv.errors import Busy, InsufficientStorage
from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024
FORK = mp.get_context("fork")


# ---------------------------------------------------------------- 4 x 1,000 puts


def _putter(name: str, seed: int, n: int, universe: int, out) -> None:
    slab = Slab.attach(name)
    rng = random.Random(seed)
    created = 0
    for _ in range(n):
        address = f"blk-{rng.randrange(universe)}"
        created += slab.put(address, content(address))
    slab.close()
    out.put(created)


def test_four_processes_thousand_puts_counters_are_exact(slab_name):
    slab = Slab.create(slab_name, 64 * MiB, page_size=16 * KiB, max_block_size=MiB)
    try:
        universe, n, seeds = 400, 1000, [11, 22, 33, 44]
        out = FORK.Queue()
        procs = [
            FORK.Process(target=_putter, args=(slab_name, s, n, universe, out), daemon=True)
            for s in seeds
        ]
        for p in procs:
            p.start()
        created = sum(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        # The model: replay each process's address sequence.
        refs: dict[str, int] = {}
        for s in seeds:
            rng = random.Random(s)
            for _ in range(n):
                a = f"blk-{rng.randrange(universe)}"
                refs[a] = refs.get(a, 0) + 1
        st = slab.stats()
        assert st["evictions"] == 0
        assert created == st["puts_created"] == st["unique_blocks"] == len(refs)
        assert st["total_refs"] == 4 * n
        assert st["dedup_hits"] == 4 * n - len(refs)
        assert st["resident_bytes"] == sum(len(content(a)) for a in refs)
        assert st["logical_bytes"] == sum(len(content(a)) * r for a, r in refs.items())
        assert st["dedup_savings_bytes"] == st["logical_bytes"] - st["resident_bytes"]
        for a in refs:
            assert slab.get(a) == content(a)
        assert slab.check() == []
    finally:
        slab.close()


def _getter(name: str, seed: int, n: int, die: bool) -> None:
    slab = Slab.attach(name)
    rng = random.Random(seed)
    for _ in range(n):
        address = f"blk-{rng.randrange(400)}"
        got = slab.get(address)
        assert got is None or got == content(address)
    if die:  # its counts live on in its entry: the next process to claim it folds them in
        os.kill(os.getpid(), signal.SIGKILL)
    slab.close()


def test_lock_free_get_counts_are_exact_across_processes(slab_name):
    slab = Slab.create(slab_name, 64 * MiB, page_size=16 * KiB, max_block_size=MiB)
    try:
        for i in range(0, 400, 2):  # every even address is resident
            slab.put(f"blk-{i}", content(f"blk-{i}"))
        seeds, n = [5, 6, 7, 8], 800
        procs = [
            FORK.Process(target=_getter, args=(slab_name, s, n, s % 2 == 0), daemon=True)
            for s in seeds
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, -9, 0, -9]  # seeds 6 and 8 die
        hits = 0
        for s in seeds:
            rng = random.Random(s)
            hits += sum(rng.randrange(400) % 2 == 0 for _ in range(n))
        st = slab.stats()
        assert (st["get_hits"], st["get_misses"]) == (hits, len(seeds) * n - hits)
        slab.get("blk-0")  # this process claims an entry, folding a dead one's counts
        st = slab.stats()
        assert (st["get_hits"], st["get_misses"]) == (hits + 1, len(seeds) * n - hits)
        assert slab.check() == []
    finally:
        slab.close()


# ---------------------------------------------------------------- SIGKILL torture


def _hammer(name: str, seed: int, progress, max_stall, stop) -> None:
    """Put, get, exist and (slowly) upload until stopped; record the longest operation.

    The shared values are lock-free (``RawValue``, one writer each): a victim SIGKILLed
    while holding a multiprocessing lock would deadlock the survivors, not the slab.
    """
    slab = Slab.attach(name)
    rng = random.Random(seed)
    while not stop.value:
        address = f"t-{rng.randrange(600)}"
        t0 = time.monotonic()
        try:
            roll = rng.random()
            if roll < 0.45:
                slab.put(address, content(address))
            elif roll < 0.8:
                got = slab.get(address)
                assert got is None or got == content(address), f"wrong bytes for {address}"
            elif roll < 0.9:
                slab.exists_many([address, f"t-{rng.randrange(600)}"])
            else:  # an upload that is still in flight when the kill may land
                body = content(address)
                h = slab.begin_put(address, len(body))
                try:
                    for i in range(0, len(body), 4096):
                        h.write(body[i : i + 4096])
                    h.commit()
                finally:
                    h.abort()
        except (InsufficientStorage, Busy):
            pass
        max_stall.value = max(max_stall.value, time.monotonic() - t0)
        progress.value += 1


def _start(*args) -> mp.Process:
    p = FORK.Process(target=_hammer, args=args, daemon=True)
    p.start()
    return p


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sigkill_torture_survivors_never_stall_and_slab_stays_sound(slab_name):
    slab = Slab.create(slab_name, 3 * MiB, page_size=16 * KiB, max_block_size=64 * KiB)
    stop = FORK.RawValue("b", 0)
    stalls = [FORK.RawValue("d", 0.0) for _ in range(2)]
    done = [FORK.RawValue("q", 0) for _ in range(2)]
    survivors = [_start(slab_name, 1000 + i, done[i], stalls[i], stop) for i in range(2)]
    rng = random.Random(7)
    kills = 0
    try:
        for cycle in range(200):
            progress = FORK.RawValue("q", 0)
            victim = _start(slab_name, cycle, progress, FORK.RawValue("d", 0.0), stop)
            target = rng.randrange(1, 40)
            wait_for(lambda p=progress, t=target: p.value >= t, timeout=20, what="victim work")
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            assert victim.exitcode == -signal.SIGKILL
            kills += 1
            if cycle % 50 == 49:  # the survivors keep working across the kills
                seen = [d.value for d in done]
                wait_for(
                    lambda s=seen: all(d.value > v + 10 for d, v in zip(done, s, strict=True)),
                    what="both survivors to make progress",
                )
    finally:
        stop.value = 1
        for p in survivors:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join(10)
    assert kills == 200
    assert all(p.exitcode == 0 for p in survivors), [p.exitcode for p in survivors]
    worst = max(s.value for s in stalls)
    assert worst < 1.0, f"a survivor stalled {worst:.3f}s"
    slab.repair()
    assert slab.check() == []
    st = slab.stats()
    # Every published block is resident, byte-identical, or was counted as evicted.
    resident = [a for a in (f"t-{i}" for i in range(600)) if slab.exists(a)]
    assert len(resident) == st["unique_blocks"]
    for a in resident:
        assert slab.get(a) == content(a)
    # Blocks created = blocks resident + blocks evicted, but for puts cut down by a kill
    # inside their commit (each such kill was repaired, and counted in `repairs`).
    assert abs(st["puts_created"] - st["unique_blocks"] - st["evictions"]) <= st["repairs"]
    assert st["evictions"] > 0 and st["reserved_pages"] == 0
    slab.close()


# ---------------------------------------------------------------- warm attach

_FILL = """
import sys
from eg_kv.slab.store import Slab
sys.path.insert(0, "tests")
from helpers.block_content import content
s = Slab.create(sys.argv[1], 16 * 1024 * 1024, page_size=16 * 1024, max_block_size=1 << 20)
for i in range(150):
    s.put(f"warm-{i}", content(f"warm-{i}"))
s.put("warm-0", content("warm-0"))
print(s.owner_pid)
"""


def test_warm_attach_after_the_creator_exits_without_unlinking(slab_name):
    out = subprocess.run(
        [sys.executable, "-c", _FILL, slab_name], cwd=ROOT, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr.decode()
    creator = int(out.stdout)
    slab = Slab.attach(slab_name)
    try:
        assert slab.owner_pid == creator
        assert slab.repair() == []
        slab.claim()
        assert slab.owner_pid == os.getpid()
        for i in range(150):
            assert slab.get(f"warm-{i}") == content(f"warm-{i}")
        st = slab.stats()
        assert (st["unique_blocks"], st["total_refs"], st["dedup_hits"]) == (150, 151, 1)
        assert slab.check() == []
    finally:
        slab.close()
