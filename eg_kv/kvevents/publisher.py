"""The KV-events publisher: eg-kv's event log, as vLLM's ZMQ KV-events stream.

One publisher per server, a process of its own (``eg-kv serve --kv-events-endpoint``;
the supervisor starts it and starts it again if it dies). It follows the slab's event
log (:mod:`eg_kv.slab.events`) as any slow reader does, without the slab lock, so it never
slows a PUT or a GET: when it falls more than the log's length behind, it skips to the
newest entry and its subscribers see a hole in ``seq`` (and ask the replay socket).

Topics and ``seq``. Each namespace publishes on its own topic (:meth:`Topics.of`): a
tenant's subscriber sees its namespace's blocks and nothing of another's. A message
carries a batch: the events of one namespace a step found (at most :data:`BATCH_EVENTS`,
in order), and its ``seq`` is the log's base (:func:`seq_base`: when the log was created,
in ms, times 2**22) plus the batch's number in its topic (0, 1, 2...), numbered in the
batch index beside the log (:mod:`eg_kv.kvevents.batches`) before it is sent: continuous
across workers (one log), across restarts of the publisher (a new one publishes what the
last had not, under the next numbers) and over a warm restart (``--keep``). Batch 0 of a
topic is ``AllBlocksCleared``; a new log (``--fresh``, a new slab) starts above every seq
of the one before, and its ``AllBlocksCleared`` (or, for a consumer that missed it, the
jump in ``seq`` and the replay it asks for) tells consumers to forget what they held.
Batching is what keeps a subscriber from costing PUTs: with one event a message, a
subscriber held a 4 KiB PUT churn on 2 cores to 0.82 of its rate with none; with a batch
a namespace's step, 0.97 (``scripts/bench_kv_events.py``, docs/benchmarks.md).

Replay (``--kv-events-replay-endpoint``, a ROUTER socket, vLLM's protocol): a request is
``[start seq as 8 bytes big-endian]`` (the default namespace's topic) or ``[topic, start
seq]``; the answer is each batch from ``start`` on, as it was sent (``[topic, seq,
payload]``), then ``[b"", -1, b""]``. Batches the index or the log no longer holds (more
than :data:`~eg_kv.slab.events.HOPS_MAX` entries back, lapped, or a number burnt when the
publisher fell behind the log) are answered by a resync, one message at the last seq
sent live: ``AllBlocksCleared``, a ``BlockStored`` for every block of the namespace the
slab holds, the log's entries after that walk, then a ``BlockStored`` for every block the
disk tier holds: applied, with the live batches after it, they give the blocks held. A
requester that stops reading is dropped after
:data:`REPLAY_SEND_TIMEOUT_MS`, and one answer may take at most :data:`REPLAY_DEADLINE_S`
(a requester that reads slowly is dropped then: the live batches wait while a replay is
served). A dropped requester gets no end marker: it never takes part of an answer for all
of it, and asks again. Resyncs come at most once a :data:`RESYNC_INTERVAL_S`: requests in
between wait (at most :data:`RESYNC_WAITING` requesters) and are answered together by the
next walk of their namespace. However many ask, and however often, answers take at most
:data:`REPLAY_SHARE` of the publisher's time (the socket queues requests meanwhile, and
takes them from its requesters in turn).

Token ids and LoRA names (:mod:`eg_kv.engine`'s extras, which the slab does not keep):
the workers hand them over on the extras socket (``extras_endpoint``, a PULL socket in the
server's run directory: :mod:`eg_kv.server.extras`) as they store the block, and mark its
entry (:data:`~eg_kv.slab.events.E_EXTRAS`). A store whose entry is marked waits for them,
at most :data:`EXTRAS_WAIT_MS` a step (then it goes without, counted); the last
:data:`EXTRAS_KEPT` blocks' are held for replays and resyncs too.

Bounds: the PUB socket's high-water mark, sized from a byte budget
(:data:`PUB_QUEUED_MAX`; a slow subscriber loses messages, never slows the publisher), and
its heartbeats (a subscriber that vanished is dropped); one replay at a time, its
messages bounded by the log and the slot table, what requesters have not read by
:data:`REPLAY_QUEUED_MAX`; the extras held, by count (each at most 4 KiB of token ids).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import zmq
import zmq.backend

from ..engine import ENGINE_HASH_MAX, TOKENS_MAX, packed_tokens, read_extras_message
from ..errors import SlabError
from ..slab.events import (
    E_EXTRAS,
    EVENTS_NAMESPACES,
    HOPS_MAX,
    STORED,
    Event,
    SnapshotVoid,
    batches_name,
)
from ..slab.store import Slab
from .batches import RECORDS, BatchIndex
from .memory import anon_bytes, trim
from .wire import END_SEQ, BatchBuilder, Wire, seq_bytes

__all__ = ["Publisher", "PublisherOptions", "ReplayCut", "Topics"]

log = logging.getLogger("eg_kv.kvevents")

#: The publisher's counters (written to its counters file once a second; every one is
#: exported on ``/metrics``, eg_kv.server.metrics).
COUNTERS = ("published", "batches", "skipped", "burnt", "replays", "resyncs",
            "resyncs_put_off", "replays_dropped", "requests_refused", "extras_late",
            "extras_bad", "replay_ms")  # fmt: skip


class ReplayCut(Exception):
    """A replay answer was cut short (too slow, or its resync could not be made): its
    requester is dropped without the end marker, and asks again."""


class _AllGone(ReplayCut):
    """Every requester of an answer was dropped already (each counted as it went)."""


#: Entries read from the log per step (one step's work between looks at the replay socket).
STEP = 4096
#: The most events one message carries (a namespace's events of one step, in order).
BATCH_EVENTS = 256
#: Idle wait between looks at the log, in ms: a store reaches subscribers within it.
IDLE_MS = 5
#: How long a replay answer may wait for its requester to read, in ms.
REPLAY_SEND_TIMEOUT_MS = 1000
#: Messages of an answer the replay socket queues per requester (libzmq's default is
#: 1,000): one that does not read is dropped within REPLAY_SEND_TIMEOUT_MS of as many
#: (their bytes, all requesters together, are bounded by REPLAY_QUEUED_MAX). At 4, the
#: sends waited on each requester's reads, and answers overran REPLAY_SHARE.
REPLAY_HWM = 64
#: The bytes of replay answers libzmq may hold, all requesters together: what was sent
#: and not yet taken (a requester that never reads, or reads slowly, holds its part for
#: as long as it stays connected). Past it a request is refused (``replays_dropped``)
#: until they read or go. Each message counts :data:`MESSAGE_COST` more.
REPLAY_QUEUED_MAX = 256 << 20
#: Each requester's kernel send buffer (loopback's grows to 4 MiB by itself).
REPLAY_SNDBUF = 256 << 10
MESSAGE_COST = 1024
#: The longest one replay answer may take (seconds): the live batches wait meanwhile, and
#: a requester reading one message a second would otherwise hold them for hours.
REPLAY_DEADLINE_S = 3.0
#: The least time between two resyncs (each walks the slot table): requests in between
#: wait for the next walk of their namespace (ZMQ has no authentication: anyone who
#: reaches the socket may ask).
RESYNC_INTERVAL_S = 1.0
#: Requesters waiting for a resync; past it a request is dropped (it asks again).
RESYNC_WAITING = 64
#: The most of the publisher's time replays and resyncs may take, all requesters
#: together: after an answer that took T, the next waits until the live stream has had
#: T * (1 / REPLAY_SHARE - 1). Without it, requesters asking again and again held the
#: live stream to one step (STEP entries) per answer, and it fell behind the log.
REPLAY_SHARE = 0.5
#: The largest frame the sockets take in (a replay request's or a subscription's: a topic
#: or a seq); a larger one drops its connection. Per frame only: libzmq has no limit on a
#: message's frames, and takes a multipart message in whole before the publisher sees it.
MAX_MESSAGE = 16 * 1024
#: The most frames a replay request has (the requester's id, the delimiter, a topic, a
#: seq); a longer one is read to its end without being copied, and refused (counted).
REQUEST_FRAMES = 4
#: Requests the replay socket queues per requester, and subscription messages the PUB
#: socket does (libzmq's default is 1,000 each, of any number of frames).
REQUESTS_QUEUED = 4
#: Anonymous memory the publisher may gain before it hands freed heap back to the OS
#: (:func:`eg_kv.kvevents.memory.trim`, looked at once a second).
TRIM_AFTER = 64 << 20
#: The bytes the PUB socket may queue for a subscriber that stopped reading (libzmq
#: shares a message among the subscribers' queues: about this much per publisher). Its
#: high-water mark counts messages: this over the largest message. vLLM's 100,000 held
#: 4 GB of 40 KB batches for one router that hung.
PUB_QUEUED_MAX = 128 << 20
#: ZMTP heartbeats on the PUB socket (ms): a subscriber that answers none in the timeout
#: is dropped (its queue freed), as is one whose host vanished while idle.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 5_000, 15_000
#: How long sent data may go unacknowledged before the kernel drops the connection
#: (``TCP_USER_TIMEOUT``, ms): a subscriber whose host vanished mid-message.
TCP_MAXRT_MS = 30_000
#: How often the counters are written for /metrics, in seconds.
STATS_EVERY_S = 1.0
#: Blocks whose token ids and LoRA name the publisher holds (the newest stores').
EXTRAS_KEPT = 16_384
#: The longest one step waits for the extras of entries marked as having them (a worker
#: sends them before it stores the block: they are late only when its socket is, as while
#: it reconnects to a publisher that just started).
EXTRAS_WAIT_MS = 200
#: The socket's send without pyzmq's Python layer: 1.3 µs a frame against 6.8 for a
#: ``send_multipart`` of three (measured here), most of a published event's cost.
_send_frame = zmq.backend.Socket.send
_MORE = zmq.SNDMORE


@dataclasses.dataclass(frozen=True)
class PublisherOptions:
    """What a publisher needs (from :class:`eg_kv.config.Settings`' ``kv_events_*``)."""

    endpoint: str  #: the PUB socket's ``tcp://HOST:PORT`` or ``ipc://PATH``
    replay_endpoint: str = ""  #: the ROUTER socket's; "": no replay
    medium: str = "SHARED_STORAGE"
    locality: str = ""
    pool: str = "eg-kv"
    model: str = "default"
    form: str = "maps"  #: eg_kv.kvevents.wire.MAPS or ARRAYS
    #: messages the PUB socket queues per subscriber; 0: :data:`PUB_QUEUED_MAX` over the
    #: largest message (:func:`largest_message`)
    hwm: int = 0
    extras_endpoint: str = ""  #: the workers' extras socket (a PULL: bound); "": none
    #: where its counters are written, as JSON, about once a second (the workers' /metrics
    #: reads them); "": nowhere
    stats_path: str = ""


#: A log's seqs start at its creation time in ms shifted by this: 4 million batches a
#: millisecond between two logs before their seqs could meet. Not room until 2527, as
#: this said: a log created after 2039-09-07 15:47:35 UTC (2**41 ms) has seqs of 2**63 and
#: over, which a consumer reading them signed (an int64, eg-kv's own replay readers until
#: they took the end marker by its bytes) takes for negative; one created after
#: 2109-05-15 cannot start (8 bytes no longer hold its seq). Changing the base would
#: send a kept log's seqs backwards on upgrade: left for a release that marks it.
SEQ_SHIFT = 22


def largest_message(wire: Wire, extras: bool) -> int:
    """The bytes of the largest message ``wire`` can make: :data:`BATCH_EVENTS` stores of
    the longest names, with the longest token ids and LoRA name when ``extras``."""
    name = b"\xff" * ENGINE_HASH_MAX
    most = (packed_tokens([2**32 - 1] * TOKENS_MAX), "l" * 128) if extras else None
    event = wire.stored(name, name, 2**31 - 1, 2**63 - 1, most)
    return len(wire.batch([event] * BATCH_EVENTS))


def seq_base(created_ms: int) -> int:
    """The seq of position 0 of a log created at ``created_ms`` (Unix ms)."""
    return created_ms << SEQ_SHIFT


class Topics:
    """Namespace ids to topics and back: ``kv@pool:<pool>@<model>`` for the default
    namespace, ``kv@pool:<pool>/<namespace>@<model>`` for a tenant's (llm-d's form).

    ``<model>`` is the namespace's own when ``models()`` (namespace name -> model, from the
    tokens file) names one, else the server's ``--kv-events-model``."""

    def __init__(
        self, pool: str, model: str, name_of: Callable[[int], str | None],
        models: Callable[[], Mapping[str, str]] = dict,
    ) -> None:  # fmt: skip
        self.pool, self.model, self._name_of, self._models = pool, model, name_of, models
        self._known = models()
        self._topic: dict[int, bytes] = {}
        self._ns: dict[bytes, int] = {}

    def refresh(self) -> None:
        """Take up a new mapping of models (a tokens file reloaded): topics anew."""
        known = self._models()
        if known != self._known:
            self._known = known
            self._topic.clear()
            self._ns.clear()

    def of(self, ns: int) -> bytes | None:
        """Namespace ``ns``'s topic (None: no such namespace)."""
        topic = self._topic.get(ns)
        if topic is None:
            name = self._name_of(ns)
            if name is None:
                return None
            pool = f"{self.pool}/{name}" if name else self.pool
            model = self._known.get(name, self.model)
            topic = f"kv@pool:{pool}@{model}".encode()
            self._topic[ns], self._ns[topic] = topic, ns
        return topic

    def ns_of(self, topic: bytes) -> int | None:
        """The namespace of a topic this publisher has published on (None: none)."""
        return self._ns.get(topic)


class Publisher:
    """Follows ``slab``'s event log and publishes it (see the module docstring).

    Args:
        slab: an attached slab with an event log.
        options: the sockets, medium and names.
        context: the ZMQ context (None: the process's).
        models: the namespaces' own models (name -> model), asked again about once a
            second (:meth:`Topics.refresh`): the tokens file's ``model`` keys.
        disk_listing: with a disk tier, the blocks only it may hold, by namespace name, a
            page of ``[namespace, address, length, hash, parent, block size, LoRA id]`` at
            a time (:func:`eg_kv.disk.wire.listing_sync`): a resync names them too.

    Raises:
        ValueError: the slab has no event log. zmq.ZMQError: an endpoint cannot be bound.
    """

    def __init__(
        self, slab: Slab, options: PublisherOptions, context: Any = None,
        models: Callable[[], Mapping[str, str]] = dict,
        disk_listing: Callable[[str], Iterable[list[Any]]] | None = None,
    ) -> None:  # fmt: skip
        ring = slab.events
        if ring is None:
            raise ValueError("the KV-events publisher needs the event log (--events > 0)")
        self.slab, self.ring, self.options = slab, ring, options
        self.disk_listing = disk_listing
        self.wire = Wire(options.medium, options.locality or None, options.form)
        self.topics = Topics(options.pool, options.model, slab.namespace_name, models)
        ctx = context or zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        largest = largest_message(self.wire, bool(options.extras_endpoint))
        self.pub.setsockopt(zmq.SNDHWM, options.hwm or max(1, PUB_QUEUED_MAX // largest))
        self.pub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.pub.setsockopt(zmq.TCP_MAXRT, TCP_MAXRT_MS)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)  # subscriptions come in
        self.pub.setsockopt(zmq.RCVHWM, REQUESTS_QUEUED)
        self.pub.bind(options.endpoint)
        self.replay = None
        if options.replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.replay.setsockopt(zmq.SNDTIMEO, REPLAY_SEND_TIMEOUT_MS)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            self.replay.setsockopt(zmq.RCVHWM, REQUESTS_QUEUED)
            self.replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
            self.replay.setsockopt(zmq.SNDBUF, REPLAY_SNDBUF)  # the kernel's part, too
            # A payload by reference, however small, so that libzmq tells when it let
            # go of it (tracked).
            self.replay.copy_threshold = 0
            self.replay.bind(options.replay_endpoint)
        self.since = ring.head  # what came before is in the log, for replay
        self.base = seq_base(ring.created_ms)
        self.index = BatchIndex(batches_name(slab.name), ring.epoch, ring.created_ms)
        #: Each namespace's last log position published or pending (its mark).
        self._at: dict[int, int] = {}
        #: Each namespace's batch being filled this step: (first position, events).
        self._pending: dict[int, tuple[int, list[Any]]] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        #: (namespace id, address) -> (packed token ids, LoRA name), newest last.
        self.extras: OrderedDict[tuple[int, bytes], tuple[bytes, str]] = OrderedDict()
        self.extras_in = None
        if options.extras_endpoint:
            extras_in = ctx.socket(zmq.PULL)
            extras_in.setsockopt(zmq.LINGER, 0)
            try:
                extras_in.bind(options.extras_endpoint)
                self.extras_in = extras_in
            except zmq.ZMQError as e:  # e.g. a run directory too deep for a socket's path
                extras_in.close(linger=0)
                log.warning("KV events: blocks go without token ids or LoRA names: cannot "
                            "listen on %s: %s", options.extras_endpoint, e)  # fmt: skip
        self._resynced_at = -RESYNC_INTERVAL_S
        #: Requesters waiting for the next resync of their namespace: (ns, topic) ->
        #: their ROUTER ids, oldest first (at most RESYNC_WAITING in all).
        self._waiting: OrderedDict[tuple[int, bytes], list[bytes]] = OrderedDict()
        self._deadline = 0.0  # when the replay being answered must be done by
        self._replays_at = 0.0  # when the next replay may be answered (REPLAY_SHARE)
        self._anon_trimmed = anon_bytes()  # the anonymous memory at the last trim
        #: Replay messages libzmq may still hold: (its tracker, what it costs).
        self._held: deque[tuple[list[zmq.MessageTracker], int]] = deque()
        self._held_total = 0  # their costs (those let go leave at the next prune)
        self._follow_all()

    # ------------------------------------------------------------------ live

    def _follow_all(self) -> None:
        """Bring every namespace's topic level with the log (at start, and after the
        publisher fell behind it): positions not yet published go out now, or, gone from
        the log, leave a hole its subscribers replay (:meth:`_catch_up`). A namespace the
        index meets with entries in the log goes on after them (a resync reaches those);
        one with none starts with ``AllBlocksCleared`` (a new log: its consumers forget
        the last one's)."""
        ring, index = self.ring, self.index
        for ns in range(EVENTS_NAMESPACES):
            if self.slab.namespace_name(ns) is None:
                continue
            count = ring.ns_position(ns)[0]
            next_k, last = index.position(ns)
            self._at[ns] = last
            if not next_k and count:
                index.start_at(ns, count + 1, count)
                self._at[ns] = count
            elif not next_k:
                self._send_cleared(ns)
            elif last < count:
                self._catch_up(ns, count + 1)
            elif last > count:  # an index ahead of its log (damaged): a hole, a resync
                index.burn(ns, count)
                self._at[ns] = count
        self._flush()

    def step(self) -> int:
        """Publish what the log gained since the last step (at most :data:`STEP`
        entries), in batches of a namespace's events. Returns how many entries were
        looked at."""
        entries, nxt, gap = self.ring.read_whole(self.since, STEP)
        if gap:  # lapped: skip to the newest, and each namespace's topic finds its hole
            head = self.ring.head
            self.counters["skipped"] += max(0, head - self.since)
            log.warning("KV events: the publisher fell %d entries behind the log; "
                        "subscribers resync by replay", head - self.since)  # fmt: skip
            self.since = head
            self._follow_all()
            return 0
        # The hot loop: fields by position (WHOLE_ENTRY's), each event appended to its
        # namespace's batch, which goes out when full or at the end of the step.
        at, topics, pending = self._at, self.topics, self._pending
        stored, removed = self.wire.stored, self.wire.removed
        expect, waited_until = self.since, 0.0
        if self.extras_in is not None:
            self._take_extras()
        for (
            seq,
            _,
            _,
            ns,
            kind,
            _,
            alen,
            nseq,
            _,
            addr,
            lora,
            size,
            hlen,
            plen,
            flags,
            h,
            parent,
        ) in entries:
            expect += 1
            if seq != expect:  # lapped while copied (cannot be, the copy was checked)
                break
            if not nseq or topics.of(ns) is None:  # a damaged id: no topic
                continue
            mark = at.get(ns)
            if mark is None:
                mark = self._begin(ns)
            if nseq <= mark:  # published by a catch-up
                continue
            if nseq > mark + 1:  # missed (lapped, or a publisher before this one)
                mark = self._catch_up(ns, nseq)
            block = h[:hlen] if hlen else addr[:alen]
            if kind != STORED:
                event = removed(block)
            elif flags & E_EXTRAS:
                if not waited_until:
                    waited_until = time.monotonic() + EXTRAS_WAIT_MS / 1000
                extras = self._extras_of(ns, addr[:alen], waited_until)
                event = stored(block, parent[:plen], size, lora, extras)
            else:
                event = stored(block, parent[:plen], size, lora)
            batch = pending.get(ns)
            if batch is None:
                pending[ns] = batch = (nseq, [])
            batch[1].append(event)
            at[ns] = nseq
            if len(batch[1]) >= BATCH_EVENTS:
                self._flush(ns)
        self._flush()
        looked = nxt - self.since
        self.since = nxt
        return looked

    def _begin(self, ns: int) -> int:
        """A namespace first met in this publisher's life: where its index stands (one
        with nothing published begins with ``AllBlocksCleared``)."""
        next_k, last = self.index.position(ns)
        if not next_k:
            self._send_cleared(ns)
        self._at[ns] = last
        return last

    def _catch_up(self, ns: int, upto: int) -> int:
        """Append namespace ``ns``'s entries from its mark to before position ``upto``,
        read back from the log; gone from it, burn a number (after what is pending): its
        subscribers see the hole, replay, and are resynced. Returns the new mark."""
        mark = self._at[ns]
        events, _, gap = self.ring.read_ns(mark, min(upto - 1 - mark, HOPS_MAX), ns)
        if gap or len(events) != upto - 1 - mark:
            self._flush(ns)
            self.index.burn(ns, upto - 1)
            self.counters["burnt"] += 1
            self._at[ns] = upto - 1
            return upto - 1
        for ev in events:
            batch = self._pending.get(ns)
            if batch is None:
                self._pending[ns] = batch = (ev.seq, [])
            batch[1].append(self._event(ev))
            self._at[ns] = ev.seq
            if len(batch[1]) >= BATCH_EVENTS:
                self._flush(ns)
        return upto - 1

    def _flush(self, ns: int | None = None) -> None:
        """Send namespace ``ns``'s pending batch (None: every namespace's), numbered in
        the index first."""
        for key in self._pending if ns is None else (ns,):
            batch = self._pending.get(key)
            topic = self.topics.of(key)
            if batch is None or topic is None:
                continue
            first, events = batch
            k = self.index.record(key, first, first + len(events) - 1)
            _send_frame(self.pub, topic, _MORE)
            _send_frame(self.pub, (self.base + k).to_bytes(8, "big"), _MORE)
            _send_frame(self.pub, self.wire.batch(events), 0)
            self.counters["published"] += len(events)
            self.counters["batches"] += 1
        if ns is None:
            self._pending.clear()
        else:
            self._pending.pop(ns, None)

    def _take_extras(self) -> None:
        """Hold every block's extras the workers have sent (the oldest go past
        :data:`EXTRAS_KEPT`)."""
        sock, held = self.extras_in, self.extras
        assert sock is not None
        while True:
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                ns, address, tokens, lora_name = read_extras_message(msg)
            except ValueError:  # not a worker's (the socket is the server user's)
                self.counters["extras_bad"] += 1
                continue
            key = (ns, address)
            held[key] = (tokens, lora_name)
            held.move_to_end(key)
            if len(held) > EXTRAS_KEPT:
                held.popitem(last=False)

    def _extras_of(self, ns: int, address: bytes, until: float) -> tuple[bytes, str] | None:
        """A marked store's extras, waited for until ``until`` (monotonic s)."""
        key = (ns, address)
        found = self.extras.get(key)
        sock = self.extras_in
        while found is None and sock is not None:
            left = until - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                self.counters["extras_late"] += 1
                return None
            self._take_extras()
            found = self.extras.get(key)
        return found

    def _send_cleared(self, ns: int) -> None:
        """Batch 0 of a namespace new to the log: ``AllBlocksCleared``."""
        topic = self.topics.of(ns)
        if topic is not None:
            k = self.index.record(ns, 0, 0)
            payload = self.wire.batch([self.wire.cleared()])
            self.pub.send_multipart((topic, seq_bytes(self.base + k), payload))

    def run(self, stopped: Callable[[], bool]) -> None:
        """Publish until ``stopped()``; answers replay requests between steps."""
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        written = 0.0
        while not stopped():
            busy = self.step() >= STEP
            if self.replay is not None and time.monotonic() >= self._replays_at:
                if poller.poll(0 if busy else IDLE_MS):
                    self._timed(self.serve_replay)
                if self._waiting:
                    self._timed(self.serve_waiting)
            elif not busy:
                time.sleep(IDLE_MS / 1000)
            if time.monotonic() - written >= STATS_EVERY_S:
                written = time.monotonic()
                self.topics.refresh()
                # libzmq takes in subscriptions (and frees them) only when the socket is
                # used: while nothing is published, this is what uses it.
                self.pub.getsockopt(zmq.EVENTS)
                self._trim_if_grown()
                if self.options.stats_path:
                    self.write_stats()

    def _timed(self, serve: Callable[[], None]) -> None:
        """Answer replays with ``serve``, then leave the live stream its share of the
        time (:data:`REPLAY_SHARE`) before the next answer."""
        t0 = time.monotonic()
        serve()
        now = time.monotonic()
        self.counters["replay_ms"] += round((now - t0) * 1000)
        self._replays_at = max(self._replays_at, now + (now - t0) * (1 / REPLAY_SHARE - 1))

    def _trim_if_grown(self) -> None:
        """Hand freed heap back to the OS once the publisher grew :data:`TRIM_AFTER`
        (a huge multipart message libzmq took in, then freed in 16 KiB pieces)."""
        if anon_bytes() - self._anon_trimmed > TRIM_AFTER:
            trim()
            self._anon_trimmed = anon_bytes()

    def write_stats(self) -> None:
        """Write the counters to ``stats_path`` (a temporary file, then a rename: a reader
        never sees half of it). A failure is logged at debug: the next one tries again."""
        path = self.options.stats_path
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.counters, f)
            os.replace(tmp, path)
        except OSError as e:
            log.debug("KV events: cannot write %s: %s", path, e)

    def close(self) -> None:
        """Close the sockets (at once: nothing lingers)."""
        self.pub.close(linger=0)
        if self.extras_in is not None:
            self.extras_in.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.index.close()

    # ------------------------------------------------------------------ replay

    def serve_replay(self) -> None:
        """Answer one waiting replay request (none waiting: nothing)."""
        assert self.replay is not None
        frames = self._take_request()
        if frames is None:
            return
        if len(frames) < 3 or frames[1] != b"":
            return  # not a REQ/DEALER request: nothing to answer to
        client = frames[0]
        body = frames[2:]
        topic = self.topics.of(0) if len(body) == 1 else body[0]
        ns = None if topic is None else self.topics.ns_of(topic)
        if ns is None and len(body) == 2:
            ns = self._ns_by_topic(body[0])
        self.counters["replays"] += 1
        self._deadline = time.monotonic() + REPLAY_DEADLINE_S
        try:
            if ns is not None and topic is not None and len(body[-1]) == 8 and len(body) <= 2:
                # A seq from before this log (another log's): this one from its start.
                start = int.from_bytes(body[-1], "big") - self.base
                if not self._replay(client, ns, topic, max(start, 0)):
                    return  # it waits for the next resync (serve_waiting)
            self._send([client], (b"", END_SEQ, b""))
        except ReplayCut as e:  # gone, not reading, or too slow: dropped
            if not isinstance(e, _AllGone):
                self._dropped(e)

    def _take_request(self) -> list[bytes] | None:
        """One request off the replay socket (None: none waiting; [] refused: over
        :data:`REQUEST_FRAMES` frames, each past it read and let go uncopied, then the
        freed heap handed back: libzmq held the message whole already)."""
        sock = self.replay
        assert sock is not None
        try:
            frames = [sock.recv(zmq.NOBLOCK)]
        except zmq.Again:
            return None
        extra = extra_bytes = 0
        while sock.rcvmore:
            frame = sock.recv(copy=False)
            if len(frames) < REQUEST_FRAMES:
                frames.append(frame.bytes)
            else:
                extra, extra_bytes = extra + 1, extra_bytes + len(frame)
        if not extra:
            return frames
        self.counters["requests_refused"] += 1
        log.info("KV events: a replay request of %d frames was refused (at most %d)",
                 len(frames) + extra, REQUEST_FRAMES)  # fmt: skip
        if extra_bytes > TRIM_AFTER // 4:
            trim()
            self._anon_trimmed = anon_bytes()
        return []

    def serve_waiting(self) -> None:
        """Resync the requesters of the namespace that has waited longest, once the last
        resync is :data:`RESYNC_INTERVAL_S` past: one walk for them all, then the end
        marker to each that took the whole of it."""
        if time.monotonic() - self._resynced_at < RESYNC_INTERVAL_S or not self._waiting:
            return
        (ns, topic), clients = self._waiting.popitem(last=False)
        self._deadline = time.monotonic() + REPLAY_DEADLINE_S
        try:
            self._resync(clients, ns, topic)
            self._send(clients, (b"", END_SEQ, b""))  # one that fails leaves ``clients``
        except ReplayCut as e:
            for _ in clients:
                self._dropped(e)

    def _dropped(self, why: Exception) -> None:
        self.counters["replays_dropped"] += 1
        log.info("KV events: a replay requester was dropped: %s", why)

    def _send(self, clients: list[bytes], frames: tuple) -> None:
        """One message (``[topic, seq, payload]``) to each of ``clients``, its payload by
        reference (one copy for them all), tracked while libzmq holds it; each requester
        that is gone or not reading leaves ``clients`` (dropped), the others go on.

        Raises:
            ReplayCut: the answers libzmq holds already cost :data:`REPLAY_QUEUED_MAX`,
                or the answer ran past its deadline. _AllGone: every requester left.
        """
        cost = len(frames[-1]) + MESSAGE_COST * len(clients)
        if self._held_total + cost > REPLAY_QUEUED_MAX:
            self._prune_held()
            if self._held_total + cost > REPLAY_QUEUED_MAX:
                raise ReplayCut(f"answers not yet taken by their requesters hold "
                                f"{self._held_total >> 20} MiB, this one "
                                f"{cost >> 20} MiB (at most {REPLAY_QUEUED_MAX >> 20} "
                                "MiB)")  # fmt: skip
        sock = self.replay
        assert sock is not None
        trackers = []
        try:
            for client in list(clients):
                self._check_deadline()
                try:
                    for frame in (client, b"", *frames[:-1]):  # small: copied
                        sock.send(frame, _MORE)
                    trackers.append(sock.send(frames[-1], 0, copy=False, track=True))
                except zmq.ZMQError as e:
                    clients.remove(client)
                    self._dropped(e)
        finally:
            self._held.append((trackers, cost))
            self._held_total += cost
        if not clients:
            raise _AllGone("every requester was dropped")

    def _prune_held(self) -> None:
        """Forget the replay messages libzmq let go (sent, or their requester gone)."""
        held = self._held
        for _ in range(len(held)):
            entry = held.popleft()
            if all(tracker.done for tracker in entry[0]):
                self._held_total -= entry[1]
            else:
                held.append(entry)

    def _check_deadline(self) -> None:
        if time.monotonic() > self._deadline:
            raise ReplayCut(f"the answer took over {REPLAY_DEADLINE_S:g} s")

    def _event(self, ev: Any) -> Any:
        """A replayed entry as an event, with its extras while they are held."""
        return self.wire.event(ev, self.extras.get((ev.ns, bytes(ev.address))))

    def _ns_by_topic(self, topic: bytes) -> int | None:
        """A topic not yet seen: a namespace with no event since the publisher started."""
        for ns in range(EVENTS_NAMESPACES):
            if self.slab.namespace_name(ns) is not None and self.topics.of(ns) == topic:
                return ns
        return None

    def _replay(self, client: bytes, ns: int, topic: bytes, start: int) -> bool:
        """Batches ``start`` on of namespace ``ns``, as they were sent; a resync when
        they cannot all be sent again (:meth:`_recorded`). Returns False when the resync
        must wait (the requester is queued for :meth:`serve_waiting`).

        Raises:
            ReplayCut: the requester was dropped (its answer is not whole).
        """
        next_k = self.index.position(ns)[0]
        if start >= next_k:
            return True  # nothing yet at or after start
        batches = self._recorded(ns, start, next_k)
        clients = [client]
        if batches is None:
            if time.monotonic() - self._resynced_at < RESYNC_INTERVAL_S:
                self.counters["resyncs_put_off"] += 1
                waiting = sum(map(len, self._waiting.values()))
                if waiting >= RESYNC_WAITING:
                    raise ReplayCut(f"{waiting} requesters wait for a resync already")
                self._waiting.setdefault((ns, topic), []).append(client)
                return False
            self._resync(clients, ns, topic)
            return True
        for k, events in enumerate(batches, start):
            self._send(clients, (topic, seq_bytes(self.base + k), self.wire.batch(events)))
        return True

    def _recorded(self, ns: int, start: int, end: int) -> list[list[Any]] | None:
        """Batches ``start`` to ``end - 1`` of namespace ``ns`` as they were sent, every
        one checked before any is: None when one is not recorded (burnt, or gone from
        the index) or its events are gone from the log."""
        if end - start > RECORDS:
            return None
        spans = [self.index.span(ns, k) for k in range(start, end)]
        if None in spans:
            return None
        held = [span for span in spans if span and span[0]]
        events: list[Event] = []
        first = held[0][0] if held else 0
        if held:
            want = held[-1][1] - first + 1
            events, _, gap = self.ring.read_ns(first - 1, min(want, HOPS_MAX), ns)
            if gap or len(events) != want:
                return None
        return [[self._event(ev) for ev in events[span[0] - first : span[1] - first + 1]]
                if span and span[0] else [self.wire.cleared()]
                for span in spans]  # fmt: skip

    def _disk_blocks(self, ns: int) -> Iterator[list[Any]]:
        """The disk tier's blocks of namespace ``ns`` as ``BlockStored`` events, a listing
        page at a time (a block also in the slab comes twice: a set, not a count). Listed
        after the walk, so one the disk dropped meanwhile is named by neither, and any
        change after is in the live batches that follow the resync."""
        name = self.slab.namespace_name(ns)
        if self.disk_listing is None or name is None:
            return
        stored = self.wire.stored
        for page in self.disk_listing(name):
            out = []
            for _, address, _, h, parent, size, lora in page:
                raw = str(address).encode()
                out.append(stored(h or raw, parent, size, lora, self.extras.get((ns, raw))))
            yield out

    def _resync(self, clients: list[bytes], ns: int, topic: bytes) -> None:
        """The namespace's blocks from a walk of the slot table, then the log after it,
        in one message at the last batch number sent (the live batches after it apply on
        top), to each of ``clients`` (those that fail leave the list). One message, as
        vLLM's replay client applies a message whose seq it has seen once, and stops at
        the one before the live seq that showed its hole: every message of a resync under
        one seq, it applied the first (``AllBlocksCleared``) alone.

        Raises:
            ReplayCut: no walk held (three were met by a repair, or lapped by the log),
                the slot table stayed locked, or the message would cost more than
                :data:`REPLAY_QUEUED_MAX`: the requesters are dropped, never told an
                answer in part is whole.
        """
        self._resynced_at = time.monotonic()
        self.counters["resyncs"] += 1
        k = max(self.index.position(ns)[0] - 1, 0)
        for _ in range(3):  # a walk met by a repair or lapped by the log: again
            try:
                payload = self._resync_payload(ns)
            except SnapshotVoid:
                continue
            except SlabError as e:  # the lock stayed held (LockTimeout): not this time
                raise ReplayCut(f"the walk of the slot table failed: {e}") from None
            self._send(clients, (topic, seq_bytes(self.base + k), payload))
            return
        raise ReplayCut("three walks of the slot table were lapped or repaired")

    def _resync_payload(self, ns: int) -> bytearray:
        """``AllBlocksCleared``, the namespace's blocks from a walk of the slot table, the
        log's entries after the walk, then the disk tier's blocks: one message's payload.

        Raises:
            SnapshotVoid: the walk was lapped or met by a repair. SlabError: the slot
                table stayed locked. ReplayCut: past the deadline, or too large.
        """
        built = BatchBuilder(self.wire)
        built.add([self.wire.cleared()])
        for out in self._resync_parts(ns):
            for at in range(0, len(out), 1024):
                built.add(out[at : at + 1024])
                self._check_deadline()
                if len(built.body) > REPLAY_QUEUED_MAX:
                    raise ReplayCut(f"a resync of over {built.events} events is over "
                                    f"{REPLAY_QUEUED_MAX >> 20} MiB")  # fmt: skip
        return built.payload()

    def _resync_parts(self, ns: int) -> Iterator[list[Any]]:
        """A resync's events, a part of the walk (or a page of the disk's listing) at a
        time."""
        for part in self.slab.snapshot_stream(ns, timeout=5.0, engines=True):
            if part.kind == "blocks":
                yield [self.wire.stored(e.hash or bytes(raw), e.parent, e.block_size,
                                        e.lora_id, self.extras.get((ns, bytes(raw))))
                       for _, raw, _, e in part.blocks]  # fmt: skip
            elif part.kind == "events":
                yield [self._event(ev) for ev in part.events if ev.ns == ns and ev.nseq]
            else:  # the end: the blocks the disk tier holds, listed after the walk
                yield from self._disk_blocks(ns)
