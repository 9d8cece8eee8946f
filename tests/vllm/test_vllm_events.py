"""The vLLM relay of eg-kv's event log (eg_kv.vllm.events): addresses mapped back to vLLM
block hashes, a block relayed when every shard is held, snapshots and gaps, the bounds,
a real server's log followed through restarts of its worker, and the objects vLLM's
KV-events publisher gets (under vLLM 0.32 and 0.34: tests/helpers/vllm_envs.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.common import wait_for
from helpers.server_procs import workers_of
from helpers.vllm_envs import vllm_py_fixture

from eg_kv.client.events import Block, Event, Snapshot
from eg_kv.client.sync import ServerConnector
from eg_kv.vllm.addresses import BlockFormat, lookup_addresses, token_chain
from eg_kv.vllm.events import EventRelay, LogFollowers

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
vllm_py = vllm_py_fixture()
FMTS = [
    BlockFormat(model="relay", dtype="bfloat16", block_size=4, layout="l:(2,4,8)", tp_size=2),
] * 2  # two shards (tp 2): every block has two addresses


def blocks(n: int, start: int = 0):
    """``n`` vLLM block hashes and their addresses (two per block, in lookup order)."""
    chain = token_chain(list(range(start, start + 4 * n)), 4)
    hashes = [b"vllm-%d" % (start + i) for i in range(n)]
    return hashes, lookup_addresses(chain, FMTS)


def ev(seq: int, kind: str, address: str) -> Event:
    return Event(seq, kind, "put" if kind == "stored" else "evict", address, 10)


def test_a_block_is_stored_once_every_shard_is_held_and_removed_when_one_goes():
    relay = EventRelay(shards=2)
    hashes, addrs = blocks(2)
    relay.remember(hashes, addrs)
    relay.apply("s", ev(1, "stored", addrs[0]))  # block 0, shard 0: not yet loadable
    assert relay.take() == []
    relay.apply("s", ev(2, "stored", addrs[1]))
    relay.apply("s", ev(3, "stored", addrs[2]))
    relay.apply("s", ev(4, "stored", addrs[3]))
    assert relay.take() == [("stored", [hashes[0], hashes[1]])]
    relay.apply("s", ev(5, "removed", addrs[1]))
    relay.apply("s", ev(6, "removed", addrs[0]))  # already not loadable: nothing more
    relay.apply("s", ev(7, "stored", addrs[1]))
    assert relay.take() == [("removed", [hashes[0]])]
    assert relay.held_blocks() == 1
    # An address never computed here cannot be mapped back: counted, not relayed.
    relay.apply("s", ev(8, "stored", "someone-elses"))
    assert relay.take() == [] and relay.counters["unmapped"] == 1


def test_a_mapping_learned_while_held_relays_the_store_and_snapshots_diff():
    relay = EventRelay(shards=2)
    hashes, addrs = blocks(3)
    relay.apply("a", Snapshot("e1", 10, [Block(a, 10) for a in addrs[:4]]))
    assert relay.take() == [] and relay.counters["unmapped"] == 4
    relay.remember(hashes, addrs)  # learned by a lookup: blocks 0 and 1 are held
    assert relay.take() == [("stored", [hashes[0], hashes[1]])]
    # A gap: the new snapshot says block 1 went and block 2 came.
    relay.apply("a", Snapshot("e1", 50, [Block(a, 10) for a in addrs[:2] + addrs[4:]]))
    assert relay.take() == [("removed", [hashes[1]]), ("stored", [hashes[2]])]
    # Two servers: a block held by either is held.
    relay.apply("b", ev(1, "stored", addrs[2]))
    relay.apply("b", ev(2, "stored", addrs[3]))
    assert relay.take() == [("stored", [hashes[1]])]
    relay.apply("a", ev(51, "stored", addrs[2]))
    relay.apply("b", ev(3, "removed", addrs[2]))  # server a still holds it
    assert relay.take() == []


def test_the_relays_tables_are_bounded():
    relay = EventRelay(shards=1, max_mapped=4, max_pending=3)
    hashes = [b"h%d" % i for i in range(6)]
    addrs = [f"a{i}" for i in range(6)]
    relay.remember(hashes, addrs)
    assert relay.counters["forgotten"] == 2  # the oldest mappings go first
    for i in range(6):
        relay.apply("s", ev(i + 1, "stored", addrs[i]))
    assert relay.counters["unmapped"] == 2
    assert relay.take() == [("stored", hashes[3:6])]  # 4 relayed, the oldest dropped
    assert relay.counters["dropped"] == 1 and relay.counters["stored"] == 4


@pytest.mark.slow
def test_followers_relay_a_real_servers_log(server_factory):
    srv = server_factory(
        workers=2, capacity="1MiB", extra=("--events", "64", "--page-size", "4KiB")
    )
    relay = EventRelay(shards=2)
    hashes, addrs = blocks(4)
    relay.remember(hashes, addrs)
    followers = LogFollowers(relay, [srv.url], {"timeout_s": 5.0}, wait=0.5)
    seen: list = []

    def taken(want, ordered):
        seen.extend(relay.take())
        flat = [(k, h) for k, hs in seen for h in hs]
        return flat == want if ordered else sorted(flat) == sorted(want)

    def relayed(want, what, timeout=20.0, ordered=True):
        """Wait until exactly ``want`` was relayed since ``seen`` was cleared (an extra,
        a repeat or a missing change fails); ``ordered=False``: in any order."""
        try:
            wait_for(lambda: taken(want, ordered), timeout=timeout, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}: relayed {seen!r}, want {want!r}") from None

    try:
        with ServerConnector(base_url=srv.url, timeout_s=5) as c:
            for a in addrs[:4]:
                assert c.put(a, b"kv")
            # In any order: the follower's first snapshot may come after the puts (a loaded
            # machine), and the blocks a snapshot lists at once have no order among them.
            relayed([("stored", hashes[0]), ("stored", hashes[1])], "two stored blocks relayed",
                    ordered=False)  # fmt: skip
            assert c.delete(addrs[3])
            seen.clear()
            relayed([("removed", hashes[1])], "the removal")
            # Fall behind the 64 entries of the log: the follower resyncs from a snapshot.
            for i in range(100):
                c.put(f"noise{i}", b"n")
                c.delete(f"noise{i}")
            assert c.put(addrs[3], b"kv")
            seen.clear()
            relayed([("stored", hashes[1])], "a resync")
            # Every worker is SIGKILLed (the follower's long-poll among them): it resumes.
            for pid in workers_of(srv):
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: (srv.healthz() or {}).get("workers_up") == 2, timeout=30,
                     what="the workers to be replaced")  # fmt: skip
            assert c.delete(addrs[0])
            seen.clear()
            relayed([("removed", hashes[0])], "a resume", timeout=30)
    finally:
        followers.close()
    assert all(not t.is_alive() for t in followers._threads)


@pytest.mark.slow
def test_vllm_gets_its_own_event_objects(vllm_py):
    code = (
        "import json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved\n"
        "from eg_kv.vllm.events import vllm_events, MEDIUM\n"
        "evs = vllm_events([('stored', [b'a', b'b']), ('removed', [7])], 16)\n"
        "batch = KVEventBatch(ts=1.0, events=evs)\n"
        "back = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)\n"
        "print(json.dumps([[type(e).__name__, [h if isinstance(h, int) else h.decode() "
        "for h in e.block_hashes], e.medium] for e in back.events]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(vllm_py), "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=80)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        ["BlockStored", ["a", "b"], "SHARED_STORAGE"],
        ["BlockRemoved", [7], "SHARED_STORAGE"],
    ]


def run_driver(vllm_py, tmp_path, code: str) -> dict:
    """Run a driver in the vLLM venv; what it printed after ``RESULT``, as JSON."""
    driver = tmp_path / "driver.py"
    driver.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(vllm_py), str(driver)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=80)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][7:])


#: In a vLLM venv: a real vLLM Request (its own block hasher), the connector's scheduler
#: state without an engine, a save of blocks 1 and 2 remembered, eg-kv events applied.
_CONNECTOR_DRIVER = """
import json
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from eg_kv.client.events import Event
from eg_kv.vllm.addresses import BlockFormat, lookup_addresses, token_chain
from eg_kv.vllm.connector import EgKvConnector
from eg_kv.vllm.events import EventRelay

