"""Issue 34: a PUT's token ids and LoRA name, which the slab does not keep, reach the KV
events all the same: real servers with a publisher, real PUTs on every path a body takes
(the fast lane's small ones, large ones read straight into the slab, aiohttp's chunked
ones), a real subscriber socket, and the replay socket."""

from __future__ import annotations

import asyncio
import base64
import os

import msgspec
import pytest
import zmq
from helpers.common import free_port, wait_for
from helpers.kv_publisher import engine_hash, kv_events_flags, publisher_of
from helpers.server_http import request
from helpers.tenants import token_of, write_tokens

from eg_kv.client.aio import AsyncServerConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.client.sync import ServerConnector
from eg_kv.engine import TOKENS_MAX, EngineName, chained_names, engine_headers

pytestmark = pytest.mark.timeout(120)
TOPIC = b"kv@pool:node:test@tiny"
KiB = 1024


class Sub:
    """A SUB socket on the publisher, decoding each message's events as vLLM's are."""

    def __init__(self, port: int, topic: bytes = TOPIC) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.stored: dict[bytes, dict] = {}

    def take(self, timeout_ms: int = 100) -> int:
        """Read what arrived within ``timeout_ms``; how many events."""
        n = 0
        while self.sock.poll(timeout_ms):
            _topic, _seq, payload = self.sock.recv_multipart()
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev["type"] == "BlockStored":
                    self.stored[ev["block_hashes"][0]] = ev
                n += 1
            timeout_ms = 0
        return n

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def named(address: str, tokens: list[int], lora: str = "") -> EngineName:
    return chained_names([engine_hash(address)], len(tokens), None, tokens, 7, lora)[0]


@pytest.fixture
def publishing(server_factory):
    ports = (free_port(), free_port())
    srv = server_factory(workers=2, capacity="16MiB", extra=kv_events_flags(ports))
    wait_for(lambda: publisher_of(srv, ports[0]), what="the publisher bound")
    sub = Sub(ports[0])
    probes = iter(range(200))

    def live() -> bool:  # the SUB's subscription has reached the publisher
        assert request(srv, "PUT", f"/kv/probe{next(probes)}", b"p").status == 201
        return sub.take() > 0

    wait_for(live, what="the subscriber's SUB delivering")
    try:
        yield srv, sub, ports
    finally:
        sub.close()


def test_token_ids_and_lora_names_reach_subscribers_on_every_put_path(publishing):
    srv, sub, _ = publishing
    blocks = {  # address -> (its bytes, its tokens): small (the lane), large (the intake)
        "tok-small": (os.urandom(4 * KiB), list(range(16))),
        "tok-large": (os.urandom(300 * KiB), [2**32 - 1, 0, 151_643, 7] * 64),
        "tok-most": (os.urandom(8 * KiB), list(range(TOKENS_MAX))),
    }
    with ServerConnector(KvCacheConfig(base_url=srv.url, local_reads=False)) as client:
        for address, (data, tokens) in blocks.items():
            assert client.put_status(address, [data], named(address, tokens, "sql-lora")) == 201

    async def aio() -> int | None:  # the async client, a body sent in pieces
        async with AsyncServerConnector(KvCacheConfig(base_url=srv.url)) as client:
            return await client.put_status(
                "tok-aio", [os.urandom(70 * KiB), b"x"], named("tok-aio", [9, 8, 7], "")
            )

    assert asyncio.run(aio()) == 201
    blocks["tok-aio"] = (b"", [9, 8, 7])
    # A chunked body (aiohttp's way) and a PUT with a hash and no extras.
    chunked = named("tok-chunked", [5] * 32, "a/b@c")
    body = iter([b"a" * 5000, b"b"])  # an iterable: http.client sends it chunked
    assert request(srv, "PUT", "/kv/tok-chunked", body, engine_headers(chunked)).status == 201
    blocks["tok-chunked"] = (b"", [5] * 32)
    plain = EngineName(engine_hash("tok-plain"), b"", 16)
    assert request(srv, "PUT", "/kv/tok-plain", b"q" * 100, engine_headers(plain)).status == 201

    want = {engine_hash(a) for a in [*blocks, "tok-plain"]}
    wait_for(lambda: sub.take() >= 0 and want <= sub.stored.keys(), what="every store published")
    for address, (_, tokens) in blocks.items():
        ev = sub.stored[engine_hash(address)]
        assert ev["token_ids"] == tokens, address
        assert ev["block_size"] == len(tokens) and ev["lora_id"] == 7
        want_name = {"tok-aio": None, "tok-chunked": "a/b@c"}.get(address, "sql-lora")
        assert ev["lora_name"] == want_name, address
    ev = sub.stored[engine_hash("tok-plain")]
    assert ev["token_ids"] == [] and ev["lora_name"] is None


