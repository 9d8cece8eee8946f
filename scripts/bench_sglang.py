#!/usr/bin/env python3
"""eg-kv as SGLang's HiCache storage against SGLang's own file backend, side by side in one
run on this machine (issue 35)::

    .venv/bin/python scripts/bench_sglang.py            # about 2 minutes

Both backends are built by SGLang's ``StorageBackendFactory`` (0.5.23, in ``.venv-vllm``)
over SGLang's own MHA host pool (page-first, bf16) and driven by SGLang's controller
functions, as SGLang's prefetch and backup threads call them:

* ``eg-kv``: :class:`eg_kv.sglang.EgKvHiCacheStorage` with ``interface_v1`` (zero copy:
  ``batch_set_v1``, ``batch_exists``, ``batch_get_v1``), on a fresh 2-worker eg-kv server
  with a 3 GiB slab (room for every round), on its host: loads are local reads of the slab;
* ``eg-kv http``: the same with ``local_reads`` off (every load a GET);
* ``file``: SGLang's ``HiCacheFile`` (its legacy copy path, the only one it has) on a
  directory of this machine's disk (``--dir``, default a temporary one under /var/tmp):
  one file per page, written through a temporary file and renamed; its reads come from
  the page cache, as they would right after the writes.

Cells: set, exists and get of 64 KiB pages (128 a batch: SGLang's storage batch) and of
2 MiB pages (32 a batch), in pages/s; each round alternates the backends (these machines
are noisy), fresh keys per round for sets, then exists and get of what the round stored.
The median over ``--rounds`` rounds per cell, and eg-kv's ratio to the file backend.
Every process it starts is stopped by pid; the slab and the directory are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDE_PY = ROOT / ".venv-vllm" / "bin" / "python"
MiB = 1024 * 1024
#: (name, pool shape, pages a batch): a 64 KiB page (4 layers x 32 tokens x 2 heads x 64,
#: K and V, bf16) and a 2 MiB page (16 layers x 32 tokens x 8 heads x 128).
CELLS = [
    ("64KiB", {"layers": 4, "heads": 2, "dim": 64, "page": 32}, 128),
    ("2MiB", {"layers": 16, "heads": 8, "dim": 128, "page": 32}, 32),
]
SIDES = ("eg-kv", "eg-kv http", "file")


def client_main(url: str, directory: str, rounds: int) -> None:
    """In .venv-vllm: every cell's per-round rates, as one JSON line."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import no_torchvision  # noqa: F401, I001  (before SGLang's host pools)

    from types import SimpleNamespace

    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_pools import EG_KV_BACKEND, mha_pool, storage_config

    op = SimpleNamespace(request_id="bench", is_terminated=lambda: False)
    out: dict[str, dict[str, list[float]]] = {}
    for name, shape, batch in CELLS:
        page = shape["page"]
        pool = mha_pool("page_first", pages=4 * batch, **shape)
        extras = {
            "eg-kv": {**EG_KV_BACKEND, "url": url},
            "eg-kv http": {**EG_KV_BACKEND, "url": url, "local_reads": False},
            "file": {"file_storage_path": os.path.join(directory, name)},
        }
        backends = {}
        for side, extra in extras.items():
            kind = "file" if side == "file" else "dynamic"
            cfg = storage_config(False, extra, model="bench/model")
            backend = StorageBackendFactory.create_backend(kind, cfg, pool)
            backend.register_mem_pool_host(pool)
            backends[side] = SimpleNamespace(
                storage_backend=backend, storage_host_pool=pool, page_size=page
            )
        slots = pool.alloc(batch * page)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
        rates: dict[str, list[float]] = {f"{side} {op_}": [] for side in SIDES
                                         for op_ in ("set", "exists", "get")}  # fmt: skip
        for r in range(rounds):
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                ctrl = backends[side]
                keys = [f"{r:04d}{side}{i:04d}{name}".encode().hex()[:64] for i in range(batch)]
                zero_copy = side != "file"
                t0 = time.perf_counter()
                if zero_copy:
                    ok = HiCacheController._page_set_zero_copy(ctrl, keys, slots)
                else:
                    ok = HiCacheController._generic_page_set(ctrl, keys, slots)
                t1 = time.perf_counter()
                found = ctrl.storage_backend.batch_exists(keys)
                t2 = time.perf_counter()
                if zero_copy:
                    got = HiCacheController._page_get_zero_copy(ctrl, op, keys, slots)
                else:
                    got = HiCacheController._generic_page_get(ctrl, op, keys, slots)
                t3 = time.perf_counter()
                if not (ok and found == batch and got == batch):
                    raise SystemExit(f"{side} {name}: set {ok}, found {found}, got {got}")
                rates[f"{side} set"].append(batch / (t1 - t0))
                rates[f"{side} exists"].append(batch / (t2 - t1))
                rates[f"{side} get"].append(batch / (t3 - t2))
        for ctrl in backends.values():
            close = getattr(ctrl.storage_backend, "close", None)
            if close is not None:
                close()
        out[name] = rates
    print(json.dumps(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="rounds per cell (default 15)")
    p.add_argument("--dir", help="where the file backend writes (default: a new temporary "
                                 "directory under /var/tmp, removed after)")  # fmt: skip
    p.add_argument("--client", nargs=2, metavar=("URL", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args.client[0], args.client[1], args.rounds)
        return 0
    if not SIDE_PY.exists():
        raise SystemExit("needs .venv-vllm with SGLang: run scripts/setup-vllm")
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_lmcache import egkv_server

    directory = tempfile.mkdtemp(prefix="eg-kv-bench-sglang-", dir=args.dir or "/var/tmp")
    logdir = Path(tempfile.mkdtemp(prefix="eg-kv-bench-sglang-logs-"))
    try:
        with egkv_server(2, 3072 * MiB, logdir) as url:
            env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
            done = subprocess.run(
                [str(SIDE_PY), __file__, "--rounds", str(args.rounds), "--client", url,
                 directory],
                capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT,
            )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        rates = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(logdir, ignore_errors=True)
    print(f"SGLang HiCache storage, pages/s (median of {args.rounds} rounds, alternating):\n")
    print("| cell | eg-kv | eg-kv http | SGLang file | eg-kv / file | eg-kv http / file |")
    print("|---|---|---|---|---|---|")
    for name, cells in rates.items():
        for op_ in ("set", "exists", "get"):
            med = {side: statistics.median(cells[f"{side} {op_}"]) for side in SIDES}
            print(f"| {op_} {name} | {med['eg-kv']:,.0f} | {med['eg-kv http']:,.0f} | "
                  f"{med['file']:,.0f} | {med['eg-kv'] / med['file']:.2f} | "
                  f"{med['eg-kv http'] / med['file']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