init_none_hash(sha256)
tokens = list(range(100, 164))
req = Request("r1", tokens, SamplingParams(max_tokens=1), None,
              block_hasher=get_request_block_hasher(16, sha256))
fmt = BlockFormat(model="m", dtype="bfloat16", block_size=16, layout="l")
conn = EgKvConnector.__new__(EgKvConnector)  # the scheduler side's state, no engine
conn._relay, conn._formats, conn._block_size = EventRelay(1), [fmt], 16
chain = token_chain(tokens, 16)
conn._remember(req, 1, chain[1:3])  # a save of blocks 1 and 2
addrs = lookup_addresses(chain, [fmt])
for seq, a in enumerate(addrs, 1):
    conn._relay.apply("s", Event(seq, "stored", "put", a, 10))
conn._relay.apply("s", Event(9, "removed", "evict", addrs[2], 10))
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
out = [[type(e).__name__, [str(h) for h in e.block_hashes], e.medium,
        getattr(e, "block_size", None)] for e in conn.take_events()]
hashes = [str(maybe_convert_block_hash(h)) for h in req.block_hashes]
print("RESULT " + json.dumps({"events": out, "hashes": hashes,
                              "unmapped": conn._relay.counters["unmapped"]}))
"""


@pytest.mark.slow
def test_the_connector_relays_with_vllms_own_block_hashes(tmp_path, vllm_py):
    got = run_driver(vllm_py, tmp_path, _CONNECTOR_DRIVER)
    h = got["hashes"]  # vLLM's hashes of the request's 4 blocks, as its events carry them
    assert got["events"] == [
        ["BlockStored", [h[1], h[2]], "SHARED_STORAGE", 16],  # the blocks this engine saved
        ["BlockRemoved", [h[2]], "SHARED_STORAGE", None],
    ]
    assert got["unmapped"] == 2  # blocks 0 and 3: never computed by this engine


#: In a vLLM venv: a real vLLM Request with a LoRA, the connector's scheduler state
#: without an engine, and the saves its plan names (what each block's PUT carries).
_SAVES_DRIVER = """
import json
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from eg_kv.engine import engine_headers, token_list
from eg_kv.vllm.addresses import BlockFormat
from eg_kv.vllm.connector import EgKvConnector, EgKvConnectorMetadata, _Tracked
from eg_kv.vllm.events import EventRelay

