"""Clients that trust nothing: every bad server, for the sync and the async client.

Each bad server is a real loopback socket (``kvcache_helpers.RawServer``). Whatever it
does, a call costs at most a miss, within about ``timeout_s``: never wrong bytes, never
memory beyond the largest block (measured in a subprocess through its peak RSS), never a
request that changes state sent twice, never a redirect followed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.common import ROOT, wait_for
from helpers.kvcache import (
    LAX_FRAMINGS,
    RawServer,
    bad_server,
    lm_keys,
    open_client,
    wait_completions,
)

from eg_kv.errors import RemoteError
from eg_kv.kvcache import RemoteKVL2Connector

KINDS = ("sync", "async")
TIMEOUT = 0.3
# A bad server may cost one timeout per phase (connect, send, answer); twice the timeout
# plus scheduling slack on a loaded 2-core box is the bound "no hang" is held to.
BOUND = 2 * TIMEOUT + 1.0
MAX_BLOCK = 8 * 1024 * 1024
#: Servers that answer every request correctly after an interim 1xx answer.
INTERIM_MODES = ("early_hints", "continue100")
#: Every way the far end can be bad, and the interim modes (which must give hits).
MODES = (
    "refused", "silent", "drip", "garbage", "short", "badjson", "nolength", "huge",
    "endless_chunked", "gzip", "redirect", "reset", *INTERIM_MODES,
)  # fmt: skip
#: Modes that cost a whole timeout per call (seconds per test): marked slow.
SLOW_MODES = ("silent", "drip")
BIG = 100 * 1024  # a PUT body large enough to ask Expect: 100-continue


def _calls(kind: str, kv, hit: bool) -> list[tuple[str, object, object]]:
    """(name, call, what it must return) for every hot-path call."""
    calls = [
        ("get a", lambda: kv.get("a"), b"a" if hit else None),
        ("get b", lambda: kv.get("b"), b"b" if hit else None),
        ("put", lambda: kv.put("a", b"v" * 1000), hit),
        ("put big", lambda: kv.put("a", bytes(BIG)), hit),
        ("exists", lambda: kv.exists("a"), hit),
        ("delete", lambda: kv.delete("a"), hit),
        ("exists_many", lambda: kv.exists_many(["a", "b"]), [hit, hit]),
        ("contains_prefix", lambda: kv.contains_prefix(["a", "b"]), 2 if hit else 0),
    ]
    if kind == "sync":
        buf = bytearray(64)
        calls.append(("get_into", lambda: kv.get_into("a", buf), 1 if hit else None))
    return calls


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODES else m for m in MODES]
)
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_server_costs_a_miss_within_the_timeout(kind, mode, monkeypatch):
    hit = mode in INTERIM_MODES
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_MAX_BLOCK_SIZE", str(MAX_BLOCK))
    with bad_server(mode) as url, open_client(kind, base_url=url, timeout_s=TIMEOUT) as kv:
        for name, call, want in _calls(kind, kv, hit):
            t0 = time.monotonic()
            got = call()
            took = time.monotonic() - t0
            assert got == want, (name, got)
            assert took < BOUND, (name, took)
        # A HEAD answered 200 is a well-formed "present" whatever the body rules say.
        t0 = time.monotonic()
        assert kv.contains("a") in ((True,) if hit else (True, False))
        assert time.monotonic() - t0 < BOUND
        if not hit:
            t0 = time.monotonic()
            with pytest.raises(RemoteError):
                kv.stats()
            assert time.monotonic() - t0 < BOUND


def _sink(kind: str):
    """A sink that takes a block whole (never called against a silent server)."""
    if kind == "sync":
        return lambda length, read_exact: length

    async def sink(length, read_exact):
        return length

    return sink


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_a_first_call_against_a_stalled_server_costs_one_timeout(kind):
    """A call's first step on a new client asks the server where its slab is. Against a
    server that accepts and never answers it took two timeouts (the probe's, then the
    call's own request's), and ``fetch(timeout_s=t)`` took ``timeout_s + t``. Old code,
    timeout_s=1.0: 2.0 s each, and 1.2 s for fetch(timeout_s=0.2)."""
    calls = {
        "get": (lambda kv: kv.get("a"), None, 1.0),
        "contains": (lambda kv: kv.contains("a"), False, 1.0),
        "exists": (lambda kv: kv.exists("a"), False, 1.0),
        "exists_many": (lambda kv: kv.exists_many(["a", "b"]), [False, False], 1.0),
        "fetch 0.2": (lambda kv: kv.fetch("a", _sink(kind), timeout_s=0.2), None, 0.2),
    }
    with RawServer("silent") as srv:
        for name, (call, want, budget) in calls.items():
            with open_client(kind, base_url=srv.url, timeout_s=1.0) as kv:  # probe due
                t0 = time.monotonic()
                got = call(kv)
                took = time.monotonic() - t0
                assert got == want, name
                assert took < budget + 0.4, (name, round(took, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_a_calls_own_short_deadline_never_marks_a_set_member_down(kind):
    """A load given what is left of its batch (vLLM's load_rows, SGLang's HiCache) timed
    out at a healthy member whose answers take 0.2 s, and the set marked it down: its
    addresses then went elsewhere, a miss for every caller until a probe passed. Old
    code: the home marked down. A member that outlasts the config's timeout still is."""
    with RawServer("late404") as a, RawServer("late404") as b:
        members = f"{a.url},{b.url}"
        with open_client(kind, base_url=members, timeout_s=2.0, local_reads=False) as kv:
            home = kv.router.home("blk-1")[1]
            t0 = time.monotonic()
            assert kv.fetch("blk-1", _sink(kind), timeout_s=0.05) is None
            assert time.monotonic() - t0 < 1.0
            assert kv.router.down() == frozenset()
            assert kv.router.home("blk-1")[1] == home
            assert kv.get("blk-1") is None  # the 404, from the same home
            assert kv.router.down() == frozenset()
        with open_client(kind, base_url=members, timeout_s=0.1, local_reads=False) as kv:
            home = kv.router.home("blk-1")[1]
            assert kv.get("blk-1") is None  # the member outlasted the config's timeout
            assert kv.router.down() == frozenset({home})


