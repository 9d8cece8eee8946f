"""Tenants against real servers with a tokens file: isolation, roles, quotas, reload, bad
files, and a SIGKILL during multi-tenant traffic followed by ``eg-kv check``."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import select
import signal
import socket
import tempfile
import threading
import time

import psutil
import pytest
from helpers.common import wait_for
from helpers.server_http import request, status_of
from helpers.server_procs import eg_kv_check, workers_of
from helpers.tenants import token_of, tokens_toml, write_tokens

from eg_kv.server import runstate

KiB, MiB = 1024, 1024 * 1024
TENANTS = [
    {"name": "team-a", "role": "readwrite"},
    {"name": "team-a-ro", "role": "readonly", "namespace": "team-a"},
    {"name": "team-b", "role": "readwrite", "quota": "2MiB"},
    {"name": "ops", "role": "admin"},
]


def as_(name: str) -> str:
    return token_of(name)


@pytest.fixture
def tenanted(server_factory, tmp_path):
    path = write_tokens(tmp_path / "tokens.toml", TENANTS)
    srv = server_factory(workers=2, capacity="8MiB", extra=("--tokens", str(path)))
    srv.tokens_path = path
    return srv


def _req(srv, who, method, path, body=None, headers=None):
    return request(srv, method, path, body, headers=headers, token=as_(who))


def test_namespaces_isolate_every_operation(tenanted):
    srv = tenanted
    assert _req(srv, "team-a", "PUT", "/kv/same", b"from-a").status == 201
    # team-b sees nothing of it, by any door, and stores its own copy.
    assert _req(srv, "team-b", "GET", "/kv/same").status == 404
    assert _req(srv, "team-b", "HEAD", "/kv/same").status == 404
    assert _req(srv, "team-b", "GET", "/kv/same/exists").json()["exists"] is False
    batch = _req(srv, "team-b", "POST", "/kv/batch/exists", b'{"addresses": ["same"]}')
    assert batch.json() == {"exists": [False], "prefix_hits": 0}
    assert _req(srv, "team-b", "DELETE", "/kv/same").status == 404
    assert _req(srv, "team-b", "PUT", "/kv/same", b"from-b, longer").status == 201
    assert _req(srv, "team-b", "GET", "/kv/same").body == b"from-b, longer"
    assert _req(srv, "team-a", "GET", "/kv/same").body == b"from-a"
    # Dedup and refcounts hold within a namespace; tokens sharing one see the same blocks.
    assert _req(srv, "team-a", "PUT", "/kv/same", b"from-a").status == 200
    assert _req(srv, "team-a-ro", "GET", "/kv/same").body == b"from-a"
    assert _req(srv, "team-a", "DELETE", "/kv/same").status == 204
    assert _req(srv, "team-a", "DELETE", "/kv/same").status == 204
    assert _req(srv, "team-a", "GET", "/kv/same").status == 404
    assert _req(srv, "team-b", "GET", "/kv/same").body == b"from-b, longer"
    # The default namespace (no tenant of the file uses it) is a third one.
    assert _req(srv, "ops", "GET", "/kv/same").status == 404


@pytest.mark.slow
def test_roles(tenanted):
    srv = tenanted
    assert _req(srv, "team-a", "PUT", "/kv/r", b"x").status == 201
    for method, body in (("PUT", b"y"), ("DELETE", None)):
        reply = _req(srv, "team-a-ro", method, "/kv/r", body)
        assert reply.status == 403 and "readonly" in reply.text and reply.text.count("\n") == 1
    # Expect: 100-continue is refused from the headers too.
    raw = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    raw.sendall(b"PUT /kv/r HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nExpect: 100-continue\r\n"
                b"Authorization: Bearer " + as_("team-a-ro").encode() + b"\r\n\r\n")  # fmt: skip
    assert raw.recv(4096).startswith(b"HTTP/1.1 403")
    raw.close()
    for route in ("/kv/r", "/kv/r/exists"):
        assert _req(srv, "team-a-ro", "GET", route).status == 200
    assert _req(srv, "team-a-ro", "HEAD", "/kv/r").status == 200
    assert _req(srv, "team-a", "GET", "/kv/r").body == b"x"  # the refused DELETE did nothing
    # /metrics: admins only, with a series per namespace.
    assert _req(srv, "team-a", "GET", "/metrics").status == 403
    metrics = _req(srv, "ops", "GET", "/metrics")
    assert metrics.status == 200
    assert 'eg_kv_namespace_resident_bytes{namespace="team-a"} 1.0' in metrics.text
    # /kv/stats: a tenant sees its own namespace, an admin the slab and every namespace.
    own = _req(srv, "team-a-ro", "GET", "/kv/stats").json()
    assert list(own)[:8] == [
        "unique_blocks", "total_refs", "resident_bytes", "logical_bytes",
        "dedup_savings_bytes", "dedup_hits", "get_hits", "get_misses",
    ]  # fmt: skip
    assert own["namespace"] == "team-a" and own["unique_blocks"] == 1 and own["get_hits"] >= 2
    assert "namespaces" not in own
    assert _req(srv, "team-b", "GET", "/kv/stats").json()["unique_blocks"] == 0
    full = _req(srv, "ops", "GET", "/kv/stats").json()
    assert {"team-a", "team-b", "ops", "default"} <= set(full["namespaces"])
    assert full["namespaces"]["team-b"]["quota_bytes"] == 2 * MiB
    # Unknown tokens get today's 401; no token reaches the log.
    reply = request(srv, "GET", "/kv/r", token="tok-nobody")
    assert reply.status == 401 and reply.text == "wrong bearer token\n"
    log = srv.log()
    assert not any(as_(t["name"]) in log for t in TENANTS)


def test_quota_under_pressure_from_another_tenant(tenanted):
    srv = tenanted
    body = os.urandom(256 * KiB)
    for k in range(8):  # team-a keeps 2 MiB, no quota
        assert _req(srv, "team-a", "PUT", f"/kv/a{k}", body).status == 201
    for k in range(40):  # team-b pushes 10 MiB through its 2 MiB quota, in an 8 MiB slab
        assert _req(srv, "team-b", "PUT", f"/kv/b{k}", body).status == 201
    for k in range(8):
        assert _req(srv, "team-a", "GET", f"/kv/a{k}").body == body, k
    ns = _req(srv, "ops", "GET", "/kv/stats").json()["namespaces"]
    assert ns["team-a"]["evictions"] == 0
    assert ns["team-b"]["resident_bytes"] <= 2 * MiB and ns["team-b"]["evictions"] >= 32
    assert ns["team-b"]["evicted_bytes"] == ns["team-b"]["evictions"] * 256 * KiB


def _upload_head(address: str, length: int, who: str) -> bytes:
    """The head of a PUT of ``length`` bytes sent as tenant ``who``."""
    return (
        b"PUT /kv/%s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\nAuthorization: Bearer %s\r\n\r\n"
        % (address.encode(), length, as_(who).encode())
    )


def _answer(s: socket.socket) -> bytes:
    """One whole response (head, Content-Length body) read from ``s``: an early answer to
    an upload whose body was not all sent."""
    s.settimeout(10)
    out = b""
    while b"\r\n\r\n" not in out and (chunk := s.recv(65536)):
        out += chunk
    head = out.partition(b"\r\n\r\n")[0].lower()
    length = (
        int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        if b"content-length:" in head
        else 0
    )
    while len(out) < len(head) + 4 + length and (chunk := s.recv(65536)):
        out += chunk
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uploads_in_flight_count_against_their_quota(server_factory, tmp_path):
    """Issue 21 item 4: eight 4 MiB uploads held open by a tenant with a 4 MiB quota
    evicted 16 of another tenant's 48 blocks while that one was under its quota. Now the
    first upload holds the quota and the others get 503 + Retry-After; the other tenant
    keeps every block."""
    path = write_tokens(tmp_path / "tokens.toml", [
        {"name": "team-a", "role": "readwrite", "quota": "4MiB"},
        {"name": "team-b", "role": "readwrite", "quota": "28MiB"},
        {"name": "ops", "role": "admin"},
    ])  # fmt: skip
    srv = server_factory(workers=2, capacity="32MiB", extra=("--tokens", str(path)))
    body = os.urandom(512 * KiB)
    for k in range(48):  # 24 MiB of team-b's, under its quota
        assert _req(srv, "team-b", "PUT", f"/kv/b{k}", body).status == 201

    def reserved_pages() -> int:
        return _req(srv, "ops", "GET", "/kv/stats").json()["reserved_pages"]

    held, answers = [], []
    try:
        for k in range(8):
            before = reserved_pages()
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(_upload_head(f"up{k}", 4 * MiB, "team-a") + b"u" * KiB)

            # Either it reserves its pages (and waits for the rest of its body), or the
            # server answers it at once.
            def taken_in(s: socket.socket = s, before: int = before) -> bool:
                return bool(select.select([s], [], [], 0)[0]) or reserved_pages() > before

            wait_for(taken_in, timeout=20, what=f"upload {k} refused or reserved")
            if select.select([s], [], [], 0)[0]:
                answers.append(_answer(s))
                s.close()
            else:
                held.append(s)
        stats = _req(srv, "ops", "GET", "/kv/stats").json()["namespaces"]
        assert stats["team-b"]["evictions"] == 0, stats["team-b"]
        for k in range(48):
            assert _req(srv, "team-b", "HEAD", f"/kv/b{k}").status == 200, k
        assert len(held) == 1 and len(answers) == 7
        for raw in answers:
            assert status_of(raw) == 503, raw[:300]
            assert b"\r\nRetry-After: " in raw
            assert b"its uploads in flight hold 4194304 bytes of its quota" in raw
        own = _req(srv, "team-a", "GET", "/kv/stats").json()
        assert (own["reserved_bytes"], own["quota_used_bytes"], own["quota_bytes"]) == (
            4 * MiB, 4 * MiB, 4 * MiB,
        )  # fmt: skip
        metrics = _req(srv, "ops", "GET", "/metrics").text
        assert 'eg_kv_namespace_reserved_bytes{namespace="team-a"} 4.194304e+06' in metrics
        assert 'eg_kv_namespace_quota_used_bytes{namespace="team-b"} 2.5165824e+07' in metrics
        # A block larger than the quota is refused for good: 507, no Retry-After.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(_upload_head("huge", 4 * MiB + 1, "team-a") + b"h" * KiB)
            raw = _answer(s)
        assert status_of(raw) == 507 and b"Retry-After" not in raw, raw[:300]
        assert b"raise the quota in the tokens file" in raw
    finally:
        for s in held:
            s.close()
    # The upload that broke off gives its pages back; the quota is free again.
    wait_for(lambda: _req(srv, "team-a", "GET", "/kv/stats").json()["quota_used_bytes"] == 0,
             timeout=20, what="the broken-off upload's pages given back")  # fmt: skip
    big = os.urandom(4 * MiB)
    assert _req(srv, "team-a", "PUT", "/kv/whole", big).status == 201
    assert _req(srv, "team-a", "GET", "/kv/whole").body == big
    assert _req(srv, "ops", "GET", "/kv/stats").json()["namespaces"]["team-b"]["evictions"] == 0
    check = eg_kv_check(srv.slab_name)
    assert check.returncode == 0, check.stdout + check.stderr


def test_reload_on_sighup_keeps_slab_and_workers(tenanted, tmp_path):
    srv = tenanted
    assert _req(srv, "team-a", "PUT", "/kv/kept", b"kept").status == 201
    pids = workers_of(srv)
    assert _req(srv, "new", "GET", "/kv/kept").status == 401
    assert _req(srv, "team-b", "PUT", "/kv/b-kept", b"b").status == 201
    kept = [t for t in TENANTS if t["name"] != "team-b"]  # team-b's token is withdrawn
    write_tokens(srv.tokens_path, [*kept, {"name": "new", "role": "readonly",
                                           "namespace": "team-a"}])  # fmt: skip
    os.kill(srv.pid, signal.SIGHUP)
    wait_for(lambda: _req(srv, "new", "GET", "/kv/kept").status == 200, timeout=20,
             what="the new tenant on every worker")  # fmt: skip
    for _ in range(6):  # fresh connections spread over both workers
        assert _req(srv, "new", "GET", "/kv/kept").body == b"kept"
        assert _req(srv, "team-b", "GET", "/kv/b-kept").status == 401
    # team-b's namespace and block stay in the slab (an admin sees them).
    assert _req(srv, "ops", "GET", "/kv/stats").json()["namespaces"]["team-b"]["unique_blocks"] == 1
    assert workers_of(srv) == pids and srv.proc.poll() is None
    # A bad file keeps the tenants in force, and the log says why.
    srv.tokens_path.write_text('[[tenant]]\nname = "x"\nrole = "god"\n')
    os.kill(srv.pid, signal.SIGHUP)
    wait_for(lambda: "not reloaded" in srv.log(), timeout=20, what="the refusal in the log")
    assert "line 1: tenant x: token_sha256" in srv.log().split("not reloaded")[1].splitlines()[0]
    for _ in range(6):
        assert _req(srv, "new", "GET", "/kv/kept").body == b"kept"
    assert workers_of(srv) == pids and srv.proc.poll() is None


def test_a_replacement_worker_reads_the_tenants_in_force_when_their_copy_went(
    server_factory, tmp_path
):
    """Workers read the supervisor's validated copy of the tokens file, never the file
    itself (edits not yet reloaded, namespaces the slab has not bound). A /tmp cleaner
    that removed the copy made a replacement worker read the file's edits: the supervisor
    writes the copy again before it forks."""
    path = write_tokens(tmp_path / "tokens.toml", TENANTS)
    srv = server_factory(workers=1, capacity="8MiB", extra=("--tokens", str(path)))
    assert _req(srv, "team-a", "PUT", "/kv/in-force", b"x").status == 201
    write_tokens(path, [*TENANTS, {"name": "unreloaded", "role": "admin"}])  # no SIGHUP
    (run_dir,) = glob.glob(os.path.join(tempfile.gettempdir(), f"eg-kv-{srv.port}-*"))
    copy = runstate.tokens_copy(run_dir)
    os.unlink(copy)
    (pid,) = workers_of(srv)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(workers_of(srv) - {pid}) == 1 and srv.healthz(), timeout=30,
             what="the replacement worker to serve")  # fmt: skip
    assert _req(srv, "team-a", "GET", "/kv/in-force").body == b"x"
    assert _req(srv, "unreloaded", "GET", "/kv/stats").status == 401
    assert "was gone" in srv.log() and os.path.exists(copy)


def test_a_bad_tokens_file_stops_the_server_at_start(server_factory, tmp_path):
    path = write_tokens(tmp_path / "t.toml", TENANTS)
    path.write_text(path.read_text().replace('role = "admin"', 'role = "superuser"'))
    srv = server_factory(workers=1, extra=("--tokens", str(path)), wait=False)
    assert srv.proc.wait(30) != 0
    line = path.read_text().splitlines().index('role = "superuser"') + 1
    assert f"line {line}" in srv.log() and "unknown role" in srv.log()


@pytest.mark.timeout(90)
def test_sigkill_during_multi_tenant_traffic_then_check(tenanted):
    srv = tenanted
    stop = threading.Event()
    errors: list[str] = []

    def load(who: str) -> None:
        k, deadline = 0, time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline and k < 5000:
            body = f"{who}-{k}".encode() * 100
            try:
                r = _req(srv, who, "PUT", f"/kv/k{k % 50}", body)
                if r.status not in (200, 201, 409):
                    errors.append(f"{who}: {r.status} {r.text}")
            except OSError:
                pass  # the connection was on the worker that was killed
            k += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in ("team-a", "team-b")]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: _req(srv, "team-b", "GET", "/kv/stats").json()["unique_blocks"] > 10,
                 timeout=20, what="traffic")  # fmt: skip
        victim = sorted(workers_of(srv))[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: victim not in workers_of(srv) and len(workers_of(srv)) == 2,
                 timeout=20, what="a replacement worker")  # fmt: skip
        time.sleep(0.3)  # traffic on the replacement too
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    check = eg_kv_check(srv.slab_name)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "in 2 namespace(s)" in check.stdout, check.stdout
    # Every block stayed in its namespace: a's addresses hold a's bytes, b's hold b's.
    for who in ("team-a", "team-b"):
        for k in range(50):
            got = _req(srv, who, "GET", f"/kv/k{k}")
            if got.status == 200:
                assert got.body.startswith(who.encode()), (who, k, got.body[:20])
    stats = json.loads(_req(srv, "ops", "GET", "/kv/stats").text)
    assert stats["namespaces"]["team-a"]["unique_blocks"] > 0


def test_remembered_headers_are_bounded_and_forgotten_on_reload(tmp_path):
    """The worker's memo of headers that authenticated: a client cycling spellings of its
    header keeps it bounded; a new table (a reload) forgets it, so a withdrawn token is
    refused from the next request on; a wrong token is never remembered."""
    from aiohttp.test_utils import make_mocked_request

    from eg_kv.server.auth import Auth
    from eg_kv.server.tenants import load

    path = write_tokens(tmp_path / "tokens.toml", TENANTS)
    auth = Auth(load(str(path), 1 << 30), str(path))

    def who(header: str) -> object:
        req = make_mocked_request("GET", "/kv/x", headers={"Authorization": header})
        found = auth.authenticate(req)
        return found if isinstance(found, str) else found.name

    for spaces in range(1, 50):
        assert who("Bearer" + " " * spaces + as_("team-a")) == "team-a"
        assert who(f"Bearer wrong-{spaces}") == "wrong bearer token"
        assert len(auth._seen) <= 1  # only the canonical spelling is remembered
    assert who(f"Bearer {as_('team-b')}") == "team-b"
    write_tokens(path, [t for t in TENANTS if t["name"] != "team-b"])
    auth.table = load(str(path), 1 << 30)
    assert who(f"Bearer {as_('team-b')}") == "wrong bearer token"
    assert who(f"Bearer {as_('team-a')}") == "team-a"


@pytest.mark.timeout(120)
def test_one_tenant_cannot_fill_a_workers_memo_of_headers(server_factory, tmp_path):
    # Any header that authenticated was remembered, up to 4 x the tenants for all of them
    # together: one readonly tenant padding its token (Bearer + 1..8,000 spaces) held
    # every entry, ~8 KiB each (before the fix: 3,900 paddings grew the worker by 51 MiB
    # with 1,000 tenants). Only `Bearer <token>` is remembered now.
    many = [{"name": f"t{i}", "role": "readonly"} for i in range(1000)]
    path = write_tokens(tmp_path / "t.toml", many)
    srv = server_factory(workers=1, extra=("--tokens", str(path)))
    (worker,) = [psutil.Process(pid) for pid in workers_of(srv)]
    token = token_of("t0")
    with socket.create_connection((srv.host, srv.port), timeout=30) as s:

        def heads(pads: range) -> None:
            s.sendall(b"".join(f"HEAD /kv/x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer"
                               f"{' ' * pad}{token}\r\n\r\n".encode() for pad in pads))  # fmt: skip
            got = b""
            while got.count(b"HTTP/1.1 404") < len(pads):
                got += s.recv(1 << 20)

        heads(range(1, 101))  # warm the worker's buffers
        baseline = worker.memory_full_info().uss
        for first in range(4200, 8000, 100):  # 3,800: with the 100 above, under its cap
            heads(range(first, first + 100))
    # (a few MiB of the worker's heap may stay in use for a while: 3-12 MiB seen)
    wait_for(lambda: worker.memory_full_info().uss - baseline < 20 * 1024 * 1024, timeout=10,
             what="the worker's growth to fall under 20 MiB")  # fmt: skip
    assert request(srv, "HEAD", "/kv/x", token=token_of("t1")).status == 404  # others unaffected


@pytest.mark.parametrize(
    "change, why",
    [
        # `printf %s "$TOKEN" | sha256sum` with TOKEN unset: a bare "Bearer" was the tenant
        (("token_sha256", hashlib.sha256(b"").hexdigest()), "digest of an empty token"),
        # the unnamed default namespace's name in /kv/stats and /metrics (one hid the other)
        (("namespace", "Default"), "choose another"),
        # its KV-events topic kv@pool:eg-kv/team@default@default starts with namespace
        # team's, kv@pool:eg-kv/team@default: a router of team's received its blocks
        (("namespace", "team@default"), "without '@'"),
    ],
    ids=["empty-token", "default-namespace", "at-in-namespace"],
)
def test_a_tokens_file_that_would_mislead_is_refused_naming_the_line(tmp_path, change, why):
    from eg_kv.errors import ConfigError
    from eg_kv.server.tenants import parse

    key, value = change
    text = tokens_toml([{"name": "team-a"}, {"name": "team-b"}])
    lines = text.splitlines()
    at = max(i for i, ln in enumerate(lines) if ln.startswith(("token_sha256", "role")))
    if key == "token_sha256":
        lines[at - 1] = f'token_sha256 = "{value}"'
    else:
        lines.insert(at + 1, f'{key} = "{value}"')
    with pytest.raises(ConfigError, match=why) as refused:
        parse("\n".join(lines), 1 << 30, "tokens.toml")
    assert "line" in str(refused.value)


def test_an_empty_bearer_token_is_no_tenants_token(tmp_path):
    from aiohttp.test_utils import make_mocked_request

    from eg_kv.server.auth import Auth
    from eg_kv.server.tenants import load

    path = write_tokens(tmp_path / "tokens.toml", TENANTS)
    auth = Auth(load(str(path), 1 << 30), str(path))
    for header in ("Bearer", "Bearer ", "bearer   "):
        req = make_mocked_request("GET", "/kv/x", headers={"Authorization": header})
        assert auth.authenticate(req) == "authorization required: the bearer token is empty"
