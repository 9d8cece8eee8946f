"""The publisher's batches: a namespace's events of a step in one message, numbered in the
batch index beside the log, so that ``seq`` has no hole within a publisher's life or
across two, and a number the log could not fill is answered by a resync."""

from __future__ import annotations

import os
import threading

import msgspec
import posix_ipc
import pytest
import zmq
from helpers.common import free_port, unique_slab_name

from eg_kv.engine import EngineName
from eg_kv.kvevents.publisher import BATCH_EVENTS, Publisher, PublisherOptions
from eg_kv.slab.events import batches_name
from eg_kv.slab.segment import SHM_DIR, ForeignSegment
from eg_kv.slab.store import Slab

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slab():
    s = Slab.create(unique_slab_name("batches"), 64 << 20, 4096)
    s.setup_events(4096)
    yield s
    s.close()
    s.unlink()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def options() -> PublisherOptions:
    return PublisherOptions(endpoint=f"tcp://127.0.0.1:{free_port()}",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")  # fmt: skip


def put(slab: Slab, count: int, tag: str) -> None:
    for k in range(count):
        slab.put(f"{tag}{k}", b"x", engine=EngineName(os.urandom(32), b"", 16))


def kinds(payload: bytes) -> list[str]:
    """The events of one message, by type."""
    _ts, events, _rank = msgspec.msgpack.decode(payload)
    return [ev["type"] for ev in events]


def live_sub(ctx, publisher: Publisher, slab: Slab) -> zmq.Socket:
    """A SUB whose subscription has reached the publisher (probes stored and published
    until one arrives), drained."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.options.endpoint)
    for k in range(200):
        put(slab, 1, f"probe{k}-")
        publisher.step()
        if sub.poll(50):
            break
    else:
        raise AssertionError("the SUB never got a message")
    while sub.poll(50):
        sub.recv_multipart()
    return sub


def ask(ctx, publisher: Publisher, seq: int) -> list[tuple[int, list[str]]]:
    """A replay request from ``seq`` served by ``publisher``: (seq, event types) each,
    the end marker's seq -1."""
    out: list[tuple[int, list[str]]] = []

    def request() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.options.replay_endpoint)
        dealer.send_multipart([b"", seq.to_bytes(8, "big")])
        while not out or out[-1][0] != -1:
            assert dealer.poll(10_000), "no answer"
            _, _, seq_b, payload = dealer.recv_multipart()
            got = int.from_bytes(seq_b, "big", signed=True)
            out.append((got, kinds(payload) if got >= 0 else []))
        dealer.close(linger=0)

    asker = threading.Thread(target=request)
    asker.start()
    while asker.is_alive():
        if publisher.replay is not None and publisher.replay.poll(50):
            publisher.serve_replay()
    asker.join()
    return out


def test_a_burst_goes_out_in_batches_numbered_without_a_hole(slab, ctx):
    publisher = Publisher(slab, options(), context=ctx)
    try:
        sub = live_sub(ctx, publisher, slab)
        last = publisher.base + publisher.index.position(0)[0] - 1
        put(slab, 600, "burst")
        publisher.step()
        got = []
        while sub.poll(200):
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), kinds(payload)))
        sizes = [len(events) for _, events in got]
        assert sizes == [BATCH_EVENTS, BATCH_EVENTS, 600 - 2 * BATCH_EVENTS]
        assert [seq for seq, _ in got] == [last + 1, last + 2, last + 3]
        assert {kind for _, events in got for kind in events} == {"BlockStored"}
        assert publisher.counters["batches"] >= 3
    finally:
        publisher.close()


def test_a_new_publisher_numbers_on_from_where_the_last_stopped(slab, ctx):
    first = Publisher(slab, options(), context=ctx)
    put(slab, 5, "a")
    first.step()
    assert first.index.position(0) == (2, 5)  # batch 0: AllBlocksCleared; 1: five stores
    put(slab, 7, "b")  # the log moves on while no publisher follows it
    first.close()
    second = Publisher(slab, options(), context=ctx)  # publishes the seven, as batch 2
    try:
        base = second.base
        assert second.index.position(0) == (3, 12)
        answer = ask(ctx, second, base)
        assert answer == [(base, ["AllBlocksCleared"]), (base + 1, ["BlockStored"] * 5),
                          (base + 2, ["BlockStored"] * 7), (-1, [])]  # fmt: skip
        assert second.counters["resyncs"] == 0
        sub = live_sub(ctx, second, slab)  # a probe: batch 3, and on
        assert second.index.position(0)[0] > 3
        sub.close(linger=0)
    finally:
        second.close()


