"""Fixtures of the LMCache tests: LMCache's event loop on its own thread."""

from __future__ import annotations

import asyncio
import threading

import pytest


@pytest.fixture
def lmcache_loop():
    """LMCache's event loop on its own thread, as the engine runs it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="lmcache-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
