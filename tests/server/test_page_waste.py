"""Small chunks in big pages: ``/kv/stats`` and ``eg-kv stats`` show the page waste, and
the rule behind the supervisor's hint (eg_kv/server/hints.py) fires when blocks use under a
quarter of their last page. Chunks are stored by the real LMCache L2 adapter."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys

import pytest

pytest.importorskip("lmcache")

from helpers.common import ROOT
from lmcache.cli.commands.bench.l2_adapter_bench.data import (
    create_l1_memory_desc,
    make_aligned_tensor,
    make_memory_objects,
    make_object_keys,
    wait_eventfd,
)
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    parse_args_to_l2_adapters_config,
)

from eg_kv.kvcache import RemoteKVConnector
from eg_kv.server.hints import PageWasteHinter, page_waste_hint

KiB = 1024
PAGE = 64 * KiB


def store_chunks(url: str, n: int, size: int) -> None:
    """Store ``n`` chunks of ``size`` bytes through LMCache's own L2 adapter."""
    spec = {"type": "native_plugin", "module_path": "eg_kv.kvcache",
            "class_name": "RemoteKVL2Connector", "adapter_params": {"base_url": url}}  # fmt: skip
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    buf = make_aligned_tensor(n * size)
    adapter = create_l2_adapter(cfg.adapters[0], l1_memory_desc=create_l1_memory_desc(buf))
    try:
        keys = make_object_keys(n, model_name="small-model")
        task = adapter.submit_store_task(keys, make_memory_objects(buf, n, size, 0))
        assert wait_eventfd(adapter.get_store_event_fd(), timeout=60)
        assert adapter.pop_completed_store_tasks()[task].is_successful()
    finally:
        adapter.close()


@pytest.mark.lmcache
def test_small_chunks_show_their_page_waste(server_factory):
    srv = server_factory(workers=1, capacity="16MiB")
    store_chunks(srv.url, 128, 1 * KiB)
    with RemoteKVConnector(base_url=srv.url) as kv:
        stats = kv.stats()
    doc = {**stats.extra, "unique_blocks": stats.unique_blocks,
           "resident_bytes": stats.resident_bytes}  # fmt: skip
    assert doc["pages_used_bytes"] == 128 * PAGE
    assert doc["page_waste_bytes"] == 128 * (PAGE - KiB)  # 98% of what the chunks take
    hint = page_waste_hint(doc)
    assert hint is not None and "--page-size 4KiB" in hint and "quarter" in hint

    def eg_kv_stats(*flags: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "workers", "stats", "--url", srv.url, *flags],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    # People read human units (128 x 63 KiB = 7.88 MiB); --json keeps the integer.
    assert re.search(r"^page_waste_bytes\s+7\.88 MiB$", eg_kv_stats(), re.M)
    assert json.loads(eg_kv_stats("--json"))["page_waste_bytes"] == 128 * (PAGE - KiB)


@pytest.mark.lmcache
def test_no_hint_when_chunks_fill_their_pages(server_factory):
    srv = server_factory(workers=1, capacity="16MiB")
    store_chunks(srv.url, 96, 48 * KiB)  # three quarters of a page each
    with RemoteKVConnector(base_url=srv.url) as kv:
        stats = kv.stats()
    doc = {**stats.extra, "unique_blocks": stats.unique_blocks,
           "resident_bytes": stats.resident_bytes}  # fmt: skip
    assert doc["page_waste_bytes"] == 96 * 16 * KiB
    assert page_waste_hint(doc) is None


def test_the_supervisor_hint_is_logged_when_due_and_not_repeated(slab, caplog):
    for i in range(80):  # 2,000-byte blocks in 64 KiB pages (the fixture's slab)
        slab.put(f"blk{i}", b"x" * 2000)
    now = [0.0]
    hinter = PageWasteHinter(interval_s=300, repeat_s=3600, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="eg_kv.supervisor")
    assert hinter.tick(slab.stats) is None  # not due yet
    now[0] = 301
    hint = hinter.tick(slab.stats)
    assert hint and "--page-size 4KiB" in hint
    said = [r for r in caplog.records if r.name == "eg_kv.supervisor"]
    assert [r.levelno for r in said] == [logging.WARNING]
    now[0] = 1000
    assert hinter.tick(slab.stats) is None  # within repeat_s: said already
    now[0] = 4000
    assert hinter.tick(slab.stats) == hint
