"""The disk tier's file on its own (eg_kv.disk): records written, scanned back after a
restart, and never believed when they do not prove themselves. A real file in a real
directory (O_DIRECT where the file system takes it); no server."""

from __future__ import annotations

import os
import stat

import pytest

from eg_kv.checksum import of as checksum_of
from eg_kv.disk import files
from eg_kv.disk import layout as D
from eg_kv.disk.index import DiskIndex, Entry
from eg_kv.disk.reader import read_block
from eg_kv.disk.scan import rebuild
from eg_kv.disk.store import DiskStore
from eg_kv.engine import EngineName
from eg_kv.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB


def _store(path, capacity=4 * MiB, max_block=256 * KiB) -> DiskStore:
    store = DiskStore(str(path), capacity, max_block)
    rebuild(store)
    return store


def _put(store: DiskStore, ns: str, address: str, data: bytes, quota: int = 0) -> Entry | None:
    def fill(view: memoryview) -> None:
        view[:] = data

    return store.append((ns, address), len(data), checksum_of(data), fill, quota=quota)


def _read(store: DiskStore, ns: str, address: str) -> bytes | None:
    e = store.index.find((ns, address))
    if e is None:
        return None
    fd, _ = files.open_data(store.path)
    try:
        got = read_block(fd, store.sb.key, e.offset, e.length, e.seq, ns, address)
    finally:
        os.close(fd)
    return None if got is None else got[0]


@pytest.fixture
def disk_dir(tmp_path):
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    return d


def test_records_come_back_after_a_restart_and_the_head_goes_on(disk_dir):
    blocks = {f"a{i}": os.urandom(1000 + 977 * i) for i in range(20)}
    store = _store(disk_dir)
    for address, data in blocks.items():
        assert _put(store, "", address, data) is not None
    engine = EngineName(b"h" * 32, b"p" * 32, 16, 3)
    hello = b"hello"
    store.append(("team", "e"), 5, checksum_of(hello), lambda v: v.__setitem__(slice(None), hello),
                 engine=engine)  # fmt: skip
    head, next_seq = store.index.head, store.index.next_seq
    store.close()

    again = _store(disk_dir)
    assert {a: _read(again, "", a) for a in blocks} == blocks
    assert _read(again, "team", "e") == b"hello"
    assert again.index.find(("team", "e")).engine == engine
    assert (again.index.head, again.index.next_seq) == (head, next_seq)
    again.close()


def test_the_ring_overwrites_the_oldest_first_and_a_scan_agrees(disk_dir):
    store = _store(disk_dir, capacity=1 * MiB)  # room for ~7 records of 128 KiB
    blocks = {f"b{i}": os.urandom(128 * KiB) for i in range(20)}
    for address, data in blocks.items():
        assert _put(store, "", address, data) is not None
    kept = [a for a in blocks if store.index.find(("", a))]
    assert kept == list(blocks)[-len(kept) :] and 5 <= len(kept) < 8  # the newest, in order
    assert store.counters["disk_evictions"] == 20 - len(kept)
    assert {a: _read(store, "", a) for a in kept} == {a: blocks[a] for a in kept}
    store.close()
    again = _store(disk_dir, capacity=1 * MiB)
    assert sorted(again.index.entries) == sorted(("", a) for a in kept)
    _put(again, "", "after", b"x" * 100)  # the head goes on where it was
    assert again.index.find(("", kept[0])) is None
    assert _read(again, "", kept[-1]) == blocks[kept[-1]]
    again.close()


def test_a_changed_byte_a_cut_file_and_a_stale_place_are_misses(disk_dir):
    store = _store(disk_dir)
    data = os.urandom(100 * KiB)
    e = _put(store, "", "victim", data)
    _put(store, "", "other", os.urandom(10 * KiB))
    name = os.path.join(store.path, D.DATA_FILE)
    with open(name, "r+b") as f:  # one byte of the block's bytes
        f.seek(e.offset + D.HEADER + 4321)
        byte = f.read(1)
        f.seek(e.offset + D.HEADER + 4321)
        f.write(bytes([byte[0] ^ 0x01]))
    assert _read(store, "", "victim") is None
    fd, _ = files.open_data(store.path)
    try:  # asked for under another name, or at another seq: no
        assert read_block(fd, store.sb.key, e.offset, e.length, e.seq, "", "other") is None
        assert read_block(fd, store.sb.key, e.offset, e.length, e.seq + 1, "", "victim") is None
    finally:
        os.close(fd)
    os.truncate(name, e.offset + D.HEADER + 10)
    assert _read(store, "", "other") is None  # beyond the end now
    store.close()


