"""A KV-events subscriber, as a router runs one: SUB to the publisher, REQ-style replay on
a DEALER when ``seq`` skips, and the set of block hashes it holds, rebuilt from the events.

``--decode vllm`` decodes with vLLM's own classes (``KVEventBatch``: run it with
.venv-vllm's Python); ``--decode llm-d`` decodes the positional form by hand, the way
llm-d's indexer does, reducing each bytes hash to its last 8 bytes as an int.

Commands on stdin, one per line: ``dump`` takes what was sent (and asks the replay socket
for anything after its last seq), then prints one JSON line: the hashes held (hex), the
last seq, and how many clears, replays and resyncs it went through, how many messages the
SUB delivered (``live``), the events of those it applied (``live_events``) and the holes
in that stream (a gap before its first message is a ``join_gaps``: joining late loses
nothing);
``quit`` ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import zmq


def decoder(kind: str):
    if kind == "vllm":
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)

        def events(payload: bytes):
            for ev in dec.decode(payload).events:
                if isinstance(ev, BlockStored):
                    yield "stored", [h.hex() for h in ev.block_hashes], ev.medium
                elif isinstance(ev, BlockRemoved):
                    yield "removed", [h.hex() for h in ev.block_hashes], ev.medium
                elif isinstance(ev, AllBlocksCleared):
                    yield "cleared", [], None

        return events
    raw = msgspec.msgpack.Decoder()

    def key(h) -> str:  # llm-d: a bytes hash is reduced to its last 8 bytes
        return str(int.from_bytes(h[-8:], "big")) if isinstance(h, bytes) else str(h)

    def events(payload: bytes):
        _ts, evs, _rank = raw.decode(payload)
        for ev in evs:
            if isinstance(ev, dict):  # tagged maps, which llm-d reads too (v0.9.0+)
                ev = [ev["type"], ev.get("block_hashes", []), *[None] * 4, ev.get("medium")]
                ev = ev if ev[0] == "BlockStored" else [ev[0], ev[1], ev[6]]
            tag = ev[0]
            if tag == "BlockStored":
                yield "stored", [key(h) for h in ev[1]], ev[6]
            elif tag == "BlockRemoved":
                yield "removed", [key(h) for h in ev[1]], ev[2]
            elif tag == "AllBlocksCleared":
                yield "cleared", [], None

    return events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("replay")
    ap.add_argument("topic")
    ap.add_argument("--decode", choices=["vllm", "llm-d"], default="vllm")
    args = ap.parse_args()
    events = decoder(args.decode)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    held: set[str] = set()
    state = {"last": -1, "cleared": 0, "replays": 0, "resyncs": 0, "holes": 0, "join_gaps": 0,
             "live": 0, "live_events": 0, "media": set()}  # fmt: skip

    def apply(payload: bytes) -> int:
        """Apply one batch; returns how many events it held."""
        count = 0
        for kind, hashes, medium in events(payload):
            count += 1
            if medium:
                state["media"].add(medium)
            if kind == "stored":
                held.update(hashes)
            elif kind == "removed":
                held.difference_update(hashes)
            else:
                held.clear()
                state["cleared"] += 1
        return count

    def replay(start: int) -> None:
        state["replays"] += 1
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(args.replay)
        dealer.send_multipart([b"", args.topic.encode(), start.to_bytes(8, "big")])
        try:
            while dealer.poll(10_000):
                _, _topic, seq_b, payload = dealer.recv_multipart()
                if not _topic and seq_b == b"\xff" * 8:  # the end marker (vLLM's -1)
                    return
                seq = int.from_bytes(seq_b, "big")  # unsigned: 2**63 and over from 2039
                if seq < start:
                    raise SystemExit(f"replay sent seq {seq} before {start}")
                if b"AllBlocksCleared" in payload:
                    state["resyncs"] += 1  # the log no longer held start (or a new log)
                apply(payload)
                state["last"] = max(state["last"], seq)
            raise SystemExit("replay: no answer in 10 s")
        finally:
            dealer.close()

    def take(msg: list[bytes]) -> None:
        _, seq_b, payload = msg
        seq = int.from_bytes(seq_b, "big")
        last = state["last"]
        if last >= 0 and seq > last + 1:  # missed some (or a new log began): replay
            # The SUB's first message may come after a gap that is no loss: what was
            # published between the first replay and the subscription reaching the publisher.
            state["holes" if state["live"] else "join_gaps"] += 1
            state["live"] += 1
            replay(last + 1)
        elif last < 0 or seq == last + 1:
            state["live"] += 1
            state["live_events"] += apply(payload)
            state["last"] = seq
        else:  # seq <= last: replayed already
            state["live"] += 1

    replay(0)  # what was published before this subscriber joined
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            if sock is sub:
                take(sub.recv_multipart())
            else:
                line = sys.stdin.readline().split()
                if not line or line[0] == "quit":
                    return
                # Everything sent so far (quiet for 0.2 s), then one "anything after my
                # last?" to the replay socket (a message sent while the SUB reconnected
                # is lost, and nothing may come after it to show the hole), then quiet.
                until = time.monotonic() + 20
                for asked in (False, True):
                    while time.monotonic() < until and sub.poll(200):
                        take(sub.recv_multipart())
                    if not asked and state["last"] >= 0:
                        replay(state["last"] + 1)
                out = {**state, "media": sorted(state["media"]), "held": sorted(held)}
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
