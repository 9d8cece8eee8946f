"""Lease holders: which token's tenant holds each lease a server took, so that a release
ends only a lease its own holder took (a readonly token ended a readwrite token's lease on
the same block: issue 31).

A slot counts its leases (:mod:`eg_kv.slab.leases`); the holder records in the readers
segment (:mod:`eg_kv.slab.layout`) say whose they are: one record per block and holder,
with that holder's count and when its newest lease ends. Records are found by open
addressing on the block id within :data:`PROBE` places (every holder's record of a block in
one run of places), and written only under the slab's lock. A record whose end has passed
holds nothing: it is taken again by the next lease that needs room, so a holder that never
releases costs its records only until its leases end. A block that goes while leased (a
``DELETE``, a quota's eviction) frees its records at once (:meth:`LeaseHolders.drop`): a
tenant that leased and deleted blocks in a loop kept records of blocks gone until their
leases would have ended, filled the table, and left every other tenant's lookups unleased.

A lookup whose leases find no room in the table within :data:`PROBE` places takes none
(the caller answers its hits unleased, as past a lease cap).
"""

from __future__ import annotations

import functools
import hashlib
from array import array

from . import layout as L

#: The most places a record is looked for: a lease or a release costs at most this many
#: reads of the table (under the slab's lock).
PROBE = 32
_W = L.HOLD_RECORD_WORDS
_ID, _HOLDER, _COUNT, _END = range(_W)
_FREED = -1
_MIX = 0x9E3779B97F4A7C15


@functools.lru_cache(maxsize=4096)
def holder_of(name: str) -> int:
    """The holder number of the tenant named ``name`` (the same in every worker): 63 bits
    of its BLAKE2b, never 0."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8, person=b"eg-kv-holder").digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


class LeaseHolders:
    """The holder records (see the module docstring). Every method runs under the slab's
    lock.

    Args:
        words: the records as int64 words (a power of two of them, ``HOLD_RECORD_WORDS``
            words each).
    """

    def __init__(self, words: memoryview) -> None:
        self._words = words
        self._mask = len(words) // _W - 1

    def take(self, blocks: list[int], holder: int, end: int, now: int) -> bool:
        """One more lease of ``holder`` on each of ``blocks`` (a block twice: two), each
        ending at ``end`` at the earliest.

        Returns:
            False, with nothing taken, when a block finds no record within :data:`PROBE`.
        """
        words = self._words
        undo: list[tuple[int, list[int]]] = []
        for block in blocks:
            r = self._find(block, holder, now, claim=True)
            if r < 0:
                for w, saved in reversed(undo):
                    words[w : w + _W] = _as_words(saved)
                return False
            w = r * _W
            undo.append((w, words[w : w + _W].tolist()))
            if words[w + _ID] != block or words[w + _END] <= now:  # new, or ended: anew
                words[w + _HOLDER], words[w + _COUNT], words[w + _END] = holder, 0, 0
                words[w + _ID] = block
            words[w + _COUNT] += 1
            if words[w + _END] < end:
                words[w + _END] = end
        return True

    def release(self, block: int, holder: int, now: int) -> bool:
        """End one of ``holder``'s leases on ``block``.

        Returns:
            False when ``holder`` holds none that has not ended (another holder's leases
            are not its to end).
        """
        r = self._find(block, holder, now, claim=False)
        if r < 0:
            return False
        w = r * _W
        words = self._words
        if words[w + _END] <= now or words[w + _COUNT] <= 0:
            return False
        words[w + _COUNT] -= 1
        if not words[w + _COUNT]:
            words[w + _ID] = _FREED
        return True

    def drop(self, block: int) -> None:
        """Free every record of ``block``, which has gone (its leases with it)."""
        words, mask = self._words, self._mask
        r = (block * _MIX) & mask
        for _ in range(PROBE):
            w = r * _W
            rid = words[w + _ID]
            if rid == 0:  # never used: no record of the block lies past it
                return
            if rid == block:
                words[w + _ID] = _FREED
            r = (r + 1) & mask

    def _find(self, block: int, holder: int, now: int, claim: bool) -> int:
        """The record of (``block``, ``holder``); with ``claim``, else the first one free
        on its way (freed, ended, or never used). -1: none within :data:`PROBE`."""
        words, mask = self._words, self._mask
        r = (block * _MIX) & mask
        room = -1
        for _ in range(PROBE):
            w = r * _W
            rid = words[w + _ID]
            if rid == 0:  # never used: the records of this key lie before it
                return (r if room < 0 else room) if claim else -1
            if rid == block and words[w + _HOLDER] == holder:
                return r
            if room < 0 and (rid == _FREED or words[w + _END] <= now):
                room = r
            r = (r + 1) & mask
        return room if claim else -1


def _as_words(values: list[int]) -> memoryview:
    """``values`` as int64 words, for a slice assignment into the records."""
    return memoryview(array("q", values))
