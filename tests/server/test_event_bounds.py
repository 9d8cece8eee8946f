"""Issue 31, items 1 and 4: a hostile readonly tenant against the event log's routes, with
real servers, real sockets and the real followers.

- A burst of costly reads on connections closed at once (the log full) kills no worker,
  and another tenant's requests during it all succeed, quickly.
- Long polls held and abandoned by one tenant leave another namespace's followers their
  delay, and its removal relay needs no snapshot.
"""

from __future__ import annotations

import logging
import socket
import statistics
import subprocess
import sys
import threading
import time

import psutil
import pytest
from helpers.common import wait_for
from helpers.server_http import request
from helpers.server_procs import workers_of
from helpers.tenants import token_of, write_tokens

from eg_kv.client.events import parse_snapshot
from eg_kv.client.sync import ServerConnector
from eg_kv.server.events import MAX_WAITERS_PER_NAMESPACE
from eg_kv.slab.events import HOPS_MAX
from eg_kv.slab.store import Slab
from eg_kv.vllm.events import EventRelay, LogFollowers
from eg_kv.vllm.tier_events import RemovalRelay

TENANTS = [
    {"name": "mallory", "role": "readonly", "namespace": "mallory-ns"},
    {"name": "victim", "role": "readwrite", "namespace": "victim-ns"},
]
RING = 65536
#: Long polls the hostile tenant holds: past both workers' 64 waiter slots on d29c8d3.
HELD = 160


