"""Local leases on a real slab (eg_kv.slab.local_leases): a reader on the slab's host leases
its hits in its own table of the readers segment, eviction honours them as it does a slot's
lease, the reader releases its own, a writer that comes between the lookup and the lease
turns a hit it took into a miss, and a reader that died costs nothing once its leases end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from eg_kv.errors import InsufficientStorage
from eg_kv.slab import layout as L
from eg_kv.slab.layout import now_ms
from eg_kv.slab.local import LocalInfo, LocalSlab
from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024
PAGE = 64 * KiB
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(60)


def info(slab: Slab, lease_ms: int = 5000) -> LocalInfo:
    doc = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0, lease_ms)
    return LocalInfo.from_json(json.loads(json.dumps(doc)))


def fill(slab: Slab, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}{k}" for k in range(n)]
    for k in keys:
        slab.put(k, bytes(PAGE))
    return keys


def counts(slab: Slab) -> tuple[int, int, int]:
    st = slab.stats()
    return st["leases_taken"], st["leases_released"], st["leased_blocks"]


def test_a_local_lease_holds_its_block_against_eviction_until_released(small):
    keys = fill(small, "a", 64)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses([*keys[:8], "absent"], 60000) == [True] * 8 + [False]
        assert counts(small) == (8, 0, 8)
        fill(small, "b", 400)  # six slabs' worth: everything unleased goes
        assert all(small.exists(k) for k in keys[:8])
        assert not any(small.exists(k) for k in keys[8:])
        assert local.release_leases(keys[:8]) == (8, [])
        assert local.release_leases(keys[:1]) == (0, keys[:1])  # none held: the server's
        assert counts(small) == (8, 8, 0)
        fill(small, "c", 400)
        assert not any(small.exists(k) for k in keys[:8])


def test_a_lease_taken_twice_needs_two_releases_and_the_server_is_not_asked(small):
    keys = fill(small, "a", 4)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys[:1], 60000) == [True]
        assert local.lease_addresses(keys[:1], 60000) == [True]
        assert local.release_leases(keys[:1]) == (1, [])
        fill(small, "b", 400)
        assert small.exists(keys[0])  # one lease left
        assert local.release_leases(keys[:1]) == (1, [])
        assert counts(small) == (2, 2, 0)


def test_batches_and_pieces_of_leases_hold_exactly_their_blocks(small):
    """A lookup's leases released as one batch go in slices (LocalLeases._release_run),
    records freed in a run are taken again in slices (_fill), anything else one by one:
    whichever way, eviction passes over exactly the blocks still leased."""
    keys = fill(small, "a", 16)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys[:8], 60000) == [True] * 8
        assert local.release_leases(keys[:8]) == (8, [])  # the whole batch: a run
        assert local.lease_addresses(keys[:8], 60000) == [True] * 8  # its records again
        assert local.lease_addresses(keys[2:4], 60000) == [True] * 2  # two hold two
        assert local.release_leases(keys[:8]) == (8, [])  # not a run: one by one
        assert local.release_leases([keys[0], keys[0]]) == (0, [keys[0]] * 2)
        assert local.lease_addresses([*keys[8:12], *keys[8:12]], 60000) == [True] * 8
        assert local.release_leases([keys[9], keys[11]]) == (2, [])  # freed apart
        assert local.lease_addresses(keys[12:16], 60000) == [True] * 4  # some records apart
        held = {keys[2], keys[3], *keys[8:16]}
        assert counts(small) == (30, 18, len(held))
        fill(small, "b", 400)
        assert [k for k in keys if small.exists(k)] == [k for k in keys if k in held]
        assert local.release_leases(sorted(held)) == (10, [])
        assert local.release_leases(keys[8:12]) == (2, [keys[9], keys[11]])  # 8, 10 twice
        assert counts(small) == (30, 30, 0)


def test_only_locally_leased_blocks_left_is_a_507_until_one_is_released(small):
    keys = fill(small, "a", 64)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys, 60000) == [True] * 64
        with pytest.raises(InsufficientStorage, match="leased blocks"):
            small.put("new", bytes(PAGE))
        with pytest.raises(InsufficientStorage):  # the wall: refused without a sweep
            small.put("new", bytes(PAGE))
        assert local.release_leases(keys[5:6]) == (1, [])  # lifts the wall at once
        assert small.put("new", bytes(PAGE))
        assert not small.exists(keys[5]) and small.exists(keys[4])


def test_a_writer_between_the_lookup_and_the_lease_turns_that_hit_into_a_miss(small):
    """The lookup found the block; a writer evicted it before the lease was checked: the
    sequence moved, the lookup looks again, answers a miss and drops that record."""
    keys = fill(small, "a", 3)
    with LocalSlab.open(info(small)) as local:
        assert local.leases is not None
        take = local.leases.take

        def take_then_a_writer_deletes(addresses, ids, lease_ms):
            ok = take(addresses, ids, lease_ms)
            small.delete(keys[1])  # a writing section: the sequence moves
            return ok

        local.leases.take = take_then_a_writer_deletes  # type: ignore[method-assign]
        assert local.lease_addresses(keys, 60000) == [True, False, True]
        assert not local.holds_lease(keys[1]) and local.holds_lease(keys[0])
        assert counts(small) == (2, 0, 2)


def test_a_full_table_asks_the_server_instead(small):
    records = L.lease_records(small.geometry.nslots)
    assert records == 64  # the slab's 128 slots: as many records as it holds blocks
    keys = fill(small, "a", 64)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys, 60000) == [True] * 64
        for k in keys:
            assert small.delete(k)  # a DELETE frees a leased block; the records stay
        fresh = fill(small, "b", 1)
        assert local.lease_addresses(fresh, 60000) is None  # no room: over HTTP
        assert local.lease_addresses(keys[:1], 60000) == [False]  # a miss needs no room


def test_a_server_without_leases_is_not_leased_locally(small):
    keys = fill(small, "a", 1)
    with LocalSlab.open(info(small, lease_ms=0)) as local:
        assert local.leases is None
        assert local.lease_addresses(keys, 5000) is None


_HOLDER = textwrap.dedent(
    """
    import json, sys
    from eg_kv.slab.local import LocalInfo, LocalSlab
    local = LocalSlab.open(LocalInfo.from_json(json.loads(sys.argv[1])))
    found = local.lease_addresses(json.loads(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(found), local._me, flush=True)
    sys.stdin.read()  # wait to be killed
    """
)


def test_a_sigkilled_readers_leases_end_and_the_next_reader_clears_its_table(small):
    keys = fill(small, "a", 64)
    doc = LocalInfo.of(small.name, small.slab_id, small.geometry.total_size, 0, 60000)
    lease_ms = 1500
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, json.dumps(doc), json.dumps(keys[:4]), str(lease_ms)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        found, me = child.stdout.readline().rsplit(" ", 1)
        end = now_ms() + lease_ms
        assert json.loads(found) == [True] * 4
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdin.close()  # type: ignore[union-attr]
        child.stdout.close()  # type: ignore[union-attr]
    if now_ms() < end - 300:  # its leases still hold after its death
        fill(small, "b", 400)
        assert all(small.exists(k) for k in keys[:4])
    while now_ms() <= end:  # bounded: the lease's own length
        time.sleep(0.01)
    assert counts(small)[2] == 0
    fill(small, "c", 400)
    assert not any(small.exists(k) for k in keys[:4])  # nothing left of its leases
    assert small._readers is not None and small._readers[int(me) + L.R_LEASE_TOP] > 0
    with LocalSlab.open(info(small)) as local:  # takes the dead reader's entry
        assert local._me == int(me)
        assert small._readers[int(me) + L.R_LEASE_TOP] == 0


def _until_ended(lease_ms: int, since: int) -> None:
    """Until leases of ``lease_ms`` taken by a call that returned at ``since`` (ms) have
    ended: each ends ``lease_ms`` after it was taken, before the call returned (timed from
    before the call, a loaded box's slow call left the last ones running)."""
    while now_ms() <= since + lease_ms:  # bounded: the lease's own length
        time.sleep(0.001)


def test_releases_of_leases_that_ended_end_nothing_here_or_at_the_server(small):
    """A record whose lease ended goes at its first release (or when the table needs
    room); the releases still to come for its other leases are this reader's, absorbed
    here: sent to the server, each would end another client's lease on the block."""
    keys = fill(small, "a", 2)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses([keys[0], keys[0]], 2) == [True, True]
        _until_ended(2, now_ms())
        assert local.holds_lease(keys[0])
        assert local.release_leases(keys[:1]) == (0, [])  # ended: counts 0, as the server
        assert local.holds_lease(keys[0])  # one release still to come
        assert local.release_leases(keys[:1]) == (0, [])  # absorbed, not the server's
        assert not local.holds_lease(keys[0])
        assert local.release_leases(keys[:1]) == (0, keys[:1])  # never leased here


def test_a_lease_on_a_record_taken_again_keeps_the_old_leases_releases_here(small):
    keys = fill(small, "a", 1)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys * 2, 2) == [True, True]  # two, ended soon
        _until_ended(2, now_ms())
        assert local.lease_addresses(keys, 60000) == [True]  # the record again: one lease
        fill(small, "b", 400)
        assert small.exists(keys[0])
        assert local.release_leases(keys) == (1, [])  # the live one first
        assert local.release_leases(keys * 2) == (0, [])  # the two that ended: absorbed
        assert local.release_leases(keys) == (0, keys)


def test_a_lookup_that_frees_ended_records_keeps_the_lease_of_one_it_held(small):
    """The table is full of ended leases; a lookup of an address it held (ended) and a
    new one must free them for room: the held address is leased anew, in a record the
    table keeps (before, its lease went into a freed record, which the next lease
    overwrote: the block could be evicted before its load, the release went astray)."""
    keys = fill(small, "a", 64)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys, 2) == [True] * 64  # every record of the table
        _until_ended(2, now_ms())
        assert small.delete(keys[63])
        fresh = fill(small, "b", 1)
        assert local.lease_addresses([keys[0], *fresh], 60000) == [True, True]
        assert local.holds_lease(keys[0]) and local.holds_lease(fresh[0])
        fill(small, "c", 400)
        assert small.exists(keys[0]) and small.exists(fresh[0])
        assert local.release_leases([keys[0], *fresh]) == (2, [])
        assert local.release_leases(keys[:1]) == (0, [])  # its ended lease: absorbed


