"""The slab's event log (eg_kv.slab.events): order, reasons, bounds, namespaces, and a
process SIGKILLed inside the lock at each step of a change (no event lost or repeated)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from eg_kv.engine import EngineName
from eg_kv.errors import SlabError
from eg_kv.slab import events as E
from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024
PAGE = 4 * KiB


def replay(events, start=None):
    """Apply events to a set of (ns, address); fail on a store of a present block or a
    removal of an absent one (a repeated or lost event), or a seq out of order."""
    held = set(start or ())
    last = None
    for ev in events:
        assert last is None or ev.seq == last + 1, f"seq {ev.seq} after {last}"
        last = ev.seq
        key = (ev.ns, ev.address.decode())
        if ev.kind == E.STORED:
            assert key not in held, f"stored twice: {ev}"
            held.add(key)
        else:
            assert key in held, f"removed while absent: {ev}"
            held.discard(key)
    return held


def all_events(slab, since=0):
    out = []
    while True:
        got, nxt, gap = slab.events.read(since, 10000)
        assert not gap
        out += got
        if nxt == since or nxt >= slab.events.head:
            return out
        since = nxt


def held_now(slab, ns=None):
    return {(n, a) for n, a, _len in slab.events_snapshot(ns)[2]}


@pytest.fixture
def eslab(slab_name):
    """A slab of 64 pages of 4 KiB with an event log of 4096 entries."""
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    s.setup_events(4096)
    yield s
    s.close()
    s.unlink()


def test_order_kinds_and_reasons(eslab):
    s = eslab
    assert s.put("a", b"x" * 100) and s.put("b", b"y" * 100)
    assert s.put("a", b"x" * 100) is False  # dedup: no event
    assert s.delete("a") is True  # one reference left: no event
    assert s.delete("a") is True  # the last: removed (delete)
    evs = all_events(s)
    assert [(e.seq, E.KINDS[e.kind], E.REASONS[e.reason], e.address) for e in evs] == [
        (1, "stored", "put", b"a"),
        (2, "stored", "put", b"b"),
        (3, "removed", "delete", b"a"),
    ]
    assert evs[0].length == 100 and evs[0].block_id != evs[1].block_id
    for i in range(200):  # a slab of 64 pages: evictions
        s.put(f"k{i}", bytes(3 * KiB))
    evs = all_events(s)
    assert {E.REASONS[e.reason] for e in evs if e.kind == E.REMOVED} == {"delete", "evict"}
    assert replay(evs) == held_now(s)
    epoch, seq, _ = s.events_snapshot(None)
    assert seq == s.events.head == len(evs) and epoch == s.events.epoch


def test_a_block_marked_on_disk_keeps_its_engine_name(eslab):
    """The disk tier's mark (its record number) lies in its own field of the slot: it
    was written over the LoRA id (one field on), so a DELETE of a spilled block logged
    its removal under a LoRA id that was the record's number, and a router kept the
    block; and a promoted block's record read back as its LoRA id (0), so a keeper's
    start took its mark for a lost copy's."""
    s = eslab
    engine = EngineName(b"h" * 32, b"", 16, 5)
    assert s.put("a", b"x" * 100, engine=engine)
    _, ids = s.block_ids(["a"])
    assert s.mark_spilled("a", 0, ids[0], 77) == 1
    assert [m[1:] for m in s.spilled_marks()] == [("a", 100, 77)]
    h = s.begin_put("p", 100)  # a promotion: published with its record
    h.write(b"y" * 100)
    h.record, h.engine = 78, engine
    assert h.commit() is True
    assert sorted(m[1:] for m in s.spilled_marks()) == [("a", 100, 77), ("p", 100, 78)]
    assert s.delete("a") and s.delete("p")
    removed = [e for e in all_events(s) if e.kind == E.REMOVED]
    assert [(e.address, e.engine.hash, e.engine.lora_id, e.engine.block_size)
            for e in removed] == [(b"a", b"h" * 32, 5, 16), (b"p", b"h" * 32, 5, 16)]  # fmt: skip


def test_large_put_and_abort(eslab):
    s = eslab
    h = s.begin_put("big", 3 * PAGE)
    h.write(bytes(3 * PAGE))
    assert h.commit() is True
    h = s.begin_put("gone", 2 * PAGE)
    h.write(bytes(PAGE))
    h.abort()  # never published: no event
    assert [(e.kind, e.address) for e in all_events(s)] == [(E.STORED, b"big")]


