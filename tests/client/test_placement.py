"""Placement over a set of servers (eg_kv/client/placement.py): pure, fast, no servers needed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from helpers.common import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from eg_kv.address import address_for_key
from eg_kv.client.placement import Placement, merge, prefix_hits, score, unit_hash
from eg_kv.errors import ConfigError

N = 10_000
# Addresses as the clients make them (LMCache keys become BLAKE2b digests) plus short
# token-hash strings: both kinds must spread.
ADDRESSES = [address_for_key(f"model/chunk/{i}") for i in range(N // 2)] + [
    f"{i:x}" for i in range(N - N // 2)
]
THREE = {
    "eg-kv-0.eg-kv.ns.svc.cluster.local:9130": 1.0,
    "eg-kv-1.eg-kv.ns.svc.cluster.local:9130": 1.0,
    "eg-kv-2.eg-kv.ns.svc.cluster.local:9130": 1.0,
}
FOURTH = "eg-kv-3.eg-kv.ns.svc.cluster.local:9130"


def homes(placement: Placement, addresses=ADDRESSES) -> list[str | None]:
    return [placement.home(a) for a in addresses]


def test_unit_hash_is_inside_the_open_interval_and_matches_the_fast_path():
    p = Placement(THREE)
    for a in ADDRESSES[:500]:
        expected = sorted(p.members, key=lambda m: (-score(m, 1.0, a), m))
        assert p.ranking(a) == expected
        for m in p.members:
            assert 0.0 < unit_hash(m, a) < 1.0


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from eg_kv.client.placement import Placement
members = json.loads(sys.argv[2])
addresses = json.loads(sys.stdin.read())
p = Placement(members)
print(json.dumps([p.ranking(a) for a in addresses]))
"""


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_same_answer_in_a_fresh_process_with_another_hash_seed(seed):
    sample = ADDRESSES[:: N // 500]
    members = {**THREE, FOURTH: 2.5}
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), json.dumps(members)],
        input=json.dumps(sample), capture_output=True, text=True, env=env, timeout=60,
        check=True,
    )  # fmt: skip
    p = Placement(members)
    assert json.loads(out.stdout) == [p.ranking(a) for a in sample]


def test_pinned_values_do_not_drift():
    """The placement is part of the wire contract between clients of different versions:
    these values must never change (a change would send every address elsewhere)."""
    digest = hashlib.blake2b(b"a:9130\0abc", digest_size=8).digest()
    by_hand = ((int.from_bytes(digest, "big") >> 12) + 0.5) / 2**52
    assert unit_hash("a:9130", "abc") == by_hand == 0.32768177866149417
    p = Placement({"a:9130": 1, "b:9130": 1, "c:9130": 1})
    assert [p.home(f"{i:x}") for i in range(8)] == PINNED_HOMES


PINNED_HOMES = ["c:9130", "b:9130", "b:9130", "a:9130", "c:9130", "b:9130", "c:9130", "b:9130"]


def test_equal_weights_spread_evenly():
    counts = Counter(homes(Placement(THREE)))
    for member in THREE:
        assert abs(counts[member] / N - 1 / 3) < 0.03, counts


def test_adding_a_fourth_member_moves_about_a_quarter_and_none_between_old_members():
    before = homes(Placement(THREE))
    after = homes(Placement({**THREE, FOURTH: 1.0}))
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == FOURTH for _, a in moved), "an address moved between two old members"
    share = len(moved) / N
    assert 0.20 <= share <= 0.30, share


def test_after_an_add_the_next_ranked_member_is_the_previous_home():
    old = Placement(THREE)
    new = Placement({**THREE, FOURTH: 1.0})
    for a in ADDRESSES[:2000]:
        ranking = new.ranking(a)
        if ranking[0] == FOURTH:
            assert ranking[1] == old.home(a)
        else:
            assert ranking[0] == old.home(a)


def test_removing_a_member_moves_only_its_own_addresses():
    four = {**THREE, FOURTH: 1.0}
    before = homes(Placement(four))
    gone = "eg-kv-1.eg-kv.ns.svc.cluster.local:9130"
    after = homes(Placement({m: w for m, w in four.items() if m != gone}))
    for b, a in zip(before, after, strict=True):
        if b != gone:
            assert a == b
        else:
            assert a != gone
    # Skipping a member that is down places exactly as if it had been removed.
    assert homes(Placement(four)) == before
    assert [Placement(four).home(a, skip={gone}) for a in ADDRESSES] == after


