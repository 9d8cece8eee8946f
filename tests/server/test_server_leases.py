"""Leases through a real server: batch exists leases its hits (JSON and compact alike), a
load or ``POST /kv/batch/release`` ends them, a full slab of leased blocks refuses a put
with 507 until they end, and THE acceptance run: under eviction pressure from two writer
processes, lookups that answered hit and then missed their load (0 with leases)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.tenants import token_of, write_tokens

from eg_kv.client.aio import AsyncServerConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.client.sync import ServerConnector
from eg_kv.wire import (
    ADDRESSES_TYPE,
    BATCH_RELEASE_PATH,
    LEASE_HEADER,
    LEASE_REFUSED_HEADER,
    RELEASE_HEADER,
)

ROOT = Path(__file__).resolve().parents[2]
KiB = 1024
BLOCK = 64 * KiB
#: A slab of 16 pages of 64 KiB: 16 blocks fill it; leases may hold all of it.
SMALL = ("--page-size", "64KiB", "--lease-ms", "3000", "--lease-share", "1")
pytestmark = pytest.mark.timeout(120)


def request(url: str, method: str = "GET", body: bytes | None = None, headers=None):
    """(status, headers, body) of one request; an error status is an answer too."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def exists(url: str, addresses: list[str], lease: str | None, compact: bool = False):
    headers = {LEASE_HEADER: lease} if lease is not None else {}
    if compact:
        body = "\n".join(addresses).encode()
        headers["Content-Type"] = ADDRESSES_TYPE
    else:
        body = json.dumps({"addresses": addresses}).encode()
        headers["Content-Type"] = "application/json"
    return request(url + "/kv/batch/exists", "POST", body, headers)


def stats(url: str) -> dict:
    return json.loads(request(url + "/kv/stats")[2])


@pytest.fixture
def srv(server_factory):
    """One worker, 1 MiB of 64 KiB pages, leases of at most 3 s."""
    return server_factory(workers=1, capacity="1MiB", extra=SMALL)


def fill(url: str, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}{k}" for k in range(n)]
    for k in keys:
        assert request(f"{url}/kv/{k}", "PUT", bytes(BLOCK))[0] == 201
    return keys


def test_a_leasing_lookup_says_what_it_granted_clamped_to_the_server(srv):
    fill(srv.url, "k", 2)
    status, headers, body = exists(srv.url, ["k0", "k1", "nope"], "60000")
    assert status == 200 and headers[LEASE_HEADER] == "3000"
    assert json.loads(body) == {"exists": [True, True, False], "prefix_hits": 2}
    status, headers, body = exists(srv.url, ["k0", "nope"], "100", compact=True)
    assert status == 200 and headers[LEASE_HEADER] == "100" and body == b"\x01\x00"
    status, headers, _ = exists(srv.url, ["k0"], None)
    assert status == 200 and LEASE_HEADER not in headers  # no header: no lease, as before
    status, headers, _ = exists(srv.url, ["k0"], "9" * 400)  # a huge ask gets the most
    assert status == 200 and headers[LEASE_HEADER] == "3000"
    st = stats(srv.url)
    assert st["leases_taken"] == 4 and st["leased_blocks"] == 2


def test_release_batches_are_bounded_like_lookups(srv):
    body = json.dumps({"addresses": [f"a{i}" for i in range(1025)]}).encode()
    status, _, out = request(srv.url + BATCH_RELEASE_PATH, "POST", body)
    assert status == 413 and b"1024" in out
    status, _, out = request(srv.url + BATCH_RELEASE_PATH, "POST", b"x" * (513 * 1024))
    assert status == 413 and out.count(b"\n") == 1
    status, _, out = request(srv.url + BATCH_RELEASE_PATH, "POST", b'{"addresses": ["bad/one"]}')
    assert status == 400


@pytest.mark.parametrize("bad", ["-1", "1.5", "soon", "", "\u00b2"])
def test_a_bad_lease_header_gets_a_400_with_its_reason(srv, bad):
    status, _, body = exists(srv.url, ["k0"], bad)
    assert status == 400 and LEASE_HEADER.encode() in body and body.count(b"\n") == 1
    assert stats(srv.url)["leases_taken"] == 0


