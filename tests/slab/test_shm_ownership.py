"""The server uses only shared memory its own user owns alone, and counts all it needs.

Issue 21 items 1 and 2. "Another local user" is a real one: a forked child that became
uid 65534 (nobody) creates its segments, as `eg-kv serve --keep` under that uid would.
Tests run as root (here and in CI), which bypasses permissions: every refusal checked
here is the explicit owner/mode check, not the kernel's.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.common import ROOT, free_port, unique_slab_name, wait_for

from eg_kv.config import DEFAULT_EVENTS
from eg_kv.errors import SlabError
from eg_kv.slab import layout as L
from eg_kv.slab.events import events_size
from eg_kv.slab.local import LocalInfo, LocalSlab, LocalUnavailable
from eg_kv.slab.store import Slab

KiB, MiB = 1024, 1024 * 1024
NOBODY = 65534
SHM = "/dev/shm"


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests need root, as CI runs them, to become another user")


@pytest.fixture
def shm_name():
    """A fresh slab name; afterwards its segments are removed, whoever owns them."""
    name = unique_slab_name("own")
    yield name
    left = [SHM + "/" + e for e in os.listdir(SHM) if e.startswith(name[1:] + ".creating-")]
    for path in (SHM + name, SHM + name + L.READERS_SUFFIX, *left):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def as_nobody(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child that became uid/gid 65534; fail if it failed."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's process failed"


def foreign_segment(name: str, data: bytes, mode: int = 0o666) -> os.stat_result:
    """Segment ``name``, created exclusively by uid 65534 with ``mode`` and ``data``."""

    def make() -> None:
        fd = os.open(SHM + name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)  # past the umask, as `chmod` would
            os.write(fd, data)
        finally:
            os.close(fd)

    as_nobody(make)
    st = os.stat(SHM + name)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, mode)
    return st


def data(path: str) -> bytes:
    return Path(path).read_bytes()


def same_file(a: os.stat_result, path: str) -> bool:
    try:
        b = os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def serve(name: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{port}",
            "--workers", "1", "--capacity", "1MiB", "--page-size", "64KiB",
            "--max-block-size", "1MiB", "--slab-name", name, *extra]  # fmt: skip


def refusal(srv_or_log: str) -> str:
    """The one log line that refused a segment (and no traceback)."""
    lines = [line for line in srv_or_log.splitlines() if "is owned by uid" in line]
    assert len(lines) == 1 and "Traceback" not in srv_or_log, srv_or_log
    return lines[0]


# ---------------------------------------------------------------- item 1: ownership


def refused_start(server_factory, shm_name: str) -> str:
    """Start a server on ``shm_name``; assert that it exits 1; return its refusal line."""
    srv = server_factory(workers=1, capacity="1MiB", slab_name=shm_name, wait=False,
                         extra=("--max-block-size", "1MiB"))  # fmt: skip
    wait_for(lambda: srv.proc.poll() is not None or srv.healthz(), timeout=60,
             what="the server to refuse or serve")  # fmt: skip
    code = srv.proc.poll()
    assert code == 1, f"it served on another user's segment (exit {code}):\n{srv.log()}"
    return refusal(srv.log())


@pytest.mark.timeout(90)
def test_a_slab_another_user_left_is_refused_not_adopted(server_factory, shm_name):
    """`eg-kv serve --keep` under another uid, then chmod 0666: HEAD re-attached it, and
    its owner could rewrite blocks under the server. Now: exit 1, named, left alone."""

    def left_by_another_user() -> None:
        slab = Slab.create(shm_name, 1 * MiB, page_size=64 * KiB, max_block_size=MiB)
        slab.put("a", b"theirs")
        slab.close()
        os.chmod(SHM + shm_name, 0o666)

    as_nobody(left_by_another_user)  # its owner pid (the child) is gone: "warm restart"
    theirs = os.stat(SHM + shm_name)
    before = data(SHM + shm_name)
    line = refused_start(server_factory, shm_name)
    assert f"{shm_name} (/dev/shm{shm_name}) is owned by uid 65534 (nobody) with mode 0666" in line
    assert "another --slab-name" in line and f"remove /dev/shm{shm_name}" in line
    # Neither used nor removed: the same file, not a byte changed (no claim, no retire).
    assert same_file(theirs, SHM + shm_name)
    assert data(SHM + shm_name) == before
    # --fresh does not remove another user's segment either.
    out = subprocess.run(serve(shm_name, free_port(), "--fresh"), cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1 and "owned by uid 65534" in refusal(out.stderr), out.stderr
    assert same_file(theirs, SHM + shm_name)


@pytest.mark.timeout(90)
def test_a_readers_segment_another_user_made_first_is_refused(server_factory, shm_name):
    """HEAD opened `<slab>.readers` with O_CREAT and adopted another user's 0666 file
    (truncating it then SIGBUSed the supervisor). Now: exit 1, and the slab it had just
    made is removed again; the other user's file is untouched."""
    readers = shm_name + L.READERS_SUFFIX
    theirs = foreign_segment(readers, b"x" * 4096)
    assert f"{readers} (/dev/shm{readers}) is owned by uid 65534" in refused_start(
        server_factory, shm_name
    )
    assert not os.path.exists(SHM + shm_name), "the half-made slab was left behind"
    assert same_file(theirs, SHM + readers)
    assert data(SHM + readers) == b"x" * 4096


