"""A server set's batch lookups against members that fail fast or hang, with real
sockets: loopback members that answer ``POST /kv/batch/exists`` from a set of addresses
they hold, after a delay or with an error status. A member is marked down only for what it
did, never for another member's failure or this client's own queue."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import itertools
import socket
import threading
import time

import pytest
from helpers.common import wait_for

from eg_kv import wire
from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.sets import SetConnector
from eg_kv.client.settings import KvCacheConfig

pytestmark = pytest.mark.timeout(60)


class LookupMember:
    """A member that answers batch lookups from ``held`` after ``delay_s`` (None: not
    until closed) with ``status`` (200: the flags; else an error), and its health and
    stats at once."""

    def __init__(self, delay_s: float | None = 0.0, status: int = 200) -> None:
        self.held: set[str] = set()
        self.lookups = 0
        self.requests = 0  # of every kind
        self.deletes = 0
        self.delete_status = 204  # what a DELETE is answered
        self._closing = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # health and stats
                owner.requests += 1
                self._send(200, b'{"status":"ok","capacity_bytes":33554432}', wire.JSON_TYPE)

            def do_PUT(self) -> None:  # stored (the body read and dropped)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.requests += 1
                self._send(201, b"", "text/plain")

            def do_DELETE(self) -> None:
                owner.requests += 1
                owner.deletes += 1
                self._send(owner.delete_status, b"", "text/plain")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.lookups += 1
                owner.requests += 1
                if owner._closing.wait(delay_s) and delay_s is None:
                    return  # closed while it hung: no answer
                if status != 200:
                    self._send(status, b'{"error":"no"}', wire.JSON_TYPE)
                    return
                found = [a in owner.held for a in wire.decode_addresses(body)]
                self._send(200, wire.encode_flags(found), wire.FLAGS_TYPE)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        port = self._server.server_address[1]
        self.url, self.member_id = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@pytest.fixture
def members(request):
    made: list[LookupMember] = []

    def make(*args, **kw) -> LookupMember:
        made.append(LookupMember(*args, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def _homed(kv, member: LookupMember, n: int = 400) -> list[str]:
    addresses = [f"{i:032x}" for i in range(n)]
    return [a for a in addresses if kv.router.home(a)[1] == member.member_id]


def _config(*ms: LookupMember) -> KvCacheConfig:
    return KvCacheConfig(base_url=",".join(m.url for m in ms), timeout_s=2.0, local_reads=False)


@pytest.mark.parametrize("status", [503, 401])
def test_a_member_that_fails_at_once_does_not_cut_a_slower_one_sync(members, status):
    """Its instant error was taken for an answer: the straggler cut (0.25 s) then dropped
    a member answering in 0.3 s, marked it down, and the batch had no answer at all."""
    failing, slow = members(status=status), members(delay_s=0.3)
    with SetConnector(_config(failing, slow)) as kv:
        on_slow, on_failing = _homed(kv, slow), _homed(kv, failing)
        slow.held = set(on_slow)
        got = kv.try_exists_addresses(on_slow + on_failing[:1])
        assert got is not None and sum(got) == len(on_slow)
        assert slow.member_id not in kv.router.down()


@pytest.mark.parametrize("status", [503, 401])
def test_a_member_that_fails_at_once_does_not_cut_a_slower_one_async(members, status):
    failing, slow = members(status=status), members(delay_s=0.3)

    async def run() -> None:
        kv = AsyncSetConnector(_config(failing, slow))
        try:
            on_slow, on_failing = _homed(kv, slow), _homed(kv, failing)
            slow.held = set(on_slow)
            got = await kv.try_exists_addresses(on_slow + on_failing[:1])
            assert got is not None and sum(got) == len(on_slow)
            assert slow.member_id not in kv.router.down()
        finally:
            await kv.close()

    asyncio.run(run())


def test_jobs_left_in_the_shared_queue_do_not_mark_their_members_down(members):
    """One member hangs; 20 callers at once fill the sync set's fan-out threads with
    lookups waiting on it, and the other members' jobs wait in the queue past the batch's
    cut. Those members were never asked: none is marked down (both were: the whole set
    went down for one hung member)."""
    hung, a, b = members(delay_s=None), members(), members()
    with SetConnector(_config(hung, a, b)) as kv:
        addresses = [f"{i:032x}" for i in range(300)]
        a.held, b.held = set(addresses), set(addresses)
        start = threading.Barrier(20)

        def caller() -> None:
            start.wait()
            kv.try_exists_addresses(addresses)

        threads = [threading.Thread(target=caller) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not {a.member_id, b.member_id} & set(kv.router.down())
        assert hung.member_id in kv.router.down()


def test_requests_to_a_member_cut_as_a_straggler_free_the_shared_threads(members):
    """One member hangs while 20 callers look up at once: the requests sent to it before
    the cut held the sync set's 16 shared threads for their whole timeout_s, and a batch
    over the two healthy members, after the hung one was down, queued behind them (2.44 s
    where it takes 0.04). The cut ends those requests: the batch answers at once."""
    hung, a, b = members(delay_s=None), members(), members()
    with SetConnector(_config(hung, a, b)) as kv:
        addresses = [f"{i:032x}" for i in range(300)]
        a.held, b.held = set(addresses), set(addresses)
        healthy = [x for x in addresses if kv.router.home(x)[1] != hung.member_id][:6]
        start = threading.Barrier(20)

        def caller() -> None:
            start.wait()
            kv.exists_many(addresses)  # unbounded: its first requests get the timeout_s

        threads = [threading.Thread(target=caller) for _ in range(20)]
        for t in threads:
            t.start()
        wait_for(lambda: hung.member_id in kv.router.down(), timeout=10, what="the cut")
        t0 = time.monotonic()
        got = kv.try_exists_addresses(healthy)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert got == [True] * len(healthy) and took < 0.5, (got, took)


def test_a_request_ended_at_the_cut_is_not_sent_again(members):
    """On a kept-alive connection, the ended request looked like one the server had
    closed before answering, and went out again on a new connection: its thread waited
    a whole timeout_s more (and a change would have been sent twice)."""
    hung, a = members(delay_s=None), members()
    with SetConnector(_config(hung, a)) as kv:
        on_hung = _homed(kv, hung)[:3]
        on_a = _homed(kv, a)[:3]
        conn = kv._members.get(kv.router.view(), hung.member_id)
        assert conn.healthz() is not None  # a kept-alive connection to it
        assert kv.exists_many(on_hung + on_a) == [False] * 3 + [False] * 3
        assert hung.member_id in kv.router.down()
        time.sleep(0.5)  # a resend would have reached it by now
        assert hung.lookups == 1


def test_a_delete_answered_503_is_asked_again_where_the_put_went(members):
    """A set's DELETE goes to the member its PUT stored the block at; a 503 there (not
    applied: ask again) spent that note, and the retry went to the home, whose reference
    is another client's."""
    a, b = members(), members()
    with SetConnector(_config(a, b)) as kv:
        key = _homed(kv, a)[0]
        kv.router.health.failed(a.member_id)  # b stands in
        assert kv.put(key, b"x" * 10)
        kv.router.health.succeeded(a.member_id)
        b.delete_status = 503
        assert kv.delete_status(key) == 503
        b.delete_status = 204
        assert kv.delete_status(key) == 204
        assert (a.deletes, b.deletes) == (0, 2)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_sets_healthz_asks_its_members_at_once_and_counts_who_answered(kind):
    """Three members that accept and never answer, one that answers: the set's healthz
    asked them in turn (3.01 s at timeout_s=1) and said all four were up."""
    import contextlib

    with contextlib.ExitStack() as stack:
        silent = []
        for _ in range(3):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            silent.append(f"http://127.0.0.1:{s.getsockname()[1]}")
        alive = LookupMember()
        stack.callback(alive.close)
        config = KvCacheConfig(base_url=",".join([*silent, alive.url]), timeout_s=1.0,
                               local_reads=False)  # fmt: skip
        t0 = time.monotonic()
        if kind == "sync":
            with SetConnector(config) as kv:
                got = kv.healthz()
        else:

            async def ask():
                async with AsyncSetConnector(config) as akv:
                    await akv.exists_many([])  # started
                    return await akv.healthz()

            got = asyncio.run(ask())
        took = time.monotonic() - t0
    assert got == {"status": "ok", "members": 4, "members_up": 1}
    assert took < 2.5, took  # one timeout (and the set's first weighing), not three