def test_repeats_of_an_address_held_already_count_once_each(small):
    keys = fill(small, "a", 2)
    with LocalSlab.open(info(small)) as local:
        assert local.lease_addresses(keys[:1], 60000) == [True]
        found = local.lease_addresses([keys[0], keys[0], keys[1], keys[1]], 60000)
        assert found == [True] * 4
        assert local.release_leases(keys[:1] * 3) == (3, [])  # three, not four
        assert local.release_leases(keys[1:] * 2) == (2, [])
        assert local.release_leases(keys) == (0, keys)
        assert counts(small) == (5, 5, 0)


def test_taking_back_a_lease_on_a_replaced_block_leaves_the_newer_lease(small):
    """Two lookups raced over an address whose block was replaced: the second moved the
    record to the new block; the first, finding its block gone, takes back its own
    lease only (before, it dropped the record and with it the second's lease)."""
    keys = fill(small, "a", 1)
    with LocalSlab.open(info(small)) as local:
        leases = local.leases
        assert leases is not None
        old = small.block_ids(keys)[1][0]
        assert leases.take(keys, [old], 60000)  # the first lookup's lease
        small.delete(keys[0])
        fill(small, "a", 1)  # the address now names another block
        new = small.block_ids(keys)[1][0]
        assert new != old
        assert leases.take(keys, [new], 60000)  # the second lookup's
        leases.undo(keys[0], old)  # the first finds its block gone
        assert local.holds_lease(keys[0])
        fill(small, "b", 400)
        assert small.block_ids(keys)[1] == [new]  # still leased
        assert local.release_leases(keys) == (1, [])
        assert local.release_leases(keys) == (0, keys)


