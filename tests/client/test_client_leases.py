"""Leases from the clients' side against real servers: a set's members each lease their
part of a batch and release what they leased; the vLLM connector's load path
(eg_kv.vllm.staging.load_rows, no engine) releases what its lookup leased; a server without
leases (--lease-ms 0) still answers every lookup; the connector's lease_ms setting."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.connectors import connect
from eg_kv.client.sets import SetConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.errors import ConfigError
from eg_kv.vllm.settings import settings_from
from eg_kv.vllm.staging import load_rows
from eg_kv.vllm.trailers import address_tag

pytestmark = pytest.mark.timeout(120)
ROW = 8 * 1024


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/kv/stats", timeout=10) as r:
        return json.loads(r.read())


def leases(url: str) -> tuple[int, int, int]:
    st = stats(url)
    return st["leases_taken"], st["leases_released"], st["leased_blocks"]


@pytest.fixture
def pair(server_factory):
    """Two servers, the members of one set."""
    return [server_factory(workers=1, capacity="8MiB") for _ in range(2)]


def test_a_set_leases_each_members_part_and_releases_it_there(pair):
    base = ",".join(s.url for s in pair)
    keys = [f"set-lease-{k}" for k in range(40)]
    with SetConnector(KvCacheConfig(base_url=base)) as kv:
        assert all(kv.put(k, bytes(ROW)) for k in keys)
        assert kv.exists_many([*keys, "absent"], lease_ms=5000) == [True] * 40 + [False]
        per_member = [leases(s.url) for s in pair]
        assert sum(t for t, _r, _h in per_member) == 40
        assert all(t > 0 for t, _r, _h in per_member)  # both members took part
        assert kv.get(keys[0], release_lease=True) == bytes(ROW)
        assert kv.release(keys[1:]) == 39
        assert [leases(s.url)[2] for s in pair] == [0, 0]
        # contains_prefix leases the prefix and gives back what lies past it
        assert kv.delete(keys[10])
        assert kv.contains_prefix(keys, lease_ms=5000) == 10
        assert sum(leases(s.url)[2] for s in pair) == 10


def test_the_async_set_leases_and_releases_alike(pair):
    base = ",".join(s.url for s in pair)
    keys = [f"aset-lease-{k}" for k in range(20)]

    async def run() -> None:
        async with AsyncSetConnector(KvCacheConfig(base_url=base)) as kv:
            for k in keys:
                assert await kv.put(k, bytes(ROW))
            assert await kv.try_exists_many(keys, lease_ms=5000) == [True] * 20
            assert await kv.get(keys[0], release_lease=True) == bytes(ROW)
            assert await kv.release(keys[1:]) == 19

    asyncio.run(run())
    assert sum(leases(s.url)[0] for s in pair) == 20
    assert [leases(s.url)[2] for s in pair] == [0, 0]


def test_the_connectors_loads_release_what_its_lookup_leased(server_factory):
    srv = server_factory(workers=1, capacity="8MiB")
    client = connect(KvCacheConfig.from_env({}, base_url=srv.url, timeout_s=5.0))
    try:
        addrs = [f"egv-lease-{k}" for k in range(6)]
        for a in addrs[:5]:
            assert client.put(a, bytes(ROW) + address_tag(a))  # as the connector stores it
        assert client.contains_prefix(addrs, lease_ms=5000) == 5
        assert leases(srv.url) == (5, 0, 5)
        rows = [bytearray(ROW) for _ in addrs]
        with ThreadPoolExecutor(4) as pool:
            ok, failed = load_rows(client, addrs, rows, map_fn=pool.map, release_lease=True)
        assert (ok, failed) == ([0, 1, 2, 3, 4], [5])
        assert leases(srv.url) == (5, 5, 0)
    finally:
        client.close()


def test_a_server_with_leases_off_answers_leasing_lookups_without_them(server_factory):
    srv = server_factory(workers=1, capacity="8MiB", extra=("--lease-ms", "0"))
    with connect(KvCacheConfig(base_url=srv.url)) as kv:
        assert kv.put("k", b"v")
        assert kv.exists_many(["k", "x"], lease_ms=5000) == [True, False]
        assert kv.get("k", release_lease=True) == b"v"
        assert kv.release(["k"]) == 0
    assert leases(srv.url) == (0, 0, 0)


def test_the_connectors_lease_setting():
    assert settings_from({"url": "http://127.0.0.1:9"}, env={}).lease_ms == 5000
    assert settings_from({"url": "http://127.0.0.1:9", "lease_ms": 0}, env={}).lease_ms == 0
    with pytest.raises(ConfigError, match="lease_ms must be at least 0"):
        settings_from({"url": "http://127.0.0.1:9", "lease_ms": -1}, env={})
    with pytest.raises(ConfigError, match="io_threads must be at least 1"):
        settings_from({"url": "http://127.0.0.1:9", "io_threads": 0}, env={})


def test_a_leasing_lookup_on_the_hosts_slab_sends_no_request(server_factory):
    """On the server's host a leasing lookup reads the slab and leases its hits in the
    reader's own lease table (eg_kv.slab.local_leases): no batch request, hit or miss, sync
    and async; the server counts the lease, and the load releases it without a request
    either. Requests are counted in order, so the marker request (a lookup over HTTP)
    showing in /metrics means any earlier one would have."""
    import re

    from helpers.common import wait_for

    from eg_kv.client.aio import AsyncServerConnector

    srv = server_factory(workers=1, capacity="8MiB")

    def requests(route: str) -> int:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        method = r'method="(?:POST|GET)"'
        pattern = rf'eg_kv_requests_total{{{method},route="{route}",status="200"}} (\S+)'
        return int(sum(float(v) for v in re.findall(pattern, text)))

    with connect(KvCacheConfig(base_url=srv.url)) as kv:
        assert kv.put("held", bytes(ROW))
        assert kv.exists_many(["absent-1", "absent-2"], lease_ms=5000) == [False, False]
        assert kv.exists_many(["held", "absent-1"], lease_ms=5000) == [True, False]

        async def aio_lookup() -> list[bool]:
            async with AsyncServerConnector(KvCacheConfig(base_url=srv.url)) as akv:
                found = await akv.exists_many(["held", "absent-3"], lease_ms=5000)
                assert await akv.get("held", release_lease=True) == bytes(ROW)
                return found

        assert asyncio.run(aio_lookup()) == [True, False]
        assert leases(srv.url) == (2, 1, 1)  # the sync lookup's lease is still held
        assert kv.get("held", release_lease=True) == bytes(ROW)
        assert leases(srv.url) == (2, 2, 0)
        with connect(KvCacheConfig(base_url=srv.url, local_reads=False)) as remote:
            assert remote.exists_many(["held"]) == [True]  # the marker
        wait_for(lambda: requests("batch_exists") >= 1, what="the marker request counted")
        assert requests("batch_exists") == 1
        assert requests("batch_release") == 0
        assert requests("block") == 0  # both loads read the slab
