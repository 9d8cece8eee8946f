"""Relaying eg-kv's event log on vLLM's KV-events stream (``BlockStored`` /
``BlockRemoved``, medium :data:`MEDIUM`), from the eg-kv connector's scheduler side.

vLLM names a block by its own block hash; eg-kv by an address derived one way from the
token chain and each KV shard's format (:mod:`eg_kv.vllm.addresses`). So the map back is
learned: every address this scheduler computes (its lookups, its saves) is remembered
with the vLLM block hash and the shard it stands for (:meth:`EventRelay.remember`, a
bounded LRU of :data:`MAX_MAPPED` addresses). A vLLM block is relayed as stored when
every shard's address of it is held (what a lookup needs to count it), and as removed
when that stops being true. Addresses it never computed (blocks stored by other engines
for prompts this one never saw) cannot be mapped back: they are counted
(``unmapped``) and not relayed; a block learned while held is relayed as stored then.
A mapping the LRU forgets is dropped quietly (its removal is not relayed).

The log is followed by one thread per static server of the connector's URL
(:class:`LogFollowers`: a snapshot, then long-polls, a snapshot again after a gap; DNS
members of a set are not followed). :meth:`EventRelay.take` hands vLLM's scheduler what
changed since the last step, in order, at most :data:`MAX_PENDING` (older ones dropped and
counted). :func:`vllm_events` turns that into vLLM's event objects; it is the only part
that imports vLLM.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

from ..client.events import Event, Pacer, Snapshot
from ..client.sync import ServerConnector
from ..errors import EgKvError

log = logging.getLogger("eg_kv.vllm.events")

#: The ``medium`` of the relayed events: eg-kv, a tier shared by every engine (what llm-d
#: scores as shared storage; it scored the old "EG_KV" 0).
MEDIUM = "SHARED_STORAGE"
#: Addresses remembered with their vLLM block hash (LRU).
MAX_MAPPED = 1 << 20
#: Changes waiting for the scheduler's next step.
MAX_PENDING = 65536
STORED, REMOVED = "stored", "removed"
#: A vLLM block hash as its events carry it (bytes, or an int: VLLM_KV_EVENTS_USE_INT_...).
BlockHash = Any


class EventRelay:
    """eg-kv's events in, vLLM block hashes stored and removed out (no vLLM needed).

    Thread-safe: lookups remember from their threads, followers apply from theirs, the
    scheduler takes from its own.

    Args:
        shards: KV shards per vLLM block (tensor x pipeline parallel ranks): a block is
            held when every shard's address is.
    """

    def __init__(
        self, shards: int, max_mapped: int = MAX_MAPPED, max_pending: int = MAX_PENDING
    ) -> None:
        self.shards, self.max_mapped = shards, max_mapped
        self._lock = threading.Lock()
        self._owner: collections.OrderedDict[str, BlockHash] = collections.OrderedDict()
        self._held: dict[str, set[str]] = {}  # source -> addresses it holds
        self._shards_held: dict[BlockHash, int] = {}
        self._pending: collections.deque[tuple[str, BlockHash]] = collections.deque(
            maxlen=max_pending
        )
        self.counters = {"stored": 0, "removed": 0, "unmapped": 0, "dropped": 0, "forgotten": 0}

    def remember(self, hashes: Sequence[BlockHash], addresses: Sequence[str]) -> None:
        """Map ``addresses`` back to ``hashes``: ``addresses`` holds every shard's address
        of each block in turn (:func:`eg_kv.vllm.addresses.lookup_addresses`' order)."""
        n = self.shards
        with self._lock:
            for k, address in enumerate(addresses[: len(hashes) * n]):
                owner = self._owner
                if address in owner:
                    owner.move_to_end(address)
                    continue
                owner[address] = hashes[k // n]
                if self._anywhere(address):
                    self._up(address)
                if len(owner) > self.max_mapped:
                    old, h = owner.popitem(last=False)
                    self.counters["forgotten"] += 1
                    if self._anywhere(old):  # forgotten quietly: its removal is not relayed
                        self._shards_held[h] = self._shards_held.get(h, 1) - 1
                        if self._shards_held[h] <= 0:
                            del self._shards_held[h]

    def apply(self, source: str, item: Snapshot | Event) -> None:
        """One item of ``source``'s log (a server's URL): a snapshot replaces what that
        server held, an event changes one address."""
        with self._lock:
            held = self._held.setdefault(source, set())
            if isinstance(item, Snapshot):
                # In the snapshot's order (not a set's, which follows the hash seed), so
                # what a resync relays is the same in every process.
                order = list(dict.fromkeys(b.hash for b in item.blocks))
                now = set(order)
                for address in sorted(held - now):
                    held.discard(address)
                    if not self._anywhere(address):
                        self._down(address)
                for address in (a for a in order if a not in held):
                    fresh = not self._anywhere(address)
                    held.add(address)
                    if fresh:
                        self._up(address)
                return
            if item.kind == STORED and item.hash not in held:
                fresh = not self._anywhere(item.hash)
                held.add(item.hash)
                if fresh:
                    self._up(item.hash)
            elif item.kind == REMOVED and item.hash in held:
                held.discard(item.hash)
                if not self._anywhere(item.hash):
                    self._down(item.hash)

    def take(self) -> list[tuple[str, list[BlockHash]]]:
        """What changed since the last call, in order, runs of one kind grouped:
        ``[("stored", [hash, ...]), ("removed", [...]), ...]``."""
        with self._lock:
            items, self._pending = (
                list(self._pending),
                collections.deque(maxlen=self._pending.maxlen),
            )
        out: list[tuple[str, list[BlockHash]]] = []
        for kind, h in items:
            if out and out[-1][0] == kind:
                out[-1][1].append(h)
            else:
                out.append((kind, [h]))
        return out

    def held_blocks(self) -> int:
        """vLLM blocks whose every shard is held now."""
        with self._lock:
            return sum(1 for c in self._shards_held.values() if c >= self.shards)

    # under the lock
    def _anywhere(self, address: str) -> bool:
        return any(address in held for held in self._held.values())

    def _up(self, address: str) -> None:
        h = self._owner.get(address)
        if h is None:
            self.counters["unmapped"] += 1
            return
        count = self._shards_held.get(h, 0) + 1
        self._shards_held[h] = count
        if count == self.shards:
            self._push(STORED, h)

    def _down(self, address: str) -> None:
        h = self._owner.get(address)
        if h is None:
            return
        count = self._shards_held.get(h, 0)
        if count == self.shards:
            self._push(REMOVED, h)
        if count <= 1:
            self._shards_held.pop(h, None)
        else:
            self._shards_held[h] = count - 1

    def _push(self, kind: str, h: BlockHash) -> None:
        pending = self._pending
        if pending.maxlen is not None and len(pending) == pending.maxlen:
            self.counters["dropped"] += 1
        pending.append((kind, h))
        self.counters[kind] += 1


class LogFollowers:
    """One thread per server following its log into an :class:`EventRelay`.

    Args:
        relay: where the items go.
        urls: the servers (their base URLs).
        client_kw: the connectors' settings (token, timeout_s, verify_tls...).
        wait: seconds each long-poll waits (and the most :meth:`close` waits per thread).
    """

    def __init__(
        self, relay: EventRelay, urls: Sequence[str], client_kw: dict[str, Any], wait: float = 2.0
    ) -> None:
        self.relay, self.wait = relay, wait
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._follow, args=(url, client_kw), name="eg-kv-events", daemon=True
            )
            for url in urls
        ]
        for t in self._threads:
            t.start()

    def _follow(self, url: str, client_kw: dict[str, Any]) -> None:
        # The follower paces itself (eg_kv.client.events.Pacer): whatever the server
        # answers, at most 20 requests a second and one snapshot per 5 s.
        pacer, stop = Pacer(), self._stop
        with ServerConnector(base_url=url, **client_kw) as client:
            since: int | None = None
            epoch = ""
            while not stop.is_set():
                try:
                    if since is None:
                        if stop.wait(pacer.turn(snapshot=True)):
                            break
                        snap = client.snapshot()
                        self.relay.apply(url, snap)
                        since, epoch = snap.seq, snap.epoch
                    if stop.wait(pacer.turn()):
                        break
                    batch = client.events(since, self.wait, epoch=epoch)
                    if batch.gap:
                        pacer.trouble()
                        since = None
                        continue
                    pacer.answered()
                    for ev in batch.events:
                        self.relay.apply(url, ev)
                    since = batch.next
                except EgKvError as e:  # down, restarting, or without a log: try later
                    log.debug("eg-kv events from %s: %s", url, e)
                    pacer.trouble()

    def close(self) -> None:
        """Stop following (each thread ends within about ``wait`` seconds)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.wait + 1.0)


def vllm_events(
    changes: Sequence[tuple[str, list[BlockHash]]], block_size: int, medium: str = MEDIUM
) -> list[Any]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` for :meth:`EventRelay.take`'s changes.

    A relayed block carries no token ids (the relay never saw them: ``token_ids`` is
    empty, as vLLM's own offloading placeholders are) and no parent hash.
    """
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out: list[Any] = []
    for kind, hashes in changes:
        if kind == STORED:
            out.append(
                BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=list(hashes), medium=medium))
    return out