def test_a_header_inside_a_block_is_never_taken_for_a_record(disk_dir):
    """A client's bytes can hold a perfectly formed header (magic, fields): without the
    file's key its MAC fails, so a scan that steps through them finds nothing there."""
    store = _store(disk_dir)
    forged = bytearray(D.HEADER)
    D.pack_header(memoryview(forged), b"k" * D.KEY_SIZE, 999, 4, checksum_of(b"evil"), "", "x")
    payload = bytes(forged) + b"evil" + bytes(8192)
    e = _put(store, "", "carrier", payload)
    # Zero the carrier's own header, so a scan walks into its bytes.
    with open(os.path.join(store.path, D.DATA_FILE), "r+b") as f:
        f.seek(e.offset)
        f.write(bytes(D.HEADER))
    store.close()
    again = _store(disk_dir)
    assert again.index.entries == {}
    again.close()


def test_deleted_records_stay_deleted_after_a_restart(disk_dir):
    store = _store(disk_dir)
    _put(store, "", "gone", b"a" * 5000)
    _put(store, "", "kept", b"b" * 5000)
    assert store.delete(("", "gone")) and not store.delete(("", "gone"))
    store.close()  # waits for the header's zeroing
    again = _store(disk_dir)
    assert again.index.find(("", "gone")) is None and _read(again, "", "kept") == b"b" * 5000
    again.close()


def test_a_namespace_quota_bounds_its_bytes_on_disk(disk_dir):
    store = _store(disk_dir)
    for i in range(10):
        _put(store, "small", f"q{i}", os.urandom(10 * KiB), quota=35 * KiB)
        _put(store, "", f"free{i}", os.urandom(10 * KiB))
    assert store.index.ns_bytes["small"] <= 35 * KiB
    assert [a for (ns, a) in store.index.entries if ns == "small"] == ["q7", "q8", "q9"]
    assert store.index.ns_bytes[""] == 100 * KiB and store.counters["quota_drops"] == 7
    store.close()


def test_after_a_restart_a_quota_drops_the_oldest_records_first(disk_dir):
    """The scan adds records in file order: once the head has wrapped, the first are the
    newest, and a namespace's quota dropped its newest records and kept its oldest."""

    def put(store, address, quota=0):
        data = address.encode() * (60 * KiB // len(address))
        return store.append(("t", address), len(data), checksum_of(data),
                            lambda v: v.__setitem__(slice(None), data), quota=quota)  # fmt: skip

    store = _store(disk_dir, capacity=1 * MiB, max_block=64 * KiB)  # 15 records: 20 wrap
    for i in range(20):
        assert put(store, f"a{i:02d}") is not None
    oldest_first = [k[1] for k in sorted(store.index.entries,
                                         key=lambda k: store.index.entries[k].seq)]  # fmt: skip
    store.close()
    again = _store(disk_dir, capacity=1 * MiB, max_block=64 * KiB)
    try:
        put(again, "new", quota=again.index.ns_bytes["t"] - 2 * 60 * KiB)
        kept = [a for a in oldest_first if ("t", a) in again.index.entries]
        # the head's own overwrite takes the oldest; the quota then the next oldest two
        assert kept == oldest_first[3:] and again.counters["quota_drops"] == 2, kept
    finally:
        again.close()


def test_the_index_claims_in_order_and_wraps():
    idx = DiskIndex(D.FIRST + 10 * D.ALIGN)
    got = []
    for i in range(6):  # records of 2 aligned blocks (header + up to 4 KiB)
        offset, lost, _given_up = idx.claim(100)
        e = Entry(("", f"r{i}"), offset, 100, i + 1, 0)
        idx.ring.append(e)
        idx.add(e)
        got.append((offset, [x.key[1] for x in lost]))
    assert got == [(4096, []), (12288, []), (20480, []), (28672, []), (36864, []),
                   (4096, ["r0"])]  # fmt: skip
    assert idx.claim(20 * D.ALIGN) is None  # never fits: refused, nothing lost
    assert len(idx.entries) == 5


def test_a_directory_that_is_not_ours_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match=r"writable by others.*chmod go-w"):
        files.check_dir(str(open_dir))
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        files.check_dir(str(a_file))
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            files.check_dir(str(foreign))
    made = files.check_dir(str(tmp_path / "new" / "dir"))
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


def test_a_disk_without_room_is_refused_at_start(disk_dir):
    with pytest.raises(ConfigError, match=r"cannot reserve .*lower --disk-capacity"):
        files.make_data(str(disk_dir), 1 << 60)
    assert not os.path.exists(os.path.join(disk_dir, D.DATA_FILE))


