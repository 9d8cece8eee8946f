"""EgKvConnector's load validation (eg_kv.vllm.staging.load_rows) against a real eg-kv
server, without a vLLM engine: a block is used only when it fills its staging row
exactly and carries its address's tag; anything else is a failed
block (vLLM recomputes it), never wrong KV."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.kvcache import RawServer

from eg_kv.client.connectors import connect
from eg_kv.client.settings import KvCacheConfig
from eg_kv.vllm.addresses import BlockFormat, block_addresses, token_chain
from eg_kv.vllm.staging import load_rows
from eg_kv.vllm.trailers import address_tag

pytestmark = pytest.mark.timeout(60)

ROW = 96 * 1024  # over 64 KiB: the PUTs take the Expect: 100-continue path


def _addresses(n: int) -> list[str]:
    fmt = BlockFormat(model="test-loads", dtype="bfloat16", block_size=16, layout="l0:(2,16,8)")
    chain = token_chain(list(range(3, 3 + 16 * n)), 16)
    return block_addresses(chain, fmt)


@pytest.fixture
def client(server_factory):
    srv = server_factory(workers=1, capacity="32MiB")
    c = connect(KvCacheConfig.from_env({}, base_url=srv.url, timeout_s=5.0))
    yield c
    c.close()


def _stored(address: str, row: bytes) -> bytes:
    """A block as the connector stores it: the row, then its address's tag."""
    return row + address_tag(address)


def test_only_blocks_of_the_exact_length_load(client):
    addrs = _addresses(6)
    good = os.urandom(ROW)
    assert client.put(addrs[0], _stored(addrs[0], good))
    assert client.put(addrs[1], _stored(addrs[1], good[: ROW // 2]))  # too short
    assert client.put(addrs[2], _stored(addrs[2], good + b"x"))  # one byte too long
    # addrs[3]: absent
    assert client.put(addrs[4], _stored(addrs[4], good[::-1]))
    assert client.put(addrs[5], b"\0")  # one byte
    rows = [bytearray(ROW) for _ in addrs]
    with ThreadPoolExecutor(4) as pool:
        ok, failed = load_rows(client, addrs, rows, map_fn=pool.map)
    assert ok == [0, 4]
    assert failed == [1, 2, 3, 5]
    assert bytes(rows[0]) == good and bytes(rows[4]) == good[::-1]


def test_a_replaced_block_of_the_wrong_length_fails(client):
    """The e2e's fault: a stored block deleted until absent, then PUT again too short."""
    (addr,) = _addresses(1)
    block = _stored(addr, os.urandom(ROW))
    assert client.put(addr, block)
    assert client.put(addr, block)  # deduplicated: two references
    for _ in range(4):
        if not client.delete(addr):
            break
    assert not client.exists(addr)
    assert client.put(addr, _stored(addr, os.urandom(ROW - 512)))
    assert client.exists(addr)
    ok, failed = load_rows(client, [addr], [bytearray(ROW)])
    assert (ok, failed) == ([], [0])


def test_a_block_of_the_right_length_that_is_not_this_addresses_fails(client):
    """Bytes of the right length under the address that its tag does not name: garbage,
    or another address's block (a server or proxy that mixed them up). Each was loaded as
    KV before."""
    a, b, c = _addresses(3)
    other = _stored(b, os.urandom(ROW))
    assert client.put(a, b"\xff" * (ROW + 16))  # garbage
    assert client.put(c, other)  # b's block, under c
    assert client.put(b, other)  # and under its own address: loads
    rows = [bytearray(ROW) for _ in range(3)]
    assert load_rows(client, [a, b, c], rows) == ([1], [0, 2])
    assert bytes(rows[1]) == other[:ROW]


@pytest.mark.slow
def test_a_server_that_never_answers_fails_every_block_in_time():
    with RawServer("silent") as raw:
        c = connect(KvCacheConfig.from_env({}, base_url=raw.url, timeout_s=1.0))
        try:
            addrs = _addresses(3)
            done = threading.Event()
            result: list = []

            def run() -> None:
                with ThreadPoolExecutor(3) as pool:
                    result.append(
                        load_rows(c, addrs, [bytearray(64) for _ in addrs], map_fn=pool.map)
                    )
                done.set()

            threading.Thread(target=run, daemon=True).start()
            assert done.wait(20), "a silent server held the load"
            assert result == [([], [0, 1, 2])]
        finally:
            c.close()


def test_a_raising_client_is_a_failed_block_not_a_crash():
    class Broken:
        def fetch(self, key, sink, timeout_s=None):
            raise OSError("boom")

    assert load_rows(Broken(), _addresses(2), [bytearray(8), bytearray(8)]) == ([], [0, 1])
    with pytest.raises(ValueError):
        load_rows(Broken(), _addresses(2), [bytearray(8)])


def _silent_load(members: int, blocks: int, threads: int, timeout_s: float):
    """A load of ``blocks`` with a 1 s deadline from ``members`` servers that never
    answer: (what load_rows returned, seconds it took)."""
    import time

    servers = [RawServer("silent") for _ in range(members)]
    try:
        url = ",".join(s.url for s in servers)
        c = connect(KvCacheConfig.from_env({}, base_url=url, timeout_s=timeout_s,
                                           local_reads=False))  # fmt: skip
        try:
            addrs = _addresses(blocks)
            t0 = time.monotonic()
            with ThreadPoolExecutor(threads) as pool:
                got = load_rows(c, addrs, [bytearray(64) for _ in addrs], map_fn=pool.map,
                                deadline=time.monotonic() + 1.0)  # fmt: skip
            return got, time.monotonic() - t0
        finally:
            c.close()
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_a_silent_server_costs_a_load_one_timeout_not_one_per_wave():
    """Twelve blocks on two threads against a server that never answers: GETs that would
    start past the load's deadline are failures unsent (six waves took six timeouts)."""
    got, took = _silent_load(1, 12, 2, timeout_s=1.0)
    assert got == ([], list(range(12)))
    assert took < 3.0, f"the load took {took:.1f} s"


@pytest.mark.parametrize("members", [1, 2])
def test_every_get_of_a_load_ends_by_the_loads_deadline(members):
    """A GET started just before the load's deadline ran its own whole timeout past it
    (a load took up to twice ``timeout_s``; over a set, the previous home's ask added
    one more). Every GET now gets what is left of the load's one deadline, and a set's
    second ask starts only while some of it is left: a load of silent servers with a
    5 s timeout and a 1 s deadline takes about 1 s."""
    got, took = _silent_load(members, 4, 4, timeout_s=5.0)
    assert got == ([], list(range(4)))
    assert took < 2.0, f"a load with a 1 s deadline took {took:.1f} s"