def _send_and_close(port: int, token: str, target: bytes) -> None:
    """One request on a fresh connection, closed as soon as it is sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"GET %s HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %s\r\n\r\n"
            % (target, token.encode())
        )


class Latencies:
    """A thread that sends ``victim``'s requests one after another until stopped, and keeps
    each status and duration."""

    def __init__(self, srv, token: str, path: str) -> None:
        self.srv, self.token, self.path = srv, token, path
        self.seen: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.seen) < 20000:
            t0 = time.monotonic()
            try:
                status = request(self.srv, "GET", self.path, token=self.token, timeout=10).status
            except OSError:
                status = 0
            self.seen.append((status, time.monotonic() - t0))

    def stop(self) -> list[tuple[int, float]]:
        self._stop.set()
        self._thread.join(30)
        return self.seen


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_burst_of_costly_reads_on_closed_connections_kills_no_worker(server_factory, tmp_path):
    """300 reads of 10,000 events of the reader's namespace from a full log, each on a
    connection closed at once: on d29c8d3 each cost a worker 81-150 ms of its loop
    (``since=<head-60000>``), the burst stalled the other tenant for seconds and got
    workers SIGKILLed by the watchdog."""
    path = write_tokens(tmp_path / "tokens.toml", TENANTS)
    srv = server_factory(
        workers=2,
        capacity="4MiB",
        extra=("--tokens", str(path), "--events", str(RING), "--page-size", "4KiB",
               "--heartbeat-timeout", "2"),
    )  # fmt: skip
    victim = token_of("victim")
    assert request(srv, "PUT", "/kv/mine", b"v" * 100, token=victim).status == 201
    with Slab.attach(srv.slab_name) as slab:  # the log filled with mallory's namespace's
        ns = slab.bind_namespaces({"mallory-ns": 0})["mallory-ns"]
        for i in range(RING // 2):
            slab.put(f"fill-{i}", b"f", ns)
            slab.delete(f"fill-{i}", ns)
        head = slab.events.head
    assert head > RING
    pids = workers_of(srv)
    watcher = Latencies(srv, victim, "/kv/mine")
    # The heaviest read there is: 10,000 events, HOPS_MAX back in the namespace's positions
    # (the namespace's own count: the fill's events and nothing else).
    since = RING - HOPS_MAX
    target = b"/kv/events?since=%d&limit=10000" % since
    mallory = token_of("mallory")
    t_end = time.monotonic() + 60
    for _ in range(300):
        _send_and_close(srv.port, mallory, target)
        assert time.monotonic() < t_end
    # Let the burst be served (or refused), and the watchdog look twice over.
    wait_for(lambda: len(watcher.seen) > 0, timeout=20, what="the victim's first answer")
    deadline = time.monotonic() + 5
    wait_for(lambda: time.monotonic() > deadline, timeout=10, what="5 s under watch")
    seen = watcher.stop()
    assert workers_of(srv) == pids, f"a worker was replaced:\n{srv.log()[-3000:]}"
    assert "SIGKILL" not in srv.log()
    statuses = {status for status, _ in seen}
    assert statuses == {200}, statuses
    worst = max(t for _, t in seen)
    assert worst < 1.0, f"the victim's slowest request took {worst:.2f} s"
    # The reader still gets what it asked for when it stays: no events of its own.
    doc = request(srv, "GET", target.decode(), token=mallory).json()
    assert len(doc["events"]) == 10000 and doc["gap"] is False
    assert doc["events"][0]["seq"] == since + 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_tenants_long_polls_leave_another_namespace_its_followers(
    server_factory, tmp_path, caplog
):
    """160 long polls held plus 20 a second opened and abandoned by a readonly tenant: on
    d29c8d3 they took every waiter slot of both workers (one counter for all tenants, a
    gone client's slot held for its whole wait), so another namespace's followers waited
    seconds and its removal relay resynced from snapshots."""
    caplog.set_level(logging.DEBUG, logger="eg_kv")
    path = write_tokens(tmp_path / "tokens.toml", TENANTS)
    srv = server_factory(workers=2, capacity="4MiB", extra=("--tokens", str(path)))
    victim, mallory = token_of("victim"), token_of("mallory")
    snapshots = [0]

    class Counting(ServerConnector):  # a real client that counts the snapshots it takes
        def snapshot(self, *a, **kw):
            snapshots[0] += 1
            return super().snapshot(*a, **kw)

    relay = EventRelay(shards=1)
    followers = LogFollowers(relay, [srv.url], {"token": victim, "timeout_s": 10}, wait=2.0)
    removals = RemovalRelay(
        lambda: Counting(base_url=srv.url, token=victim, timeout_s=10), wait_s=2.0
    )
    held: list[socket.socket] = []
    try:
        assert removals.following.wait(20)
        before, errors = snapshots[0], removals.errors
        head = request(srv, "GET", "/kv/events", token=mallory).json()["next"]
        target = b"/kv/events?since=%d&wait=30" % head
        for _ in range(HELD):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(
                b"GET %s HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %s\r\n\r\n"
                % (target, mallory.encode())
            )
            held.append(s)
        stop = threading.Event()

        def abandon() -> None:  # 20 a second, each closed as soon as it is sent
            for _ in range(400):
                if stop.wait(0.05):
                    return
                _send_and_close(srv.port, mallory, target)

        churn = threading.Thread(target=abandon, daemon=True)
        churn.start()
        delays = []
        for i in range(20):
            address = f"v{i}"
            relay.remember([address.encode()], [address])
            assert request(srv, "PUT", f"/kv/{address}", b"v", token=victim).status == 201
            t0 = time.monotonic()
            got: list = []

            def arrived(address=address, got=got) -> bool:
                got += [h for kind, hs in relay.take() if kind == "stored" for h in hs]
                return address.encode() in got

            wait_for(arrived, timeout=30, interval=0.002, what=f"{address} relayed")
            delays.append(time.monotonic() - t0)
            assert request(srv, "DELETE", f"/kv/{address}", token=victim).status == 204
            time.sleep(0.2)
        stop.set()
        churn.join(30)
        seen = (statistics.median(delays), snapshots[0] - before, removals.errors - errors)
        why = f"median delay, snapshots, errors: {seen}; {caplog.text}"
        assert seen[0] < 0.1 and seen[1:] == (0, 0), why
    finally:
        for s in held:
            s.close()
        followers.close()
        removals.close(10)
    assert MAX_WAITERS_PER_NAMESPACE * 2 < HELD  # the attack is past the per-namespace bound


@pytest.mark.timeout(120)
def test_the_log_tells_a_tenant_nothing_of_another_tenants_blocks(server_factory, tmp_path):
    """On d29c8d3 a readonly tenant with an empty namespace read the exact number of
    another tenant's new blocks in the ``next`` of every answer (the server-wide seq, in
    gap and epoch answers too). Its answers are now the same bytes whether the other
    tenant stored 1 block or 40."""
    path = write_tokens(tmp_path / "tokens.toml", [*TENANTS, {"name": "ops", "role": "admin"}])
    srv = server_factory(workers=2, capacity="4MiB", extra=("--tokens", str(path)))
    victim, mallory = token_of("victim"), token_of("mallory")
    queries = ("/kv/events", "/kv/events?since=0&wait=0.1", "/kv/events?since=7",
               "/kv/events?since=0&epoch=not-this-log", "/kv/events/snapshot")  # fmt: skip

    def answers() -> list[bytes]:
        out = []
        for q in queries:
            reply = request(srv, "GET", q, token=mallory)
            assert reply.status == 200, (q, reply)
            out.append(reply.body)
        return out

    assert request(srv, "PUT", "/kv/v0", b"v", token=victim).status == 201
    after_one = answers()
    for i in range(1, 40):
        assert request(srv, "PUT", f"/kv/v{i}", b"v", token=victim).status == 201
    assert answers() == after_one
    # The admin still sees every namespace's events, in one order.
    every = request(srv, "GET", "/kv/events?limit=100", token=token_of("ops")).json()
    assert [e["seq"] for e in every["events"]] == list(range(1, 41)) and every["next"] == 40


# ------------------------------------------------ one answer's size, unread answers

LONG_EVENTS = 4000  # of 256-character addresses with engine hashes: ~1.6 MiB of JSON


def _store_long_events(srv, token: str, tag: str) -> None:
    """LONG_EVENTS one-byte blocks with the longest addresses, pipelined in batches."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        for base in range(0, LONG_EVENTS, 500):
            s.sendall(b"".join(
                (f"PUT /kv/{tag}{'a' * (250 - len(tag))}{i:06d} HTTP/1.1\r\nHost: t\r\n"
                 f"Authorization: Bearer {token}\r\nContent-Length: 1\r\n"
                 f"X-Eg-Kv-Engine-Hash: {'ab' * 32}\r\n\r\nz").encode()
                for i in range(base, base + 500)))  # fmt: skip
            got = b""
            while got.count(b"HTTP/1.1 201") < 500:
                got += s.recv(1 << 20)