def test_attach_refuses_segments_of_another_user_or_open_to_others(shm_name):
    """Workers, warm restarts and `eg-kv check` attach: each segment is checked on its
    descriptor before it is mapped; a same-user leftover readers segment is replaced."""
    slab = Slab.create(shm_name, 1 * MiB, page_size=64 * KiB, max_block_size=MiB)
    slab.put("a", b"mine")
    slab.close()
    path, readers = SHM + shm_name, SHM + shm_name + L.READERS_SUFFIX
    os.chmod(path, 0o660)  # group may write it
    with pytest.raises(SlabError, match=r"is owned by uid 0 \(root\) with mode 0660"):
        Slab.attach(shm_name)
    os.chmod(path, 0o600)
    os.chown(path, NOBODY, NOBODY)  # another user's (root made it, as `chown` would)
    with pytest.raises(SlabError, match=r"is owned by uid 65534 \(nobody\) with mode 0600"):
        Slab.attach(shm_name)
    os.chown(path, 0, 0)
    # Another user's readers segment in place of the slab's own.
    good = data(readers)
    os.unlink(readers)
    theirs = foreign_segment(shm_name + L.READERS_SUFFIX, good)
    with pytest.raises(SlabError, match=r"\.readers \(/dev/shm.*\) is owned by uid 65534"):
        Slab.attach(shm_name)
    assert same_file(theirs, readers) and data(readers) == good
    os.unlink(readers)
    with Slab.attach(shm_name) as again:  # a missing one is made anew, the user's own
        assert again.get("a") == b"mine"
        st = os.stat(readers)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    # A new slab replaces a leftover readers segment of its own user's, never adopts it.
    Slab.unlink_named(shm_name)
    fd = os.open(readers, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b"\xff" * 70000)
    os.close(fd)
    stale = os.stat(readers)
    with Slab.create(shm_name, 1 * MiB, page_size=64 * KiB, max_block_size=MiB) as fresh:
        assert not same_file(stale, readers)
        assert fresh._reader_counts() == {}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("taker", ["another user", "the same user"])
