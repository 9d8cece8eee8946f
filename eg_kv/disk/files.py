"""The disk tier's directory: who may use it, its lock, its data file, aligned I/O.

``DIR`` must be a directory of the server's own uid that no one else may write (a block
store any local user could plant records in would serve their bytes). One server holds it
at a time: ``DIR/lock`` carries an ``flock`` and the holder's pid, so a second server is
refused with the first one's pid, and a holder that died (SIGKILL) leaves a lock the
kernel already released.

The data file is preallocated (``fallocate``) to its whole capacity when it is made, so a
full disk shows at start, not mid-write. It is opened ``O_DIRECT`` where the file system
allows it (not tmpfs: said once in the log), so spills and cold reads bypass the page
cache the host's other work lives in; buffers are anonymous ``mmap`` s (page aligned).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import stat
import time

from ..errors import ConfigError
from ..procs import PidFileHeld, lock_pid_file
from ..units import human_size
from . import layout as D

log = logging.getLogger("eg_kv.disk")


def check_dir(path: str) -> str:
    """``path`` made absolute, after checking it may hold the disk tier (made if absent).

    Raises:
        ConfigError: not a directory, owned by another uid, writable by others, or not
            writable by us (each with a one-line reason that names the fix).
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--disk {path}: not a directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"--disk {path}: cannot make or read it: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"--disk {path}: not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"--disk {path}: owned by uid {st.st_uid}, not this server's ({os.geteuid()}); "
            "give it a directory of its own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"--disk {path}: writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"chmod go-w {path}"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--disk {path}: not writable by this server; chmod u+wx {path}")
    return path


def lock_dir(path: str) -> int:
    """Take ``path``'s lock for this process; returns the lock file's fd (keep it open:
    closing it, or dying, releases the lock).

    Raises:
        ConfigError: another live server holds it (its pid named), or it cannot be opened
            (a directory in its place).
    """
    name = os.path.join(path, D.LOCK_FILE)
    try:
        return lock_pid_file(name)
    except PidFileHeld as e:
        raise ConfigError(
            f"--disk {path}: in use by another eg-kv server (pid {e.holder}); stop it or give "
            "this one another directory"
        ) from None
    except OSError as e:
        raise _unusable(name, e) from None


def _unusable(name: str, e: OSError) -> ConfigError:
    """The one-line refusal of a file of the directory that cannot be used."""
    return ConfigError(
        f"--disk {os.path.dirname(name)}: cannot use {os.path.basename(name)} "
        f"({e.strerror}); remove or rename it"
    )


def socket_path(path: str) -> str:
    """The keeper's socket in directory ``path``, where a socket (or nothing) is.

    Raises:
        ConfigError: something else is in its place (the keeper could not bind, ever).
    """
    name = os.path.join(path, D.SOCKET_FILE)
    try:
        mode = os.lstat(name).st_mode
    except FileNotFoundError:
        return name
    except OSError as e:
        raise _unusable(name, e) from None
    if not stat.S_ISSOCK(mode):
        raise _unusable(name, OSError(errno.EEXIST, "not a socket"))
    return name


def buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer of ``size`` bytes (rounded up to :data:`layout.ALIGN`)."""
    return mmap.mmap(-1, D.align(max(size, 1)))


def open_data(path: str, write: bool = False) -> tuple[int, bool]:
    """Open the data file; returns (fd, whether it is O_DIRECT)."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC
    name = os.path.join(path, D.DATA_FILE)
    try:
        return os.open(name, flags | os.O_DIRECT), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.open(name, flags), False


def make_data(path: str, capacity: int) -> D.Super:
    """Make or open the data file for ``capacity`` bytes; returns its superblock.

    A file of another capacity, or one whose superblock is not ours, is made anew (its
    records are dropped, said in the log).

    Raises:
        ConfigError: the disk has no room for ``capacity`` bytes (fallocate failed), or
            the file cannot be read (a directory in its place).
    """
    name = os.path.join(path, D.DATA_FILE)
    try:
        with open(name, "rb") as f:
            sb = D.unpack_super(f.read(D.HEADER))
        if sb is not None and sb.capacity == capacity and os.path.getsize(name) >= capacity:
            return sb
    except FileNotFoundError:
        pass
    except OSError as e:  # a directory in its place, an unreadable file
        raise _unusable(name, e) from None
    else:
        log.warning("disk tier: %s is not a data file of %s; making it anew (its records "
                    "are dropped)", name, human_size(capacity))  # fmt: skip
    sb = D.Super(capacity, int(time.time() * 1000), D.FIRST, secrets.token_bytes(D.KEY_SIZE))
    tmp = name + ".new"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError as e:
            raise ConfigError(
                f"--disk {path}: cannot reserve {human_size(capacity)} ({e.strerror}); "
                "free space or lower --disk-capacity"
            ) from None
        os.pwrite(fd, D.pack_super(sb), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, name)
    return sb


def read_super(fd: int) -> D.Super | None:
    """The superblock of an open data file (None: not one)."""
    buf = buffer(D.HEADER)
    try:
        n = os.preadv(fd, [buf], 0)
        return D.unpack_super(buf[:n])
    finally:
        buf.close()


def write_super(fd: int, sb: D.Super) -> None:
    """Write the superblock (one aligned block)."""
    buf = buffer(D.HEADER)
    try:
        buf[:] = D.pack_super(sb)
        os.pwritev(fd, [buf], 0)
    finally:
        buf.close()


#: The most buffers one ``preadv``/``pwritev`` takes (the rest go in further calls).
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def pwrite_all(fd: int, views: list, offset: int) -> None:
    """Write ``views`` one after another from ``offset`` (as many calls as IOV_MAX needs).

    Raises:
        OSError: a write failed or was short (a full disk).
    """
    for i in range(0, len(views), IOV_MAX):
        group = views[i : i + IOV_MAX]
        want = sum(len(v) for v in group)
        if os.pwritev(fd, group, offset) != want:
            raise OSError(errno.ENOSPC, "short write")
        offset += want


def pread_all(fd: int, views: list, offset: int) -> bool:
    """Fill ``views`` from ``offset`` on; False if the file ended first."""
    for i in range(0, len(views), IOV_MAX):
        group = views[i : i + IOV_MAX]
        want = sum(len(v) for v in group)
        if os.preadv(fd, group, offset) != want:
            return False
        offset += want
    return True
