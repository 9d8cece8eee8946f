"""Issue 34: eg-kv's event log as vLLM's KV events, consumed as routers consume it.

Real servers with a publisher (``--kv-events-endpoint``), real PUTs carrying engine hashes,
and a real subscriber process (tests/kvevents/subscriber.py): decoding with vLLM's own
``KVEventBatch`` (vLLM 0.32 and 0.34: tests/helpers/vllm_envs.py) or the positional form as
llm-d's indexer does. After churn (stores, evictions, DELETEs, a worker SIGKILLed, the
publisher SIGKILLed while the log moves on: replay, then a resync once the log lapped it, a
``--fresh`` restart: ``AllBlocksCleared``), the subscriber's set of hashes is the server's,
exactly.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading

import psutil
import pytest
from helpers.common import ROOT, free_port, wait_for
from helpers.kv_publisher import Subscriber, engine_hash, held_by, kv_events_flags, publisher_of
from helpers.server_http import request
from helpers.server_procs import workers_of
from helpers.tenants import token_of, write_tokens
from helpers.vllm_envs import vllm_py_fixture

from eg_kv.engine import EngineName, engine_headers

pytestmark = pytest.mark.timeout(240)

vllm_py = vllm_py_fixture()
BLOCK = b"k" * 4096


def put(srv, address: str, token: str | None = None, parent: bytes = b"") -> int:
    name = EngineName(engine_hash(address), parent, 16, 0)
    return request(srv, "PUT", f"/kv/{address}", BLOCK, engine_headers(name), token=token).status


@pytest.mark.slow
def test_a_vllm_subscriber_rebuilds_what_the_server_holds_through_churn(server_factory, vllm_py):
    ports = (free_port(), free_port())
    extra = kv_events_flags(ports, "--events", "256")  # a short log: a resync is reachable
    srv = server_factory(workers=2, capacity="4MiB", extra=extra)
    sub = Subscriber(vllm_py, ports, "kv@pool:node:test@tiny", "vllm")
    n = [0]

    def store(count: int) -> None:
        for _ in range(count):
            assert put(srv, f"blk{n[0]}") in (200, 201)
            n[0] += 1

    def store_through_a_kill(count: int) -> None:  # a PUT the kill cuts may or may not land
        for _ in range(count):
            with contextlib.suppress(OSError):
                put(srv, f"blk{n[0]}")
            n[0] += 1

    def agrees(what: str) -> dict:
        addresses = held_by(srv)
        got = sub.dump()
        want = sorted(engine_hash(a).hex() for a in addresses)
        assert got["held"] == want, f"{what}: {len(got['held'])} held, server {len(want)}"
        assert got["media"] == ["SHARED_STORAGE"]
        return got

    try:
        # Stores past the slab's 64 pages: evictions; then DELETEs.
        store(150)
        held = held_by(srv)  # the newest are held, but CLOCK's order is not exactly by age
        gone = [a for a in (f"blk{k}" for k in range(149, 99, -1)) if a in held][:5]
        assert len(gone) == 5
        for address in gone:
            assert request(srv, "DELETE", f"/kv/{address}").status == 204
        first = agrees("stores, evictions and deletes")
        assert first["cleared"] >= 1 and len(first["held"]) > 50
        # A worker SIGKILLed while PUTs run.
        worker = min(workers_of(srv) - {publisher_of(srv, ports[0])})
        churn = threading.Thread(target=store_through_a_kill, args=(100,))
        churn.start()
        psutil.Process(worker).send_signal(signal.SIGKILL)
        churn.join(60)
        wait_for(lambda: (srv.healthz() or {}).get("workers_up") == 2, what="a new worker")
        agrees("a worker killed")
        # The publisher stopped while the log moves on, then killed: 40 entries (within the
        # log's 256) come back by replay; 600 (lapped) by a resync.
        for moved, resync in ((40, False), (600, True)):
            before = sub.dump()
            old = publisher_of(srv, ports[0])
            psutil.Process(old).send_signal(signal.SIGSTOP)  # stopped: it publishes nothing
            store(moved)
            psutil.Process(old).send_signal(signal.SIGKILL)  # and dies; a new one starts
            wait_for(lambda old=old: publisher_of(srv, ports[0]) not in (None, old),
                     timeout=20, what="the publisher started again")  # fmt: skip
            store(1)
            got = agrees(f"the publisher killed, {moved} entries missed")
            assert got["replays"] > before["replays"]
            assert (got["resyncs"] > before["resyncs"]) == resync
    finally:
        sub.close()
    # A --fresh restart: a new log, AllBlocksCleared, then only the new blocks.
    sub = Subscriber(vllm_py, ports, "kv@pool:node:test@tiny", "vllm")
    try:
        before = sub.dump()
        srv.stop()
        srv = server_factory(workers=2, capacity="4MiB", extra=(*extra, "--fresh"),
                             port=srv.port, slab_name=srv.slab_name)  # fmt: skip
        n[0] = 10_000
        store(20)
        got = agrees("a --fresh restart")
        assert got["cleared"] > before["cleared"] and len(got["held"]) == 20
    finally:
        sub.close()


def test_the_positional_form_read_as_llm_d_does_and_namespaces_apart(server_factory, tmp_path):
    """``--kv-events-arrays``, decoded by hand as llm-d's indexer does (the last 8 bytes of
    each hash); two tenants publish on two topics, and neither sees the other's blocks."""
    path = write_tokens(tmp_path / "tokens.toml", [
        {"name": "alice", "role": "readwrite", "namespace": "team-a"},
        {"name": "bob", "role": "readwrite", "namespace": "team-b"},
    ])  # fmt: skip
    ports = (free_port(), free_port())
    extra = kv_events_flags(ports, "--kv-events-arrays", "--tokens", str(path))
    srv = server_factory(workers=2, capacity="4MiB", extra=extra)
    subs = {
        who: Subscriber(sys.executable, ports, f"kv@pool:node:test/{ns}@tiny", "llm-d")
        for who, ns in (("alice", "team-a"), ("bob", "team-b"))
    }
    try:
        for k in range(120):
            who = "alice" if k % 3 else "bob"
            assert put(srv, f"{who}{k}", token_of(who)) in (200, 201)
        assert request(srv, "DELETE", "/kv/alice119", token=token_of("alice")).status == 204
        for who, sub in subs.items():
            addresses = held_by(srv, token_of(who))
            got = sub.dump()
            want = sorted(str(int.from_bytes(engine_hash(a)[-8:], "big")) for a in addresses)
            assert addresses and all(a.startswith(who) for a in addresses)
            assert got["held"] == want, who
    finally:
        for sub in subs.values():
            sub.close()


