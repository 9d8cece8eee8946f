"""The supervisor and its workers as real processes: crashes, boot failures, drain, restart."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import http.client
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
from helpers.common import ROOT, free_port, unique_slab_name, wait_for
from helpers.server_http import request, stats
from helpers.server_procs import eg_kv_check, gone, upload_in_flight, workers_of
from helpers.tenants import token_of, write_tokens

from eg_kv.procs import private_memory
from eg_kv.slab.store import Slab

MiB = 1024 * 1024


RETRIES: list[str] = []


def _retry(call, attempts: int = 30):
    """Run ``call`` until it returns without a connection error or a 503 (a retrying client)."""
    last = None
    for _ in range(attempts):
        try:
            reply = call()
        except (OSError, http.client.HTTPException) as e:
            last = e
            RETRIES.append(type(e).__name__)
            continue
        if reply.status != 503:
            return reply
        last = reply
    raise AssertionError(f"gave up after {attempts} attempts: {last!r}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_workers_under_load(server_factory):
    """Kill workers mid PUT/GET load: retrying clients finish, every acked block is intact."""
    srv = server_factory(workers=2, capacity="64MiB")
    acked: dict[str, bytes] = {}
    lock = threading.Lock()
    failures: list[str] = []
    done = threading.Event()
    nclients, nputs = 4, 30
    deadline = time.monotonic() + 100

    def client(cid: int) -> None:
        rng = random.Random(cid)
        mine: list[str] = []
        try:
            for i in range(nputs):
                if time.monotonic() > deadline:
                    failures.append(f"client {cid} ran out of time at {i}")
                    return
                addr = f"crash-{cid}-{i}"
                data = rng.randbytes(rng.randrange(1_000, 700_000))
                r = _retry(lambda a=addr, d=data: request(srv, "PUT", f"/kv/{a}", d, timeout=10))
                if r.status not in (200, 201):
                    failures.append(f"PUT {addr}: {r}")
                    return
                mine.append(addr)
                with lock:
                    acked[addr] = hashlib.sha256(data).digest()
                probe = rng.choice(mine)
                r = _retry(lambda p=probe: request(srv, "GET", f"/kv/{p}", timeout=10))
                if r.status != 200 or hashlib.sha256(r.body).digest() != acked[probe]:
                    failures.append(f"GET {probe}: {r.status}, {len(r.body)} bytes, wrong bytes")
        except Exception as e:
            failures.append(f"client {cid}: {e!r}")

    threads = [threading.Thread(target=client, args=(c,)) for c in range(nclients)]
    for t in threads:
        t.start()
    replaced_in: list[float] = []
    cut: list[socket.socket] = []
    try:
        for k in range(3):
            wait_for(lambda k=k: len(acked) >= (k + 1) * 20 or failures, timeout=60, what="load")
            # Besides the load, an upload is surely in flight on the victim: start one
            # and kill the worker that holds its connection.
            upload, victim = upload_in_flight(srv, f"cut-{k}")
            cut.append(upload)
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            wait_for(
                lambda v=victim: (
                    len(w := workers_of(srv)) == 2
                    and v not in w
                    and (srv.healthz() or {}).get("workers_up") == 2
                ),
                timeout=10,
                what="a replacement worker",
            )
            replaced_in.append(time.monotonic() - t0)
    finally:
        for t in threads:
            t.join(120)
        done.set()
        for upload in cut:
            upload.close()
    assert not failures, failures
    print(f"replaced in {replaced_in}; requests retried: {RETRIES}")
    assert len(acked) == nclients * nputs
    assert max(replaced_in) < 1.0, f"replacements took {replaced_in}"
    assert srv.log().count("replacing it") == 3

    wait_for(lambda: stats(srv)["reserved_pages"] == 0, timeout=10, what="dead uploads freed")
    check = eg_kv_check(srv.slab_name)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "clean" in check.stdout
    s = stats(srv)
    assert s["unique_blocks"] == len(acked) and s["evictions"] == 0
    for addr, digest in acked.items():
        r = request(srv, "GET", f"/kv/{addr}")
        assert r.status == 200 and hashlib.sha256(r.body).digest() == digest, addr
    for k in range(3):  # the uploads cut by the kills left nothing behind
        assert request(srv, "HEAD", f"/kv/cut-{k}").status == 404


def _run_dirs(port: int) -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"eg-kv-{port}-*")))


def test_workers_exit_when_supervisor_dies_and_next_start_cleans_up(server_factory):
    srv = server_factory(workers=2)
    workers = workers_of(srv)
    assert len(workers) == 2
    left = _run_dirs(srv.port)
    assert len(left) == 1
    with open(os.path.join(next(iter(left)), "owner")) as f:
        assert int(f.read()) == srv.pid
    # A directory whose owner still runs (this test) is not touched by the next start.
    alive = tempfile.mkdtemp(prefix=f"eg-kv-{srv.port}-")
    try:
        with open(os.path.join(alive, "owner"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(10)
        wait_for(lambda: all(gone(p) for p in workers), timeout=10, what="orphaned workers to exit")
        assert left <= _run_dirs(srv.port), "SIGKILL leaves the run directory behind"
        # Its slab survives for a warm restart; a new server re-attaches it (owner is dead)
        # and removes the run directory the killed one left on this address.
        again = server_factory(workers=1, slab_name=srv.slab_name, port=srv.port)
        assert "re-attached" in again.log()
        assert stats(again)["unique_blocks"] == 0
        now = _run_dirs(srv.port)
        assert not left & now, "the dead supervisor's run directory was removed"
        assert alive in now and len(now) == 2, now
    finally:
        shutil.rmtree(alive, ignore_errors=True)


def test_port_taken_stops_with_reason(server_factory):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        srv = server_factory(workers=2, port=port, wait=False)
        assert srv.proc.wait(30) == 3
    assert "taken" in srv.log(), srv.log()
    assert not Slab.exists_named(srv.slab_name), "a server that never served leaves no slab"


def test_port_of_another_eg_kv_is_taken(server_factory):
    first = server_factory(workers=1)
    second = server_factory(workers=1, port=first.port, wait=False)
    assert second.proc.wait(30) == 3
    assert "taken" in second.log()
    assert request(first, "GET", "/healthz").status == 200


def test_two_servers_started_together_on_one_port_do_not_both_serve(server_factory):
    """The second starts while the first still makes its slab (nothing listens yet): the
    probe of the port passed for both, and both served it through SO_REUSEPORT, each
    client's blocks landing in one of two caches. The first holds the port's claim from
    its start."""
    port = free_port()
    first = server_factory(workers=1, port=port, capacity="2GiB", wait=False)
    claim = f"eg-kv-{os.getuid()}-port-{port}.lock"
    wait_for(lambda: os.path.exists(os.path.join("/tmp", claim)), timeout=30,
             interval=0.005, what="the first server's claim")  # fmt: skip
    second = server_factory(workers=1, port=port, wait=False)
    assert second.proc.wait(30) == 3
    assert f"taken by another eg-kv (pid {first.proc.pid}), starting" in second.log()

    def serving() -> bool:
        try:
            return request(first, "GET", "/healthz").status == 200
        except OSError:
            return False

    wait_for(serving, timeout=60, what="the first server")
    assert first.stop() == 0
    assert not os.path.exists(os.path.join("/tmp", claim))  # its claim went


def test_sigterm_drains_in_flight_upload(server_factory):
    srv = server_factory(workers=1, extra=("--drain-timeout", "20"))
    data = os.urandom(4 * MiB)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
        s.sendall(b"PUT /kv/drained HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(data))
        s.sendall(data[:MiB])
        wait_for(lambda: stats(srv)["reserved_pages"] > 0, timeout=10, what="upload started")
        srv.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
            except ConnectionRefusedError:
                return True
            return False

        wait_for(refused, timeout=10, what="the listener to close")
        assert srv.proc.poll() is None, "the supervisor waits for the in-flight upload"
        s.sendall(data[MiB:])
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 201 "), reply
    assert srv.proc.wait(30) == 0
    assert not Slab.exists_named(srv.slab_name), "the slab is unlinked without --keep"
    assert "removed" in srv.log()


@pytest.mark.slow
def test_drain_timeout_cuts_a_stalled_upload(server_factory):
    srv = server_factory(workers=1, extra=("--drain-timeout", "1", "--keep"))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
        s.sendall(b"PUT /kv/stalled HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % MiB)
        s.sendall(b"x" * 1000)
        wait_for(lambda: stats(srv)["reserved_pages"] > 0, timeout=10, what="upload started")
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
    with Slab.attach(srv.slab_name) as slab:
        assert slab.check() == [] and slab.stats()["reserved_pages"] == 0
        assert not slab.exists("stalled")


def test_sigint_stops_like_sigterm(server_factory):
    srv = server_factory(workers=2)
    workers = workers_of(srv)
    assert srv.stop(signal.SIGINT) == 0
    assert all(gone(p) for p in workers)
    assert not Slab.exists_named(srv.slab_name)


def test_a_slab_name_without_its_slash_is_removed_at_exit(server_factory):
    name = unique_slab_name("bare")
    srv = server_factory(workers=1, slab_name=name.lstrip("/"))
    assert request(srv, "PUT", "/kv/b0", b"x" * 100).status == 201
    assert srv.stop() == 0
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(name[1:])], srv.log()


@pytest.mark.slow
def test_warm_restart_with_keep(server_factory):
    name = unique_slab_name("warm")
    first = server_factory(workers=2, slab_name=name, extra=("--keep",))
    blocks = {f"w{i}": os.urandom(50_000 + i) for i in range(6)}
    for addr, data in blocks.items():
        assert request(first, "PUT", f"/kv/{addr}", data).status == 201
    assert request(first, "PUT", "/kv/w0", blocks["w0"]).status == 200
    assert first.stop() == 0
    assert Slab.exists_named(name), "--keep leaves the slab"

    # The same port at once: connections of the first run in TIME_WAIT do not block it.
    second = server_factory(workers=2, slab_name=name, port=first.port)
    assert "re-attached" in second.log()
    for addr, data in blocks.items():
        assert request(second, "GET", f"/kv/{addr}").body == data
    s = stats(second)
    assert (s["unique_blocks"], s["total_refs"]) == (6, 7)
    assert second.stop() == 0
    assert not Slab.exists_named(name), "without --keep the slab goes at exit"


def _serving(srv, workers: int) -> bool:
    assert srv.proc.poll() is None, srv.log()
    return bool((h := srv.healthz()) and h.get("workers_up") == workers)


def test_a_start_that_fails_leaves_the_slab_it_found(server_factory, tmp_path):
    """A warm slab outlives a start that re-attached it and then failed before serving
    (here the tenants of its tokens file no longer fit the slab's namespace table, which
    keeps the first server's): the next start with the first tokens file serves its
    blocks."""
    name = unique_slab_name("failwarm")
    first_tokens = write_tokens(tmp_path / "a.toml", [{"name": f"a{i:04d}"} for i in range(2100)])
    other_tokens = write_tokens(tmp_path / "b.toml", [{"name": f"b{i:04d}"} for i in range(2100)])
    first = server_factory(
        workers=1, slab_name=name, extra=("--keep", "--tokens", str(first_tokens))
    )
    assert request(first, "PUT", "/kv/kept", b"kept bytes", token=token_of("a0000")).status == 201
    assert first.stop() == 0
    second = server_factory(workers=1, slab_name=name, port=first.port, wait=False,
                            extra=("--tokens", str(other_tokens)))  # fmt: skip
    assert second.proc.wait(60) == 1, second.log()
    assert "re-attached" in second.log() and "namespace table is full" in second.log()
    assert "left as it was found" in second.log()
    assert Slab.exists_named(name), "the failed start removed the slab it found"
    third = server_factory(workers=1, slab_name=name, port=first.port,
                           extra=("--tokens", str(first_tokens)))  # fmt: skip
    assert request(third, "GET", "/kv/kept", token=token_of("a0000")).body == b"kept bytes"


@pytest.mark.timeout(120)
def test_a_stopped_worker_of_a_dead_server_keeps_its_slab_from_a_new_start(server_factory):
    """The supervisor SIGKILLed, one of its workers SIGSTOPped (it still maps the slab and
    would write into it when continued): a new server on that slab refuses, naming the
    pid, rather than repair and serve a slab another process writes."""
    name = unique_slab_name("stopped")
    first = server_factory(workers=2, slab_name=name)
    assert request(first, "PUT", "/kv/before", b"before").status == 201
    victim, other = sorted(workers_of(first))
    os.kill(victim, signal.SIGSTOP)
    try:
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(10)
        wait_for(lambda: gone(other), timeout=20, what="the running worker to exit")
        second = server_factory(workers=1, slab_name=name, wait=False)
        assert second.proc.wait(60) == 1, second.log()
        assert f"still written by pid(s) {victim} (stopped: {victim})" in second.log()
        assert Slab.exists_named(name)
    finally:
        os.kill(victim, signal.SIGKILL)
    wait_for(lambda: gone(victim), timeout=20, what="the stopped worker to die")
    third = server_factory(workers=1, slab_name=name)
    assert "re-attached" in third.log()
    assert request(third, "GET", "/kv/before").body == b"before"


@pytest.mark.timeout(120)
def test_a_new_start_waits_for_a_dead_servers_draining_worker(server_factory):
    """The supervisor SIGKILLed while a worker receives an upload: the worker drains (it
    gets SIGTERM) and still writes the block into the slab. A new server on that slab waits
    for it to exit before it repairs the slab, and then serves the block it finished."""
    name = unique_slab_name("draining")
    first = server_factory(workers=1, slab_name=name, extra=("--drain-timeout", "60"))
    s, worker = upload_in_flight(first, "drained")
    with s:
        wait_for(lambda: stats(first)["reserved_pages"] > 0, timeout=10, what="upload started")
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(10)
        second = server_factory(workers=1, slab_name=name, wait=False)
        wait_for(lambda: f"waiting for pid(s) {worker}" in second.log(), timeout=30,
                 what="the new start to wait for the draining worker")  # fmt: skip
        assert "re-attached" not in second.log() and not gone(worker)
        s.sendall(b"u" * (3 * MiB))  # the rest of the body: upload_in_flight sent 1 MiB
        assert s.recv(65536).startswith(b"HTTP/1.1 201 ")
    wait_for(lambda: gone(worker), timeout=30, what="the draining worker to exit")
    wait_for(lambda: _serving(second, 1), timeout=60, what="the new server to serve")
    assert "re-attached" in second.log()
    assert request(second, "GET", "/kv/drained").body == b"u" * (4 * MiB)


def test_a_kept_slab_whose_owner_pid_was_reused_is_taken_again(server_factory):
    """The slab records its owner's pid; after a restart (a container's pids are small and
    reused) that pid may be another process's: every start was refused, --fresh too. An
    owner is a running process that maps the slab."""
    import struct

    from eg_kv.slab import layout as L

    name = unique_slab_name("reused")
    first = server_factory(workers=1, slab_name=name, extra=("--keep",))
    assert request(first, "PUT", "/kv/kept", b"kept").status == 201
    assert first.stop() == 0
    other = subprocess.Popen(["sleep", "60"])  # whatever got the old pid
    try:
        with open("/dev/shm" + name, "r+b") as f:
            f.seek(L.OWNER_PID_OFFSET)
            f.write(struct.pack("=q", other.pid))
        second = server_factory(workers=1, slab_name=name, port=first.port)
        assert "re-attached" in second.log()
        assert request(second, "GET", "/kv/kept").body == b"kept"
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("extra", [(), ("--fresh",)], ids=["plain", "fresh"])
def test_a_running_servers_slab_is_refused_to_a_second_server(server_factory, extra):
    """Another port, the same --slab-name: the first server's slab belongs to it (a
    running process that maps it, by inode: it was made under another name and linked),
    and the second stops, --fresh or not."""
    name = unique_slab_name("taken")
    first = server_factory(workers=1, slab_name=name)
    assert request(first, "PUT", "/kv/mine", b"mine").status == 201
    second = server_factory(workers=1, slab_name=name, extra=extra, wait=False)
    assert second.proc.wait(30) == 1
    assert f"belongs to a running eg-kv (pid {first.proc.pid})" in second.log()
    assert request(first, "GET", "/kv/mine").body == b"mine"


def test_fresh_discards_a_kept_slab(server_factory):
    name = unique_slab_name("fresh")
    first = server_factory(workers=1, slab_name=name, extra=("--keep",))
    assert request(first, "PUT", "/kv/old", b"old").status == 201
    assert first.stop() == 0
    second = server_factory(workers=1, slab_name=name, extra=("--fresh",))
    assert request(second, "GET", "/kv/old").status == 404
    assert stats(second)["unique_blocks"] == 0


def test_slab_of_a_live_server_is_refused(server_factory):
    first = server_factory(workers=1)
    second = server_factory(workers=1, slab_name=first.slab_name, wait=False)
    assert second.proc.wait(30) == 1
    assert f"pid {first.pid}" in second.log()
    assert request(first, "GET", "/healthz").status == 200


@pytest.mark.slow
def test_slab_of_other_sizes_is_refused(server_factory):
    name = unique_slab_name("sizes")
    first = server_factory(workers=1, slab_name=name, capacity="32MiB", extra=("--keep",))
    assert first.stop() == 0
    second = server_factory(workers=1, slab_name=name, capacity="64MiB", wait=False)
    assert second.proc.wait(30) == 1
    assert "--fresh" in second.log() and "32MiB" in second.log()
    assert Slab.exists_named(name), "a refused start does not destroy the kept blocks"


@pytest.mark.slow
def test_worker_memory_stays_small_under_14mib_traffic(server_factory):
    """4 clients move 14 MiB blocks through one worker: its private memory (anonymous
    pages: the slab's pages it maps are shared memory) stays small."""
    srv = server_factory(workers=1, capacity="256MiB")  # room for all 12 blocks: no eviction
    worker = psutil.Process(next(iter(workers_of(srv))))
    failures: list[str] = []
    idle = private_memory(worker.pid)
    peak = [idle]
    done = threading.Event()

    def sample():
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                peak.append(private_memory(worker.pid))
            done.wait(0.02)

    def client(cid: int) -> None:
        data = os.urandom(14 * MiB)
        try:
            for i in range(3):
                put = request(srv, "PUT", f"/kv/m{cid}-{i}", data)
                got = request(srv, "GET", f"/kv/m{cid}-{i}")
                if put.status != 201 or got.body != data:
                    failures.append(f"client {cid} block {i}: {put}, {got.status}")
        except Exception as e:
            failures.append(f"client {cid}: {e!r}")

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        clients = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(60)
    finally:
        done.set()
        sampler.join()
    assert not failures, failures
    assert max(peak) < 120 * MiB, f"private memory peaked at {max(peak) / MiB:.0f} MiB"
    # Once quiet, the worker hands freed buffers back (glibc malloc_trim).
    wait_for(lambda: private_memory(worker.pid) < idle + 16 * MiB, timeout=10,
             what="private memory back near its idle level")  # fmt: skip


def test_sigterm_during_startup_still_cleans_up(server_factory):
    srv = server_factory(workers=2, wait=False)
    wait_for(lambda: Slab.exists_named(srv.slab_name) or srv.proc.poll() is not None,
             timeout=30, what="the slab to be created")  # fmt: skip
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.log()
    assert not Slab.exists_named(srv.slab_name)
    assert not _run_dirs(srv.port)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [(("--capacity", "64TiB"), "free but the slab needs"), (("--workers", "0"), "at least 1"),
     (("--capacity", "lots"), "not a size"), (("--tls-cert", "only-a-cert.pem"), "both"),
     (("--slab-name", "a/b"), "bad slab name")],
)  # fmt: skip
def test_bad_settings_exit_1_with_reason(extra, reason):
    cmd = [sys.executable, "-m", "workers", "serve", "--addr", f"127.0.0.1:{free_port()}",
           "--slab-name", unique_slab_name("bad"), *extra]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert reason in out.stderr
