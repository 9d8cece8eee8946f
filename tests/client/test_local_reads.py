"""Same-host local reads: clients that map their server's slab read-only.

Real servers, real slabs, real processes: a reader SIGKILLed after counting, readers
hashing every hit under eviction churn, DELETEs and a SIGKILLed worker, a reader without
permission, a server restarted onto a new slab, tenants, a fork.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.common import wait_for
from helpers.kvcache import wait_completions
from helpers.server_procs import gone, workers_of
from helpers.tenants import token_of, write_tokens

from eg_kv.client.aio_connectors import AsyncRemoteKVConnector
from eg_kv.kvcache import RemoteKVConnector, RemoteKVL2Connector
from eg_kv.slab import layout as L
from eg_kv.slab.local import LocalInfo, LocalRetired, LocalSlab, LocalUnavailable
from eg_kv.slab.store import Slab

ROOT = Path(__file__).resolve().parents[2]
FORK = mp.get_context("fork")
KiB, MiB = 1024, 1024 * 1024


def content(address: str, size: int) -> bytes:
    """The bytes an address names in these tests (any reader can check a hit)."""
    seed = hashlib.sha256(address.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def stats(srv) -> dict:
    with urllib.request.urlopen(srv.url + "/kv/stats", timeout=5) as r:
        return json.loads(r.read())


def metrics(srv) -> str:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=5) as r:
        return r.read().decode()


def http_block_gets(srv) -> int:
    """GETs of blocks the (one-worker) server answered over HTTP, from /metrics."""
    pattern = r'eg_kv_requests_total\{method="GET",route="block",status="\d+"\} (\S+)'
    return int(sum(float(v) for v in re.findall(pattern, metrics(srv))))


def metric(srv, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", metrics(srv), re.M)
    assert m, name
    return float(m.group(1))


def test_a_client_on_the_host_reads_the_slab_and_counts_as_http(server_factory):
    srv = server_factory(workers=1, capacity="64MiB")
    big, small = content("big", 14 * MiB), content("small", 1000)
    with RemoteKVConnector(base_url=srv.url, local_reads=False) as http:
        assert http.put("big", big) and http.put("small", small)
        assert http.get("small") == small  # one HTTP GET, the baseline below
    gets, before = http_block_gets(srv), stats(srv)
    with RemoteKVConnector(base_url=srv.url) as kv:
        assert kv.get("big") == big
        buf = bytearray(15 * MiB)
        assert kv.get_into("big", buf) == len(big) and buf[: len(big)] == big
        assert kv.get_into("big", bytearray(MiB)) is None  # too small: a miss, as over HTTP
        assert kv.get("small") == small and kv.get("absent") is None
        assert kv.exists("small") and not kv.exists("absent") and kv.contains("big")
        assert kv.exists_many(["big", "absent", "small"]) == [True, False, True]
        assert kv.contains_prefix(["small", "big", "absent", "big"]) == 2
        assert kv._core.local.slab is not None, "the client did not map the slab"
    # Nothing went over HTTP, and the counters moved as if it had: 3 hits, 1 miss (a read
    # counts once it ends whole; the one into a buffer too small never did, as a send
    # whose client gave up).
    assert http_block_gets(srv) == gets
    after = stats(srv)
    assert (after["get_hits"] - before["get_hits"], after["get_misses"] - before["get_misses"]) == (
        3,
        1,
    )
    assert metric(srv, "eg_kv_get_hits_total") == after["get_hits"]
    # Both segments are the owner's only.
    for name in (srv.slab_name, srv.slab_name + L.READERS_SUFFIX):
        assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("eg-kv-test-copy")]


def test_the_async_client_reads_locally_and_copies_large_blocks_off_the_loop(server_factory):
    srv = server_factory(workers=1, capacity="64MiB")
    big, small = content("big", 14 * MiB), content("small", 1000)
    with RemoteKVConnector(base_url=srv.url, local_reads=False) as http:
        assert http.put("big", big) and http.put("small", small)
    gets, before = http_block_gets(srv), stats(srv)

    async def reads() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="eg-kv-test-copy"))
        async with AsyncRemoteKVConnector(base_url=srv.url) as kv:
            assert await kv.get("small") == small and await kv.get("absent") is None
            assert await kv.exists("small") and not await kv.exists("absent")
            assert kv._core.local.slab is not None, "the async client did not map the slab"
            assert not _copy_threads(), "a small block left the event loop"
            assert await kv.get("big") == big
            assert _copy_threads(), "a 14 MiB block was copied in the event loop"

    asyncio.run(reads())
    assert http_block_gets(srv) == gets  # nothing went over HTTP
    after = stats(srv)
    assert after["get_hits"] - before["get_hits"] == 2
    assert after["get_misses"] - before["get_misses"] == 1


_CLOSE_DURING_COPY = textwrap.dedent(
    """
    import sys, threading
    from eg_kv.slab.local import LocalInfo, LocalRetired, LocalSlab
    local = LocalSlab.open(LocalInfo.from_json(__import__("json").loads(sys.argv[1])))
    halfway, closed = threading.Event(), threading.Event()

    def sink(length, read_exact):
        buf = bytearray(length)
        view = memoryview(buf)
        read_exact(view[: length // 2])
        halfway.set()
        closed.wait(10)
        read_exact(view[length // 2 :])  # a memmove from the mapping another thread closed
        return bytes(buf)

    out = []
    t = threading.Thread(target=lambda: out.append(local.fetch("big", 1 << 30, sink)))
    t.start()
    halfway.wait(10)
    local.close()
    closed.set()
    t.join(10)
    assert out == [bytes(range(256)) * 8192], "the copy went wrong"
    try:
        local.fetch("big", 1 << 30, sink)
    except LocalRetired:
        print("ok", flush=True)
    """
)


def test_closing_a_local_slab_waits_for_the_copy_in_flight(slab_name):
    slab = Slab.create(slab_name, 8 * MiB, page_size=64 * KiB, max_block_size=4 * MiB)
    try:
        slab.put("big", bytes(range(256)) * 8192)  # 2 MiB: copied by memmove
        doc = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0)
        # In a child: unmapping under its copy would kill it with SIGSEGV.
        out = subprocess.run(
            [sys.executable, "-c", _CLOSE_DURING_COPY, json.dumps(doc)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr[-2000:]
    finally:
        slab.close()
        Slab.unlink_named(slab.name)


def test_a_new_mapping_maps_the_slab_tables_ahead_of_its_lookups(slab_name):
    """A lookup of a key whose slot this reader had not read faulted the slot's page into
    its page tables (16 faults in 32 lookups of new keys, 217 against 135 µs for the
    call). A new mapping maps the tables at once: lookups of 512 keys spread over a 12 MiB
    table fault none of its pages in (208 faults before, 31 now: the call's own memory)."""
    slab = Slab.create(slab_name, 64 * MiB, page_size=4 * KiB)
    try:
        keys = [f"spread-{i}" for i in range(512)]
        for key in keys:
            slab.put(key, b"v" * 100)
        doc = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0)
        with LocalSlab.open(LocalInfo.from_json(json.loads(json.dumps(doc)))) as local:
            local.exists_addresses([f"other-{i}" for i in range(4)])  # the code path, once
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            found = local.exists_addresses(keys)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert found == [True] * len(keys)
        assert faults < 100, f"{faults} page faults in 512 lookups"
    finally:
        slab.close()
        Slab.unlink_named(slab.name)


_CLOSE_DURING_LOOKUPS = textwrap.dedent(
    """
    import json, random, sys, threading, time
    from eg_kv.slab.local import LocalInfo, LocalSlab, LocalUnavailable
    sys.setswitchinterval(1e-5)  # interleave the two threads finely (as more cores would)
    info = LocalInfo.from_json(json.loads(sys.argv[1]))
    addrs = [f"k{i}" for i in range(16)]
    bad, rounds, end = [], 0, time.monotonic() + 20
    while not bad and rounds < 300 and time.monotonic() < end:
        local, done = LocalSlab.open(info), [0]

        def lookups():
            while True:
                try:
                    assert local.lease_addresses(addrs, 1000) == [True] * 16
                    local.release_leases(addrs)
                    local.exists_addresses(addrs)
                except LocalUnavailable:  # closed: the caller's HTTP
                    return
                except Exception as e:
                    bad.append(repr(e))
                    return
                done[0] += 1

        t = threading.Thread(target=lookups)
        t.start()
        wanted = random.randrange(20)
        while done[0] < wanted and t.is_alive():
            pass
        local.close()  # what a lookup that found the slab retired does (step_aside)
        t.join(10)
        rounds += 1
    print(json.dumps({"rounds": rounds, "bad": bad}), flush=True)
    """
)


def test_closing_a_local_slab_waits_for_the_lookups_in_flight(slab_name):
    # Old code: close() unmapped at once, and a lookup, lease or release on another thread
    # raised ValueError (released memoryview, closed mmap) into its caller: the L2
    # adapter's submit_batch_exists, a connector's release().
    slab = Slab.create(slab_name, 8 * MiB, page_size=64 * KiB, max_block_size=1 * MiB)
    try:
        for i in range(16):
            slab.put(f"k{i}", b"x" * 4096)
        doc = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0, lease_ms=5000)
        out = subprocess.run(
            [sys.executable, "-c", _CLOSE_DURING_LOOKUPS, json.dumps(doc)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout)
        assert result["bad"] == [] and result["rounds"] > 0, result
    finally:
        slab.close()
        Slab.unlink_named(slab.name)


_COUNTING_READER = textwrap.dedent(
    """
    import sys
    from eg_kv.kvcache import RemoteKVConnector
    kv = RemoteKVConnector(base_url=sys.argv[1])
    hits = sum(kv.get("blk") is not None for _ in range(int(sys.argv[2])))
    misses = sum(kv.get("nope") is None for _ in range(int(sys.argv[3])))
    assert kv._core.local.slab is not None
    print(hits, misses, flush=True)
    sys.stdin.read()  # wait to be killed
    """
)


def test_local_counts_survive_the_readers_sigkill(server_factory):
    srv = server_factory(workers=1)
    with RemoteKVConnector(base_url=srv.url, local_reads=False) as http:
        assert http.put("blk", b"x" * 5000)
    before = stats(srv)
    for hits, misses in ((30, 20), (7, 3)):  # the second reader may take the first's entry
        proc = subprocess.Popen(
            [sys.executable, "-c", _COUNTING_READER, srv.url, str(hits), str(misses)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout.readline().split() == [str(hits), str(misses)]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    after = stats(srv)
    assert after["get_hits"] - before["get_hits"] == 37
    assert after["get_misses"] - before["get_misses"] == 23


def _churn_reader(url: str, seconds: float, seed: int, out) -> None:
    rng = random.Random(seed)
    kv = RemoteKVConnector(base_url=url, timeout_s=5)
    hits = misses = wrong = 0
    buf = bytearray(MiB)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = f"c{rng.randrange(120)}"
        size = 64 * KiB * (1 + int(a[1:]) % 12)
        if rng.random() < 0.5:
            got = kv.get(a)
        else:
            n = kv.get_into(a, buf)
            got = None if n is None else bytes(buf[:n])
        if got is None:
            misses += 1
        elif got == content(a, size):
            hits += 1
        else:
            wrong += 1
    out.put((hits, misses, wrong, kv._core.local.slab is not None))
    kv.close()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_local_readers_under_churn_deletes_and_a_sigkilled_worker_never_get_wrong_bytes(
    server_factory,
):
    # 16 MiB of 64 KiB pages for 120 blocks of 64-768 KiB: every PUT evicts.
    srv = server_factory(workers=2, capacity="16MiB")
    out = FORK.Queue()
    readers = [FORK.Process(target=_churn_reader, args=(srv.url, 6.0, s, out)) for s in (1, 2)]
    for p in readers:
        p.start()
    rng = random.Random(7)
    killed = False
    try:
        with RemoteKVConnector(base_url=srv.url, timeout_s=5, local_reads=False) as w:
            deadline = time.monotonic() + 6.0
            n = 0
            while time.monotonic() < deadline and n < 20_000:
                a = f"c{rng.randrange(120)}"
                if rng.random() < 0.8:
                    w.put(a, content(a, 64 * KiB * (1 + int(a[1:]) % 12)))
                else:
                    w.delete(a)
                n += 1
                if n == 200 and not killed:
                    os.kill(min(workers_of(srv)), signal.SIGKILL)  # a worker, mid-traffic
                    killed = True
        results = [out.get(timeout=60) for _ in readers]
    finally:
        for p in readers:
            p.join(30)
    assert killed
    assert all(p.exitcode == 0 for p in readers), [p.exitcode for p in readers]
    print("readers (hits, misses, wrong, local):", results)
    assert sum(r[2] for r in results) == 0, "a local reader got bytes that were not the block's"
    assert all(r[3] for r in results), "a reader did not read locally"
    assert sum(r[0] for r in results) > 50 and sum(r[1] for r in results) > 0
    assert srv.healthz()["workers_up"] == 2  # the killed worker was replaced


@pytest.mark.slow
def test_local_reads_off_or_without_permission_use_http(server_factory):
    srv = server_factory(workers=1)
    with RemoteKVConnector(base_url=srv.url, local_reads=False) as kv:
        assert kv.put("p", b"payload") and kv.get("p") == b"payload"
        assert kv._core.local.slab is None
    env_off = {**os.environ, "EPISTEMIC_GRAPH_KVCACHE_LOCAL_READS": "off"}
    code = (
        "import sys; from eg_kv.kvcache import RemoteKVConnector as C; "
        "kv = C(base_url=sys.argv[1]); assert kv.get('p') == b'payload'; "
        "assert kv._core.local.slab is None; print('http')"
    )
    out = subprocess.run([sys.executable, "-c", code, srv.url], cwd=ROOT, env=env_off,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "http", out.stderr[-2000:]

    # Another user (the slab is 0600): the open fails, HTTP answers, the bytes are right.
    def as_nobody(q) -> None:
        os.setgid(65534)
        os.setuid(65534)
        kv = RemoteKVConnector(base_url=srv.url)
        q.put((kv.get("p"), kv.exists_many(["p", "q"]), kv._core.local.slab is None))

    if os.geteuid() != 0:
        pytest.fail("this test needs root, as CI runs it, to become another user")
    q = FORK.Queue()
    p = FORK.Process(target=as_nobody, args=(q,))
    p.start()
    assert q.get(timeout=30) == (b"payload", [True, False], True)
    p.join(10)


def test_another_slab_another_layout_or_a_busy_table_is_never_read(slab_name):
    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        slab.put("a", b"A" * 100)
        doc = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0)
        local = LocalSlab.open(LocalInfo.from_json(doc))
        assert local.get("a") == b"A" * 100
        for bad, why in (
            ({"slab_id": "00" * 16}, "another slab"),
            ({"layout_version": L.VERSION - 1}, "layout version"),
            ({"total_size": 12345}, "not the server's slab"),
            ({"slab": "/eg-kv-no-such-slab"}, "cannot open"),
        ):
            with pytest.raises(LocalUnavailable, match=why):
                LocalSlab.open(LocalInfo.from_json({**doc, **bad}))
        # Where loads may be reordered (not x86), lookups cannot go without the lock.
        import eg_kv.slab.local

        eg_kv.slab.local.LOCKFREE_READS = False
        try:
            with pytest.raises(LocalUnavailable, match="memory ordering"):
                LocalSlab.open(LocalInfo.from_json(doc))
        finally:
            eg_kv.slab.local.LOCKFREE_READS = True
        for hostile in ({"slab": "../etc/passwd"}, {"readers": "/a/b"}, {"slab_id": "zz"}, {}):
            with pytest.raises(LocalUnavailable):
                LocalInfo.from_json({**doc, **hostile} if hostile else {})
        # A writer that never leaves its critical section: lookups give up, never guess.
        slab._state[L.ST_SEQ] += 1
        with pytest.raises(LocalUnavailable, match="busy"):
            local.get("a")
        slab._state[L.ST_SEQ] += 1
        assert local.get("a") == b"A" * 100
        # A hit leaves a hint that the owner folds into the slot's CLOCK reference count.
        i, _ = slab._find(*slab._key("a"))
        slab._mm[slab._slot_off(i) + L.SLOT_REF_OFFSET] = 0
        assert local.get("a") is not None and slab.fold_local_hits() == 1
        assert slab._read_slot(i)[L.F_REF] == L.REF_TOUCHED and slab.fold_local_hits() == 0
        # Removing the slab retires it: the reader lets it go.
        Slab.unlink_named(slab_name)
        with pytest.raises(LocalRetired):
            local.get("a")
        local.close()
    finally:
        slab.close()
        Slab.unlink_named(slab_name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL then --fresh"])
def test_a_server_restarted_onto_a_new_slab_is_never_read_through_the_old_mapping(
    server_factory, how
):
    old = server_factory(workers=1)
    with RemoteKVConnector(base_url=old.url, timeout_s=5) as kv:
        assert kv.put("same", b"old bytes")
        assert kv.get("same") == b"old bytes" and kv._core.local.slab is not None
        mapped = kv._core.local.slab
        if how == "SIGTERM":
            old.stop(signal.SIGTERM)  # removes (and retires) its slab
            extra: tuple[str, ...] = ()
        else:
            orphans = workers_of(old)
            old.stop(signal.SIGKILL)  # the slab stays, and its name
            # Its worker drains and exits by itself; until then it still answers on the
            # port, and the new server's readiness check could be answered by it.
            wait_for(lambda: all(gone(pid) for pid in orphans), timeout=30)
            extra = ("--fresh",)
        new = server_factory(workers=1, port=old.port, slab_name=old.slab_name, extra=extra)
        with RemoteKVConnector(base_url=new.url, local_reads=False) as http:
            assert http.put("same", b"new bytes")
        # The old mapping is let go at the first read (which goes over HTTP); the next
        # maps the new slab.
        assert kv.get("same") == b"new bytes"
        assert kv.get("same") == b"new bytes"
        assert kv._core.local.slab is not None and kv._core.local.slab is not mapped


@pytest.mark.slow
def test_with_tenants_only_an_admin_reads_locally(server_factory, tmp_path):
    tenants = [{"name": "team-a", "role": "readwrite"}, {"name": "ops", "role": "admin"}]
    path = write_tokens(tmp_path / "tokens.toml", tenants)
    srv = server_factory(workers=1, extra=("--tokens", str(path)))
    for who, local in (("team-a", False), ("ops", True)):
        with RemoteKVConnector(base_url=srv.url, token=token_of(who)) as kv:
            assert kv.put(f"{who}-blk", b"mine")
            assert kv.get(f"{who}-blk") == b"mine"
            assert (kv._core.local.slab is not None) is local, who
            assert kv.get("team-a-blk" if who == "ops" else "ops-blk") is None  # namespaces
    req = urllib.request.Request(
        srv.url + "/kv/local/slab", headers={"Authorization": f"Bearer {token_of('team-a')}"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 403 and b"needs role admin" in e.value.read()


def test_a_forked_child_maps_the_slab_anew(server_factory):
    srv = server_factory(workers=1)
    with RemoteKVConnector(base_url=srv.url) as kv:
        assert kv.put("f", b"forked") and kv.get("f") == b"forked"
        parent_map = kv._core.local.slab
        before = stats(srv)["get_hits"]

        def child(q) -> None:
            # The first read lets the parent's mapping go (and goes over HTTP); the next
            # maps the slab anew, with an entry of its own.
            got = (kv.get("f"), kv.get("f"))
            q.put((got, kv._core.local.slab is not None and kv._core.local.slab is not parent_map))

        q = FORK.Queue()
        p = FORK.Process(target=child, args=(q,))
        p.start()
        assert q.get(timeout=30) == ((b"forked", b"forked"), True)
        p.join(10)
        assert kv.get("f") == b"forked" and kv._core.local.slab is parent_map
        assert stats(srv)["get_hits"] - before == 3


def test_the_lmcache_l2_adapter_loads_locally(server_factory):
    srv = server_factory(workers=1, capacity="128MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, num_workers=2)
    try:
        keys = [f"m@0@0@{i:064x}" for i in range(4)]
        blocks = [bytearray(os.urandom(3 * MiB + 5)) for _ in keys]
        f_set = conn.submit_batch_set(keys, [memoryview(b) for b in blocks])
        assert wait_completions(conn, {f_set})[f_set][3] == [True] * 4
        # The first load asks where the slab is (a load alongside it may go over HTTP
        # meanwhile); from then on nothing does.
        warm = bytearray(len(blocks[0]))
        f_warm = conn.submit_batch_get(keys[:1], [memoryview(warm)])
        assert wait_completions(conn, {f_warm})[f_warm][3] == [True] and warm == blocks[0]
        gets = http_block_gets(srv)
        f_has = conn.submit_batch_exists(keys)
        assert wait_completions(conn, {f_has})[f_has][3] == [True] * 4
        outs = [bytearray(len(b)) for b in blocks]
        f_get = conn.submit_batch_get(keys, [memoryview(o) for o in outs])
        assert wait_completions(conn, {f_get})[f_get][3] == [True] * 4
        assert outs == blocks
        assert http_block_gets(srv) == gets, "the loads went over HTTP"
        assert conn._client._core.local.slab is not None
        # A connector that only looks up (inline, under a short deadline) maps the slab
        # too: the probe runs on its own thread, never inside the lookup.
        lookups = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, num_workers=2)
        try:

            def mapped() -> bool:
                f = lookups.submit_batch_exists(keys)
                assert wait_completions(lookups, {f})[f][3] == [True] * 4
                return lookups._client._core.local.slab is not None

            wait_for(mapped, timeout=20, what="inline lookups to map the slab")
        finally:
            lookups.close()
    finally:
        conn.close()


def test_a_full_readers_table_refuses_cleanly_and_stale_counts_are_dropped(slab_name):
    import fcntl
    import struct

    import posix_ipc

    slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        slab.put("a", b"A")
        info = LocalInfo.from_json(
            LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0)
        )
        with LocalSlab.open(info) as local:
            assert local.get("a") == b"A" and local.get("b") is None
        assert (slab.stats()["get_hits"], slab.stats()["get_misses"]) == (1, 1)
        # Every entry owned by a live reader (here: locks through another descriptor).
        holder = os.open("/dev/shm" + info.readers, os.O_RDWR)
        try:
            for e in range(L.NREADERS):
                start = L.READERS_HEADER_SIZE + e * L.READER_ENTRY_SIZE
                lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0)
                fcntl.fcntl(holder, fcntl.F_OFD_SETLK, lock)
            fds = len(os.listdir("/proc/self/fd"))
            with pytest.raises(LocalUnavailable, match="taken"):
                LocalSlab.open(info)
            assert len(os.listdir("/proc/self/fd")) == fds, "a refused open leaked descriptors"
        finally:
            os.close(holder)
        # The slab removed without its readers segment, and a new one made with its name:
        # the old counts are not the new slab's.
        slab.close()
        posix_ipc.unlink_shared_memory(slab_name)
        slab = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
        assert (slab.stats()["get_hits"], slab.stats()["get_misses"]) == (0, 0)
    finally:
        slab.close()
        Slab.unlink_named(slab_name)


def test_a_probe_answered_after_close_maps_nothing(server_factory, monkeypatch):
    """An inline lookup's probe can be answered after its client closed: the mapping it
    names is let go at once (it was kept, and nothing would ever unmap it: an fd, a
    mapping of the whole slab and one of its reader entries)."""
    from eg_kv.client.localreads import LocalReads

    srv = server_factory(workers=1, capacity="32MiB")
    with urllib.request.urlopen(srv.url + "/kv/local/slab", timeout=10) as r:
        body = r.read()
    reads = LocalReads(enabled=True)
    reads.adopt(200, body)  # open: it maps
    assert reads.slab is not None
    reads.close()
    assert reads.slab is None
    opened: list[LocalSlab] = []
    real_open = LocalSlab.open
    monkeypatch.setattr(
        LocalSlab, "open", lambda info: opened.append(real_open(info)) or opened[-1]
    )
    reads.adopt(200, body)
    assert reads.slab is None and len(opened) == 1 and opened[0].closed
