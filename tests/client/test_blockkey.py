"""The engines' block key (issue 32, item 2), with real servers and real clients: with a
key, forged blocks from another token holder and from a lying server load 0 times (they
loaded every time before: the controls below, without a key, still do), and what a keyed
engine stores round-trips on every path (sync, async, local reads, the LMCache L2 adapter,
the vLLM tier's copies)."""

from __future__ import annotations

import asyncio
import http.server
import os
import threading

import pytest
import xxhash
from helpers.kvcache import lm_keys, wait_completions
from helpers.slab_bytes import change_one_byte

from eg_kv.blockkey import (
    ENV_BLOCK_KEY,
    ONE_CALL_MAX,
    OVERHEAD,
    SALT,
    TAG,
    BlockKey,
    ForgedBlock,
    from_env,
)
from eg_kv.client.aio import AsyncServerConnector
from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.sets import SetConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.client.sync import ServerConnector
from eg_kv.errors import ConfigError
from eg_kv.kvcache import RemoteKVL2Connector
from eg_kv.vllm.tier_copies import TRAILER, CopyJobs, trailer
from eg_kv.wire import CHECKSUM_HEADER

KiB, MiB = 1024, 1024 * 1024
SECRET = "engines-only-" + os.urandom(16).hex()
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(server_factory):
    return server_factory(workers=2, capacity="64MiB", extra=("--page-size", "64KiB"))


def keyed(url: str, **kw) -> KvCacheConfig:
    return KvCacheConfig.from_env({ENV_BLOCK_KEY: SECRET}, base_url=url, **kw)


def test_the_key_is_read_checked_and_never_shown(tmp_path):
    key = from_env({ENV_BLOCK_KEY: SECRET})
    assert key is not None and SECRET not in repr(key)
    config = KvCacheConfig.from_env({ENV_BLOCK_KEY: SECRET})
    assert SECRET not in repr(config) and "BlockKey" not in repr(config)
    path = tmp_path / "key"
    path.write_text(SECRET + "\n")
    from_file = KvCacheConfig.from_env({}, block_key_file=str(path)).block_key
    assert from_file is not None
    salt, tag = key.seal("a", [b"x"])
    assert from_file.open("a", salt + b"x" + tag) == b"x"
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        from_env({ENV_BLOCK_KEY: "short"})
    with pytest.raises(ConfigError, match="cannot read the block key file"):
        KvCacheConfig.from_env({}, block_key_file=str(tmp_path / "absent"))
    assert from_env({}) is None


@pytest.mark.parametrize("local_reads", [False, True])
@pytest.mark.parametrize("size", [3 * MiB + 3, ONE_CALL_MAX, ONE_CALL_MAX + 1, 1])
def test_a_keyed_engine_round_trips_what_it_stores(server, local_reads, size):
    # Small blocks are read whole and checked in one call, large ones as they arrive.
    data = os.urandom(size)
    with ServerConnector(keyed(server.url, local_reads=local_reads)) as engine:
        assert engine.put("kv-1", data) and engine.get("kv-1") == data
        buf = bytearray(len(data))
        assert engine.get_into("kv-1", buf) == len(data) and buf == data
        # A sink may read in pieces; one that leaves bytes unread or reads past them misses.
        pieces: list[bytes] = []

        def in_pieces(n: int, read) -> int:
            for at in range(0, n, 7777):
                piece = bytearray(min(7777, n - at))
                read(memoryview(piece))
                pieces.append(bytes(piece))
            return n

        assert engine.fetch("kv-1", in_pieces) == len(data) and b"".join(pieces) == data
        assert engine.fetch("kv-1", lambda n, read: read(memoryview(bytearray(n - 1)))) is None
        assert engine.fetch("kv-1", lambda n, read: read(memoryview(bytearray(n + 1)))) is None
        assert engine.forged_blocks == 0
    with ServerConnector(KvCacheConfig(base_url=server.url)) as plain:
        stored = plain.get("kv-1")
    # What the server holds: a salt, the bytes, then the tag.
    assert len(stored) == SALT + len(data) + TAG and stored[SALT:-TAG] == data
    assert BlockKey(SECRET.encode()).open("kv-1", stored) == data
    with pytest.raises(ForgedBlock):  # the tag binds the address...
        BlockKey(SECRET.encode()).open("kv-2", stored)
    for at in (0, SALT, len(stored) - 1):  # ...the salt, the bytes and itself
        bent = bytearray(stored)
        bent[at] ^= 1
        with pytest.raises(ForgedBlock):
            BlockKey(SECRET.encode()).open("kv-1", bytes(bent))

    async def aio() -> bytes | None:
        async with AsyncServerConnector(keyed(server.url, local_reads=local_reads)) as engine:
            assert await engine.put("kv-2", data)
            got = bytearray(len(data))
            assert await engine.get_into("kv-2", got) == len(data) and got == data
            pieces: list[bytes] = []

            async def in_pieces(n: int, read) -> int:
                for at in range(0, n, 7777):
                    piece = bytearray(min(7777, n - at))
                    await read(memoryview(piece))
                    pieces.append(bytes(piece))
                return n

            assert await engine.fetch("kv-2", in_pieces) == len(data)
            assert b"".join(pieces) == data
            return await engine.get("kv-1")

    assert asyncio.run(aio()) == data


