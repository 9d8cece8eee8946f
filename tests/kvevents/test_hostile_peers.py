"""The publisher's memory against peers that send huge multipart messages or never read
(ZMQ has no authentication): a publisher process of its own, its anonymous memory read
from /proc, real sockets on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zmq
from helpers.common import ROOT, free_port, unique_slab_name, wait_for

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20

#: A slab and a publisher running its loop until SIGTERM (as the server's process runs
#: it); prints "ready" once bound. argv: slab name, PUB port, replay port, stats path.
_PUBLISHER = """
import signal, sys
from eg_kv.kvevents.publisher import Publisher, PublisherOptions
from eg_kv.slab.store import Slab
name, pub_port, replay_port, stats = sys.argv[1:5]
slab = Slab.create(name, 4 << 20, 4096)
slab.setup_events(64)
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
def publisher_proc(tmp_path):
    """A publisher process: (its pid, PUB endpoint, replay endpoint, stats path)."""
    pub, replay = free_port(), free_port()
    stats = tmp_path / "kv-events.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER, unique_slab_name("hostile"), str(pub), str(replay),
         str(stats)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", stats
    finally:
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


def test_a_multipart_replay_request_is_refused_and_its_memory_given_back(publisher_proc):
    """One request of 2,500 frames of 16,000 B (each under the 16 KiB frame limit): the
    publisher copied all 40 MB into Python and kept the 80 MB for good, and answered it;
    now it reads the frames past a request's four uncopied, refuses it (counted), and
    hands the freed heap back."""
    pid, _pub, replay, stats = publisher_proc
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


def test_a_multipart_subscription_message_leaves_no_memory_behind(publisher_proc):
    """An XSUB sends the PUB socket one message of 5,000 frames (80 MB): libzmq took it
    in whole and freed it in 16 KiB pieces that the publisher kept for good; now the
    publisher hands freed heap back once it grew past TRIM_AFTER."""
    pid, pub, _replay, _stats = publisher_proc
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
