"""What a repair and ``eg-kv check --deep --repair`` leave behind, at the edges a review
found: a process SIGKILLed inside a lease section (the leased-page counters the lease caps
read), the lease holders' records after a rebuild, a backward shift's slot copy cut short,
and a deep repair on a slab whose page chains are damaged. Real slabs, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers.common import ROOT

from eg_kv.slab import layout as L
from eg_kv.slab.holds import holder_of
from eg_kv.slab.store import Slab, move_slot

pytestmark = pytest.mark.timeout(60)
KiB, MiB = 1024, 1024 * 1024


def _die_in_the_lock(name: str, step) -> int:
    """A child that attaches ``name``, runs ``step(slab)`` (which SIGKILLs it inside the
    lock), and is reaped: its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child dies by SIGKILL
        try:
            step(Slab.attach(name))
        finally:
            os._exit(1)  # never reached when the step killed it
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return pid


def test_a_death_inside_a_lease_section_is_repaired_and_the_share_holds(slab_name):
    """Killed after the slots counted their leases, before the leased pages were: the
    caps then let leases hold every page (64 of 64 under a 0.5 share) and every PUT got
    507. The repair now finds the counters short of the slots and rebuilds."""
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        for k in range(64):  # 64 one-page blocks: the slab is full
            slab.put(f"b{k}", os.urandom(1000))

        def lease_and_die(child: Slab) -> None:
            child._count_leased = lambda ns, pages: os.kill(os.getpid(), signal.SIGKILL)
            child.exists_leased([f"b{k}" for k in range(32)], lease_ms=60_000, share=0.5)

        dead = _die_in_the_lock(slab_name, lease_and_die)
        repaired = slab.release_process(dead).full_repair
        assert repaired and "counter leased_pages is 0 but the slots say 32" in repaired
        assert slab.check() == []
        found, leased = slab.exists_leased(
            [f"b{k}" for k in range(32, 64)], lease_ms=60_000, share=0.5
        )
        assert all(found) and leased
        assert slab.leased_blocks() == 32  # the share's half, not every block
        assert slab.put("new", os.urandom(1000))  # evicts an unleased block
    finally:
        slab.close()


def test_a_rebuilding_repair_forgets_the_holders_of_the_leases_it_dropped(slab_name):
    """A rebuild drops every slot's leases; a holder's record kept past it let tenant A
    end tenant B's newer lease on the block (and B's own release then failed)."""
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        slab.put("blk", os.urandom(1000))
        a, b = holder_of("tenant-a"), holder_of("tenant-b")
        assert slab.exists_leased(["blk"], lease_ms=60_000, holder=a) == ([True], True)

        def half_count_and_die(child: Slab) -> None:
            with child._locked():
                child._state[L.ST_TOTAL_REFS] += 1  # a change half made
                os.kill(os.getpid(), signal.SIGKILL)

        dead = _die_in_the_lock(slab_name, half_count_and_die)
        assert slab.release_process(dead).full_repair  # rebuilt: no lease is left
        assert slab.exists_leased(["blk"], lease_ms=60_000, holder=b) == ([True], True)
        assert slab.release_leases(["blk"], holder=a) == [False]  # A's went with the rebuild
        assert slab.release_leases(["blk"], holder=b) == [True]  # B's own is still there
    finally:
        slab.close()


class _CutShort:
    """The slab's mapping for one slot move that a SIGKILL cuts short: the first slice
    written stops after ``keep`` bytes, and nothing after it is written."""

    def __init__(self, mm, keep: int) -> None:
        self._mm, self._keep, self.cut = mm, keep, False

    def __getitem__(self, key):
        return self._mm[key]

    def __setitem__(self, key, value) -> None:
        if self.cut:
            return  # the process is dead
        if isinstance(key, slice):
            stop = key.start + min(self._keep, key.stop - key.start)
            self._mm[key.start : stop] = value[: stop - key.start]
            self.cut = True
            return
        self._mm[key] = value


@pytest.mark.parametrize("keep", [1, 40, 200])
def test_a_slot_move_cut_short_leaves_the_deleted_address_gone_and_the_moved_one_whole(
    slab_name, keep
):
    """A DELETE's backward shift moves the next block's slot over the deleted one. Cut
    short with the state byte copied first, the deleted address came back over the moved
    block's pages, with its own old checksum, and the repair kept it and dropped the
    moved block. Written state byte last, the cut slot is empty and the repair keeps the
    moved block whole."""
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        homes: dict[int, str] = {}
        for k in range(100_000):  # two addresses with one home slot: d there, j after it
            address = f"{k:08d}"
            home = slab._key(address)[1] & slab._mask
            if home in homes:
                d, j = homes[home], address
                break
            homes[home] = address
        jbytes = os.urandom(3000)
        slab.put(d, os.urandom(3000))
        slab.put(j, jbytes)
        i_d, i_j = slab._find(*slab._key(d))[0], slab._find(*slab._key(j))[0]
        assert i_j == (i_d + 1) & slab._mask
        dead = _die_in_the_lock(slab_name, lambda child: os.kill(os.getpid(), signal.SIGKILL))
        # What DELETE d did before the kill: d's pages freed, then j's slot moved over d's,
        # under the lock of the (now dead) process.
        slab._state[L.ST_LOCK_HOLDER] = dead
        slab._state[L.ST_SEQ] |= 1
        gone = slab._read_slot(i_d)
        slab._free_pages(gone[L.F_FIRST], gone[L.F_NPAGES])
        move_slot(_CutShort(slab._mm, keep), slab._slot_off(i_d), slab._slot_off(i_j), L.SLOT_SIZE)
        slab.repair()
        assert not slab.exists(d)
        assert slab.get(j) == jbytes
        assert slab.check() == []
    finally:
        slab.close()


