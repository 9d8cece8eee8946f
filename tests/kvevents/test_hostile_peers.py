"""The publisher's memory against peers that send huge multipart messages or never read
(ZMQ has no authentication): a publisher process of its own, its anonymous memory read
from /proc, real sockets on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import zmq
from helpers.common import ROOT, free_port, unique_slab_name, wait_for

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20

#: A slab and a publisher running its loop until SIGTERM (as the server's process runs
#: it); prints "ready" once bound. argv: slab name, PUB port, replay port, stats path,
#: blocks stored first, REPLAY_QUEUED_MAX.
_PUBLISHER = """
import os, signal, sys
from eg_kv.engine import EngineName
from eg_kv.kvevents import publisher as P
from eg_kv.kvevents.publisher import Publisher, PublisherOptions
from eg_kv.slab.store import Slab
name, pub_port, replay_port, stats, blocks, queued_max = sys.argv[1:7]
P.REPLAY_QUEUED_MAX = int(queued_max)
slab = Slab.create(name, 192 << 20, 4096, 4096, prefault=False)
slab.setup_events(64)
for k in range(int(blocks)):  # each named by the engine, as a resync names it
    slab.put(f"b{k}", b"x", engine=EngineName(os.urandom(32), os.urandom(32), 16))
options = PublisherOptions(endpoint=f"tcp://127.0.0.1:{pub_port}",
                           replay_endpoint=f"tcp://127.0.0.1:{replay_port}", stats_path=stats)
publisher = Publisher(slab, options)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
try:
    publisher.run(lambda: bool(stop))
finally:
    publisher.close()
    slab.close()
    slab.unlink()
"""


def anon(pid: int) -> int:
    """A process's resident anonymous memory, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def given_back(pid: int, before: int, timeout: float) -> None:
    """Wait until the process's anonymous memory is back within 16 MiB of ``before``."""
    wait_for(lambda: anon(pid) < before + 16 * MiB, timeout,
             what=f"memory back within 16 MiB of {before // MiB} MiB (now "
             f"{anon(pid) // MiB} MiB)")  # fmt: skip


@pytest.fixture
def start_publisher(tmp_path):
    """Starts a publisher process storing ``blocks`` first, with REPLAY_QUEUED_MAX
    ``queued_max``: (its pid, PUB endpoint, replay endpoint, stats path). Each is
    stopped, and its slab unlinked, after the test."""
    procs = []

    def start(blocks: int = 0, queued_max: int = 256 * MiB):
        pub, replay = free_port(), free_port()
        stats = tmp_path / f"kv-events-{len(procs)}.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER, unique_slab_name("hostile"), str(pub),
             str(replay), str(stats), str(blocks), str(queued_max)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc.pid, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", stats

    yield start
    for proc in procs:
        proc.terminate()  # its finally unlinks the slab
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def counters(stats) -> dict:
    try:
        return json.loads(stats.read_text())
    except (OSError, ValueError):
        return {}


def test_a_multipart_replay_request_is_refused_and_its_memory_given_back(start_publisher):
    """One request of 2,500 frames of 16,000 B (each under the 16 KiB frame limit): the
    publisher copied all 40 MB into Python and kept the 80 MB for good, and answered it;
    now it reads the frames past a request's four uncopied, refuses it (counted), and
    hands the freed heap back."""
    pid, _pub, replay, stats = start_publisher()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    far = ((1 << 64) - 2).to_bytes(8, "big")  # past every seq: the end marker alone
    try:
        dealer.send_multipart([b"", far])
        assert dealer.poll(10_000) and dealer.recv_multipart()[2] == b"\xff" * 8
        before = anon(pid)
        dealer.send_multipart([b"", *[b"x" * 16_000] * 2_500, far])
        dealer.send_multipart([b"", far])  # answered after the huge one was taken
        assert dealer.poll(10_000)
        answers = [dealer.recv_multipart()]
        while dealer.poll(300):
            answers.append(dealer.recv_multipart())
        assert len(answers) == 1  # the huge request got no answer, the honest one its end
        wait_for(lambda: counters(stats).get("requests_refused") == 1, 10, what="counted")
        given_back(pid, before, 5)
    finally:
        dealer.close()
        ctx.term()


def test_a_multipart_subscription_message_leaves_no_memory_behind(start_publisher):
    """An XSUB sends the PUB socket one message of 5,000 frames (80 MB): libzmq took it
    in whole and freed it in 16 KiB pieces that the publisher kept for good; now the
    publisher hands freed heap back once it grew past TRIM_AFTER."""
    pid, pub, _replay, _stats = start_publisher()
    ctx = zmq.Context()
    xsub = ctx.socket(zmq.XSUB)
    xsub.setsockopt(zmq.LINGER, 0)
    xsub.connect(pub)
    try:
        before = anon(pid)
        xsub.send_multipart([b"\x01kv", *[b"x" * 16_000] * 5_000])
        wait_for(lambda: anon(pid) > before + 40 * MiB, 15, what="the message taken in")
        given_back(pid, before, 15)
    finally:
        xsub.close()
        ctx.term()


