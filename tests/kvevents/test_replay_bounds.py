"""The publisher's replay socket against a requester that asks for resyncs over and over
(ZMQ has no authentication): one resync a second at most, the rest get the end marker."""

from __future__ import annotations

import os
import time

import pytest
import zmq
from helpers.common import free_port, unique_slab_name, wait_for

from eg_kv.engine import EngineName
from eg_kv.kvevents.publisher import Publisher, PublisherOptions
from eg_kv.kvevents.wire import END_SEQ
from eg_kv.slab.store import Slab

pytestmark = pytest.mark.timeout(60)


def ask(ctx, endpoint: str, start: int) -> list[int]:
    """One replay request; the seqs of the answer's messages (-1: the end marker)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs: list[int] = []
    try:
        while not seqs or seqs[-1] != -1:
            assert dealer.poll(10_000), "no answer"
            _, _, seq, _ = dealer.recv_multipart()
            seqs.append(int.from_bytes(seq, "big", signed=True))
    finally:
        dealer.close()
    return seqs


def test_resyncs_come_at_most_once_a_second_and_those_put_off_wait_for_the_next():
    """A resync walks the slot table: at most one a second. Requests in between wait, and
    the next walk answers them together, whole (the end marker alone, as before, looked
    like a complete answer to a requester that had to resync)."""
    import threading

    slab = Slab.create(unique_slab_name("replay"), 4 << 20, 4096)
    slab.setup_events(16)
    replay = f"tcp://127.0.0.1:{free_port()}"
    options = PublisherOptions(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay)
    publisher = Publisher(slab, options)
    ctx = zmq.Context()
    try:
        for k in range(40):  # the 16-entry log lapped: position 1 is gone
            slab.put(f"b{k}", b"x", engine=EngineName(os.urandom(32), b"", 16))
        publisher.step()
        first = ask_and_serve(ctx, publisher, replay)
        # one message (AllBlocksCleared, then every block held) at the walk's seq; the end
        assert len(first) == 2 and first[0] > 0 and first[-1] == -1
        answers: list[list[int]] = []
        askers = [threading.Thread(target=lambda: answers.append(ask(ctx, replay, 1)))
                  for _ in range(2)]  # fmt: skip
        for asker in askers:
            asker.start()
        while publisher.counters["resyncs_put_off"] < 2:  # both asked within the second
            if publisher.replay is not None and publisher.replay.poll(50):
                publisher.serve_replay()
        assert publisher.counters["resyncs"] == 1 and not answers
        while any(asker.is_alive() for asker in askers):  # the next walk, once it is due
            publisher.serve_waiting()
            time.sleep(0.01)
        assert answers == [first, first]  # whole: the blocks, then the end marker
        assert publisher.counters["resyncs"] == 2  # one walk for both
        assert publisher.counters["replays_dropped"] == 0
    finally:
        publisher.close()
        ctx.term()
        slab.close()
        slab.unlink()


def ask_and_serve(ctx, publisher: Publisher, endpoint: str) -> list[int]:
    """Ask from position 1 while the publisher serves the request (one thread each)."""
    import threading

    out: list[list[int]] = []
    asker = threading.Thread(target=lambda: out.append(ask(ctx, endpoint, 1)))
    asker.start()
    while asker.is_alive():
        if publisher.replay is not None and publisher.replay.poll(50):
            publisher.serve_replay()
    asker.join()
    return out[0]


@pytest.fixture
def lapped():
    """A publisher whose 16-entry log lapped (position 1 is gone: a resync answers), its
    replay endpoint and a ZMQ context; everything closed and unlinked after."""
    slab = Slab.create(unique_slab_name("replay"), 4 << 20, 4096)
    slab.setup_events(16)
    ctx = zmq.Context()
    publisher = None
    try:
        replay = f"tcp://127.0.0.1:{free_port()}"
        options = PublisherOptions(endpoint=f"tcp://127.0.0.1:{free_port()}",
                                   replay_endpoint=replay)  # fmt: skip
        publisher = Publisher(slab, options)
        for k in range(40):
            slab.put(f"b{k}", b"x", engine=EngineName(os.urandom(32), b"", 16))
        publisher.step()
        yield slab, publisher, replay, ctx
    finally:
        if publisher is not None:
            publisher.close()
        ctx.term()
        slab.close()
        slab.unlink()


def _answer_until_quiet(ctx, publisher: Publisher, endpoint: str, body: list[bytes]) -> list[int]:
    """Send one request, serve it, and collect what came back until 0.3 s of quiet."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", *body])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (
            publisher.replay is not None and publisher.replay.poll(50)
        ):
            pass
        publisher.serve_replay()
        seqs: list[int] = []
        while dealer.poll(300):
            frames = dealer.recv_multipart()
            seqs.append(int.from_bytes(frames[2], "big", signed=True))
        return seqs
    finally:
        dealer.close()