@pytest.mark.timeout(120)
def test_an_events_answer_stops_at_1_mib_and_next_goes_on(server_factory, tmp_path):
    # limit=10000 answered 10,000 events in one body written whole (4 MiB of 256-character
    # addresses): a 70-byte request pinned it for a client that did not read (before the
    # fix: one answer of 4,000 such events was 1.6 MiB). Both ways of reading: every
    # namespace's (an admin) and one namespace's (a tenant).
    path = write_tokens(tmp_path / "tokens.toml", [*TENANTS, {"name": "ops", "role": "admin"}])
    srv = server_factory(workers=1, capacity="64MiB",
                         extra=("--tokens", str(path), "--page-size", "4KiB"))  # fmt: skip
    _store_long_events(srv, token_of("victim"), "v")
    for who in ("ops", "victim"):
        seen, since, answers = [], 0, 0
        while len(seen) < LONG_EVENTS:
            reply = request(srv, "GET", f"/kv/events?since={since}&limit=10000",
                            token=token_of(who))  # fmt: skip
            assert reply.status == 200 and len(reply.body) <= 1024 * 1024 + 512, len(reply.body)
            got = reply.json()
            assert not got["gap"] and got["events"], got["next"]
            seen += [e["hash"] for e in got["events"]]
            since, answers = got["next"], answers + 1
        assert answers >= 2, who
        assert seen == [f"v{'a' * 249}{i:06d}" for i in range(LONG_EVENTS)], who


