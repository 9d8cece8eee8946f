"""The async connectors do what their sync twins do, method by method, against real servers:
one server (over HTTP and through local reads) and a set of two; the compact batch body with
its JSON fallback; misses, never exceptions, when the server is gone.

Which methods exist on each side is tests/client/test_connector_parity.py's job.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers.kvcache import RawServer
from helpers.server_sets import set_url

from eg_kv import wire
from eg_kv.client.aio_connectors import AsyncRemoteKVConnector
from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.client.sets import SetConnector


@pytest.fixture(scope="module")
def servers(module_server_factory):
    """Two one-worker servers: the first alone, both as a set."""
    return [module_server_factory(workers=1, capacity="32MiB") for _ in range(2)]


def _both(url: str, tag: str, **settings: Any) -> dict[str, Any]:
    """Every method's answer, from the sync connector and from the async one, for the same
    blocks (written by the sync one under keys unique to ``tag``)."""
    keys = [f"{tag}-{i}" for i in range(6)]
    block = bytes(range(256)) * 64  # 16 KiB

    with RemoteKVConnector(base_url=url, **settings) as kv:
        assert kv.put_parts(keys[0], [block[:100], memoryview(block)[100:]])
        assert kv.put(keys[1], b"one")
        assert kv.put_status(keys[2], [b"two"]) == 201

        def sink(length: int, read_exact: Any) -> bytes:
            buf = bytearray(length)
            read_exact(memoryview(buf)[:10])
            read_exact(memoryview(buf)[10:])
            return bytes(buf)

        big, small = bytearray(len(block) + 5), bytearray(10)
        want = {
            "fetch": kv.fetch(keys[0], sink),
            "fetch_miss": kv.fetch(keys[5], sink),
            "get_into": (kv.get_into(keys[0], big), bytes(big[: len(block)])),
            "get_into_small": kv.get_into(keys[0], small),
            "get": kv.get(keys[1]),
            "try_exists_many": kv.try_exists_many(keys),
            "try_exists_addresses": kv.try_exists_addresses(keys[:3], 2.0),
            "exists_many": kv.exists_many(keys),
            "contains_prefix": kv.contains_prefix(keys),
            "healthz": kv.healthz() is not None,
            "members": [line.up for line in kv.member_stats()],
            "put_status_again": kv.put_status(keys[2], [b"two"]),
        }

    async def run() -> dict[str, Any]:
        async with AsyncRemoteKVConnector(base_url=url, **settings) as akv:

            async def sink(length: int, read_exact: Any) -> bytes:
                buf = bytearray(length)
                await read_exact(memoryview(buf)[:10])
                await read_exact(memoryview(buf)[10:])
                return bytes(buf)

            big, small = bytearray(len(block) + 5), bytearray(10)
            got = {
                "fetch": await akv.fetch(keys[0], sink),
                "fetch_miss": await akv.fetch(keys[5], sink),
                "get_into": (await akv.get_into(keys[0], big), bytes(big[: len(block)])),
                "get_into_small": await akv.get_into(keys[0], small),
                "get": await akv.get(keys[1]),
                "try_exists_many": await akv.try_exists_many(keys),
                "try_exists_addresses": await akv.try_exists_addresses(keys[:3], 2.0),
                "exists_many": await akv.exists_many(keys),
                "contains_prefix": await akv.contains_prefix(keys),
                "healthz": await akv.healthz() is not None,
                "members": [line.up for line in await akv.member_stats()],
                "put_status_again": await akv.put_status(keys[2], [b"two"]),
            }
            # Writes through the async side, read back by both.
            assert await akv.put_parts(keys[3], [b"a", bytearray(b"b"), memoryview(b"c")])
            assert await akv.get(keys[3]) == b"abc"
            return got

    got = asyncio.run(run())
    with RemoteKVConnector(base_url=url, **settings) as kv:
        assert kv.get(keys[3]) == b"abc"
    assert want["fetch"] == block and want["get_into"] == (len(block), block)
    assert want["try_exists_many"] == [True, True, True, False, False, False]
    return {"want": want, "got": got}


@pytest.mark.slow
@pytest.mark.parametrize("local_reads", [False, True], ids=["http", "local"])
def test_one_server_answers_the_async_client_as_the_sync_one(servers, local_reads):
    both = _both(servers[0].url, f"one-{local_reads}", local_reads=local_reads)
    assert both["got"] == both["want"]


def test_a_set_answers_the_async_client_as_the_sync_one(servers):
    url = set_url(servers)
    both = _both(url, "set", local_reads=False)
    assert both["got"] == both["want"]
    assert both["want"]["members"] == [True, True]


def test_the_async_set_is_built_for_a_set_url(servers):
    async def run() -> tuple[type, type]:
        async with AsyncRemoteKVConnector(base_url=set_url(servers)) as akv:
            one = AsyncRemoteKVConnector(base_url=servers[0].url)
            await one.close()
            return type(akv), type(one)

    set_type, one_type = asyncio.run(run())
    assert set_type is AsyncSetConnector and one_type is AsyncRemoteKVConnector
    with RemoteKVConnector(base_url=set_url(servers)) as kv:
        assert isinstance(kv, SetConnector)


def test_the_async_client_sends_the_compact_batch_and_falls_back_to_json_once():
    async def run(url: str) -> tuple:
        async with AsyncRemoteKVConnector(base_url=url, local_reads=False) as akv:
            return await akv.exists_many(["a", "b"]), await akv.try_exists_many(["c"])

    with RawServer("early_hints") as srv:  # speaks JSON only, like a server before compact
        assert asyncio.run(run(srv.url)) == ([True, True], [True])
    types = [h.lower().split(b"content-type: ", 1)[1].split(b"\r\n")[0] for h in srv.heads]
    # Compact first (refused with a 400), JSON at once, and JSON from then on.
    assert types == [wire.ADDRESSES_TYPE.encode(), b"application/json", b"application/json"]


def test_the_async_client_speaks_the_compact_body_to_a_server_that_does(servers):
    async def run() -> tuple:
        async with AsyncRemoteKVConnector(base_url=servers[0].url, local_reads=False) as akv:
            assert await akv.put("compact-a", b"x")
            found = await akv.exists_many(["compact-a", "compact-b"])
            return found, akv._core.compact_batches  # still compact: the server took it

    assert asyncio.run(run()) == ([True, False], True)


@pytest.mark.parametrize("shape", ["one", "set"])
def test_a_gone_server_is_a_miss_for_every_new_async_method(shape):
    url = "http://127.0.0.1:1" if shape == "one" else "http://127.0.0.1:1,http://127.0.0.1:2"

    async def run() -> list:
        async with AsyncRemoteKVConnector(base_url=url, timeout_s=0.5) as akv:

            async def sink(length: int, read_exact: Any) -> bytes:
                raise AssertionError("no body to read")

            return [
                await akv.fetch("k", sink),
                await akv.get_into("k", bytearray(8)),
                await akv.put_parts("k", [b"x"]),
                await akv.healthz(),
                await akv.try_exists_many(["k"]),
                await akv.try_exists_addresses(["k"], 0.2),
                [line.up for line in await akv.member_stats()],
            ]

    got = asyncio.run(run())
    down = [False] if shape == "one" else [False, False]
    assert got == [None, None, False, None, None, None, down]