class _EndFailsFor:
    """The publisher's real replay socket, except that the end marker to one requester
    fails as a requester that stopped reading makes it fail (``zmq.Again``)."""

    def __init__(self, socket, identity: bytes) -> None:
        self._socket, self._identity, self._frames = socket, identity, []

    def send(self, frame, flags=0, **kwargs):
        self._frames.append(frame)
        if not flags & zmq.SNDMORE:  # the message's last frame: the payload
            frames, self._frames = self._frames, []
            if frames[0] == self._identity and frames[3] == END_SEQ:
                raise zmq.Again()
            for part in frames[:-1]:
                self._socket.send(part, zmq.SNDMORE)
            return self._socket.send(frame, flags, **kwargs)
        return None

    def __getattr__(self, name):
        return getattr(self._socket, name)


def test_a_requester_whose_end_marker_fails_costs_the_next_one_nothing(lapped):
    """Three requesters wait for one resync; the end marker to the first fails. The
    others each get theirs (the one after it went without and had to ask again)."""
    import threading

    _, publisher, replay, ctx = lapped
    first = ask_and_serve(ctx, publisher, replay)  # the next resync waits a second
    dealers = {}
    for name in (b"A", b"B", b"C"):  # asked in this order: A's is the first served
        dealer = dealers[name] = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, name)
        dealer.connect(replay)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        put_off = publisher.counters["resyncs_put_off"]
        while publisher.counters["resyncs_put_off"] == put_off:
            if publisher.replay is not None and publisher.replay.poll(50):
                publisher.serve_replay()
    publisher.replay = _EndFailsFor(publisher.replay, b"A")
    got: dict[bytes, list[int]] = {}

    def read(name: bytes) -> None:
        seqs: list[int] = []
        while (not seqs or seqs[-1] != -1) and dealers[name].poll(10_000):
            seqs.append(int.from_bytes(dealers[name].recv_multipart()[2], "big", signed=True))
        got[name] = seqs

    readers = [threading.Thread(target=read, args=(n,)) for n in (b"B", b"C")]
    try:
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 20
        while publisher.counters["resyncs"] < 2 and time.monotonic() < deadline:
            publisher.serve_waiting()
            time.sleep(0.01)
        for reader in readers:
            reader.join(15)
        assert got == {b"B": first, b"C": first}  # whole, each with its end marker
        assert publisher.counters["replays_dropped"] == 1  # A alone
    finally:
        publisher.replay = publisher.replay._socket
        for dealer in dealers.values():
            dealer.close()


def test_a_resync_that_cannot_be_made_whole_sends_no_end_marker(lapped, monkeypatch):
    """Three walks met by a repair (or lapped by the log): the requester is dropped
    without the end marker (before, the marker told it a part was the whole) and asks
    again; it gets no part either (it got a clear and part of the blocks, three times)."""
    from eg_kv.slab.events import SnapshotVoid

    slab, publisher, replay, ctx = lapped
    walk = slab.snapshot_stream

    def lapped_after_a_part(ns, timeout=None, engines=False):
        for part in walk(ns, timeout=timeout, engines=engines):
            yield part
            raise SnapshotVoid("the log lapped the walk")

    monkeypatch.setattr(slab, "snapshot_stream", lapped_after_a_part)
    seqs = _answer_until_quiet(ctx, publisher, replay, [(1).to_bytes(8, "big")])
    assert seqs == []  # no part (a resync goes out whole, once built), and no end marker
    assert publisher.counters["resyncs"] == 1
    assert publisher.counters["replays_dropped"] == 1


