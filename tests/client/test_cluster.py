"""A server set behind every client: real servers on loopback, one SIGKILLed; a real DNS
server (dnslib) whose SRV records gain a member during the test."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import trustme
from helpers.common import ROOT, wait_for
from helpers.dns_zone import pod
from helpers.server_procs import gone, workers_of
from helpers.server_sets import SRV_NAME, set_url, start_set

from eg_kv.client.aio_connectors import AsyncRemoteKVConnector
from eg_kv.client.aio_sets import AsyncClusterConnector
from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.client.sets import ClusterConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.errors import ConfigError


def sigkill(srv) -> None:
    """SIGKILL a server: its supervisor and its workers, as a lost host."""
    pids = [srv.pid, *workers_of(srv)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    srv.proc.wait(10)
    wait_for(lambda: all(gone(p) for p in pids), timeout=10, what="the killed server's processes")


def test_a_set_in_base_url_and_a_set_of_one_is_the_direct_client():
    one = RemoteKVConnector(base_url="http://127.0.0.1:1")
    assert type(one) is RemoteKVConnector  # today's direct path, no placement
    one.close()
    many = RemoteKVConnector(base_url="http://127.0.0.1:1,http://127.0.0.1:2", timeout_s=0.5)
    assert isinstance(many, ClusterConnector)
    assert set(many.router.view().members) == {"127.0.0.1:1", "127.0.0.1:2"}
    many.close()
    env = {"EPISTEMIC_GRAPH_KVCACHE_URL": "http://127.0.0.1:1, http://127.0.0.1:2"}
    assert not KvCacheConfig.from_env(env).single
    assert KvCacheConfig(base_url="dnssrv+http://_http._tcp.x.svc").base_url.startswith("dnssrv+")
    for bad in ("ftp://h:1", "http://h:1,,http://h:2", "http://u:p@h:1,http://h:2",
                "dnssrv+http://x:53"):  # fmt: skip
        with pytest.raises(ConfigError):
            KvCacheConfig(base_url=bad)


@pytest.mark.slow
def test_batches_split_by_member_merged_in_order_one_request_each(server_factory):
    servers = start_set(server_factory)
    with RemoteKVConnector(base_url=set_url(servers), timeout_s=5) as kv:
        keys = [f"prefix{i:03d}" for i in range(16)]
        for i, k in enumerate(keys):
            if i != 10:
                assert kv.put(k, k.encode())
        homes = {kv.router.home(k)[1] for k in keys}
        assert len(homes) == 3, "16 keys land on every member"
        calls: dict[str, int] = {}
        for member_id in homes:
            conn = kv._members.get(kv.router.view(), member_id)
            real = conn.try_exists_addresses

            def counted(addresses, real=real, member_id=member_id):
                calls[member_id] = calls.get(member_id, 0) + 1
                return real(addresses)

            conn.try_exists_addresses = counted
        found = kv.exists_many(keys)
        assert found == [i != 10 for i in range(16)]  # the caller's order
        assert calls == {m: 1 for m in homes}  # one round trip per member
        assert kv.contains_prefix(keys) == 10  # counted over the merged order
        assert [kv.get(k) for k in keys[:3]] == [k.encode() for k in keys[:3]]
        total = kv.stats()
        lines = kv.member_stats()
        assert total.unique_blocks == 15 == sum(line.stats.unique_blocks for line in lines)
        assert total.extra["capacity_bytes"] == sum(
            line.stats.extra["capacity_bytes"] for line in lines
        )
        # Each member's weight is its capacity, read from its /kv/stats.
        assert kv.router.view().placement.weights == {
            line.member.id: line.stats.extra["capacity_bytes"] for line in lines
        }


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_killed_member_costs_its_share_never_a_wait(server_factory):
    servers = start_set(server_factory, extra=("--keep",))
    victim = servers[0]
    victim_id = f"127.0.0.1:{victim.port}"
    with RemoteKVConnector(base_url=set_url(servers), timeout_s=5) as kv:
        keys = [f"blk{i:04d}" for i in range(240)]
        for k in keys:
            assert kv.put(k, k.encode() * 8)
        on_victim = [k for k in keys if kv.router.home(k)[1] == victim_id]
        elsewhere = [k for k in keys if k not in on_victim]
        assert on_victim and elsewhere
        sigkill(victim)

        assert kv.get(on_victim[0]) is None  # the first failure: a refused connection
        assert victim_id in kv.router.down()
        assert all(kv.get(k) == k.encode() * 8 for k in elsewhere)  # 100% on live homes
        times = []
        for k in on_victim:
            t = time.perf_counter()
            assert kv.get(k) is None
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"\nops on the dead member's addresses: median {times[len(times) // 2] * 1e3:.2f}"
              f" ms, max {times[-1] * 1e3:.2f} ms over {len(times)}")  # fmt: skip
        assert times[-1] < 0.1, "an op on a dead member's address waited"
        # Writes go to the next-ranked member meanwhile, and read back from there.
        assert kv.put("standin", b"s") and kv.get("standin") == b"s"

        again = server_factory(workers=1, capacity="32MiB", port=victim.port,
                               slab_name=victim.slab_name, extra=("--keep",))  # fmt: skip
        assert again.healthz()
        # Back within back-off (1 s, doubling per failed probe) + a probe tick.
        wait_for(lambda: victim_id not in kv.router.down(), timeout=20, what="the member back")
        hits = sum(kv.get(k) == k.encode() * 8 for k in on_victim)
        assert hits == len(on_victim), f"{hits} of {len(on_victim)} hit after the restart"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_after_a_member_is_added_a_miss_asks_the_previous_home_once(server_factory, dns_server):
    zone, dns_port = dns_server
    servers = start_set(server_factory, n=4)
    zone.set(
        srv={SRV_NAME: [(0, 1, s.port, pod(i)) for i, s in enumerate(servers[:3])]},
        a={pod(i): ["127.0.0.1"] for i in range(4)},
    )
    config = KvCacheConfig(
        base_url=f"dnssrv+http://{SRV_NAME}", refresh_s=4.0,
        dns_server=f"127.0.0.1:{dns_port}", timeout_s=5,
    )  # fmt: skip
    with RemoteKVConnector(config) as kv:
        assert len(kv.router.view().members) == 3
        keys = [f"warm{i:04d}" for i in range(400)]
        for k in keys:
            assert kv.put(k, b"x")
        zone.set(srv={SRV_NAME: [(0, 1, s.port, pod(i)) for i, s in enumerate(servers)]})
        wait_for(lambda: len(kv.router.view().members) == 4, timeout=20, what="the 4th member")
        view = kv.router.view()
        with_previous = sum(kv.exists_many(keys)) / len(keys)
        home_only = sum(
            kv._members.get(view, view.placement.home(k)).exists(k) for k in keys
        ) / len(keys)
        assert time.monotonic() - view.changed_at < view.window_s, "measured inside the window"
        print(f"\nhit rate right after adding a member: {with_previous:.1%} asking the "
              f"previous home once, {home_only:.1%} without")  # fmt: skip
        assert with_previous == 1.0
        assert 0.6 < home_only < 0.9  # about a quarter moved to the empty new member
        # Once the window is over, a miss at the new home stays a miss.
        wait_for(lambda: time.monotonic() - view.changed_at > view.window_s, timeout=20)
        assert sum(kv.exists_many(keys)) / len(keys) == home_only
        # A member that leaves: its connector is closed, its addresses go back.
        zone.set(srv={SRV_NAME: [(0, 1, s.port, pod(i)) for i, s in enumerate(servers[:3])]})
        wait_for(lambda: len(kv.router.view().members) == 3, timeout=20, what="one member less")
        assert len(kv._members._conns) <= 3
        assert all(kv.exists_many(keys))


@pytest.mark.slow
def test_a_member_that_never_answers_costs_one_timeout_then_nothing(server_factory):
    servers = start_set(server_factory, n=2)
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        silent_id = f"127.0.0.1:{silent.getsockname()[1]}"
        url = f"{set_url(servers)},http://{silent_id}"
        with RemoteKVConnector(base_url=url, timeout_s=1.0) as kv:
            keys = [f"quiet{i:03d}" for i in range(60)]
            on_silent = [k for k in keys if kv.router.home(k)[1] == silent_id]
            t = time.perf_counter()
            assert kv.get(on_silent[0]) is None
            took = time.perf_counter() - t
            # The one timeout it costs: not two (the local-slab probe's, then the GET's).
            assert 0.9 <= took < 1.6, took
            assert silent_id in kv.router.down()
            t = time.perf_counter()
            for k in keys:
                assert kv.put(k, b"z")  # to the next-ranked member meanwhile
            assert kv.exists_many(keys) == [True] * len(keys)
            assert (time.perf_counter() - t) / (len(keys) + 1) < 0.1

        async def run_async() -> float:
            async with AsyncRemoteKVConnector(base_url=url, timeout_s=1.0) as akv:
                elsewhere = next(k for k in keys if k not in on_silent)
                await akv.get(elsewhere)  # started: its first weighing waited for the silent one
                t = time.perf_counter()
                assert await akv.get(on_silent[1]) is None
                return time.perf_counter() - t

        took = asyncio.run(run_async())
        assert 0.9 <= took < 1.6, took  # the async set alike


@pytest.mark.slow
def test_the_async_client_over_a_set(server_factory):
    servers = start_set(server_factory)

    async def run() -> tuple:
        # Over HTTP: a SIGKILLed member's slab stays readable on this host, and the
        # test is about a refused request marking the member down.
        kv = AsyncRemoteKVConnector(base_url=set_url(servers), timeout_s=5, local_reads=False)
        assert isinstance(kv, AsyncClusterConnector)
        try:
            keys = [f"async{i:03d}" for i in range(30)]
            for k in keys[:20]:
                assert await kv.put(k, k.encode())
            answers = (await kv.exists_many(keys), await kv.contains_prefix(keys),
                       await kv.get(keys[5]), (await kv.stats()).unique_blocks)  # fmt: skip
            # A SIGKILLed member: one refused request marks it down; the rest still hit.
            dead = kv.router.home(keys[0])[1]  # a member that holds some (ports are random)
            sigkill(next(s for s in servers if f"127.0.0.1:{s.port}" == dead))
            lost = [k for k in keys[:20] if kv.router.home(k)[1] == dead]
            assert await kv.get(lost[0]) is None and dead in kv.router.down()
            kept = [k for k in keys[:20] if k not in lost]
            assert await kv.exists_many(kept) == [True] * len(kept)
            return answers
        finally:
            await kv.close()

    found, prefix, got, blocks = asyncio.run(run())
    assert found == [True] * 20 + [False] * 10 and prefix == 20
    assert got == b"async005" and blocks == 20


@pytest.mark.slow
def test_stats_of_a_set_print_the_sum_and_each_member(server_factory):
    servers = start_set(server_factory)
    with RemoteKVConnector(base_url=set_url(servers)) as kv:
        for i in range(30):
            assert kv.put(f"st{i:03d}", b"y" * 100)
    sigkill(servers[2])
    out = subprocess.run(
        [sys.executable, "-m", "workers", "stats", "--url", set_url(servers), "--timeout", "2"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "2 of 3 member(s) up" in text
    for s in servers[:2]:
        assert any(f"127.0.0.1:{s.port}" in line and " up " in line for line in text.splitlines())
    assert any(f"127.0.0.1:{servers[2].port}" in line and "down" in line
               for line in text.splitlines())  # fmt: skip
    blocks = [
        int(line.split()[1]) for line in text.splitlines() if line.startswith("unique_blocks")
    ]
    members_blocks = [int(line.split()[2]) for line in text.splitlines() if " up " in line]
    assert blocks == [sum(members_blocks)] and 0 < blocks[0] < 30


@pytest.mark.slow
def test_https_members_found_through_dns_verify_their_own_name(
    server_factory,
    dns_server,
    tmp_path,
    monkeypatch,
):
    """A dnssrv+https member is connected at its address (127.0.0.1) and its certificate,
    which names only the SRV target, is checked against that name."""
    zone, dns_port = dns_server
    ca = trustme.CA()
    cert = ca.issue_cert(pod(0))  # the pod's stable name only, not 127.0.0.1
    cert_path, key_path, ca_path = (tmp_path / n for n in ("s.pem", "s.key", "ca.pem"))
    cert.private_key_pem.write_to_path(str(key_path))
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(cert_path), append=i > 0)
    ca.cert_pem.write_to_path(str(ca_path))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_path))  # the client trusts the test CA
    tls = ("--tls-cert", str(cert_path), "--tls-key", str(key_path))
    srv = server_factory(workers=1, capacity="32MiB", wait=False, extra=tls)
    zone.set(srv={SRV_NAME: [(0, 1, srv.port, pod(0))]}, a={pod(0): ["127.0.0.1"]})
    config = KvCacheConfig(
        base_url=f"dnssrv+https://{SRV_NAME}", dns_server=f"127.0.0.1:{dns_port}"
    )
    with RemoteKVConnector(config) as kv:
        (member,) = kv.router.view().members.values()
        assert member.host == "127.0.0.1" and member.server_name == pod(0)
        wait_for(lambda: kv.put("tls-named", b"t"), timeout=30, what="the TLS member to answer")
        assert kv.get("tls-named") == b"t"
    # The same server by its address: the certificate does not name 127.0.0.1.
    with RemoteKVConnector(base_url=f"https://127.0.0.1:{srv.port},https://127.0.0.1:1") as kv:
        assert kv.get("tls-named") is None


_STDLIB_SET_CLIENT = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"aiohttp", "dns", "posix_ipc", "prometheus_client"}:
            raise ImportError(f"{name} is blocked for this test")
        return None

sys.meta_path.insert(0, Block())
from eg_kv.kvcache import RemoteKVConnector

with RemoteKVConnector(base_url=sys.argv[1]) as kv:
    assert type(kv).__name__ == "SetConnector"
    assert all(kv.put(f"std{i}", b"s") for i in range(20))
    assert kv.exists_many([f"std{i}" for i in range(21)]) == [True] * 20 + [False]
for name in ("aiohttp", "dns", "posix_ipc", "eg_kv.slab.store", "eg_kv.server.app"):
    assert name not in sys.modules, name
print("ok")
"""


