"""Block checksums end to end (issue 32, item 1), with a real server and real clients: every
GET and HEAD answer carries the block's XXH3-64, a PUT body that fails the checksum it
carries is refused and stored nowhere, and a byte changed in the slab in ``/dev/shm`` (as
the server's user) is a miss on every client path (sync and async, over HTTP and by local
reads, one server or a set), counted and logged once, and named by ``eg-kv check --deep``,
whose ``--repair`` frees it."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import xxhash
from helpers.slab_bytes import change_one_byte

from eg_kv.client.aio import AsyncServerConnector
from eg_kv.client.sets import SetConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.client.sync import ServerConnector
from eg_kv.wire import CHECKSUM_HEADER

ROOT = Path(__file__).resolve().parents[2]
KiB, MiB = 1024, 1024 * 1024
pytestmark = pytest.mark.timeout(180)


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def call(srv, method: str, address: str, body=None, headers=None):
    """(status, headers, body) of one request to ``srv``."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        conn.request(method, f"/kv/{address}", body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def stats(srv) -> dict:
    with urllib.request.urlopen(srv.url + "/kv/stats", timeout=10) as r:
        return json.loads(r.read())


def check(srv, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers", "check", "--slab-name", srv.slab_name, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def server(server_factory):
    return server_factory(workers=2, capacity="64MiB", extra=("--page-size", "64KiB"))


@pytest.mark.parametrize("size", [1, 4 * KiB, 64 * KiB + 1, 3 * MiB])
def test_every_block_answer_carries_its_checksum(server, size):
    data = os.urandom(size)
    assert call(server, "PUT", f"sum-{size}", data)[0] == 201  # no checksum sent (curl)
    status, headers, body = call(server, "GET", f"sum-{size}")
    assert (status, body) == (200, data)
    assert headers[CHECKSUM_HEADER] == xxh3(data)
    status, headers, _ = call(server, "HEAD", f"sum-{size}")
    assert status == 200 and headers[CHECKSUM_HEADER] == xxh3(data)
    assert CHECKSUM_HEADER not in call(server, "GET", "absent")[1]


@pytest.mark.parametrize("size", [4 * KiB, 3 * MiB])
def test_a_put_whose_body_fails_its_checksum_is_refused_and_stored_nowhere(server, size):
    data = os.urandom(size)
    wrong = f"{int(xxh3(data), 16) ^ 1:016x}"
    status, _, body = call(server, "PUT", "bad", data, {CHECKSUM_HEADER: wrong})
    assert status == 400 and b"checksum" in body and body.count(b"\n") == 1
    assert call(server, "HEAD", "bad")[0] == 404
    chunked = iter([data[: size // 2], data[size // 2 :]])
    status, _, _ = call(server, "PUT", "bad", chunked, {CHECKSUM_HEADER: wrong})
    assert status == 400 and call(server, "HEAD", "bad")[0] == 404
    after = stats(server)
    assert after["bad_checksum_puts"] == 2 and after["unique_blocks"] == 0
    assert after["free_bytes"] == after["capacity_bytes"]  # its pages went back
    for bad in ("xyz", "0" * 15, "g" * 16, "1" * 17):
        status, _, body = call(server, "PUT", "bad", data, {CHECKSUM_HEADER: bad})
        assert status == 400 and b"hex digits" in body
    status, _, _ = call(server, "PUT", "good", data, {CHECKSUM_HEADER: xxh3(data).upper()})
    assert status == 201 and call(server, "GET", "good")[2] == data


def test_the_clients_send_the_checksum_the_server_keeps(server):
    data = [os.urandom(70 * KiB), os.urandom(5)]
    with ServerConnector(KvCacheConfig(base_url=server.url)) as client:
        assert client.put_parts("parts", data)
    assert call(server, "HEAD", "parts")[1][CHECKSUM_HEADER] == xxh3(b"".join(data))

    async def aio() -> None:
        async with AsyncServerConnector(KvCacheConfig(base_url=server.url)) as client:
            assert await client.put_parts("aparts", data)

    asyncio.run(aio())
    assert call(server, "HEAD", "aparts")[1][CHECKSUM_HEADER] == xxh3(b"".join(data))
    assert stats(server)["bad_checksum_puts"] == 0


def test_a_byte_changed_in_the_slab_is_a_miss_on_every_client_path(server, caplog):
    blocks = {"small": os.urandom(4 * KiB), "big": os.urandom(2 * MiB)}
    with ServerConnector(KvCacheConfig(base_url=server.url)) as client:
        for address, data in blocks.items():
            assert client.put(address, data)
            assert client.get(address) == data
    for data in blocks.values():
        assert change_one_byte(server, data, len(data) // 2)

    http_only = KvCacheConfig(base_url=server.url, local_reads=False)
    local = KvCacheConfig(base_url=server.url)  # local reads on: the test runs on the host
    caplog.set_level(logging.ERROR, logger="eg_kv.checksum")
    sync_counts = []
    for config in (http_only, local):
        with ServerConnector(config) as client:
            for address, data in blocks.items():
                assert client.get(address) is None
                buf = bytearray(len(data))
                assert client.get_into(address, buf) is None
                assert client.fetch(address, lambda n, read: read(memoryview(bytearray(n)))) is None
                assert client.get(address) is None
            assert (client._core.local.slab is not None) == config.local_reads
            sync_counts.append(client.checksum_failures)
    assert sync_counts == [8, 8]
    # Logged once per address and client, not once per read.
    lines = [r.getMessage() for r in caplog.records if "failed its checksum" in r.getMessage()]
    assert len(lines) == 4 and all("small" in m or "big" in m for m in lines)

    async def aio(config: KvCacheConfig) -> int:
        async with AsyncServerConnector(config) as client:
            for address, data in blocks.items():
                assert await client.get(address) is None
                assert await client.get_into(address, bytearray(len(data))) is None
            return client.checksum_failures

    assert asyncio.run(aio(http_only)) == 4
    assert asyncio.run(aio(local)) == 4
    # The local reads counted their failures in the slab: the server's stats show them.
    assert stats(server)["checksum_failures"] >= 8 + 4

    found = check(server, "--deep")
    assert found.returncode == 1, found.stdout + found.stderr
    for address in blocks:
        assert f"block {address} " in found.stdout and "fails its checksum" in found.stdout
    fixed = check(server, "--deep", "--repair")
    assert fixed.returncode == 1 and fixed.stdout.count("; freed") == 2
    assert call(server, "HEAD", "small")[0] == 404 and call(server, "HEAD", "big")[0] == 404
    clean = check(server, "--deep")
    assert clean.returncode == 0 and "0 failed their checksum" in clean.stdout


def test_a_server_set_misses_a_changed_block_whichever_member_holds_it(server_factory):
    a, b = (server_factory(workers=1, capacity="32MiB") for _ in range(2))
    blocks = {f"set-{i}": os.urandom(64 * KiB + i) for i in range(4)}
    config = KvCacheConfig(base_url=f"{a.url},{b.url}", local_reads=False)
    with SetConnector(config) as members:
        for address, data in blocks.items():
            assert members.put(address, data) and members.get(address) == data
        for data in blocks.values():
            assert change_one_byte(a, data, 7) or change_one_byte(b, data, 7)
        assert all(members.get(address) is None for address in blocks)
        assert members.checksum_failures == len(blocks)


@pytest.mark.parametrize("local_reads", [False, True])
def test_the_lmcache_l2_adapter_misses_a_changed_block(server, local_reads):
    from helpers.kvcache import lm_keys, wait_completions

    from eg_kv.kvcache import RemoteKVL2Connector

    conn = RemoteKVL2Connector(base_url=server.url, timeout_s=10, local_reads=local_reads)
    try:
        keys = lm_keys(2)
        blocks = [bytearray(os.urandom(2 * MiB + 5)) for _ in keys]
        f_set = conn.submit_batch_set(keys, [memoryview(b) for b in blocks])
        assert wait_completions(conn, {f_set})[f_set][3] == [True, True]
        assert change_one_byte(server, bytes(blocks[1]), 1000)
        outs = [bytearray(len(b)) for b in blocks]
        f_get = conn.submit_batch_get(keys, [memoryview(o) for o in outs])
        assert wait_completions(conn, {f_get})[f_get][3] == [True, False]
        assert outs[0] == blocks[0]
        assert conn._client.checksum_failures == 1
    finally:
        conn.close()