def stalled_requester(endpoint: str, start: int) -> socket.socket:
    """A replay requester that speaks ZMTP 3.1 as a DEALER, asks from ``start``, and
    never reads (its receive buffer 4 KiB): what is sent to it stays with the sender."""
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.settimeout(10)

    def take(n: int) -> bytes:
        got = b""
        while len(got) < n:
            more = sock.recv(n - len(got))
            assert more, "the publisher hung up"
            got += more
        return got

    # Each step once the publisher's came (libzmq misreads a greeting sent with more).
    sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32))
    take(64)  # its greeting
    ready = b"\x05READY\x0bSocket-Type\0\0\0\x06DEALER\x08Identity\0\0\0\0"
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
    take(take(2)[1])  # its READY (a short command)
    sock.sendall(b"\x01\x00" + b"\x00\x08" + start.to_bytes(8, "big"))  # [b"", seq]
    return sock


def test_answers_held_for_requesters_that_never_read_stay_within_the_budget(start_publisher):
    """Six requesters ask for a resync of 40,000 blocks (about 6 MB) and never read. The
    replay socket queued up to 1,000 messages per requester, so each answer was taken as
    delivered and held for as long as its requester stayed connected, a copy each; now
    the answers libzmq holds are bounded (REPLAY_QUEUED_MAX, 8 MiB here) and a requester
    past it is refused (counted)."""
    pid, _pub, replay, stats = start_publisher(40_000, 8 * MiB)
    stalled = []
    try:
        before = anon(pid)
        for _ in range(6):
            stalled.append(stalled_requester(replay, 1))  # the log lapped: a resync

        def taken() -> bool:  # every request, and two walks at least (written after)
            got = counters(stats)
            return got.get("replays", 0) >= 6 and got["resyncs"] >= 2

        wait_for(taken, 60, what="six requests, two walks")
        grown = anon(pid) - before
        assert grown < 8 * MiB + 10 * MiB, f"{grown / MiB:.1f} MiB held"  # was 25.1
        assert counters(stats)["replays_dropped"] >= 1  # cut off, or refused (was 0)
    finally:
        for sock in stalled:
            sock.close()


def test_a_subscriber_that_stopped_reading_holds_at_most_the_pub_budget(monkeypatch):
    """A subscriber that stops reading (its host hung): the PUB socket queued up to
    100,000 messages for it whatever their size; now its high-water mark is the byte
    budget over the largest message (PUB_QUEUED_MAX, 16 MiB here). 100 batches of 256
    stores with 1,024 token ids each (1.4 MB a batch) go out behind it."""
    from eg_kv.engine import packed_tokens
    from eg_kv.kvevents import memory
    from eg_kv.kvevents import publisher as P
    from eg_kv.slab.store import Slab

    monkeypatch.setattr(P, "PUB_QUEUED_MAX", 16 * MiB, raising=False)
    slab = Slab.create(unique_slab_name("hostile"), 4 << 20, 4096)
    slab.setup_events(64)
    ctx = zmq.Context()
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = P.PublisherOptions(endpoint=pub_endpoint, extras_endpoint="inproc://extras")
    publisher = P.Publisher(slab, options, context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)  # takes one message in, then reads no more
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint)
    tokens = (packed_tokens([2**32 - 1] * 1024), "lora")
    wire = publisher.wire

    def batch() -> None:  # a full batch of the default namespace, sent as step() does
        events = [wire.stored(os.urandom(32), b"", 16, 0, tokens) for _ in range(P.BATCH_EVENTS)]
        publisher._pending[0] = (1, events)
        publisher._flush(0)

    try:

        def heard() -> bool:  # the subscription reached the publisher
            batch()
            return bool(sub.poll(50))

        wait_for(heard, 10, what="the subscriber subscribed")
        before = memory.anon_bytes()
        for _ in range(100):
            batch()
        grown = memory.anon_bytes() - before
        print(f"grown {grown / MiB:.1f} MiB")
        assert grown < 16 * MiB + 12 * MiB, f"{grown / MiB:.0f} MiB held"  # was 126
        assert publisher.pub.getsockopt(zmq.HEARTBEAT_TIMEOUT) > 0  # a vanished one goes
    finally:
        sub.close()
        publisher.close()
        ctx.term()
        slab.close()
        slab.unlink()
