"""The publisher's replay socket against a requester that asks for resyncs over and over
(ZMQ has no authentication): one resync a second at most, the rest get the end marker."""

from __future__ import annotations

import os

import pytest
import zmq
from helpers.common import free_port, unique_slab_name

from eg_kv.engine import EngineName
from eg_kv.kvevents.publisher import Publisher, PublisherOptions
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


def test_resyncs_come_at_most_once_a_second():
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
        first, *rest = [ask_and_serve(ctx, publisher, replay) for _ in range(3)]
        # AllBlocksCleared, one message of every block held, both at the walk's seq; the end
        assert len(first) == 3 and first[0] == first[1] > 0 and first[-1] == -1
        assert rest == [[-1], [-1]]  # within the second: the end marker alone
        assert publisher.counters["resyncs"] == 1 and publisher.counters["resyncs_put_off"] == 2
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
