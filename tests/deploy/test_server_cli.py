"""The ``eg-kv`` command: argument parsing, the address grammar end to end, stats, check."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from helpers.common import ROOT, free_port, unique_slab_name, wait_for
from helpers.server_http import request

from eg_kv.config import settings_from_env
from eg_kv.slab import layout as L
from eg_kv.slab.store import Slab
from workers.__main__ import SERVE_FLAGS, build_parser


def eg_kv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_parser_serve_flags():
    args = build_parser().parse_args(
        ["serve", "--addr", "0.0.0.0:9130", "--workers", "4", "--capacity", "8GiB",
         "--page-size", "128KiB", "--max-block-size", "32MiB", "--keep", "--fresh",
         "--tls-cert", "c.pem", "--tls-key", "k.pem", "--drain-timeout", "3"]
    )  # fmt: skip
    assert args.command == "serve"
    s = settings_from_env({}, **{k: getattr(args, k) for k in SERVE_FLAGS})
    assert (s.host, s.port, s.workers) == ("0.0.0.0", 9130, 4)
    assert (s.capacity, s.page_size, s.max_block_size) == (8 << 30, 128 << 10, 32 << 20)
    assert s.keep and s.fresh and s.tls_cert == "c.pem" and s.drain_timeout_s == 3.0


def test_parser_defaults_bind_the_seed_default():
    args = build_parser().parse_args(["serve"])
    s = settings_from_env({}, **{k: getattr(args, k) for k in SERVE_FLAGS})
    assert (s.host, s.port, s.slab_name) == ("127.0.0.1", 9130, "/eg-kv-9130")
    assert not s.keep and not s.fresh and s.workers == (os.cpu_count() or 1)


def test_parser_rejects_unknown_commands_and_flags():
    for argv in (["nope"], ["serve", "--bogus"], []):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2


def test_help_runs():
    out = eg_kv("serve", "--help")
    assert out.returncode == 0 and "--max-block-size" in out.stdout
    assert os.access(os.path.join(ROOT, ".venv", "bin", "eg-kv"), os.X_OK)


@pytest.mark.parametrize(
    ("addr_env", "host"),
    [("{port}", "127.0.0.1"), ("127.0.0.1:{port}", "127.0.0.1"), ("[::1]:{port}", "::1")],
)
def test_env_address_grammar_end_to_end(tmp_path, addr_env, host):
    if host == "::1":
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    port = free_port()
    name = unique_slab_name("env")
    log = tmp_path / "serve.log"
    env = {**os.environ, "EPISTEMIC_GRAPH_KVCACHE_ADDR": addr_env.format(port=port)}
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "serve", "--workers", "1", "--capacity", "16MiB",
             "--slab-name", name],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    url_host = f"[{host}]" if ":" in host else host
    try:

        def up():
            if proc.poll() is not None:
                return True
            try:
                with urllib.request.urlopen(f"http://{url_host}:{port}/healthz", timeout=2) as r:
                    return json.loads(r.read())["workers_up"] == 1
            except OSError:
                return False

        wait_for(up, timeout=30, what="server on the env address")
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        Slab.unlink_named(name)


@pytest.mark.slow
def test_stats_command(server_factory):
    srv = server_factory(workers=1, env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "tok-for-stats"})
    request(srv, "PUT", "/kv/s1", b"12345")
    env = {"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "tok-for-stats"}
    out = eg_kv("stats", "--url", srv.url, "--json", env=env)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["unique_blocks"] == 1 and body["resident_bytes"] == 5
    out = eg_kv("stats", "--addr", str(srv.port), env=env)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["unique_blocks", "1"]
    out = eg_kv("stats", "--url", srv.url, env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "wrong"})
    assert out.returncode == 1 and "401" in out.stderr and "tok-for-stats" not in out.stderr
    out = eg_kv("stats", "--url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "no eg-kv server answers at" in out.stderr


def test_stats_follows_no_redirect_and_sends_the_token_nowhere_else():
    """A proxy answering 302 to another host: urllib followed it, Authorization and all.
    The command says where it was sent and stops; the other host hears nothing."""
    import http.server
    import threading

    heard: list[str | None] = []

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            heard.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Other)

    class Proxy(Other):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{other.server_port}/kv/stats")
            self.end_headers()

    proxy = http.server.HTTPServer(("127.0.0.1", 0), Proxy)
    threads = [threading.Thread(target=s.serve_forever) for s in (other, proxy)]
    for t in threads:
        t.start()
    try:
        out = eg_kv("stats", "--url", f"http://127.0.0.1:{proxy.server_port}",
                    env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "s3cret-for-stats"})  # fmt: skip
    finally:
        for s in (other, proxy):
            s.shutdown()
            s.server_close()
    assert out.returncode == 1 and "302" in out.stderr and "not followed" in out.stderr
    assert heard == [] and "s3cret-for-stats" not in out.stderr


def test_check_command_clean_and_damaged(slab, slab_name):
    slab.put("c1", b"x" * 70_000)
    out = eg_kv("check", "--slab-name", slab_name)
    assert out.returncode == 0 and "clean" in out.stdout and "1 blocks" in out.stdout
    slab._state[L.ST_UNIQUE_BLOCKS] += 3  # damage a derived counter behind the slab's back
    out = eg_kv("check", "--slab-name", slab_name)
    assert out.returncode == 1 and "unique_blocks" in out.stdout
    assert eg_kv("check", "--slab-name", unique_slab_name("none")).returncode == 1


def test_check_by_address_names_the_default_slab(server_factory):
    port = free_port()
    srv = server_factory(workers=1, port=port, slab_name=f"/eg-kv-{port}")
    request(srv, "PUT", "/kv/d", b"d")
    out = eg_kv("check", "--addr", f"127.0.0.1:{port}")
    assert out.returncode == 0 and "clean" in out.stdout


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [("0.0.0.0", None, True), ("10.1.2.3", None, True), ("eg-kv.internal", None, True),
     ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
     ("0.0.0.0", "s3cret-token-value", False)],
)  # fmt: skip
def test_a_server_bound_beyond_loopback_without_a_token_warns_naming_the_variable(
    host, token, warned
):
    from eg_kv.config import Settings
    from workers.supervisor import open_door_warning

    warning = open_door_warning(Settings(host=host, token=token))
    assert (warning is not None) == warned
    if warned:
        assert "EPISTEMIC_GRAPH_KVCACHE_TOKEN" in warning and "s3cret" not in warning