@pytest.mark.timeout(60)
def test_an_events_answer_left_unread_is_cut_at_the_send_limit(server_factory, tmp_path):
    # An answer written whole leaves its handler at once: the connection then waited for
    # its next request, the sweeper skipped its send check, and only the keep-alive limit
    # (here 30 s) let the answer go (before the fix: no send timeout within 15 s).
    srv = server_factory(workers=1, capacity="64MiB", extra=(
        "--body-timeout", "2", "--keepalive-timeout", "30", "--page-size", "4KiB"))  # fmt: skip
    _store_long_events(srv, "", "u")
    s = socket.socket()  # a small window and MSS: the server's kernel buffer stays small
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    try:
        s.connect(("127.0.0.1", srv.port))
        s.sendall(b"GET /kv/events?since=0&limit=10000 HTTP/1.1\r\nHost: t\r\n\r\n")
        assert s.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"  # and nothing more read

        def send_timeouts() -> float:
            text = request(srv, "GET", "/metrics").text
            line = 'eg_kv_connection_timeouts_total{limit="send"} '
            return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

        wait_for(lambda: send_timeouts() >= 1, timeout=15, what="the send limit to cut it")
    finally:
        s.close()


# ------------------------------------------------ a million blocks (items 2 and 3)

MILLION = 1 << 20


@pytest.fixture(scope="module")
def million(module_server_factory, tmp_path_factory):
    """One worker over a 4 GiB slab of 4 KiB pages holding 1,048,576 one-byte blocks of
    the victim's namespace (the block count of a 64 GiB slab of 64 KiB pages)."""
    path = write_tokens(
        tmp_path_factory.mktemp("tokens") / "tokens.toml",
        [*TENANTS, {"name": "ops", "role": "admin"}],
    )
    srv = module_server_factory(
        workers=1, capacity="4GiB",
        extra=("--page-size", "4KiB", "--tokens", str(path), "--lock-timeout", "5"),
        ready_s=180,
    )  # fmt: skip
    with Slab.attach(srv.slab_name) as slab:
        ns = slab.bind_namespaces({"victim-ns": 0})["victim-ns"]
        for i in range(MILLION):
            slab.put(f"b{i}", b"v", ns)
        assert slab.stats()["unique_blocks"] == MILLION
    return srv


def _worker(srv) -> psutil.Process:
    (pid,) = workers_of(srv)
    return psutil.Process(pid)


def private_mib(proc: psutil.Process) -> float:
    """``proc``'s resident memory that is its own: RSS less the pages it shares (the
    slab's, mapped by every process, count in RSS once touched)."""
    info = proc.memory_info()
    return (info.rss - info.shared) / 2**20


