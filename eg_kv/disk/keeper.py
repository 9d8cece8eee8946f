"""The disk tier's keeper: one process per server that spills blocks and keeps the index.

It follows the slab's event log, as the KV-events publisher does (lock-free): a block
*stored* is queued for its spill, and a writer thread writes it straight from the slab's
pages (O_DIRECT; its tag checked after the write, as a GET's) into a record at the ring's
head. So
the spill is write-behind: a block is written once, shortly after its PUT, and the slab's
eviction of it later costs nothing and moves it to the disk tier, where it stays. A
block removed by a ``DELETE`` of its last reference leaves the disk too; an eviction does
not (that is the move). When the disk is slower than the PUTs, the queue (bounded)
fills and later blocks are not spilled (``spill_drops``); a block evicted before its turn
is a drop too. No PUT ever waits for the disk.

Once a block is on disk, its slot in the slab says so (:meth:`~eg_kv.slab.store.Slab.
mark_spilled`, a short critical section): its eviction then moves it, and logs no
removal. When the disk drops a record (its ring overwrites it, a quota, a failed check, a
``DELETE`` of its last reference) and the slab does not hold the block, the keeper logs
its removal (:meth:`~eg_kv.slab.store.Slab.disk_dropped`): the event log stays the record
of what the server holds, in either tier.

Workers ask the keeper where a block's record lies (:mod:`eg_kv.disk.wire`) and read it
themselves. The socket answers from the moment the keeper starts; the index fills as the
scan of the file (:mod:`eg_kv.disk.scan`) proceeds, and the writer starts once it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine import NO_ENGINE, EngineName
from ..slab.events import (
    R_DELETE,
    R_DISK,
    STORED,
    W_HASH,
    W_HLEN,
    W_LORA,
    W_PARENT,
    W_PLEN,
    W_SIZE,
)
from ..slab.layout import NS_COUNT
from ..slab.store import BlockGone, Slab
from . import files, wire
from . import layout as D
from .index import Entry, Key
from .scan import rebuild
from .store import DiskStore

log = logging.getLogger("eg_kv.disk")

#: A block to spill: namespace id, key, block id, length, engine name.
Spill = tuple[int, Key, int, int, EngineName]
#: Stored blocks waiting for their spill; past it, a block is not spilled (a drop).
SPILL_QUEUE = 4096
#: Entries of the event log read per step, and how long an idle follower sleeps (s).
STEP = 4096
IDLE_S = 0.002
#: An idle follower's sleep doubles up to this while the log stays quiet (a keeper polling
#: every 2 ms used 3% of a core on an idle server), and drops back at the next entry.
IDLE_MAX_S = 0.032
#: Listings of the index in progress (a snapshot each), and how long one may lie idle.
MAX_LISTINGS = 8
LISTING_IDLE_S = 60.0
#: Connections (workers) the keeper serves, and requests each may have in flight.
MAX_CONNECTIONS = 256
MAX_INFLIGHT = 64
#: Answers a connection may leave unread (bytes): past it, or when its answers do not
#: drain within ANSWER_DRAIN_S, the keeper drops it (a worker reads its answers at once;
#: a peer that asks without reading would grow the keeper's memory without bound).
MAX_UNREAD = 8 * 1024 * 1024
ANSWER_DRAIN_S = 5.0
#: A DELETE's answer waits for its record's header to be zeroed at most until this long
#: before its worker's deadline (a discard's, before ZEROED_WAIT_S: its worker waits
#: eg_kv.disk.tier.CALL_TIMEOUT_S): an answer past it is a 503 for a change applied.
ZEROED_MARGIN_S = 0.15
ZEROED_WAIT_S = 0.5
#: Promotions and adopting PUTs between their answer and ``promoted`` at once (each for
#: ``wire.COMMIT_S`` at most): past it, a promotion is declined (served, not published),
#: a PUT answered 503.
MAX_COMMITTING = 4096
#: An ADOPT is answered BUSY, with no mark, this long before its worker's deadline: an
#: answer that came too late for it would leave a mark nobody ends (for COMMIT_S).
ADOPT_MARGIN_S = 0.1
#: Reports handled as they are read (no answer, no task): see ``Keeper._count``.
_REPORTS = frozenset({wire.LOADED, wire.REFS, wire.PROMOTED})


class Keeper:
    """Spills ``slab``'s blocks into ``store`` and answers workers (module docstring).

    Raises:
        ValueError: the slab has no event log (the disk tier follows it).
    """

    def __init__(self, slab: Slab, store: DiskStore) -> None:
        ring = slab.events
        if ring is None:
            raise ValueError("the disk tier follows the event log: --events must not be 0")
        self.slab, self.ring, self.store = slab, ring, store
        self.socket = files.socket_path(store.path)  # ConfigError: a directory there
        self.since = ring.head
        self.spills: queue.Queue[tuple[int, Key, int, int, EngineName] | None] = queue.Queue(
            SPILL_QUEUE
        )
        self._names: dict[int, str | None] = {}
        self._ids: dict[str, int] = {}
        self._listings: dict[int, tuple[list[Entry], int, float]] = {}  # id: (rest, at, when)
        self._listing_ids = itertools.count(1)
        store.on_drop = self._dropped
        self._connections = 0
        self._writers: set[asyncio.StreamWriter] = set()  # the workers' connections
        #: Promotions and PUTs told their count and not yet committed: key -> (until,
        #: done, mark id); only the holder's ``promoted`` (its mark id) ends one.
        self._committing: dict[Key, tuple[float, asyncio.Event, int]] = {}
        self._mark_ids = itertools.count(1)

    # ------------------------------------------------------------------ spills

    def follow(self) -> int:
        """Queue the spills and deletes the log gained since the last call; returns the
        entries looked at."""
        entries, nxt, gap = self.ring.read_whole(self.since, STEP)
        counters = self.store.counters
        if gap:
            head = self.ring.head
            counters["spill_drops"] += max(0, head - self.since)
            log.warning("disk tier: fell %d events behind the slab; those blocks are not "
                        "spilled", head - self.since)  # fmt: skip
            self.since = head
            return 0
        deletes: list[tuple[Key, int]] = []  # (key, its block id)
        for e in entries:
            ns, kind, reason, alen, addr = e[3], e[4], e[5], e[6], e[9]
            name = self._name(ns)
            if name is None:
                continue
            key = (name, addr[:alen].decode("ascii", "replace"))
            if kind == STORED:
                engine = NO_ENGINE
                if e[W_HLEN]:
                    engine = EngineName(e[W_HASH][: e[W_HLEN]], e[W_PARENT][: e[W_PLEN]],
                                        e[W_SIZE], e[W_LORA])  # fmt: skip
                try:
                    self.spills.put_nowait((ns, key, e[1], e[2], engine))
                except queue.Full:
                    counters["spill_drops"] += 1
            elif reason == R_DELETE:
                deletes.append((key, e[1]))
        for gone, block in deletes:
            self.discard(gone, block)
        looked = nxt - self.since
        self.since = nxt
        return looked

    def _name(self, ns: int) -> str | None:
        name = self._names.get(ns)
        if name is None:
            name = self._names[ns] = self.slab.namespace_name(ns)
            if name is not None:
                self._ids[name] = ns
        return name

    def _ns_id(self, name: str) -> int | None:
        """The slab's id of namespace ``name`` (None: not bound in this slab)."""
        if name not in self._ids:
            for ns in range(NS_COUNT):
                if self._name(ns) == name:
                    break
        return self._ids.get(name)

    def _dropped(self, e: Entry, deleted: bool) -> None:
        """A record left the disk: if the slab does not hold its block either, the block
        has left the server, and the event log says so."""
        ns = self._ns_id(e.key[0])
        if ns is not None:
            self.slab.disk_dropped(e.key[1], ns, e.length, R_DELETE if deleted else R_DISK,
                                   e.engine)  # fmt: skip

    def discard(self, key: Key, block: int = 0) -> None:
        """The slab's last reference of ``key`` (its block ``block``; 0: unknown) went:
        its disk copy goes too, and a spill of that block written now is not indexed."""
        self.store.discard(key, block)

    def write_spills(self) -> None:
        """The writer thread: spill queued blocks until a None is queued."""
        self.store.ready.wait()
        store, slab, counters = self.store, self.slab, self.store.counters
        while True:
            item = self.spills.get()
            if item is None:
                return
            ns, key, block, length, engine = item
            try:
                found = slab.read_or_open(key[1], ns, use=False)  # not a client's GET
            except Exception:  # a damaged address cannot be one the log names: skip it
                found = None
            with store.lock:
                have = store.index.find(key)
            if found is None or (found[1].length if not isinstance(found[1], bytes)
                                 else len(found[1])) != length:  # fmt: skip
                # Gone before its turn: a drop, unless the disk has it (a promotion).
                counters["spill_skips" if have is not None else "spill_drops"] += 1
                continue
            checksum, reader = found
            if have is not None and have.checksum == checksum:
                counters["spill_skips"] += 1  # its record is there already (an adopted PUT)
                slab.mark_spilled(key[1], ns, block, have.seq)
                continue
            try:
                views = None if isinstance(reader, bytes) else reader.aligned_views(D.ALIGN)
                refs = max(1, slab.refs(key[1], ns))  # dedup PUTs before the spill count
                if views is None or isinstance(reader, bytes):  # small (a copy), or unaligned
                    done = store.append(key, length, checksum, _filler(reader), refs, engine,
                                        self._quota(ns), block=block)  # fmt: skip
                else:  # straight from the slab's pages, vouched for after the write
                    done = store.append(key, length, checksum, None, refs, engine,
                                        self._quota(ns), views, reader.still_there,
                                        block)  # fmt: skip
                if done is None:
                    counters["spill_drops"] += 1
                elif not (marked := slab.mark_spilled(key[1], ns, block, done.seq)):
                    # Evicted while written, and so logged as removed: the disk must not
                    # hold what the log says left (nor log its removal a second time).
                    store.undo(done)
                    counters["spill_drops"] += 1
                else:
                    with store.lock:  # the slab's count after the write, not the larger:
                        # a DELETE during the write lowered it, and its report found no
                        # record to tell (the block may have left the slab since)
                        done.refs = max(1, slab.refs(key[1], ns) or marked)
                    counters["spills"] += 1  # counted once the slab knows it is moved
            except BlockGone:
                counters["spill_drops"] += 1

    # ------------------------------------------------------------------ promotions

    def _promote(self, key: Key, seq: int) -> list[int]:
        """A worker read record ``seq`` of ``key`` into the slab, and publishes it on this
        answer: ``[references to publish it with, mark id]`` (``[0, 0]``: do not; the
        record went, or is being committed by another). Until it says ``promoted`` with
        the mark id (``wire.COMMIT_S`` at most), DELETEs of ``key`` wait, then find the
        block in the slab: the count told here stays exact, whatever DELETEs came before,
        during or after."""
        self._expire_marks()
        if key in self._committing:
            return [0, 0]
        with self.store.lock:
            e = self.store.index.find(key)
            if e is None or e.seq != seq:
                return [0, 0]
            refs = e.refs
        mark = self._mark(key)
        return [refs, mark] if mark else [0, 0]

    def _expire_marks(self) -> None:
        """Let go the marks past their end (oldest first: one deadline for all)."""
        now, marks = time.monotonic(), self._committing
        while marks:
            oldest, (until, done, _) = next(iter(marks.items()))
            if until > now:
                break
            del marks[oldest]
            done.set()

    def _mark(self, key: Key) -> int:
        """Mark ``key`` as being committed into the slab (a promotion's or a PUT's, told
        the copy's count): DELETEs, promotions and ADOPTs of it wait for ``promoted``
        with the mark id returned, ``wire.COMMIT_S`` at most. 0 when
        :data:`MAX_COMMITTING` are marked."""
        self._expire_marks()
        if len(self._committing) >= MAX_COMMITTING:
            return 0
        mark = next(self._mark_ids)
        self._committing[key] = (time.monotonic() + wire.COMMIT_S, asyncio.Event(), mark)
        return mark

    def _unmark(self, key: Key, mark: int) -> bool:
        """End mark ``mark`` of ``key`` (another's, a later one, stays); whether it was."""
        held = self._committing.get(key)
        if held is None or held[2] != mark:
            return False
        del self._committing[key]
        held[1].set()
        return True

    async def _settled(self, key: Key, deadline: float) -> None:
        """Wait while ``key`` is being committed into the slab (until ``deadline`` at
        most; a mark past its own end is let go: its worker never said)."""
        while True:
            self._expire_marks()
            mark = self._committing.get(key)
            wait = 0.0 if mark is None else min(mark[0], deadline) - time.monotonic()
            if mark is None or wait <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(mark[1].wait(), wait)

    async def _delete(self, key: Key, deadline: float) -> int | None:
        """A ``DELETE`` of ``key`` the slab did not hold when the worker looked: one
        reference of its disk copy goes, unless the slab holds the block now (a promotion
        or a PUT since: ``wire.IN_SLAB``, the worker deletes it there). Waits for a
        promotion being committed. None past ``deadline`` (the worker answered 503), and
        while the scan has not found the record yet (the worker answers 503: retry)."""
        await self._settled(key, deadline)
        if time.monotonic() > deadline:
            return None
        ns = self._ns_id(key[0])
        if ns is not None and self.slab.refs(key[1], ns):
            return wire.IN_SLAB
        there = self.store.delete(key)
        return None if there is None else int(there)  # None: the scan may find it yet

    def _quota(self, ns: int) -> int:
        return self.slab.namespace_quota(ns) if ns else 0

    # ------------------------------------------------------------------ answers

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one worker's connection until it closes."""
        if self._connections >= MAX_CONNECTIONS:
            writer.close()
            return
        self._connections += 1
        self._writers.add(writer)
        inflight = asyncio.Semaphore(MAX_INFLIGHT)
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    msg = await wire.read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                    return
                if self._count(msg):  # a report: counted here, no task for it
                    continue
                await inflight.acquire()
                task = asyncio.ensure_future(self._answer(msg, writer, inflight))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            self._connections -= 1
            self._writers.discard(writer)
            for task in tasks:
                task.cancel()
            writer.close()

    def _count(self, msg: Any) -> bool:
        """Handle ``msg`` at once if it is a report (of a promotion's read, a count, a
        commit): a task each cost more than the report, and a commit's ``promoted`` queued
        behind the ADOPTs that wait for it (64 a connection) held them all. True if it
        was one."""
        if not (isinstance(msg, list) and len(msg) > 1 and isinstance(msg[0], str)
                and msg[0] in _REPORTS and msg[1] == 0):  # fmt: skip
            return False
        store = self.store
        try:
            op, _, *args = msg
            if op == wire.LOADED:
                store.counters["promotions"] += 1
                store.counters["read_bytes"] += args[0]
                store.counters["read_seconds"] += args[1]
            elif op == wire.REFS:  # the disk's copy keeps the slab's count (at least 1)
                with store.lock:
                    e = store.index.find((args[0], args[1]))
                    if e is not None:
                        e.refs = max(1, int(args[2]))
            elif op == wire.PROMOTED:  # an adopting PUT's reference joins the copy's
                key = (args[0], args[1])
                if self._unmark(key, int(args[2])) and len(args) > 3 and int(args[3]):
                    with store.lock:
                        e = store.index.find(key)
                        if e is not None:
                            e.refs += int(args[3])
        except (TypeError, ValueError, IndexError):  # malformed: the worker's bug
            log.warning("disk tier: a report failed: %r", msg[:1])
        return True

    async def _answer(self, msg: Any, writer: asyncio.StreamWriter,
                      inflight: asyncio.Semaphore) -> None:  # fmt: skip
        try:
            op, rid, *args = msg
            result = await self._do(op, args)
            if rid and not writer.is_closing():
                if writer.transport.get_write_buffer_size() > MAX_UNREAD:
                    raise ConnectionError(f"over {MAX_UNREAD} bytes of answers left unread")
                writer.write(wire.frame([rid, result]))
                await asyncio.wait_for(writer.drain(), ANSWER_DRAIN_S)
        except (ConnectionError, TimeoutError) as e:  # not reading: dropped (said once)
            if not writer.transport.is_closing():
                why = str(e) or f"its answers did not drain in {ANSWER_DRAIN_S:g} s"
                log.warning("disk tier: a connection to the keeper was dropped: %s", why)
                writer.transport.abort()
        except Exception as e:  # a malformed request: the worker's bug, not the keeper's end
            log.warning("disk tier: a request failed: %s", e)
        finally:
            inflight.release()

    async def _do(self, op: str, args: list[Any]) -> Any:
        store, counters = self.store, self.store.counters
        if op == wire.FIND:
            ns, addresses, load = args
            out: list[Any] = []
            with store.lock:
                for address in addresses:
                    e = store.index.find((ns, address))
                    out.append(None if e is None else
                               [e.offset, e.length, e.seq, e.checksum, e.refs])  # fmt: skip
            if load:
                counters["disk_hits"] += sum(1 for x in out if x is not None)
            return [store.sb.created_ms, out]
        # Index changes run here, as finds do: each is a short hold of the index's lock
        # (the writes they cause, a zeroed header, go to the store's own thread). ADOPT
        # comes with every PUT that creates a block: a thread hop each cost the keeper,
        # whose writer thread shares its GIL, more than the change.
        if op == wire.DELETE:  # (past its deadline the worker answered 503: not applied)
            key, deadline = (args[0], args[1]), int(args[2]) / 1000
            answer = await self._delete(key, deadline)
            if answer == 1 and self.store.index.find(key) is None:  # its last: dropped
                await self._zeroed(deadline)
            return answer
        if op == wire.PROMOTE:
            return self._promote((args[0], args[1]), int(args[2]))
        if op == wire.DISCARD:  # (a block id bounds it: a copy of a later block stays)
            block = int(args[2]) if len(args) > 2 else 0
            dropped = store.discard((args[0], args[1]), block)
            if dropped:
                await self._zeroed(time.monotonic() + ZEROED_WAIT_S)
            return dropped
        if op == wire.ADOPT:
            return await self._adopt((args[0], args[1]), args[2], int(args[3]),
                                     int(args[4]) / 1000)  # fmt: skip
        if op == wire.STATS:
            stats = store.stats()
            stats["spill_queue"] = self.spills.qsize()
            stats["direct_io"] = store.direct
            stats["pid"] = os.getpid()
            return stats
        if op == wire.BAD:
            store.forget((args[0], args[1]), args[2])
            return None
        if op == wire.LIST:
            return self._list(args[0], int(args[1]))
        raise ValueError(f"unknown op {op!r}")

    async def _zeroed(self, until: float) -> None:
        """Wait until the headers of the records dropped so far are zeroed in the file,
        or ``until`` (monotonic; a margin before the worker stops waiting for the
        answer, which must reach it: a DELETE it answers 503 is sent again, and would end
        a second reference). The worker answers its client after: a keeper or server
        killed then must not find the record at its next scan (it did in 4 of 6 tries,
        the zeroing queued behind a spill's write)."""
        wait = until - ZEROED_MARGIN_S - time.monotonic()
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(self.store.zeroed()), wait)

    def _list(self, ns: str | None, listing: int) -> list[Any] | None:
        """A page of the blocks the disk holds (namespace ``ns``'s, or all): the first
        call takes a snapshot of the index (references, not copies), later ones page
        through it. Bounded: the oldest listing goes when :data:`MAX_LISTINGS` are open,
        and one left idle for :data:`LISTING_IDLE_S` is dropped."""
        now = time.monotonic()
        for lid in [k for k, (_, _, t) in self._listings.items() if now - t > LISTING_IDLE_S]:
            del self._listings[lid]
        if listing and listing not in self._listings:
            return None  # expired (idle, or past MAX_LISTINGS): its caller ends, never
            # starts over (a restart per call let more than MAX_LISTINGS go on for good)
        if not listing:
            with self.store.lock:  # one C-level copy under the lock, the filter outside
                rest = list(self.store.index.entries.values())
            if ns is not None:
                rest = [e for e in rest if e.key[0] == ns]
            while len(self._listings) >= MAX_LISTINGS:
                del self._listings[next(iter(self._listings))]
            listing = next(self._listing_ids)
            at = 0
        else:
            rest, at, _ = self._listings[listing]
        page = rest[at : at + wire.LIST_PAGE]
        at += len(page)
        done = at >= len(rest)
        if done:
            self._listings.pop(listing, None)
        else:
            self._listings[listing] = (rest, at, now)
        return [listing, [[*e.key, e.length, e.engine.hash, e.engine.parent,
                           e.engine.block_size, e.engine.lora_id] for e in page if e.live],
                done]  # fmt: skip

    async def _adopt(self, key: Key, checksum: int, length: int, deadline: float) -> list[Any]:
        """A PUT is about to create ``key`` in the slab (``length`` bytes, ``checksum``):
        what the disk's copy makes of it, as a resident block would (``[verdict,
        number, mark id, record]``, the verdicts of :mod:`eg_kv.disk.wire`; the copy's
        record: a block published from the same bytes says the disk holds it). A copy stands: the
        same bytes are a dedup hit (the PUT publishes the block with the copy's
        references and its own), the same length with other bytes too (the copy's bytes
        stay, with the PUT's reference), another length a conflict. A block the slab
        holds is RESIDENT (a dedup hit there, whatever the disk holds).

        Asked before the block is published, and answered after any promotion or other
        PUT of ``key`` being committed; a copy that stands is marked until the PUT says
        ``promoted`` with the mark id (and its reference), so that no DELETE, promotion
        or other PUT of ``key`` comes in between. (Asked after the publish, a DELETE on
        another worker in the round trip took the block's only reference: it went, with
        its copy and every holder's reference.) BUSY when the wait ran out, the marks
        are full, or the worker's ``deadline`` (monotonic) is near: no mark is left for
        a worker that gave up."""
        until = min(time.monotonic() + wire.ADOPT_WAIT_S, deadline - ADOPT_MARGIN_S)
        await self._settled(key, until)
        if key in self._committing or time.monotonic() > deadline - ADOPT_MARGIN_S:
            return [wire.BUSY, 0, 0, 0]
        ns = self._ns_id(key[0])
        if ns is not None and self.slab.refs(key[1], ns):
            return [wire.RESIDENT, 0, 0, 0]
        with self.store.lock:
            e = self.store.index.find(key)
            if e is None:
                return [wire.NEW, 0, 0, 0]
            if e.length != length:
                return [wire.CONFLICT, e.length, 0, 0]
            verdict = wire.SAME if e.checksum == checksum else wire.OTHER
            refs, seq = e.refs, e.seq
        mark = self._mark(key)
        return [verdict, refs, mark, seq] if mark else [wire.BUSY, 0, 0, 0]

    # ------------------------------------------------------------------ start

    def _scan(self) -> None:
        """The index rebuild, then the slab's marks checked against it; or the keeper's
        end: a scan that fails (a read error of a bad sector) left the keeper up and never
        ready, for good (nothing spilled, every DELETE of a disk-only block a 503, the
        scan's deletes kept without bound). Exiting, it is started again by the
        supervisor, and an error that stays shows as its restarts."""
        try:
            rebuild(self.store)
            self._unmark_lost()
        except BaseException as e:
            log.error("disk tier: the index rebuild failed (%s); the keeper exits", e)
            os._exit(1)

    def _unmark_lost(self) -> int:
        """Clear the slab's marks of copies the disk does not hold (a data file made anew
        under a kept slab: another capacity, a damaged or removed file): such a block's
        eviction was taken for a move, so it left both tiers with no removal logged, and
        a router kept it. Returns the marks cleared."""
        index, lock = self.store.index, self.store.lock
        cleared = 0
        for ns, address, length, record in self.slab.spilled_marks():
            name = self._name(ns)
            with lock:
                e = index.find((name, address)) if name is not None else None
                held = e is not None and e.live and e.seq == record
            if not held:
                self.slab.disk_dropped(address, ns, length)  # resident: the mark goes
                cleared += 1
        if cleared:
            log.warning("disk tier: %d blocks the slab says are on disk are not in %s; "
                        "they are the slab's alone again", cleared, self.store.path)  # fmt: skip
        return cleared

    # ------------------------------------------------------------------ process

    async def run(self, stopped: Callable[[], bool]) -> None:
        """Serve the socket, follow the log and spill until ``stopped()``."""
        path = self.socket
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket a keeper before this one left (socket_path checked)
        server = await asyncio.start_unix_server(self.serve, path)
        os.chmod(path, 0o600)
        threading.Thread(target=self._scan, name="disk-scan", daemon=True).start()
        writer = threading.Thread(target=self.write_spills, name="disk-writer", daemon=True)
        writer.start()
        try:
            idle = IDLE_S
            while not stopped():
                looked = self.follow()
                if looked < STEP:
                    idle = IDLE_S if looked else min(2 * idle, IDLE_MAX_S)
                    await asyncio.sleep(idle)
        finally:
            server.close()
            for w in list(self._writers):  # their handlers end now, not cancelled at exit
                w.close()
            await asyncio.sleep(0.01)
            with self.spills.mutex:
                self.spills.queue.clear()
            self.spills.put(None)
            self.store.ready.set()  # a writer still waiting for the scan ends too
            await asyncio.to_thread(writer.join, 5.0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _filler(reader: Any) -> Callable[[memoryview], None]:
    """What copies a block (bytes, or a slab reader that checks its tag) into a view."""
    if isinstance(reader, bytes):

        def fill(view: memoryview) -> None:
            view[:] = reader

        return fill

    def fill_from_slab(view: memoryview) -> None:
        reader.read_into(view)

    return fill_from_slab