def test_a_copy_superseded_by_newer_bytes_never_comes_back(disk_dir):
    """A block spilled twice (its bytes changed): the older record's header goes when
    the newer is indexed. Before, a DELETE zeroed the newer one only, and the scan after
    a restart served the older bytes of a deleted block."""
    store = _store(disk_dir)
    _put(store, "", "k", b"A" * 5000)
    _put(store, "", "k", b"B" * 5000)
    assert _read(store, "", "k") == b"B" * 5000
    assert store.delete(("", "k"))
    store.close()
    again = _store(disk_dir)
    assert again.index.find(("", "k")) is None
    again.close()


def test_records_a_wrap_gives_up_stay_gone_after_a_restart(disk_dir):
    """A wrap of the head gives up the tail past it: those records leave the index with
    their bytes still on disk. Their headers go too, or a scan would bring back a block
    deleted (or dropped) meanwhile."""
    store = _store(disk_dir, capacity=1 * MiB, max_block=1 * MiB)
    for i in range(5):  # the first lap: records 0-4 end near the end of the file
        assert _put(store, "", f"r{i}", os.urandom(200 * KiB)) is not None
    tail = store.index.find(("", "r4"))
    assert tail is not None
    assert _put(store, "", "wrap", os.urandom(200 * KiB)) is not None  # over r0
    assert _put(store, "", "big", os.urandom(600 * KiB)) is not None  # up to before r4
    assert store.index.head <= tail.offset and store.index.find(("", "r4")) is not None
    assert _put(store, "", "over", os.urandom(300 * KiB)) is not None  # wraps: r4 given up
    assert store.index.find(("", "r4")) is None
    assert not store.discard(("", "r4"))  # a DELETE now finds nothing to drop
    store.close()
    again = _store(disk_dir, capacity=1 * MiB, max_block=1 * MiB)
    assert again.index.find(("", "r4")) is None
    assert _read(again, "", "over") is not None
    again.close()


def test_a_listing_that_expired_ends_its_caller_and_never_starts_over(disk_dir, monkeypatch):
    """Past MAX_LISTINGS open listings the oldest goes; its next page is answered None
    (its caller ends, having said less). Before, it started a new snapshot from page 0:
    nine listers taking turns never finished, each sent the index again and again."""
    from eg_kv.disk import keeper as K
    from eg_kv.disk import wire
    from eg_kv.slab.store import Slab

    monkeypatch.setattr(wire, "LIST_PAGE", 1)
    slab = Slab.create(f"/eg-kv-test-listing-{os.getpid()}", 4 * MiB, 64 * KiB)
    store = None
    try:
        slab.setup_events(1024)
        store = _store(disk_dir)
        for i in range(3):
            _put(store, "", f"b{i}", b"x" * 100)
        keeper = K.Keeper(slab, store)
        first = keeper._list(None, 0)
        assert first is not None and not first[2]  # one page of three: open
        for _ in range(K.MAX_LISTINGS):  # as many more: the first is the oldest, it goes
            assert keeper._list(None, 0) is not None
        assert keeper._list(None, first[0]) is None
        assert len(keeper._listings) == K.MAX_LISTINGS
    finally:
        if store is not None:
            store.close()
        slab.close()
        slab.unlink()


def test_a_spill_of_a_block_deleted_while_it_was_written_is_not_indexed(disk_dir):
    """The DELETE's discard came while the spill of that block was being written (it
    found nothing to drop): the record must not be indexed after it, or the deleted
    block would be served from the disk. A later block of the address is spilled."""
    store = _store(disk_dir)

    def fill_while_deleted(view: memoryview) -> None:
        assert not store.discard(("", "k"), 7)  # slab block 7's last reference went
        view[:] = b"A" * 5000

    got = store.append(("", "k"), 5000, checksum_of(b"A" * 5000), fill_while_deleted, block=7)
    assert got is None and store.index.find(("", "k")) is None

    def fill(view: memoryview) -> None:
        view[:] = b"B" * 5000

    assert store.append(("", "k"), 5000, checksum_of(b"B" * 5000), fill, block=8) is not None
    assert _read(store, "", "k") == b"B" * 5000  # a later PUT of the address: kept
    store.close()
    again = _store(disk_dir)
    assert _read(again, "", "k") == b"B" * 5000
    again.close()


def test_a_discard_during_the_scan_stays_deleted_after_the_next_restart(disk_dir):
    """The slab's last reference of a block went while the keeper's scan ran: the record
    is dropped when the scan finds it, and its header goes too (before, the next
    restart's scan found it)."""
    store = _store(disk_dir)
    _put(store, "", "gone", b"g" * 5000)
    _put(store, "", "kept", b"k" * 5000)
    store.close()
    scanning = DiskStore(str(disk_dir), 4 * MiB, 256 * KiB)  # not scanned yet
    assert not scanning.discard(("", "gone"))  # not indexed yet: noted for the scan
    rebuild(scanning)
    assert scanning.index.find(("", "gone")) is None
    scanning.close()  # waits for the header's zeroing
    again = _store(disk_dir)
    assert again.index.find(("", "gone")) is None and _read(again, "", "kept") == b"k" * 5000
    again.close()


