"""POSIX shared memory's names and where Linux keeps them: one spelling for the slab's
segments, which the server (``eg_kv.slab``), its settings and the clients' local reads use.
"""

from __future__ import annotations

from .errors import SlabError

#: Where Linux keeps POSIX shared memory (``posix_ipc`` segment ``/x`` is ``/dev/shm/x``).
SHM_DIR = "/dev/shm"

#: Longest name of a file in /dev/shm (NAME_MAX); the readers and events segments add to it.
_NAME_MAX = 255 - 16


def segment_name(name: str) -> str:
    """``name`` as POSIX shared memory spells it, one leading slash: ``foo`` is ``/foo``.
    Without it the segment was created (``shm_open`` drops the slash) but never found
    again by path, so its unlink failed and the slab stayed in /dev/shm after every stop.

    Raises:
        SlabError: empty, too long, or with a slash past the first.
    """
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or bare in (".", "..") or len(bare) > _NAME_MAX:
        raise SlabError(
            f"bad slab name {name!r}: one name of 1-{_NAME_MAX} characters without '/' "
            "(an optional leading '/'), e.g. --slab-name /eg-kv-9130"
        )
    return "/" + bare