def test_a_replay_carries_what_the_live_stream_did(publishing):
    srv, sub, ports = publishing
    tokens = list(range(100, 132))
    name = named("rep-1", tokens, "lora-x")
    assert request(srv, "PUT", "/kv/rep-1", b"r" * 2048, engine_headers(name)).status == 201
    wait_for(lambda: sub.take() >= 0 and engine_hash("rep-1") in sub.stored, what="published")
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.connect(f"tcp://127.0.0.1:{ports[1]}")
    try:
        req.send_multipart((b"", TOPIC, (0).to_bytes(8, "big")))
        replayed = {}
        while True:
            _, _topic, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev["type"] == "BlockStored":
                    replayed[ev["block_hashes"][0]] = ev
    finally:
        req.close(linger=0)
        ctx.term()
    ev = replayed[engine_hash("rep-1")]
    assert ev["token_ids"] == tokens and ev["lora_name"] == "lora-x"


@pytest.mark.parametrize("headers", [
    {"X-Eg-Kv-Engine-Tokens": "AAAAAA=="},  # tokens without the hash they describe
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Tokens": "not base64!"},
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Tokens": "AAAA"},  # 3 bytes: no whole id
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Tokens": ""},
    {"X-Eg-Kv-Engine-Hash": "ab",
     "X-Eg-Kv-Engine-Tokens": base64.b64encode(bytes(4 * (TOKENS_MAX + 1))).decode()},
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Lora-Name": "has space"},
    {"X-Eg-Kv-Engine-Hash": "ab", "X-Eg-Kv-Engine-Lora-Name": "x" * 129},
])  # fmt: skip
def test_bad_token_ids_and_lora_names_get_400_and_store_nothing(server_factory, headers):
    srv = server_factory(workers=1, capacity="4MiB")
    for body in (b"k" * 4096, b"k" * (200 * KiB)):  # the lane's way and aiohttp's
        got = request(srv, "PUT", "/kv/bad", body, headers)
        assert got.status == 400 and b"X-Eg-Kv-Engine" in got.body, headers
        assert got.body.count(b"\n") == 1
    assert request(srv, "HEAD", "/kv/bad").status == 404


def test_without_a_publisher_token_ids_are_checked_and_dropped(server_factory):
    srv = server_factory(workers=1, capacity="4MiB")
    name = named("np-1", [1, 2, 3], "l")
    assert request(srv, "PUT", "/kv/np-1", b"n" * 4096, engine_headers(name)).status == 201
    assert request(srv, "GET", "/kv/np-1").body == b"n" * 4096


def test_the_publishers_counters_reach_metrics(publishing):
    srv = publishing[0]

    def counters() -> dict[str, float]:
        text = request(srv, "GET", "/metrics").body.decode()
        return {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line.startswith("eg_kv_kv_events_")
        }

    for k in range(20):
        assert request(srv, "PUT", f"/kv/m{k}", b"m" * 100).status == 201
    # The publisher writes its counters about once a second; every worker shows them.
    wait_for(lambda: counters().get("eg_kv_kv_events_published_total", 0) >= 20,
             what="the publisher's counters in /metrics")  # fmt: skip
    got = counters()
    for quiet in ("skipped", "extras_late", "extras_dropped"):
        assert got[f"eg_kv_kv_events_{quiet}_total"] == 0, quiet


def test_a_namespace_publishes_under_its_own_model(server_factory, tmp_path):
    """A tokens file's ``model`` names a namespace's topic: one server, two models' engines
    as two tenants, each router subscribed to its model's topic gets its blocks only."""
    path = write_tokens(tmp_path / "tokens.toml", [
        {"name": "alice", "role": "readwrite", "namespace": "team-a", "model": "org/model-a"},
        {"name": "bob", "role": "readwrite", "namespace": "team-b"},
    ])  # fmt: skip
    ports = (free_port(), free_port())
    srv = server_factory(workers=2, capacity="16MiB",
                         extra=(*kv_events_flags(ports), "--tokens", str(path)))  # fmt: skip
    wait_for(lambda: publisher_of(srv, ports[0]), what="the publisher bound")
    subs = {
        "alice": Sub(ports[0], b"kv@pool:node:test/team-a@org/model-a"),
        "bob": Sub(ports[0], b"kv@pool:node:test/team-b@tiny"),  # --kv-events-model's
    }
    probes = iter(range(400))
    try:

        def live() -> bool:  # both SUBs' subscriptions have reached the publisher
            k = next(probes)
            for who in subs:
                name = EngineName(engine_hash(f"probe-{who}-{k}"), b"", 16)
                got = request(srv, "PUT", f"/kv/probe-{who}-{k}", b"p", engine_headers(name),
                              token=token_of(who))  # fmt: skip
                assert got.status == 201
            return all([sub.take() > 0 for sub in subs.values()])

        wait_for(live, what="both subscribers' SUBs delivering")
        for who in subs:
            name = EngineName(engine_hash(f"{who}-block"), b"", 16)
            got = request(srv, "PUT", f"/kv/{who}-block", b"b" * 100, engine_headers(name),
                          token=token_of(who))  # fmt: skip
            assert got.status == 201
        for who, sub in subs.items():
            block = engine_hash(f"{who}-block")
            wait_for(lambda sub=sub, block=block: sub.take() >= 0 and block in sub.stored,
                     what=f"{who}'s block")  # fmt: skip
            mine = {engine_hash(f"probe-{who}-{k}") for k in range(400)} | {block}
            assert set(sub.stored) <= mine, f"{who}'s topic carried another's blocks"
    finally:
        for sub in subs.values():
            sub.close()
