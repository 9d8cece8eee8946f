"""eg_kv.engine: the headers a PUT names its block with, both ways, and the chains the
connectors build from their engines' block hashes."""

from __future__ import annotations

import pytest

from eg_kv.engine import (
    NO_ENGINE,
    TOKENS_MAX,
    EngineName,
    chained_names,
    engine_from_headers,
    engine_headers,
    extras_message,
    packed_tokens,
    read_extras_message,
    token_list,
)
from eg_kv.errors import BadRequest


def test_a_name_round_trips_through_its_headers():
    name = EngineName(bytes(range(32)), b"\xab" * 8, 16, 3)
    assert engine_from_headers(engine_headers(name).get) == name
    assert engine_headers(NO_ENGINE) == {} and engine_from_headers({}.get) == NO_ENGINE


@pytest.mark.parametrize("headers", [
    {"X-Eg-Kv-Engine-Hash": "abc"}, {"X-Eg-Kv-Engine-Hash": "zz"},
    {"X-Eg-Kv-Engine-Hash": "00" * 33}, {"X-Eg-Kv-Engine-Hash": "٠١"},
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Block-Size": "0"},
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Lora": "-1"},
    {"X-Eg-Kv-Engine-Lora": "3"},
])  # fmt: skip
def test_bad_headers_are_refused_with_the_header_named(headers):
    with pytest.raises(BadRequest, match="X-Eg-Kv-Engine"):
        engine_from_headers(headers.get)


def test_a_chain_names_each_blocks_parent():
    a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    assert chained_names([b, c], 16, a) == [EngineName(b, a, 16), EngineName(c, b, 16)]
    assert chained_names([a], 16) == [EngineName(a, b"", 16)]
    # vLLM's int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): 8 big-endian bytes
    assert chained_names([-1, 5], 4)[1] == EngineName((5).to_bytes(8, "big"), b"\xff" * 8, 4)
    assert chained_names([b"", a], 16) == [NO_ENGINE, EngineName(a, b"", 16)]


def test_token_ids_and_a_lora_name_ride_along_bounded():
    name = chained_names([b"\x01" * 32], 4, None, [0, 1, 2**32 - 1, 65_536], 3, "team/sql-lora")[0]
    assert token_list(name.token_ids) == [0, 1, 2**32 - 1, 65_536] and name.lora_id == 3
    assert engine_from_headers(engine_headers(name).get) == name
    # A block's tokens are its own slice of the sequence's; ids or names a header cannot
    # carry are not sent (never a 400 for the engine's own values).
    two = chained_names([b"\x01" * 8, b"\x02" * 8], 2, None, [5, 6, 7, 8])
    assert [token_list(n.token_ids) for n in two] == [[5, 6], [7, 8]]
    assert chained_names([b"\x01"], 2, None, [-1, 3])[0].token_ids == b""
    assert chained_names([b"\x01"], 2, None, None, 0, "not a name")[0].lora_name == ""
    assert packed_tokens(list(range(TOKENS_MAX + 1))) == b"" and packed_tokens([]) == b""
    assert (
        len(
            engine_headers(EngineName(b"\x01", token_ids=packed_tokens([2**32 - 1] * TOKENS_MAX)))[
                "X-Eg-Kv-Engine-Tokens"
            ]
        )
        < 8190
    )  # aiohttp's line limit
    # What a worker hands the publisher reads back whole; anything else is refused.
    ns, address, tokens, lora = read_extras_message(extras_message(9, "addr-1", name))
    assert (ns, address, tokens, lora) == (9, b"addr-1", name.token_ids, "team/sql-lora")
    for bad in (b"", b"\x01\x00\x05\x00", extras_message(1, "a", name) + b"\x00"):
        with pytest.raises(ValueError):
            read_extras_message(bad)