class Prober:
    """Asks ``/healthz`` (the one worker) every 20 ms on a thread and keeps each wait."""

    def __init__(self, srv, rss_of: psutil.Process | None = None) -> None:
        self.srv, self.waits, self.rss = srv, [], []
        self._proc = rss_of
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02) and len(self.waits) < 100_000:
            t0 = time.monotonic()
            assert request(self.srv, "GET", "/healthz", timeout=10).status == 200
            self.waits.append(time.monotonic() - t0)
            if self._proc is not None:
                self.rss.append(private_mib(self._proc))

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(30)
        return self.waits


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_snapshot_of_a_million_blocks_is_a_stream_not_a_stall(million):
    """On d29c8d3 one admin snapshot of these 1,048,576 blocks got its worker SIGKILLed
    (a list of dicts and one json.dumps on the loop; at 262,144 blocks /healthz waited
    1.83 s). Now: no worker killed, /healthz never waits 250 ms, and the worker's RSS
    grows by less than 64 MiB."""
    srv = million
    worker = _worker(srv)
    before = private_mib(worker)
    prober = Prober(srv, worker)
    reader = (  # in a process of its own: its parsing must not hold the prober's GIL
        "import sys\nfrom eg_kv.client.sync import ServerConnector\n"
        "with ServerConnector(base_url=sys.argv[1], token=sys.argv[2], timeout_s=300) as c:\n"
        "    snap = c.snapshot()\n"
        "print(len(snap.blocks), sorted({b.namespace for b in snap.blocks}))\n"
    )
    try:
        wait_for(lambda: len(prober.waits) >= 5, timeout=30, what="the prober's first answers")
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", reader, srv.url, token_of("ops")],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        took = time.monotonic() - t0
    finally:
        waits = prober.stop()
    assert out.stdout.split(maxsplit=1) == [str(MILLION), "['victim-ns']\n"], out
    assert _worker(srv).pid == worker.pid, "the worker was replaced"
    grew = max(prober.rss) - before
    worst = max(waits)
    seen = f"healthz {worst:.3f} s, private memory +{grew:.0f} MiB, {took:.1f} s"
    assert worst < 0.25 and grew < 64, seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_empty_namespaces_snapshot_burst_costs_the_others_little(million):
    """On d29c8d3 600 snapshots from a readonly tenant with an EMPTY namespace, each on a
    connection closed at once, kept another tenant's p99 over 5x its baseline for 25 s
    (each walked every slot in Python; the executor queue was unbounded; abandoned ones
    were walked). A snapshot's Python work now follows its own namespace's blocks, the
    gate turns the rest away, and a gone client's is dropped."""
    srv = million
    victim, mallory = token_of("victim"), token_of("mallory")
    empty = request(srv, "GET", "/kv/events/snapshot", token=mallory)
    assert empty.status == 200 and parse_snapshot(empty.body).blocks == []

    def latencies(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.monotonic()
            assert request(srv, "GET", "/kv/b7", token=victim).status == 200
            out.append(time.monotonic() - t0)
        return out

    def p99(xs: list[float]) -> float:
        return sorted(xs)[int(0.99 * (len(xs) - 1))]

    def under_burst(target: bytes) -> list[float]:
        """The victim's latencies while 600 requests for ``target`` come in over 3 s, each
        on a connection closed at once."""
        watcher = Latencies(srv, victim, "/kv/b7")
        start = time.monotonic()
        for k in range(600):
            _send_and_close(srv.port, mallory, target)
            pause = start + (k + 1) / 200 - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            assert time.monotonic() < start + 60
        seen = watcher.stop()
        assert {status for status, _ in seen} == {200} and len(seen) >= 10
        return [t for _, t in seen]

    # The baseline: the same burst of a cheap request (/healthz), so the
    # comparison is of what the snapshots cost, not of 200 connections a second on 2 cores.
    # A pair over the bound is measured again, twice at most: a neighbour's burst of work
    # under scripts/test's two processes (a server test file's) can land in one burst and
    # not the other (CI saw 1.84 against 0.71 ms), where d29c8d3's walks cost 5x for 25 s.
    idle = p99(latencies(300))
    pairs = []
    for _ in range(3):
        pairs.append((p99(under_burst(b"/healthz")), p99(under_burst(b"/kv/events/snapshot"))))
        if pairs[-1][1] <= 2 * pairs[-1][0]:
            break
    baseline, during = pairs[-1]
    assert during <= 2 * baseline, (idle, pairs)
    # Once the burst is over, nothing of it lingers. Sub-millisecond p99s wobble by 2x on
    # 2 cores (0.65 ms idle, then 1.78 ms in one CI run; 2.49 ms once beside another test
    # file's servers under scripts/test's two processes), so the bound is 2x the larger of
    # the two quiet figures, and a sample over it is taken again, for at most 10 s: a walk
    # left running would cost tens of ms a request for as long as it ran (25 s on d29c8d3).
    deadline, afters = time.monotonic() + 10, []
    while True:
        afters.append(p99(latencies(300)))
        if afters[-1] <= 2 * max(idle, baseline) or time.monotonic() > deadline:
            break
    assert afters[-1] <= 2 * max(idle, baseline), (idle, baseline, afters)
