"""The fast lookup path: the compact ``POST /kv/batch/exists`` body beside JSON, the
client's fallback to JSON, and LMCache lookups answered on the submitting thread within
a bound.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest
from helpers.common import wait_for
from helpers.kvcache import RawServer, wait_completions

from eg_kv import wire
from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.lmcache import l2 as lmcache_l2
from eg_kv.lmcache.l2 import RemoteKVL2Connector


@pytest.fixture(scope="module")
def srv(module_server_factory):
    """One server for the module: each test asks about its own addresses only."""
    return module_server_factory(workers=1)


def _post(srv, body: bytes, content_type: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("POST", "/kv/batch/exists", body, {"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def test_compact_batch_answers_one_byte_per_address_and_json_still_works(srv):
    with RemoteKVConnector(base_url=srv.url) as kv:
        assert kv.put("a1", b"x") and kv.put("a3", b"y")
    asked = ["a1", "a2", "a3"]
    status, ctype, body = _post(srv, b"a1\na2\na3", wire.ADDRESSES_TYPE)
    assert (status, ctype, body) == (200, wire.FLAGS_TYPE, b"\x01\x00\x01")
    status, ctype, body = _post(srv, json.dumps({"addresses": asked}).encode(), "application/json")
    assert status == 200 and ctype.startswith("application/json")
    assert json.loads(body) == {"exists": [True, False, True], "prefix_hits": 1}
    # Parameters on the type are fine; an empty compact body asks about nothing.
    assert _post(srv, b"a1", wire.ADDRESSES_TYPE + "; charset=ascii")[2] == b"\x01"
    assert _post(srv, b"", wire.ADDRESSES_TYPE)[:3] == (200, wire.FLAGS_TYPE, b"")


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ("é".encode(), 400, b"ASCII"),
        (b"a1\n\na2", 400, b"invalid address"),
        (b"a1\nkv/x", 400, b"invalid address"),
        (b"\n".join(b"a%d" % i for i in range(1025)), 413, b"at most 1024"),
    ],
    ids=["not-ascii", "empty-line", "slash", "too-many"],
)
def test_a_bad_compact_body_gets_a_4xx_with_its_reason(srv, body, status, reason):
    got, _ctype, text = _post(srv, body, wire.ADDRESSES_TYPE)
    assert got == status and reason in text, text
    assert srv.healthz()["workers_up"] == 1  # nothing crashed


def test_the_client_falls_back_to_json_once_for_a_server_that_only_speaks_it():
    with (
        RawServer("early_hints") as srv,
        RemoteKVConnector(base_url=srv.url, local_reads=False) as kv,
    ):  # every request's head is read below
        assert kv.exists_many(["a", "b"]) == [True, True]
        assert kv.exists_many(["c"]) == [True]
    types = [h.lower().split(b"content-type: ", 1)[1].split(b"\r\n")[0] for h in srv.heads]
    # Compact first (refused with a 400), JSON at once, and JSON from then on.
    assert types == [wire.ADDRESSES_TYPE.encode(), b"application/json", b"application/json"]


def test_a_small_lmcache_lookup_is_answered_before_submit_returns(srv):
    conn = RemoteKVL2Connector(base_url=srv.url, num_workers=2)
    try:
        keys = [f"m@0@0@{i:064x}" for i in range(16)]
        with RemoteKVConnector(base_url=srv.url) as kv:
            assert kv.put(conn.addresses.address(keys[3]), b"z")
        # The first lookup maps the server's slab (its probe runs beside); from then on a
        # lookup is answered from it inline: the completion is queued before submit
        # returns (no pool thread, no wait, no request).
        fid = conn.submit_batch_exists(keys)
        assert wait_completions(conn, {fid})[fid][3] == [i == 3 for i in range(16)]
        # (The probe's thread may still be mapping it on a loaded box: waited for.)
        wait_for(lambda: conn._client._core.local.slab is not None, timeout=10,
                 what="the server's slab mapped by the adapter's client")  # fmt: skip
        fid = conn.submit_batch_exists(keys)
        assert conn.drain_completions() == [(fid, True, "", [i == 3 for i in range(16)])]
        big = [f"m@0@0@{i:064x}" for i in range(lmcache_l2.INLINE_MAX_KEYS + 1)]
        fid = conn.submit_batch_exists(big)
        got: list = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = conn.drain_completions()
            time.sleep(0.005)
        assert got == [(fid, True, "", [i == 3 for i in range(len(big))])]
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("lease_ms", [0, 5000])
def test_an_inline_lookup_never_holds_lmcache_for_the_whole_timeout(lease_ms):
    # A server that never answers. Without leases: the inline attempt gives up after
    # INLINE_TIMEOUT_S and the batch goes to the pool; the next submit goes straight to
    # the pool (back-off): three requests. A leasing lookup is never tried inline over
    # HTTP (asked twice, it leased its hits twice): one request per batch, from the pool.
    with RawServer("silent") as srv:
        # local_reads off: the silent server's requests are counted (no slab probe).
        conn = RemoteKVL2Connector(base_url=srv.url, num_workers=2, timeout_s=6,
                                   local_reads=False, lease_ms=lease_ms)  # fmt: skip
        try:
            keys = [f"m@0@0@{i:064x}" for i in range(16)]
            for _ in range(2):
                t0 = time.monotonic()
                conn.submit_batch_exists(keys)
                assert time.monotonic() - t0 < 3.0  # well under timeout_s (6 s)
            want = 2 if lease_ms else 3
            wait_for(lambda: len(srv.requests) >= want, timeout=5, what="the lookups")
            assert len(srv.requests) == want
        finally:
            conn.close()