def test_stop_removes_only_the_segments_this_server_made(server_factory, taker):
    """The slab's names removed under a running server (an operator's `rm`) and taken
    by another program: at stop HEAD retired and unlinked that program's segments."""
    srv = server_factory(workers=1, capacity="4MiB")
    name = srv.slab_name
    rname = name + L.READERS_SUFFIX
    for path in (SHM + name, SHM + rname):
        os.unlink(path)
    try:
        if taker == "another user":
            took = [foreign_segment(n, b"theirs" * 1000) for n in (name, rname)]
        else:  # an eg-kv slab of the same user under the name: HEAD would retire it
            other = Slab.create(name, 1 * MiB, page_size=64 * KiB, max_block_size=MiB)
            other.close()
            took = [os.stat(SHM + name), os.stat(SHM + rname)]
        before = [data(SHM + n) for n in (name, rname)]
        assert srv.stop(signal.SIGTERM) == 0, srv.log()
        for st, n, was in zip(took, (name, rname), before, strict=True):
            assert same_file(st, SHM + n), f"{n} was removed at stop"
            assert data(SHM + n) == was, f"{n} was written at stop"
        assert "no longer points at this server's segment" in srv.log()
        if taker == "the same user":  # still a live slab to its readers: not retired
            head = data(SHM + name)
            assert struct.unpack_from("=q", head, L.STATE_OFFSET + 8 * L.ST_RETIRED) == (0,)
    finally:
        for n in (name, rname):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM + n)


def test_a_local_reader_refuses_segments_not_the_servers_users_alone(shm_name):
    """A client that maps the slab (as root, it can open anything) reads only segments
    the server's uid owns with mode 0600: HEAD read another user's, or a 0644 one."""
    slab = Slab.create(shm_name, 1 * MiB, page_size=64 * KiB, max_block_size=MiB)
    try:
        slab.put("a", b"A" * 100)
        doc = LocalInfo.of(slab.name, slab.slab_id, slab.geometry.total_size, 0)
        with LocalSlab.open(LocalInfo.from_json(doc)) as local:
            assert local.get("a") == b"A" * 100
        path, readers = SHM + shm_name, SHM + shm_name + L.READERS_SUFFIX
        os.chmod(path, 0o644)
        with pytest.raises(LocalUnavailable, match="owned by uid 0 with mode 0644"):
            LocalSlab.open(LocalInfo.from_json(doc))
        os.chmod(path, 0o600)
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(LocalUnavailable, match="owned by uid 65534 with mode 0600"):
            LocalSlab.open(LocalInfo.from_json(doc))
        os.chown(path, 0, 0)
        # The server says which uid it runs as: a segment of any other is not its own.
        assert doc["uid"] == os.geteuid()
        with pytest.raises(LocalUnavailable, match="not by the server's uid 65534"):
            LocalSlab.open(LocalInfo.from_json({**doc, "uid": NOBODY}))
        good = data(readers)  # another user's readers segment, same header
        os.unlink(readers)
        foreign_segment(shm_name + L.READERS_SUFFIX, good)
        with pytest.raises(LocalUnavailable, match=r"\.readers here is owned by uid 65534"):
            LocalSlab.open(LocalInfo.from_json(doc))
    finally:
        slab.close()


# ---------------------------------------------------------------- item 2: room