def test_release_route_answers_in_the_requests_format_and_never_below_zero(srv):
    fill(srv.url, "k", 2)
    exists(srv.url, ["k0", "k0", "k1"], "3000")
    body = json.dumps({"addresses": ["k0", "k1", "k1", "nope"]}).encode()
    status, _, out = request(srv.url + BATCH_RELEASE_PATH, "POST", body)
    assert status == 200 and json.loads(out) == {"released": [True, True, False, False]}
    compact = {"Content-Type": ADDRESSES_TYPE}
    status, _, out = request(srv.url + BATCH_RELEASE_PATH, "POST", b"k0\nk0", compact)
    assert status == 200 and out == b"\x01\x00"
    st = stats(srv.url)
    assert (st["leases_taken"], st["leases_released"], st["leased_blocks"]) == (3, 3, 0)
    assert request(srv.url + BATCH_RELEASE_PATH)[0] == 405
    status, _, out = request(srv.url + BATCH_RELEASE_PATH, "POST", b"not json")
    assert status == 400 and b"JSON" in out


def test_a_get_with_the_release_header_ends_one_lease_hit_or_miss(srv):
    fill(srv.url, "k", 1)
    exists(srv.url, ["k0", "k0"], "3000")
    status, _, body = request(srv.url + "/kv/k0", headers={RELEASE_HEADER: "1"})
    assert status == 200 and len(body) == BLOCK
    assert stats(srv.url)["leases_released"] == 1
    assert request(srv.url + "/kv/nope", headers={RELEASE_HEADER: "1"})[0] == 404
    assert request(srv.url + "/kv/k0", headers={RELEASE_HEADER: "1"})[0] == 200
    st = stats(srv.url)
    assert st["leases_released"] == 2 and st["leased_blocks"] == 0


def test_a_slab_of_leased_blocks_refuses_a_put_until_released(srv):
    keys = fill(srv.url, "k", 16)
    with ServerConnector(KvCacheConfig(base_url=srv.url)) as kv:
        assert kv.exists_many(keys, lease_ms=3000) == [True] * 16
        status, _, body = request(f"{srv.url}/kv/more", "PUT", bytes(BLOCK))
        assert status == 507 and b"leases end within" in body
        assert kv.release(keys[:1]) == 1
        assert kv.put("more", bytes(BLOCK))
        assert not kv.exists(keys[0]) and all(kv.exists_many(keys[1:]))
        metrics = request(srv.url + "/metrics")[2].decode()
    for name in ("eg_kv_leases_taken_total 16.0", "eg_kv_leases_released_total 1.0"):
        assert name in metrics
    assert "eg_kv_leased_blocks 15.0" in metrics


def test_the_clients_lease_and_release_sync_and_async(srv):
    fill(srv.url, "k", 4)
    config = KvCacheConfig(base_url=srv.url)
    with ServerConnector(config) as kv:
        assert kv.contains_prefix(["k0", "k1", "nope", "k3"], lease_ms=1000) == 2
        st = stats(srv.url)  # k3, past the prefix, was released at once
        assert (st["leases_taken"], st["leases_released"], st["leased_blocks"]) == (3, 1, 2)
        buf = bytearray(BLOCK)
        assert kv.get_into("k0", buf, release_lease=True) == BLOCK
        assert kv.get("k1", release_lease=True) == bytes(BLOCK)
        assert stats(srv.url)["leased_blocks"] == 0

    async def run() -> None:
        async with AsyncServerConnector(config) as akv:
            assert await akv.exists_many(["k2", "nope"], lease_ms=1000) == [True, False]
            assert await akv.get("k2", release_lease=True) == bytes(BLOCK)
            assert await akv.try_exists_many(["k3"], lease_ms=1000) == [True]
            assert await akv.release(["k3", "k3"]) == 1

    asyncio.run(run())
    st = stats(srv.url)
    assert (st["leased_blocks"], st["leases_taken"], st["leases_released"]) == (0, 5, 5)


