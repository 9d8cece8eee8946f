"""The sync and async clients: settings, addresses, and against a real server.

Every kind of broken server, for both clients, is in ``test_bad_servers.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import urllib.request

import aiohttp
import pytest
from helpers.common import wait_for
from helpers.kvcache import RawServer

from eg_kv.address import address_for_key, validate
from eg_kv.client.rules import Miss, block_to_read, may_resend, to_addresses
from eg_kv.client.settings import CONFIG_KEYWORDS
from eg_kv.errors import ConfigError, InvalidAddress, RemoteError, Unauthorized
from eg_kv.kvcache import (
    AsyncRemoteKVConnector,
    KvCacheConfig,
    KvCacheStats,
    RemoteKVConnector,
    to_address,
)

LMCACHE_KEY = "Qwen/Qwen2.5-7B-Instruct@01000100@0@" + "ab" * 32
TOKEN = "s3cret-T0ken-for-tests"
BAD_TIMEOUT = 0.5


# --------------------------------------------------------------------------- config


def test_config_from_env_follows_the_contract_grammar():
    env = {"EPISTEMIC_GRAPH_KVCACHE_ADDR": "1"}
    assert KvCacheConfig.from_env(env).base_url == "http://127.0.0.1:9130"
    env = {"EPISTEMIC_GRAPH_KVCACHE_ADDR": "9200"}
    assert KvCacheConfig.from_env(env).base_url == "http://127.0.0.1:9200"
    env = {"EPISTEMIC_GRAPH_KVCACHE_ADDR": "[::1]:9300"}
    assert KvCacheConfig.from_env(env).base_url == "http://[::1]:9300"
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_URL": "https://kv.example:443/",
        "EPISTEMIC_GRAPH_KVCACHE_ADDR": "9200",  # the URL wins over the bind address
        "EPISTEMIC_GRAPH_KVCACHE_TOKEN": TOKEN,
        "EPISTEMIC_GRAPH_KVCACHE_TIMEOUT_S": "2.5",
        "EPISTEMIC_GRAPH_KVCACHE_TLS_VERIFY": "off",
    }
    cfg = KvCacheConfig.from_env(env)
    assert cfg.base_url == "https://kv.example:443"
    assert (cfg.token, cfg.timeout_s, cfg.verify_tls) == (TOKEN, 2.5, False)
    # Keywords beat the environment; an omitted keyword falls back to it.
    cfg = KvCacheConfig.from_env(env, addr="127.0.0.1:7000", timeout_s=1)
    assert (cfg.base_url, cfg.timeout_s, cfg.token) == ("http://127.0.0.1:7000", 1.0, TOKEN)
    assert KvCacheConfig.from_env({}).base_url == "http://127.0.0.1:9130"
    for bad in (
        {"EPISTEMIC_GRAPH_KVCACHE_TIMEOUT_S": "soon"},
        {"EPISTEMIC_GRAPH_KVCACHE_TLS_VERIFY": "maybe"},
        {"EPISTEMIC_GRAPH_KVCACHE_ADDR": "host:99999"},
        {"EPISTEMIC_GRAPH_KVCACHE_URL": "ftp://x"},
        {"EPISTEMIC_GRAPH_KVCACHE_URL": "http://user:pw@x:1"},
    ):
        with pytest.raises(ConfigError):
            KvCacheConfig.from_env(bad)
    with pytest.raises(ConfigError, match="unknown setting"):
        RemoteKVConnector(base_url="http://127.0.0.1:1", colour="red")


def test_max_block_size_setting():
    assert "max_block_size" in CONFIG_KEYWORDS
    assert KvCacheConfig.from_env({}).max_block_size == 64 * 1024 * 1024  # the server's default
    env = {"EPISTEMIC_GRAPH_KVCACHE_MAX_BLOCK_SIZE": "96MiB"}
    assert KvCacheConfig.from_env(env).max_block_size == 96 * 1024 * 1024
    assert KvCacheConfig.from_env(env, max_block_size="1KiB").max_block_size == 1024
    assert RemoteKVConnector(max_block_size=4096).config.max_block_size == 4096
    for bad in ("lots", "0"):
        with pytest.raises(ConfigError):
            KvCacheConfig.from_env({"EPISTEMIC_GRAPH_KVCACHE_MAX_BLOCK_SIZE": bad})


def test_token_stays_out_of_repr_and_errors():
    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        kv = RemoteKVConnector(base_url=url, token=TOKEN, timeout_s=BAD_TIMEOUT)
        assert TOKEN not in repr(kv) and TOKEN not in repr(kv.config)
        with pytest.raises(RemoteError) as info:
            kv.stats()
        assert TOKEN not in str(info.value)
        kv.close()


def test_keys_map_to_the_same_address_in_every_process():
    assert to_address("abc123") == "abc123"  # a token hash is used verbatim
    addr = to_address(LMCACHE_KEY)
    assert addr == address_for_key(LMCACHE_KEY) and "/" not in addr
    code = "from eg_kv.kvcache import to_address; import sys; print(to_address(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, LMCACHE_KEY],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},  # hash() would differ; ours must not
        check=True,
    )
    assert out.stdout.strip() == addr


def test_base_import_needs_the_standard_library_only():
    code = (
        "import sys, eg_kv.kvcache as k; k.RemoteKVConnector; k.RemoteKVL2Connector; "
        "print(sorted(m for m in ('aiohttp', 'torch', 'lmcache', 'yarl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_answer_rules_both_clients_share():
    assert block_to_read(200, 10, None, 10) is True
    assert block_to_read(200, 10, "", 10) is True
    assert block_to_read(200, 10, " Identity ", 10) is True
    assert block_to_read(404, 10, None, 10) is False  # a plain miss: drain and keep
    for status, length, encoding in ((200, 11, None), (200, None, None), (200, 5, "gzip"),
                                     (301, 5, None), (307, 5, None)):  # fmt: skip
        with pytest.raises(Miss):
            block_to_read(status, length, encoding, 10)
    with pytest.raises(Unauthorized):
        block_to_read(401, 5, None, 10)
    assert [may_resend(m, t) for m, t in (("GET", "/kv/a"), ("HEAD", "/kv/a"),
            ("POST", "/kv/batch/exists"), ("PUT", "/kv/a"), ("DELETE", "/kv/a"),
            ("POST", "/kv/a"))] == [True, True, True, False, False, False]  # fmt: skip


#: Keys at the edges of the address grammar: (key, is it an address as it stands).
EDGE_KEYS = [
    (".", False), ("..", False), ("...", True), (".a", True), ("a.", True), ("..a", True),
    ("a..", True), ("a..b", True), ("a" * 256, True), ("a" * 257, False), ("", False),
    ("a/b", False), ("../a", False), ("stats", False), ("batch", False), ("a b", False),
    ("é", False), ("a%2e", False), ("A-Z_0.9:@+=", True),
]  # fmt: skip


def test_dot_segments_are_not_addresses():
    for key, valid in EDGE_KEYS:
        if valid:
            assert validate(key) == key.encode() and to_address(key) == key
        else:
            with pytest.raises(InvalidAddress):
                validate(key)
            assert to_address(key) == address_for_key(key)  # a digest, never the key
    # A batch maps as its keys one by one do, whether checked as one or key by key.
    keys = [k for k, _ in EDGE_KEYS]
    assert to_addresses(keys) == [to_address(k) for k in keys]
    good = [k for k, valid in EDGE_KEYS if valid]
    assert to_addresses(good) == good and to_addresses(["a\nb"]) == [address_for_key("a\nb")]


def test_edge_keys_mean_the_same_block_to_both_clients_and_the_server(server_factory):
    srv = server_factory(workers=1, capacity="16MiB")
    keys = [k for k, _ in EDGE_KEYS if k]
    with RemoteKVConnector(base_url=srv.url, timeout_s=10) as kv:
        for i, key in enumerate(keys):
            assert kv.put(key, b"block %d" % i) is True, key
            # Stored under the address to_address names, reachable by any HTTP client.
            assert raw_get(f"{srv.url}/kv/{to_address(key)}") == b"block %d" % i, key

    async def read_all() -> list[bytes | None]:
        async with AsyncRemoteKVConnector(base_url=srv.url, timeout_s=10) as akv:
            return [await akv.get(key) for key in keys]

    assert asyncio.run(read_all()) == [b"block %d" % i for i in range(len(keys))]
    # The server refuses dot segments as addresses, on every block route (raw requests:
    # an HTTP library would rewrite the path before sending it).
    for target in (b"/kv/.", b"/kv/..", b"/kv/%2E%2E", b"/kv/%2e"):
        for method in (b"GET", b"PUT", b"HEAD", b"DELETE"):
            assert raw_status(srv.port, method, target) == 400, (method, target)
        assert raw_status(srv.port, b"GET", target + b"/exists") == 400, target
    doc = b'{"addresses": [".."]}'
    assert raw_status(srv.port, b"POST", b"/kv/batch/exists", doc) == 400


def raw_status(port: int, method: bytes, target: bytes, body: bytes = b"x") -> int:
    """The status a raw socket request gets (no library in between to normalise it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"%s %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (method, target, len(body), body)
        )
        return int(s.recv(64).split(b" ", 2)[1])