def test_quota_evictions_are_named(eslab):
    s = eslab
    ids = s.bind_namespaces({"": 0, "small": 4 * PAGE, "other": 0})
    for i in range(10):
        s.put(f"q{i}", bytes(PAGE), ns=ids["small"])
        s.put(f"o{i}", bytes(PAGE), ns=ids["other"])
    evs = all_events(s)
    quota = [e for e in evs if e.kind == E.REMOVED]
    assert quota and all(E.REASONS[e.reason] == "quota" and e.ns == ids["small"] for e in quota)
    # Each namespace reads only its own entries; the seqs stay the log's.
    mine, nxt, gap = s.events.read(0, 1000, ns=ids["other"])
    assert not gap and nxt == s.events.head
    assert [e.address for e in mine] == [f"o{i}".encode() for i in range(10)]
    assert replay(evs) == held_now(s)
    assert held_now(s, ids["other"]) == {(ids["other"], f"o{i}") for i in range(10)}
    some, nxt, _ = s.events.read(0, 3, ns=ids["small"])
    assert len(some) == 3 and nxt == some[-1].seq  # limit counts what is returned


def test_ring_wraps_into_a_gap_and_a_snapshot_resyncs(slab_name):
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        s.setup_events(16)
        for i in range(10):
            s.put(f"a{i}", b"1")
        held, since = held_now(s), s.events.head
        for i in range(40):  # more than the log holds
            s.put(f"b{i}", b"2")
            s.delete(f"a{i % 10}")
        got, nxt, gap = s.events.read(since, 100)
        assert gap and got == [] and nxt == s.events.head
        # Everything from head + 2 - N on is readable; one earlier is a gap.
        head = s.events.head
        assert s.events.read(head + 1 - 16, 100)[2] is False
        assert s.events.read(head - 16, 100)[2] is True
        assert s.events.read(head + 5, 100)[2] is True  # beyond the log: another log
        _epoch, seq, blocks = s.events_snapshot(None)
        start = {(n, a) for n, a, _ in blocks}
        for i in range(5):
            s.put(f"c{i}", b"3")
        got, nxt, gap = s.events.read(seq, 100)
        assert not gap and replay(got, start) == held_now(s)
        assert held != start
    finally:
        s.close()
        s.unlink()


def test_setup_keeps_a_log_of_the_same_size_and_replaces_another(slab_name):
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        s.setup_events(64)
        s.put("a", b"1")
        epoch = s.events.epoch
        other = Slab.attach(slab_name)
        assert other.events.epoch == epoch and other.events.head == 1
        other.close()
        s.setup_events(64)  # a warm restart with the same size: readers resume
        assert s.events.epoch == epoch and s.events.head == 1
        s.setup_events(128)  # another size: a new log, a new epoch
        assert s.events.epoch != epoch and s.events.head == 0
        with pytest.raises(SlabError, match="want 0"):
            s.setup_events(3)
        s.setup_events(0)
        assert s.events is None and not os.path.exists(f"/dev/shm{slab_name}.events")
        with pytest.raises(SlabError, match="no event log"):
            s.events_snapshot(None)
        s.put("b", b"2")  # no log: nothing breaks
        s.setup_events(32)
        assert os.stat(f"/dev/shm{slab_name}.events").st_mode & 0o777 == 0o600
    finally:
        s.close()
        s.unlink()
    assert not os.path.exists(f"/dev/shm{slab_name}.events")


# ------------------------------------------------------------ a holder SIGKILLed inside

