"""Operator hints the server logs from what its counters show (at most every few minutes).

One rule so far, :func:`page_waste_hint`: blocks much smaller than a page. Every block
takes whole pages, so 1 KiB chunks in 64 KiB pages fill a 512 MiB slab with 8,192 chunks.
The counters hold the total, not each block's last page, so the rule reads the mean: when
the empty part of the blocks' last pages is over three quarters of a page per block, the
blocks use under a quarter of their last page on average (for LMCache, whose chunks all
have one size, that is most blocks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..units import format_size

log = logging.getLogger("eg_kv.supervisor")

#: Fewer blocks than this say nothing about the workload.
MIN_BLOCKS = 64
#: The hint fires when blocks use under this part of their last page (on average).
TAIL_FILL = 0.25
#: Smallest page the slab accepts (the OS page).
MIN_PAGE = 4096


def suggested_page_size(mean_block: int) -> int:
    """The largest power of two at most ``mean_block``, and at least :data:`MIN_PAGE`."""
    page = MIN_PAGE
    while page * 2 <= mean_block:
        page *= 2
    return page


def page_waste_hint(stats: Mapping[str, Any]) -> str | None:
    """The hint for ``/kv/stats``-shaped counters, or None when pages fit the blocks.

    Args:
        stats: ``unique_blocks``, ``resident_bytes``, ``page_size``, ``page_waste_bytes``.

    Returns:
        One line naming the waste and the ``--page-size`` to use, or None.
    """
    blocks, page = stats.get("unique_blocks", 0), stats.get("page_size", 0)
    waste, resident = stats.get("page_waste_bytes", 0), stats.get("resident_bytes", 0)
    if blocks < MIN_BLOCKS or page <= 0 or waste <= (1 - TAIL_FILL) * blocks * page:
        return None
    mean = resident // blocks
    better = suggested_page_size(mean)
    if better >= page:
        return None  # already the smallest page that helps
    used = waste + resident
    return (
        f"most blocks use under a quarter of their last page: {blocks} blocks of "
        f"{format_size(mean)} on average hold {format_size(resident)} in "
        f"{format_size(used)} of {format_size(page)} pages ({100 * waste // used}% "
        f"wasted); restart eg-kv with --page-size {format_size(better)} (or store larger "
        "chunks: a bigger LMCache chunk_size)"
    )


class PageWasteHinter:
    """Checks :func:`page_waste_hint` every ``interval_s``; logs it at most every
    ``repeat_s`` while it holds.

    Args:
        interval_s: least time between two checks.
        repeat_s: least time between two WARNINGs.
        clock: the time source (``time.monotonic``).
    """

    def __init__(
        self,
        interval_s: float = 300.0,
        repeat_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.repeat_s = repeat_s
        self._clock = clock
        self._next_check = clock() + interval_s
        self._next_warning = 0.0

    def tick(self, stats: Callable[[], Mapping[str, Any]]) -> str | None:
        """Check when due; returns the hint it logged, if any. Never raises."""
        now = self._clock()
        if now < self._next_check:
            return None
        self._next_check = now + self.interval_s
        try:
            hint = page_waste_hint(stats())
        except Exception:  # a hint must never stop the supervisor
            log.debug("page waste hint failed", exc_info=True)
            return None
        if hint is None or now < self._next_warning:
            return None
        self._next_warning = now + self.repeat_s
        log.warning("eg-kv: %s", hint)
        return hint


_supervisor_hinter = PageWasteHinter()


def tick(slab: Any) -> None:
    """The supervisor loop's hook: check the slab's counters when due."""
    if slab is not None:
        # Bounded: the supervisor's loop must never wait on a lock a wedged worker holds.
        _supervisor_hinter.tick(lambda: slab.stats(timeout=0.2))