def test_an_answer_that_runs_past_its_deadline_is_cut(lapped, monkeypatch):
    """A requester reading one message a second would hold the live batches for as long
    as its answer lasts: each answer has a deadline, and one cut gets no end marker."""
    from eg_kv.kvevents import publisher as P

    _slab, publisher, replay, ctx = lapped
    monkeypatch.setattr(P, "REPLAY_DEADLINE_S", -1.0)  # every answer is past it at once
    seqs = _answer_until_quiet(ctx, publisher, replay, [(1).to_bytes(8, "big")])
    assert seqs == []  # cut before its first message: no end marker either
    assert publisher.counters["replays_dropped"] == 1
    monkeypatch.setattr(P, "REPLAY_DEADLINE_S", 3.0)
    publisher._resynced_at = -P.RESYNC_INTERVAL_S  # the next resync is due
    seqs = _answer_until_quiet(ctx, publisher, replay, [(1).to_bytes(8, "big")])
    assert seqs[-1] == -1 and len(seqs) == 2  # the same request, whole


def test_a_huge_request_frame_is_refused_by_the_socket(lapped):
    """No peer can stream a huge frame into the publisher's memory: the replay socket
    takes messages of at most MAX_MESSAGE bytes (a larger one drops the connection)."""
    from eg_kv.kvevents.publisher import MAX_MESSAGE

    _slab, publisher, replay, ctx = lapped
    huge = _answer_until_quiet(ctx, publisher, replay, [b"x" * (4 * MAX_MESSAGE)])
    assert huge == []  # never taken in, never answered
    later = (publisher.base + 10**6).to_bytes(8, "big")
    fine = _answer_until_quiet(ctx, publisher, replay, [later])
    assert fine == [-1]  # the publisher goes on: nothing at or after that seq


#: A requester that asks for the same long replay again and again, from four sockets at
#: once, until it has read ``want`` whole answers (``seconds`` at most); prints how many.
_HUNGRY = """
import sys, time, zmq
endpoint, seconds, want = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
dealers = [ctx.socket(zmq.DEALER) for _ in range(4)]
for d in dealers:
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", (1).to_bytes(8, "big")])
answers, until = 0, time.monotonic() + seconds
poller = zmq.Poller()
for d in dealers:
    poller.register(d, zmq.POLLIN)
while time.monotonic() < until and answers < want:
    for d, _ in poller.poll(100):
        while d.poll(0):
            if d.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True):
                answers += 1
                d.send_multipart([b"", (1).to_bytes(8, "big")])
print(answers)
for d in dealers:
    d.close()
ctx.term()
"""


def test_requesters_asking_again_and_again_get_at_most_half_the_publishers_time():
    """Four requests always waiting, each for a replay of 3,000 batches: the publisher
    answers them in at most REPLAY_SHARE of its time and gives the rest to the live
    stream (it answered one after each step, and the live stream fell behind the log).
    The live stream's share comes after each answer, so the last answer may run past the
    share by its own length (up to 1.2 s here, with the requester's reads): it is left
    out (a fixed 300 ms for it failed once in CI). The requester stops after four
    answers, however long they take (a fixed 3 s read three on a loaded box)."""
    import subprocess
    import sys
    import threading

    from eg_kv.kvevents import publisher as P

    slab = Slab.create(unique_slab_name("replay"), 8 << 20, 4096)
    slab.setup_events(8192)
    ctx = zmq.Context()
    publisher = None
    stop = threading.Event()
    try:
        replay = f"tcp://127.0.0.1:{free_port()}"
        options = P.PublisherOptions(endpoint=f"tcp://127.0.0.1:{free_port()}",
                                     replay_endpoint=replay)  # fmt: skip
        publisher = P.Publisher(slab, options)
        answers_ms: list[float] = []
        timed = publisher._timed

        def timing(serve) -> None:
            t = time.monotonic()
            timed(serve)
            answers_ms.append((time.monotonic() - t) * 1000)

        publisher._timed = timing
        for k in range(3000):  # a batch each
            slab.put(f"b{k}", b"x", engine=EngineName(os.urandom(32), b"", 16))
            publisher.step()
        loop = threading.Thread(target=publisher.run, args=(stop.is_set,))
        loop.start()
        t0 = time.monotonic()
        hungry = subprocess.run([sys.executable, "-c", _HUNGRY, replay, "20", "4"], timeout=40,
                                capture_output=True, text=True, check=True)  # fmt: skip
        stop.set()
        loop.join(10)
        elapsed_ms = (time.monotonic() - t0) * 1000
        assert int(hungry.stdout) == 4  # it was answered, whole, again and again
        spent = publisher.counters["replay_ms"]
        before_last = spent - answers_ms[-1]
        assert before_last <= P.REPLAY_SHARE * elapsed_ms + 100, (spent, answers_ms, elapsed_ms)
    finally:
        stop.set()
        if publisher is not None:
            publisher.close()
        ctx.term()
        slab.close()
        slab.unlink()


