"""vLLM's KV-events wire format, written from eg-kv's event log (no vLLM import).

What a subscriber of vLLM's ``ZmqEventPublisher`` reads (``vllm/distributed/kv_events.py``,
0.32 to 0.34), and what llm-d's indexer and Dynamo's router consume:

* a message is three ZMQ frames: ``[topic, seq as 8 bytes big-endian, payload]``;
* the payload is msgpack ``[ts, [event, ...], data_parallel_rank]`` (vLLM's
  ``KVEventBatch``, an array);
* an event is a msgpack map tagged by ``type`` (vLLM since #42892; :data:`MAPS`):
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
  [...], "block_size": n, "lora_id": ..., "medium": ..., "lora_name": ..., "locality":
  ...}``, ``{"type": "BlockRemoved", "block_hashes": [...], "medium": ..., "locality":
  ...}``, ``{"type": "AllBlocksCleared"}``; or, for older consumers (:data:`ARRAYS`), the
  positional form ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``.

A block's hash is the engine's (:mod:`eg_kv.engine`) as bytes; a block stored without one
is named by its eg-kv address (ASCII bytes). ``token_ids`` and ``lora_name`` are what the
block's PUT carried, while the publisher holds them (:mod:`eg_kv.kvevents.publisher`);
else ``[]`` and ``None``. Encoded with msgspec's msgpack encoder (the one vLLM uses).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..engine import EngineName, token_list
from ..slab.events import STORED, Event

__all__ = ["ARRAYS", "MAPS", "BatchBuilder", "Wire"]

MAPS, ARRAYS = "maps", "arrays"
#: The replay socket's end-of-answer marker's seq (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    """A message's seq frame."""
    return seq.to_bytes(8, "big")


class Wire:
    """Encodes eg-kv's log entries as vLLM's event batches, one medium and form.

    Args:
        medium: the ``medium`` every event carries (``SHARED_STORAGE``, ``STORAGE``...).
        locality: ``LOCAL``/``REMOTE`` or None (not sent).
        form: :data:`MAPS` (tagged maps, vLLM 0.32+) or :data:`ARRAYS` (positional).
    """

    def __init__(self, medium: str, locality: str | None = None, form: str = MAPS) -> None:
        if form not in (MAPS, ARRAYS):
            raise ValueError(f"form: {MAPS!r} or {ARRAYS!r}")
        self.medium, self.locality, self.form = medium, locality, form
        self._encode = msgspec.msgpack.Encoder().encode

    def event(self, ev: Event, extras: tuple[bytes, str] | None = None) -> Any:
        """One log entry as a vLLM event (``BlockStored`` or ``BlockRemoved``);
        ``extras``: a store's packed token ids and LoRA name, if known."""
        e: EngineName = ev.engine
        block = e.hash or bytes(ev.address)
        if ev.kind == STORED:
            return self.stored(block, e.parent, e.block_size, e.lora_id, extras)
        return self.removed(block)

    def removed(self, block: bytes) -> Any:
        """A ``BlockRemoved`` of one block named ``block``."""
        if self.form == ARRAYS:
            return ["BlockRemoved", [block], self.medium]
        out: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [block],
                               "medium": self.medium}  # fmt: skip
        if self.locality:
            out["locality"] = self.locality
        return out

    def stored(
        self, block: bytes, parent: bytes, block_size: int, lora_id: int,
        extras: tuple[bytes, str] | None = None,
    ) -> Any:  # fmt: skip
        """A ``BlockStored`` of one block named ``block`` (``parent`` b"", ``lora_id`` 0:
        none; ``extras``: its packed token ids and LoRA name, None: not known)."""
        tokens, lora_name = (token_list(extras[0]), extras[1] or None) if extras else ([], None)
        if self.form == ARRAYS:
            return ["BlockStored", [block], parent or None, tokens, block_size, lora_id or None,
                    self.medium, lora_name]  # fmt: skip
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": [block], "parent_block_hash": parent or None,
            "token_ids": tokens, "block_size": block_size, "lora_id": lora_id or None,
            "medium": self.medium, "lora_name": lora_name,
        }  # fmt: skip
        if self.locality:
            out["locality"] = self.locality
        return out

    def cleared(self) -> Any:
        """``AllBlocksCleared``: the consumer forgets what this topic said before."""
        return ["AllBlocksCleared"] if self.form == ARRAYS else {"type": "AllBlocksCleared"}

    def batch(self, events: list[Any], ts: float | None = None) -> bytes:
        """The payload of one message: ``[ts, events, data_parallel_rank]``."""
        return self._encode([time.time() if ts is None else ts, events, 0])


class BatchBuilder:
    """One message's payload built a part at a time (a resync: every block a namespace
    holds, in one message), as :meth:`Wire.batch` would encode all the events at once:
    each part is encoded as it comes and only its bytes are kept.

    Args:
        wire: the form and medium the events were made in.
    """

    def __init__(self, wire: Wire, ts: float | None = None) -> None:
        self._encode = wire._encode
        #: ``[ts, [events...``: the array's count is written in at the end (msgpack's
        #: array 32, which every decoder takes whatever the count).
        self.body = bytearray(b"\x93" + self._encode(time.time() if ts is None else ts))
        self._count_at = len(self.body) + 1
        self.body += b"\xdd\x00\x00\x00\x00"
        self.events = 0

    def add(self, events: list[Any]) -> None:
        """Append ``events`` (at most 65,535 a call)."""
        if not events:
            return
        if len(events) > 0xFFFF:
            raise ValueError("at most 65,535 events a part")
        raw = self._encode(events)
        self.body += memoryview(raw)[1 if len(events) < 16 else 3 :]  # less its array head
        self.events += len(events)

    def payload(self) -> bytearray:
        """The payload (``data_parallel_rank`` 0 last); the builder is done."""
        self.body[self._count_at : self._count_at + 4] = self.events.to_bytes(4, "big")
        self.body += b"\x00"
        return self.body
