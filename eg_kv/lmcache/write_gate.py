"""No write into a caller's buffer once the caller may have freed it.

The LMCache plugins load on pool threads straight into buffers LMCache owns, and LMCache
may release them (shutdown, a cancelled prefetch) while a load still runs. Three rules
keep every write inside the time the buffer is ours:

* a load reads its body in :data:`SLICE` pieces and checks its :class:`WriteGate` before
  each one, so a closed gate stops it at the next slice;
* ``close()`` closes every gate (:class:`GateSet`) and then waits for every transfer to
  end; each ends within its own deadline (``timeout_s``), so once ``close()`` returns no
  thread writes into a caller's buffer again;
* a transfer starts only when its whole ``timeout_s`` fits before its batch's deadline
  (:meth:`WriteGate.can_start`), so no transfer outlives its batch.

Why not a private buffer and a copy under a lock: it is strict too, but the extra copy of
every chunk cost about 10% of the L2 adapter's load throughput on 14 MiB chunks
(docs/design.md, "Clients"); these rules cost nothing measurable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Body bytes read between two checks of the gate: a closed gate stops a 14 MiB load
#: after at most this much more.
SLICE = 1 << 20


class GateClosed(Exception):
    """The caller's buffer may be gone: the transfer stops without writing more."""


class WriteGate:
    """Whether one caller's buffers may still be written. Closes for good.

    Args:
        deadline: ``time.monotonic()`` after which no write may happen.
    """

    __slots__ = ("_open", "deadline")

    def __init__(self, deadline: float = float("inf")) -> None:
        self._open = True
        self.deadline = deadline

    def close(self) -> None:
        """Close the gate: transfers through it stop at their next slice."""
        self._open = False

    @property
    def is_open(self) -> bool:
        """True while writes may still happen (not closed, before the deadline)."""
        return self._open and time.monotonic() < self.deadline

    def can_start(self, timeout_s: float) -> bool:
        """True when a transfer bounded by ``timeout_s`` started now ends before the
        deadline (and the gate is open)."""
        return self._open and time.monotonic() + timeout_s <= self.deadline


class GateSet:
    """The open gates of one connector, so ``close()`` can close them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: set[WriteGate] = set()
        self._closed = False

    def open(self, deadline: float = float("inf")) -> WriteGate:
        """A new gate, registered until :meth:`release`; born closed after :meth:`close`."""
        gate = WriteGate(deadline)
        with self._lock:
            if self._closed:
                gate.close()
            else:
                self._gates.add(gate)
        return gate

    def release(self, gate: WriteGate) -> None:
        """Forget a gate whose transfers are over."""
        with self._lock:
            self._gates.discard(gate)

    def close(self) -> None:
        """Close every gate, present and future."""
        with self._lock:
            self._closed = True
            gates, self._gates = self._gates, set()
        for gate in gates:
            gate.close()


def read_through(
    read_exact: Callable[[memoryview], None], dest: memoryview, gate: WriteGate
) -> None:
    """Read ``len(dest)`` body bytes into ``dest`` slice by slice while ``gate`` is open.

    Args:
        read_exact: the client's body reader (fills the view it is given).
        dest: the caller's buffer (bytes).
        gate: the gate of the caller's batch.

    Raises:
        GateClosed: the gate closed; no slice was started after it did.
        Whatever ``read_exact`` raises.
    """
    total = len(dest)
    for offset in range(0, total, SLICE):
        if not gate.is_open:
            raise GateClosed("the caller's buffer may be gone")
        read_exact(dest[offset : min(offset + SLICE, total)])