# --------------------------------------------------------------------------- real server


def raw_get(url: str, token: str | None = None) -> bytes | None:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def test_sync_client_against_real_server(server_factory):
    srv = server_factory(workers=2, capacity="64MiB")
    with RemoteKVConnector(base_url=srv.url, timeout_s=10) as kv:
        # Misses.
        assert kv.get("nothere") is None
        assert kv.get_into("nothere", bytearray(8)) is None
        assert kv.contains("nothere") is False
        assert kv.exists("nothere") is False
        assert kv.delete("nothere") is False

        # Store, then every way of looking at it.
        assert kv.put("blk1", b"hello world") is True
        assert kv.get("blk1") == b"hello world"
        buf = bytearray(32)
        assert kv.get_into("blk1", buf) == 11 and bytes(buf[:11]) == b"hello world"
        assert kv.get_into("blk1", bytearray(4)) is None  # does not fit: a miss
        assert kv.contains("blk1") is True
        assert kv.exists("blk1") is True

        # Dedup: a second put of the same address is a hit, one resident copy.
        before = kv.stats()
        assert kv.put("blk1", b"hello world") is True
        after = kv.stats()
        assert after.dedup_hits == before.dedup_hits + 1
        assert after.unique_blocks == before.unique_blocks
        assert after.total_refs == before.total_refs + 1
        # DELETE releases one reference: the block survives the first, not the second.
        assert kv.delete("blk1") is True and kv.contains("blk1") is True
        assert kv.delete("blk1") is True and kv.contains("blk1") is False
        assert kv.get("blk1") is None

        # An LMCache key (holds "/") is stored under its stable digest.
        assert kv.put(LMCACHE_KEY, b"kv-page") is True
        assert kv.get(LMCACHE_KEY) == b"kv-page"
        assert raw_get(f"{srv.url}/kv/{address_for_key(LMCACHE_KEY)}") == b"kv-page"

        # A 14 MiB chunk, byte-identical through get and get_into.
        big = os.urandom(14 * 1024 * 1024)
        assert kv.put("big", memoryview(big)) is True
        assert kv.get("big") == big
        into = bytearray(len(big))
        assert kv.get_into("big", into) == len(big) and into == big
        assert kv.put_parts("parts", [b"head-", memoryview(big)[:1000]]) is True
        assert kv.get("parts") == b"head-" + big[:1000]

        # Batch existence: per key, and the prefix run.
        assert kv.exists_many(["big", "nothere", LMCACHE_KEY]) == [True, False, True]
        assert kv.contains_prefix(["big", LMCACHE_KEY, "nothere", "parts"]) == 2
        assert kv.contains_prefix([]) == 0
        # More than one batch's worth (the server takes 1024 per request).
        many = ["big"] * 1500
        assert kv.contains_prefix(many) == 1500
        assert kv.exists_many([*many, "nothere"]) == [True] * 1500 + [False]

        stats = kv.stats()
        assert isinstance(stats, KvCacheStats)
        assert stats.unique_blocks == 3  # big, parts, the LMCache key
        assert stats.resident_bytes >= len(big)
        assert stats.get_hits >= 5 and stats.get_misses >= 2
        assert kv.healthz()["workers_up"] == 2