def test_the_async_set_lets_a_departed_members_requests_finish(members):
    """A member's address changes (a pod started again elsewhere) while a lookup waits on
    it: the membership thread prunes its connector. The async set closed its session at
    once, which ended the lookup (a miss after 0.3 s, where the sync set's answered); it
    closes it once its requests are over."""
    import dataclasses
    import types

    from eg_kv.client.membership import View

    a, b = members(), members(delay_s=1.0)

    def moved(old: View) -> View:  # b's id at another host: a new connector's key
        ms = dict(old.members)
        ms[b.member_id] = dataclasses.replace(ms[b.member_id], host="127.0.0.2")
        return View(types.MappingProxyType(ms), old.placement, old.placement,
                    time.monotonic(), old.window_s)  # fmt: skip

    async def run() -> list[bool] | None:
        async with AsyncSetConnector(_config(a, b)) as kv:
            on_b = _homed(kv, b)[:3]
            b.held = set(on_b)
            await kv.exists_many([])  # started
            timer = threading.Timer(0.3, lambda: kv._members.prune(moved(kv.router.view())))
            timer.start()
            try:
                return await kv.try_exists_addresses(on_b)
            finally:
                timer.join()

    assert asyncio.run(run()) == [True, True, True]


def test_a_second_round_has_only_what_the_first_left_of_the_deadline(members):
    """Right after a member joined, a miss at the new home asks the previous home: that
    request had the config's whole timeout again, so one lookup could take two."""
    import dataclasses
    import time

    from eg_kv.client.placement import Placement

    previous, other, new = members(delay_s=5.0), members(), members(delay_s=0.8)
    with SetConnector(KvCacheConfig(base_url=",".join(m.url for m in (previous, other, new)),
                                    timeout_s=1.0, local_reads=False)) as kv:  # fmt: skip
        m = kv.router.membership
        m._view = dataclasses.replace(  # the new member just joined
            m.view(), previous=Placement({previous.member_id: 1.0, other.member_id: 1.0}),
            changed_at=time.monotonic())  # fmt: skip
        x = next(a for a in (f"{i:032x}" for i in range(4000))
                 if m.view().placement.home(a) == new.member_id
                 and m.view().previous_home(a) == previous.member_id)  # fmt: skip
        t0 = time.monotonic()
        assert kv.exists_many([x]) == [False]
        took = time.monotonic() - t0
    assert previous.lookups == 1  # asked, within what was left
    assert took < 1.4, f"one lookup took {took:.2f} s of a 1 s timeout"