def test_a_delete_during_the_scan_is_unknown_not_a_miss_that_drops_every_reference(disk_dir):
    """A DELETE of a block only the disk holds, before the scan found its record: it was
    answered "not there" (a 404), and the scan then dropped the record with all its
    references. It is unknown now (the worker answers 503: retry), and once the scan has
    run it releases one reference of three."""
    data = b"d" * 5000
    store = _store(disk_dir)
    store.append(("", "d"), len(data), checksum_of(data), lambda v: v.__setitem__(
        slice(None), data), 3)  # fmt: skip
    store.close()
    scanning = DiskStore(str(disk_dir), 4 * MiB, 256 * KiB)  # not scanned yet
    assert scanning.delete(("", "d")) is None
    rebuild(scanning)
    assert scanning.index.find(("", "d")).refs == 3
    assert scanning.delete(("", "d")) is True and scanning.index.find(("", "d")).refs == 2
    scanning.close()


def test_a_delete_waits_for_a_promotion_being_committed_then_goes_to_the_slab(disk_dir):
    """Between the keeper telling a promotion its count and the worker's commit, a DELETE
    that missed the slab waits, then is sent back to the slab (the block is there now):
    the count told stays exact. Without a promotion it releases one reference on disk;
    a promotion never committed holds it back until the DELETE's deadline at most."""
    import asyncio
    import time

    from eg_kv.disk import keeper as K
    from eg_kv.disk import wire
    from eg_kv.slab.store import Slab

    slab = Slab.create(f"/eg-kv-test-promote-{os.getpid()}", 4 * MiB, 64 * KiB)
    store = None
    try:
        slab.setup_events(1024)
        store = _store(disk_dir)
        data = b"p" * 5000
        seq = store.append(("", "k"), len(data), checksum_of(data), lambda v: v.__setitem__(
            slice(None), data), 3).seq  # fmt: skip
        keeper = K.Keeper(slab, store)

        async def scenario() -> None:
            def deadline(s: float) -> float:
                return time.monotonic() + s

            assert await keeper._delete(("", "k"), deadline(1)) == 1  # no promotion: 3 -> 2
            assert keeper._promote(("", "k"), seq + 1) == [0, 0]  # not the indexed record
            refs, mark = keeper._promote(("", "k"), seq)
            assert refs == 2 and mark
            assert keeper._promote(("", "k"), seq) == [0, 0]  # one commit at a time
            waiting = asyncio.ensure_future(keeper._delete(("", "k"), deadline(0.9)))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiting.done()
            assert slab.put("k", data)  # the worker's commit
            assert keeper._count([wire.PROMOTED, 0, "", "k", mark + 1])  # not its mark
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiting.done()
            assert keeper._count([wire.PROMOTED, 0, "", "k", mark])
            assert await waiting == wire.IN_SLAB
            assert store.index.find(("", "k")).refs == 2  # untouched on disk
            assert slab.delete("k")  # (as the worker does on IN_SLAB)
            assert keeper._promote(("", "k"), seq)[0] == 2  # a promotion that never commits
            t0 = time.monotonic()
            assert await keeper._delete(("", "k"), deadline(0.2)) is None  # a 503
            assert time.monotonic() - t0 > 0.15
            assert store.index.find(("", "k")).refs == 2

        asyncio.run(scenario())
    finally:
        if store is not None:
            store.close()
        slab.close()
        slab.unlink()


@pytest.fixture
def keeper_on(disk_dir):
    """A keeper over a real slab (with its event log) and a real disk file: (slab, store,
    keeper); everything closed and unlinked after."""
    from eg_kv.disk import keeper as K
    from eg_kv.slab.store import Slab

    slab = Slab.create(f"/eg-kv-test-keeper-{os.getpid()}-{disk_dir.parent.name}", 4 * MiB,
                       64 * KiB)  # fmt: skip
    store = None
    try:
        slab.setup_events(1024)
        store = _store(disk_dir, capacity=16 * MiB, max_block=1 * MiB)
        yield slab, store, K.Keeper(slab, store)
    finally:  # unlinked whatever a failed test left mapped (a close then raises)
        try:
            if store is not None:
                store.close()
        finally:
            try:
                slab.close()
            finally:
                slab.unlink()


def _spill_with(keeper, monkeypatch, during) -> None:
    """Run the keeper's writer over what the log queued, calling ``during()`` once the
    record's bytes are written and before the slab is told (the window a DELETE or an
    eviction can fall in)."""
    real = files.pwrite_all
    called = []

    def pwrite_all(fd, views, offset):
        real(fd, views, offset)
        if not called:
            called.append(during())

    monkeypatch.setattr(files, "pwrite_all", pwrite_all)
    keeper.follow()
    keeper.spills.put(None)
    keeper.write_spills()
    monkeypatch.setattr(files, "pwrite_all", real)
    assert called


