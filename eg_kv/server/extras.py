"""A worker's hand-off of a block's engine extras to the KV-events publisher.

A PUT may carry the block's token ids and its LoRA's name (:mod:`eg_kv.engine`), which
the slab does not keep. With a publisher (``--kv-events-endpoint``) a worker sends them to
it over a local ZMQ socket (:func:`extras_endpoint`, in the server's run directory) as it
stores the block, and marks the block's log entry so the publisher waits for them (at
most :data:`~eg_kv.kvevents.publisher.EXTRAS_WAIT_MS`) before it publishes its
``BlockStored``. The send never blocks: messages queue while the publisher (re)starts, and
when it is down or behind (:data:`EXTRAS_HWM` messages queued, 4 MiB at most), the extras
are dropped, counted and said once, the entry is not marked, and the block is published
without them.
Without a publisher they are checked (a bad value is a 400) and dropped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import zmq

from ..engine import EngineName, extras_message

log = logging.getLogger("eg_kv.server.extras")

#: Messages a worker queues for the publisher before it drops extras (each at most 4 KiB).
EXTRAS_HWM = 1_000
#: How soon a worker tries again to reach a publisher that is not (yet) there, in ms: its
#: messages wait that long at most once it is, so the publisher's wait covers them.
RECONNECT_MS = 10


def extras_endpoint(run_dir: str) -> str:
    """The publisher's extras socket, in the server's run directory (the server's user's)."""
    return "ipc://" + os.path.join(run_dir, "kv-events-extras")


def stripped(name: EngineName) -> EngineName:
    """``name`` without what the slab does not keep."""
    return name._replace(token_ids=b"", lora_name="") if name.token_ids or name.lora_name else name


class ExtrasRelay:
    """Hands each stored block's extras to the publisher (see the module's docstring).

    Args:
        endpoint: the publisher's socket (:func:`extras_endpoint`); "" for none: every
            name is :func:`stripped`.
        on_drop: called once for each block's extras dropped (a metrics counter).
    """

    def __init__(self, endpoint: str, on_drop: Callable[[], object] = lambda: None) -> None:
        self.dropped = 0
        self._on_drop = on_drop
        self._sock: zmq.Socket[bytes] | None = None
        if endpoint:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, EXTRAS_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            sock.connect(endpoint)
            self._sock = sock

    def __call__(self, ns: int, address: str, name: EngineName) -> EngineName:
        """``name`` as the slab should record it: with its extras when they were handed
        to the publisher (its log entry is marked: :data:`~eg_kv.slab.events.E_EXTRAS`),
        else :func:`stripped`."""
        if not (name.token_ids or name.lora_name):
            return name
        if self._sock is not None:
            try:
                self._sock.send(extras_message(ns, address, name), zmq.NOBLOCK)
                return name
            except zmq.ZMQError:
                self.dropped += 1
                self._on_drop()
                if self.dropped == 1:
                    log.warning("KV events: the publisher is not taking blocks' token ids "
                                "(down or behind): blocks are published without them")  # fmt: skip
        return stripped(name)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
