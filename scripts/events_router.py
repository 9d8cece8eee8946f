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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefixes", nargs="*", metavar="PREFIX", help="addresses, comma-separated")
    p.add_argument("--url", default=os.environ.get("EPISTEMIC_GRAPH_KVCACHE_URL",
                                                   "http://127.0.0.1:9130"))  # fmt: skip
    p.add_argument("--seconds", type=float, default=2.0, help="follow this long, then score")
    p.add_argument("--watch", action="store_true", help="rescore after each batch, for ever")
    p.add_argument("--verbose", action="store_true", help="print each event")
    args = p.parse_args(argv)
    prefixes = [[a for a in text.split(",") if a] for text in args.prefixes]
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