def test_a_number_the_log_could_not_fill_is_answered_by_a_resync(ctx):
    slab = Slab.create(unique_slab_name("batches"), 4 << 20, 4096)
    slab.setup_events(16)
    publisher = Publisher(slab, options(), context=ctx)
    try:
        put(slab, 40, "lap")  # the 16-entry log lapped before the publisher looked
        publisher.step()
        assert publisher.counters["burnt"] == 1 and publisher.index.position(0)[0] == 2
        answer = ask(ctx, publisher, publisher.base + 1)  # the burnt number
        seqs = {seq for seq, _ in answer[:-1]}
        assert seqs == {publisher.base + 1} and answer[-1] == (-1, [])
        # One message (vLLM's replay loop applies one message per seq): the clear, then
        # every block held.
        assert len(answer) == 2 and answer[0][1] == ["AllBlocksCleared"] + ["BlockStored"] * 40
        assert publisher.counters["resyncs"] == 1
    finally:
        publisher.close()
        slab.close()
        slab.unlink()


def test_the_index_goes_with_the_slab(ctx):
    for by_name in (False, True):
        slab = Slab.create(unique_slab_name("batches"), 4 << 20, 4096)
        name = slab.name
        try:
            slab.setup_events(64)
            Publisher(slab, options(), context=ctx).close()
            assert os.path.exists(SHM_DIR + batches_name(name))
        finally:
            slab.close()
            if by_name:  # as --fresh does
                Slab.unlink_named(name)
            else:
                slab.unlink()
        assert not os.path.exists(SHM_DIR + batches_name(name))


def test_an_index_another_user_could_write_is_refused(slab, ctx):
    """A segment under the index's name with group or other bits (planted, or another
    user's) stops the publisher: it never numbers batches in memory others can write."""
    planted = posix_ipc.SharedMemory(batches_name(slab.name), posix_ipc.O_CREX, mode=0o666,
                                     size=4096)  # fmt: skip
    planted.close_fd()
    os.chmod(SHM_DIR + batches_name(slab.name), 0o666)  # whatever the umask
    with pytest.raises(ForeignSegment, match="mode 0666"):
        Publisher(slab, options(), context=ctx)


class _KilledAfter:
    """The index's namespace words, as a publisher killed after ``writes`` more writes
    to them sees them (the rest never happen)."""

    def __init__(self, words, writes: int) -> None:
        self.words, self.left = words, writes

    def __getitem__(self, i):
        return self.words[i]

    def __setitem__(self, i, value) -> None:
        if self.left == 0:
            raise KeyboardInterrupt("killed")
        self.left -= 1
        self.words[i] = value


def test_a_publisher_killed_between_its_index_words_leaves_a_hole_not_a_silent_skip(slab, ctx):
    """A batch is recorded as its ring record, then the namespace's next number and last
    position. Killed between those two words, the next publisher must either publish the
    batch's positions again or give a number its subscribers see missing: never number
    the next batch as if they had gone out."""
    first = Publisher(slab, options(), context=ctx)
    put(slab, 3, "a")
    first.step()
    assert first.index.position(0) == (2, 3)
    put(slab, 5, "b")  # positions 4..8: the batch the kill cuts
    words = first.index._ns
    first.index._ns = _KilledAfter(words, 1)
    with pytest.raises(KeyboardInterrupt):
        first.step()
    first.index._ns = words
    first.close()
    second = Publisher(slab, options(), context=ctx)
    try:
        spans = {k: second.index.span(0, k) for k in range(2, 5)}
        assert (4, 8) in spans.values()  # the five went out again after the restart
        k = next(k for k, span in spans.items() if span == (4, 8))
        assert k == 3 and spans[2] is None  # under a new number, after a hole at 2
    finally:
        second.close()
