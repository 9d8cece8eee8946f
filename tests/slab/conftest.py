"""Fixtures the slab's lease tests share."""

from __future__ import annotations

import pytest

from eg_kv.slab.store import Slab

MiB = 1024 * 1024


@pytest.fixture
def small(slab_name):
    """4 MiB of 64 KiB pages: 64 one-page blocks fill it."""
    s = Slab.create(slab_name, 4 * MiB, page_size=64 * 1024, max_block_size=MiB)
    yield s
    s.close()
