"""Followers pace themselves (issue 31, item 8): against a server that answers
``GET /kv/events`` at once, or one that always answers ``gap``, every follower of the log
(``follow``, the vLLM connector's ``LogFollowers``, the tier's ``RemovalRelay``) sends at
most 20 requests a second and takes at most one snapshot per 5 s. Before, the pacing
rested on the server: 18,385 requests in 5 s, or 200 snapshots.

The lying servers are real HTTP servers on loopback that count what they are asked.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eg_kv.client.events import MIN_INTERVAL_S, SNAPSHOT_INTERVAL_S, Pacer, follow
from eg_kv.client.settings import KvCacheConfig
from eg_kv.client.sync import ServerConnector
from eg_kv.vllm.events import EventRelay, LogFollowers
from eg_kv.vllm.tier_events import RemovalRelay

pytestmark = pytest.mark.timeout(60)
#: How long each follower runs against a lying server.
RUN_S = 2.5


@contextlib.contextmanager
def answering_server(answer):
    """A loopback HTTP server whose GETs get ``answer(path)``: ``(body, content type)``,
    or None for a 404. Yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server calls it by this name
            got = answer(self.path.split("?")[0])
            if got is None:
                self.send_error(404)
                return
            body, kind = got
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def lying_server(gap: bool):
    """A server whose ``/kv/events`` answers at once: nothing new, or always ``gap``."""
    asked: Counter[str] = Counter()

    def answer(path: str) -> tuple[bytes, str] | None:
        asked[path] += 1
        if path == "/kv/events/snapshot":  # NDJSON: the epoch, no block, the end
            return b'{"epoch": "00"}\n{"seq": 5}\n', "application/json"
        if path == "/kv/events":
            doc = {"epoch": "00", "events": [], "next": 5, "gap": gap}
            return json.dumps(doc).encode(), "application/json"
        return None

    with answering_server(answer) as url:
        yield url, asked


def assert_paced(asked: Counter[str], seconds: float) -> None:
    events, snaps = asked["/kv/events"], asked["/kv/events/snapshot"]
    assert events + snaps <= seconds / MIN_INTERVAL_S + 2, asked  # 20 a second
    assert snaps <= 1 + seconds / SNAPSHOT_INTERVAL_S, asked  # one per 5 s
    assert events + snaps >= 1, asked  # it did follow


@pytest.mark.slow
@pytest.mark.parametrize("gap", [False, True], ids=["answers-at-once", "always-gap"])
def test_follow_paces_itself(gap):
    with lying_server(gap) as (url, asked):
        client = ServerConnector(KvCacheConfig(base_url=url, local_reads=False))
        t0 = time.monotonic()

        def sleep(seconds: float) -> None:  # follow's wait for its turn ends the run
            if time.monotonic() - t0 > RUN_S:
                raise TimeoutError
            time.sleep(seconds)

        with client, contextlib.suppress(TimeoutError):
            for _item in follow(client, wait=10, sleep=sleep):
                pass
        assert_paced(asked, time.monotonic() - t0)


@pytest.mark.slow
@pytest.mark.parametrize("gap", [False, True], ids=["answers-at-once", "always-gap"])
def test_the_connectors_log_followers_pace_themselves(gap):
    with lying_server(gap) as (url, asked):
        followers = LogFollowers(EventRelay(shards=1), [url], {"local_reads": False}, wait=1.0)
        t0 = time.monotonic()
        try:
            time.sleep(RUN_S)  # the run itself: what is counted is what it sent meanwhile
        finally:
            followers.close()
        assert_paced(asked, time.monotonic() - t0)


@pytest.mark.slow
@pytest.mark.parametrize("gap", [False, True], ids=["answers-at-once", "always-gap"])
def test_the_tiers_removal_relay_paces_itself(gap):
    with lying_server(gap) as (url, asked):
        relay = RemovalRelay(
            lambda: ServerConnector(KvCacheConfig(base_url=url, local_reads=False)), wait_s=1.0
        )
        t0 = time.monotonic()
        try:
            time.sleep(RUN_S)
        finally:
            relay.close(10)
        assert_paced(asked, time.monotonic() - t0)