@pytest.mark.parametrize("kind", KINDS)
def test_interim_answers_never_shift_answers_onto_the_next_request(kind):
    # Today's bug: a 103 taken as final left the 200 to be read as the next answer, so
    # get("b") returned a's bytes. Every answer here names its key.
    with RawServer("early_hints") as srv, open_client(kind, base_url=srv.url, timeout_s=5) as kv:
        for key in ("k1", "k2", "k3", "k1"):
            assert kv.get(key) == key.encode()
        assert kv.put("k4", bytes(BIG)) is True
        assert kv.get("k5") == b"k5"
    assert srv.accepted == 1  # the connection stayed in step, so it was kept


@pytest.mark.parametrize("kind", KINDS)
def test_an_answer_out_of_step_is_a_miss_never_another_blocks_bytes(kind, caplog):
    """A server or proxy that sends a connection's previous answer again before each
    answer: HTTP/1.1 ties answers to requests only by order, so get("k2") returned k1's
    bytes, checksum and all, and each answer after was one behind. The address each block
    answer echoes tells them apart: a miss, warned once, and the connection dropped."""
    with RawServer("stale") as srv, open_client(kind, base_url=srv.url, timeout_s=5,
                                                local_reads=False) as kv:  # fmt: skip
        assert kv.get("k1") == b"k1"
        assert kv.get("k2") is None  # k1's answer again: not k1's bytes
        assert kv.get("k3") == b"k3"  # the first answer on a new connection
        assert kv.get("k4") is None
        assert srv.accepted == 2  # each dropped after its mismatch
    warned = [r for r in caplog.records if "nobody asked for" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_lookup_answer_out_of_step_is_a_miss_never_resident(kind):
    """The same replay before a HEAD or an ``/exists``: the old clients read only the
    status or the boolean, so another block's answer made an absent block resident. Both
    name the address asked (the echo, ``"hash"``): a miss, and the connection dropped."""
    for lookup in ("contains", "exists"):
        with RawServer("stale") as srv, open_client(kind, base_url=srv.url, timeout_s=5,
                                                    local_reads=False) as kv:  # fmt: skip
            ask = getattr(kv, lookup)
            assert ask("present") is True
            assert ask("absent") is False  # present's answer again: not "resident"
            assert ask("absent") is False  # the first answer on a new connection
            assert srv.accepted == 2, lookup  # dropped after its mismatch


@pytest.mark.parametrize("mode", sorted(LAX_FRAMINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_framing_http_does_not_allow_is_a_miss(kind, mode):
    """``Content-Length: +2`` or ``0_2`` (Python's ``int`` took both), two that differ
    (the last won), chunk sizes ``0x2`` and ``-2``: a proxy may frame such an answer
    otherwise, and its answers then go out of step. The right bytes so framed: a miss."""
    with RawServer(mode) as srv, open_client(kind, base_url=srv.url, timeout_s=5,
                                             local_reads=False) as kv:  # fmt: skip
        assert kv.get("k1") is None


@pytest.mark.parametrize("kind", KINDS)
def test_writes_and_lease_changes_are_never_sent_twice(kind):
    # The server applies each PUT and DELETE, then drops the connection unanswered. A
    # client that resends would release two references for one delete().
    with RawServer("dropwrite") as srv, open_client(kind, base_url=srv.url, timeout_s=5) as kv:
        for _ in range(2):
            assert kv.get("warm") is None  # a kept-alive connection for the next call
            assert kv.delete("k") is False
        assert srv.applied == 2
        assert kv.get("warm") is None
        assert kv.put("k", b"small") is False
        assert kv.get("warm") is None
        assert kv.put("k", bytes(BIG)) is False
        assert srv.applied == 4
        assert sum(line.startswith(b"DELETE") for line in srv.requests) == 2
        # Reads that change state: a lookup that leases its hits, a GET that ends a lease
        # (sent twice: two leases taken, or two of the caller's leases ended).
        assert kv.get("warm") is None
        assert kv.exists_many(["a1", "a2"], lease_ms=5000) == [False, False]
        assert kv.get("warm") is None
        assert kv.get("a1", release_lease=True) is None
        assert srv.applied == 6


def test_a_connection_the_server_closed_while_idle_is_not_used():
    # A PUT is never resent, so it must not go out on a connection the server closed
    # while it sat in the pool: the zero-timeout poll finds it closed first.
    with (
        RawServer("oneshot") as srv,
        open_client("sync", base_url=srv.url, timeout_s=5, local_reads=False) as kv,
    ):  # connections counted: no probe for the slab
        assert kv.get("a") == b"hello"
        # The server closed that connection right after its answer: wait for its FIN.
        wait_for(lambda: kv._http.pool._idle[0].dropped(), timeout=5, what="the FIN")
        assert kv.put("a", b"value") is True
        assert srv.accepted == 2 and len(srv.requests) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_redirect_is_never_followed(kind):
    token = "never-leaves-the-first-server"
    with RawServer("oneshot") as elsewhere, RawServer("redirect", elsewhere.url) as srv:
        # local_reads off: the requests are counted (the slab probe is redirected too:
        # tests/test_local_reads.py shows it never leaves the first server either).
        with open_client(kind, base_url=srv.url, timeout_s=2, token=token, local_reads=False) as kv:
            assert kv.get("a") is None
            assert kv.put("a", b"v") is False
            assert kv.put("a", bytes(BIG)) is False
            assert kv.exists("a") is False
            assert kv.delete("a") is False
            assert kv.contains("a") is False
            assert kv.exists_many(["a"]) == [False]
            assert kv.put_status("a", [b"v"]) == 307
        assert len(srv.requests) == 8
        assert all(token.encode() in head for head in srv.heads)
        assert elsewhere.accepted == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_final_answer_to_the_head_gets_no_body(kind):
    # A server that answers a large PUT from its head alone (a dedup hit found from the
    # headers, or a refusal) is not sent the body, and the connection is closed: whether
    # the server still waits for the body is unknown.
    with RawServer("final_first") as srv, open_client(kind, base_url=srv.url, timeout_s=5) as kv:
        t0 = time.monotonic()
        assert kv.put_status("k", [bytes(BIG), bytes(BIG)]) == 200
        assert time.monotonic() - t0 < 4
        assert srv.client_closed.wait(5)
        head = srv.heads[0].lower()
        assert b"expect: 100-continue" in head and b"content-length: %d" % (2 * BIG) in head
        assert srv.after_head == 0
    # A small body goes with its head, without asking.
    with RawServer("early_hints") as srv, open_client(kind, base_url=srv.url, timeout_s=5) as kv:
        assert kv.put_status("k", [b"x" * 1000]) == 201
        assert b"expect" not in srv.heads[0].lower()
        assert srv.bodies[0] == b"x" * 1000


@pytest.mark.parametrize("mode", ["early_hints", "gzip", "nolength", "redirect", "reset"])
def test_the_lmcache_l2_adapter_loads_the_right_bytes_or_misses(mode):
    # One worker, one connection: a client that took the 103 as final loads key 0 as a
    # miss and key 1 with key 0's bytes (same length: the adapter would accept them).
    keys = lm_keys(3)
    with RawServer(mode) as srv:
        conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=TIMEOUT, num_workers=1)
        want = [conn.addresses.address(k).encode() for k in keys]  # what /kv/<addr> holds there
        outs = [bytearray(len(w)) for w in want]
        fid = conn.submit_batch_get(keys, [memoryview(o) for o in outs])
        done = wait_completions(conn, {fid}, timeout=10)[fid]
        conn.close()
    if mode == "early_hints":
        assert done[3] == [True] * 3 and outs == want
    else:
        assert done[3] == [False] * 3 and outs == [bytearray(len(w)) for w in want]


# --------------------------------------------------------------------------- memory

#: Run in a fresh interpreter: each mode's peak RSS growth (VmHWM, reset per mode
#: through /proc/self/clear_refs where the kernel allows it).
_MEASURE = r"""
import json, sys, time
sys.path.insert(0, "tests")
from helpers.kvcache import open_client

kind, urls, timeout = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass

settings = dict(timeout_s=timeout)  # max_block_size from the environment
with open_client(kind, base_url=urls["early_hints"], **settings) as kv:  # warm up
    assert kv.get("warm") == b"warm" and kv.exists("warm") and kv.put("warm", bytes(100000))
out = {}
for mode, url in urls.items():
    with open_client(kind, base_url=url, **settings) as kv:
        reset_hwm()
        base = hwm()
        t0 = time.monotonic()
        got = [kv.get("k"), kv.exists("k"), kv.contains("k")]
        took = time.monotonic() - t0
        out[mode] = {"growth": hwm() - base, "took": took, "got": repr(got[0])[:40]}
print(json.dumps(out))
"""
MEMORY_MODES = (
    "early_hints", "huge", "nolength", "endless_chunked", "gzip", "drip", "short",
    "garbage", "reset", "redirect", "trailers", "extensions",
)  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_a_bad_server_costs_no_more_memory_than_the_largest_block(kind):
    servers = [RawServer(mode) for mode in MEMORY_MODES]
    try:
        urls = {s.mode: s.url for s in servers}
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE, kind, json.dumps(urls), "0.5"],
            capture_output=True,
            text=True,
            timeout=150,
            cwd=ROOT,
            env={
                **os.environ,
                "LMCACHE_TRACK_USAGE": "false",
                "EPISTEMIC_GRAPH_KVCACHE_MAX_BLOCK_SIZE": str(MAX_BLOCK),
            },
        )
    finally:
        for s in servers:
            s.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    print(kind, json.dumps(out, indent=1))
    assert out["early_hints"]["got"] == "b'k'"  # the one good server still gives hits
    for mode, seen in out.items():
        assert seen["growth"] < 2 * MAX_BLOCK, (mode, seen)
        if mode != "early_hints":
            assert seen["got"] == "None", (mode, seen)
        assert seen["took"] < 3 * (2 * 0.5 + 1.0), (mode, seen)


