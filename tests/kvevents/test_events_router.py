"""scripts/events_router.py's ZMQ follower against a real publisher over a real slab: what
a router built the way the script shows keeps of each namespace."""

from __future__ import annotations

import importlib.util

import pytest
import zmq
from helpers.common import ROOT, free_port, unique_slab_name, wait_for

from eg_kv.kvevents.publisher import Publisher, PublisherOptions
from eg_kv.slab.store import Slab

pytestmark = pytest.mark.timeout(60)


def _router_script():
    spec = importlib.util.spec_from_file_location(
        "events_router", ROOT / "scripts" / "events_router.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_namespaces_clear_leaves_the_others_blocks_held():
    """A tenant's first batch (and a resync of its topic) starts with AllBlocksCleared: the
    router kept one set for every topic, so it forgot the default namespace's 5 blocks
    (it held 1 of 6, and a prompt of them scored 0)."""
    events_router = _router_script()
    slab = Slab.create(unique_slab_name("router"), 4 << 20, 4096)
    ctx = zmq.Context()
    publisher = src = None
    try:
        slab.setup_events(1024)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        publisher = Publisher(slab, PublisherOptions(endpoint=endpoint), context=ctx)
        src = events_router.Source(ctx, "eg-kv", endpoint, None)

        def follow(*addresses: str) -> bool:
            """Step the publisher, apply what arrived; whether ``addresses`` are held."""
            publisher.step()
            while src.sub.poll(50):
                topic, seq, payload = src.sub.recv_multipart()
                src.take(topic, int.from_bytes(seq, "big"), payload)
            return all(a.encode().hex() in src.held for a in addresses)

        probes = iter(range(1000))

        def subscribed() -> bool:  # the subscription reaches the publisher: probes until then
            probe = f"probe{next(probes)}"
            slab.put(probe, b"x")
            return follow(probe)

        wait_for(subscribed, timeout=20, what="the router's subscription")
        held = [f"d{k}" for k in range(5)]
        for address in held:
            slab.put(address, b"x")
        wait_for(lambda: follow(*held), timeout=10, what="the default namespace's blocks")
        ids = slab.bind_namespaces({"t": 0})  # a tenant added (a tokens-file reload)
        slab.put("t0", b"x", ns=ids["t"])
        wait_for(lambda: follow("t0"), timeout=10, what="the tenant's block")
        assert follow(*held), "the default namespace's blocks were forgotten"
        prompt = [f"d{k}".encode().hex() for k in range(3)]
        assert src.score(prompt) == (1.5, 3)  # three leading blocks, SHARED_STORAGE
    finally:
        if src is not None:
            src.sub.close(linger=0)
        if publisher is not None:
            publisher.close()
        ctx.destroy(linger=0)
        slab.close()
        slab.unlink()
