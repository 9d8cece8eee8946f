"""eg_kv.engine: the headers a PUT names its block with, both ways, and the chains the
connectors build from their engines' block hashes."""

from __future__ import annotations

import pytest

from eg_kv.engine import NO_ENGINE, EngineName, chained_names, engine_from_headers, engine_headers
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