def test_a_delete_during_a_spill_lowers_the_disk_copys_count(keeper_on, monkeypatch):
    """PUT twice, one DELETE while the spill is written (its report finds no record yet):
    the copy counts 1 reference, not the 2 read before the write, so one more DELETE
    after an eviction removes it (it took two)."""
    import asyncio

    slab, store, keeper = keeper_on
    data = os.urandom(512 * KiB)
    slab.put("k", data)
    slab.put("k", data)

    def delete_one() -> None:
        slab.delete("k")
        assert keeper._count(["refs", 0, "", "k", slab.refs("k")])  # the worker's report

    _spill_with(keeper, monkeypatch, delete_one)
    assert store.index.find(("", "k")).refs == 1
    for i in range(12):  # the slab evicts it: a move, the disk copy stays
        slab.put(f"f{i}", os.urandom(512 * KiB))
    assert not slab.refs("k") and store.index.find(("", "k")) is not None
    assert asyncio.run(keeper._delete(("", "k"), 1e12)) == 1
    assert store.index.find(("", "k")) is None


def test_a_block_evicted_while_its_spill_is_written_leaves_the_disk_too(keeper_on, monkeypatch):
    """The eviction came before the slab was told of the copy, so the log says the block
    was removed: the disk must not keep it (it was served and listed, and its removal
    logged a second time when the disk dropped it)."""
    slab, store, keeper = keeper_on
    slab.put("x", os.urandom(16 * KiB))  # small: spilled from a copy, written after

    def evict() -> None:
        for i in range(1000):  # (a small block shares pages: it takes ~180 here)
            slab.put(f"f{i}", os.urandom(64 * KiB))
            if not slab.refs("x"):
                return
        raise AssertionError("x was never evicted")

    _spill_with(keeper, monkeypatch, evict)
    from eg_kv.slab.events import REMOVED

    kinds = [ev.kind for ev in slab.events.read(0, 1000)[0] if ev.address == b"x"]
    assert kinds[-1] == REMOVED, kinds
    assert store.index.find(("", "x")) is None and store.counters["spill_drops"] >= 1
    store.zeroed().result(timeout=30)  # once the header's zeroing is written
    again = _store(store.path, capacity=16 * MiB, max_block=1 * MiB)
    try:
        assert again.index.find(("", "x")) is None  # its header went too
    finally:
        again.close()


def test_a_delete_is_answered_once_its_header_is_gone_from_the_file(keeper_on):
    """The keeper answers a DISCARD or a disk-only DELETE after the record's header is
    zeroed, not when it is queued behind a spill's write: a keeper killed after the
    answer must not find the block at its next scan."""
    import asyncio

    _, store, keeper = keeper_on
    for address in ("d", "e"):
        assert _put(store, "", address, b"z" * 5000) is not None

    async def scenario() -> tuple[list[bool], list[int]]:
        done, tasks = [], []
        with store.io:  # a spill's write holds the file
            for op, args in (("discard", ["", "d", 0]), ("delete", ["", "e", 1 << 62])):
                tasks.append(asyncio.ensure_future(keeper._do(op, args)))
                await asyncio.sleep(0.2)
                done.append(tasks[-1].done())
                assert store.index.find(("", args[1])) is None  # the index let it go
        return done, await asyncio.gather(*tasks)

    done, answers = asyncio.run(scenario())
    assert done == [False, False] and answers == [True, 1]  # answered once written
    scanned = _store(store.path, capacity=16 * MiB, max_block=1 * MiB)  # a restart's scan
    try:
        assert scanned.index.find(("", "d")) is None and scanned.index.find(("", "e")) is None
    finally:
        scanned.close()


def test_a_delete_is_answered_before_its_worker_stops_waiting_whatever_the_zeroing(keeper_on):
    """A spill's write can hold the file longer than a worker waits for the keeper (0.5 s):
    the answer waited for the zeroing and came too late, the worker answered 503 for a
    reference released, and the client's retry released a second one."""
    import asyncio
    import time

    _, store, keeper = keeper_on
    data = b"r" * 5000
    store.append(("", "r"), len(data), checksum_of(data), lambda v: v.__setitem__(
        slice(None), data), 2)  # fmt: skip
    store.append(("", "s"), len(data), checksum_of(data), lambda v: v.__setitem__(
        slice(None), data), 1)  # fmt: skip

    async def scenario() -> list[tuple[object, float]]:
        out = []
        with store.io:  # a long spill's write
            for address in ("r", "s"):  # a reference of two; the last of one
                t0 = time.monotonic()
                deadline_ms = int((t0 + 0.5) * 1000)
                answer = await keeper._do("delete", ["", address, deadline_ms])
                out.append((answer, time.monotonic() - t0))
        return out

    (r_answer, r_took), (s_answer, s_took) = asyncio.run(scenario())
    assert (r_answer, s_answer) == (1, 1) and r_took < 0.1  # nothing to zero: at once
    assert s_took < 0.45, s_took  # before the worker's 0.5 s
    assert store.index.find(("", "r")).refs == 1 and store.index.find(("", "s")) is None


