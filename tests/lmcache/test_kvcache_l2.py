"""RemoteKVL2Connector on its own: the native_plugin contract, against a real server.

No LMCache here (that is ``test_lmcache_*``): these tests call the connector the way
LMCache's ``NativeConnectorL2Adapter`` does and check each promise of the contract.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

from helpers.kvcache import RawServer, lm_keys, wait_completions

from eg_kv.engine import NO_ENGINE
from eg_kv.kvcache import RemoteKVConnector, RemoteKVL2Connector
from eg_kv.lmcache.key_addresses import KeyAddresses, binding_params, chunk_name


def test_l2_connector_store_lookup_load_delete(server_factory):
    srv = server_factory(workers=2, capacity="128MiB")
    # Over HTTP (its requests are spied on); tests/test_local_reads.py reads locally.
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, num_workers=4, local_reads=False)
    keys = lm_keys(6)
    size = 2 * 1024 * 1024 + 17  # not a page multiple on purpose
    blocks = [bytearray(os.urandom(size)) for _ in keys]

    # The lookup completes before the stores are submitted: both run on the connector's
    # pool, so a store submitted alongside could land before the lookup asks.
    f_miss = conn.submit_batch_exists(keys)
    assert wait_completions(conn, {f_miss})[f_miss][1:] == (True, "", [False] * 6)
    f_set = conn.submit_batch_set(keys, [memoryview(b) for b in blocks])
    got = wait_completions(conn, {f_set})
    assert f_miss != f_set
    assert got[f_set][1] is True and got[f_set][3] == [True] * 6

    # Every key is stored under the stable digest of the whole key and the binding.
    plain = RemoteKVConnector(base_url=srv.url)
    assert conn.addresses.address(keys[3]) == KeyAddresses(binding_params({})).address(keys[3])
    assert plain.get(conn.addresses.address(keys[3])) == bytes(blocks[3])

    # Record every request the connector's transport sends (a spy on our own code; the
    # server is real): a lookup batch must be one batch request, and no per-key probe.
    sent: list[tuple[str, str]] = []
    exchange = conn._client._exchange

    def spy(method, target, *a, **kw):
        sent.append((method, target))
        return exchange(method, target, *a, **kw)

    conn._client._exchange = spy
    probe = [*keys[:4], *lm_keys(2, start=100), keys[5]]
    f_hit = conn.submit_batch_exists(probe)
    got = wait_completions(conn, {f_hit})
    assert got[f_hit][1:] == (True, "", [True] * 4 + [False] * 2 + [True])
    assert sent == [("POST", "/kv/batch/exists")]
    conn._client._exchange = exchange

    # Loads fill the caller's buffers in place; a buffer of the wrong size is a miss.
    outs = [bytearray(size) for _ in keys]
    outs[2] = bytearray(size + 1)
    f_get = conn.submit_batch_get(keys, [memoryview(o) for o in outs])
    got = wait_completions(conn, {f_get})
    assert got[f_get][3] == [True, True, False, True, True, True]
    assert got[f_get][1] is False  # one key missed: the batch reports it
    for i in (0, 1, 3, 4, 5):
        assert outs[i] == blocks[i]

    f_del = conn.submit_batch_delete(keys[:3] + lm_keys(1, start=500))
    got = wait_completions(conn, {f_del})
    assert got[f_del][3] == [True, True, True, False]
    f_after = conn.submit_batch_exists(keys)
    got = wait_completions(conn, {f_after})
    assert got[f_after][3] == [False] * 3 + [True] * 3

    conn.close()
    conn.close()  # idempotent
    plain.close()


def test_l2_future_ids_are_unique_and_submits_never_block():
    # A server that never answers: submits must still return at once, with fresh ids,
    # and every batch must complete (as a failure) within about the timeout.
    with RawServer("silent") as srv:
        conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=0.3, num_workers=4)
        keys = lm_keys(4)
        bufs = [memoryview(bytearray(1024)) for _ in keys]
        t0 = time.monotonic()
        fids = []
        for _ in range(4):
            fids.append(conn.submit_batch_set(keys, bufs))
            fids.append(conn.submit_batch_get(keys, bufs))
            fids.append(conn.submit_batch_exists(keys))
            fids.append(conn.submit_batch_delete(keys))
        submit_time = time.monotonic() - t0
        assert submit_time < 0.5, f"16 submits took {submit_time:.3f}s: they must not block"
        assert len(set(fids)) == len(fids) == 16
        # 4 workers, 0.3 s per stuck request, 52 requests: about 4 s.
        got = wait_completions(conn, set(fids), timeout=60)
        for fid in fids:
            _, ok, error, results = got[fid]
            assert ok is False and error and results == [False] * 4
        conn.close()


def test_l2_closed_connector_fails_batches_without_raising(server_factory):
    srv = server_factory(workers=1, capacity="16MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=5)
    fid = conn.submit_batch_exists([])
    assert wait_completions(conn, {fid})[fid][1:] == (True, "", [])
    conn.close()
    f_set = conn.submit_batch_set(lm_keys(1), [memoryview(b"x")])
    f_ex = conn.submit_batch_exists(lm_keys(1))
    done = {c[0]: c for c in conn.drain_completions()}
    assert done[f_set][1] is False and done[f_ex][1] is False


def test_l2_connector_reads_the_environment(server_factory, monkeypatch):
    srv = server_factory(workers=1, capacity="16MiB")
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_ADDR", f"127.0.0.1:{srv.port}")
    conn = RemoteKVL2Connector()  # LMCache's adapter_params may be empty
    assert conn.config.base_url == srv.url
    fid = conn.submit_batch_set(lm_keys(1), [memoryview(b"from-env")])
    assert wait_completions(conn, {fid})[fid][1] is True
    with RemoteKVConnector(base_url=srv.url) as kv:
        assert kv.get(conn.addresses.address(lm_keys(1)[0])) == b"from-env"
    conn.close()


def test_l2_copies_the_key_and_view_lists_at_submit(server_factory):
    """LMCache may reuse its lists once ``submit_batch_*`` returned: the connector must
    have copied them (the views themselves stay the caller's)."""
    srv = server_factory(workers=1, capacity="32MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, num_workers=1)
    keys, decoys = lm_keys(8), lm_keys(8, start=50)
    size = 256 * 1024
    blocks = [bytearray(os.urandom(size)) for _ in keys]
    other = memoryview(bytearray(b"\x01" * size))
    key_list, view_list = list(keys), [memoryview(b) for b in blocks]
    f_set = conn.submit_batch_set(key_list, view_list)
    key_list[:] = decoys  # reused by LMCache for its next batch, right away
    view_list[:] = [other] * len(view_list)
    assert wait_completions(conn, {f_set})[f_set][3] == [True] * 8
    with RemoteKVConnector(base_url=srv.url) as kv:
        for key, block in zip(keys, blocks, strict=True):
            assert kv.get(conn.addresses.address(key)) == bytes(block)
        assert not any(kv.exists_many(conn.addresses.addresses(decoys)))

    outs = [bytearray(size) for _ in keys]
    spare = [bytearray(size) for _ in keys]
    key_list, view_list = list(keys), [memoryview(o) for o in outs]
    f_get = conn.submit_batch_get(key_list, view_list)
    key_list[:] = decoys
    view_list[:] = [memoryview(s) for s in spare]
    assert wait_completions(conn, {f_get})[f_get][3] == [True] * 8
    assert outs == blocks and not any(any(s) for s in spare)
    conn.close()


def test_l2_stores_name_each_chunk_by_lmcaches_chunk_hash(server_factory):
    # The key's fourth field is LMCache's chunk hash: the server's KV events name the
    # chunk by it (eg_kv.engine), not by eg-kv's address.
    srv = server_factory(workers=1, capacity="16MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10)
    try:
        keys = lm_keys(3, start=40)
        f_set = conn.submit_batch_set(keys, [memoryview(bytearray(b"c" * 1000))] * 3)
        assert wait_completions(conn, {f_set})[f_set][3] == [True] * 3
    finally:
        conn.close()
    with urllib.request.urlopen(srv.url + "/kv/events?since=0", timeout=10) as answer:
        logged = json.loads(answer.read())["events"]
    assert sorted(e.get("engine_hash") for e in logged) == [k.split("@")[3] for k in keys]
    assert chunk_name("model@0@0@not-hex") == NO_ENGINE == chunk_name("no-fields")


def test_a_key_stored_twice_is_gone_after_one_delete(server_factory):
    """Each store of a key takes a reference; the connector remembered the key once, so
    its delete released one and the block stayed (LMCache had deleted the key)."""
    srv = server_factory(workers=1, capacity="16MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, num_workers=2, local_reads=False)
    try:
        keys, block = lm_keys(1), bytearray(os.urandom(4096))
        for _ in range(2):
            f_set = conn.submit_batch_set(keys, [memoryview(block)])
            assert wait_completions(conn, {f_set})[f_set][3] == [True]
        f_del = conn.submit_batch_delete(keys)
        assert wait_completions(conn, {f_del})[f_del][3] == [True]
        f_after = conn.submit_batch_exists(keys)
        assert wait_completions(conn, {f_after})[f_after][3] == [False]
    finally:
        conn.close()