def test_tenants_lease_only_their_own_blocks_and_never_past_their_quota(server_factory, tmp_path):
    """A tenant's lookups lease its namespace's blocks alone (the same address elsewhere
    is another block), and a tenant at its quota evicts its own leased blocks."""
    tenants = [{"name": "capped", "quota": "512KiB"}, {"name": "other"}]
    path = write_tokens(tmp_path / "tokens.toml", tenants)
    srv = server_factory(workers=1, capacity="4MiB", extra=(*SMALL, "--tokens", str(path)))
    capped, other = (
        ServerConnector(KvCacheConfig(base_url=srv.url, token=token_of(t["name"]))) for t in tenants
    )
    with capped, other:
        keys = [f"t{k}" for k in range(8)]  # 8 pages: capped's whole quota
        for k in keys:
            assert capped.put(k, bytes(BLOCK)) and other.put(k, bytes(BLOCK))
        assert capped.exists_many(keys, lease_ms=3000) == [True] * 8
        assert other.release(keys) == 0  # other's blocks hold no lease; capped's are not its
        assert other.exists_many(keys, lease_ms=3000) == [True] * 8
        more = [f"more{k}" for k in range(4)]
        for k in more:  # past its quota: its leased blocks go (unleased ones first)
            assert capped.put(k, bytes(BLOCK))
        assert sum(capped.exists_many(keys)) < 8  # a leased block went for the first
        assert sum(capped.exists_many(keys + more)) == 8  # never past the quota
        assert all(other.exists_many(keys))
        assert other.release(keys) == 8


def test_lease_ms_0_turns_leases_off(server_factory):
    srv = server_factory(workers=1, capacity="1MiB", extra=("--lease-ms", "0"))
    fill(srv.url, "k", 1)
    status, headers, _ = exists(srv.url, ["k0"], "3000")
    assert status == 200 and headers[LEASE_HEADER] == "0"
    assert stats(srv.url)["leases_taken"] == 0


@pytest.mark.slow
def test_hits_that_miss_their_load_none_with_leases_some_without(server_factory):
    """THE acceptance run (scripts/bench_leases.py): a 2 MiB slab, two writer processes
    putting a slab's worth each between every lookup and its loads, rounds alternating
    with and without leases on the same server."""
    srv = server_factory(workers=2, capacity="2MiB", extra=("--page-size", "64KiB"))
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_leases.py"), "--url", srv.url,
         "--rounds", "6", "--latency-calls", "0", "--json"],
        capture_output=True, text=True, timeout=100, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    leased, bare = got["leases"], got["no_leases"]
    assert leased["rounds"] == bare["rounds"] == 6
    assert leased["hits"] >= 6 and bare["hits"] >= 6
    assert leased["missed"] == 0
    assert bare["missed"] > 0
    assert leased["taken"] == leased["released"] == leased["hits"]


def test_one_tenant_leasing_every_block_leaves_another_namespace_room(server_factory, tmp_path):
    """On d29c8d3 a readonly tenant that leased every block of its namespace (1,024 of
    1,024) got every PUT of another namespace a 507. Leases now stop at --lease-share
    (default half) of the slab: the lookups past it answer their hits unleased and say
    so, and the other namespace's PUTs go on by evicting the unleased half."""
    tenants = [
        {"name": "writer-x", "namespace": "x"},
        {"name": "reader-x", "role": "readonly", "namespace": "x"},
        {"name": "writer-y", "namespace": "y"},
        {"name": "ops", "role": "admin"},
    ]
    path = write_tokens(tmp_path / "tokens.toml", tenants)
    srv = server_factory(
        workers=2,
        capacity="4MiB",
        extra=("--page-size", "64KiB", "--lease-ms", "30000", "--tokens", str(path)),
    )
    auth = {t["name"]: {"Authorization": f"Bearer {token_of(t['name'])}"} for t in tenants}
    keys = [f"x{k}" for k in range(64)]  # the whole slab
    for k in keys:
        assert request(f"{srv.url}/kv/{k}", "PUT", bytes(BLOCK), auth["writer-x"])[0] == 201
    granted = []
    for lo in range(0, 64, 8):  # the reader leases every block it finds, 8 at a time
        body = json.dumps({"addresses": keys[lo : lo + 8]}).encode()
        headers = {**auth["reader-x"], LEASE_HEADER: "30000", "Content-Type": "application/json"}
        status, got, answer = request(srv.url + "/kv/batch/exists", "POST", body, headers)
        assert status == 200 and json.loads(answer)["exists"] == [True] * 8
        granted.append(got[LEASE_HEADER])
        assert (got[LEASE_HEADER] == "0") == (LEASE_REFUSED_HEADER in got)
    assert granted == ["30000"] * 4 + ["0"] * 4  # half the slab's 64 pages, then none
    for k in range(32):
        status, _, body = request(f"{srv.url}/kv/y{k}", "PUT", bytes(BLOCK), auth["writer-y"])
        assert status == 201, body
    leased = keys[:32]
    for k in leased:  # the leased half stayed
        assert request(f"{srv.url}/kv/{k}", headers=auth["reader-x"])[0] == 200
    st = json.loads(request(srv.url + "/kv/stats", headers=auth["ops"])[2])
    assert st["leased_pages"] == 32 and st["leases_refused"] == 32


