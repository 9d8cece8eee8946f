"""The disk tier under a real server (``eg-kv serve --disk DIR``): real processes, a real
directory, blocks four times the slab; crashes by SIGKILL, damage by changing the file."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from struct import error as struct_error

import psutil
import pytest
from helpers.common import free_port, wait_for
from helpers.kv_publisher import Subscriber, held_by, kv_events_flags
from helpers.server_http import WORKER_HEADER, request, stats
from helpers.server_procs import stopped
from helpers.servers import serve_cmd
from helpers.tenants import token_of, write_tokens

from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.disk import layout as D
from eg_kv.disk.counters import NAMES as COUNTER_NAMES

KiB = 1024
BLOCK = 512 * KiB  # a 4 MiB slab holds 8


@pytest.fixture
def disk_dir(tmp_path):
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    return d


def _serve(server_factory, disk_dir, capacity="4MiB", workers=2, disk="64MiB", extra_args=(),
           **kw):  # fmt: skip
    srv = server_factory(workers=workers, capacity=capacity, extra=(
        "--page-size", "64KiB", "--max-block-size", "1MiB", "--disk", str(disk_dir),
        "--disk-capacity", disk, *extra_args), **kw)  # fmt: skip
    if not extra_args:  # (with a tokens file, stats need the admin's token: the test waits)
        wait_for(lambda: _disk(srv).get("ready"), what="the disk tier's scan")
    return srv


def _disk(srv) -> dict:
    return stats(srv)["disk"]


def _spills(srv) -> int:
    """The spills so far: asked until a worker answers with the keeper's count (one that
    died under the question, or whose call to the keeper timed out on a loaded box, is
    asked again)."""
    got: list[int] = []

    def answered() -> bool:
        try:
            got[:] = [_disk(srv)["spills"]]
        except (OSError, KeyError):
            return False
        return True

    wait_for(answered, what="the disk tier's spill count")
    return got[0]


def _on_disk(srv, addresses: list[str]) -> list[str]:
    """Those of ``addresses`` only the disk holds (the batch exists' ``on_disk``)."""
    answer = request(srv, "POST", "/kv/batch/exists", json.dumps({"addresses": addresses}).encode())
    return [addresses[i] for i in answer.json().get("on_disk", [])]


def _blocks(tag: str, n: int) -> dict[str, bytes]:
    return {f"{tag}{i:03d}": os.urandom(BLOCK) for i in range(n)}


def _put_spilled(srv, blocks: dict[str, bytes]) -> None:
    """PUT each block and wait for its spill (so none is evicted before it is written)."""
    for address, data in blocks.items():
        spilled = _spills(srv)
        assert request(srv, "PUT", f"/kv/{address}", data).status == 201
        wait_for(lambda s=spilled: _spills(srv) > s, what=f"the spill of {address}")


def _all_back(srv, blocks: dict[str, bytes]) -> dict[str, int]:
    """GET every block: counts of equal bytes and misses; wrong bytes fail here."""
    out = {"equal": 0, "miss": 0}
    for address, data in blocks.items():
        r = request(srv, "GET", f"/kv/{address}")
        if r.status == 404:
            out["miss"] += 1
            continue
        assert r.status == 200 and r.body == data, f"{address}: wrong bytes"
        out["equal"] += 1
    return out


def _evict_to_disk(srv, address: str, tag: str) -> None:
    """PUT fillers until the slab evicts ``address`` (its second chance spent) and only
    the disk holds it."""
    for i in range(40):
        _put_spilled(srv, _blocks(f"{tag}-fill{i}-", 2))
        if _on_disk(srv, [address]):
            break
    assert _on_disk(srv, [address]) == [address]


def _held_by(srv, address: str, data: bytes, holders: int) -> None:
    """``address`` serves ``data`` until its ``holders``' DELETEs, and then no more."""
    for left in range(holders, 0, -1):
        assert request(srv, "GET", f"/kv/{address}").body == data, f"{left} references left"
        assert request(srv, "DELETE", f"/kv/{address}").status == 204
    assert request(srv, "GET", f"/kv/{address}").status == 404


def test_evictions_spill_and_hits_come_back(server_factory, disk_dir):
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("s", 32)  # 16 MiB through a 4 MiB slab
    _put_spilled(srv, blocks)
    st = stats(srv)
    assert st["unique_blocks"] <= 8 and st["evictions"] >= 24
    first = _on_disk(srv, list(blocks))[:3]  # evicted: on disk only
    r = request(srv, "HEAD", f"/kv/{first[0]}")
    assert r.status == 200 and int(r.headers["Content-Length"]) == BLOCK
    assert request(srv, "GET", f"/kv/{first[1]}/exists").json()["exists"] is True
    batch = request(srv, "POST", "/kv/batch/exists",
                    json.dumps({"addresses": [*first, "s999"]}).encode()).json()  # fmt: skip
    assert batch == {"exists": [True, True, True, False], "prefix_hits": 3, "on_disk": [0, 1, 2]}

    before = stats(srv)
    assert _all_back(srv, blocks) == {"equal": 32, "miss": 0}
    disk = _disk(srv)
    assert disk["disk_hits"] >= 24 and disk["promotions"] >= 24 and disk["checksum_failures"] == 0
    # 32 GETs answered 200: 32 hits, whichever tier answered (a disk hit counted a miss,
    # and its promotion a PUT no client made).
    after = stats(srv)
    assert (after["get_hits"] - before["get_hits"], after["get_misses"] - before["get_misses"],
            after["puts_created"] - before["puts_created"]) == (32, 0, 0)  # fmt: skip
    assert disk["spills"] == 32 and disk["blocks"] == 32 and disk["direct_io"] is True


def test_dedup_and_delete_hold_across_tiers(server_factory, disk_dir):
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("d", 12)
    _put_spilled(srv, blocks)
    old = _on_disk(srv, list(blocks))[0]  # on disk only
    assert stats(srv)["unique_blocks"] < 12
    # A dedup hit: two references (the copy's joined the PUT's, which was counted twice:
    # three, and two DELETEs left the block served).
    assert request(srv, "PUT", f"/kv/{old}", blocks[old]).status == 200
    # Two references now: the first DELETE leaves it, the second removes it everywhere.
    assert request(srv, "DELETE", f"/kv/{old}").status == 204
    assert request(srv, "GET", f"/kv/{old}").body == blocks[old]
    assert request(srv, "DELETE", f"/kv/{old}").status == 204
    assert request(srv, "GET", f"/kv/{old}").status == 404
    wait_for(lambda: _disk(srv)["blocks"] == 11, what="the disk copy to go")
    twice = _blocks("t", 1)  # two references while resident, then evicted: both kept
    ((address, data),) = twice.items()
    assert request(srv, "PUT", f"/kv/{address}", data).status == 201
    assert request(srv, "PUT", f"/kv/{address}", data).status == 200
    _evict_to_disk(srv, address, "t")
    _held_by(srv, address, data, 2)
    other = list(blocks)[1]  # a DELETE of a block only the disk holds
    assert request(srv, "DELETE", f"/kv/{other}").status == 204
    assert request(srv, "GET", f"/kv/{other}").status == 404
    assert request(srv, "DELETE", f"/kv/{other}").status == 404


def test_a_put_of_other_bytes_answers_alike_whichever_tier_holds_the_block(
    server_factory, disk_dir
):
    """Two holders' block, then a PUT of other bytes under its address: resident, it is a
    dedup hit (same length: 200, the old bytes stay, three references) or a 409 (another
    length). Only on disk it was a 201: the copy went with both its references, a GET
    gave the new bytes and one DELETE was left. Now the same answers from either tier."""
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("held", 2)
    for data_address, data in blocks.items():
        assert request(srv, "PUT", f"/kv/{data_address}", data).status == 201
        assert request(srv, "PUT", f"/kv/{data_address}", data).status == 200
    for i in range(60):  # until the slab evicts both (spilled first)
        _put_spilled(srv, _blocks(f"push{i}-", 2))
        if len(_on_disk(srv, list(blocks))) == 2:
            break
    assert len(_on_disk(srv, list(blocks))) == 2
    same, other = blocks
    r = request(srv, "PUT", f"/kv/{same}", os.urandom(BLOCK))  # same length, other bytes
    assert (r.status, r.body) == (200, b"dedup\n")
    r = request(srv, "PUT", f"/kv/{other}", os.urandom(BLOCK // 2))  # another length
    assert r.status == 409 and b"delete it first" in r.body, r.body
    assert request(srv, "GET", f"/kv/{other}").body == blocks[other]
    for address, refs in ((same, 3), (other, 2)):
        assert request(srv, "GET", f"/kv/{address}").body == blocks[address]
        for _ in range(refs):
            assert request(srv, "DELETE", f"/kv/{address}").status == 204
        assert request(srv, "GET", f"/kv/{address}").status == 404


def test_a_restart_keeps_the_cache(server_factory, disk_dir):
    """After SIGTERM (the slab is removed with the server, as after a reboot) every
    spilled block is served again, verified, from the same directory; deletes stay."""
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("r", 24)
    _put_spilled(srv, blocks)
    gone = list(blocks)[5]
    assert request(srv, "DELETE", f"/kv/{gone}").status == 204
    wait_for(lambda: _disk(srv)["blocks"] == 23, what="the delete to reach the disk")
    assert srv.stop(signal.SIGTERM) == 0
    again = _serve(server_factory, disk_dir)
    assert _disk(again)["blocks"] == 23
    assert request(again, "GET", f"/kv/{gone}").status == 404
    del blocks[gone]
    assert _all_back(again, blocks) == {"equal": 23, "miss": 0}


def test_a_kept_slab_over_a_data_file_made_anew_logs_its_blocks_removals(server_factory, disk_dir):
    """The slab kept (``--keep``), the data file made anew (another capacity): the slab's
    marks said the disk held its blocks, so their evictions were taken for moves: they
    left both tiers with no removal logged (5 of 6, and a router kept them). The marks of
    copies the new file lacks are cleared once its scan is done."""
    srv = _serve(server_factory, disk_dir, extra_args=("--keep",))
    wait_for(lambda: _disk(srv).get("ready"), what="the disk tier's scan")
    old = _blocks("kept", 6)
    _put_spilled(srv, old)
    assert stats(srv)["unique_blocks"] == 6  # all resident, all marked spilled
    slab, port = srv.slab_name, srv.port
    assert srv.stop(signal.SIGTERM) == 0  # the slab stays (--keep)
    again = _serve(server_factory, disk_dir, disk="32MiB", slab_name=slab, port=port)
    assert _disk(again)["blocks"] == 0 and stats(again)["unique_blocks"] == 6
    wait_for(lambda: "are the slab's alone again" in again.log(), what="the marks cleared")
    _put_spilled(again, _blocks("new", 12))  # evicts the old ones
    removed = {e["hash"] for e in _events(again) if e["kind"] == "removed"}
    for address in old:
        held = request(again, "HEAD", f"/kv/{address}").status == 200
        assert held or address in removed, address


def test_sigkill_while_spilling_serves_no_wrong_bytes_and_keeps_what_was_spilled(
    server_factory, disk_dir
):
    srv = _serve(server_factory, disk_dir)
    spilled = _blocks("k", 12)
    _put_spilled(srv, spilled)
    more = _blocks("m", 40)
    stop = threading.Event()

    def put_more() -> None:
        for address, data in more.items():
            if stop.is_set():
                return
            with contextlib.suppress(OSError):
                request(srv, "PUT", f"/kv/{address}", data, timeout=5)

    writer = threading.Thread(target=put_more)
    writer.start()
    try:
        wait_for(lambda: _spills(srv) >= 16, what="spills under way")
        worker = next(p for p in psutil.Process(srv.pid).children() if p.pid != _disk(srv)["pid"])
        worker.send_signal(signal.SIGKILL)  # a worker, mid-stream
        wait_for(lambda: _spills(srv) >= 20, what="spills to go on")
        everyone = [srv.pid, *(p.pid for p in psutil.Process(srv.pid).children())]
        for pid in everyone:  # the whole server, at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        stop.set()
        writer.join(30)
    wait_for(lambda: srv.proc.poll() is not None, what="the supervisor's death")
    wait_for(lambda: all(not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie"
                         for p in everyone), what="every child's death")  # fmt: skip
    again = _serve(server_factory, disk_dir)
    assert _all_back(again, spilled) == {"equal": 12, "miss": 0}
    _all_back(again, more)  # whatever comes back is byte-equal


def test_damaged_records_are_misses_and_the_server_stays_up(server_factory, disk_dir):
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("x", 20)
    _put_spilled(srv, blocks)
    names = list(blocks)
    answer = request(srv, "POST", "/kv/batch/exists", json.dumps({"addresses": names}).encode())
    only_on_disk = [names[i] for i in answer.json()["on_disk"]]  # evicted from the slab
    assert len(only_on_disk) >= 12
    data_file = disk_dir / D.DATA_FILE
    raw = data_file.read_bytes()
    at = {a: raw.index(blocks[a][:64]) for a in only_on_disk}  # where each block lies
    del raw
    victim, cut = only_on_disk[0], only_on_disk[6]
    with open(data_file, "r+b") as f:  # one byte of the victim's block
        f.seek(at[victim] + 1000)
        byte = f.read(1)
        f.seek(at[victim] + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert request(srv, "GET", f"/kv/{victim}").status == 404
    assert _disk(srv)["checksum_failures"] == 1
    assert request(srv, "GET", f"/kv/{victim}").status == 404  # dropped: not read again
    os.truncate(data_file, at[cut] + 100)  # the file cut inside a block
    before = {a: blocks[a] for a in only_on_disk[1:] if at[a] < at[cut]}
    after = {a: blocks[a] for a in only_on_disk if at[a] >= at[cut]}
    assert _all_back(srv, after) == {"equal": 0, "miss": len(after)}
    assert _all_back(srv, before) == {"equal": len(before), "miss": 0}
    assert srv.healthz()["workers_up"] == 2 and srv.proc.poll() is None


def test_a_stopped_keeper_costs_disk_hits_only(server_factory, disk_dir):
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("p", 12)
    _put_spilled(srv, blocks)
    keeper = _disk(srv)["pid"]
    resident, on_disk = list(blocks)[-1], _on_disk(srv, list(blocks))[0]
    os.kill(keeper, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert request(srv, "GET", f"/kv/{resident}").body == blocks[resident]
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        assert request(srv, "GET", f"/kv/{on_disk}").status == 404  # a miss, not a wait
        assert time.monotonic() - t0 < 3
        assert stats(srv)["disk"]["ready"] is False
        # New blocks: each PUT asks the keeper whether the disk held it; while one
        # question waits for the stopped keeper, the others do not wait behind it.
        t0 = time.monotonic()
        for i in range(20):
            assert request(srv, "PUT", f"/kv/while-stopped-{i}", b"y" * 1000).status == 201
        assert time.monotonic() - t0 < 5  # 20 waits of a second each, had they waited
    finally:
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: request(srv, "GET", f"/kv/{on_disk}").status == 200, what="disk hits again")


def test_what_the_disk_never_held_needs_no_keeper(server_factory, disk_dir):
    """A worker reads the keeper's filter (DIR/filter) before it asks the keeper: with the
    keeper stopped, PUTs of new blocks are stored without asking it, and a GET, HEAD,
    exists, batch exists or DELETE of an address never stored is a 404 at once (the
    DELETE was a 503: the disk might have held it). What the disk holds still needs the
    keeper: its DELETE is a 503 while the keeper is stopped."""
    srv = _serve(server_factory, disk_dir, workers=1)
    blocks = _blocks("f", 12)
    _put_spilled(srv, blocks)
    on_disk = _on_disk(srv, list(blocks))[0]
    keeper, before = _disk(srv)["pid"], _disk(srv)
    os.kill(keeper, signal.SIGSTOP)
    try:
        for i in range(20):
            assert request(srv, "PUT", f"/kv/new-{i}", b"y" * 1000).status == 201
        assert request(srv, "GET", "/kv/never").status == 404
        assert request(srv, "HEAD", "/kv/never").status == 404
        assert request(srv, "GET", "/kv/never/exists").json()["exists"] is False
        body = json.dumps({"addresses": ["never", "new-0"]}).encode()
        assert request(srv, "POST", "/kv/batch/exists", body).json()["exists"] == [False, True]
        assert request(srv, "DELETE", "/kv/never").status == 404
    finally:
        os.kill(keeper, signal.SIGCONT)
    after = _disk(srv)
    assert after["unreachable"] == before["unreachable"]  # none of them asked the keeper
    assert after["filtered"] - before["filtered"] >= 25
    os.kill(keeper, signal.SIGSTOP)
    try:
        assert request(srv, "DELETE", f"/kv/{on_disk}").status == 503
    finally:
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: request(srv, "DELETE", f"/kv/{on_disk}").status == 204, what="the keeper")
    assert request(srv, "GET", f"/kv/{on_disk}").status == 404


def test_small_blocks_answered_by_the_fast_lane_hold_across_tiers(server_factory, disk_dir):
    """With a disk tier, small PUTs, GETs and HEADs go through the fast lane where the
    keeper's filter rules out a copy on disk, and past it where it does not: a small
    block PUT twice, spilled and evicted is found by HEAD, PUT again as a dedup hit that
    joins the copy's references, served, and deleted reference by reference."""
    srv = _serve(server_factory, disk_dir, workers=1)
    small = {f"small{i}": os.urandom(4 * KiB) for i in range(3)}
    for address, data in small.items():
        spilled = _spills(srv)
        assert request(srv, "PUT", f"/kv/{address}", data).status == 201
        assert request(srv, "PUT", f"/kv/{address}", data).status == 200  # in the slab
        wait_for(lambda s=spilled: _spills(srv) > s, what=f"the spill of {address}")
    address, data = next(iter(small.items()))
    _evict_to_disk(srv, address, "e")
    assert request(srv, "GET", "/kv/small-never").status == 404
    head = request(srv, "HEAD", f"/kv/{address}")
    assert head.status == 200 and int(head.headers["Content-Length"]) == len(data)
    assert request(srv, "PUT", f"/kv/{address}", data).status == 200  # joins the copy
    _held_by(srv, address, data, 3)


def test_the_disk_counters_go_on_when_the_keeper_is_started_again(server_factory, disk_dir):
    """They lived in the keeper's memory: after a SIGKILL of the keeper, spills went
    16 -> 0, disk hits 15 -> 0 (a reset, to Prometheus). They count on now; a new server
    counts from 0."""
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("c", 16)
    _put_spilled(srv, blocks)
    assert _all_back(srv, blocks) == {"equal": 16, "miss": 0}  # disk hits, promotions
    before = {k: v for k, v in _disk(srv).items() if k in COUNTER_NAMES}
    assert before["spills"] == 16 and before["disk_hits"] >= 8
    keeper = _disk(srv)["pid"]
    os.kill(keeper, signal.SIGKILL)
    wait_for(lambda: _disk(srv).get("pid") not in (None, keeper) and _disk(srv)["ready"],
             timeout=20, what="a new keeper, ready")  # fmt: skip
    after = _disk(srv)
    assert all(after[k] >= v for k, v in before.items()), (before, after)
    assert request(srv, "GET", f"/kv/{next(iter(blocks))}").status == 200
    assert srv.stop(signal.SIGTERM) == 0
    again = _serve(server_factory, disk_dir)
    assert _disk(again)["spills"] == 0 and _disk(again)["blocks"] == 16


def test_a_second_server_on_the_directory_is_refused(server_factory, disk_dir, tmp_path):
    srv = _serve(server_factory, disk_dir)
    for where, reason in (
        (disk_dir, f"in use by another eg-kv server (pid {srv.pid})"),
        (tmp_path, "writable by others"),
    ):
        if where == tmp_path:
            os.chmod(tmp_path, 0o777)
        out = subprocess.run(serve_cmd("--addr", f"127.0.0.1:{free_port()}", "--capacity", "4MiB",
                                       "--disk", str(where), "--disk-capacity", "64MiB"),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
        assert out.returncode != 0 and len(errors) == 1 and reason in errors[0], out.stderr
    os.chmod(tmp_path, 0o700)
    assert srv.healthz()["workers_up"] == 2


@pytest.mark.parametrize("name", [D.DATA_FILE, D.LOCK_FILE, D.SOCKET_FILE, "filter"])
def test_a_directory_in_place_of_a_file_of_the_tier_is_refused_in_one_line(disk_dir, name):
    """It was a 23-26 line traceback (the data file, the lock), or a keeper that died and
    was started again every second, forever (its socket)."""
    (disk_dir / name).mkdir()
    out = subprocess.run(serve_cmd("--addr", f"127.0.0.1:{free_port()}", "--capacity", "4MiB",
                                   "--disk", str(disk_dir), "--disk-capacity", "64MiB"),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert out.returncode != 0 and len(errors) == 1, out.stderr
    assert f"cannot use {name} (" in errors[0] and "remove or rename it" in errors[0]
    assert "Traceback" not in out.stderr


def test_a_client_reading_the_slab_itself_gets_disk_hits_over_http(server_factory, disk_dir):
    """On the server's host the client reads the slab itself; a block the slab evicted is
    asked of the server, which has it on disk (LocalInfo's ``disk``)."""
    srv = _serve(server_factory, disk_dir)
    blocks = {f"key-{i}": os.urandom(BLOCK) for i in range(16)}
    with RemoteKVConnector(base_url=srv.url, local_reads=True) as kv:
        for key, data in blocks.items():
            spilled = _spills(srv)
            assert kv.put(key, data)
            wait_for(lambda s=spilled: _spills(srv) > s, what=f"the spill of {key}")
        assert kv.exists_many(list(blocks)) == [True] * 16
        assert kv.exists_many(list(blocks), lease_ms=2000) == [True] * 16  # leased: the same
        kv.release(list(blocks))
        assert {key: kv.get(key) for key in blocks} == blocks
        assert kv.reads_locally
    assert _disk(srv)["promotions"] >= 8


def test_a_local_client_asks_the_server_only_about_misses_the_disk_may_hold(
    server_factory, disk_dir
):
    """A client reading the slab itself maps the disk tier's key filter the server names
    (``GET /kv/local/slab``): a miss the filter rules out is answered there, leasing
    lookups included; a batch with a miss the disk may hold asks the server, which
    finds it on disk. One worker, so its ``filtered`` count is every miss it was asked."""
    srv = _serve(server_factory, disk_dir, workers=1)
    blocks = {f"key-{i}": os.urandom(BLOCK) for i in range(12)}
    never = [f"never-{i}" for i in range(64)]
    with RemoteKVConnector(base_url=srv.url, local_reads=True) as kv:
        for key, data in blocks.items():
            spilled = _spills(srv)
            assert kv.put(key, data)
            wait_for(lambda s=spilled: _spills(srv) > s, what=f"the spill of {key}")
        on_disk = _on_disk(srv, list(blocks))
        assert on_disk and kv.reads_locally
        before = _disk(srv)["filtered"]
        assert kv.exists_many(never) == [False] * 64
        assert kv.exists_many(never, lease_ms=2000) == [False] * 64
        assert kv.get(never[0]) is None
        assert _disk(srv)["filtered"] == before  # not one of them reached the server
        # A miss the disk holds: the batch goes to the server, which filters the rest.
        assert kv.exists_many([on_disk[0], *never[:8]]) == [True] + [False] * 8
        assert _disk(srv)["filtered"] == before + 8
        assert kv.get(on_disk[0]) == blocks[on_disk[0]]
        assert kv.reads_locally


def _events(srv) -> list[dict]:
    return request(srv, "GET", "/kv/events?since=0&limit=10000").json()["events"]


def test_the_event_log_says_what_left_the_server_not_what_moved(server_factory, disk_dir):
    """An eviction of a block the disk holds is a move (no removal); a promotion is logged
    as stored; a block leaves the log when it leaves the last tier: a DELETE, or the
    disk's ring overwriting the only copy."""
    srv = _serve(server_factory, disk_dir, disk="8MiB")  # ~15 records of 512 KiB
    blocks = _blocks("v", 12)
    _put_spilled(srv, blocks)
    assert stats(srv)["evictions"] >= 4
    assert [e["kind"] for e in _events(srv)] == ["stored"] * 12  # evictions: moves
    names = list(blocks)
    answer = request(srv, "POST", "/kv/batch/exists", json.dumps({"addresses": names}).encode())
    first, second = [names[i] for i in answer.json()["on_disk"][:2]]  # on disk only
    assert request(srv, "GET", f"/kv/{first}").body == blocks[first]  # a promotion
    assert request(srv, "DELETE", f"/kv/{second}").status == 204  # its last reference
    tail = [(e["kind"], e["reason"], e["hash"]) for e in _events(srv)[12:]]
    assert ("stored", "put", first) in tail and ("removed", "delete", second) in tail
    more = _blocks("w", 12)  # the disk's ring goes round: the oldest records go
    _put_spilled(srv, more)
    wait_for(lambda: any(e["reason"] == "disk" for e in _events(srv)), what="a disk removal")
    removed = {e["hash"] for e in _events(srv) if e["kind"] == "removed"}
    held = {a for a in {**blocks, **more} if request(srv, "HEAD", f"/kv/{a}").status == 200}
    assert removed.isdisjoint(held)  # nothing held was said to be gone
    logged = set()  # replaying the log gives what the server holds, in either tier
    for e in _events(srv):
        (logged.add if e["kind"] == "stored" else logged.discard)(e["hash"])
    assert logged == held


def test_a_snapshot_lists_the_blocks_only_the_disk_holds(server_factory, disk_dir):
    srv = _serve(server_factory, disk_dir)
    blocks = _blocks("n", 12)
    _put_spilled(srv, blocks)
    only_on_disk = _on_disk(srv, list(blocks))
    assert len(only_on_disk) >= 4
    r = request(srv, "GET", "/kv/events/snapshot")
    assert r.status == 200
    lines = [json.loads(line) for line in r.text.splitlines()]
    listed = {line["hash"] for line in lines if "hash" in line}
    assert listed == set(blocks)  # the slab's blocks and the disk's, each at least once
    assert "seq" in lines[-1]  # the end line stays last


def test_a_tenants_quota_bounds_its_blocks_on_disk(server_factory, disk_dir, tmp_path):
    """A namespace with a 2 MiB quota keeps at most 2 MiB of blocks on disk too (its
    oldest go first); a namespace without one keeps all of its."""
    tokens = write_tokens(tmp_path / "tokens.toml", [
        {"name": "ops", "role": "admin"}, {"name": "small", "quota": "2MiB"},
        {"name": "big"},
    ])  # fmt: skip
    srv = _serve(server_factory, disk_dir, extra_args=("--tokens", str(tokens)))
    admin = token_of("ops")

    def disk() -> dict:
        return request(srv, "GET", "/kv/stats", token=admin).json()["disk"]

    def spills() -> int:
        return disk().get("spills", 0)  # none while the keeper does not answer

    wait_for(lambda: disk().get("ready"), what="the disk tier's scan")

    for name in ("small", "big"):
        for i in range(12):  # 6 MiB each
            before = spills()
            r = request(srv, "PUT", f"/kv/{name}-{i}", os.urandom(BLOCK), token=token_of(name))
            assert r.status == 201, r
            wait_for(lambda b=before: spills() > b, what=f"the spill of {name}-{i}")
    assert disk()["quota_drops"] >= 8  # 12 blocks of 512 KiB against 2 MiB
    served = {name: sum(request(srv, "GET", f"/kv/{name}-{i}", token=token_of(name)).status == 200
                        for i in range(12)) for name in ("small", "big")}  # fmt: skip
    assert served["small"] <= 4 and served["big"] == 12, served


def test_a_routers_resync_names_the_blocks_only_the_disk_holds(server_factory, disk_dir):
    """A KV-events subscriber that joins after the log lapped is resynced: its set is the
    blocks of both tiers, the disk-only ones included (the keeper lists them)."""
    ports = (free_port(), free_port())
    srv = _serve(server_factory, disk_dir, extra_args=kv_events_flags(ports, "--events", "16"))
    wait_for(lambda: _disk(srv).get("ready"), what="the disk tier's scan")
    blocks = _blocks("r", 20)  # 20 stores: the 16-entry log laps, so a joiner resyncs
    _put_spilled(srv, blocks)
    only_on_disk = _on_disk(srv, list(blocks))
    assert len(only_on_disk) >= 8
    sub = Subscriber(sys.executable, ports, "kv@pool:node:test@tiny", "llm-d")
    try:
        got = sub.dump()
        assert got["resyncs"] >= 1
        # llm-d's key: the last 8 bytes of a bytes hash (here, the address's bytes)
        want = {str(int.from_bytes(a.encode()[-8:], "big")) for a in blocks}
        assert (
            set(got["held"])
            == want
            == {str(int.from_bytes(a.encode()[-8:], "big")) for a in held_by(srv)}
        )
    finally:
        sub.close()


def test_a_peer_that_asks_the_keeper_without_reading_is_dropped(server_factory, disk_dir):
    """The keeper's answers to a peer that never reads do not pile up in its memory: it
    drops the connection (answers left unread past a cap, or not drained in time), and
    goes on serving the workers."""
    import socket

    from eg_kv.disk import wire

    srv = _serve(server_factory, disk_dir, workers=1)
    keeper = _disk(srv)["pid"]
    asks = b"".join(wire.frame([wire.STATS, i + 1]) for i in range(2000))  # ~1 KiB each back
    dropped = False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(disk_dir / D.SOCKET_FILE))
        s.settimeout(30)
        try:
            for _ in range(200):  # 400,000 asks, never a read: ~400 MB of answers
                s.sendall(asks)
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
    assert dropped, "the keeper took every ask and kept their answers"
    assert srv.log().count("a connection to the keeper was dropped") == 1  # said once
    assert _disk(srv)["pid"] == keeper and psutil.Process(keeper).memory_info().rss < 300 << 20


def _two_spilled(server_factory, disk_dir, prefix: str, workers: int):
    """A server with two blocks spilled: (server, blocks, the keeper's pid)."""
    srv = _serve(server_factory, disk_dir, workers=workers)
    blocks = _blocks(prefix, 2)
    _put_spilled(srv, blocks)
    return srv, blocks, _disk(srv)["pid"]


def test_a_delete_the_keeper_did_not_answer_reaches_the_next_keeper(server_factory, disk_dir):
    """A DELETE of a spilled block while the keeper is stopped: its discard times out,
    and the keeper is SIGKILLed before it reads the delete from the event log (a new one
    follows the log from its head). The worker sends the discard again once a keeper
    answers: the deleted block does not come back from the disk, before or after a
    restart (it did: the new keeper's scan indexed its record)."""
    srv, blocks, keeper = _two_spilled(server_factory, disk_dir, "d", workers=1)
    gone, kept = list(blocks)
    os.kill(keeper, signal.SIGSTOP)
    try:
        assert request(srv, "DELETE", f"/kv/{gone}").status == 204  # the slab's last ref
    finally:  # the DELETE waits ~5 s: the supervisor's watchdog may have killed it first
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper, signal.SIGKILL)
    wait_for(lambda: _disk(srv).get("pid") not in (None, keeper) and _disk(srv)["ready"],
             timeout=30, what="a new keeper")  # fmt: skip
    wait_for(lambda: _disk(srv)["blocks"] == 1, timeout=30, what="the discard sent again")
    assert request(srv, "GET", f"/kv/{gone}").status == 404
    assert srv.stop(signal.SIGTERM) == 0
    again = _serve(server_factory, disk_dir, workers=1)
    assert request(again, "GET", f"/kv/{gone}").status == 404
    assert request(again, "GET", f"/kv/{kept}").body == blocks[kept]


def _keeper_stats(disk_dir) -> dict | None:
    """The keeper's stats, asked on its own socket (no worker's call: a worker that calls
    the keeper sends it what it holds undone first); None while no keeper answers."""
    from eg_kv.disk import wire

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(disk_dir / D.SOCKET_FILE))
            s.sendall(wire.frame([wire.STATS, 1]))
            size = wire.FRAME.unpack(s.recv(4, socket.MSG_WAITALL))[0]
            return wire._decode(s.recv(size, socket.MSG_WAITALL))[1]
    except (OSError, ValueError, struct_error):
        return None


def test_a_delete_while_the_keeper_restarts_is_answered_once_the_new_keeper_has_it(
    server_factory, disk_dir
):
    """The keeper was SIGKILLed: a DELETE of a spilled block's last reference waits for
    the new keeper to take its discard before it answers. Before, it answered at once and
    only that worker remembered the discard: the other worker's GETs found the deleted
    block on the new keeper's disk, served it and promoted it back into the slab."""
    srv, blocks, keeper = _two_spilled(server_factory, disk_dir, "r", workers=2)
    gone, kept = list(blocks)
    os.kill(keeper, signal.SIGKILL)
    assert request(srv, "DELETE", f"/kv/{gone}").status == 204
    wait_for(lambda: ((st := _keeper_stats(disk_dir)) or {}).get("pid") not in (None, keeper)
             and st["ready"], timeout=30, what="a new keeper")  # fmt: skip
    # New connections: each worker gets some of them (SO_REUSEPORT spreads them).
    assert {request(srv, "GET", f"/kv/{gone}").status for _ in range(16)} == {404}
    assert request(srv, "GET", f"/kv/{kept}").body == blocks[kept]


def test_a_dedup_put_on_a_worker_without_a_keeper_connection_counts_on_disk(
    server_factory, disk_dir
):
    """A dedup PUT tells the keeper the block's new count in a report. A worker with no
    connection to the keeper (none made yet, or the keeper just started again) dropped
    it: the disk's copy kept a reference fewer, and once the block was only on disk its
    last holder's DELETE was a 404 (CI, about 1 run in 30 of the test of a PUT of other
    bytes above). Now the report is held and sent on the connection made for it."""
    srv = _serve(server_factory, disk_dir, workers=1)
    blocks = _blocks("k", 1)
    _put_spilled(srv, blocks)
    ((address, data),) = blocks.items()
    keeper = _disk(srv)["pid"]
    os.kill(keeper, signal.SIGKILL)  # the worker's connection ends with it
    wait_for(lambda: ((st := _keeper_stats(disk_dir)) or {}).get("pid") not in (None, keeper)
             and st["ready"], timeout=30, what="a new keeper")  # fmt: skip
    assert request(srv, "PUT", f"/kv/{address}", data).status == 200  # a second holder
    _evict_to_disk(srv, address, "k")
    _held_by(srv, address, data, 2)


def test_a_dedup_put_answered_from_its_head_counts_on_disk(server_factory, disk_dir):
    """A PUT with ``Expect: 100-continue`` of a resident block is a dedup hit answered
    from its head. Its reference was never told to the disk's copy: once the block was
    only on disk, its holders' last DELETE was a 404."""
    srv = _serve(server_factory, disk_dir, workers=1)
    ((address, data),) = _blocks("e", 1).items()
    _put_spilled(srv, {address: data})
    with socket.create_connection((srv.host, srv.port), timeout=30) as s:
        s.sendall(b"PUT /kv/%s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
                  b"Expect: 100-continue\r\n\r\n" % (address.encode(), len(data)))  # fmt: skip
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    _evict_to_disk(srv, address, "e")
    _held_by(srv, address, data, 2)


def test_a_put_of_a_block_the_disk_holds_and_a_delete_in_its_round_trip_keep_every_reference(
    server_factory, disk_dir
):
    """A PUT of a block only the disk holds (two references) and a DELETE of it, read by
    the worker together. The PUT used to publish the block with its own reference and
    then ask the keeper for the copy's: the DELETE, run in that round trip, took the
    only reference, so the block and its copy went with both holders' (a GET after was a
    404). Now the PUT asks first and publishes with all three; the keeper holds the
    DELETE back until then."""
    srv = _serve(server_factory, disk_dir, workers=1)
    address, data = "race-put-delete", os.urandom(4 * KiB)
    _put_spilled(srv, {address: data})
    assert request(srv, "PUT", f"/kv/{address}", data).status == 200  # a second holder
    _evict_to_disk(srv, address, "r")
    put, delete = (http.client.HTTPConnection(srv.host, srv.port, timeout=30) for _ in "12")
    try:
        for conn in (put, delete):  # kept alive, so both are the worker's before it stops
            conn.request("HEAD", "/kv/race-warm-up")
            reply = conn.getresponse()
            reply.read()
        worker = int(reply.headers[WORKER_HEADER])
        os.kill(worker, signal.SIGSTOP)
        try:
            wait_for(lambda: stopped(worker), timeout=10, what="the worker to stop")
            put.request("PUT", f"/kv/{address}", body=data)
            delete.request("DELETE", f"/kv/{address}")
        finally:
            os.kill(worker, signal.SIGCONT)
        answers = []
        for conn in (put, delete):
            reply = conn.getresponse()
            reply.read()
            answers.append(reply.status)
    finally:
        put.close()
        delete.close()
    assert answers == [200, 204]
    _held_by(srv, address, data, 2)  # the copy's two and the PUT's, less one


def test_a_delete_of_a_block_only_the_disk_holds_is_a_503_while_the_keeper_is_stopped(
    server_factory, disk_dir
):
    """Not a 404: the disk may hold the block, and a client told it is gone would not
    ask again. Once the keeper answers, the same DELETE is a 204."""
    srv = _serve(server_factory, disk_dir, workers=1)
    blocks = _blocks("q", 12)  # three times the slab: the first ones only on disk
    _put_spilled(srv, blocks)
    on_disk = _on_disk(srv, list(blocks))[0]
    keeper = _disk(srv)["pid"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        answer = request(srv, "DELETE", f"/kv/{on_disk}")
        assert answer.status == 503 and b"disk tier did not answer" in answer.body
    finally:
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: request(srv, "DELETE", f"/kv/{on_disk}").status == 204, timeout=30,
             what="the keeper to answer the DELETE")  # fmt: skip
    assert request(srv, "GET", f"/kv/{on_disk}").status == 404


def test_reports_to_a_stopped_keeper_are_dropped_not_queued(server_factory, disk_dir):
    """A worker's reports (a dedup PUT's reference count, here) to a keeper that does not
    read are dropped and counted, never queued without bound in the worker."""
    srv = _serve(server_factory, disk_dir, workers=1)
    blocks = _blocks("s", 12)
    _put_spilled(srv, blocks)
    resident, on_disk = list(blocks)[-1], _on_disk(srv, list(blocks))[0]
    before = _disk(srv)["unreachable"]
    keeper = _disk(srv)["pid"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        assert request(srv, "GET", f"/kv/{on_disk}").status == 404  # it times out: down
        for _ in range(50):
            assert request(srv, "PUT", f"/kv/{resident}", blocks[resident]).status == 200
    finally:
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: _disk(srv).get("ready"), what="the keeper to answer again")
    assert _disk(srv)["unreachable"] - before >= 51  # the GET's call and 50 reports


BIG = 8 * 1024 * KiB  # more than a stalled client's socket buffers take


def _serve_big(server_factory, disk_dir):
    """A server whose blocks are larger than the kernel buffers a send to a client that
    does not read: such a GET stays in its send, its block read from disk but not yet
    promoted into the slab."""
    srv = server_factory(workers=2, capacity="48MiB", extra=(
        "--page-size", "64KiB", "--max-block-size", "8MiB", "--disk", str(disk_dir),
        "--disk-capacity", "128MiB"))  # fmt: skip
    wait_for(lambda: _disk(srv).get("ready"), what="the disk tier's scan")
    return srv


class _StalledGet:
    """A keep-alive GET whose client reads the answer's head, then nothing until
    :meth:`rest` (the server's send waits on it meanwhile)."""

    def __init__(self, srv, address: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect((srv.host, srv.port))
        self.address = address
        self.buf = b""
        self._send("GET")
        head = self._head()
        assert head.startswith(b"HTTP/1.1 200"), head
        self.length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])

    def _send(self, method: str) -> None:
        self.sock.sendall(f"{method} /kv/{self.address} HTTP/1.1\r\nHost: x\r\n\r\n".encode())

    def _head(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            got = self.sock.recv(65536)
            assert got, "the server closed the connection"
            self.buf += got
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        return head

    def rest(self) -> bytes:
        """The body, read to its end."""
        while len(self.buf) < self.length:
            got = self.sock.recv(1 << 20)
            assert got, "the server cut the body short"
            self.buf += got
        body, self.buf = self.buf[: self.length], self.buf[self.length :]
        return body

    def head_again(self) -> bytes:
        """The status line of a HEAD on the same connection: answered only once the GET's
        handler has finished (after any promotion it made)."""
        self._send("HEAD")
        return self._head().split(b"\r\n")[0]

    def close(self) -> None:
        self.sock.close()


def test_a_delete_while_a_get_promotes_the_block_stays_deleted(server_factory, disk_dir):
    """The GET read the block from disk before the DELETE came, and gets it; the DELETE
    released the disk's last reference, so the promotion that follows the GET's send
    publishes nothing (it did: the deleted block came back into the slab)."""
    srv = _serve_big(server_factory, disk_dir)
    blocks = {f"p{i}": os.urandom(BIG) for i in range(7)}
    _put_spilled(srv, blocks)
    address = _on_disk(srv, list(blocks))[0]
    get = _StalledGet(srv, address)
    try:
        assert request(srv, "DELETE", f"/kv/{address}").status == 204
        assert get.rest() == blocks[address]
        assert get.head_again() == b"HTTP/1.1 404 Not Found"
    finally:
        get.close()
    assert request(srv, "GET", f"/kv/{address}").status == 404
    assert request(srv, "DELETE", f"/kv/{address}").status == 404


def test_two_gets_promoting_one_block_publish_its_references_once(server_factory, disk_dir):
    """Both GETs read the disk's copy (one reference) into pages of their own; the second
    to publish finds the first's block and adds nothing (it added the disk's references
    again: one DELETE left the block served)."""
    srv = _serve_big(server_factory, disk_dir)
    blocks = {f"w{i}": os.urandom(BIG) for i in range(7)}
    _put_spilled(srv, blocks)
    address = _on_disk(srv, list(blocks))[0]
    gets = [_StalledGet(srv, address) for _ in range(2)]
    try:
        for get in gets:
            assert get.rest() == blocks[address]
            assert get.head_again() == b"HTTP/1.1 200 OK"
    finally:
        for get in gets:
            get.close()
    assert request(srv, "DELETE", f"/kv/{address}").status == 204
    assert request(srv, "GET", f"/kv/{address}").status == 404


def test_spills_are_no_clients_reads(server_factory, disk_dir):
    """The keeper reads each block it spills from the slab: not a GET hit (or miss) of the
    block's namespace, and no second chance in eviction (every spill counted as a hit)."""
    srv = _serve(server_factory, disk_dir, workers=1)
    _put_spilled(srv, _blocks("n", 12))  # some of them spilled while they were there
    st = stats(srv)
    assert _disk(srv)["spills"] >= 12
    assert st["get_hits"] == 0 and st["get_misses"] == 0


def test_a_promotion_counts_no_dedup_hit_and_keeps_the_references(server_factory, disk_dir):
    """A block PUT three times, then only on disk: one GET promotes it with its three
    references. Each reference the promotion added counted a dedup hit (two for one GET,
    with no PUT); the references stay exact (three DELETEs free it)."""
    srv = _serve(server_factory, disk_dir, workers=1)
    data = os.urandom(BLOCK)
    for status in (201, 200, 200):
        assert request(srv, "PUT", "/kv/three", data).status == status
    for n in range(40):  # until the slab lets it go (a block of several references stays longer)
        if _on_disk(srv, ["three"]):
            break
        _put_spilled(srv, {f"fill{n:02d}": os.urandom(BLOCK)})
    assert _on_disk(srv, ["three"]) == ["three"]
    hits = stats(srv)["dedup_hits"]
    assert request(srv, "GET", "/kv/three").body == data
    wait_for(lambda: _disk(srv)["promotions"] >= 1, what="the promotion")
    assert stats(srv)["dedup_hits"] == hits
    assert [request(srv, "DELETE", "/kv/three").status for _ in range(4)] == [204] * 3 + [404]


def test_a_delete_of_a_block_never_spilled_does_not_wait_for_a_stopped_keeper(
    server_factory, disk_dir
):
    """The keeper is stopped: a block PUT meanwhile was never spilled, so its DELETE has
    no disk copy to wait for (it waited the 5 s a spilled block's discard may, about a
    client's whole timeout). A spilled block's DELETE still waits for the keeper."""
    srv = _serve(server_factory, disk_dir, workers=1)
    keeper = _disk(srv)["pid"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        assert request(srv, "PUT", "/kv/fresh", os.urandom(BLOCK)).status == 201
        t0 = time.monotonic()
        assert request(srv, "DELETE", "/kv/fresh").status == 204
        assert time.monotonic() - t0 < 1.5
    finally:
        os.kill(keeper, signal.SIGCONT)
