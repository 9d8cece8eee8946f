"""Server sets (eg_kv/client/members.py): the setting grammar, and discovery against a real DNS
server on loopback (dnslib's: the dns_server fixture, tests/client/conftest.py) whose SRV,
A and AAAA answers change during the tests. dnspython asks it over real UDP (and TCP)
sockets; nothing is patched."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from helpers.common import ROOT, wait_for

from eg_kv.client.health import Health
from eg_kv.client.members import (
    DnsQuery,
    Member,
    parse_server_set,
)
from eg_kv.client.membership import Membership
from eg_kv.client.placement import Placement
from eg_kv.client.settings import KvCacheConfig
from eg_kv.errors import ConfigError

pytest.importorskip("dnslib", reason="the DNS discovery tests need dnslib (the dev extra)")
from helpers.dns_zone import NS, pod

SRV_NAME = f"_http._tcp.eg-kv.{NS}.svc.cluster.local"
SVC_NAME = f"eg-kv.{NS}.svc"


# Short periods keep the tests fast; every wait below is on a condition with margins
# for a loaded 2-core machine.
REFRESH_S = 0.3
QUERY_TIMEOUT_S = 0.5


def membership(setting: str, port: int, **kw) -> Membership:
    kw.setdefault("refresh_s", REFRESH_S)
    kw.setdefault("query_timeout_s", QUERY_TIMEOUT_S)
    return Membership(setting, nameservers=["127.0.0.1"], dns_port=port, **kw)


def ids(m: Membership) -> set[str]:
    return {member.id for member in m.members}


def pods(*numbers: int, port: int = 9130, weight: int = 33) -> list:
    return [(0, weight, port, pod(i)) for i in numbers]


def addresses(*numbers: int, base: str = "127.0.0") -> dict[str, list[str]]:
    return {pod(i): [f"{base}.{10 + i}"] for i in numbers}


# --------------------------------------------------------------------------- grammar


def test_a_list_of_urls_and_a_set_of_one():
    s = parse_server_set(" http://A.example:9130 , https://b.example:9131/kv/ ,http://[::1]:7")
    assert [m.id for m in s.static] == ["a.example:9130", "b.example:9131", "[::1]:7"]
    assert [m.base_url for m in s.static] == [
        "http://a.example:9130",
        "https://b.example:9131/kv",
        "http://[::1]:7",
    ]
    assert s.static[1].https and s.static[1].server_name == "b.example"
    assert s.queries == () and s.single is None
    one = parse_server_set("http://127.0.0.1:9130")
    assert one.single == Member("127.0.0.1:9130", "http", "127.0.0.1", 9130)
    # The default ports are the ones the single-server client uses today.
    assert parse_server_set("https://h").single.port == 443
    assert parse_server_set("http://h").single.port == 80


def test_dns_entries():
    s = parse_server_set(f"dnssrv+https://{SRV_NAME}.,dns+http://{SVC_NAME}:9130/p,http://x:1")
    assert s.queries == (
        DnsQuery("srv", "https", SRV_NAME, None, ""),
        DnsQuery("a", "http", SVC_NAME, 9130, "/p"),
    )
    assert [m.id for m in s.static] == ["x:1"] and s.single is None
    assert str(s.queries[0]) == f"dnssrv+https://{SRV_NAME}"


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("", "no server given"),
        ("http://a:1,,http://b:1", "empty entry"),
        ("ftp://a:1", "want http"),
        ("dnsxx+http://a", "want http"),
        ("a:9130", "want http"),
        ("http://:9130", "names no host"),
        ("http://a:99999", "bad server URL"),
        ("http://user:secret@a:1", "no user, password"),
        ("http://a:1/?token=secret", "no user, password"),
        ("http://user:secret@a:99999", "bad server URL"),
        ("http://a:1,http://a:1/?secret", "no user, password"),
        ("http://a:1,,http://b:1?token=secret", "empty entry"),
        (f"dnssrv+http://{SRV_NAME}:9130", "takes its ports from the SRV"),
        ("http://a:1,http://A:1/", "listed twice"),
        (f"dns+http://{SVC_NAME}:1,dns+http://{SVC_NAME}:1", "listed twice"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(setting, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_server_set(setting)
    assert "secret" not in str(e.value)


@pytest.mark.parametrize(
    "url", ["http://user:secret@/kv", "http://:secret@:9130", "http://u:secret@/?token=secret"]
)
def test_a_bad_base_url_is_refused_without_its_credentials(url):
    # Old code: a single URL that named no host (or another scheme) was quoted whole,
    # its password with it: "base_url 'http://user:secret@/kv' must look like ...".
    with pytest.raises(ConfigError, match="must look like http") as e:
        KvCacheConfig(base_url=url)
    assert "secret" not in str(e.value) and "***@" in str(e.value)


def test_a_static_list_needs_no_dnspython_and_no_thread():
    """The sync client is stdlib-only: a plain list must work with dnspython absent."""
    code = f"""