def test_a_closed_set_asks_its_members_nothing(members):
    """After close() the set-wide calls answer as misses and send nothing: they built
    fresh member connectors (a pooled socket; on the async side a session never closed)
    and asked the members."""
    a, b = members(), members()
    kv = SetConnector(_config(a, b))
    kv.close()
    asked = a.requests + b.requests
    assert kv.healthz() is None and kv.member_stats() == []
    with pytest.raises(Exception, match="no member"):
        kv.stats()
    assert a.requests + b.requests == asked and kv._members._conns == {}

    async def run() -> None:
        akv = AsyncSetConnector(_config(a, b))
        await akv.close()
        before = a.requests + b.requests  # (a set weighs its members as it starts)
        assert await akv.healthz() is None and await akv.member_stats() == []
        assert akv._members._conns == {} and a.requests + b.requests == before

    asyncio.run(run())


def test_an_async_set_is_built_without_blocking_its_loop(members):
    """The membership's first weighing of a member that never answers (1 s) ran in the
    constructor, on the caller's loop: every other task of the loop stood still. Now the
    first request awaits it off the loop, and then answers from the live member."""
    live = members()
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"{live.url},http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = KvCacheConfig(base_url=url, timeout_s=2.0, local_reads=False)

        async def run() -> tuple[float, float, list[bool] | None]:
            ticks: list[float] = []
            stop = asyncio.Event()

            async def ticker() -> None:
                while not stop.is_set():
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.01)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            kv = AsyncSetConnector(cfg)
            built = time.monotonic() - t0
            try:
                got = await kv.try_exists_addresses([f"{i:032x}" for i in range(64)])
            finally:
                stop.set()
                await task
                await kv.close()
            return built, max(b - a for a, b in itertools.pairwise(ticks)), got

        built, longest_gap, got = asyncio.run(run())
    assert built < 0.3, f"the constructor took {built:.2f} s"
    assert longest_gap < 0.6, f"the loop stood still for {longest_gap:.2f} s"
    assert got is not None  # the live member answered its part


def test_a_later_request_is_not_sent_with_a_sliver_of_the_deadline():
    """A member's later request (its next 1,024 addresses, or the second round) went out
    with whatever was left of the batch's deadline, a millisecond if so: it timed out at
    a healthy member, and the timeout marked the member down. Under MIN_LEFT_S left, it
    is not sent; a caller's own short bound on a first request still is."""
    from eg_kv.client.membership import View
    from eg_kv.client.placement import Placement
    from eg_kv.client.rounds import MIN_LEFT_S, Ask

    view = View({}, Placement({"m": 1.0}))
    soon = Ask(view, {"m": [0]}, ["a" * 32], time.monotonic() + MIN_LEFT_S / 2, True)
    assert 0 < soon.timeout(first=True) <= MIN_LEFT_S / 2  # the caller's bound: sent
    with pytest.raises(TimeoutError):
        soon.timeout(first=False)  # a later request: not sent
    with pytest.raises(TimeoutError):
        dataclasses.replace(soon, again=True).timeout(first=True)  # the second round's
    later = dataclasses.replace(soon, deadline=time.monotonic() + 10 * MIN_LEFT_S)
    assert later.timeout(first=False) > MIN_LEFT_S
