"""``eg-kv check --deep``: every block's bytes against its checksum, on a live slab.

The structural check (:mod:`eg_kv.slab.check`) proves the slab's bookkeeping; this proves
its contents: each published block is hashed (XXH3-64, :mod:`eg_kv.checksum`) and compared
with the checksum its writer gave it. A block changed at rest (a process with the server's
uid writing to ``/dev/shm``, a bug in a repair, a bit flip) fails, by address, and
``--repair`` frees it (a removal with reason ``repair`` in the event log, counted as an
eviction), so no client is ever handed it again. A block whose page chain is broken is
not hashed (the structural check names it), and ``eg-kv check`` frees nothing when the
structural check found a problem: a block sharing its pages with another would free that
block's pages too.

The walk hashes under the slab lock in slices of about :data:`CONTENT_SLICE_S` (the
readers' copies need no lock; writers wait a slice at most), hashing at ~10 GB/s: 2 GiB
of blocks takes about 0.2 s of lock time in all. A block stored, deleted or moved while the
walk runs may be skipped; one that fails is reported once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from ..checksum import Running
from . import layout as L
from .events import R_REPAIR
from .layout import F_ALEN, F_FIRST, F_LENGTH, F_NPAGES, F_NS, F_STATE
from .lock import no_job_stops

if TYPE_CHECKING:
    from .store import Slab

#: The longest one hold of the lock lasts (checked after each block; a 14 MiB block takes
#: about 1 ms to hash): the same bound as the structural check's slices.
CONTENT_SLICE_S = 0.005


@dataclasses.dataclass(frozen=True)
class BadBlock:
    """A block whose bytes do not match its checksum."""

    namespace: str  #: the namespace's name ("" for the default one)
    address: str
    length: int
    stored: int  #: the checksum its writer gave it
    found: int  #: the checksum of its bytes now
    freed: bool  #: ``--repair`` freed it


@dataclasses.dataclass
class ContentReport:
    """What :func:`verify_contents` found."""

    checked: int = 0  #: blocks hashed
    checked_bytes: int = 0
    bad: list[BadBlock] = dataclasses.field(default_factory=list)
    slices: int = 0  #: holds of the lock
    longest_hold_s: float = 0.0


def verify_contents(
    slab: Slab, repair: bool = False, timeout: float | None = None
) -> ContentReport:
    """Hash every published block and compare it with its checksum.

    Args:
        repair: free each block that fails (it is never served again).
        timeout: wait at most this long for the lock at each slice.

    Returns:
        A :class:`ContentReport`; failures are also counted in ``checksum_failures``.

    Raises:
        LockTimeout: a slice waited more than ``timeout`` for the lock.
    """
    report = ContentReport()
    i, nslots = 0, slab.geometry.nslots
    while i < nslots:
        start = time.monotonic()
        with no_job_stops(), slab._locked(timeout, write=repair):
            while i < nslots and time.monotonic() - start < CONTENT_SLICE_S:
                i = _verify_slot(slab, i, repair, report)
        report.slices += 1
        report.longest_hold_s = max(report.longest_hold_s, time.monotonic() - start)
    return report


def _verify_slot(slab: Slab, i: int, repair: bool, report: ContentReport) -> int:
    """Hash slot ``i``'s block (under the lock); return the next slot to look at."""
    s = slab._read_slot(i)
    if s[F_STATE] != L.SLOT_READY:
        return i + 1
    pages = slab._chain(s[F_FIRST], s[F_NPAGES])
    if isinstance(pages, str):  # a broken chain: the structural check names it
        return i + 1
    off = slab._slot_off(i)
    stored = L.SLOT_CHECKSUM.unpack_from(slab._mm, off + L.SLOT_META_OFFSET)[0]
    found = _hash_block(slab, pages, s[F_LENGTH])
    report.checked += 1
    report.checked_bytes += s[F_LENGTH]
    if found == stored:
        return i + 1
    address = bytes(slab._slot_address(i, s[F_ALEN])).decode("ascii", "replace")
    slab._state[L.ST_CHECKSUM_FAILURES] += 1
    if repair:
        slab._drop_block(i, s, evicted=True, reason=R_REPAIR)
    bad = BadBlock(slab._ns_name(s[F_NS]), address, s[F_LENGTH], stored, found, repair)
    report.bad.append(bad)
    # A freed slot may now hold a block shifted back into it: look at it again.
    return i if repair else i + 1


def _hash_block(slab: Slab, pages: list[int], length: int) -> int:
    """The checksum of the bytes on a block's pages (the lock is held)."""
    running, mv = Running(), slab._mv
    base, ps, left = slab.geometry.data_off, slab.page_size, length
    for p in pages:
        size = min(ps, left)
        running.update(mv[base + p * ps : base + p * ps + size])
        left -= size
    return running.intdigest()
