"""The publisher's anonymous memory, and giving freed heap back to the OS.

libzmq takes a multipart message in whole before the publisher sees any of it (a frame
limit, ``ZMQ_MAXMSGSIZE``, is per frame), and frees it in the pieces it came in: glibc
keeps those pieces for reuse, so a hostile request of 40 MB left the publisher 40 MB
larger for good. :func:`trim` hands them back (glibc's ``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["anon_bytes", "trim"]

_libc = None


def anon_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``: the slab's shared pages
    are not in it), in bytes; 0 when /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim() -> bool:
    """Give the heap's free pages back to the OS (every arena's, libzmq's I/O thread's
    included). False where libc has no ``malloc_trim`` (not glibc)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    fn = getattr(_libc, "malloc_trim", None)
    if fn is None:
        return False
    fn(0)
    return True
