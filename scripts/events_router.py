#!/usr/bin/env python3
"""A router's view of one eg-kv server: follow its event log, keep which blocks it holds,
and score prompt prefixes by how many of their leading blocks it could load.

Each PREFIX argument is a prompt's block addresses in order, comma-separated (a router
derives them as the engines do: eg_kv.vllm.addresses for vLLM's connector). The score
of a prefix is the number of its leading addresses the server holds, exactly: the log
names every store and every removal (eviction, delete to zero, repair), so nothing is
guessed from time or TTLs. A router asks this of each instance's tier and sends the
request where the score is highest.

    python scripts/events_router.py --url http://127.0.0.1:9130 --seconds 2 a,b,c b,c

follows the log for 2 seconds (a snapshot first, then every event: ``--verbose`` prints
them), then prints ``score prefix`` lines, best first. ``--watch`` rescores after each
batch of events until interrupted. The token comes from EPISTEMIC_GRAPH_KVCACHE_TOKEN.

With ``--zmq NAME=ENDPOINT[,REPLAY]`` (repeatable) it is a router over vLLM's KV-events
streams instead: each source (a vLLM instance's ``--kv-events-config`` publisher, or an
eg-kv server's ``--kv-events-endpoint``) is followed with replay on a ``seq`` hole, and a
prompt (its engine block hashes in hex, comma-separated) scores on each source by its
leading blocks held there, weighted by the medium they were stored in (GPU 1, CPU 0.8,
SHARED_STORAGE and STORAGE 0.5: a shared tier's hit still costs a load)::

    python scripts/events_router.py --seconds 2 --zmq gpu-a=tcp://10.0.0.5:5557 \
        --zmq gpu-b=tcp://10.0.0.6:5557 --zmq eg-kv=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \
        <hash>,<hash>,<hash>

prints ``score hits/blocks source medium`` lines per prompt, best first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from eg_kv.client.events import Event, Snapshot
from eg_kv.client.sync import ServerConnector


class Router:
    """What one server holds, kept from its log."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.seq = 0
        self.resyncs = 0

    def apply(self, item: Snapshot | Event) -> None:
        if isinstance(item, Snapshot):
            self.held = {b.hash for b in item.blocks}
            self.resyncs += 1
        elif item.kind == "stored":
            self.held.add(item.hash)
        else:
            self.held.discard(item.hash)
        self.seq = item.seq

    def score(self, prefix: list[str]) -> int:
        """Leading blocks of ``prefix`` the server holds."""
        n = 0
        for address in prefix:
            if address not in self.held:
                break
            n += 1
        return n


#: What a hit is worth by the medium it is in (a load from a shared tier costs more than
#: the instance's own memory; an unknown medium scores 0, as llm-d does).
MEDIUM_WEIGHT = {"GPU": 1.0, "CPU": 0.8, "SHARED_STORAGE": 0.5, "STORAGE": 0.5}


class Source:
    """One KV-events stream: the blocks it holds (hex hash -> medium), kept from its
    messages, with replay when ``seq`` skips."""

    def __init__(self, ctx, name: str, endpoint: str, replay: str | None) -> None:
        import zmq

        self.name, self.replay_endpoint, self.ctx = name, replay, ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        #: Each topic's blocks (hex hash -> medium): a topic's AllBlocksCleared (its
        #: first batch, a resync) clears its own, never another namespace's.
        self.by_topic: dict[bytes, dict[str, str]] = {}
        self.last: dict[bytes, int] = {}  # topic -> last seq applied
        self.replays = 0

    @property
    def held(self) -> dict[str, str]:
        """The blocks of every topic this source streams."""
        out: dict[str, str] = {}
        for blocks in self.by_topic.values():
            out.update(blocks)
        return out

    def apply(self, topic: bytes, payload: bytes) -> None:
        import msgspec

        held = self.by_topic.setdefault(topic, {})
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for ev in events:
            if isinstance(ev, dict):  # tagged maps (vLLM 0.32+)
                kind, hashes, medium = ev.get("type"), ev.get("block_hashes", []), ev.get("medium")
            else:  # positional arrays: [tag, hashes, (parent, tokens, size, lora,) medium]
                kind, hashes = ev[0], ev[1] if len(ev) > 1 else []
                medium = ev[6] if kind == "BlockStored" else ev[2] if len(ev) > 2 else None
            keys = [h.hex() if isinstance(h, bytes) else str(h) for h in hashes]
            if kind == "BlockStored":
                held.update(dict.fromkeys(keys, medium or "GPU"))
            elif kind == "BlockRemoved":
                for k in keys:
                    held.pop(k, None)
            elif kind == "AllBlocksCleared":
                held.clear()

    def take(self, topic: bytes, seq: int, payload: bytes) -> None:
        last = self.last.get(topic)
        if last is not None and seq > last + 1 and self.replay_endpoint:
            self.replay(topic if len(self.last) > 1 else None, last + 1)
        elif last is None or seq > last:
            self.apply(topic, payload)
            self.last[topic] = seq

    def replay(self, topic: bytes | None, start: int) -> None:
        """Ask the replay socket for ``topic``'s messages from ``start`` (None: the
        publisher's default topic, vLLM's one-frame request, which eg-kv takes too)."""
        import zmq

        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        body = [start.to_bytes(8, "big")] if topic is None else [topic, start.to_bytes(8, "big")]
        dealer.send_multipart([b"", *body])
        try:
            while dealer.poll(5000):
                _, got_topic, seq_b, payload = dealer.recv_multipart()
                if not got_topic and seq_b == b"\xff" * 8:  # the end marker (vLLM's -1)
                    return
                seq = int.from_bytes(seq_b, "big")  # unsigned: 2**63 and over from 2039
                self.apply(got_topic, payload)
                self.last[got_topic] = max(self.last.get(got_topic, 0), seq)
        finally:
            dealer.close()

    def score(self, prompt: list[str]) -> tuple[float, int]:
        """(score, leading blocks held): each leading hit weighted by its medium."""
        n, total, held = 0, 0.0, self.held
        for h in prompt:
            medium = held.get(h)
            if medium is None:
                break
            n += 1
            total += MEDIUM_WEIGHT.get(medium, 0.0)
        return total, n


