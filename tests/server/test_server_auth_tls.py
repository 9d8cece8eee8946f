"""Bearer-token auth and TLS, against real servers (a certificate made by the test)."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import urllib.request

import psutil
import pytest
import trustme
from helpers.common import wait_for
from helpers.server_http import raw_exchange, request, status_of
from helpers.server_procs import gone

TOKEN = "s3cr3t-T0ken-which-must-never-leak"
AUTH_ENV = {"EPISTEMIC_GRAPH_KVCACHE_TOKEN": TOKEN}


@pytest.fixture
def authed(server_factory):
    return server_factory(workers=2, env=AUTH_ENV)


def _assert_401(reply, head: bool = False) -> None:
    assert reply.status == 401, reply
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert int(reply.headers["X-EgKv-Worker"]) > 0
    assert TOKEN not in reply.text and reply.text.count("\n") == (0 if head else 1)


ROUTES = [
    ("GET", "/kv/a", None), ("PUT", "/kv/a", b"x"), ("HEAD", "/kv/a", None),
    ("DELETE", "/kv/a", None), ("GET", "/kv/a/exists", None), ("GET", "/kv/stats", None),
    ("POST", "/kv/batch/exists", b'{"addresses": ["a"]}'), ("GET", "/metrics", None),
    ("GET", "/nowhere", None), ("POST", "/kv/a", b"x"), ("GET", "/kv/a/b", None),
]  # fmt: skip


def test_every_route_needs_the_token(authed):
    for method, path, body in ROUTES:
        head = method == "HEAD"
        _assert_401(request(authed, method, path, body, token=""), head)
        _assert_401(request(authed, method, path, body, token="wrong-token"), head)
        basic = {"Authorization": f"Basic {TOKEN}"}
        _assert_401(request(authed, method, path, body, headers=basic), head)
        assert request(authed, method, path, body).status != 401, (method, path)


def test_healthz_needs_no_token(authed):
    reply = request(authed, "GET", "/healthz", token="")
    assert reply.status == 200 and reply.json()["workers_up"] == 2


def test_healthz_answers_every_method_alike_with_or_without_the_token(authed):
    # A load balancer probing with HEAD and no token got 401 (only GET was an open
    # route; before the fix: HEAD 401 without the token, 405 with it).
    for token in ("", None):  # none, then the server's
        head = request(authed, "HEAD", "/healthz", token=token)
        assert head.status == 200 and head.body == b"", (token, head)
        assert int(head.headers["Content-Length"]) > 0
        for method in ("POST", "PUT", "DELETE"):
            reply = request(authed, method, "/healthz", b"", token=token)
            assert reply.status == 405, (method, token, reply)
            assert reply.headers["Allow"] == "GET, HEAD" and reply.text.count("\n") == 1


def test_authorized_roundtrip(authed):
    assert request(authed, "PUT", "/kv/tok", b"data").status == 201
    assert request(authed, "GET", "/kv/tok").body == b"data"
    assert request(authed, "GET", "/kv/tok", headers={"Authorization": f"bearer  {TOKEN} "}).body


def test_odd_authorization_headers_are_401_not_500(authed):
    for value in (b"Bearer \xff\xfe\xfd", b"Bearer", b"", b"Bearer " + b"a" * 8000, b"\x00"):
        raw = raw_exchange(
            authed.port,
            b"GET /kv/stats HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: "
            + value + b"\r\n\r\n",
        )  # fmt: skip
        assert status_of(raw) in (400, 401), raw[:200]


def test_expect_continue_without_token_is_401_before_the_body(authed):
    head = b"PUT /kv/e HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    with socket.create_connection(("127.0.0.1", authed.port), timeout=10) as s:
        s.sendall(head)
        reply = s.recv(65536)
    assert status_of(reply) == 401 and b"WWW-Authenticate: Bearer" in reply


def test_token_never_reaches_logs_or_argv(authed):
    request(authed, "GET", "/kv/stats", token="wrong-token")
    request(authed, "GET", "/kv/stats")
    request(authed, "PUT", "/kv/x", b"1")
    authed.stop()
    assert TOKEN not in authed.log()
    assert "wrong-token" not in authed.log()


def test_token_not_in_process_command_lines(authed):
    procs = [psutil.Process(authed.pid), *psutil.Process(authed.pid).children()]
    for p in procs:
        assert TOKEN not in " ".join(p.cmdline())


# ---------------------------------------------------------------------------- TLS


@pytest.fixture
def tls_files(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    cert.private_key_pem.write_to_path(str(key_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_path), append=True)
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return str(cert_path), str(key_path), ctx


def _start_tls(server_factory, ctx, workers=2, **kw):
    srv = server_factory(workers=workers, wait=False, **kw)
    srv.scheme = "https"

    def healthy():
        if srv.proc.poll() is not None:
            return True
        try:
            with urllib.request.urlopen(srv.url + "/healthz", timeout=2, context=ctx) as r:
                return json.loads(r.read()).get("workers_up") == workers
        except OSError:
            return False

    wait_for(healthy, timeout=30, what="TLS server healthy")
    assert srv.proc.poll() is None, srv.log()
    return srv


def test_tls_roundtrip(server_factory, tls_files):
    cert, key, ctx = tls_files
    srv = _start_tls(server_factory, ctx, extra=("--tls-cert", cert, "--tls-key", key))
    data = os.urandom(3 * 1024 * 1024 + 5)
    assert request(srv, "PUT", "/kv/secure", data, context=ctx).status == 201
    assert request(srv, "GET", "/kv/secure", context=ctx).body == data
    assert request(srv, "HEAD", "/kv/secure", context=ctx).headers["Content-Length"] == str(
        len(data)
    )
    # Plain HTTP on the TLS port gets no HTTP answer.
    raw = raw_exchange(srv.port, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n", timeout=3)
    assert not raw.startswith(b"HTTP/1.1 200")
    # A client that does not trust the CA refuses the server.
    with pytest.raises(ssl.SSLError):
        request(srv, "GET", "/healthz", context=ssl.create_default_context())


def test_tls_from_environment_with_token(server_factory, tls_files):
    cert, key, ctx = tls_files
    env = {**AUTH_ENV, "EPISTEMIC_GRAPH_KVCACHE_TLS_CERT": cert,
           "EPISTEMIC_GRAPH_KVCACHE_TLS_KEY": key}  # fmt: skip
    srv = _start_tls(server_factory, ctx, env=env)
    _assert_401(request(srv, "GET", "/kv/stats", context=ctx, token=""))
    assert request(srv, "GET", "/kv/stats", context=ctx).status == 200


def test_bad_certificate_stops_the_server_with_reason(server_factory, tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    srv = server_factory(workers=2, wait=False, extra=("--tls-cert", str(bad), "--tls-key",
                                                       str(bad)))  # fmt: skip
    assert srv.proc.wait(30) == 3
    assert "TLS" in srv.log()
    assert srv.log().count("could not start") == 0  # refused before any worker was forked


def test_a_replacement_that_cannot_boot_costs_its_slot_only(server_factory, tls_files):
    """A certificate being rotated (garbage here) when a worker dies: its replacement
    cannot boot. That stopped the whole server and removed its slab; now the other
    worker serves on, the slot tries again with a growing wait (each failure logged with
    its reason), and fills once the certificate is whole again."""
    cert, key, ctx = tls_files
    srv = _start_tls(server_factory, ctx, extra=("--tls-cert", cert, "--tls-key", key))
    assert request(srv, "PUT", "/kv/kept", b"k" * 1000, context=ctx).status == 201
    with open(cert) as f:
        good = f.read()
    with open(cert, "w") as f:
        f.write("garbage\n")
    victim, survivor = sorted(p.pid for p in psutil.Process(srv.pid).children())
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: srv.log().count("could not start") >= 4 or srv.proc.poll() is not None,
             timeout=30, what="the slot to fail 4 times")  # fmt: skip
    assert srv.proc.poll() is None, srv.log()[-2000:]
    log = srv.log()
    assert "SSLError" in log and "in 0.4 s (its slot keeps failing)" in log, log[-2000:]
    assert not gone(survivor)
    assert request(srv, "GET", "/kv/kept", context=ctx).body == b"k" * 1000
    with open(cert, "w") as f:
        f.write(good)

    def both_up() -> bool:
        try:
            with urllib.request.urlopen(srv.url + "/healthz", timeout=2, context=ctx) as r:
                return json.loads(r.read()).get("workers_up") == 2
        except OSError:
            return False

    wait_for(both_up, timeout=30, what="the slot filled again")
    assert srv.log().count("could not start") < 12, "the retries back off"