_FAILING_SCAN = """
import asyncio, errno, os, sys
from eg_kv.disk import scan
from eg_kv.disk.keeper import Keeper
from eg_kv.disk.store import DiskStore
from eg_kv.slab.store import Slab

def bad_sector(*args):  # what a read error of the disk does to the scan
    raise OSError(errno.EIO, "Input/output error")

scan._records = bad_sector
slab = Slab.attach(sys.argv[1])
store = DiskStore(sys.argv[2], 16 * 1024 * 1024, 1024 * 1024)
store.sb = store.sb._replace(high_water=store.capacity)  # a file written to its end
print("running", flush=True)
asyncio.run(Keeper(slab, store).run(lambda: False))
"""


def test_a_keeper_whose_scan_fails_exits_to_be_started_again(disk_dir):
    """A rebuild that raised (a bad sector) left the keeper running and never ready, for
    good: nothing spilled again, DELETEs of disk-only blocks 503 forever. It exits now,
    saying why (the supervisor starts another)."""
    import subprocess
    import sys

    from eg_kv.slab.store import Slab

    slab = Slab.create(f"/eg-kv-test-scanfail-{os.getpid()}", 4 * MiB, 64 * KiB)
    try:
        slab.setup_events(1024)
        _store(disk_dir, capacity=16 * MiB, max_block=1 * MiB).close()
        out = subprocess.run([sys.executable, "-c", _FAILING_SCAN, slab.name, str(disk_dir)],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        assert out.stdout.startswith("running") and out.returncode == 1, out.stderr[-2000:]
        assert "the index rebuild failed ([Errno 5] Input/output error)" in out.stderr
    finally:
        slab.close()
        slab.unlink()


def test_adopt_holds_the_address_until_the_put_says_it_is_done(keeper_on):
    """ADOPT is asked before a PUT publishes its block: a copy that stands (the same
    bytes, or the same length) is marked until the PUT's ``promoted`` with its mark id,
    which brings its reference to the copy; meanwhile a DELETE waits (then goes to the
    slab, where the block now is), a promotion is declined, and another ADOPT is told
    BUSY after ``ADOPT_WAIT_S``. Only the holder's mark id ends the mark (a declined
    promotion's ``promoted`` ended the PUT's). No copy, or one of another length, marks
    nothing; a block the slab holds is RESIDENT; an answer due past the worker's
    deadline is BUSY and leaves no mark."""
    import asyncio
    import time

    from eg_kv.disk import wire

    slab, store, keeper = keeper_on
    data, other = os.urandom(5000), os.urandom(5000)
    key = ("", "k")
    store.append(key, len(data), checksum_of(data), lambda v: v.__setitem__(slice(None), data),
                 2)  # fmt: skip

    async def scenario() -> None:
        def adopt(checksum: int, length: int = 5000, deadline: float = 0.5):
            return keeper._adopt(key, checksum, length, time.monotonic() + deadline)

        assert await keeper._adopt(("", "absent"), 1, 10, time.monotonic() + 1) == [
            wire.NEW, 0, 0, 0]  # fmt: skip
        assert await adopt(checksum_of(data), 4000) == [wire.CONFLICT, 5000, 0, 0]
        assert await adopt(checksum_of(data), deadline=0.05) == [wire.BUSY, 0, 0, 0]  # late
        assert not keeper._committing
        verdict, refs, mark, record = await adopt(checksum_of(data))
        assert (verdict, refs, record) == (wire.SAME, 2, store.index.find(key).seq) and mark
        waiting = asyncio.ensure_future(keeper._delete(key, time.monotonic() + 1.5))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        t0 = time.monotonic()
        assert await adopt(checksum_of(data)) == [wire.BUSY, 0, 0, 0]
        assert time.monotonic() - t0 >= wire.ADOPT_WAIT_S * 0.9
        assert keeper._promote(key, store.index.find(key).seq) == [0, 0]  # declined
        assert keeper._count([wire.PROMOTED, 0, "", "k", 0])  # (what a declined one sent)
        assert keeper._count([wire.PROMOTED, 0, "", "k", mark + 1, 1])  # not its mark
        assert not waiting.done() and store.index.find(key).refs == 2
        slab.put("k", data)  # the PUT's publish (with the copy's two and its own)
        assert keeper._count([wire.PROMOTED, 0, "", "k", mark, 1])
        assert store.index.find(key).refs == 3
        assert await waiting == wire.IN_SLAB
        assert await adopt(checksum_of(other)) == [wire.RESIDENT, 0, 0, 0]
        assert slab.delete("k")
        verdict, refs, mark, _ = await adopt(checksum_of(other))
        assert (verdict, refs) == (wire.OTHER, 3) and mark
        keeper._count([wire.PROMOTED, 0, "", "k", mark, 1])  # the copy stands, with its ref
        assert store.index.find(key).refs == 4 and not keeper._committing

    asyncio.run(scenario())


def test_a_spill_of_other_bytes_never_replaces_a_copy_the_disk_holds(disk_dir):
    """A block of other bytes under an address whose copy the disk holds from an earlier
    block (a PUT whose ADOPT came before that copy was indexed; before ADOPT was asked
    ahead of the publish, any PUT of other bytes): a spill of it replaced the copy in the
    index (seen in 2 of 35 runs of the server test under load: a GET got the PUT's
    bytes, or the copy's references were lost and a DELETE got 404). A spill never
    replaces a copy of other bytes from an earlier block."""
    old, new = os.urandom(4000), os.urandom(4000)
    store = _store(disk_dir)
    try:
        fill_old = lambda v: v.__setitem__(slice(None), old)  # noqa: E731
        fill_new = lambda v: v.__setitem__(slice(None), new)  # noqa: E731
        held = store.append(("t", "a"), len(old), checksum_of(old), fill_old, refs=2, block=5)
        assert held is not None
        assert store.append(("t", "a"), len(new), checksum_of(new), fill_new, block=9) is None
        assert store.index.find(("t", "a")) is held and _read(store, "t", "a") == old
        # The same bytes from a later block may take its place (the keeper skips those).
        again = store.append(("t", "a"), len(old), checksum_of(old), fill_old, block=9)
        assert again is not None and _read(store, "t", "a") == old
    finally:
        store.close()


def test_a_keepers_start_keeps_the_marks_of_copies_it_holds(keeper_on):
    """At its start the keeper clears the slab's marks of copies its index lacks (a data
    file made anew). A promoted block's mark, and a spilled one's, name a record the
    index holds: both stay (a promoted block's record was read from the LoRA id's field,
    so every keeper restart cleared its mark, and its eviction was logged a removal
    while the disk held it); a mark naming a record the index lacks goes."""
    slab, store, keeper = keeper_on
    data = os.urandom(5000)
    fill = lambda v: v.__setitem__(slice(None), data)  # noqa: E731
    promoted = store.append(("", "p"), len(data), checksum_of(data), fill)
    spilled = store.append(("", "s"), len(data), checksum_of(data), fill)
    h = slab.begin_put("p", len(data), engine=EngineName(b"h" * 32, b"", 16, 2))
    h.write(data)
    h.record = promoted.seq
    assert h.commit() is True
    assert slab.put("s", data) and slab.put("lost", data)
    _, ids = slab.block_ids(["s", "lost"])
    assert slab.mark_spilled("s", 0, ids[0], spilled.seq) == 1
    assert slab.mark_spilled("lost", 0, ids[1], spilled.seq + 100) == 1
    assert keeper._unmark_lost() == 1
    assert sorted(m[1] for m in slab.spilled_marks()) == ["p", "s"]


def test_the_keepers_filter_rules_out_only_what_no_record_holds(disk_dir):
    """Workers read the keeper's filter (DIR/filter) instead of asking it about blocks no
    record holds. It says "absent" only for keys the index lacks, and only once the index
    is rebuilt: a key indexed, superseded, or sharing a count with another is never
    "absent"; one removed is again. A keeper started again makes it untrusted until its
    scan is done, for the workers that mapped it before too."""
    from eg_kv.disk import keyfilter
    from eg_kv.keyfilter import FilterReader

    reader = FilterReader(str(disk_dir))
    store = DiskStore(str(disk_dir), 4 * MiB, 256 * KiB)
    try:
        assert reader.absent("", ["a"]) == [False]  # not made yet, or not ready
        reader._next_look = 0.0
        assert reader.absent("", ["a"]) == [False]  # made, but the scan has not run
        rebuild(store)
        names = [f"k{i}" for i in range(200)]
        assert all(reader.absent("", names)) and all(reader.absent("t", names))
        kept = [_put(store, "", n, os.urandom(100)) for n in names[:100]]
        assert all(kept) and _put(store, "t", "k0", b"t's") is not None
        assert reader.absent("", names) == [False] * 100 + [True] * 100
        assert reader.absent("t", ["k0", "k1"]) == [False, True]  # namespaces apart
        assert _put(store, "", "k5", os.urandom(100)) is not None  # a newer copy
        assert reader.absent("", ["k5"]) == [False]
        for n in names[:50]:
            store.index.remove(("", n))
        assert reader.absent("", names[:100]) == [True] * 50 + [False] * 50
        # Two keys of one count: removing one leaves the other counted.
        mask = store.filter.mask
        slot = keyfilter.slot_of("", "k60", mask)
        twin = next(f"x{i}" for i in range(10**6) if keyfilter.slot_of("", f"x{i}", mask) == slot)
        assert reader.absent("", [twin]) == [False]  # k60's count: ask the keeper
        assert _put(store, "", twin, b"twin") is not None
        store.index.remove(("", twin))
        assert reader.absent("", ["k60", twin]) == [False, False]
    finally:
        store.close()
    again = DiskStore(str(disk_dir), 4 * MiB, 256 * KiB)  # the keeper started again
    try:
        assert reader.absent("", ["k99", "k150"]) == [False, False]  # until its scan
        rebuild(again)
        # (k10's record is still in the file: the index alone forgot it, and the scan
        # found it again.)
        assert reader.absent("", ["k99", "k150", "k10"]) == [False, True, False]
    finally:
        again.close()
    # The file removed under a running server: the next keeper makes another, and the
    # workers map it (the old one's counts, frozen, would rule out what it holds now).
    os.unlink(disk_dir / keyfilter.FILE)
    third = DiskStore(str(disk_dir), 4 * MiB, 256 * KiB)
    try:
        rebuild(third)
        assert _put(third, "", "k150", b"new") is not None
        reader._next_look = 0.0
        assert reader.absent("", ["k150", "k151"]) == [False, True]
    finally:
        third.close()
        reader.close()


def test_the_filter_takes_its_room_when_the_server_starts(disk_dir):
    """Made with its space allocated (written later through a mapping, a page with no
    room behind it killed the keeper with SIGBUS), generation 0: workers ask the keeper
    until it has filled it."""
    from eg_kv.disk import keyfilter
    from eg_kv.keyfilter import FilterReader

    keyfilter.make(str(disk_dir), 64 * MiB)
    st = os.stat(disk_dir / keyfilter.FILE)
    assert st.st_size == keyfilter.COUNTS_OFFSET + keyfilter.slots_for(64 * MiB)
    assert st.st_blocks * 512 >= st.st_size and st.st_mode & 0o077 == 0
    reader = FilterReader(str(disk_dir))
    try:
        assert reader.absent("", ["a"]) == [False]
    finally:
        reader.close()


def test_a_client_trusts_only_a_filter_of_the_servers_user_that_no_one_else_may_write(disk_dir):
    """A client on the host maps the filter the server names only if the server's user
    owns it and neither group nor others may write it: any other file could say "absent"
    of blocks the disk holds (a miss then, never wrong bytes, but misses all the same)."""
    from eg_kv.disk import keyfilter
    from eg_kv.keyfilter import FilterReader

    w = keyfilter.FilterWriter(str(disk_dir), 4 * MiB)
    w.ready()
    name = disk_dir / keyfilter.FILE
    readers = []
    try:
        me = os.geteuid()
        trusted = FilterReader(str(disk_dir), uid=me)
        readers.append(trusted)
        assert trusted.absent("", ["a"]) == [True]
        other_user = FilterReader(str(disk_dir), uid=me + 1)
        readers.append(other_user)
        assert other_user.absent("", ["a"]) == [False]  # asks the server
        for mode in (0o620, 0o602):
            os.chmod(name, mode)
            reader = FilterReader(str(disk_dir), uid=me)
            readers.append(reader)
            assert reader.absent("", ["a"]) == [False], oct(mode)
        os.chmod(name, 0o640)  # others may read it: nothing they can change
        reader = FilterReader(str(disk_dir), uid=me)
        readers.append(reader)
        assert reader.absent("", ["a"]) == [True]
    finally:
        for reader in readers:
            reader.close()
        w.close()


def test_a_filter_count_saturates_and_stays(disk_dir):
    """A count at 255 stays (it may count more than 255 keys): never "absent" again
    until the keeper starts anew."""
    from eg_kv.disk import keyfilter
    from eg_kv.keyfilter import FilterReader

    w = keyfilter.FilterWriter(str(disk_dir), 4 * MiB)
    reader = FilterReader(str(disk_dir))
    try:
        w.ready()
        key = ("", "hot")
        for _ in range(300):
            w.add(key)
        for _ in range(300):
            w.remove(key)
        assert reader.absent("", ["hot"]) == [False]
        assert os.stat(disk_dir / keyfilter.FILE).st_mode & 0o077 == 0
    finally:
        reader.close()
        w.close()
