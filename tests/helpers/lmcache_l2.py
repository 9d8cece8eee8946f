"""What the LMCache L2-adapter tests share: our ``native_plugin`` JSON, the chunk size,
LMCache's environment, and where the one-process helper script lies."""

from __future__ import annotations

import json
import os

from helpers.common import ROOT

#: tests/, where tests/lmcache_l2_proc.py (one LMCache process: store or load) lies.
TESTS = ROOT / "tests"
CHUNK = 14 * 1024 * 1024
LMCACHE_ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}


def our_json(base_url: str, **params) -> str:
    return json.dumps(
        {
            "type": "native_plugin",
            "module_path": "eg_kv.kvcache",
            "class_name": "RemoteKVL2Connector",
            "adapter_params": {"base_url": base_url, **params},
        }
    )
