"""A worker's way to the disk tier: the keeper's index over its socket, the file read here.

Every call is bounded: an answer that takes over :data:`CALL_TIMEOUT_S` (a keeper that is
stopped, or busy), more than :data:`MAX_PENDING` calls in flight, or a keeper that cannot
be reached (it is restarting) are all a miss, never a wait; a keeper that is down is
tried again at most every :data:`RETRY_S` (at once when its socket is made anew), and a
warning is logged once per outage. A keeper that let a call time out is taken for down:
calls are misses at once while a probe in the background asks it every :data:`RETRY_S`
until it answers, and while any call has gone unanswered for :data:`SLOW_S` (a keeper
answers in well under a millisecond) the others are misses at once too. So one request
waits for a stopped keeper, not every PUT and GET behind it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, NamedTuple

from ..engine import EngineName
from ..keyfilter import FilterReader
from . import files, wire
from . import layout as D
from .layout import Record
from .reader import read_block, read_into

log = logging.getLogger("eg_kv.disk")

CALL_TIMEOUT_S = 0.5
MAX_PENDING = 256
#: Discards a worker keeps for a keeper that did not answer (the oldest go first): each
#: is sent again once it answers, or a deleted block would come back from the disk.
MAX_UNDONE = 4096
#: Bytes of reports and requests a worker leaves unsent to a keeper that does not read
#: (SIGSTOPped): past it, reports are dropped.
MAX_UNSENT = 1024 * 1024
RETRY_S = 0.5
#: How long a discard (the slab's last reference of a spilled block went) waits for a
#: keeper that does not answer, before its DELETE is answered: a killed keeper is back
#: within about a second, and until it has the discard, another worker's GET could
#: find the deleted block on disk (only this worker's memory holds what is undone).
DISCARD_WAIT_S = 5.0
SLOW_S = 0.05
#: Reports a worker holds while it has no connection to the keeper (none made yet, or
#: the keeper restarting); sent first on the next one, the oldest dropped past this.
MAX_HELD_REPORTS = 4096


class Found(NamedTuple):
    """Where the keeper says a block's record lies."""

    offset: int
    length: int
    seq: int
    checksum: int
    refs: int


class Loaded(NamedTuple):
    """A block read back from the disk and verified."""

    data: bytes
    checksum: int
    refs: int
    engine: EngineName


