"""Addresses bind everything that changes what the bytes mean (issue 32, item 3), built from
vLLM's real config objects (tests/vllm/binding_proc.py, under vLLM 0.32 and 0.34:
tests/helpers/vllm_envs.py): engines at fp16 and bf16, at two revisions, two tensor-parallel
ranks, two LoRAs, and two checkpoints written at one path share 0 addresses, on
EgKvConnector's path and on EgKvTier's; the same engine twice shares all of them; and both
paths bind the same description of the engine (with vLLM's config current; the tier's
options say the revision where vLLM does not show the scheduler its config)."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest
from helpers.vllm_envs import vllm_py_fixture

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300)]
vllm_py = vllm_py_fixture(scope="module")
PLAN = [
    {"name": "base", "dtype": "bfloat16"},
    {"name": "same", "dtype": "bfloat16"},
    {"name": "fp16", "dtype": "float16"},
    {"name": "rev-a", "dtype": "bfloat16", "revision": "rev-a"},
    {"name": "rev-b", "dtype": "bfloat16", "revision": "rev-b"},
    {"name": "tp-rank-0", "dtype": "bfloat16", "tp": 2, "rank": 0},
    {"name": "tp-rank-1", "dtype": "bfloat16", "tp": 2, "rank": 1},
    {"name": "lora-a", "dtype": "bfloat16", "lora": "adapter-a"},
    {"name": "lora-b", "dtype": "bfloat16", "lora": "adapter-b"},
    {"name": "new-weights", "dtype": "bfloat16", "touch": True},
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, vllm_py):
    model_dir = tmp_path_factory.mktemp("tiny-model")
    env = {"LMCACHE_TRACK_USAGE": "false", "PATH": "/usr/bin:/bin", "HOME": str(model_dir)}
    done = subprocess.run(
        [str(vllm_py), str(ROOT / "tests" / "vllm" / "binding_proc.py"), str(model_dir),
         json.dumps(PLAN)],
        capture_output=True, text=True, timeout=280, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def shared(a: dict, b: dict, path: str) -> int:
    return len(set(a[path]) & set(b[path]))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["connector", "tier"])
def test_engines_whose_bytes_differ_share_no_address(engines, path):
    assert shared(engines["base"], engines["same"], path) == 64  # the same engine: all
    pairs = [
        ("base", "fp16"), ("rev-a", "rev-b"), ("base", "rev-a"), ("lora-a", "lora-b"),
        ("base", "lora-a"), ("base", "new-weights"),
    ]  # fmt: skip
    if path == "connector":  # one engine's two shards (the tier stores whole slots)
        pairs.append(("tp-rank-0", "tp-rank-1"))
    for a, b in pairs:
        assert shared(engines[a], engines[b], path) == 0, (a, b, path)
    names = [n for n in engines if n != "same"]
    for a, b in itertools.combinations(names, 2):
        if {a, b} != {"tp-rank-0", "tp-rank-1"} or path == "connector":
            assert shared(engines[a], engines[b], path) == 0, (a, b, path)


def test_both_paths_bind_the_same_description_of_the_engine(engines):
    for name, engine in engines.items():
        binding = json.loads(engine["binding"])
        assert json.loads(engine["tier_binding_seen"]) == binding, name
        # Without vLLM's config in sight the tier binds what the offloading config, the
        # model's directory and its options say: the same binding.
        assert json.loads(engine["tier_binding_unseen"]) == binding, name
    assert json.loads(engines["fp16"]["binding"])["kv_dtype"] == "float16"
    assert json.loads(engines["base"]["binding"])["kv_dtype"] == "bfloat16"
    assert json.loads(engines["rev-a"]["binding"])["revision"] == "rev-a"
    base_weights = json.loads(engines["base"]["binding"])["weights"]
    assert base_weights.startswith("files:")
    assert json.loads(engines["new-weights"]["binding"])["weights"] != base_weights