def test_every_publisher_counter_is_on_metrics():
    """The publisher counted dropped replay requesters and bad extras messages that
    /metrics never showed; every counter it keeps has a series now (time in seconds)."""
    from eg_kv.kvevents.publisher import COUNTERS
    from eg_kv.server.metrics import _KV_EVENTS, _kv_events_families

    assert set(COUNTERS) == set(_KV_EVENTS)
    names = {f.name for f in _kv_events_families(dict.fromkeys(COUNTERS, 1500))}
    assert "eg_kv_kv_events_replays_dropped" in names
    assert "eg_kv_kv_events_replay_seconds" in names and "eg_kv_kv_events_replay_ms" not in names
    (replay,) = [f for f in _kv_events_families({"replay_ms": 1500}) if "replay" in f.name]
    assert replay.samples[0].value == 1.5


def test_vllms_replay_loop_applies_a_resync_whole():
    """vLLM's reference subscriber (examples/online_serving/kv_events_subscriber.py)
    applies a replayed message only if its seq is above the last it applied, and stops at
    the one before the live seq that showed its hole. A resync sent every message under
    one seq, so it applied AllBlocksCleared alone: 20 of 43 blocks held. A resync is now
    one message: the loop applies it whole."""
    import threading

    import msgspec

    slab = Slab.create(unique_slab_name("replay"), 4 << 20, 4096)
    slab.setup_events(32)
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = PublisherOptions(endpoint=pub_endpoint, replay_endpoint=replay_endpoint)
    publisher = Publisher(slab, options)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint)
    held: set[bytes] = set()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if publisher.replay is not None and publisher.replay.poll(20):
                publisher.serve_replay()

    server = threading.Thread(target=serve)
    probes: list[bytes] = []

    def process(payload: bytes) -> None:
        for event in msgspec.msgpack.decode(payload)[1]:
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            else:
                held.clear()

    def put_and_step(first: int, end: int) -> list[bytes]:
        for k in range(first, end):
            slab.put(f"b{k}", b"x")
        publisher.step()
        assert sub.poll(5000), "no live message"
        return sub.recv_multipart()

    try:

        def heard() -> bool:  # the subscription reached the publisher
            probes.append(f"probe{len(probes)}".encode())
            slab.put(probes[-1].decode(), b"x")
            publisher.step()
            return bool(sub.poll(50))

        wait_for(heard, 10, what="the subscriber subscribed")
        _, seq_b, payload = sub.recv_multipart()
        held.update(probes)  # as a snapshot would have told it
        process(payload)
        _, seq_b, payload = put_and_step(0, 3)
        last_seq = int.from_bytes(seq_b, "big")
        process(payload)
        put_and_step(3, 23)  # lost (a full queue, a reconnect): the 32-entry log laps it
        _, seq_b, payload = put_and_step(23, 43)
        seq = int.from_bytes(seq_b, "big")
        assert seq > last_seq + 1
        server.start()
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(replay_endpoint)
        replay.send_multipart([b"", (last_seq + 1).to_bytes(8, "big")])
        while replay.poll(2000):  # vLLM's loop
            _, _topic, seq_bytes, replay_payload = replay.recv_multipart()
            if not replay_payload:
                break
            replay_seq = int.from_bytes(seq_bytes, "big")
            if replay_seq > last_seq:
                process(replay_payload)
                last_seq = replay_seq
                if replay_seq >= seq - 1:
                    break
        process(payload)
        replay.close()
        assert publisher.counters["resyncs"] == 1
        assert held == {f"b{k}".encode() for k in range(43)} | set(probes)  # was 20 of 43
    finally:
        stop.set()
        if server.is_alive():
            server.join(5)
        sub.close()
        publisher.close()
        ctx.term()
        slab.close()
        slab.unlink()
