"""Tenants below the server: the tokens file's grammar and the slab's namespaces."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys

import pytest
from helpers.common import ROOT
from helpers.tenants import token_of, tokens_toml

from eg_kv.errors import Busy, ConfigError, InsufficientStorage
from eg_kv.server import tenants
from eg_kv.slab import layout as L
from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024
GOOD = [
    {"name": "team-a", "role": "readwrite", "quota": "1MiB"},
    {"name": "team-a-ro", "role": "readonly", "namespace": "team-a"},
    {"name": "ops", "role": "admin"},
]


# ---------------------------------------------------------------------------- the file


def test_parse_finds_tenants_by_the_digest_of_their_token():
    table = tenants.parse(tokens_toml(GOOD), 64 * MiB)
    a = table.find(token_of("team-a").encode())
    assert a is not None and (a.name, a.role, a.namespace, a.quota) == (
        "team-a", "readwrite", "team-a", MiB,
    )  # fmt: skip
    ro = table.find(token_of("team-a-ro").encode())
    assert ro is not None and ro.namespace == "team-a" and not ro.can_write
    assert table.find(b"tok-unknown") is None
    assert table.quotas == {"team-a": MiB, "ops": 0}
    # The table holds digests only: no token appears in it.
    assert all(len(d) == 32 for d in table.by_digest)


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        tenants.parse(text, 64 * MiB, "tokens file t.toml")
    return str(e.value)


def test_bad_files_name_the_line():
    good = tokens_toml(GOOD)
    dup_digest = hashlib.sha256(token_of("team-a").encode()).hexdigest()
    dup = good + f'[[tenant]]\nname = "x"\ntoken_sha256 = "{dup_digest}"\nrole = "admin"\n'
    line = dup.splitlines().index(f'token_sha256 = "{dup_digest}"', 5) + 1
    msg = _error(dup)
    assert f"line {line}:" in msg and "duplicate token" in msg and "team-a" in msg
    lines = good.splitlines()
    admin_line, quota_line = lines.index('role = "admin"') + 1, lines.index('quota = "1MiB"') + 1
    msg = _error(good.replace('role = "admin"', 'role = "root"'))
    assert f"line {admin_line}:" in msg and "unknown role 'root'" in msg
    msg = _error(good.replace('quota = "1MiB"', 'quota = "lots"'))
    assert f"line {quota_line}:" in msg and "bad quota" in msg
    msg = _error(good.replace('quota = "1MiB"', 'quota = "1GiB"'))
    assert "over the slab's capacity" in msg and f"line {quota_line}:" in msg
    assert "line 2" in _error('[[tenant]]\nname = "a\n')  # TOML's own error names the line
    assert "no [[tenant]]" in _error("")
    assert "token_sha256 must be 64 hex" in _error(good.replace(dup_digest, "abc"))
    assert "unknown key" in _error(good.replace('role = "admin"', 'role = "admin"\ntoken = "x"'))


def test_the_single_token_is_an_admin_of_the_default_namespace():
    table = tenants.single_token("s3cret")
    t = table.find(b"s3cret")
    assert t is not None and t.is_admin and t.ns == 0 and t.namespace == ""
    assert table.find(b"s3cre") is None


# ---------------------------------------------------------------------------- namespaces


@pytest.fixture
def small(slab_name):
    """4 MiB of 64 KiB pages."""
    s = Slab.create(slab_name, 4 * MiB, page_size=64 * KiB, max_block_size=MiB)
    yield s
    s.close()


def test_namespaces_isolate_addresses_and_keep_their_ids(small, slab_name):
    ids = small.bind_namespaces({"": 0, "a": 0, "b": 0})
    a, b = ids["a"], ids["b"]
    assert ids[""] == 0 and len({0, a, b}) == 3
    assert small.put("x", b"A" * 100, a) is True
    assert small.exists_many(["x"], a) == [True]  # where it lies is remembered for a only
    assert small.get("x", b) is None and small.get("x") is None
    assert not small.exists("x", b) and small.exists_many(["x"], b) == [False]
    assert small.put("x", b"B" * 200, b) is True  # its own copy, another length: no 409
    assert small.put("x", b"A" * 100, a) is False  # dedup within a: one more reference
    assert small.delete("x", b) is True and small.get("x", a) == b"A" * 100
    assert small.delete("x", b) is False
    small.put("x", b"D" * 300)  # the default namespace: a third block
    st = small.namespace_stats()
    assert st["a"]["unique_blocks"] == 1 and st["a"]["total_refs"] == 2
    assert (st[""]["unique_blocks"], st[""]["resident_bytes"], st[""]["puts_created"]) == (
        1, 300, 1,
    )  # fmt: skip
    assert st["b"]["unique_blocks"] == 0 and st["b"]["deletes"] == 1
    assert small.check() == []
    # Another process (and a restart of the same slab) gets the same ids.
    with Slab.attach(slab_name) as other:
        assert other.bind_namespaces({"b": 0, "c": 0, "a": 0})["a"] == a
        assert other.get("x", a) == b"A" * 100


def test_repair_keeps_every_block_in_its_namespace(small):
    ids = small.bind_namespaces({"a": 0, "b": 0})
    small.put("k", b"a", ids["a"])
    small.put("k", b"bb", ids["b"])
    small._state[L.ST_FREE_COUNT] += 3  # damage a counter: repair rebuilds from the slots
    small._nsw[ids["a"] * L.NS_WORDS + L.NS_BLOCKS] = 7
    problems = small.repair()
    assert any("namespace" in p for p in problems)
    assert small.check() == []
    assert small.get("k", ids["a"]) == b"a" and small.get("k", ids["b"]) == b"bb"


def test_quota_evicts_the_namespace_own_blocks_only(small):
    ids = small.bind_namespaces({"big": 0, "capped": 512 * KiB})
    big, capped = ids["big"], ids["capped"]
    for k in range(16):  # 1 MiB of big's blocks
        small.put(f"b{k}", bytes(64 * KiB), big)
    for k in range(40):  # 2.5 MiB through a 512 KiB quota
        small.put(f"c{k}", bytes(64 * KiB), capped)
    st = small.namespace_stats()
    assert st["capped"]["resident_bytes"] <= 512 * KiB
    assert st["capped"]["evictions"] >= 32 and st["big"]["evictions"] == 0
    assert all(small.exists(f"b{k}", big) for k in range(16))
    assert small.check() == []
    with pytest.raises(InsufficientStorage, match="quota"):
        small.put("huge", bytes(600 * KiB), capped)


def test_a_full_slab_still_evicts_as_before(small):
    ids = small.bind_namespaces({"a": 0})
    for k in range(80):  # 5 MiB into 4 MiB
        small.put(f"a{k}", bytes(64 * KiB), ids["a"])
    st = small.namespace_stats()["a"]
    assert st["evictions"] >= 16 and st["resident_bytes"] <= 4 * MiB
    assert small.check() == []


def test_a_quota_lowered_under_an_upload_refuses_it_and_frees_its_pages(small):
    ids = small.bind_namespaces({"a": MiB})
    handle = small.begin_put("big", 512 * KiB, ns=ids["a"])
    handle.write(bytes(512 * KiB))
    small.bind_namespaces({"a": 256 * KiB})  # a reload lowered the quota meanwhile
    with pytest.raises(InsufficientStorage, match="quota"):
        handle.commit()
    st = small.stats()
    assert st["reserved_pages"] == 0 and st["free_bytes"] == st["capacity_bytes"]
    assert small.check() == []


def test_a_quota_counts_pages_not_bytes(small):
    """Issue 21 item 3: 1,100 one-byte blocks under a 1 MiB quota took 1,100 64 KiB pages
    (the quota counted 1,100 bytes) and evicted another namespace under its own quota."""
    ids = small.bind_namespaces({"tiny": MiB, "other": 3 * MiB})
    tiny, other = ids["tiny"], ids["other"]
    for k in range(32):  # 2 MiB of other's blocks: half the slab, under its quota
        small.put(f"o{k}", bytes(64 * KiB), other)
    for k in range(1100):
        small.put(f"t{k}", b"x", tiny)
    st = small.namespace_stats()
    assert st["other"]["evictions"] == 0
    assert all(small.exists(f"o{k}", other) for k in range(32))
    assert st["tiny"]["slot_pages"] <= 16 and st["tiny"]["unique_blocks"] <= 16
    assert st["tiny"]["evictions"] >= 1100 - 16
    assert st["tiny"]["quota_used_bytes"] == st["tiny"]["slot_pages"] * 64 * KiB <= MiB
    assert st["tiny"]["resident_bytes"] == st["tiny"]["unique_blocks"]  # one byte each
    assert small.check() == []


def test_uploads_in_flight_count_against_their_quota(small):
    """Issue 21 item 4: uploads in flight were not charged to their namespace, so four
    stalled 1 MiB uploads under a 1 MiB quota evicted another namespace's blocks. Now the
    first holds the quota, the others get Busy (503), and only the namespace's own blocks
    are ever evicted for it."""
    ids = small.bind_namespaces({"a": MiB, "b": 3 * MiB})
    a, b = ids["a"], ids["b"]
    for k in range(32):
        small.put(f"b{k}", bytes(64 * KiB), b)
    held, refused = [], []
    for k in range(4):
        try:
            held.append(small.begin_put(f"u{k}", MiB, ns=a))
        except Busy as e:
            refused.append(str(e))
    try:
        assert small.namespace_stats()["b"]["evictions"] == 0
        assert all(small.exists(f"b{k}", b) for k in range(32))
        assert len(held) == 1 and len(refused) == 3
        assert "uploads in flight hold 1048576 bytes of its quota" in refused[0]
        assert "namespace a" in refused[0] and "raise the quota" in refused[0]
        with pytest.raises(Busy):  # a small put waits for the upload too
            small.put("small", b"s", a)
        st = small.namespace_stats()["a"]
        assert (st["reserved_pages"], st["reserved_bytes"], st["quota_used_bytes"]) == (
            16, MiB, MiB,
        )  # fmt: skip
        assert small.check() == [] and small.check_live().problems == []
        # 961 KiB in 16 pages is over a 1000 KiB quota: quotas count whole pages.
        with pytest.raises(InsufficientStorage, match="over its namespace's quota of 1024000"):
            small.begin_put("huge", 961 * KiB, ns=small.bind_namespaces({"c": 1000 * KiB})["c"])
        held[0].write(bytes(MiB))
        assert held[0].commit() is True
        # Published, its pages still count; the next upload evicts a's own block for room.
        st = small.namespace_stats()["a"]
        assert (st["slot_pages"], st["reserved_bytes"], st["quota_used_bytes"]) == (16, 0, MiB)
        again = small.begin_put("u-next", MiB, ns=a)
        assert not small.exists("u0", a) and small.namespace_stats()["a"]["evictions"] == 1
        again.abort()
    finally:
        for h in held:
            h.abort()
    st = small.namespace_stats()
    assert st["a"]["quota_used_bytes"] == 0 and st["b"]["evictions"] == 0
    assert small.check() == []


def _dead_writer(slab_name: str, ns: int, address: str) -> int:
    """A real process that reserves a 1 MiB upload in namespace ``ns`` and is then
    SIGKILLed mid-upload; returns its pid (reaped)."""
    code = (
        "import sys, time\n"
        "from eg_kv.slab.store import Slab\n"
        "s = Slab.attach(sys.argv[1])\n"
        "h = s.begin_put(sys.argv[3], 1 << 20, ns=int(sys.argv[2]))\n"
        "h.write(bytes(1000))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, slab_name, str(ns), address],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    return proc.pid


@pytest.mark.timeout(60)
def test_a_dead_writers_upload_stops_counting_once_released(small, slab_name):
    """A writer SIGKILLed mid-upload keeps its pages charged to its namespace until they
    are given back: by the supervisor's release_process, or by repair; check() sees the
    counter either way, and damage to it is found and rebuilt."""
    a = small.bind_namespaces({"a": MiB})["a"]
    pid = _dead_writer(slab_name, a, "dead-1")
    assert small.namespace_stats()["a"]["reserved_bytes"] == MiB
    with pytest.raises(Busy, match="uploads in flight"):
        small.begin_put("mine", MiB, ns=a)
    left = small.release_process(pid)  # what the supervisor does when it reaps a worker
    assert (left.reservations, left.pages) == (1, 16)
    assert small.namespace_stats()["a"]["quota_used_bytes"] == 0
    assert small.check() == []
    _dead_writer(slab_name, a, "dead-2")
    problems = small.check()
    assert any("writer is dead" in p for p in problems)
    assert any("reserved_pages" in p and "namespace" in p for p in problems), problems
    small.repair()
    assert small.check() == [] and small.namespace_stats()["a"]["reserved_bytes"] == 0
    h = small.begin_put("mine", MiB, ns=a)
    small._nsw[a * L.NS_WORDS + L.NS_RESV_PAGES] += 3  # damage: repair rebuilds it
    assert any("counter reserved_pages is 19 but the slots say 16" in p for p in small.check())
    small.repair()
    assert small.check() == [] and small.namespace_stats()["a"]["reserved_pages"] == 16
    h.abort()
    assert small.namespace_stats()["a"]["reserved_pages"] == 0 and small.check() == []


def test_a_namespace_may_name_its_model_once():
    with_models = [
        {"name": "team-a", "role": "readwrite", "model": "Qwen/Qwen3-8B"},
        {"name": "team-a-ro", "role": "readonly", "namespace": "team-a"},
        {"name": "ops", "role": "admin"},
    ]
    assert tenants.parse(tokens_toml(with_models), 64 * MiB).models == {"team-a": "Qwen/Qwen3-8B"}
    assert tenants.parse(tokens_toml(GOOD), 64 * MiB).models == {}
    twice = [*with_models[:1], {**with_models[1], "model": "other"}]
    assert "namespace team-a has two models" in _error(tokens_toml(twice))
    for bad in ("has space", "a@b", "", "x" * 129):
        one = [{**with_models[0], "model": bad}]
        assert "model must be 1-128 printable characters" in _error(tokens_toml(one))


def test_the_default_namespace_never_counts_what_a_named_one_did(slab_name):
    """The default namespace's counters are the slab's less the named ones', and were read
    in two holds of the lock: a tenant's request between them made them -1 and back (a
    counter reset to Prometheus), in 357 of 600 reads. Now in one hold; and its get hits
    and misses are its own count (the slab's less the named ones', written apart, went
    back whenever a scrape fell between the two words)."""
    import threading

    with Slab.create(slab_name, 8 * 1024 * 1024, page_size=4096) as s:
        ns = s.bind_namespaces({"team-a": 0})["team-a"]
        s.put("mine", b"y" * 100)  # the default namespace's one block
        stop, seen, hits = threading.Event(), [], []

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                s.put(f"a{i % 50}", b"x" * 100, ns)  # new blocks, then dedup hits
                s.get(f"a{i % 50}", ns)
                s.get("absent", ns)
                s.get("mine")  # the default namespace's reads, all the while
                i += 1

        worker = threading.Thread(target=traffic)
        worker.start()
        try:
            for _ in range(300):
                default = s.namespace_stats()[""]
                hits.append(default["get_hits"])
                seen.append({k: v for k, v in default.items() if k in
                             ("dedup_hits", "get_misses", "puts_created", "evictions",
                              "unique_blocks", "total_refs")})  # fmt: skip
        finally:
            stop.set()
            worker.join(10)
        mine = {"dedup_hits": 0, "get_misses": 0, "puts_created": 1, "evictions": 0,
                "unique_blocks": 1, "total_refs": 1}  # fmt: skip
        assert seen == [mine] * 300  # its own block, nothing the named namespace did
        assert hits == sorted(hits) and hits[-1] > 0  # never back