def test_deep_repair_frees_nothing_on_a_slab_whose_chains_are_damaged(slab_name):
    """Block b's chain runs into block a's pages and b's bytes changed: freeing b along
    its chain put a's pages on the free list, and the next PUTs overwrote a."""
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        abytes = os.urandom(3 * 64 * KiB)
        slab.put("a", abytes)
        slab.put("b", os.urandom(3 * 64 * KiB))
        first_a = slab._find(*slab._key("a"))[1][L.F_FIRST]
        first_b = slab._find(*slab._key("b"))[1][L.F_FIRST]
        slab._next[first_b] = slab._next[first_a]  # b's second page is a's now
        data = slab.geometry.data_off + first_b * slab.page_size
        slab._mv[data] ^= 0xFF  # and b's bytes changed
        cmd = [sys.executable, "-m", "workers", "check", "--slab-name", slab_name, "--deep",
               "--repair"]  # fmt: skip
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode == 1, run.stdout + run.stderr
        assert "page" in run.stdout and "in two chains" in run.stdout, run.stdout
        assert "not freed: the slab's structure is damaged" in run.stdout, run.stdout
        assert slab.exists("b")  # not freed
        for k in range(40):  # what the free list holds is nobody's
            slab.put(f"x{k}", os.urandom(64 * KiB))
        assert slab.get("a") == abytes
    finally:
        slab.close()


def _dedup_put_then_die(name: str, address: str, length: int) -> int:
    """A child that begins a put of a resident block (a dedup hit: a reference taken at
    the headers), writes part of its body and is SIGKILLed: its pid."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child dies by SIGKILL
        try:
            child = Slab.attach(name)
            handle = child.begin_put(address, length)
            assert handle.dedup
            handle.write(b"x" * 1000)
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(1)
    os.read(ready_r, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    return pid


@pytest.mark.parametrize("cleanup", ["release_process", "repair"])
def test_a_dedup_put_whose_writer_dies_mid_body_gives_its_reference_back(slab_name, cleanup):
    """The reference a dedup hit takes at the headers was given back only by the put's
    own abort: a worker killed mid-body left it, and the one real holder's DELETE left
    the block resident. The supervisor's cleanup (or, when it died too, the repair of a
    re-attach) takes it back now."""
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        data = os.urandom(200_000)
        slab.put("blk", data)
        before = {k: slab.stats()[k] for k in ("dedup_hits", "total_refs")}
        dead = _dedup_put_then_die(slab_name, "blk", len(data))
        assert slab.refs("blk") == 2  # held by the dead writer's put
        if cleanup == "release_process":
            left = slab.release_process(dead)
            assert (left.reservations, left.pages) == (1, 0)
        else:
            assert slab.repair() == []  # not damage: the reference is taken back
        assert slab.refs("blk") == 1
        assert {k: slab.stats()[k] for k in before} == before
        assert slab.delete("blk") and not slab.exists("blk")
        assert slab.check() == []
    finally:
        slab.close()


@pytest.mark.parametrize("cleanup", ["release_process", "repair"])
def test_a_dead_dedup_put_is_taken_back_from_a_block_shifted_across_the_wrap(slab_name, cleanup):
    """Two blocks homed at the table's last slot (the second wraps to slot 0); deleting
    the first shifts the second back across the wrap, and slot 0, emptied, keeps its id.
    The cleanup found that stale copy first (the lower index) and took nothing back: one
    DELETE no longer freed the block."""
    slab = Slab.create(slab_name, 16 * 4096, page_size=4096, max_block_size=4096)
    try:
        last = slab.geometry.nslots - 1
        homed = (a for a in (f"a{k}" for k in range(10**6)) if slab._key(a, 0)[1] & last == last)
        first, second = next(homed), next(homed)
        slab.put(first, b"A" * 4000)
        slab.put(second, b"B" * 4000)
        assert slab._find(*slab._key(second, 0), 0)[0] == 0  # wrapped
        slab.delete(first)  # the second shifts back to the last slot
        block = slab.block_ids([second])[1][0]
        assert slab._slot_block_ids.tolist().index(block) == 0  # the empty slot's stale id
        dead = _dedup_put_then_die(slab_name, second, 4000)
        assert slab.refs(second) == 2
        if cleanup == "release_process":
            assert slab.release_process(dead).reservations == 1
        else:
            assert slab.repair() == []
        assert slab.refs(second) == 1
        assert slab.delete(second) and not slab.exists(second)
        assert slab.check() == []
    finally:
        slab.close()
