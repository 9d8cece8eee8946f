"""Sizes: binary units, parsing and display, and the block-size defaults every layer shares.

A base module (it imports only :mod:`eg_kv.errors`): the slab, the server's settings and the
clients all use it, so none of them has to import another layer for a number.
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

#: The slab's page: a block takes whole pages (see docs/design.md).
DEFAULT_PAGE_SIZE = 64 * KiB
#: The largest block the server accepts and a client reads, unless told otherwise.
DEFAULT_MAX_BLOCK_SIZE = 64 * MiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}


def parse_size(text: str | int) -> int:
    """Parse a size such as ``8GiB``, ``64KiB``, ``512M`` or ``4096`` into bytes.

    Units are binary (``K`` = 1024): ``KiB``, ``MiB``, ``GiB``, ``TiB``, or the letter
    alone (``64K``, ``8G``). ``KB``, ``MB``, ``GB`` and ``TB`` are refused: they mean
    powers of 1000 to some and of 1024 to others, and a slab sized a few percent off is
    found out only when it fills.

    Raises:
        ConfigError: the text is not a size, or is one of the ambiguous units.
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (write it like 4096, 64KiB, 512MiB or 8GiB)")
    number, unit, binary = m.group(1), m.group(2).upper(), m.group(3)
    if unit and not binary and text.strip()[-1:] in "bB":
        raise ConfigError(
            f"ambiguous size {text.strip()!r}: eg-kv's sizes are binary; write "
            f"{number}{unit}iB ({int(float(number) * _UNITS[unit]):,} bytes) or the bytes"
        )
    return int(float(number) * _UNITS[unit])


def format_size(n: int) -> str:
    """The inverse of :func:`parse_size` for display: the largest exact binary unit."""
    for unit in ("T", "G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}iB"
    return f"{n}B"


def human_size(n: int) -> str:
    """``n`` bytes for a person to read, to three significant figures: ``1.23 GiB``.

    For sizes that are measured, not configured (free space in ``/dev/shm``): the largest
    binary unit the size reaches, so a message never shows ``1258291KiB``. Use
    :func:`format_size` where the exact value matters (a setting to type back in).
    """
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            value = n / _UNITS[unit]
            # Never rounded up to the next unit: 1 GiB less a page is not "1024 MiB".
            exact = f"{math.floor(value * 10) / 10:.1f}"
            text = f"{value:.3g}" if value < 999.5 else exact
            return f"{text} {unit}iB"
    return f"{n} B"