def test_bad_engine_headers_get_400_and_store_nothing(server_factory):
    srv = server_factory(workers=1, capacity="4MiB")
    for headers in ({"X-Eg-Kv-Engine-Hash": "xyz"}, {"X-Eg-Kv-Engine-Hash": "ab" * 33},
                    {"X-Eg-Kv-Engine-Block-Size": "16"},
                    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Block-Size": "-1"},
                    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Lora": "9" * 30}):  # fmt: skip
        got = request(srv, "PUT", "/kv/bad", BLOCK, headers)
        assert got.status == 400 and b"X-Eg-Kv-Engine" in got.body, headers
    assert request(srv, "HEAD", "/kv/bad").status == 404


@pytest.mark.slow
def test_the_router_demo_scores_sources_by_leading_blocks_and_medium(server_factory):
    """scripts/events_router.py --zmq over two streams: eg-kv (SHARED_STORAGE) holding a
    prompt's 4 blocks and an instance's stand-in (an eg-kv server publishing as GPU)
    holding its first; both stored before the router joined (it replays them)."""
    shared, instance = (free_port(), free_port()), (free_port(), free_port())
    a = server_factory(workers=1, capacity="4MiB", extra=kv_events_flags(shared))
    b = server_factory(workers=1, capacity="4MiB",
                       extra=kv_events_flags(instance, "--kv-events-medium", "GPU"))  # fmt: skip
    prompt = [f"p{k}" for k in range(4)]
    for k, address in enumerate(prompt):
        parent = engine_hash(prompt[k - 1]) if k else b""
        assert put(a, address, parent=parent) == 201
    assert put(b, prompt[0]) == 201
    hexes = ",".join(engine_hash(x).hex() for x in prompt)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "events_router.py"), "--seconds", "1",
         "--zmq", f"eg-kv=tcp://127.0.0.1:{shared[0]},tcp://127.0.0.1:{shared[1]}",
         "--zmq", f"gpu-a=tcp://127.0.0.1:{instance[0]},tcp://127.0.0.1:{instance[1]}", hexes],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()[1:]]
    assert lines == [["2.0", "4/4", "eg-kv", "SHARED_STORAGE"], ["1.0", "1/4", "gpu-a", "GPU"]]


def test_a_publisher_beyond_loopback_is_warned_about(server_factory):
    port = free_port()
    srv = server_factory(workers=1, capacity="4MiB",
                         extra=("--kv-events-endpoint", f"tcp://0.0.0.0:{port}"))  # fmt: skip
    wait_for(lambda: "ZMQ has no authentication" in srv.log(), what="the warning")
    wait_for(lambda: "KV events published on" in srv.log(), what="the publisher up all the same")


def test_a_subscriber_that_never_reads_costs_the_others_nothing(server_factory):
    """A SUB that connects and never reads while 1,500 PUTs churn: every PUT succeeds, the
    publisher stays the same process, and a reading subscriber gets every event in order."""
    ports = (free_port(), free_port())
    srv = server_factory(workers=2, capacity="4MiB", extra=kv_events_flags(ports))
    import zmq

    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 10)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(f"tcp://127.0.0.1:{ports[0]}")
    sub = Subscriber(sys.executable, ports, "kv@pool:node:test@tiny", "llm-d")
    try:
        # The publisher binds once its worker serves: /healthz may answer before it has.
        publisher = wait_for(lambda: publisher_of(srv, ports[0]), what="the publisher bound")
        probes = iter(range(100))

        def live() -> bool:  # the reading SUB's subscription has reached the publisher
            assert put(srv, f"probe{next(probes)}") == 201
            return sub.dump()["live"] > 0

        wait_for(live, what="the subscriber's SUB delivering")
        for k in range(1500):
            assert put(srv, f"s{k}") == 201
        got = sub.dump()
        want = sorted(str(int.from_bytes(engine_hash(a)[-8:], "big")) for a in held_by(srv))
        assert got["held"] == want and got["resyncs"] == 1  # on joining
        assert got["holes"] == 0 and got["live_events"] > 1000, got["live_events"]
        assert publisher_of(srv, ports[0]) == publisher
    finally:
        sub.close()
        stuck.close(linger=0)
        ctx.term()