def test_put_status_and_max_block_size_against_a_real_server(server_factory):
    srv = server_factory(workers=1, capacity="16MiB", extra=("--max-block-size", "1MiB"))
    block = os.urandom(512 * 1024)
    too_big = bytes(2 * 1024 * 1024)
    with RemoteKVConnector(base_url=srv.url, timeout_s=10) as kv:
        # Over 64 KiB: Expect: 100-continue, then the body; the real server answers both.
        assert kv.put_status("big", [block[:1000], memoryview(block)[1000:]]) == 201
        assert kv.put_status("big", [block]) == 200  # deduplicated
        assert kv.put_status("toobig", [too_big]) == 413  # refused from the head alone
        assert kv.put("toobig", too_big) is False
        assert kv.get("big") == block
    with RemoteKVConnector(base_url=srv.url, timeout_s=10, max_block_size=len(block)) as kv:
        assert kv.get("big") == block  # exactly the limit is fine
    with RemoteKVConnector(base_url=srv.url, timeout_s=10, max_block_size=len(block) - 1) as kv:
        assert kv.get("big") is None
        assert kv.get_into("big", bytearray(len(block))) is None
        assert kv.contains("big") is True  # only reading the block is refused

    async def main() -> None:
        async with AsyncRemoteKVConnector(base_url=srv.url, max_block_size=len(block)) as akv:
            assert await akv.get("big") == block
            assert await akv.put_status("big2", [block[:10], block[10:]]) == 201
            assert await akv.put_status("big2", [block]) == 200
            assert await akv.put_status("toobig", [too_big]) == 413
            assert await akv.get("big2") == block
        async with AsyncRemoteKVConnector(base_url=srv.url, max_block_size=len(block) - 1) as a:
            assert await a.get("big") is None and await a.contains("big") is True

    asyncio.run(main())


