"""Loading stored blocks into a staging buffer and deciding which arrived whole: the
part of :class:`~eg_kv.vllm.connector.EgKvConnector`'s load path that needs neither vLLM
nor torch (so it is tested against a real server without an engine).

What a load can and cannot detect: a stored block is a row (one vLLM block of one shard,
every layer) and its address's tag (:mod:`eg_kv.vllm.trailers`), and it is accepted only
when its length is exactly the row's and the tag's, and the tag is its address's: a
missing block, a shorter or longer one, a transport error or a refusal,
and a block of the right length that is not this address's (a server that mixed up two
blocks, a member back with stale state, a proxy) are all failures, and the block is
recomputed. Bytes that changed after they were stored fail the server's checksum first,
and with the engines' block key a forged block fails its MAC (:mod:`eg_kv.checksum`,
:mod:`eg_kv.blockkey`): the trailer is no MAC, so without a key a writer of the namespace
can still store KV of its own choosing under an address (docs/security.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..client.rounds import MIN_LEFT_S
from .trailers import read_row

__all__ = ["BlockReader", "load_rows"]

_T = TypeVar("_T")


class BlockReader(Protocol):
    """What a load needs of a client (every eg-kv sync client has it)."""

    def fetch(self, key: str | bytes, sink: Any, *, timeout_s: float | None = None) -> Any: ...


def load_rows(
    client: BlockReader,
    addresses: Sequence[str],
    rows: Any,
    *,
    map_fn: Callable[[Callable[[int], bool], Iterable[int]], Iterable[bool]] = map,
    deadline: float | None = None,
) -> tuple[list[int], list[int]]:
    """GET ``addresses[i]`` into ``rows[i]`` (a writable buffer of one stored block's
    exact length), with ``map_fn`` (e.g. a thread pool's ``map``) running the GETs.
    ``deadline`` (``time.monotonic()``): a GET that would start after it (or with less
    than :data:`~eg_kv.client.rounds.MIN_LEFT_S` of it left) is a failed block, unsent,
    and each one sent is bounded by what is left of it, so a silent server costs a load
    one timeout (not one per wave of GETs, nor a GET started just before the deadline
    that ran its own whole timeout past it).

    Returns:
        ``(ok, failed)``: the indices (``rows`` is any indexable of buffers with a
        length, e.g. a 2-D uint8 array's rows) whose row now holds the block stored at
        its address, checked by its tag (its bytes by their checksum), and the others
        (a miss, an error, a block of another length or another address's). A failed
        row's bytes are undefined and must not be used.
    """
    if len(addresses) != len(rows):
        raise ValueError(f"{len(addresses)} addresses for {len(rows)} rows")

    def one(i: int) -> bool:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < MIN_LEFT_S:  # a sliver would time out at a healthy
            return False  # server, and a server set's member would be marked down
        address, row = addresses[i], memoryview(rows[i]).cast("B")

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> bool:
            read_row(address, row, length, read_exact, tagged=True)  # raises unless whole
            return True

        try:
            return client.fetch(address, sink, timeout_s=left) is True
        except Exception:  # a client that raises counts as a failed block, never a crash
            return False

    whole = list(map_fn(one, range(len(rows))))
    return [i for i, w in enumerate(whole) if w], [i for i, w in enumerate(whole) if not w]