def test_a_list_of_urls_needs_only_the_standard_library(server_factory):
    servers = start_set(server_factory, n=2)
    out = subprocess.run(
        [sys.executable, "-c", _STDLIB_SET_CLIENT, set_url(servers)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --------------------------------------------------------------------------- bad members


class FakeMember:
    """A member on loopback whose ``/healthz`` answers at once while its data routes
    (``POST /kv/batch/exists``, ``GET``/``PUT``/``HEAD`` of a block) answer after
    ``delay_s`` (None: never, until stopped); ``/kv/stats`` reports ``capacity``.

    Attributes:
        url: its base URL.
        member_id: its id in a set (``127.0.0.1:port``).
        data_requests: how many data-route requests it received.
    """

    def __init__(self, delay_s: float | None, capacity: int = 32 << 20) -> None:
        import http.server
        import json
        import threading

        release = self._release = threading.Event()
        owner = self
        self.data_requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, doc: object) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _data(self) -> None:
                owner.data_requests += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                release.wait(delay_s)  # None: until the test ends
                self._answer(503, {"error": "slow member"})

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._answer(200, {"status": "ok"})
                elif self.path == "/kv/stats":
                    self._answer(200, {"capacity_bytes": capacity, "page_size": 4096})
                else:
                    self._data()

            do_POST = do_PUT = do_HEAD = do_DELETE = _data

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{port}"
        self.member_id = f"127.0.0.1:{port}"

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SLOW_TIMEOUT_S = 2.0
#: Just under timeout_s (the request never times out: HEAD waited for it every batch),
#: or never (its health check answers: HEAD let it back in after each probe).
SLOW_DELAYS = {"just_under_timeout": 0.9 * SLOW_TIMEOUT_S, "hangs": None}
#: One batch stops waiting for a straggler at 4x the first answer's time (at least
#: STRAGGLER_FLOOR_S, 0.25 s): a first answer that took 0.25 s under the full suite cut the
#: straggler at 1.0 s (the batch took 1.016 s against a bound of 1.0 once). 1.5 s is still
#: under the slow member's 1.8 s answer: a batch within it did not wait for that member.
ONE_BATCH_BOUND_S = 1.5


def _keys_off(kv, member_id: str, n: int, prefix: str) -> tuple[list[str], list[str]]:
    """(keys whose home is elsewhere, keys whose home is ``member_id``), ``n`` in all."""
    keys = [f"{prefix}{i:04d}" for i in range(n)]
    on = [k for k in keys if kv.router.home(k)[1] == member_id]
    return [k for k in keys if k not in on], on


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", sorted(SLOW_DELAYS))
@pytest.mark.slow
def test_a_slow_member_costs_its_share_of_one_batch_sync(server_factory, how):
    servers = start_set(server_factory, n=2)
    with (
        FakeMember(SLOW_DELAYS[how]) as slow,
        RemoteKVConnector(
            base_url=f"{set_url(servers)},{slow.url}", timeout_s=SLOW_TIMEOUT_S, local_reads=False
        ) as kv,
    ):
        elsewhere, on_slow = _keys_off(kv, slow.member_id, 90, f"slow-{how}-")
        assert elsewhere and on_slow
        for k in elsewhere:
            assert kv.put(k, b"v")
        keys = elsewhere + on_slow
        want = [True] * len(elsewhere) + [False] * len(on_slow)

        t = time.perf_counter()
        assert kv.exists_many(keys) == want, "the others' hits are answered"
        first = time.perf_counter() - t
        assert first < ONE_BATCH_BOUND_S, f"the batch waited {first:.2f} s for the slow member"
        assert slow.member_id in kv.router.down(), "a member that stalls a batch is down"

        # Later batches do not pay for it, also after its /healthz-answering probes (the
        # prober's data-route probe still stalls, so it stays down, backing off).
        sent = slow.data_requests
        t_end = time.monotonic() + 3.0  # past the first back-off (1 s) and its probe
        worst = 0.0
        while time.monotonic() < t_end:
            t = time.perf_counter()
            assert kv.exists_many(elsewhere) == [True] * len(elsewhere)
            worst = max(worst, time.perf_counter() - t)
            time.sleep(0.05)
        assert worst < ONE_BATCH_BOUND_S / 2, f"a later batch took {worst:.2f} s"
        assert slow.member_id in kv.router.down()
        assert slow.data_requests - sent <= 2, "only probes reached it, a few of them"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", sorted(SLOW_DELAYS))
@pytest.mark.slow
def test_a_slow_member_costs_its_share_of_one_batch_async(server_factory, how):
    servers = start_set(server_factory, n=2)

    async def run(slow: FakeMember) -> None:
        kv = AsyncRemoteKVConnector(
            base_url=f"{set_url(servers)},{slow.url}", timeout_s=SLOW_TIMEOUT_S,
            local_reads=False,
        )  # fmt: skip
        try:
            elsewhere, on_slow = _keys_off(kv, slow.member_id, 90, f"aslow-{how}-")
            for k in elsewhere:
                assert await kv.put(k, b"v")
            keys = elsewhere + on_slow
            t = time.perf_counter()
            found = await kv.exists_many(keys)
            first = time.perf_counter() - t
            assert found == [True] * len(elsewhere) + [False] * len(on_slow)
            assert first < ONE_BATCH_BOUND_S, f"the batch waited {first:.2f} s"
            assert slow.member_id in kv.router.down()
            t_end = time.monotonic() + 3.0
            worst = 0.0
            while time.monotonic() < t_end:
                t = time.perf_counter()
                assert await kv.exists_many(elsewhere) == [True] * len(elsewhere)
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.05)
            assert worst < ONE_BATCH_BOUND_S / 2, f"a later batch took {worst:.2f} s"
            assert slow.member_id in kv.router.down()
        finally:
            await kv.close()

    with FakeMember(SLOW_DELAYS[how]) as slow:
        asyncio.run(run(slow))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_member_that_reports_a_huge_capacity_takes_a_capped_share(server_factory, caplog):
    servers = start_set(server_factory, n=2)
    liar = FakeMember(None, capacity=2**62)
    with (
        liar,
        caplog.at_level("WARNING", "eg_kv"),
        RemoteKVConnector(base_url=f"{set_url(servers)},{liar.url}") as kv,
    ):
        weights = kv.router.view().placement.weights
        assert weights[liar.member_id] == 4 * weights[f"127.0.0.1:{servers[0].port}"]
        n = 3000
        share = sum(kv.router.home(f"{i:x}")[1] == liar.member_id for i in range(n)) / n
        # Capped at 4x the median of 32 MiB members: 4 / (4 + 1 + 1) of the addresses.
        assert share < 4 / 6 + 0.04, f"the member reporting 2**62 bytes took {share:.1%}"
    said = [r.getMessage() for r in caplog.records if liar.member_id in r.getMessage()]
    assert any("over 4x the median" in line for line in said), said