init_none_hash(sha256)
tokens = list(range(100, 164))
req = Request("r1", tokens, SamplingParams(max_tokens=1), None,
              lora_request=LoRARequest("sql-lora", 3, "/nowhere"),
              block_hasher=get_request_block_hasher(16, sha256))
conn = EgKvConnector.__new__(EgKvConnector)  # the scheduler side's state, no engine
conn._relay, conn._block_size, conn._tracked = EventRelay(1), 16, {}
conn._formats = [BlockFormat(model="m", dtype="bfloat16", block_size=16, layout="l")]
tracked = _Tracked(req, ("lora:3",), block_ids=[10, 11, 12, 13])
conn._tracked["r1"] = tracked
meta = EgKvConnectorMetadata()
conn._plan(tracked, 0, 64, meta)  # the step computes all four blocks: they are saved
names = meta.saves[0].names
print("RESULT " + json.dumps({
    "tokens": [token_list(n.token_ids) for n in names],
    "lora": [[n.lora_id, n.lora_name] for n in names],
    "headers": sorted(engine_headers(names[1])),
}))
"""


@pytest.mark.slow
def test_the_connectors_saves_carry_each_blocks_tokens_and_the_lora(tmp_path, vllm_py):
    got = run_driver(vllm_py, tmp_path, _SAVES_DRIVER)
    assert got["tokens"] == [list(range(100 + 16 * i, 116 + 16 * i)) for i in range(4)]
    assert got["lora"] == [[3, "sql-lora"]] * 4
    assert "X-Eg-Kv-Engine-Tokens" in got["headers"]
    assert "X-Eg-Kv-Engine-Lora-Name" in got["headers"]