def test_sync_client_keeps_one_connection_alive(server_factory):
    srv = server_factory(workers=2, capacity="16MiB")
    kv = RemoteKVConnector(base_url=srv.url, timeout_s=10)
    assert kv.put("k", b"v")
    sock = kv._http.pool._idle[0].sock
    for _ in range(50):
        assert kv.get("k") == b"v"
        assert kv.contains("k")
        assert kv.get("missing") is None  # a 404 keeps the connection too
    assert len(kv._http.pool._idle) == 1 and kv._http.pool._idle[0].sock is sock
    kv.close()


def test_sync_client_is_thread_safe(server_factory):
    srv = server_factory(workers=2, capacity="64MiB")
    kv = RemoteKVConnector(base_url=srv.url, timeout_s=20, max_connections=4)
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(25):
            data = os.urandom(1000 + t * 100 + i)
            key = f"t{t}-{i}"
            if not kv.put(key, data):
                errors.append(f"put {key}")
            elif kv.get(key) != data:
                errors.append(f"get {key}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert 1 <= len(kv._http.pool._idle) <= 4  # never more connections than allowed
    assert kv.stats().unique_blocks == 200
    kv.close()


def test_bearer_token(server_factory):
    srv = server_factory(workers=1, capacity="16MiB", env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": TOKEN})
    anon = RemoteKVConnector(base_url=srv.url, timeout_s=5)
    assert anon.put("k", b"v") is False
    assert anon.get("k") is None and anon.contains("k") is False and anon.exists("k") is False
    with pytest.raises(Unauthorized):
        anon.stats()
    wrong = RemoteKVConnector(base_url=srv.url, token="not-it", timeout_s=5)
    assert wrong.put("k", b"v") is False
    kv = RemoteKVConnector(base_url=srv.url, token=TOKEN, timeout_s=5)
    assert kv.put("k", b"v") is True and kv.get("k") == b"v" and kv.exists("k")
    assert kv.stats().unique_blocks == 1
    assert anon.get("k") is None  # still refused without the token
    # The token came from the environment too.
    env_kv = RemoteKVConnector(KvCacheConfig.from_env({"EPISTEMIC_GRAPH_KVCACHE_TOKEN": TOKEN},
                                                      base_url=srv.url))  # fmt: skip
    assert env_kv.get("k") == b"v"
    for c in (anon, wrong, kv, env_kv):
        c.close()


def test_tls(server_factory, tmp_path, monkeypatch):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path, ca_path = tmp_path / "s.pem", tmp_path / "s.key", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    ca.cert_pem.write_to_path(str(ca_path))
    srv = server_factory(
        workers=1, capacity="16MiB", wait=False,
        extra=("--tls-cert", str(cert_path), "--tls-key", str(key_path)),
    )  # fmt: skip
    url = f"https://127.0.0.1:{srv.port}"
    # Trusting the test CA through the standard SSL_CERT_FILE (read when a client starts).
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_path))
    kv = RemoteKVConnector(base_url=url, timeout_s=5)
    assert wait_for(lambda: kv.healthz(), timeout=30, what="TLS server healthy")
    data = os.urandom(3 * 1024 * 1024 + 5)
    assert kv.put("secure", data) is True and kv.get("secure") == data
    assert kv.stats().unique_blocks == 1
    kv.close()
    monkeypatch.delenv("SSL_CERT_FILE")
    # Without the CA the certificate is refused: a miss, not an exception...
    strict = RemoteKVConnector(base_url=url, timeout_s=5)
    assert strict.get("secure") is None and strict.contains("secure") is False
    # ...unless the check is turned off (EPISTEMIC_GRAPH_KVCACHE_TLS_VERIFY=0).
    loose = RemoteKVConnector(
        KvCacheConfig.from_env({"EPISTEMIC_GRAPH_KVCACHE_TLS_VERIFY": "0"}, base_url=url)
    )
    assert loose.get("secure") == data
    # Plain HTTP to the TLS port gets no usable answer.
    assert (
        RemoteKVConnector(base_url=f"http://127.0.0.1:{srv.port}", timeout_s=2).get("secure")
        is None
    )

    async def main() -> None:
        async with AsyncRemoteKVConnector(base_url=url, verify_tls=False) as akv:
            assert await akv.get("secure") == data

    asyncio.run(main())
    strict.close()
    loose.close()