import sys, threading
sys.path.insert(0, {str(ROOT)!r})
class NoDns:
    def find_spec(self, name, path=None, target=None):
        if name == "dns" or name.startswith("dns."):
            raise ImportError("dnspython is not installed")
sys.meta_path.insert(0, NoDns())
from eg_kv.client.membership import Membership
m = Membership("http://a:1,http://b:2")
assert [x.id for x in m.members] == ["a:1", "b:2"], m.members
assert threading.active_count() == 1, threading.enumerate()
assert m.view().placement.home("abc") in ("a:1", "b:2")
m.close()
from eg_kv.errors import ConfigError
try:
    Membership("dns+http://eg-kv:1")
except ConfigError as e:
    print("dns refused:", e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "dns refused: dns+ and dnssrv+ server URLs need dnspython: pip install" in out.stdout


def test_bad_bounds_are_refused():
    for key in ("refresh_s", "query_timeout_s", "weigh_timeout_s"):
        for bad in (0, -1, float("nan"), float("inf"), "5"):
            with pytest.raises(ConfigError, match=key):
                Membership("http://a:1", **{key: bad})


# --------------------------------------------------------------------------- SRV


@pytest.mark.timeout(60)
def test_srv_members_follow_the_records(dns_server):
    zone, port = dns_server
    zone.set(srv={SRV_NAME: pods(0, 1)}, a=addresses(0, 1, 2))
    changes = []
    with membership(f"dnssrv+http://{SRV_NAME}", port, on_change=changes.append) as m:
        assert ids(m) == {f"{pod(0)}:9130", f"{pod(1)}:9130"}
        first = {x.id: x for x in m.members}[f"{pod(0)}:9130"]
        # Connected at the address the same DNS server gives; named by the target for TLS.
        assert (first.host, first.server_name, first.scheme) == ("127.0.0.10", pod(0), "http")
        assert first.base_url == "http://127.0.0.10:9130"
        assert first.weight == 33.0  # SRV weight, the fallback when nobody weighs members
        assert len(changes) == 1

        # Scale out: the new pod is a member within one refresh.
        old = m.view()
        zone.set(srv={SRV_NAME: pods(0, 1, 2)})
        wait_for(lambda: len(ids(m)) == 3, timeout=10, what="the third member")
        view = m.view()
        assert view.previous == old.placement and changes[-1] is view
        # For one window after the change, a moved address names its previous home once.
        moved = [
            a for a in (f"{i:x}" for i in range(300)) if view.placement.home(a) == f"{pod(2)}:9130"
        ]
        assert moved
        for a in moved:
            assert view.previous_home(a, now=view.changed_at) == old.placement.home(a)
            assert view.previous_home(a, now=view.changed_at + REFRESH_S * 1.01) is None
        stays = next(a for a in (f"{i:x}" for i in range(300)) if a not in moved)
        assert view.previous_home(stays, now=view.changed_at) is None

        # A pod restarted with a new IP keeps its id, so its addresses stay home.
        zone.set(a={**addresses(0, 2), pod(1): ["127.0.0.99"]})
        wait_for(lambda: {x.host for x in m.members} >= {"127.0.0.99"}, timeout=10, what="new IP")
        assert m.view().placement == view.placement

        # Scale in: gone within one refresh.
        zone.set(srv={SRV_NAME: pods(0, 2)})
        wait_for(
            lambda: ids(m) == {f"{pod(0)}:9130", f"{pod(2)}:9130"}, timeout=10, what="scale-in"
        )


@pytest.mark.timeout(60)
def test_srv_without_additional_records_queries_each_target(dns_server):
    zone, port = dns_server
    zone.set(
        srv={SRV_NAME: [*pods(0, 1), (1, 0, 9130, pod(7)), (0, 0, 9131, "unknown.example")]},
        a=addresses(0, 7),
        aaaa={pod(1): ["::1"]},
        additional=False,
    )
    with membership(f"dnssrv+https://{SRV_NAME}", port) as m:
        got = {x.id: x for x in m.members}
        # Priority 1 is a standby (RFC 2782); a target nobody resolves is left to the
        # system resolver at connect time.
        assert set(got) == {f"{pod(0)}:9130", f"{pod(1)}:9130", "unknown.example:9131"}
        assert got[f"{pod(0)}:9130"].host == "127.0.0.10"
        assert got[f"{pod(1)}:9130"].base_url == "https://[::1]:9130"
        assert got["unknown.example:9131"].host == "unknown.example"
        assert got["unknown.example:9131"].weight == 1.0  # SRV weight 0 counts as 1
        assert zone.count(pod(0), "A") >= 1
        # A target whose address lookup fails for a while keeps its last address.
        zone.set(a=addresses(7))
        asked = zone.count(pod(0), "A")
        wait_for(lambda: zone.count(pod(0), "A") >= asked + 2, timeout=10, what="refreshes")
        assert {x.id: x.host for x in m.members}[f"{pod(0)}:9130"] == "127.0.0.10"


#: What the constructor may take (Membership.start_bound_s: one query_timeout_s plus
#: 0.25 s), with a margin for a loaded 2-core machine. HEAD took 6 x 0.5 s for six
#: targets whose AAAA queries were dropped, and 12 x 0.5 s when A was dropped too.
START_BOUND_S = QUERY_TIMEOUT_S + 0.25 + 0.75


@pytest.mark.timeout(60)
def test_a_dns_server_that_drops_aaaa_costs_the_constructor_nothing(dns_server):
    zone, port = dns_server
    six = range(6)
    zone.set(srv={SRV_NAME: pods(*six)}, a=addresses(*six), additional=False, drop={"AAAA"})
    t = time.monotonic()
    with membership(f"dnssrv+http://{SRV_NAME}", port, refresh_s=30) as m:
        took = time.monotonic() - t
        assert took < START_BOUND_S, f"the constructor took {took:.2f} s"
        # IPv4 is connected first: once A answered, the dropped AAAA is not waited for.
        assert {x.id: x.host for x in m.members} == {
            f"{pod(i)}:9130": f"127.0.0.{10 + i}" for i in six
        }
        wait_for(lambda: all(zone.count(pod(i), "AAAA") for i in six), timeout=10,
                 what="AAAA asked (and dropped) for every target")  # fmt: skip


@pytest.mark.timeout(60)
def test_targets_whose_lookups_hang_cost_one_deadline_then_fill_in(dns_server):
    zone, port = dns_server
    six = range(6)
    zone.set(srv={SRV_NAME: pods(*six)}, a=addresses(*six), additional=False,
             drop={"A", "AAAA"})  # fmt: skip
    t = time.monotonic()
    with membership(f"dnssrv+http://{SRV_NAME}", port) as m:
        took = time.monotonic() - t
        assert took < START_BOUND_S, f"the constructor took {took:.2f} s"
        # Known now: the six targets, by name (the system resolves them meanwhile).
        assert {x.host for x in m.members} == {pod(i) for i in six}
        zone.set(drop=set())
        wait_for(
            lambda: {x.host for x in m.members} == {f"127.0.0.{10 + i}" for i in six},
            timeout=10, what="the targets' addresses filled in",
        )  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_the_members_taken_from_dns_are_capped(dns_server, caplog):
    from eg_kv.client.dns import MAX_DNS_MEMBERS

    zone, port = dns_server
    many = range(MAX_DNS_MEMBERS + 20)
    zone.set(srv={SRV_NAME: pods(*many)}, a=addresses(*many, base="127.0"), additional=False)
    with (
        caplog.at_level("WARNING", "eg_kv"),
        membership(f"dnssrv+http://{SRV_NAME}", port, refresh_s=30, query_timeout_s=5.0) as m,
    ):
        got = ids(m)
    assert len(got) == MAX_DNS_MEMBERS
    assert got == set(sorted(f"{pod(i)}:9130" for i in many)[:MAX_DNS_MEMBERS]), "by id"
    assert any("MAX_DNS_MEMBERS" in r.getMessage() for r in caplog.records)


def test_a_member_reporting_a_huge_capacity_is_capped_and_a_jump_is_logged(caplog):
    capacity = {"a:1": 1 << 30, "b:1": 1 << 30, "c:1": 1 << 30, "liar:1": 2**62}

    def weigh(member: Member) -> float | None:
        return capacity[member.id]

    with (
        caplog.at_level("WARNING", "eg_kv"),
        Membership(",".join(f"http://{m}" for m in capacity), weigh=weigh, refresh_s=0.1) as m,
    ):
        weights = m.view().placement.weights
        assert weights["liar:1"] == 4 << 30 and weights["a:1"] == 1 << 30
        n = 4000
        share = Counter(m.view().placement.home(f"{i:x}") for i in range(n))["liar:1"] / n
        assert share < 4 / 7 + 0.03, f"the member reporting 2**62 bytes took {share:.1%}"
        capacity["a:1"] = 1 << 40  # a jump of 1024x at a later weighing
        wait_for(lambda: any("now reports" in r.getMessage() for r in caplog.records),
                 timeout=10, what="the jump logged")  # fmt: skip
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "liar:1 reports capacity" in said and "over 4x the median" in said


# --------------------------------------------------------------------------- A / AAAA


@pytest.mark.timeout(60)
def test_a_and_aaaa_members_follow_the_records(dns_server):
    zone, port = dns_server
    zone.set(a={SVC_NAME: ["127.0.0.3", "127.0.0.2"]}, aaaa={SVC_NAME: ["::1"]})
    with membership(f"dns+https://{SVC_NAME}:9130,http://static:1", port) as m:
        assert ids(m) == {"127.0.0.2:9130", "127.0.0.3:9130", "[::1]:9130", "static:1"}
        v6 = {x.id: x for x in m.members}["[::1]:9130"]
        assert v6.https and v6.server_name == SVC_NAME and v6.base_url == "https://[::1]:9130"
        zone.set(a={SVC_NAME: ["127.0.0.4"]}, aaaa={})
        wait_for(lambda: ids(m) == {"127.0.0.4:9130", "static:1"}, timeout=10, what="new addresses")


# --------------------------------------------------------------------------- failures


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "failure", [pytest.param("silent", marks=pytest.mark.slow), "servfail", "nxdomain", "empty"]
)
def test_a_failed_resolution_keeps_the_last_good_list(dns_server, failure):
    zone, port = dns_server
    zone.set(srv={SRV_NAME: pods(0, 1)}, a=addresses(0, 1))
    with membership(f"dnssrv+http://{SRV_NAME}", port) as m:
        before = m.members
        asked = zone.count(SRV_NAME, "SRV")
        if failure in ("silent", "servfail"):
            zone.set(mode=failure)
        elif failure == "nxdomain":
            zone.set(srv={}, a={})
        else:
            zone.set(srv={SRV_NAME: [(0, 0, 9130, ".")]})
        # Several refreshes happen (the server sees them) and the set stays as it was.
        wait_for(lambda: zone.count(SRV_NAME, "SRV") >= asked + 3, timeout=20, what="refreshes")
        assert m.members == before
        # A timed-out resolution costs the refresh at most its bound, never more.
        t0 = time.monotonic()
        assert m.refresh() is False
        assert time.monotonic() - t0 < QUERY_TIMEOUT_S * 3 + 2
        # When it answers again, with a change, the set follows.
        zone.set(mode="answer", srv={SRV_NAME: pods(1, 2)}, a=addresses(1, 2))
        wait_for(
            lambda: ids(m) == {f"{pod(1)}:9130", f"{pod(2)}:9130"}, timeout=10, what="recovery"
        )


