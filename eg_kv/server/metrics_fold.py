"""Dead workers' request metrics, folded into one kept file per type.

prometheus_client's multiprocess mode keeps one counter file and one histogram file per
worker pid (64 KiB each), and a scrape reads every one of them: a server whose workers
were replaced hundreds of times (watchdog kills, OOM kills, crashes) read hundreds of
files per scrape, forever. When the supervisor reaps a worker it adds that worker's
values into ``counter_archive.db`` and ``histogram_archive.db`` (the sum a scrape would
have made of them) and removes its files.

A scrape must never see a dead worker's values both in its file and in the archive, nor
in neither (a counter that goes back reads as a reset): the fold and a scrape exclude
each other through an ``flock`` on :data:`LOCK_FILE`. Neither side waits long: the
supervisor tries once and folds on a later tick, a scrape waits at most
:data:`SCRAPE_WAIT_S` and is answered 503 (scrape again) after that.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import mark_process_dead

from ..errors import Busy

LOCK_FILE = ".fold.lock"
#: The types whose values add up across processes (gauges of dead workers are dropped).
_SUMMED = ("counter", "histogram")
#: The longest a scrape waits for a fold in progress (a fold takes about a millisecond).
SCRAPE_WAIT_S = 0.2


def _lock_fd(multiproc_dir: str) -> int:
    return os.open(os.path.join(multiproc_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                   0o600)  # fmt: skip


@contextlib.contextmanager
def scrape_lock(multiproc_dir: str) -> Iterator[None]:
    """Hold off folds while a scrape reads the files.

    Raises:
        Busy: a fold held the files for :data:`SCRAPE_WAIT_S` (its supervisor stopped).
    """
    fd = _lock_fd(multiproc_dir)
    try:
        deadline = time.monotonic() + SCRAPE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Busy("metrics: the supervisor is folding a dead worker's "
                               "counters; scrape again") from None  # fmt: skip
                time.sleep(0.001)
        yield
    finally:
        os.close(fd)


def fold_dead_process(multiproc_dir: str, pid: int) -> bool:
    """Add dead worker ``pid``'s counters and histograms into the archive files, remove
    its files and drop its live gauges. Returns False, having done nothing, while a
    scrape reads the files (call again later).

    Raises:
        OSError: the directory cannot be written (its files then stay, still counted).
    """
    fd = _lock_fd(multiproc_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        for typ in _SUMMED:
            _fold(multiproc_dir, typ, pid)
        mark_process_dead(pid, multiproc_dir)
        return True
    finally:
        os.close(fd)


def _fold(multiproc_dir: str, typ: str, pid: int) -> None:
    dead = os.path.join(multiproc_dir, f"{typ}_{pid}.db")
    if not os.path.exists(dead):
        return
    archive = os.path.join(multiproc_dir, f"{typ}_archive.db")
    summed: dict[str, float] = collections.defaultdict(float)
    for path in (archive, dead):
        with contextlib.suppress(FileNotFoundError):
            for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(path):
                summed[key] += value
    tmp = os.path.join(multiproc_dir, f".{typ}_archive.tmp")  # not *.db: no scrape reads it
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    out = MmapedDict(tmp)
    try:
        for key, value in summed.items():
            out.write_value(key, value, 0.0)
    finally:
        out.close()
    os.replace(tmp, archive)
    os.unlink(dead)
