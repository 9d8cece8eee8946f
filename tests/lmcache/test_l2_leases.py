"""The LMCache L2 adapter's lookup-and-lock leases its hits on a real server, and each load
releases one: a slab full of locked chunks keeps them until loaded (a put meanwhile gets
507), then takes new ones; ``lease_ms`` 0 turns it off; a bad one is refused."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from helpers.kvcache import lm_keys, wait_completions

from eg_kv.errors import ConfigError
from eg_kv.kvcache import RemoteKVL2Connector

pytestmark = pytest.mark.timeout(120)
CHUNK = 64 * 1024


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/kv/stats", timeout=10) as r:
        return json.loads(r.read())


def put_status(url: str, address: str) -> int:
    req = urllib.request.Request(f"{url}/kv/{address}", data=bytes(CHUNK), method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("local_reads", [False, True])
def test_lookup_and_lock_leases_and_the_load_releases(server_factory, local_reads):
    # 16 pages of 64 KiB: the 16 chunks fill the slab, all of which leases may hold.
    srv = server_factory(
        workers=1, capacity="1MiB", extra=("--page-size", "64KiB", "--lease-share", "1")
    )
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, local_reads=local_reads)
    try:
        keys = lm_keys(16)
        blocks = [bytearray(os.urandom(CHUNK)) for _ in keys]
        f = conn.submit_batch_set(keys, [memoryview(b) for b in blocks])
        assert wait_completions(conn, {f})[f][1] is True
        f = conn.submit_batch_exists([*keys, *lm_keys(1, start=99)])
        assert wait_completions(conn, {f})[f][3] == [True] * 16 + [False]
        st = stats(srv.url)
        assert (st["leases_taken"], st["leased_blocks"]) == (16, 16)
        # Locked: a put from elsewhere finds only leased chunks to evict.
        assert put_status(srv.url, "elsewhere") == 507
        bufs = [bytearray(CHUNK) for _ in keys]
        f = conn.submit_batch_get(keys[:4], [memoryview(b) for b in bufs[:4]])
        assert wait_completions(conn, {f})[f][3] == [True] * 4
        assert bufs[:4] == blocks[:4]
        st = stats(srv.url)
        assert (st["leases_released"], st["leased_blocks"]) == (4, 12)
        assert put_status(srv.url, "elsewhere") == 201  # a loaded chunk may go now
        # Two lookups lease twice: a load ends one, the next load the other.
        f = conn.submit_batch_exists(keys[4:6])
        assert wait_completions(conn, {f})[f][3] == [True, True]
        for loaded, released, leased in ((keys[4:8], 8, 10), (keys[4:6], 10, 8)):
            f = conn.submit_batch_get(loaded, [memoryview(bytearray(CHUNK)) for _ in loaded])
            assert wait_completions(conn, {f})[f][3] == [True] * len(loaded)
            st = stats(srv.url)
            assert (st["leases_released"], st["leased_blocks"]) == (released, leased)
    finally:
        conn.close()


def test_lease_ms_0_takes_no_lease_and_a_bad_one_is_refused(server_factory):
    srv = server_factory(workers=1, capacity="8MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, lease_ms=0, local_reads=False)
    try:
        keys = lm_keys(2)
        f = conn.submit_batch_set(keys, [memoryview(bytes(100)) for _ in keys])
        wait_completions(conn, {f})
        f = conn.submit_batch_exists(keys)
        assert wait_completions(conn, {f})[f][3] == [True, True]
        assert stats(srv.url)["leases_taken"] == 0
    finally:
        conn.close()
    for bad in (-1, "soon", True):
        with pytest.raises(ConfigError, match="lease_ms"):
            RemoteKVL2Connector(base_url=srv.url, lease_ms=bad)


def test_a_load_releases_only_what_this_connectors_lookup_leased(server_factory):
    """Another client's lease on a chunk survives this connector's load of it (a load
    ends only a lease this connector's lookup took), and a load with no lookup before
    it releases nothing. On the server's host the lookup leases in the reader's own table
    and the load releases there: no request; over HTTP, one batch-release request for the
    whole batch of loads (issue 37: one per chunk cost loads 1.5-3x)."""
    import re

    from helpers.common import wait_for

    from eg_kv.client.settings import KvCacheConfig
    from eg_kv.client.sync import ServerConnector

    srv = server_factory(workers=1, capacity="8MiB")

    def release_requests() -> int:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        pattern = r'eg_kv_requests_total\{method="POST",route="batch_release",status="200"\} (\S+)'
        return int(sum(float(v) for v in re.findall(pattern, text)))

    keys = lm_keys(2)
    bufs = [bytearray(CHUNK) for _ in keys]
    released = expected = 0
    other = ServerConnector(KvCacheConfig(base_url=srv.url, local_reads=False))
    for local in (True, False):
        conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, local_reads=local)
        try:
            f = conn.submit_batch_set(keys, [memoryview(bytes(CHUNK)) for _ in keys])
            assert wait_completions(conn, {f})[f][1] is True
            # Another client leases the first chunk.
            found = other.try_exists_addresses(conn.addresses.addresses(keys[:1]), lease_ms=60000)
            assert found == [True]
            f = conn.submit_batch_get(keys, [memoryview(b) for b in bufs])
            assert wait_completions(conn, {f})[f][3] == [True, True]
            assert stats(srv.url)["leased_blocks"] == 1  # the other client's lease stands
            # This connector's own lookup leases both; its load then releases them, once.
            f = conn.submit_batch_exists(keys)
            assert wait_completions(conn, {f})[f][3] == [True, True]
            assert stats(srv.url)["leased_blocks"] == 2
            f = conn.submit_batch_get(keys, [memoryview(b) for b in bufs])
            assert wait_completions(conn, {f})[f][3] == [True, True]
            released += 2
            st = stats(srv.url)
            assert (st["leases_released"], st["leased_blocks"]) == (released, 1)
        finally:
            conn.close()
        assert other.release(conn.addresses.addresses(keys[:1])) == 1  # a request: the marker
        released += 1
        # Local: released in the reader's table, no request. HTTP: one for the batch.
        # Requests are counted in order: once the marker shows, the batch's would.
        expected += 1 if local else 2
        wait_for(lambda: release_requests() >= expected, what="the marker counted")  # noqa: B023
        assert release_requests() == expected
    other.close()


def _workers(srv) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(srv.pid).children() if p.status() != "zombie"]


def test_a_leasing_lookup_is_sent_once_even_when_the_server_is_slow(server_factory):
    """A lookup over HTTP was tried inline for 50 ms, then sent again on the pool: with
    the server a little slow, both reached it and every hit was leased twice (one lease
    left after the load, pinning the block). A leasing lookup is inline only where the
    slab mapped here answers it; over HTTP it is one request, on the pool."""
    import signal
    import time

    srv = server_factory(workers=1)
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=5, local_reads=False)
    try:
        keys = lm_keys(4)
        f = conn.submit_batch_set(keys, [memoryview(bytes(CHUNK)) for _ in keys])
        assert wait_completions(conn, {f})[f][1] is True
        before = stats(srv.url)["leases_taken"]
        worker = _workers(srv)
        for pid in worker:  # slow: stopped for 0.3 s (the supervisor cuts at 5 s)
            os.kill(pid, signal.SIGSTOP)
        try:
            f = conn.submit_batch_exists(keys)
            time.sleep(0.3)
        finally:
            for pid in worker:
                os.kill(pid, signal.SIGCONT)
        assert wait_completions(conn, {f})[f][3] == [True] * 4
        assert stats(srv.url)["leases_taken"] - before == 4  # once each, not 8
        f = conn.submit_batch_get(keys, [memoryview(bytearray(CHUNK)) for _ in keys])
        assert wait_completions(conn, {f})[f][3] == [True] * 4
        assert stats(srv.url)["leased_blocks"] == 0
    finally:
        conn.close()


@pytest.mark.parametrize("n", [2, 65])  # inline, and on the pool
def test_a_model_with_a_dangling_weights_link_is_stored_and_looked_up(server_factory, n, tmp_path):
    """A model directory with a dangling weights link (a snapshot whose blob went): the
    binding raised, so every store failed; a lookup inline raised into LMCache's thread,
    one on the pool never completed (LMCache's scheduler waits for it). The link is
    skipped now, and any error a lookup meets is a failed lookup."""
    os.symlink(tmp_path / "gone-blob", tmp_path / "model-00001.safetensors")
    srv = server_factory(workers=1)
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=5, local_reads=False)
    try:
        keys = lm_keys(n, model=str(tmp_path))
        f = conn.submit_batch_set(keys, [memoryview(bytes(CHUNK)) for _ in keys])
        assert wait_completions(conn, {f})[f][3] == [True] * n
        f = conn.submit_batch_exists(keys)
        assert wait_completions(conn, {f}, timeout=10)[f][3] == [True] * n
    finally:
        conn.close()


def _stopped(srv):
    """Stop the server's workers (SIGSTOP) for a ``with`` block: a stalled server."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def hold():
        worker = _workers(srv)
        for pid in worker:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in worker:
                os.kill(pid, signal.SIGCONT)

    return hold()


def test_close_completes_every_batch_it_had_queued(server_factory):
    """close() cancelled the batches still queued on the pool: their completions never
    came (4 of 5 against a stalled server), and whoever waits on a future id waits for
    good. They run now, each failing at once (and sending no release of the leases the
    lookup took: they end by themselves)."""
    srv = server_factory(workers=1)
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=1, local_reads=False, num_workers=2)
    keys = lm_keys(2)
    f = conn.submit_batch_set(keys, [memoryview(bytes(CHUNK)) for _ in keys])
    assert wait_completions(conn, {f})[f][1] is True
    f = conn.submit_batch_exists(keys)  # leased: each load batch below releases
    assert wait_completions(conn, {f})[f][3] == [True, True]
    with _stopped(srv):
        fids = {conn.submit_batch_get(keys, [memoryview(bytearray(CHUNK)) for _ in keys])
                for _ in range(3)}  # fmt: skip
        fids.add(conn.submit_batch_exists(lm_keys(100, start=10)))
        fids.add(conn.submit_batch_set(lm_keys(2, start=200),
                                       [memoryview(bytes(CHUNK)) for _ in range(2)]))  # fmt: skip
        conn.close()
    done = [c[0] for c in conn.drain_completions()]
    assert sorted(done) == sorted(fids)  # each once


def test_a_delete_of_a_key_stored_many_times_keeps_to_its_deadline(server_factory):
    """A key stored N times holds N references, deleted one DELETE after another: against
    a stalled server that was N timeouts (80 s at the defaults, past LMCache's own 30 s
    wait). Each DELETE starts only while the batch's deadline has room; the rest are kept
    for a later delete, which releases them."""
    import time

    srv = server_factory(workers=1)
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=1, local_reads=False)
    try:
        (key,) = lm_keys(1)
        for _ in range(4):
            f = conn.submit_batch_set([key], [memoryview(bytes(CHUNK))])
            assert wait_completions(conn, {f})[f][1] is True
        with _stopped(srv):
            t0 = time.monotonic()
            f = conn.submit_batch_delete([key])
            got = wait_completions(conn, {f}, timeout=10)[f]
            took = time.monotonic() - t0
        assert got[3] == [False] and took < 3.0, (got, took)  # not 4 timeouts
        f = conn.submit_batch_delete([key])  # the references kept: released now
        wait_completions(conn, {f})
        assert stats(srv.url)["unique_blocks"] == 0
    finally:
        conn.close()
