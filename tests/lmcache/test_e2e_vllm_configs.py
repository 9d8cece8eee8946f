"""The LMCache configurations scripts/e2e_vllm --lmcache runs vLLM with (on a CUDA
machine) load through LMCache's own loader here, so a typo shows up without a GPU."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _script():
    loader = importlib.machinery.SourceFileLoader("e2e_vllm", str(ROOT / "scripts" / "e2e_vllm"))
    spec = importlib.util.spec_from_loader("e2e_vllm", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_in_engine_config_loads_with_lmcaches_loader():
    from lmcache.v1.config import LMCacheEngineConfig

    path = _script().lmcache_engine_config("http://127.0.0.1:9131", 256)
    try:
        config = LMCacheEngineConfig.from_file(str(path))
    finally:
        path.unlink()
    assert config.chunk_size == 256
    assert config.local_cpu is True  # LMCache loads through its CPU cache
    assert config.remote_storage_plugins == ["egkv"]
    extra = config.extra_config
    assert extra["remote_storage_plugin.egkv.module_path"] == "eg_kv.kvcache"
    assert extra["remote_storage_plugin.egkv.class_name"] == "EgKvConnectorAdapter"
    assert extra["remote_storage_plugin.egkv.base_url"] == "http://127.0.0.1:9131"


def test_the_l2_adapter_names_eg_kvs_l2_connector():
    spec = json.loads(_script().l2_adapter("http://127.0.0.1:9131"))
    assert spec["type"] == "native_plugin"
    module = importlib.import_module(spec["module_path"])
    assert getattr(module, spec["class_name"]).__name__ == "RemoteKVL2Connector"
    assert spec["adapter_params"] == {"base_url": "http://127.0.0.1:9131"}
