"""Tenants below the server: the tokens file's grammar and the slab's namespaces."""

from __future__ import annotations

import hashlib

import pytest
from tenant_helpers import token_of, tokens_toml

from eg_kv import layout as L
from eg_kv import tenants
from eg_kv.errors import ConfigError, InsufficientStorage
from eg_kv.slab import Slab

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
