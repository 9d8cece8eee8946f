"""The block checksum: XXH3-64 (seed 0) of a block's bytes, kept with the block from its
writer to every reader.

Why XXH3-64: on this project's 2-core box it ran at 38 GB/s on 4 KiB and 50 GB/s on
2-14 MiB blocks, against 16-23 GB/s for CRC32C (``google-crc32c``) and 0.8 GB/s for
BLAKE2b (``scripts/bench_integrity.py`` prints both): a 14 MiB block costs 0.3 ms, under a
tenth of its copy. It is a checksum, not a MAC: it catches a changed byte, a torn or
misplaced copy and a bit flip, never a forger (that needs a key the forger lacks:
docs/security.md). ``xxhsum -H3 FILE`` prints the same value (XXH3_64bits).

On the wire it is :data:`eg_kv.wire.CHECKSUM_HEADER`, 16 lowercase hex digits: a PUT may
carry it (the server refuses a body that does not match, and computes it for a PUT that
carries none), and every ``GET`` and ``HEAD`` answer carries the block's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import xxhash

from .errors import BadRequest, NotFound

log = logging.getLogger("eg_kv.checksum")

#: The checksum of ``data`` (any buffer), an unsigned 64-bit int.
of: Callable[[Any], int] = xxhash.xxh3_64_intdigest
#: A running checksum: ``update(view)`` piece by piece, then ``intdigest()``.
Running = xxhash.xxh3_64
#: The pieces a socket or a local copy fills and hashes in turn (:class:`Verifier`): each
#: hashed while in cache. A 14 MiB block copied whole out of the slab and hashed after was
#: read back from memory: eight threads loading 16 x 14 MiB ran at 0.73-0.75 of no check,
#: against 0.88 in 512 KiB-2 MiB pieces (and 0.73 in 128 KiB ones: the calls between).
HASH_PIECE = 1024 * 1024
#: Hex digits of the wire form.
HEX_DIGITS = 16
_HEX = frozenset("0123456789abcdefABCDEF")


class ChecksumMismatch(NotFound):
    """The bytes read are not the bytes stored (their checksum differs): a miss, never bytes
    handed on. A 404 where the server finds it (``eg-kv check --deep``, a disk record)."""


class ChecksumMissing(ChecksumMismatch):
    """A block answer carries no checksum header: not the server's slab (every eg-kv server
    sends one) but the path to it (a proxy that drops headers, or not an eg-kv server). A
    miss, counted; the clients warn once per server, not once per block."""


class BodyMismatch(BadRequest):
    """A PUT's body does not match the checksum it carried: nothing was stored (400)."""


def encode(value: int) -> str:
    """The wire form of a checksum: 16 lowercase hex digits."""
    return f"{value:016x}"


def decode(text: str | bytes | None) -> int | None:
    """A checksum from its wire form, None when ``text`` is None.

    Raises:
        BadRequest: not 16 hex digits.
    """
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    text = text.strip()
    if len(text) != HEX_DIGITS or not _HEX.issuperset(text):
        raise BadRequest(f"a checksum is {HEX_DIGITS} hex digits (XXH3-64), not {text[:40]!r}")
    return int(text, 16)


def read_hashed(
    read_exact: Callable[[memoryview], None],
    update: Callable[[Any], Any],
    view: memoryview,
    piece: int,
) -> None:
    """Fill ``view`` with ``read_exact`` and hash it with ``update``, ``piece`` bytes at a
    time (0: whole), each piece hashed right after it is filled, while in cache."""
    if not piece or len(view) <= piece:
        read_exact(view)
        update(view)
        return
    view = memoryview(view).cast("B")
    for at in range(0, len(view), piece):
        part = view[at : at + piece]
        read_exact(part)
        update(part)


class Verifier:
    """Checks a block's bytes against its checksum as a sink fills them.

    Each piece is hashed right after it is filled (while it is still in cache): wrap a
    ``read_exact(view)`` (:meth:`read_exact`) or :meth:`add` each piece; :meth:`check`
    compares the whole.

    Args:
        expected: the checksum the server said the block has.
        read_exact: the transport's ``read_exact`` (fills ``view`` with the next bytes).
        piece: hand ``read_exact`` at most this many bytes at a time, each hashed right
            after it is filled (a socket's): a 14 MiB view filled whole and hashed after
            was read back from memory (0.76-0.84x an unchecked 14 MiB GET over HTTP).
            0: whole views.
    """

    __slots__ = ("_hash", "_inner", "_piece", "expected")

    def __init__(
        self,
        expected: int,
        read_exact: Callable[[memoryview], None] | None = None,
        piece: int = 0,
    ) -> None:
        self._inner, self.expected, self._piece = read_exact, expected, piece
        self._hash = Running()

    def read_exact(self, view: memoryview) -> None:
        read_hashed(self._inner, self._hash.update, view, self._piece)  # type: ignore[arg-type]

    def add(self, piece: Any) -> None:
        """Hash the next piece of the block (any buffer)."""
        self._hash.update(piece)

    def check(self) -> None:
        """Raises:
        ChecksumMismatch: the bytes read do not have the expected checksum."""
        got = self._hash.intdigest()
        if got != self.expected:
            raise ChecksumMismatch(
                f"bytes read have checksum {got:016x}, the block's is {self.expected:016x}"
            )


class Failures:
    """A client's count of blocks whose bytes failed a check (their checksum, or the block
    key's tag), logged once per address (a bounded memory of the addresses logged: at
    most :attr:`LOGGED_MAX`).

    Args:
        where: who counts (``client``, ``server set``), for the log line.
        what: what failed, for the log line.
        hint: what to do, for the log line.
    """

    LOGGED_MAX = 4096

    def __init__(
        self,
        where: str,
        what: str = "failed its checksum",
        hint: str = "run `eg-kv check --deep` on the server's host",
    ) -> None:
        self.where, self.what, self.hint = where, what, hint
        self.count = 0
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def add(self) -> None:
        """Count one failure without logging it (its cause is logged once elsewhere)."""
        with self._lock:
            self.count += 1

    def record(self, address: str, detail: str) -> None:
        """Count one failure of ``address``; log it the first time (an error: wrong bytes
        reached this client and were dropped)."""
        with self._lock:
            self.count += 1
            if address in self._logged:
                return
            if len(self._logged) >= self.LOGGED_MAX:
                self._logged.clear()
            self._logged.add(address)
        log.error(
            "eg-kv %s: block %s %s (%s): a miss, the bytes were dropped; %s",
            self.where, address, self.what, detail, self.hint,
        )  # fmt: skip