def test_stale_kept_alive_connection_is_retried_once():
    with RawServer("oneshot") as srv:
        kv = RemoteKVConnector(base_url=srv.url, timeout_s=5, local_reads=False)  # counted
        assert kv.get("a") == b"hello"
        # The server closed that connection after answering; the client still holds it.
        assert kv.get("a") == b"hello"
        assert kv.get("a") == b"hello"
        assert srv.accepted == 3 and len(srv.requests) == 3
        kv.close()

        async def main() -> None:
            async with AsyncRemoteKVConnector(
                base_url=srv.url, timeout_s=5, local_reads=False
            ) as akv:
                for _ in range(3):
                    assert await akv.get("a") == b"hello"

        asyncio.run(main())
        assert len(srv.requests) == 6


def test_unframed_answers_json_is_read_a_block_is_a_miss():
    # Not what eg-kv sends, but well-formed HTTP a proxy in between might produce. A JSON
    # answer is read whatever its framing (it is bounded); a block without a
    # Content-Length is a miss before anything is allocated for it.
    with RawServer("chunked") as srv:
        kv = RemoteKVConnector(base_url=srv.url, timeout_s=5, local_reads=False)  # counted
        assert kv.exists("k") is True
        assert kv.exists("k") is True
        assert srv.accepted == 1  # a complete chunked answer keeps the connection
        assert kv.get("k") is None
        buf = bytearray(8)
        assert kv.get_into("k", buf) is None and buf == bytearray(8)
        kv.close()
    with RawServer("close10") as srv:
        kv = RemoteKVConnector(base_url=srv.url, timeout_s=5, local_reads=False)
        assert kv.get("k") is None and kv.get("k") is None
        assert srv.accepted == 2  # a connection whose answer was refused is not reused
        kv.close()


# --------------------------------------------------------------------------- async


def test_async_client_against_real_server(server_factory):
    srv = server_factory(workers=2, capacity="64MiB")
    big = os.urandom(14 * 1024 * 1024)

    async def main() -> None:
        async with AsyncRemoteKVConnector(base_url=srv.url, timeout_s=10) as kv:
            assert await kv.get("a") is None
            assert await kv.contains("a") is False
            assert await kv.exists("a") is False
            assert await kv.put("a", b"alpha") is True
            assert await kv.put("a", b"alpha") is True  # dedup
            assert await kv.get("a") == b"alpha"
            assert await kv.contains("a") and await kv.exists("a")
            assert await kv.put(LMCACHE_KEY, memoryview(big)) is True
            assert await kv.get(LMCACHE_KEY) == big
            assert await kv.exists_many(["a", "zz", LMCACHE_KEY]) == [True, False, True]
            assert await kv.contains_prefix(["a", LMCACHE_KEY, "zz"]) == 2
            stats = await kv.stats()
            assert stats.unique_blocks == 2 and stats.dedup_hits >= 1
            assert await kv.delete("a") and await kv.delete("a")
            assert await kv.delete("a") is False
        # Sharing a caller-owned session: the connector never closes it.
        async with aiohttp.ClientSession() as session:
            kv = AsyncRemoteKVConnector(base_url=srv.url, session=session)
            assert await kv.get(LMCACHE_KEY) == big
            await kv.close()
            assert not session.closed
            again = AsyncRemoteKVConnector(base_url=srv.url, session=session)
            assert await again.contains(LMCACHE_KEY)

    asyncio.run(main())