def test_a_forked_child_releases_none_of_its_parents_leases(small):
    """A child that inherited a client must not end the leases its parent's lookups took:
    not in the parent's table (the parent would lose them), nor at the server (another
    client's). Its lease record forgets them at the fork."""
    from eg_kv.client.lease_record import LeaseRecord

    class Sent:  # what the record hands its connector to release
        def __init__(self) -> None:
            self.addresses: list[str] = []

        def release(self, addresses: list[str]) -> None:
            self.addresses.extend(addresses)

    keys = fill(small, "a", 4)
    with LocalSlab.open(info(small)) as local:
        sent = Sent()
        record = LeaseRecord(sent, 60000)
        record.note(keys, local.lease_addresses(keys, 60000) or [])
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if it left everything alone
            ok = local.release_leases(keys) == (0, keys) and not local.holds_lease(keys[0])
            record.release(keys)
            os._exit(0 if ok and not sent.addresses else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        fill(small, "b", 400)
        assert all(small.exists(k) for k in keys)  # the parent's leases held
        record.release(keys)  # the parent's record kept them: its connector ends them
        assert sent.addresses == keys
        assert local.release_leases(keys) == (4, [])


def test_a_lookup_that_cannot_look_again_takes_back_its_leases(small):
    """A writer came in after the leases were taken, and the look again fails (writers
    kept the table busy): the caller asks the server instead, so none of the leases
    taken here may stay (the server's would be released here, these never)."""
    from eg_kv.slab.local import LocalUnavailable

    keys = fill(small, "a", 2)
    with LocalSlab.open(info(small)) as local:
        assert local.leases is not None
        take, look = local.leases.take, local.block_ids
        looks: list[int] = []

        def take_then_a_writer(addresses, ids, lease_ms):
            ok = take(addresses, ids, lease_ms)
            small.put("other", bytes(PAGE))  # a writing section: the sequence moves
            return ok

        def block_ids(addresses, ns=0):
            looks.append(1)
            if len(looks) > 1:
                raise LocalUnavailable("writers kept the slot table busy")
            return look(addresses, ns)

        local.leases.take = take_then_a_writer  # type: ignore[method-assign]
        local.block_ids = block_ids  # type: ignore[method-assign]
        with pytest.raises(LocalUnavailable):
            local.lease_addresses(keys, 60000)
        assert not local.holds_lease(keys[0]) and not local.holds_lease(keys[1])
        assert counts(small)[2] == 0