_SNAPSHOT_MEMORY = r"""
import json, sys
sys.path.insert(0, "tests")
from helpers.kvcache import open_client

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

with open_client(sys.argv[1], base_url=sys.argv[2], timeout_s=30, local_reads=False) as kv:
    base = hwm()
    snap = kv.snapshot()
    print(json.dumps({"growth": hwm() - base, "seq": snap.seq, "blocks": len(snap.blocks)}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_long_snapshot_is_read_a_piece_at_a_time(kind):
    """The sync client read the whole snapshot answer (up to 512 MiB, allocated as soon as
    its length was announced) and split it at once: 16 MiB of short lines took 56 MiB.
    Both clients hold a piece and the blocks listed."""
    with RawServer("long_snapshot") as srv:
        proc = subprocess.run([sys.executable, "-c", _SNAPSHOT_MEMORY, kind, srv.url],
                              capture_output=True, text=True, timeout=100, cwd=ROOT,
                              env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert (out["seq"], out["blocks"]) == (5, 0)
    assert out["growth"] < 8 * 1024 * 1024, out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["infinity", "deepjson"])
def test_a_slab_description_no_server_sends_leaves_reads_on_http(kind, mode):
    """The answer to the first-use probe of the server's slab (local reads, on by
    default) with Infinity, or nested 50,000 deep: get() raised OverflowError or
    RecursionError, documented never to raise, once every 30 s."""
    with RawServer(mode) as srv, open_client(kind, base_url=srv.url, timeout_s=5) as kv:
        assert kv.get("abc123") == b"abc123"
        assert kv.exists("abc123") is True
        assert any(line.endswith(b"/kv/local/slab HTTP/1.1") for line in srv.requests)


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_answer_without_its_checksum_is_a_miss_counted(kind, caplog):
    """Every eg-kv server sends the checksum; an answer without it (a proxy that drops
    X- headers, a server that is not eg-kv) was taken as a hit, unchecked and uncounted.
    Each is counted; the cause (the path, not the slab) is warned once per server, not
    logged per block at ERROR (2,000 blocks were 2,000 lines)."""
    with (
        RawServer("nochecksum") as srv,
        open_client(kind, base_url=srv.url, timeout_s=5, local_reads=False) as kv,
    ):
        for key in ("abc123", "abc124", "abc125"):
            assert kv.get(key) is None
        assert kv.checksum_failures == 3
    said = [r for r in caplog.records if "X-Eg-Kv-Checksum" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"]


def test_an_async_call_is_bounded_by_one_timeout_across_its_resend():
    """A server that closes each connection unanswered after 0.9 s: the transport's
    resend got a fresh timeout, so one get() with timeout_s=2 took 3.6 s."""
    with (
        RawServer("closelate") as srv,
        open_client("async", base_url=srv.url, timeout_s=2.0, local_reads=False) as kv,
    ):
        t0 = time.monotonic()
        assert kv.get("abc123") is None
        took = time.monotonic() - t0
    assert took < 2.5, f"one get took {took:.2f} s with timeout_s=2"
