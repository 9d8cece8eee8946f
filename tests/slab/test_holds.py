"""Lease holders (eg_kv.slab.holds) on a real slab and on a table of their own: a release
ends only the leases its own holder took, a lookup whose leases find no holder record
takes none (and changes nothing), and records whose leases ended are taken again."""

from __future__ import annotations

from array import array

import pytest

from eg_kv.slab import layout as L
from eg_kv.slab.holds import PROBE, LeaseHolders, holder_of
from eg_kv.slab.layout import now_ms
from eg_kv.slab.store import Slab

pytestmark = pytest.mark.timeout(60)
PAGE = 64 * 1024


def table(records: int) -> tuple[LeaseHolders, memoryview]:
    words = memoryview(array("q", bytes(8 * L.HOLD_RECORD_WORDS * records)))
    return LeaseHolders(words), words


def test_a_release_ends_only_its_own_holders_leases(small: Slab):
    keys = [f"k{n}" for n in range(4)]
    for k in keys:
        small.put(k, bytes(PAGE))
    alice, bob = holder_of("alice"), holder_of("bob")
    assert alice != bob and holder_of("alice") == alice and alice > 0
    assert small.exists_leased(keys, 0, 60000, 1.0, alice) == ([True] * 4, True)
    assert small.exists_leased(keys[:1], 0, 60000, 1.0, bob) == ([True], True)
    assert small.release_leases(keys, 0, bob) == [True, False, False, False]
    assert small.release_leases(keys[:1], 0, bob) == [False]  # its one is spent
    assert small.stats()["leased_blocks"] == 4
    assert small.release_leases(keys, 0, alice) == [True] * 4
    assert small.release_leases(keys, 0, alice) == [False] * 4
    assert small.stats()["leased_blocks"] == 0
    # Another handle (another worker) sees the same holders.
    with Slab.attach(small.name) as other:
        assert small.exists_leased(keys[:2], 0, 60000, 1.0, alice)[1]
        assert other.release_leases(keys[:2], 0, bob) == [False, False]
        assert other.release_leases(keys[:2], 0, alice) == [True, True]


def test_a_full_neighbourhood_refuses_all_of_a_lookups_leases_and_ended_ones_make_room():
    holders, words = table(64)
    now = now_ms()
    taken = [b for b in range(1, 10_000) if holders.take([b], 7, now + 60000, now)][:64]
    assert len(taken) == 64  # the whole table: each place holds one record
    before = words.tobytes()
    assert not holders.take([taken[0], 20_000], 7, now + 60000, now)
    assert words.tobytes() == before  # nothing taken: the lease it had room for undone
    assert holders.release(taken[0], 8, now) is False  # another holder's
    assert holders.release(taken[0], 7, now) is True
    # The freed record is taken by the first new block whose places cover it, and then
    # the table is full again.
    fits = [b for b in range(40_000, 42_000) if holders.take([b], 7, now + 60000, now)]
    assert len(fits) == 1
    # Once their leases end, every record may be taken again.
    later = now + 60001
    assert holders.take(list(range(30_000, 30_000 + PROBE)), 9, later + 5000, later)
    assert holders.release(taken[1], 7, later) is False  # ended: nothing to release


def test_a_block_leased_twice_by_one_holder_needs_two_releases():
    holders, _ = table(64)
    now = now_ms()
    assert holders.take([5, 5], 3, now + 1000, now)
    assert holders.release(5, 3, now) and holders.release(5, 3, now)
    assert not holders.release(5, 3, now)


def test_a_leased_block_that_goes_frees_its_holders_records(small: Slab):
    """A DELETE of a leased block gave its pages back but left its holder records taken
    until the leases would have ended: a tenant that leased and deleted in a loop filled
    the table (with no page leased), and every other tenant's lookups went unleased."""
    alice, bob = holder_of("alice"), holder_of("bob")
    records = len(small._holds) // L.HOLD_RECORD_WORDS
    for _ in range(2 * records):
        small.put("a1", bytes(100))
        assert small.exists_leased(["a1"], 0, 60000, 1.0, alice) == ([True], True)
        assert small.delete("a1")  # the last reference: the block goes, leased
    assert small.stats()["leased_blocks"] == 0
    small.put("v1", bytes(100))
    assert small.exists_leased(["v1"], 0, 60000, 1.0, bob) == ([True], True)
    # A block leased by several holders frees every one's record.
    small.put("s1", bytes(100))
    for name in ("carol", "dave", "erin"):
        assert small.exists_leased(["s1"], 0, 60000, 1.0, holder_of(name))[1]
    assert small.delete("s1")
    ids = small._holds[L.HOLD_RECORD_WORDS * 0 :: L.HOLD_RECORD_WORDS]
    live = [b for b in ids.tolist() if b > 0]
    assert len(live) == 1  # bob's of v1, no other


def test_a_leased_block_its_quota_evicts_frees_its_holders_records(small: Slab):
    """A namespace over its quota evicts its own leased blocks: the eviction cleared the
    slot's leases first, so the records were left (the DELETE case alone was covered)."""
    capped = small.bind_namespaces({"capped": 8 * PAGE})["capped"]
    alice = holder_of("alice")
    mine = [f"c{i}" for i in range(8)]
    for k in mine:
        small.put(k, bytes(PAGE), capped)
    assert small.exists_leased(mine, capped, 60000, 1.0, alice) == ([True] * 8, True)
    for k in range(4):  # four more pages through a quota of eight: a leased block goes
        small.put(f"c-new{k}", bytes(PAGE), capped)
    gone = [k for k in mine if not small.exists(k, capped)]
    assert gone
    ids = small._holds[:: L.HOLD_RECORD_WORDS].tolist()
    assert sum(b > 0 for b in ids) == 8 - len(gone)  # the records of those left, no other