class DiskTier:
    """One worker's client of the disk tier under ``path`` (the ``--disk`` directory)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = os.path.join(path, D.SOCKET_FILE)
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._asked: dict[int, float] = {}  # when each pending call was sent, oldest first
        self._down = False  # a call timed out: misses at once until the probe gets an answer
        self._probe: asyncio.Future[None] | None = None
        self._ids = itertools.count(1)
        self._connecting: asyncio.Lock | None = None
        self._retry_at = 0.0
        self._failed_at: tuple[int, int] | None = None  # the socket a connect last failed on
        self._warned = False
        self._fd = -1
        self._file = (0, b"")  # (file id: its creation ms, its MAC key)
        self._answers: asyncio.Future[None] | None = None
        self.unreachable = 0  #: calls answered as misses because the keeper was not there
        #: Discards the keeper did not answer: (namespace, address) -> the newest slab
        #: block id whose copy goes (a copy of a later block is another PUT's, and stays).
        self._undone: dict[tuple[str, str], int] = {}
        self._flushing: asyncio.Future[None] | None = None
        #: Reports made while there was no connection (frames), sent first on the next.
        self._held: collections.deque[bytes] = collections.deque(maxlen=MAX_HELD_REPORTS)
        self._connecting_soon: asyncio.Future[bool] | None = None
        #: The keys no record holds, as the keeper counts them: those need no call.
        self._filter = FilterReader(path)
        self.filtered = 0  #: calls (or addresses of a batch) answered from it

    def absent(self, namespace: str, address: str, count: bool = True) -> bool:
        """True when the keeper's filter rules out a copy of ``address`` (``count``:
        counted in :attr:`filtered`): the slab alone answers for it, as it would without
        the tier. False: the keeper must be asked."""
        if self._filter.absent(namespace, [address])[0]:
            self.filtered += count
            return True
        return False

    def recheck(self, namespace: str, address: str) -> Callable[[], bool]:
        """:meth:`absent` again, uncounted, for a put's critical section to ask before it
        creates the block (``Slab.put``'s and ``PutHandle``'s ``new_ok``): a copy spilled
        and its slab block evicted since the filter was read makes the put a 503."""
        return partial(self.absent, namespace, address, False)

    async def close(self) -> None:
        self._filter.close()
        for task in (self._probe, self._flushing, self._connecting_soon):
            if task is not None:
                task.cancel()
        if self._writer is not None:
            self._writer.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------------ calls

    async def find(
        self, namespace: str, addresses: list[str], load: bool = False
    ) -> list[Found | None]:
        """Where each of ``addresses`` lies on disk (None: not there, or no answer); the
        keeper is asked about those its filter does not rule out."""
        absent = self._filter.absent(namespace, addresses)
        ask = [a for a, no in zip(addresses, absent, strict=True) if not no]
        self.filtered += len(addresses) - len(ask)
        if not ask:
            return [None] * len(addresses)
        got = await self._call(wire.FIND, namespace, ask, load)
        if got is None:
            return [None] * len(addresses)
        file_id, places = got
        self._check_file(file_id)
        answers = iter(places)
        return [None if no or (p := next(answers)) is None else Found(*p)
                for no in absent]  # fmt: skip

    async def locate(self, namespace: str, address: str) -> Found | None:
        """Where the block a GET is about to load lies (None: not on disk); counted as a
        disk hit when found."""
        found = (await self.find(namespace, [address], load=True))[0]
        return found if found is not None and self._fd >= 0 else None

    async def read(self, namespace: str, address: str, found: Found) -> Loaded | None:
        """The block, read from its record into memory and verified; None: a miss."""
        t0 = time.perf_counter()
        got = await asyncio.to_thread(read_block, self._fd, self._file[1], found.offset,
                                      found.length, found.seq, namespace, address)  # fmt: skip
        if got is None:
            self.failed(namespace, address, found)
            return None
        self._report(wire.LOADED, found.length, time.perf_counter() - t0)
        data, rec = got
        return Loaded(data, rec.checksum, found.refs, rec.engine)

    async def read_into(
        self, namespace: str, address: str, found: Found, views: list[memoryview],
        digest: Callable[[], int],
    ) -> tuple[Record, int] | None:  # fmt: skip
        """Read the block straight into ``views`` (a promotion's reserved slab pages) and
        return its header, which names this record, with ``digest()`` of what was read;
        None: a miss (reported). ``digest`` runs in the reading thread too (the block's
        checksum: off the event loop), and comparing it is the caller's. The read is not
        abandoned halfway: a cancelled caller waits for it, so the pages are never freed
        under it."""

        def read() -> tuple[Record, int] | None:
            rec = read_into(self._fd, self._file[1], found.offset, found.length, found.seq,
                            namespace, address, views)  # fmt: skip
            return None if rec is None else (rec, digest())

        t0 = time.perf_counter()
        task = asyncio.ensure_future(asyncio.to_thread(read))
        try:
            got = await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise
        if got is None:
            self.failed(namespace, address, found)
            return None
        self._report(wire.LOADED, found.length, time.perf_counter() - t0)
        return got

    def count_refs(self, namespace: str, address: str, refs: int) -> None:
        """A dedup PUT or a DELETE that left references changed a resident block's count
        to ``refs``: its disk copy, if any, keeps the same (a report: nothing waits for
        it; the count itself, not the change, so that reports and the spill's own count
        agree in whatever order they arrive)."""
        if refs > 0:
            self._report(wire.REFS, namespace, address, refs)

    def failed(self, namespace: str, address: str, found: Found) -> None:
        """A record failed its checks: the keeper drops it."""
        log.warning("disk tier: the record of %s failed its checks; dropped", address)
        self._report(wire.BAD, namespace, address, found.seq)

    async def delete(self, namespace: str, address: str) -> int | None:
        """Release one reference of a block only the disk holds: 1 if it was there, 0 if
        not, ``wire.IN_SLAB`` if the slab holds it now (delete it there); None: the keeper
        did not answer."""
        # The keeper ignores it after this worker gives up on it (monotonic ms, one clock
        # for the host): a stopped keeper that wakes must not apply a DELETE answered 503
        # here, or the client's retry would end a second reference.
        if not self._down and self.absent(namespace, address):
            # (Only while the keeper answers: one killed with records' headers still to
            # zero leaves them uncounted, and its successor's scan brings them back; the
            # DELETE is a 503 to retry then, as before.)
            return 0
        deadline = int((time.monotonic() + CALL_TIMEOUT_S) * 1000)
        got = await self._call(wire.DELETE, namespace, address, deadline)
        return None if got is None else int(got)

    async def promote(self, namespace: str, address: str, seq: int) -> tuple[int, int]:
        """Record ``seq`` of ``address`` was read into the slab: the references to publish
        it with, now, and the keeper's mark (``(0, 0)``: publish nothing: the record went,
        another is committing it, or the keeper did not answer in time). With a mark,
        publish at once (no await between), then call :meth:`promoted`: DELETEs of the
        block wait for it meanwhile (``wire.COMMIT_S`` at most)."""
        t0 = time.monotonic()
        got = await self._call(wire.PROMOTE, namespace, address, seq)
        if not isinstance(got, list) or len(got) != 2 or not got[1]:
            return 0, 0
        if self._too_late(t0, namespace, address, int(got[1])):
            return 0, 0
        return int(got[0]), int(got[1])

    def _too_late(self, t0: float, namespace: str, address: str, mark: int) -> bool:
        """Whether an answer asked at ``t0`` came too late to act on (over half of
        ``wire.COMMIT_S``: the keeper's mark may be over); its mark is then let go."""
        if time.monotonic() - t0 <= wire.COMMIT_S / 2:
            return False
        self.promoted(namespace, address, mark)
        return True

    def promoted(self, namespace: str, address: str, mark: int, refs: int = 0) -> None:
        """The promotion :meth:`promote` (or the PUT :meth:`adopt`) that holds ``mark`` is
        published, or not: DELETEs go on. ``refs``: the PUT's references, which join the
        copy's. Sent even while the keeper is taken for down (its mark would hold the
        block's DELETEs for ``wire.COMMIT_S``, and the copy would miss the reference)."""
        self._report(wire.PROMOTED, namespace, address, mark, refs, must=True)

    async def discard(
        self, namespace: str, address: str, block: int = 0, wait: bool = True
    ) -> bool:
        """The slab's last reference of ``address`` (slab block ``block``; 0: unknown)
        went: drop the disk's copy too, waiting :data:`DISCARD_WAIT_S` at most for a
        keeper that does not answer (``wait``: the block was spilled; one never spilled
        has no copy to wait for). Past that, it gets it again once it does
        (:meth:`_send_undone`): a new keeper follows the event log from its head, and
        would never learn of the ``DELETE``."""
        got = await self._call(wire.DISCARD, namespace, address, block)
        until = time.monotonic() + (DISCARD_WAIT_S if wait else 0.0)
        while got is None and time.monotonic() < until:  # a new keeper, or this one back
            await asyncio.sleep(RETRY_S)
            got = await self._call(wire.DISCARD, namespace, address, block, probe=True)
        if got is None:
            key = (namespace, address)
            self._undone[key] = max(block, self._undone.pop(key, 0))  # newest last
            if len(self._undone) > MAX_UNDONE:
                del self._undone[next(iter(self._undone))]
                log.warning("disk tier: over %d discards wait for the keeper; the oldest "
                            "is forgotten (its block may come back from the disk)",
                            MAX_UNDONE)  # fmt: skip
        return bool(got)

    async def _send_undone(self) -> None:
        """Send the discards the keeper did not answer, while it answers."""
        while self._undone:
            key, block = next(iter(self._undone.items()))
            if await self._call(wire.DISCARD, key[0], key[1], block) is None:
                return
            if self._undone.get(key) == block:
                del self._undone[key]

    def _resend_undone(self) -> None:
        if self._undone and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.ensure_future(self._send_undone())

    async def adopt(
        self, namespace: str, address: str, checksum: int, length: int
    ) -> tuple[str, int, int, int]:
        """A PUT is about to create ``address`` (``length`` bytes, ``checksum``) in the
        slab: the disk's verdict on its copy (:data:`eg_kv.disk.wire.NEW` ... ``BUSY``),
        its number, the keeper's mark and the copy's record (see the keeper's
        ``_adopt``). After SAME or
        OTHER, decide at once (no await between), then call :meth:`promoted` with the
        mark. NEW when the keeper did not answer (down, stopped, or slow: the slab goes
        on alone, as its GETs and DELETEs do; docs/disk.md says what that costs); BUSY
        when it answered too late to decide."""
        t0 = time.monotonic()
        deadline = int((t0 + CALL_TIMEOUT_S) * 1000)
        got = await self._call(wire.ADOPT, namespace, address, checksum, length, deadline)
        if not isinstance(got, list) or len(got) != 4:
            return wire.NEW, 0, 0, 0
        verdict, number, mark, record = str(got[0]), int(got[1]), int(got[2]), int(got[3])
        if mark and self._too_late(t0, namespace, address, mark):
            return wire.BUSY, 0, 0, 0
        return verdict, number, mark, record

    async def listing(self, namespace: str | None) -> AsyncIterator[list[list[Any]]]:
        """The blocks the disk holds (``namespace``'s, or all), a page at a time:
        ``[namespace, address, length, engine hash, parent, block size, LoRA id]``
        each. Ends early (having said less) when the
        keeper does not answer."""
        lid = 0
        while True:
            got = await self._call(wire.LIST, namespace, lid)
            if got is None:
                return
            lid, page, done = got
            if page:
                yield page
            if done:
                return

    async def stats(self) -> dict[str, Any] | None:
        """The keeper's counters (None: it did not answer)."""
        got = await self._call(wire.STATS)
        if got is not None:
            got["unreachable"], got["filtered"] = self.unreachable, self.filtered
        return got

    # ------------------------------------------------------------------ plumbing

    def _check_file(self, file_id: int) -> None:
        """(Re)open the data file when the keeper names another one than ours."""
        if file_id == self._file[0] and self._fd >= 0:
            return
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            fd, _ = files.open_data(self.path)
        except OSError:
            return
        sb = files.read_super(fd)
        if sb is None or sb.created_ms != file_id:
            os.close(fd)
            return
        self._fd, self._file = fd, (sb.created_ms, sb.key)

    def _report(self, *msg: Any, must: bool = False) -> None:
        """Send a report (no answer), unless the keeper is down or not reading: then it
        is dropped (counted as unreachable), never queued without bound. Made while
        there is no connection (this worker's first call to the keeper is yet to come,
        or the keeper is restarting), it is held (:data:`MAX_HELD_REPORTS`) and sent
        first on the connection made for it: a dedup PUT's count was lost so, and the
        copy's holders' last DELETE was a 404."""
        writer, frame = self._writer, wire.frame([msg[0], 0, *msg[1:]])
        if writer is None or writer.is_closing():
            if len(self._held) == self._held.maxlen:
                self.unreachable += 1  # the oldest goes
            self._held.append(frame)
            if self._connecting_soon is None or self._connecting_soon.done():
                self._connecting_soon = asyncio.ensure_future(self._connected())
            return
        if (self._down and not must) or writer.transport.get_write_buffer_size() > MAX_UNSENT:
            self.unreachable += 1
            return
        writer.write(frame)

    async def _call(self, op: str, *args: Any, probe: bool = False) -> Any:
        if (not probe and (self._down or self._stalled())) or len(
            self._pending
        ) >= MAX_PENDING or not await self._connected():  # fmt: skip
            self.unreachable += 1
            return None
        assert self._writer is not None
        rid = next(self._ids)
        fut = self._pending[rid] = asyncio.get_running_loop().create_future()
        self._asked[rid] = time.monotonic()
        try:
            self._writer.write(wire.frame([op, rid, *args]))
            return await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        except (TimeoutError, ConnectionError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            self.unreachable += 1
            if isinstance(e, TimeoutError) and not self._down:
                self._down = True
                log.warning("disk tier: the keeper did not answer in %.1f s; disk hits are "
                            "misses until it does", CALL_TIMEOUT_S)  # fmt: skip
                self._probe = asyncio.ensure_future(self._probe_until_up())
            return None
        finally:
            self._pending.pop(rid, None)
            self._asked.pop(rid, None)

    async def _probe_until_up(self) -> None:
        while self._down:
            await asyncio.sleep(RETRY_S)
            if await self._call(wire.STATS, probe=True) is not None:
                self._down = False
                log.warning("disk tier: the keeper answers again")
                self._resend_undone()

    def _stalled(self) -> bool:
        """Whether the oldest call in flight has waited over :data:`SLOW_S`."""
        for sent in self._asked.values():  # insertion order: the oldest first
            return time.monotonic() - sent > SLOW_S
        return False

    async def _connected(self) -> bool:
        if self._writer is not None and not self._writer.is_closing():
            return True
        if time.monotonic() < self._retry_at and self._sock_id() == self._failed_at:
            return False  # the same socket refused us a moment ago (a new keeper's: try)
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return True
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self._sock), CALL_TIMEOUT_S
                )
            except (OSError, TimeoutError) as e:
                self._retry_at = time.monotonic() + RETRY_S
                self._failed_at = self._sock_id()
                if not self._warned:
                    self._warned = True
                    log.warning("disk tier: the keeper is not reachable (%s); disk hits are "
                                "misses until it is", e)  # fmt: skip
                return False
            self._warned = False
            self._writer = writer
            while self._held:  # before any call that comes after them
                writer.write(self._held.popleft())
            self._answers = asyncio.ensure_future(self._read_answers(reader, writer))
            self._resend_undone()  # a new keeper (or the same, back)
            return True

    def _sock_id(self) -> tuple[int, int] | None:
        """The keeper's socket file as (inode, mtime): a keeper makes it anew at start."""
        try:
            st = os.stat(self._sock)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    async def _read_answers(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                rid, result = await wire.read_frame(reader)
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(result)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError):
            pass
        finally:
            writer.close()
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionResetError("the keeper went away"))
