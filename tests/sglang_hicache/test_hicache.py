"""eg-kv as SGLang's HiCache storage backend (issue 35), with SGLang's own code: the
backend built by SGLang's ``StorageBackendFactory`` from the ``dynamic`` config, over
SGLang's own MHA and MLA host pools in each layout, driven by SGLang's controller functions
(tests/sglang_hicache/hicache_proc.py, run in .venv-vllm where SGLang 0.5.23 is installed), against
a real server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from eg_kv.errors import ConfigError
from eg_kv.sglang.settings import backend_options

ROOT = Path(__file__).resolve().parents[2]
SIDE_PY = ROOT / ".venv-vllm" / "bin" / "python"
HAS_SGLANG = SIDE_PY.exists() and any(
    (ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages/sglang")
)
needs_sglang = pytest.mark.skipif(
    not HAS_SGLANG, reason="needs SGLang 0.5.23 in .venv-vllm (scripts/setup-vllm installs it)"
)
pytestmark = pytest.mark.timeout(300)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def found(module_server_factory, tmp_path_factory):
    """Every scenario's findings, from one run of SGLang's code against one server."""
    if not HAS_SGLANG:
        pytest.skip("needs SGLang 0.5.23 in .venv-vllm (scripts/setup-vllm installs it)")
    srv = module_server_factory(workers=2, capacity="128MiB", extra=("--page-size", "64KiB"))
    members = [module_server_factory(workers=1, capacity="32MiB") for _ in range(2)]
    home = tmp_path_factory.mktemp("sglang-home")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LMCACHE_TRACK_USAGE": "false"}
    done = subprocess.run(
        [str(SIDE_PY), str(ROOT / "tests" / "sglang_hicache" / "hicache_proc.py"), srv.url,
         srv.slab_name, f"http://127.0.0.1:{_closed_port()}", "all",
         ",".join(m.url for m in members)],
        capture_output=True, text=True, timeout=280, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_sglang
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(
    "layout", ["page_first", "layer_first", "page_first_direct", "layer_first->page_first_direct"]
)
def test_pages_round_trip_through_sglangs_own_pools_and_controller(found, kind, layout):
    """Set from one engine, exists and get from a fresh one: the leading run, equal bytes
    (a page-first-direct engine loads a layer-first engine's pages: one byte order)."""
    got = found["layouts"][f"{kind}:{layout}"]
    assert got["stored"] is True
    assert got["found"] == 6  # the 6 stored, not the 2 absent after them
    assert got["loaded"] == 6 and got["equal"] is True
    assert got["page_bytes"] == (32768 if kind == "mha" else 73728)


@pytest.mark.slow
@needs_sglang
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_page_first_engine_finds_no_page_of_a_layer_first_one(found, kind):
    """A page_first page keeps K token by token, a layer_first one layer by layer: the same
    key names other addresses, so neither loads the other's keys transposed (it did: the
    bytes passed every check, and 24 of 32 values landed in the wrong place)."""
    got = found["layouts"][f"{kind}:page_first->layer_first"]
    assert got["stored"] is True
    assert got["found"] == 0 and got["loaded"] == 0


@needs_sglang
def test_the_legacy_copy_path_stores_the_zero_copy_paths_pages(found):
    got = found["legacy"]
    assert got["stored"] == [True, True]
    assert got["legacy_loaded"] == 4 and got["legacy_equal"] is True
    assert got["v1_loaded"] == 4 and got["v1_equal"] is True


@needs_sglang
def test_mha_ranks_keep_their_own_pages_and_mla_ranks_share_one_copy(found):
    mha, mla = found["ranks"]["mha"], found["ranks"]["mla"]
    assert mha["stored"] and mha["rank1_found"] == 0 and mha["rank1_loaded"] == 0
    assert mla["stored"] and mla["rank1_found"] == 4 and mla["rank1_loaded"] == 4
    assert mla["rank1_equal"] is True
    # An MLA rank that is not SGLang's storage writer stores nothing (and says True).
    assert mla["nonwriter_set"] is True and mla["nonwriter_stored"] == 0


@needs_sglang
def test_engines_whose_pages_differ_share_none(found):
    assert found["binding"] == {"fp16": 0, "revision": 0, "same": 4}


@needs_sglang
def test_a_byte_changed_in_the_slab_is_a_miss_never_loaded(found):
    got = found["corrupt"]
    assert got["changed"] is True
    assert got["loaded"] == [False, True] and got["second_equal"] is True
    assert got["checksum_failures"] == 1


@needs_sglang
def test_with_a_block_key_forged_pages_are_misses(found):
    got = found["block_key"]
    assert got["loaded"] == [False, False, True]
    assert got["forged_blocks"] == 2
    assert got["keyed_set"] is True and got["keyed_equal"] is True


@needs_sglang
def test_a_pool_with_k_and_v_of_other_head_dims_round_trips(found):
    got = found["asymmetric"]
    # K: 4 layers x 16 tokens x 2 heads x 64 dims x 2 B; V the same at 32 dims
    assert got["page_bytes"] == 16384 + 8192
    assert got["stored"] is True and got["loaded"] == 4 and got["equal"] is True
    assert got["legacy_get"] == [None]


@needs_sglang
def test_a_silent_server_costs_a_store_one_timeout_not_one_per_page(found):
    got = found["silent"]
    assert got["set"] == [False] * 8
    assert got["seconds"] < 1.5  # timeout_s 0.5, one thread: it took 4.5 s (one per page)


@needs_sglang
def test_a_server_that_stalls_after_a_lookup_costs_each_call_one_timeout(found):
    got = found["stalled"]
    assert got["exists"] == 8 and got["get"] == [False] * 8 and got["set"] == [False] * 8
    assert got["gap"] == 2
    # timeout_s 1: each call within it (they took 2.0 s, 1.8 s and 1.0 s).
    assert got["get_s"] < 1.5 and got["set_s"] < 1.5 and got["gap_s"] < 0.5


@needs_sglang
def test_a_legacy_get_into_a_strided_target_is_a_miss_that_writes_nothing(found):
    got = found["strided"]
    assert got == {"stored": True, "got": [False], "untouched": True}


@needs_sglang
def test_a_dead_server_is_misses_within_the_timeout(found):
    got = found["dead"]
    assert got["set"] == [False] * 8 and got["get"] == [False] * 8
    assert got["exists"] == 0 and got["legacy_get"] == [None]
    assert got["seconds"] < 2 * 2 + 1  # timeout_s 2: a batch's deadline, then one request


@needs_sglang
def test_sglangs_failure_injector_never_gets_wrong_bytes_loaded(found):
    got = found["injector"]
    assert got["wrapped"] == "HiCacheStorageFailureInjector"
    assert got["wrong"] == 0
    assert 0 < got["full"] < got["rounds"]  # failures were injected, and some got through


@needs_sglang
def test_a_lookup_leases_its_run_and_the_get_ends_those_leases(found):
    got = found["leases"]
    assert got["found"] == 4 and got["loaded"] == 4
    taken = got["looked"]["leases_taken"] - got["before"]["leases_taken"]
    released = got["after"]["leases_released"] - got["before"]["leases_released"]
    assert taken == 5  # the run of 4, and the hit after the gap
    assert released == 5  # that one at once, the run by the get


@needs_sglang
def test_a_server_set_spreads_pages_and_loads_them_whole(found):
    got = found["server_set"]
    assert got["stored"] is True and got["found"] == 16
    assert got["loaded"] == 16 and got["equal"] is True
    assert all(n > 0 for n in got["held"]) and sum(got["held"]) == 16


@needs_sglang
def test_each_page_is_named_by_its_sglang_key_for_the_kv_events(found):
    got = found["engine_names"]
    assert got == {"stored": True, "named": 5}


def test_the_token_comes_from_the_environment_only():
    with pytest.raises(ConfigError, match="EPISTEMIC_GRAPH_KVCACHE_TOKEN"):
        backend_options({"url": "http://127.0.0.1:9130", "token": "s3cret"})


def test_settings_from_sglangs_extra_config(monkeypatch):
    monkeypatch.delenv("EPISTEMIC_GRAPH_KVCACHE_URL", raising=False)
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", "from-env")
    extra = {"backend_name": "eg-kv", "module_path": "eg_kv.sglang",
             "class_name": "EgKvHiCacheStorage", "interface_v1": 1,
             "url": "http://127.0.0.1:9555", "lease_ms": "0", "revision": "r1"}  # fmt: skip
    config, settings = backend_options(extra)
    assert config.base_url == "http://127.0.0.1:9555" and config.token == "from-env"
    assert settings["lease_ms"] == 0 and settings["revision"] == "r1"
    with pytest.raises(ConfigError, match="unknown key 'lease'"):
        backend_options({"lease": 1})
    with pytest.raises(ConfigError, match="io_threads"):
        backend_options({"io_threads": 0})


@pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="a GPU is here: the run is real")
def test_the_gpu_script_skips_with_77_and_says_why_without_a_gpu():
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "e2e_sglang")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 77, done.stdout + done.stderr
    assert "skipped: no GPU here" in done.stdout