@pytest.mark.timeout(60)
def test_a_set_that_cannot_resolve_at_start_is_empty_then_fills(dns_server):
    zone, port = dns_server
    zone.set(mode="servfail")
    with membership(f"dnssrv+http://{SRV_NAME}", port) as m:
        assert m.members == () and m.view().placement.home("abc") is None
        zone.set(mode="answer", srv={SRV_NAME: pods(0)}, a=addresses(0))
        wait_for(lambda: ids(m) == {f"{pod(0)}:9130"}, timeout=10, what="first members")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_close_stops_the_thread_and_the_queries(dns_server):
    zone, port = dns_server
    zone.set(srv={SRV_NAME: pods(0)}, a=addresses(0))
    m = membership(f"dnssrv+http://{SRV_NAME}", port)
    thread = m._thread
    assert thread is not None and thread.is_alive()
    wait_for(lambda: zone.count(SRV_NAME, "SRV") >= 3, timeout=10, what="background refreshes")
    m.close()
    assert not thread.is_alive()
    asked = zone.count(SRV_NAME, "SRV")
    time.sleep(REFRESH_S * 4)  # proving an absence: nothing may happen in this time
    assert zone.count(SRV_NAME, "SRV") == asked


# --------------------------------------------------------------------------- weights


@pytest.mark.timeout(60)
def test_weights_come_from_each_members_capacity(dns_server):
    zone, port = dns_server
    zone.set(srv={SRV_NAME: pods(0, 1, 2)}, a=addresses(0, 1, 2))
    capacity = {pod(0): 16 << 30, pod(1): 8 << 30}  # pod 2 does not answer yet
    asked: Counter = Counter()

    def weigh(member: Member) -> float | None:
        asked[member.id] += 1
        if member.server_name not in capacity:
            raise ConnectionRefusedError("not up yet")
        return capacity[member.server_name]

    with membership(f"dnssrv+http://{SRV_NAME}", port, weigh=weigh) as m:
        w = {x.server_name: x.weight for x in m.members}
        # Pod 2 takes the mean of the weighed meanwhile: an equal share, not none.
        assert w == {pod(0): 16 << 30, pod(1): 8 << 30, pod(2): 12 << 30}
        capacity[pod(2)] = 8 << 30
        wait_for(
            lambda: {x.server_name: x.weight for x in m.members}[pod(2)] == 8 << 30,
            timeout=10,
            what="pod 2 weighed",
        )
        # Every member is weighed again at each refresh (a capacity that changes is seen).
        assert asked[f"{pod(0)}:9130"] >= 2 and asked[f"{pod(2)}:9130"] >= 2
        counts = Counter(m.view().placement.home(f"{i:x}") for i in range(4000))
        assert abs(counts[f"{pod(0)}:9130"] / 4000 - 0.5) < 0.04, counts


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_weigh_hook_that_hangs_costs_a_bounded_wait_and_one_thread():
    release = threading.Event()
    calls: Counter = Counter()

    def weigh(member: Member) -> float | None:
        calls[member.id] += 1
        if member.id == "slow:1":
            release.wait(30)
            return None
        return 2.0

    t0 = time.monotonic()
    m = Membership("http://fast:1,http://slow:1", weigh=weigh, weigh_timeout_s=0.3,
                   refresh_s=0.1)  # fmt: skip
    try:
        assert time.monotonic() - t0 < 10
        assert {x.id: x.weight for x in m.members} == {"fast:1": 2.0, "slow:1": 2.0}
        # Several refreshes later the hung weighing was not started again (the fast
        # member is weighed again at each refresh).
        assert calls["fast:1"] >= 1
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # bounded: ten refreshes
            assert calls["slow:1"] == 1
            time.sleep(0.05)
    finally:
        release.set()
        m.close()


