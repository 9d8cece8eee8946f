"""tests/docs: the Markdown's code blocks and installing eg-kv as users do.

The blocks' servers read ``EPISTEMIC_GRAPH_KVCACHE_*`` from their environment; the tests set
what each needs, so none leaks in from the shell that runs pytest.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_eg_kv_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("EPISTEMIC_GRAPH_KVCACHE_"):
            monkeypatch.delenv(name)
