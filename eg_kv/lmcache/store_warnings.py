"""What a refused store means, said once: the LMCache plugins' 413 and 409 warnings.

A store that fails is only a later miss for LMCache, so without a word a misconfigured
chunk size or two differently configured LMCache instances would just lose their hits.
:class:`StoreWarnings` turns the two refusals that a configuration causes into WARNINGs:

* 413: one per distinct chunk size, at most one per :data:`INTERVAL_S`, naming the chunk
  size, the server's limit (``/kv/stats`` ``max_block_size``) and the fix;
* 409: once per connector, saying what "first writer wins" means.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("eg_kv.kvcache")

#: Least time between two 413 warnings (of different sizes).
INTERVAL_S = 10.0
#: Chunk sizes remembered as already reported; later new sizes are not reported.
MAX_SIZES = 64
_MiB = 1 << 20


def suggested_limit(size: int) -> str:
    """A ``--max-block-size`` that holds ``size`` bytes: the next power of two in MiB."""
    mib = 1
    while mib * _MiB < size:
        mib *= 2
    return f"{mib}MiB"


class StoreWarnings:
    """Says once why stores of one connector are refused.

    Args:
        client: the connector's sync client (its ``stats()`` gives the server's limit).
        who: how the log names the plugin (e.g. ``"eg-kv LMCache L2 adapter"``).
    """

    def __init__(self, client: Any, who: str) -> None:
        self._client = client
        self._who = who
        self._lock = threading.Lock()
        self._sizes: set[int] = set()
        self._next_413 = 0.0
        self._limit: int | None = None
        self.conflict_warned = False

    def too_large(self, size: int) -> bool:
        """Report a 413 for a chunk of ``size`` bytes. Returns True when it logged."""
        with self._lock:
            now = time.monotonic()
            if size in self._sizes or len(self._sizes) >= MAX_SIZES or now < self._next_413:
                return False
            self._sizes.add(size)
            self._next_413 = now + INTERVAL_S
        limit = self._server_limit()
        log.warning(
            "%s: a chunk of %d bytes is over the eg-kv server's maximum block size (%s) "
            "at %s, so it is not stored and LMCache recomputes it: start the server with "
            "`eg-kv serve --max-block-size %s` (in the compose file: EG_KV_MAX_BLOCK_SIZE) "
            "or lower LMCache's chunk_size (from LMCache 0.5.7 on, `lmcache server "
            "--chunk-size` is a minimum that vLLM may raise to a multiple of its block size)",
            self._who, size, f"{limit} bytes" if limit else "unknown",
            self._client.config.base_url, suggested_limit(size),
        )  # fmt: skip
        return True

    def conflict(self, size: int, what: str) -> bool:
        """Report a 409 (the address holds a block of another length). True when it logged.

        Args:
            size: the refused chunk's length.
            what: what the plugin does about it (one sentence).
        """
        with self._lock:
            if self.conflict_warned:
                return False
            self.conflict_warned = True
        log.warning(
            "%s: eg-kv at %s already holds this chunk's address with another length "
            "(409; this chunk is %d bytes): eg-kv keeps the first copy of an address "
            "(first writer wins), so another LMCache instance with other settings stores "
            "into the same addresses. %s (said once)",
            self._who, self._client.config.base_url, size, what,
        )  # fmt: skip
        return True

    def _server_limit(self) -> int | None:
        if self._limit is None:
            try:
                value = self._client.stats().extra.get("max_block_size")
            except Exception:  # the warning must not fail because stats could not be read
                return None
            if isinstance(value, int) and not isinstance(value, bool):
                self._limit = value
        return self._limit