def test_a_client_never_releases_hits_it_was_answered_unleased(server_factory):
    """Past the cap a lookup's hits are answered unleased: a client that then released
    them (its loads, or release()) would end another client's leases on the same blocks
    (a release ends *a* lease on the block). The clients remember such hits and send no
    release for them, sync and async alike."""
    srv = server_factory(workers=1, capacity="1MiB", extra=("--page-size", "64KiB"))
    keys = fill(srv.url, "k", 16)
    holder = ServerConnector(KvCacheConfig(base_url=srv.url, local_reads=False))
    late = ServerConnector(KvCacheConfig(base_url=srv.url, local_reads=False))
    with holder, late:
        assert holder.exists_many(keys[:8], lease_ms=3000) == [True] * 8  # half: the cap
        assert late.exists_many(keys, lease_ms=3000) == [True] * 16  # answered, unleased
        assert late.get("k0", release_lease=True) == bytes(BLOCK)  # a load that releases
        assert late.release(keys[1:]) == 0  # and the rest
        st = stats(srv.url)
        assert (st["leased_blocks"], st["leases_released"], st["leases_refused"]) == (8, 0, 16)

    async def run() -> None:
        async with AsyncServerConnector(KvCacheConfig(base_url=srv.url, local_reads=False)) as a:
            assert await a.exists_many(keys, lease_ms=3000) == [True] * 16
            assert await a.get("k1", release_lease=True) == bytes(BLOCK)
            assert await a.release([k for k in keys if k != "k1"]) == 0

    asyncio.run(run())
    st = stats(srv.url)
    assert (st["leased_blocks"], st["leases_released"]) == (8, 0)


def test_a_release_ends_only_the_leases_its_own_token_took(server_factory, tmp_path):
    """On main before the lease holders, a readonly token of a namespace ended a readwrite
    token's leases there (POST /kv/batch/release, or a GET with X-Eg-Kv-Release), and the
    leased blocks went to the next PUT. Now a server records which tenant holds each
    lease (eg_kv.slab.holds) in the slab's readers segment, shared by its workers: another
    token's release ends nothing, the holder's own ends them."""
    tenants = [
        {"name": "writer-x", "namespace": "x"},
        {"name": "reader-x", "role": "readonly", "namespace": "x"},
    ]
    path = write_tokens(tmp_path / "tokens.toml", tenants)
    srv = server_factory(
        workers=2,
        capacity="1MiB",  # 16 pages of 64 KiB
        extra=("--page-size", "64KiB", "--lease-ms", "60000", "--lease-share", "1",
               "--tokens", str(path)),
    )  # fmt: skip
    auth = {t["name"]: {"Authorization": f"Bearer {token_of(t['name'])}"} for t in tenants}
    keys = [f"x{k}" for k in range(16)]
    for k in keys:
        assert request(f"{srv.url}/kv/{k}", "PUT", bytes(BLOCK), auth["writer-x"])[0] == 201
    body = json.dumps({"addresses": keys}).encode()
    lease = {**auth["writer-x"], LEASE_HEADER: "60000", "Content-Type": "application/json"}
    status, got, _ = request(srv.url + "/kv/batch/exists", "POST", body, lease)
    assert status == 200 and got[LEASE_HEADER] == "60000"
    # The reader's releases, each on a connection of its own (either worker): none ends.
    theirs = {**auth["reader-x"], "Content-Type": "application/json"}
    for _ in range(4):
        status, _, answer = request(srv.url + BATCH_RELEASE_PATH, "POST", body, theirs)
        assert status == 200 and json.loads(answer)["released"] == [False] * 16
    for k in keys:
        headers = {**auth["reader-x"], RELEASE_HEADER: "1"}
        assert request(f"{srv.url}/kv/{k}", headers=headers)[0] == 200
    # Every block still leased: a new block finds nothing to evict.
    assert request(f"{srv.url}/kv/new", "PUT", bytes(BLOCK), auth["writer-x"])[0] == 507
    mine = {**auth["writer-x"], "Content-Type": "application/json"}
    status, _, answer = request(srv.url + BATCH_RELEASE_PATH, "POST", body, mine)
    assert status == 200 and json.loads(answer)["released"] == [True] * 16
    assert request(f"{srv.url}/kv/new", "PUT", bytes(BLOCK), auth["writer-x"])[0] == 201
