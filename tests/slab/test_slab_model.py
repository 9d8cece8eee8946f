"""Property test: random put / get / exists / delete sequences against a plain dict model.

``exists_many`` asks about every key at once, so the places it remembers from one batch
(eg_kv.slab.view.SlabView.block_ids) are checked after blocks were evicted, deleted,
stored again and moved within the table.

The slab is small (32 pages of 4 KiB) and blocks are up to 40 KiB, so sequences keep
forcing eviction. A block the model holds may vanish only by eviction, and each one that
vanishes must be counted by ``evictions``; everything resident reads back identical.
"""

from __future__ import annotations

import hashlib

import pytest
from helpers.common import unique_slab_name
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eg_kv.slab.store import Slab

PAGE = 4096
KEYS = [f"key-{i}" for i in range(12)]


def content(key: str, length: int) -> bytes:
    seed = hashlib.blake2b(f"{key}/{length}".encode(), digest_size=16).digest()
    return (seed * (length // 16 + 1))[:length]


# Hypothesis favours small integers; mix in big blocks so sequences keep evicting.
SIZES = st.one_of(st.integers(1, 2 * PAGE), st.integers(6 * PAGE, 10 * PAGE))
# "put" stores in one critical section (small blocks), "stream" through a PutHandle.
PUT = st.tuples(st.sampled_from(["put", "stream"]), st.sampled_from(KEYS), SIZES)
ops = st.lists(
    st.one_of(
        PUT,
        PUT,
        st.tuples(st.just("get"), st.sampled_from(KEYS), st.just(0)),
        st.tuples(st.just("exists"), st.sampled_from(KEYS), st.just(0)),
        st.tuples(st.just("exists_many"), st.just(""), st.just(0)),
        st.tuples(st.just("delete"), st.sampled_from(KEYS), st.just(0)),
    ),
    min_size=20,
    max_size=80,
)


def streamed_put(slab: Slab, key: str, body: bytes) -> bool:
    """The streaming path: a PutHandle fed in three uneven chunks."""
    handle = slab.begin_put(key, len(body))
    try:
        for a, b in ((0, len(body) // 3), (len(body) // 3, len(body) - 1), (len(body) - 1, None)):
            handle.write(body[a:b])
        return handle.commit()
    finally:
        handle.abort()


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_slab_matches_dict_model(sequence):
    name = unique_slab_name("prop")
    slab = Slab.create(name, 32 * PAGE, page_size=PAGE, max_block_size=64 * 1024)
    model: dict[str, list] = {}  # key -> [bytes, refs]
    try:
        for op, key, length in sequence:
            before = slab.stats()["evictions"]
            if op in ("put", "stream"):
                held = model.get(key)
                if held is not None and len(held[0]) != length:
                    length = len(held[0])  # the same address always names the same bytes
                body = content(key, length)
                created = slab.put(key, body) if op == "put" else streamed_put(slab, key, body)
                assert created == (held is None), (op, key)
                if created:
                    model[key] = [body, 1]
                else:
                    held[1] += 1
            elif op == "get":
                got = slab.get(key)
                assert got == (model[key][0] if key in model else None)
            elif op == "exists":
                assert slab.exists(key) == (key in model)
            elif op == "exists_many":
                assert slab.exists_many(KEYS) == [k in model for k in KEYS]
            else:
                assert slab.delete(key) == (key in model)
                if key in model:
                    model[key][1] -= 1
                    if model[key][1] == 0:
                        del model[key]
            # Whatever vanished from the slab was evicted, and was counted.
            gone = [k for k in model if not slab.exists(k)]
            assert len(gone) == slab.stats()["evictions"] - before, (op, key, gone)
            for k in gone:
                del model[k]
        stats = slab.stats()
        assert stats["unique_blocks"] == len(model)
        assert stats["total_refs"] == sum(r for _, r in model.values())
        assert stats["resident_bytes"] == sum(len(b) for b, _ in model.values())
        assert stats["logical_bytes"] == sum(len(b) * r for b, r in model.values())
        assert (
            stats["free_bytes"] + sum(-(-len(b) // PAGE) * PAGE for b, _ in model.values())
            == stats["capacity_bytes"]
        )
        for k, (body, _) in model.items():
            assert slab.get(k) == body
        assert slab.check() == []
    finally:
        slab.close()
        Slab.unlink_named(name)