def test_the_pacer_backs_off_with_jitter_and_spaces_snapshots():
    now = [100.0]
    pacer = Pacer(clock=lambda: now[0], jitter=lambda: 1.0)
    assert pacer.turn(snapshot=True) == 0
    assert pacer.turn() == pytest.approx(MIN_INTERVAL_S)
    now[0] += 1
    assert pacer.turn(snapshot=True) == pytest.approx(SNAPSHOT_INTERVAL_S - 1)
    now[0] += 10
    waits = []
    for _ in range(8):
        pacer.trouble()
        waits.append(pacer.turn())
        now[0] += waits[-1]
    assert waits[0] == pytest.approx(0.1) and waits[-1] == pytest.approx(5.0)
    assert waits == sorted(waits)  # doubling up to the cap
    pacer.answered()
    pacer.trouble()
    assert pacer.turn() == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("lie", ["too-many-blocks", "a-long-line"])
def test_a_snapshot_past_its_bounds_is_refused_not_held(kind, lie, monkeypatch):
    """Short distinct lines made a follower hold ~10 bytes for each byte a server sent
    (5 GiB at the answer's cap); a long line inside a piece (the sync client's whole
    answer is one) was parsed whatever its length. Both are refused now."""
    import asyncio

    from eg_kv.client import events
    from eg_kv.client.aio import AsyncServerConnector
    from eg_kv.errors import RemoteError

    monkeypatch.setattr(events, "SNAPSHOT_BLOCKS_MAX", 1000)
    lines = [b'{"epoch": "00"}']
    if lie == "too-many-blocks":
        lines += [b'{"hash": "b%d", "length": 1}' % i for i in range(1001)]
    else:
        lines += [b'{"hash": "' + b"x" * 5000 + b'", "length": 1}']
    body = b"\n".join([*lines, b'{"seq": 5}', b""])
    served = answering_server(lambda _path: (body, "application/x-ndjson"))
    with served as url, pytest.raises(RemoteError, match="snapshot"):
        if kind == "sync":
            with ServerConnector(KvCacheConfig(base_url=url, local_reads=False)) as kv:
                kv.snapshot()
        else:

            async def take() -> None:
                async with AsyncServerConnector(
                    KvCacheConfig(base_url=url, local_reads=False)
                ) as kv:
                    await kv.snapshot()

            asyncio.run(take())


def test_follow_resyncs_on_an_answer_that_is_not_after_its_since():
    """An events answer that goes back (a stale one a caching proxy kept, a replay) was
    applied: the follower believed a removed block held again, and asked for ``since=1``
    next. It is taken as a gap now: a snapshot."""
    stored = {"seq": 1, "kind": "stored", "reason": "put", "hash": "p1", "length": 5}
    removed = {**stored, "seq": 2, "kind": "removed", "reason": "delete"}

    reads: Counter[str] = Counter()

    def answer(path: str) -> tuple[bytes, str]:
        if path == "/kv/events/snapshot":
            return b'{"epoch": "e"}\n{"seq": 0}\n', "application/json"
        reads[path] += 1  # the first read (since=0) is answered right, the next stale
        events, nxt = ([stored, removed], 2) if reads[path] == 1 else ([stored], 1)
        body = {"events": events, "next": nxt, "gap": False, "epoch": "e"}
        return json.dumps(body).encode(), "application/json"

    with answering_server(answer) as url, ServerConnector(base_url=url, timeout_s=5) as kv:
        got = []
        for item in follow(kv, wait=0, sleep=lambda s: None):
            got.append(("event", item.seq) if hasattr(item, "kind") else ("snapshot", item.seq))
            if len(got) == 4:
                break
    assert got == [("snapshot", 0), ("event", 1), ("event", 2), ("snapshot", 0)]