def route(specs: list[str], prompts: list[list[str]], seconds: float) -> None:
    """Follow each ``NAME=ENDPOINT[,REPLAY]`` source for ``seconds``, then score."""
    import zmq

    ctx = zmq.Context()
    sources = []
    for spec in specs:
        name, _, where = spec.partition("=")
        endpoint, _, replay = where.partition(",")
        sources.append(Source(ctx, name, endpoint, replay or None))
    poller = zmq.Poller()
    for src in sources:
        poller.register(src.sub, zmq.POLLIN)
    time.sleep(0.3)  # the subscriptions reach the publishers
    for src in sources:  # what they published before this router joined
        if src.replay_endpoint:
            src.replay(None, 0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for sock, _ in poller.poll(100):
            src = next(s for s in sources if s.sub is sock)
            topic, seq, payload = sock.recv_multipart()
            src.take(topic, int.from_bytes(seq, "big"), payload)
    for prompt in prompts:
        print(f"prompt {','.join(h[:8] for h in prompt)} ({len(prompt)} blocks):")
        rows = sorted(((*s.score(prompt), s) for s in sources), key=lambda r: -r[0])
        for score, n, s in rows:
            held = s.held
            media = sorted({held[h] for h in prompt[:n]}) or ["-"]
            print(f"  {score:.1f} {n}/{len(prompt)} {s.name} {'+'.join(media)}")
    sys.stdout.flush()
    for src in sources:
        src.sub.close(linger=0)
    ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefixes", nargs="*", metavar="PREFIX", help="addresses, comma-separated")
    p.add_argument("--url", default=os.environ.get("EPISTEMIC_GRAPH_KVCACHE_URL",
                                                   "http://127.0.0.1:9130"))  # fmt: skip
    p.add_argument("--seconds", type=float, default=2.0, help="follow this long, then score")
    p.add_argument("--watch", action="store_true", help="rescore after each batch, for ever")
    p.add_argument("--verbose", action="store_true", help="print each event")
    p.add_argument("--zmq", action="append", metavar="NAME=ENDPOINT[,REPLAY]",
                   help="route over these KV-events streams instead (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    prefixes = [[a for a in text.split(",") if a] for text in args.prefixes]
    if args.zmq:
        route(args.zmq, prefixes, args.seconds)
        return 0
    router = Router()
    with ServerConnector(base_url=args.url, timeout_s=10) as client:
        snap = client.snapshot()
        router.apply(snap)
        since, epoch = snap.seq, snap.epoch
        print(f"snapshot at seq {snap.seq}: {len(router.held)} blocks", flush=True)
        end = time.monotonic() + args.seconds
        while args.watch or time.monotonic() < end:
            wait = 1.0 if args.watch else max(0.0, min(1.0, end - time.monotonic()))
            batch = client.events(since, wait, epoch=epoch)
            if batch.gap:  # fell behind the log: start again from what is held
                snap = client.snapshot()
                router.apply(snap)
                since, epoch = snap.seq, snap.epoch
                print(f"gap: resynced at seq {snap.seq}", flush=True)
                continue
            for ev in batch.events:
                router.apply(ev)
                if args.verbose:
                    print(f"{ev.seq} {ev.kind} {ev.hash} ({ev.reason}, {ev.length} B)")
            since = batch.next
            if args.watch and batch.events:
                report(router, prefixes)
    report(router, prefixes)
    return 0


def report(router: Router, prefixes: list[list[str]]) -> None:
    print(f"seq {router.seq}: {len(router.held)} blocks held")
    for prefix in sorted(prefixes, key=router.score, reverse=True):
        print(f"{router.score(prefix)}/{len(prefix)} {','.join(prefix)}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
