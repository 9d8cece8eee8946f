"""One LMCache process for the two-process test: build the L2 adapter the way LMCache does
(its config parser and adapter registry, our ``native_plugin`` JSON), then store or load
one chunk, and print one JSON line with what happened.

Usage: ``python tests/lmcache_l2_proc.py store|load <base_url> <chunk_bytes> <seed>``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import sys

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import (
    create_l1_memory_desc,
    make_aligned_tensor,
    make_memory_objects,
    make_object_keys,
)
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    parse_args_to_l2_adapters_config,
)

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def adapter_json(base_url: str) -> str:
    """The exact ``--l2-adapter`` JSON a user passes to ``lmcache server``."""
    return json.dumps(
        {
            "type": "native_plugin",
            "module_path": "eg_kv.kvcache",
            "class_name": "RemoteKVL2Connector",
            "adapter_params": {"base_url": base_url, "timeout_s": 30},
        }
    )


def wait(fd: int, timeout_s: float = 60.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(timeout_s * 1000):
        raise TimeoutError("no completion within the timeout")
    os.eventfd_read(fd)


def main() -> int:
    op, base_url, size, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[adapter_json(base_url)]))
    buf = make_aligned_tensor(size)
    adapter = create_l2_adapter(cfg.adapters[0], l1_memory_desc=create_l1_memory_desc(buf))
    keys = make_object_keys(1, model_name=MODEL, key_offset=seed)
    (obj,) = make_memory_objects(buf, 1, size, 0)
    out: dict = {"adapter": type(adapter).__name__, "plugin": type(adapter._client).__name__}
    try:
        if op == "store":
            # A content pattern both processes derive from the seed alone.
            pattern = hashlib.blake2b(str(seed).encode()).digest()
            data = bytearray((pattern * (size // len(pattern) + 1))[:size])
            obj.raw_data.copy_(torch.frombuffer(data, dtype=torch.uint8))
            task = adapter.submit_store_task(keys, [obj])
            wait(adapter.get_store_event_fd())
            res = adapter.pop_completed_store_tasks()[task]
            out["stored"] = res.is_successful()
        else:
            task = adapter.submit_lookup_and_lock_task(
                keys, {0: MemoryLayoutDesc(shapes=[], dtypes=[])}
            )
            wait(adapter.get_lookup_and_lock_event_fd())
            out["found"] = adapter.query_lookup_and_lock_result(task).popcount()
            obj.raw_data.zero_()
            task = adapter.submit_load_task(keys, [obj])
            wait(adapter.get_load_event_fd())
            out["loaded"] = adapter.query_load_result(task).popcount()
        out["digest"] = hashlib.blake2b(bytes(obj.byte_array)).hexdigest()
    finally:
        adapter.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
