"""Unit tests of the slab: every operation and every error, on a real shared segment."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import posix_ipc
import pytest

from eg_kv.address import all_valid, fingerprint
from eg_kv.errors import (
    BadRequest,
    Busy,
    Conflict,
    InsufficientStorage,
    InvalidAddress,
    SlabError,
    TooLarge,
)
from eg_kv.procs import pid_alive
from eg_kv.slab import layout as L
from eg_kv.slab import segment as slab_module
from eg_kv.slab.store import EVICT_AHEAD, BlockGone, Slab

KiB, MiB = 1024, 1024 * 1024
PAGE = 64 * KiB


def data(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)


# ---------------------------------------------------------------- lifecycle


def test_create_attach_share_close_unlink(slab_name):
    a = Slab.create(slab_name, 2 * MiB, page_size=PAGE, max_block_size=MiB)
    b = Slab.attach(slab_name)
    assert a.put("x", data(1000)) is True
    assert b.get("x") == data(1000)
    assert b.geometry == a.geometry
    assert b.owner_pid == os.getpid()
    b.close()
    b.close()  # idempotent
    a.unlink()
    assert not Slab.exists_named(slab_name)
    assert a.get("x") == data(1000)  # an unlinked segment stays mapped where it is attached
    a.close()
    with pytest.raises(SlabError, match="start the server"):
        Slab.attach(slab_name)


def test_a_name_without_its_slash_is_the_same_segment_and_unlinks(slab_name):
    # shm_open drops the leading slash, but /dev/shm paths need it: a slash-less name was
    # created and never unlinked (the server left its three segments after every stop).
    bare = slab_name.lstrip("/")
    a = Slab.create(bare, 2 * MiB, page_size=PAGE, max_block_size=MiB)
    assert a.name == slab_name
    with Slab.attach(bare) as b:
        assert b.slab_id == a.slab_id
    a.close()
    assert a.unlink() is True
    assert not os.path.exists("/dev/shm" + slab_name)
    assert not os.path.exists("/dev/shm" + slab_module.readers_name(slab_name))


@pytest.mark.parametrize("name", ["", "/", "a/b", "/a/b", "/..", "x" * 300])
def test_a_bad_name_is_refused_before_anything_is_created(name):
    with pytest.raises(SlabError, match="bad slab name"):
        Slab.create(name, 2 * MiB, page_size=PAGE)


def test_create_refuses_existing_name(slab):
    with pytest.raises(SlabError, match=r"exists already.*--fresh"):
        Slab.create(slab.name, 2 * MiB)


def test_attach_refuses_foreign_segment(slab_name):
    shm = posix_ipc.SharedMemory(slab_name, posix_ipc.O_CREX, size=8192)
    os.pwrite(shm.fd, b"NOTOURS!" + bytes(100), 0)
    shm.close_fd()
    with pytest.raises(SlabError, match="not an eg-kv slab"):
        Slab.attach(slab_name)


def test_attach_refuses_other_layout_version(slab):
    os.pwrite(slab._fd, (L.VERSION + 1).to_bytes(4, "little"), 8)
    with pytest.raises(SlabError, match=r"layout version.*--fresh"):
        Slab.attach(slab.name)


def test_create_checks_shm_room_first(slab_name):
    with pytest.raises(SlabError, match=r"free but the slab needs.*lower --capacity"):
        Slab.create(slab_name, 1 << 50)
    assert not Slab.exists_named(slab_name)


@pytest.mark.parametrize("page", [1000, 2048, 3 * 4096])
def test_page_size_must_be_power_of_two(slab_name, page):
    with pytest.raises(SlabError, match="power of two"):
        Slab.create(slab_name, 2 * MiB, page_size=page)


def test_header_records_geometry_and_prefaults(slab):
    magic, version, g = L.Geometry.unpack(bytes(slab._mm[: L.GEOMETRY.size]))
    assert (magic, version) == (L.MAGIC, L.VERSION)
    assert g == slab.geometry
    assert g.npages == 4 * MiB // PAGE and g.nslots >= 2 * g.npages
    assert g.data_off % 4096 == 0 and g.total_size == g.data_off + g.npages * PAGE
    st = os.fstat(slab._fd)
    assert st.st_blocks * 512 >= g.total_size  # every byte allocated up front: no SIGBUS later


# ---------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "address", ["a", "Z9", "model@0100@0@" + "f" * 64, "a.b_c:d@e+f=g-h", "x" * 256]
)
def test_valid_addresses(slab, address):
    assert slab.put(address, b"v") is True
    assert slab.get(address) == b"v"


@pytest.mark.parametrize(
    "address", ["", "x" * 257, "a/b", "a b", "é", "a\n", "a?b", "%2F", "stats", "batch", "exists"]
)
def test_invalid_addresses_are_rejected_everywhere(slab, address):
    for op in (slab.exists, slab.get, slab.delete, slab.length, lambda a: slab.put(a, b"v")):
        with pytest.raises(InvalidAddress):
            op(address)
    assert slab.stats()["unique_blocks"] == 0
    # A batch checked in one match (eg_kv.address.all_valid) says the same, wherever the
    # bad one lies: alone, first, last, or joined to a good one by its own newline.
    good = ["a", "k" + "0" * 40]
    for batch in ([address], [address, *good], [*good, address], [f"a\n{address}"]):
        assert not all_valid(batch), batch
    assert all_valid(good)


# ---------------------------------------------------------------- put


def test_put_creates_then_dedups_across_handles(slab):
    other = Slab.attach(slab.name)
    try:
        assert slab.put("blk", data(200 * KiB)) is True
        assert other.put("blk", data(200 * KiB)) is False
        assert slab.put("blk", data(200 * KiB)) is False
        st = slab.stats()
        assert (st["unique_blocks"], st["total_refs"], st["dedup_hits"]) == (1, 3, 2)
        assert st["resident_bytes"] == 200 * KiB
        assert st["logical_bytes"] == 600 * KiB
        assert st["dedup_savings_bytes"] == 400 * KiB
    finally:
        other.close()


def test_streaming_put_in_odd_chunks(slab):
    body = data(300 * KiB + 7, seed=3)
    h = slab.begin_put("s", len(body))
    for i in range(0, len(body), 9999):
        h.write(body[i : i + 9999])
    assert h.commit() is True
    assert slab.get("s") == body


def test_put_of_other_length_conflicts(slab):
    slab.put("c", b"abc")
    with pytest.raises(Conflict, match="resident with 3 bytes, not 4"):
        slab.put("c", b"abcd")
    assert slab.get("c") == b"abc"
    assert slab.stats()["total_refs"] == 1


def test_concurrent_new_puts_one_creates_other_dedups(slab):
    h1 = slab.begin_put("race", 5000)
    h2 = slab.begin_put("race", 5000)
    h1.write(data(5000))
    h2.write(data(5000))
    assert not slab.exists("race")  # nothing is visible before a commit
    assert h2.commit() is True
    assert h1.commit() is False
    st = slab.stats()
    assert (st["unique_blocks"], st["total_refs"], st["reserved_pages"]) == (1, 2, 0)
    assert slab.check() == []


def test_abort_and_short_body_publish_nothing_and_return_pages(slab):
    free0 = slab.stats()["free_bytes"]
    h = slab.begin_put("a", 200 * KiB)
    assert slab.stats()["free_bytes"] == free0 - 4 * PAGE
    h.write(data(100 * KiB))
    with pytest.raises(BadRequest, match="cut short: 102400 of 204800"):
        h.commit()
    h.abort()  # idempotent
    assert not slab.exists("a")
    with pytest.raises(BadRequest, match="longer than its announced length"):
        slab.begin_put("b", 10).write(b"x" * 11)
    slab.begin_put("c", 10).abort()
    st = slab.stats()
    assert st["free_bytes"] == free0 - PAGE and st["reserved_pages"] == 1  # "b" still open
    assert slab.check() == []


def test_too_large_is_refused_before_anything_is_stored(slab):
    free0 = slab.stats()["free_bytes"]
    with pytest.raises(TooLarge, match="over the maximum block size"):
        slab.begin_put("big", slab.max_block_size + 1)
    with pytest.raises(BadRequest, match="empty block"):
        slab.begin_put("empty", 0)
    assert slab.stats()["free_bytes"] == free0


def test_insufficient_storage_when_uploads_hold_the_room(slab):
    handles = [slab.begin_put(f"h{i}", MiB) for i in range(4)]  # all 4 MiB reserved
    with pytest.raises(InsufficientStorage, match="held by uploads in flight"):
        slab.put("one-more", b"x")
    handles[0].abort()
    assert slab.put("one-more", b"x") is True
    for h in handles[1:]:
        h.abort()


def test_reservation_table_never_fills_before_the_pages(slab_name):
    """One entry per page: 2,048 one-page puts in flight (the old table held 1,024) all
    reserve, and the next one finds no room (507), not a full table (503)."""
    with Slab.create(slab_name, 8 * MiB, page_size=4 * KiB, max_block_size=MiB) as s:
        assert s.geometry.nresv == s.geometry.npages + L.DEDUP_ENTRIES == 2048 + 4096
        handles = [s.begin_put(f"p{i}", 4 * KiB) for i in range(2048)]
        with pytest.raises(InsufficientStorage):
            s.begin_put("one-more", 4 * KiB)
        assert s.stats()["reserved_pages"] == 2048 and s.check() == []
        for h in handles[::2]:
            h.abort()
        handles = [s.begin_put(f"q{i}", 4 * KiB) for i in range(1024)]  # entries reused
        assert s.check() == []


def test_upload_share_bounds_what_puts_in_flight_hold(slab):
    """Half of the 4 MiB slab for uploads in flight: the third 1 MiB put is told to retry,
    small puts still find room, and one upload alone may be larger than the share."""
    handles = [slab.begin_put(f"h{i}", MiB, upload_share=0.5) for i in range(2)]
    with pytest.raises(Busy, match=r"--upload-share 0.5"):
        slab.begin_put("third", MiB, upload_share=0.5)
    assert slab.put("small", data(1000)) is True
    for h in handles:
        h.abort()
    alone = slab.begin_put("alone", MiB, upload_share=0.2)  # 16 pages, over a share of 12
    with pytest.raises(Busy):
        slab.begin_put("next", 100 * KiB, upload_share=0.2)
    alone.write(data(MiB))
    assert alone.commit() is True
    assert slab.stats()["reserved_pages"] == 0 and slab.check() == []


def test_add_ref_counts_a_dedup_hit_from_the_headers(slab):
    assert slab.add_ref("absent", 10) == 0
    slab.put("here", data(300 * KiB))
    block_id = slab.add_ref("here", 300 * KiB)  # the block's id, for take_back_ref
    assert block_id > 0
    with pytest.raises(Conflict, match="resident with 307200 bytes, not 5"):
        slab.add_ref("here", 5)
    st = slab.stats()
    assert (st["total_refs"], st["dedup_hits"], st["logical_bytes"]) == (2, 1, 600 * KiB)
    # The server's hits are counted once answered (hit=False, then count_dedup_hit): two
    # taken back (their answers never went out) count nothing, and nothing goes back. One
    # named a block replaced meanwhile (no reference goes), one this block (its own does).
    taken = [slab.add_ref("here", 300 * KiB, hit=False) for _ in range(3)]
    assert taken == [block_id] * 3 and slab.stats()["dedup_hits"] == 1
    slab.take_back_ref("here", block_id + 1)
    slab.take_back_ref("here", block_id)
    slab.count_dedup_hit()  # the third's answer went out
    st = slab.stats()
    assert (st["total_refs"], st["dedup_hits"], st["deletes"]) == (4, 2, 0)


def test_a_promotion_is_published_with_all_its_references_at_once(slab):
    """A block read back from the disk tier comes with its copy's references. Published
    with one and given the others a moment later, a DELETE on another worker in between
    took the only one: the block went, and its copy with the others' references. The
    handle names them, and they are published in the same step (none a dedup hit)."""
    body = data(100 * KiB)
    h = slab.begin_put("promoted", len(body))
    h.write(body)
    h.record, h.refs = 7, 3
    assert h.commit() is True
    assert slab.refs("promoted") == 3 and slab.spilled("promoted")
    st = slab.stats()
    assert (st["total_refs"], st["logical_bytes"], st["dedup_hits"]) == (3, 300 * KiB, 0)
    for left in (2, 1, 0):
        assert slab.delete("promoted") and slab.refs("promoted") == left
    assert slab.stats()["total_refs"] == 0 and slab.check() == []


def test_a_put_that_joins_the_disks_copy_is_published_as_on_disk(slab):
    """A PUT of bytes the disk tier holds (its ADOPT said SAME) is published with the
    copy's references and its own, and its slot names the copy's record at once: its
    eviction is then a move, not a removal (unmarked, it waited for the keeper's next
    spill of it). Unlike a promotion, it is no block created, and it brings its
    reference to a block stored meanwhile."""
    body = data(100 * KiB)
    created = slab.stats()["puts_created"]
    h = slab.begin_put("joined", len(body))
    h.write(body)
    h.joined, h.refs = 9, 3
    assert h.commit() is True
    assert slab.refs("joined") == 3 and slab.spilled("joined")
    assert [m[1:] for m in slab.spilled_marks()] == [("joined", len(body), 9)]
    assert slab.stats()["puts_created"] == created
    h = slab.begin_put("meanwhile", len(body))
    h.write(body)
    h.joined, h.refs = 9, 3
    assert slab.put("meanwhile", body)  # another PUT published it first
    assert h.commit() is False and slab.refs("meanwhile") == 2  # a dedup hit: its reference


def test_a_small_put_asks_before_it_creates_a_block(slab):
    """``new_ok`` (the disk tier's check that no copy was spilled since the caller read
    its filter) is asked under the lock before a small block is created: no, and the put
    is a 503 that stores nothing; a dedup hit does not ask."""
    from eg_kv.errors import Busy

    asked = []

    def refuse() -> bool:
        asked.append(1)
        return False

    with pytest.raises(Busy):
        slab.put("small", b"x" * 100, new_ok=refuse)
    assert asked == [1] and not slab.exists("small") and slab.check() == []
    assert slab.put("small", b"x" * 100, new_ok=lambda: True) is True
    assert slab.put("small", b"x" * 100, new_ok=refuse) is False and asked == [1]
    assert slab.refs("small") == 2
    # A streamed put asks the same of its commit; no, and its pages go back.
    free = slab.stats()["free_bytes"]
    h = slab.begin_put("large", 300 * KiB)
    h.write(data(300 * KiB))
    h.new_ok = refuse
    with pytest.raises(Busy):
        h.commit()
    h.abort()
    assert asked == [1, 1] and not slab.exists("large")
    assert slab.stats()["free_bytes"] == free and slab.check() == []


def test_streamed_dedup_hit_takes_its_reference_at_once_and_back_on_abort(slab):
    """Its reference at once; its count when it ends, so an abort takes nothing counted
    back (dedup_hits went back, a reset to Prometheus)."""
    slab.put("d", data(200 * KiB))
    h = slab.begin_put("d", 200 * KiB)  # the hit counts once the put ends
    assert h.dedup and slab.stats()["total_refs"] == 2 and slab.stats()["dedup_hits"] == 0
    h.write(data(100 * KiB))
    with pytest.raises(BadRequest, match="cut short"):
        h.commit()  # aborts: the reference goes back
    st = slab.stats()
    assert (st["total_refs"], st["dedup_hits"], st["reserved_pages"]) == (1, 0, 0)
    # Evicted (deleted here) and stored anew while the dedup body arrived: the abort must
    # not take a reference of the new block.
    h = slab.begin_put("d", 200 * KiB)
    assert slab.delete("d") and slab.delete("d")
    slab.put("d", data(200 * KiB, seed=1))
    h.abort()
    st = slab.stats()
    assert (st["unique_blocks"], st["total_refs"], st["dedup_hits"]) == (1, 1, 0)
    # A completed dedup hit stores nothing and keeps its reference.
    h = slab.begin_put("d", 200 * KiB)
    h.write(b"anything: the address names the content".ljust(200 * KiB))
    assert h.commit() is False
    assert slab.get("d") == data(200 * KiB, seed=1)
    assert (slab.stats()["total_refs"], slab.stats()["dedup_hits"]) == (2, 1)
    assert slab.check() == []


def test_prefault_of_an_attached_slab_never_writes(slab, monkeypatch):
    """Without MADV_POPULATE_WRITE (forced here with an advice the kernel rejects), the
    fallback faults an attached slab in by reading, never by writing zeros into it."""
    blocks = {f"b{i}": bytes([0xA5 + i]) * (300 * KiB) for i in range(4)}
    for address, block in blocks.items():
        slab.put(address, block)
    monkeypatch.setattr(slab_module, "_MADV_POPULATE_WRITE", 0x7FFF)
    with Slab.attach(slab.name, prefault=True) as other:
        for address, block in blocks.items():
            assert other.get(address) == block
    assert slab.check() == []


def test_is_eg_kv_segment(slab, slab_name):
    assert Slab.is_eg_kv_segment(slab.name)
    assert not Slab.is_eg_kv_segment(slab_name + "-none")
    shm = posix_ipc.SharedMemory(slab_name + "-x", posix_ipc.O_CREX, size=8192)
    try:
        os.pwrite(shm.fd, b"NOTOURS!", 0)
        assert not Slab.is_eg_kv_segment(slab_name + "-x")
    finally:
        shm.close_fd()
        Slab.unlink_named(slab_name + "-x")


# ---------------------------------------------------------------- get / exists / delete


def test_get_exists_length_and_counters(slab):
    assert slab.get("nope") is None
    slab.put("k", data(70 * KiB))
    assert slab.exists("k") and slab.length("k") == 70 * KiB
    assert not slab.exists("nope") and slab.length("nope") is None
    assert slab.get("k") == data(70 * KiB)
    st = slab.stats()
    assert (st["get_hits"], st["get_misses"]) == (1, 1)  # exists/length count nothing
    assert slab.exists_many(["k", "nope", "k"]) == [True, False, True]


def test_delete_releases_one_reference_then_frees(slab):
    free0 = slab.stats()["free_bytes"]
    slab.put("d", data(100 * KiB))
    slab.put("d", data(100 * KiB))
    assert slab.delete("d") is True
    assert slab.get("d") == data(100 * KiB)
    assert slab.delete("d") is True
    assert slab.delete("d") is False
    st = slab.stats()
    assert (st["unique_blocks"], st["total_refs"], st["free_bytes"]) == (0, 0, free0)
    assert slab.check() == []


def test_a_read_is_counted_once_it_ends_and_a_hit_is_never_taken_back(slab):
    """A hit counted when a read began and taken back when its block went made get_hits go
    back (a counter reset to Prometheus): it is counted when the read ends whole."""
    slab.put("kept", data(256 * KiB, seed=1))
    slab.put("goes", data(256 * KiB, seed=2))
    reader = slab.open_block("goes")
    assert reader is not None and slab.stats()["get_hits"] == 0
    assert slab.delete("goes")
    with pytest.raises(BlockGone):
        reader.read()
    assert (slab.stats()["get_hits"], slab.stats()["get_misses"]) == (0, 1)
    assert slab.get("kept") == data(256 * KiB, seed=1)
    assert (slab.stats()["get_hits"], slab.stats()["get_misses"]) == (1, 1)


def test_reader_of_a_released_block_gets_a_miss_not_wrong_bytes(slab):
    slab.put("r", data(MiB))
    reader = slab.open_block("r")
    it = reader.slices(PAGE)
    assert next(it) == data(MiB)[:PAGE]
    slab.delete("r")
    slab.put("other", data(MiB, seed=9))  # likely reuses the same pages
    with pytest.raises(BlockGone):
        list(it)
    st = slab.stats()
    assert (st["get_hits"], st["get_misses"]) == (0, 1)


# ---------------------------------------------------------------- eviction


def test_clock_evicts_unreferenced_blocks_first(slab):
    for i in range(8):  # 8 x 512 KiB fills the 4 MiB slab
        slab.put(f"b{i}", data(512 * KiB, seed=i))
    assert slab.stats()["free_bytes"] == 0
    slab.get("b0")  # read since the last sweep: survives it
    slab.put("new", data(512 * KiB, seed=99))
    assert slab.exists("b0") and slab.exists("new")
    st = slab.stats()
    assert (st["evictions"], st["evicted_bytes"], st["unique_blocks"]) == (1, 512 * KiB, 8)
    assert slab.check() == []


def _full_slab_of_4kib(slab_name: str) -> Slab:
    """A slab of 1,024 one-page blocks of 4 KiB."""
    return Slab.create(slab_name, 1024 * 4 * KiB, page_size=4 * KiB, max_block_size=4 * KiB,
                       prefault=False)  # fmt: skip


def test_the_newest_blocks_outlive_older_ones(slab_name):
    """The hand walks the slots in scattered order, not by age: with a reference bit, a
    block stored a moment ago was as likely a victim as one stored a sweep ago (of the
    newest tenth of the slab's blocks 89% were held, of the newest half 72%). A count of
    passes makes a block's life several sweeps long, give or take one."""
    slab = _full_slab_of_4kib(slab_name)
    try:
        n = 8 * 1024
        for k in range(n):
            slab.put(f"n{k}", b"x" * 4 * KiB)
        held = [slab.exists(f"n{k}") for k in range(n)]
        assert sum(held[-102:]) >= 100, sum(held[-102:])  # the newest tenth
        assert sum(held[-512:]) >= 0.88 * 512, sum(held[-512:])  # the newest half
        assert sum(held) == 1024
    finally:
        slab.close()


def test_used_blocks_outlive_a_scan_of_one_off_blocks(slab_name):
    """Blocks read once keep their place while a slab's worth of blocks nobody reads
    passes through (a read gives a block REF_TOUCHED passes, a new one REF_NEW): 64 of
    100 were held with a reference bit."""
    slab = _full_slab_of_4kib(slab_name)
    try:
        for k in range(1024):
            slab.put(f"old{k}", b"o" * 4 * KiB)
        hot = [f"hot{k}" for k in range(100)]
        for address in hot:
            slab.put(address, b"h" * 4 * KiB)
            assert slab.get(address) == b"h" * 4 * KiB
        for k in range(1024):
            slab.put(f"scan{k}", b"s" * 4 * KiB)
        assert sum(map(slab.exists, hot)) >= 80
    finally:
        slab.close()


def test_with_a_disk_tier_eviction_takes_spilled_blocks_first(slab):
    """A block the disk tier holds is evicted before one it has not written yet (that
    one would be lost); with none spilled, eviction goes on as before, and looks for
    spilled victims again once the keeper marks another block."""
    for i in range(8):  # 8 x 512 KiB fills the 4 MiB slab
        slab.put(f"b{i}", data(512 * KiB, seed=i))
    _, ids = slab.block_ids([f"b{i}" for i in range(8)])
    for i in (2, 5, 7):  # the keeper wrote these three
        assert slab.mark_spilled(f"b{i}", 0, ids[i], 100 + i) == 1
    for k in range(3):
        slab.put(f"n{k}", data(512 * KiB, seed=50 + k))
    gone = [i for i in range(8) if not slab.exists(f"b{i}")]
    assert gone == [2, 5, 7]  # the moves, never a loss
    # Nothing spilled is left: the next eviction takes an unspilled block (it does not
    # fail or wait), and the ones after it do not look for spilled victims again...
    slab.put("n3", data(512 * KiB, seed=53))
    assert sum(slab.exists(f"b{i}") for i in range(8)) == 4
    st = slab._state
    assert st[L.ST_SPILL_WALL] == st[L.ST_SPILLS] == 3
    # ...until the keeper marks one more.
    survivors = [i for i in range(8) if slab.exists(f"b{i}")]
    _, now = slab.block_ids([f"b{survivors[-1]}"])
    slab.mark_spilled(f"b{survivors[-1]}", 0, now[0], 200)
    slab.put("n4", data(512 * KiB, seed=54))
    assert not slab.exists(f"b{survivors[-1]}")
    assert all(slab.exists(f"b{i}") for i in survivors[:-1])
    assert slab.check() == []


@pytest.fixture
def thousand_pages(slab_name):
    """4 MiB of 4 KiB pages: 1,024 pages, the smallest slab that evicts ahead (one)."""
    s = Slab.create(slab_name, 4 * MiB, page_size=4 * KiB, max_block_size=64 * KiB)
    yield s
    s.close()


def test_a_put_that_evicts_frees_a_page_ahead_for_the_next(thousand_pages):
    """A slab of 1,024 pages or more frees a 1,024th of its pages beyond what the put
    needs (at most EVICT_AHEAD): the put after it finds a free page and evicts nothing."""
    s = thousand_pages
    assert s.geometry.npages == 1024 and EVICT_AHEAD >= 1
    for i in range(1024):
        s.put(f"f{i}", b"f" * 4 * KiB)
    assert s.stats()["evictions"] == 0
    s.put("g0", b"g" * 4 * KiB)
    assert s.stats()["evictions"] == 2  # its page, and one ahead
    assert s._state[L.ST_FREE_COUNT] == 1
    s.put("g1", b"g" * 4 * KiB)
    assert s.stats()["evictions"] == 2  # the page freed ahead
    s.put("g2", b"g" * 4 * KiB)
    assert s.stats()["evictions"] == 4
    assert s.check() == []


def test_evicting_ahead_never_takes_a_leased_block_or_refuses_a_put(thousand_pages):
    """Every block leased but one: the put that needs that one page evicts it and is
    stored; the page ahead, which only a leased block could give, is not taken."""
    s = thousand_pages
    keys = [f"f{i}" for i in range(1024)]
    for k in keys:
        s.put(k, b"f" * 4 * KiB)
    assert all(s.exists_many(keys[1:], lease_ms=10_000))
    assert s.put("new", b"n" * 4 * KiB) is True
    assert s.stats()["evictions"] == 1 and not s.exists(keys[0])
    assert all(s.exists(k) for k in keys[1:])
    assert s.check() == []


def test_big_block_fits_in_scattered_free_pages(slab):
    for i in range(64):  # one page each: the whole slab
        slab.put(f"p{i}", b"x" * PAGE)
    for i in range(0, 64, 2):  # free every other page: no two free pages are adjacent
        slab.delete(f"p{i}")
    assert slab.put("big", data(MiB)) is True  # 16 scattered pages
    assert slab.get("big") == data(MiB)
    assert slab.stats()["evictions"] == 0
    assert slab.check() == []


# ---------------------------------------------------------------- check / repair


def test_check_finds_and_repair_fixes_damage(slab):
    for i in range(5):
        slab.put(f"k{i}", data(100 * KiB, seed=i))
    slab._state[L.ST_FREE_COUNT] += 3
    slab._state[L.ST_TOTAL_REFS] += 1
    problems = slab.check()
    assert any("free count" in p for p in problems)
    assert any("counter total_refs" in p for p in problems)
    assert slab.repair() == problems
    assert slab.check() == []
    assert all(slab.get(f"k{i}") == data(100 * KiB, seed=i) for i in range(5))


def test_repair_drops_a_slot_whose_chain_is_broken(slab):
    slab.put("good", data(100 * KiB))
    slab.put("bad", data(100 * KiB, seed=1))
    s = slab._find(b"bad", fingerprint(b"bad"))[1]
    assert s is not None
    slab._tag[s[5]] = 12345  # the block's tag no longer matches: its memory is suspect
    assert any("tag 12345" in p for p in slab.check())
    slab.repair()
    assert slab.check() == []
    assert slab.get("bad") is None and slab.get("good") == data(100 * KiB)
    st = slab.stats()
    assert (st["evictions"], st["repairs"]) == (1, 1)


def _die_inside_the_lock(name):
    s = Slab.attach(name)
    with s._locked():
        s._state[L.ST_FREE_COUNT] -= 7  # half-done work
        os.kill(os.getpid(), signal.SIGKILL)


def _die_with_a_reservation(name, ready):
    s = Slab.attach(name)
    h = s.begin_put("orphan", 300 * KiB)
    h.write(b"x" * 1000)
    ready.set()
    signal.pause()


def test_holder_killed_inside_the_lock_is_repaired_by_the_next_taker(slab):
    slab.put("keep", data(100 * KiB))
    p = mp.get_context("fork").Process(target=_die_inside_the_lock, args=(slab.name,))
    p.start()
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    assert slab.get("keep") == data(100 * KiB)  # the lock was free; repair ran first
    assert slab.stats()["repairs"] == 1
    assert slab.check() == []


def kill_a_writer_holding_a_reservation(slab) -> int:
    """Start a process that reserves 5 pages for a put, SIGKILL it; return the free bytes
    seen while it was alive."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_die_with_a_reservation, args=(slab.name, ready), daemon=True)
    p.start()
    assert ready.wait(10)
    free_during = slab.stats()["free_bytes"]
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert not pid_alive(p.pid)
    return free_during


def test_reservation_of_a_killed_writer_is_reclaimed(slab):
    free_during = kill_a_writer_holding_a_reservation(slab)
    assert any("writer is dead" in x for x in slab.check())
    slab.repair()
    assert slab.check() == []
    assert slab.stats()["free_bytes"] == free_during + 5 * PAGE
    assert not slab.exists("orphan")


def test_dead_reservations_are_reclaimed_when_room_runs_out(slab):
    kill_a_writer_holding_a_reservation(slab)
    handles = [slab.begin_put(f"h{i}", 900 * KiB) for i in range(4)]  # needs the orphan's pages
    for h in handles:
        h.abort()
    assert slab.check() == []


def test_get_counts_stay_exact_when_every_process_entry_is_taken(slab):
    handles = [Slab.attach(slab.name) for _ in range(L.NPROCS + 2)]
    try:
        slab.put("k", b"v")
        for h in handles:  # the last handles find no free entry and count under the lock
            assert h.get("k") == b"v" and h.get("nope") is None
        assert slab.get("k") == b"v"
        st = slab.stats()
        assert (st["get_hits"], st["get_misses"]) == (len(handles) + 1, len(handles))
    finally:
        for h in handles:
            h.close()
    st = slab.stats()  # closing folds each entry's counts into the totals
    assert (st["get_hits"], st["get_misses"]) == (len(handles) + 1, len(handles))


def test_a_lookup_remembers_no_more_places_than_its_namespaces_cap(slab_name):
    """The memo of where each hit lies is capped per namespace (``share_key_cache``), as
    the address memo is: one lookup of 1,024 hits left 1,024 places in each namespace,
    past the cap (a worker's memory grew with its tenants)."""
    s = Slab.create(slab_name, 16 * 1024 * 1024, page_size=4096)
    try:
        ids = s.bind_namespaces({f"t{i}": 0 for i in range(200)})
        s.share_key_cache(len(ids))
        cap = s._key_cap
        addresses = [f"blk{i}" for i in range(1024)]
        for ns in (ids["t1"], ids["t2"]):
            for a in addresses:
                s.put(a, b"x", ns)
            assert s.block_ids(addresses, ns)[1].count(0) == 0
            assert 0 < len(s._places[ns]) <= cap < len(addresses)
            assert all(s.block_ids(addresses, ns)[1])  # answers whole, memo or not
    finally:
        s.close()


def test_stalled_dedup_puts_never_take_the_entries_a_puts_pages_need(slab_name):
    """A dedup hit in flight holds a reservation entry and no page: one client's stalled
    dedup PUTs (one connection each) filled a table of one entry per page, and another
    tenant's large PUT got 503. They have entries of their own now, and past those they
    go on without one."""
    with Slab.create(slab_name, 256 * KiB, page_size=4 * KiB, max_block_size=MiB) as s:
        s.put("mine", data(8 * KiB))
        dedups = [s.begin_put("mine", 8 * KiB) for _ in range(L.DEDUP_ENTRIES + 100)]
        assert all(h.dedup for h in dedups)
        assert sum(h.ref_entry >= 0 for h in dedups) == L.DEDUP_ENTRIES
        big = s.begin_put("victim", 128 * KiB)  # 32 of the 64 pages: room for its entry
        big.write(data(128 * KiB))
        assert big.commit() is True
        for h in dedups:
            h.abort()
        assert s.refs("mine") == 1 and s.check() == []