#: A child that attaches, makes ``method`` SIGKILL it, and runs ``op`` (inside the lock).
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from eg_kv.slab.store import Slab
    from eg_kv.slab import events as E
    name, where, op = sys.argv[1:4]
    s = Slab.attach(name)
    cls = E.EventRing if where == "commit" else Slab
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(cls, where, die)
    if op == "delete":
        s.delete("victim")
    elif op == "put":
        s.put("fresh", b"z" * 100)
    elif op == "evict":  # the slab is full: this put evicts first
        s.put("filler", bytes(3 * 4096))
    """
)


@pytest.mark.parametrize(
    "op, where, expect",
    [
        ("delete", "_free_pages", "kept"),  # pending, nothing changed yet: dropped
        ("delete", "_remove_slot", "repair"),  # pages freed, slot left: repair drops it
        ("delete", "commit", "delete"),  # removed, not yet published: published
        ("put", "_write_slot", "none"),  # pending store never written: dropped
        ("put", "commit", "put"),  # stored, not yet published: published
        ("evict", "_remove_slot", "repair"),
        ("evict", "commit", "evict"),
    ],
)
def test_sigkill_inside_the_lock_loses_and_repeats_nothing(slab_name, op, where, expect):
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        s.setup_events(4096)
        s.put("victim", b"v" * 100)
        for i in range(63 if op == "evict" else 20):
            s.put(f"b{i}", bytes(PAGE))
        before = s.events.head
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, slab_name, where, op], timeout=60, check=False
        )
        assert child.returncode == -9
        assert s.lock_state()[0] != 0  # the dead holder's pid is left in the header
        problems = s.repair()  # the next holder repairs (the supervisor's call here)
        evs = all_events(s)
        assert replay(evs) == held_now(s), problems
        new = evs[before:]
        last = new[-1] if new else None
        if expect == "kept":
            assert new == [] and (0, "victim") in held_now(s)
        elif expect == "none":
            assert new == [] and (0, "fresh") not in held_now(s)
        else:
            assert last is not None and E.REASONS[last.reason] == expect
            if op in ("delete", "put"):
                assert last.address in (b"victim", b"fresh")
        assert s.check() == []
        assert s.events.read(s.events.head, 10) == ([], s.events.head, False)
    finally:
        s.close()
        s.unlink()


def test_an_events_segment_of_another_user_is_refused_and_left_alone(slab_name):
    """Like the readers segment: another user's (or a 0666) ``<slab>.events`` is never
    mapped, written or removed; the slab's own is 0600."""
    import posix_ipc

    from eg_kv.slab.segment import ForeignSegment

    name = slab_name + E.EVENTS_SUFFIX
    path = "/dev/shm" + name
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
        shm.close_fd()
        os.chmod(path, 0o666)
        os.chown(path, 65534, 65534)
        before = os.stat(path)
        with pytest.raises(ForeignSegment, match=r"\.events .* owned by uid 65534"):
            s.setup_events(64)
        with pytest.raises(ForeignSegment, match=r"\.events .* owned by uid 65534"):
            Slab.attach(slab_name)
        Slab.unlink_named(slab_name)  # by name (--fresh): another user's stays
        after = os.stat(path)
        assert (after.st_ino, after.st_uid, after.st_size) == (before.st_ino, 65534, 4096)
    finally:
        s.close()
        if os.path.exists(path):
            os.unlink(path)


_CHURN = textwrap.dedent(
    """
    import random, sys
    from eg_kv.slab.store import Slab
    s = Slab.attach(sys.argv[1])
    rnd = random.Random(7)
    for _ in range(int(sys.argv[2])):
        key = f"c{rnd.randrange(300)}"
        if rnd.random() < 0.3:
            s.delete(key)
        else:
            s.put(key, bytes(100 + int(key[1:]) * 37))  # one length per address
    """
)


@pytest.mark.timeout(120)
def test_sliced_snapshots_under_churn_match_the_log(slab_name, monkeypatch):
    """Snapshots taken slice by slice while another process stores, deletes and evicts:
    each equals the log replayed up to its seq (slices end at empty slots, and what
    changed during the walk comes from the log)."""
    monkeypatch.setattr(E, "SNAPSHOT_SLICE", 16)  # a small slab, many slices
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        s.setup_events(1 << 17)
        child = subprocess.Popen([sys.executable, "-c", _CHURN, slab_name, "20000"])
        snaps = []
        try:
            while child.poll() is None and len(snaps) < 400:
                snaps.append(s.events_snapshot(None))
        finally:
            child.wait(60)
        assert child.returncode == 0 and len(snaps) > 10
        log = all_events(s)
        assert len(log) < 1 << 17  # the whole churn is still in the log
        for _epoch, seq, blocks in snaps:
            assert {(n, a) for n, a, _ in blocks} == replay(log[:seq]), seq
    finally:
        s.close()
        s.unlink()


def test_a_block_moved_across_the_walks_frontier_is_never_missed(eslab, monkeypatch):
    """A delete between two slices shifts a block backwards, towards its home (no event
    of its own). A slice ends at an empty slot, so the block's whole probe run is walked
    in one slice: here the first slice of 16 runs on past slots 15 and 16 (both held),
    and the delete after it moves nothing across the frontier."""
    s = eslab
    home = 15  # the last slot of the first slice of 16
    same = [a for a in (f"x{i}" for i in range(20000)) if s._key(a)[1] & s._mask == home][:2]
    first, moved = same
    s.put(first, b"1")  # at its home, slot 15
    s.put(moved, b"2")  # probes on to slot 16, past the first 16 slots
    calls = []

    class Between:
        @staticmethod
        def sleep(_s):
            if not calls:  # after the first slice: the backward shift moves it to 15
                calls.append(s.delete(first))

    monkeypatch.setattr(E, "SNAPSHOT_SLICE", 16)
    monkeypatch.setattr(E, "time", Between)
    _epoch, seq, blocks = s.events_snapshot(None)
    assert calls == [True]
    assert {a for _n, a, _l in blocks} == {moved} and seq == s.events.head