def test_a_byte_changed_in_the_slab_fails_a_keyed_engines_tag_on_every_path(server):
    # With a key, the tag is the one check of a block's bytes (it covers every byte the
    # checksum would): a changed byte is a miss over HTTP and by local reads, counted as
    # a failed tag, never loaded.
    data = os.urandom(2 * MiB)
    with ServerConnector(keyed(server.url)) as engine:
        assert engine.put("kv-bent", data) and engine.get("kv-bent") == data
    assert change_one_byte(server, data, len(data) // 2)
    for local_reads in (False, True):
        with ServerConnector(keyed(server.url, local_reads=local_reads)) as engine:
            buf = bytearray(len(data))
            assert engine.get("kv-bent") is None and engine.get_into("kv-bent", buf) is None
            assert engine.forged_blocks == 2 and engine.checksum_failures == 0
            assert (engine._core.local.slab is not None) == local_reads

    async def aio() -> int:
        async with AsyncServerConnector(keyed(server.url, local_reads=False)) as engine:
            assert await engine.get("kv-bent") is None
            assert await engine.get_into("kv-bent", bytearray(len(data))) is None
            return engine.forged_blocks

    assert asyncio.run(aio()) == 2


@pytest.mark.parametrize("local_reads", [False, True])
def test_blocks_forged_by_another_token_holder_load_zero_times(server, local_reads):
    # The forger holds the token, not the key: it stores first, under the addresses an
    # engine will load, bytes of the right length (with a tag of its own making).
    forged = {f"fk-{i}": os.urandom(64 * KiB + OVERHEAD) for i in range(4)}
    with ServerConnector(KvCacheConfig(base_url=server.url)) as forger:
        for address, data in forged.items():
            assert forger.put(address, data)
    with ServerConnector(keyed(server.url, local_reads=local_reads)) as engine:
        buf = bytearray(64 * KiB)
        loaded = [engine.get_into(address, buf) for address in forged]
        assert loaded == [None] * 4 and engine.forged_blocks == 4
    # Control: an engine without a key loads every forged block (what a checksum allows).
    with ServerConnector(KvCacheConfig(base_url=server.url, local_reads=local_reads)) as open_:
        assert [open_.get(address) for address in forged] == list(forged.values())


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_server_set_counts_the_forged_blocks_its_members_refused(server_factory, client):
    """A set's ``forged_blocks`` is every member's (SGLang's and the tier's stats read it):
    it was 0 whatever the members refused."""
    a, b = (server_factory(workers=1, capacity="16MiB") for _ in range(2))
    urls = f"{a.url},{b.url}"
    forged = {f"sf-{i}": os.urandom(4 * KiB + OVERHEAD) for i in range(6)}
    with SetConnector(KvCacheConfig(base_url=urls)) as forger:
        assert all(forger.put(address, data) for address, data in forged.items())
    config = keyed(urls, local_reads=False)
    if client == "sync":
        with SetConnector(config) as engine:
            loaded = [engine.get(address) for address in forged]
            count = engine.forged_blocks
    else:

        async def run() -> tuple[list[bytes | None], int]:
            async with AsyncSetConnector(config) as engine:
                return [await engine.get(address) for address in forged], engine.forged_blocks

        loaded, count = asyncio.run(run())
    assert loaded == [None] * 6 and count == 6


class _LyingHandler(http.server.BaseHTTPRequestHandler):
    """Answers every GET of a block with bytes of its own, their checksum correct."""

    size = 64 * KiB + OVERHEAD

    def do_GET(self) -> None:  # http.server calls it by this name
        body = os.urandom(self.size)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header(CHECKSUM_HEADER, xxhash.xxh3_64_hexdigest(body))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def lying_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LyingHandler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    thread.join(10)


def test_a_lying_server_gets_zero_loads(lying_server):
    addresses = [f"lie-{i}" for i in range(8)]
    with ServerConnector(keyed(lying_server, local_reads=False)) as engine:
        buf = bytearray(64 * KiB)
        assert [engine.get_into(a, buf) for a in addresses] == [None] * 8
        assert engine.forged_blocks == 8 and engine.checksum_failures == 0

    async def aio() -> list:
        async with AsyncServerConnector(keyed(lying_server, local_reads=False)) as engine:
            return [await engine.get(a) for a in addresses]

    assert asyncio.run(aio()) == [None] * 8
    # Control: without a key the lies load (their checksums are right).
    with ServerConnector(KvCacheConfig(base_url=lying_server, local_reads=False)) as open_:
        assert all(open_.get(a) is not None for a in addresses)


def test_the_lmcache_l2_adapter_loads_no_forged_chunk(server, tmp_path):
    path = tmp_path / "block.key"
    path.write_text(SECRET)
    conn = RemoteKVL2Connector(base_url=server.url, timeout_s=10, block_key_file=str(path))
    try:
        keys = lm_keys(4)
        chunks = [bytearray(os.urandom(256 * KiB)) for _ in keys]
        stored = conn.submit_batch_set(keys[:2], [memoryview(c) for c in chunks[:2]])
        assert wait_completions(conn, {stored})[stored][3] == [True, True]
        # Another token holder stores chunks of the right length for the other two keys.
        from eg_kv.address import address_for_key

        with ServerConnector(KvCacheConfig(base_url=server.url)) as forger:
            for key in keys[2:]:
                assert forger.put(address_for_key(key), os.urandom(256 * KiB + OVERHEAD))
        outs = [bytearray(256 * KiB) for _ in keys]
        got = conn.submit_batch_get(keys, [memoryview(o) for o in outs])
        assert wait_completions(conn, {got})[got][3] == [True, True, False, False]
        assert outs[:2] == chunks[:2]
    finally:
        conn.close()


def test_the_vllm_tier_loads_no_forged_row(server):
    row_bytes, rows = 128 * KiB, 4
    primary = bytearray(os.urandom(row_bytes * rows))
    addresses = [f"tier-{i}" for i in range(rows)]
    # A forger stores rows under two of the addresses with the tier's public trailer.
    with ServerConnector(KvCacheConfig(base_url=server.url)) as forger:
        for address in addresses[2:]:
            row = os.urandom(row_bytes)
            parts = [os.urandom(SALT), row, trailer(address, row), os.urandom(TAG)]
            assert forger.put_parts(address, parts)
    with ServerConnector(keyed(server.url)) as client:
        jobs = CopyJobs(client, memoryview(primary), row_bytes, threads=2)
        try:
            jobs.submit(1, False, addresses[:2], [0, 1])
            assert jobs.drain(30)
            assert jobs.finished()[0].ok == [True, True]
            target = bytearray(row_bytes * rows)
            loads = CopyJobs(client, memoryview(target), row_bytes, threads=2)
            loads.submit(2, True, addresses, [0, 1, 2, 3])
            assert loads.drain(30)
            assert loads.finished()[0].ok == [True, True, False, False]
            assert target[: 2 * row_bytes] == primary[: 2 * row_bytes]
            loads.close()
        finally:
            jobs.close()
    assert TRAILER == 16