# --------------------------------------------------------------------------- health


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_member_is_skipped_until_a_probe_finds_it_up():
    clock = Clock()
    health = Health(first_s=1.0, max_s=30.0, clock=clock)
    placement = Placement(dict.fromkeys(["a:1", "b:1", "c:1"], 1.0))
    batch = [f"{i:x}" for i in range(300)]
    on_b = [x for x in batch if placement.home(x) == "b:1"]
    assert health.failed("b:1") == 1.0
    assert health.down() == {"b:1"}
    # Its addresses go to their next-ranked member; the others stay where they are.
    groups = placement.group(batch, skip=health.down())
    assert "b:1" not in groups
    for x in on_b:
        assert placement.home(x, health.down()) == placement.ranking(x)[1]
    # Probed after its back-off, once; each failed probe doubles it, up to the maximum.
    assert health.due() == []
    backoffs = []
    for _ in range(7):
        clock.now += backoffs[-1] if backoffs else 1.0
        assert health.due() == ["b:1"]
        assert health.due() == [], "handed out twice in one back-off"
        backoffs.append(health.failed("b:1"))
    assert backoffs == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert health.down() == {"b:1"}, "down until a probe succeeds, however long"
    # A prober that never reports gets it again after another back-off.
    clock.now += 30.0
    assert health.due() == ["b:1"]
    clock.now += 30.0
    assert health.due() == ["b:1"]
    # Up again: home again. Failing again soon after (a member whose probes pass while
    # its requests stall) resumes the doubling; only max_s up without a failure resets it.
    assert health.succeeded("b:1") is True and health.succeeded("b:1") is False
    assert health.down() == frozenset()
    assert [placement.home(x, health.down()) for x in on_b] == ["b:1"] * len(on_b)
    clock.now += 29.0
    assert health.failed("b:1") == 30.0
    assert health.succeeded("b:1") is True
    clock.now += 30.0
    assert health.failed("b:1") == 1.0


