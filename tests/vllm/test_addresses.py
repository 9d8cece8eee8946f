"""The vLLM connector's block addresses and settings (no vLLM needed).

Addresses must be the same in every process whatever ``PYTHONHASHSEED`` (two processes
compute them), name a whole prefix (a chain), and change with everything that changes a
block's bytes: model, dtype, block size, KV layout, parallel sizes, the shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from eg_kv.address import validate
from eg_kv.errors import ConfigError
from eg_kv.vllm import addresses as A
from eg_kv.vllm.settings import settings_from

FMT = A.BlockFormat(
    model="/models/tiny-llama",
    dtype="bfloat16",
    block_size=16,
    layout="model.layers.0.self_attn.attn:(2,16,2,64):bfloat16",
    tp_size=1,
)
TOKENS = [(i * 7919) % 32000 for i in range(16 * 5 + 3)]

_CHILD = """
import json, sys
from eg_kv.vllm import addresses as A
fmt = A.BlockFormat(**json.loads(sys.argv[1]))
tokens = json.loads(sys.argv[2])
chain = A.token_chain(tokens, fmt.block_size, extras=["salt-1"])
print(json.dumps([A.block_addresses(chain, fmt, s) for s in range(fmt.shards)]))
"""


def _addresses_in_child(seed: str, fmt: A.BlockFormat) -> list[list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(dataclasses.asdict(fmt)), json.dumps(TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.timeout(60)
def test_addresses_are_the_same_in_every_process_whatever_the_hash_seed():
    fmt = dataclasses.replace(FMT, tp_size=2)
    first = _addresses_in_child("1", fmt)
    second = _addresses_in_child("4242", fmt)
    assert first == second
    here = A.token_chain(TOKENS, 16, extras=["salt-1"])
    assert first == [A.block_addresses(here, fmt, s) for s in range(2)]
    # and a known value, so a change of scheme cannot pass unnoticed (bump FORMAT_VERSION)
    assert len(first[0]) == 5
    assert first[0][0] == "egv2-87196f0cb2d2f380d87bd97d99b42d9706250515"


def test_only_whole_blocks_get_addresses_and_a_prefix_keeps_its_addresses():
    chain = A.token_chain(TOKENS, 16)
    assert len(chain) == 5  # 83 tokens: 5 whole blocks, the last 3 tokens have none
    shorter = A.token_chain(TOKENS[:50], 16)
    assert shorter == chain[:3]
    assert A.token_chain(TOKENS, 16, max_blocks=2) == chain[:2]
    assert A.token_chain(TOKENS[:15], 16) == []
    assert A.token_chain(TOKENS, 16, known=chain[:2]) == chain  # grown: hashes the rest
    addresses = A.block_addresses(chain, FMT)
    assert len(set(addresses)) == 5
    for a in addresses:
        validate(a)


def test_a_block_address_names_its_whole_prefix():
    chain = A.token_chain(TOKENS, 16)
    changed = list(TOKENS)
    changed[3] += 1  # a token of block 0: every later block changes too
    assert not set(A.token_chain(changed, 16)) & set(chain)
    changed = list(TOKENS)
    changed[40] += 1  # a token of block 2: blocks 0 and 1 stay
    other = A.token_chain(changed, 16)
    assert other[:2] == chain[:2] and not set(other[2:]) & set(chain[2:])


def test_extras_change_the_chain():
    assert A.token_chain(TOKENS, 16) != A.token_chain(TOKENS, 16, extras=["cache-salt"])
    assert A.token_chain(TOKENS, 16, extras=["ab", "c"]) != A.token_chain(
        TOKENS, 16, extras=["a", "bc"]
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"dtype": "float16"},
        {"layout": "model.layers.0.self_attn.attn:(16,2,2,64):bfloat16"},
        {"tp_size": 2},
        {"pp_size": 2},
    ],
)
def test_the_format_is_bound(change):
    chain = A.token_chain(TOKENS, 16)
    assert not set(A.block_addresses(chain, FMT)) & set(
        A.block_addresses(chain, dataclasses.replace(FMT, **change))
    )


def test_the_block_size_is_bound():
    a = A.block_addresses(A.token_chain(TOKENS, 16), FMT)
    fmt8 = dataclasses.replace(FMT, block_size=8)
    b = A.block_addresses(A.token_chain(TOKENS, 8), fmt8)
    assert not set(a) & set(b)


def test_each_shard_has_its_own_addresses_and_a_lookup_asks_all_of_them():
    fmt = dataclasses.replace(FMT, tp_size=2, pp_size=2)
    chain = A.token_chain(TOKENS, 16)
    per_shard = [A.block_addresses(chain, fmt, s) for s in range(4)]
    assert len({a for addrs in per_shard for a in addrs}) == 20
    assert fmt.shard_of(tp_rank=1, pp_rank=1) == 3
    lookup = A.lookup_addresses(chain, [fmt] * 4)
    assert lookup[:4] == [per_shard[s][0] for s in range(4)]
    assert lookup[4:8] == [per_shard[s][1] for s in range(4)]
    with pytest.raises(ValueError):
        fmt.shard_of(tp_rank=2)
    with pytest.raises(ValueError):
        fmt.salt(4)


def test_bad_tokens_and_sizes_are_refused():
    with pytest.raises(ValueError):
        A.token_chain([-1] * 16, 16)
    with pytest.raises(ValueError):
        A.token_chain([2**31] * 16, 16)
    with pytest.raises(ValueError):
        A.token_chain(TOKENS, 0)
    with pytest.raises(ValueError):
        A.BlockFormat(model="m", dtype="bf16", block_size=0, layout="")


def test_settings_take_extra_config_over_the_environment():
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_URL": "http://10.0.0.1:9130",
        "EPISTEMIC_GRAPH_KVCACHE_TOKEN": "from-env",
        "EPISTEMIC_GRAPH_KVCACHE_TIMEOUT_S": "7",
    }
    s = settings_from({"url": "http://127.0.0.1:9999", "io_threads": "2"}, env)
    assert s.client.base_url == "http://127.0.0.1:9999"
    assert s.client.token == "from-env" and s.client.timeout_s == 7.0
    assert s.io_threads == 2
    s = settings_from(None, env)
    assert s.client.base_url == "http://10.0.0.1:9130"
    s = settings_from({"base_url": "http://a:1,http://b:2", "timeout_s": 0.5}, {})
    assert not s.client.single and s.client.timeout_s == 0.5
    s = settings_from({"url": "dnssrv+http://_kv._tcp.example"}, {})
    assert not s.client.single


@pytest.mark.parametrize(
    "extra",
    [
        {"shared_storage_path": "/tmp"},
        {"url": "http://a:1", "base_url": "http://b:2"},
        {"io_threads": 0},
        {"max_pending_bytes": "lots"},
        {"url": "ftp://a"},
    ],
)
def test_bad_settings_say_what_is_wrong(extra):
    with pytest.raises(ConfigError):
        settings_from(extra, {})


@pytest.mark.timeout(60)
def test_the_package_imports_without_vllm_or_torch():
    code = (
        "import sys, eg_kv.vllm, eg_kv.vllm.settings\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