def _private_shm_ok() -> bool:
    """Whether this machine lets us mount a small tmpfs over /dev/shm privately."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs "
                            f"{SHM}"], capture_output=True, timeout=30)  # fmt: skip
    return probe.returncode == 0


def _in_small_shm(size: int, cmd: list[str]) -> list[str]:
    """``cmd`` in a private mount namespace whose /dev/shm is a tmpfs of ``size`` bytes."""
    kib = size // KiB
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={kib}k tmpfs {SHM} && exec "$@"',
            "sh", *cmd]  # fmt: skip


@pytest.mark.timeout(120)
def test_room_for_the_slab_but_not_its_readers_is_refused_not_sigbus(tmp_path):
    """HEAD checked /dev/shm for the slab alone and touched the unallocated readers
    segment: the supervisor died of SIGBUS with an empty log. Now: exit 1, the
    documented message, sizes in human units; with room for both it serves."""
    if not _private_shm_ok():
        pytest.skip("needs `unshare -m` and a tmpfs mount (root in a namespace that allows it)")
    g = L.Geometry.plan(1 * MiB, 64 * KiB, 1 * MiB)
    slab_size, readers_size = g.total_size, L.readers_size(g.nslots)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = math.ceil(slab_size / page)
    assert readers_size > page  # so one page more than the slab holds no readers segment
    name = unique_slab_name("room")
    log = tmp_path / "small.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_in_small_shm((pages + 1) * page, serve(name, free_port())),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = log.read_text(errors="replace")
    assert code == 1, f"exit {code} (-7 is SIGBUS):\n{text}"
    message = (
        r"/dev/shm has [\d.]+ [KMG]iB free but the slab needs [\d.]+ [KMG]iB "
        r"\(slab [\d.]+ MiB \+ readers [\d.]+ KiB\): lower --capacity or enlarge /dev/shm "
        r"\(docker: shm_size\)"
    )
    assert re.search(message, text), text
    assert "Traceback" not in text
    # Room for both (each rounded up to whole pages) and the event log (default size): it
    # starts, serves and stops cleanly.
    events = math.ceil(events_size(DEFAULT_EVENTS) / page)
    both = (pages + math.ceil(readers_size / page) + events) * page
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(_in_small_shm(both, serve(name, port)), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: proc.poll() is not None or "serving http://" in log.read_text(),
                 timeout=60, what="the server to start")  # fmt: skip
        assert proc.poll() is None, log.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, log.read_text()


def test_sizes_in_messages_are_for_people():
    from eg_kv.units import human_size

    assert human_size(1258291 * KiB) == "1.2 GiB"
    assert human_size(65632) == "64.1 KiB"
    assert human_size(3 * MiB) == "3 MiB"
    assert human_size(1023) == "1023 B"


def test_a_creator_killed_while_it_allocates_leaves_nothing_that_blocks_the_next(shm_name):
    """SIGKILL (the OOM killer's) while a slab is allocated: the name was left holding a
    segment of 0 bytes that every later start refused as not an eg-kv slab, --fresh
    included. It is made under a name of its own now, linked once formatted, and the
    next create sweeps what a dead creator left."""
    base = shm_name.lstrip("/")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child dies by SIGKILL
        try:
            Slab.create(shm_name, 2048 * MiB, page_size=64 * KiB, prefault=True)
        finally:
            os._exit(1)
    try:
        wait_for(lambda: any(e.startswith(base) for e in os.listdir(SHM)), timeout=30,
                 interval=0.001, what="the segment to appear")  # fmt: skip
        os.kill(pid, signal.SIGKILL)
    finally:
        os.waitpid(pid, 0)
    left = [e for e in os.listdir(SHM) if e.startswith(base)]
    assert left == [f"{base}.creating-{pid}"], left  # never the name itself, half made
    slab = Slab.create(shm_name, 64 * MiB, page_size=64 * KiB)
    try:
        slab.put("a", b"x")
        assert slab.get("a") == b"x"
        assert sorted(e for e in os.listdir(SHM) if e.startswith(base)) == [
            base, base + L.READERS_SUFFIX.lstrip("/")]  # fmt: skip
    finally:
        slab.close()
        slab.unlink()


def test_a_half_made_slab_left_under_this_processs_pid_is_swept(shm_name):
    """A container starts again with the same small pids: the dead creator's leftover
    carried this process's pid, and every create said the slab "exists already"."""
    base = shm_name.lstrip("/")
    leftover = os.path.join(SHM, f"{base}.creating-{os.getpid()}")
    fd = os.open(leftover, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8 * MiB)  # half allocated
    os.close(fd)
    slab = Slab.create(shm_name, 64 * MiB, page_size=64 * KiB)
    try:
        assert not os.path.exists(leftover)
        assert slab.put("a", b"x") and slab.get("a") == b"x"
    finally:
        slab.close()
        slab.unlink()