def test_a_snapshot_streams_slices_then_the_logs_changes_then_its_end(eslab, monkeypatch):
    s = eslab
    for i in range(40):
        s.put(f"k{i}", b"k", 3 if i % 2 else 0)
    monkeypatch.setattr(E, "SNAPSHOT_SLICE", 16)
    parts = s.snapshot_stream(3)
    kinds = [next(parts).kind for _ in range(2)]
    s.put("late", b"l", 3)  # during the walk: an events part carries it
    s.delete("k1", 3)
    rest = list(parts)
    kinds += [p.kind for p in rest]
    assert kinds[:2] == ["blocks", "blocks"] and kinds[-1] == "end"
    changes = [(ev.kind, ev.address) for p in rest if p.kind == "events" for ev in p.events]
    assert changes == [(E.STORED, b"late"), (E.REMOVED, b"k1")]
    assert rest[-1].position == s.events.ns_position(3)[0] == 22
    held = {raw for p in rest if p.kind == "blocks" for _n, raw, _l in p.blocks}
    assert all(n == 3 for p in rest if p.kind == "blocks" for n, _r, _l in p.blocks)
    assert held <= {f"k{i}".encode() for i in range(1, 40, 2)} | {b"late"}


def test_a_namespace_counts_its_own_positions_and_a_dropped_pending_entry_restores_them(eslab):
    s = eslab
    ring = s.events
    for i in range(3):
        s.put(f"a{i}", b"a", 0)
        s.put(f"b{i}", b"b", 5)
    assert ring.ns_position(5) == (3, 6) and ring.ns_position(0) == (3, 5)
    got, nxt, gap = ring.read_ns(1, 10, 5)
    assert [(e.seq, e.address) for e in got] == [(2, b"b1"), (3, b"b2")] and (nxt, gap) == (
        3,
        False,
    )
    assert ring.read_ns(3, 10, 5) == ([], 3, False)
    assert ring.read_ns(4, 10, 5) == ([], 3, True)  # beyond its position: a gap
    assert ring.ns_position(9) == (0, 0) and ring.read_ns(0, 10, 9) == ([], 0, False)
    # A commit that moved the namespace's words and died before publishing: a reader takes
    # the entry before it, and a repair that drops the entry puts the words back.
    ring.begin(E.STORED, E.R_PUT, 5, b"b3", 99, 1)
    seq = ring.head + 1
    ring._nsw[2 * 5 + E.NS_LAST] = seq
    assert ring.ns_position(5) == (3, 6)
    ring._nsw[2 * 5 + E.NS_COUNT_WORD] = 4
    assert ring.ns_position(5) == (3, 6)
    ring.drop_pending()
    assert ring.ns_position(5) == (3, 6) and ring._nsw[2 * 5 + E.NS_COUNT_WORD] == 3


def test_a_namespace_reader_too_far_behind_or_lapped_gets_a_gap(slab_name):
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        s.setup_events(16)
        for i in range(12):
            s.put(f"a{i}", b"a", 2)
            s.delete(f"a{i}", 2)
        ring = s.events
        assert ring.ns_position(2)[0] == 24
        assert ring.read_ns(2, 5, 2)[2] is True  # its entries after 2 left the ring
        got, nxt, gap = ring.read_ns(20, 5, 2)
        assert [e.seq for e in got] == [21, 22, 23, 24] and (nxt, gap) == (24, False)
    finally:
        s.close()
        s.unlink()


def test_a_namespace_read_in_steps_walks_once_and_stops_at_a_lap(slab_name):
    """A tenant's long read is served a step at a time from ONE walk back along its links
    (each step re-walked them from the newest entry: 209 ms of CPU for a 10,000-event
    read); the steps add up to the one read, and a writer lapping the log between steps
    makes that step a gap, and the last."""
    s = Slab.create(slab_name, 64 * PAGE, page_size=PAGE, max_block_size=4 * PAGE)
    try:
        s.setup_events(256)
        for i in range(60):
            s.put(f"a{i}", b"a", 3)
            s.put(f"o{i}", b"o", 0)  # another namespace's entries between
        ring = s.events
        at = ring.ns_position(3)
        whole, nxt, gap = ring.read_ns(10, 40, 3, at)
        steps = list(ring.read_ns_steps(10, 40, 16, 3, at))
        assert [len(ev) for ev, _n, _g in steps] == [16, 16, 8]
        assert [n for _ev, n, _g in steps] == [26, 42, 50] and (nxt, gap) == (50, False)
        assert [e for ev, _n, _g in steps for e in ev] == whole
        assert [e.seq for e in whole] == list(range(11, 51))
        lapped = ring.read_ns_steps(10, 40, 16, 3, at)
        assert [e.seq for e in next(lapped)[0]] == list(range(11, 27))
        for i in range(300):  # the 256-entry log laps the rest of the read
            s.put(f"n{i}", b"n", 0)
        assert next(lapped) == ([], at[0], True) and next(lapped, None) is None
    finally:
        s.close()
        s.unlink()
