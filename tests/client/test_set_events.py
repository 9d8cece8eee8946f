"""A server set's event log: a set of one member reads that server's log; a set of
several refuses with the fix (each member keeps its own log and sequence numbers)."""

from __future__ import annotations

import asyncio

import pytest

from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.rules import to_address
from eg_kv.client.sets import SetConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def test_a_set_of_one_member_reads_its_log(server_factory):
    srv = server_factory(workers=1, capacity="8MiB")
    with SetConnector(KvCacheConfig(base_url=srv.url)) as kv:
        assert kv.put("set-events-a", b"x" * 100)
        batch = kv.events(since=0)
        address = to_address("set-events-a")
        assert [(e.kind, e.hash) for e in batch.events] == [("stored", address)]
        snap = kv.snapshot()
        assert snap.seq == batch.next and [b.hash for b in snap.blocks] == [address]

    async def aio() -> tuple[int, int]:
        async with AsyncSetConnector(KvCacheConfig(base_url=srv.url)) as akv:
            return (await akv.events(since=0)).next, (await akv.snapshot()).seq

    assert asyncio.run(aio()) == (batch.next, batch.next)


def test_a_set_of_several_members_says_to_follow_each(server_factory):
    a, b = (server_factory(workers=1, capacity="8MiB") for _ in range(2))
    config = KvCacheConfig(base_url=f"{a.url},{b.url}")
    with SetConnector(config) as kv, pytest.raises(ConfigError, match="each member's URL"):
        kv.events()

    async def aio() -> None:
        async with AsyncSetConnector(config) as akv:
            await akv.snapshot()

    with pytest.raises(ConfigError, match="one event log per member"):
        asyncio.run(aio())