def test_a_member_that_flaps_is_retried_exponentially_less_often():
    """Fail, come back at the probe, fail at once again: each round waits twice as long
    (before, every probe that passed reset the back-off to 1 s)."""
    clock = Clock()
    health = Health(first_s=1.0, max_s=30.0, clock=clock)
    waits = []
    for _ in range(6):
        waits.append(health.failed("b:1"))
        clock.now += waits[-1]
        assert health.due() == ["b:1"]
        assert health.succeeded("b:1")
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


def test_health_forgets_members_that_left_and_refuses_bad_bounds():
    health = Health(clock=Clock())
    health.failed("a:1")
    health.failed("b:1")
    health.forget({"b:1", "c:1"})
    assert health.down() == {"b:1"}
    for first, most in ((0, 1), (2, 1), (-1, 5)):
        with pytest.raises(ConfigError):
            Health(first, most)


def test_a_capped_member_whose_capacity_changes_at_each_weighing_is_said_once(caplog):
    """The note of capped members was keyed by (member, capacity): one reporting another
    huge capacity at each refresh logged a warning, and kept a note, per refresh."""
    capacity = {"a:1": 1 << 30, "b:1": 1 << 30, "c:1": 1 << 30, "liar:1": 2**50}
    weighed = []

    def weigh(member: Member) -> float | None:
        if member.id == "liar:1":
            capacity["liar:1"] += 1 << 30  # another over-cap figure each time
            weighed.append(1)
        return capacity[member.id]

    with (
        caplog.at_level("WARNING", "eg_kv"),
        Membership(",".join(f"http://{m}" for m in capacity), weigh=weigh, refresh_s=0.05) as m,
    ):
        wait_for(lambda: len(weighed) >= 10, timeout=20, what="ten weighings")
        assert m._capped == {"liar:1"}
    said = [r for r in caplog.records if "over 4x the median" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
