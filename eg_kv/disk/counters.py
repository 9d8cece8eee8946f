"""The disk tier's counters, in a small file beside its data: :class:`DiskCounters`.

The keeper is a process of its own that the supervisor starts again when it dies (or is
killed for a stuck loop): counters kept in its memory went back to 0 with it, and a
Prometheus counter that goes back reads as a reset (``eg_kv_disk_spills_total`` 16 -> 0).
They live in ``DIR/counters`` instead, mapped by the keeper (their only writer), and set
to 0 by the supervisor when the server starts (:func:`reset`): a server's counters count
from its start, whatever its keeper went through.

Layout: ``"EGKVCNT1"``, then one little-endian float64 per name of :data:`NAMES`, in order
(byte counts stay exact below 2**53).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, MutableMapping

NAMES = ("spills", "spill_drops", "spill_skips", "spilled_bytes", "write_seconds",
         "write_errors", "disk_evictions", "quota_drops", "deletes", "disk_hits",
         "promotions", "read_bytes", "read_seconds", "checksum_failures")  # fmt: skip
FILE = "counters"
MAGIC = b"EGKVCNT1"
SIZE = len(MAGIC) + 8 * len(NAMES)
_INDEX = {name: i for i, name in enumerate(NAMES)}


def reset(path: str) -> None:
    """Make ``path``'s counters file anew, every counter 0 (a server starting)."""
    name = os.path.join(path, FILE)
    tmp = name + ".new"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, MAGIC + bytes(SIZE - len(MAGIC)))
    finally:
        os.close(fd)
    os.replace(tmp, name)


class DiskCounters(MutableMapping[str, float]):
    """The counters of :data:`NAMES`, mapped from ``path``'s counters file (made, at 0,
    when it is absent or not one). Counts read back as ints, ``*_seconds`` as floats.

    Raises:
        OSError: the file cannot be opened (the keeper cannot start).
    """

    def __init__(self, path: str) -> None:
        name = os.path.join(path, FILE)
        with contextlib.suppress(FileNotFoundError), open(name, "rb") as f:
            if f.read(len(MAGIC)) == MAGIC and os.fstat(f.fileno()).st_size == SIZE:
                self._map(name)
                return
        reset(path)
        self._map(name)

    def _map(self, name: str) -> None:
        fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._values = memoryview(self._mm)[len(MAGIC) :].cast("d")

    def __getitem__(self, name: str) -> float:
        value = self._values[_INDEX[name]]
        return value if name.endswith("_seconds") else int(value)

    def __setitem__(self, name: str, value: float) -> None:
        self._values[_INDEX[name]] = float(value)

    def __delitem__(self, name: str) -> None:
        raise TypeError("the disk tier's counters are fixed")

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)

    def close(self) -> None:
        self._values.release()
        self._mm.close()