@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_weights_give_their_share(ratio):
    p = Placement({"big:9130": ratio, "small:9130": 1.0})
    counts = Counter(homes(p))
    share = counts["big:9130"] / N
    assert abs(share - ratio / (ratio + 1)) < 0.02, counts
    # Three members 2:1:1 (a slab twice as large takes twice the addresses).
    counts = Counter(homes(Placement({"a:1": 2 * 8 << 30, "b:1": 8 << 30, "c:1": 8 << 30})))
    assert abs(counts["a:1"] / N - 0.5) < 0.02 and abs(counts["b:1"] / N - 0.25) < 0.02


def test_a_set_of_one_and_an_empty_set():
    p = Placement({"only:9130": 1})
    assert {p.home(a) for a in ADDRESSES[:100]} == {"only:9130"}
    assert p.home("x", skip={"only:9130"}) is None
    empty = Placement({})
    assert empty.home("x") is None and empty.ranking("x") == [] and len(empty) == 0
    assert empty.group(["a", "b"]) == {}
    assert merge(2, {}, {}, False) == [False, False]


@pytest.mark.parametrize(
    "members",
    [{"": 1}, {"a:1": 0}, {"a:1": -1}, {"a:1": float("nan")}, {"a:1": float("inf")}],
)
def test_bad_members_are_refused(members):
    with pytest.raises(ConfigError):
        Placement(members)
    with pytest.raises(ConfigError, match="twice"):
        Placement([("a:1", 1), ("a:1", 2)])


MEMBER_IDS = st.sampled_from(["a:9130", "b:9130", "c:9130", "d:9130", "e:9130"])
BATCH = st.lists(st.text(alphabet="0123456789abcdef", min_size=1, max_size=12), max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(MEMBER_IDS, st.floats(0.1, 10), min_size=1),
    BATCH,
    st.sets(MEMBER_IDS),
)
def test_group_then_merge_restores_the_callers_order(members, addresses, down):
    p = Placement(members)
    groups = p.group(addresses, skip=down)
    # Every address with a live member is in exactly one group, at its home.
    seen = sorted(i for idx in groups.values() for i in idx)
    placed = [i for i, a in enumerate(addresses) if p.home(a, down) is not None]
    assert seen == placed
    for member, idx in groups.items():
        assert member not in down and idx == sorted(idx)
        assert all(p.home(addresses[i], down) == member for i in idx)
    # Each member answers with its own addresses; the merge puts them back in place.
    answers = {m: [addresses[i] for i in idx] for m, idx in groups.items()}
    merged = merge(len(addresses), groups, answers, None)
    assert merged == [a if p.home(a, down) is not None else None for a in addresses]


@settings(max_examples=100, deadline=None)
@given(BATCH, st.sets(MEMBER_IDS, min_size=1))
def test_a_failed_member_leaves_misses_and_prefix_hits_stop_there(addresses, failed):
    p = Placement(dict.fromkeys(["a:9130", "b:9130", "c:9130"], 1.0))
    groups = p.group(addresses)
    answers = {m: [True] * len(idx) for m, idx in groups.items() if m not in failed}
    found = merge(len(addresses), groups, answers, False)
    expected = [p.home(a) not in failed for a in addresses]
    assert found == expected
    assert prefix_hits(found) == (expected.index(False) if False in expected else len(expected))


def test_merge_refuses_answers_that_do_not_fit():
    groups = {"a:1": [0, 2], "b:1": [1]}
    with pytest.raises(ValueError, match="answered 1 values for 2"):
        merge(3, groups, {"a:1": [True]}, False)
    with pytest.raises(ValueError, match="sent no addresses"):
        merge(3, groups, {"c:1": []}, False)
    with pytest.raises(ValueError, match="outside"):
        merge(2, groups, {"a:1": [True, True]}, False)


def test_weights_are_capped_at_a_few_times_the_lower_median():
    from eg_kv.client.placement import WEIGHT_CAP_FACTOR, cap_weights

    assert WEIGHT_CAP_FACTOR == 4.0
    gib = float(1 << 30)
    assert cap_weights({"a": gib, "b": gib, "liar": 2.0**62}) == {"a": gib, "b": gib,
                                                                 "liar": 4 * gib}  # fmt: skip
    # In a set of two the lower median is the honest member, not the mean of the pair.
    assert cap_weights({"a": gib, "liar": 2.0**62})["liar"] == 4 * gib
    # Weights within the cap are left alone (2:1 stays 2:1).
    assert cap_weights({"a": 2.0, "b": 1.0, "c": 1.0}) == {"a": 2.0, "b": 1.0, "c": 1.0}
    assert cap_weights({}) == {}
    with pytest.raises(ConfigError):
        cap_weights({"a": 1.0}, 0.5)
