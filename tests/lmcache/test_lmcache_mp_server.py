"""A real ``lmcache server`` (LMCache's multiprocess server, on CPU) with our L2 adapter
over a real eg-kv server, started the way the compose file starts it.

What differs between LMCache 0.5.6 and 0.5.7rc2 for such a server: 0.5.7 reads an API key
(``--api-key-file PATH``, or ``LMCACHE_API_KEY_FILE`` / ``LMCACHE_API_KEY``) and then asks
for it on its HTTP admin API, all but ``/`` and ``/healthcheck`` (the compose file's
healthcheck needs none); 0.5.6 has no such flag and refuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from importlib.metadata import version

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from helpers.common import free_port, wait_for
from helpers.lmcache_l2 import LMCACHE_ENV, TESTS, our_json

pytestmark = pytest.mark.lmcache

#: 0.5.7 and later read an API key; 0.5.6 does not know the flag.
HAS_API_KEY = not version("lmcache").startswith("0.5.6")


def http_status(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


class MPServer:
    """``lmcache server`` on loopback with our ``native_plugin`` adapter."""

    def __init__(self, eg_kv_url: str, *extra: str, env: dict | None = None) -> None:
        self.http = f"http://127.0.0.1:{free_port()}"
        cmd = [
            sys.executable, "-m", "lmcache.cli.main", "server",
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--chunk-size", "256",
            "--max-workers", "1", "--http-host", "127.0.0.1",
            "--http-port", self.http.rsplit(":", 1)[1],
            "--l2-adapter", our_json(eg_kv_url, timeout_s=5), *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**LMCACHE_ENV, **(env or {})}, cwd=TESTS.parent,
        )  # fmt: skip

    def output(self) -> str:
        self.stop()
        return (self.proc.stdout.read() if self.proc.stdout else "")[-4000:]

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.output()
            try:
                return http_status(f"{self.http}/healthcheck") == 200
            except OSError:
                return False

        wait_for(up, timeout=90, interval=0.5, what="lmcache server's /healthcheck")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mp_server_with_our_adapter_and_an_api_key(server_factory, tmp_path):
    srv = server_factory(workers=1, capacity="16MiB")
    key = "k-" + os.urandom(16).hex()
    key_file = tmp_path / "lmcache-api-key"
    key_file.write_text(key + "\n")
    if not HAS_API_KEY:
        mp = MPServer(srv.url, "--api-key-file", str(key_file))
        assert mp.proc.wait(60) != 0
        assert "--api-key-file" in mp.output()  # "unrecognized arguments"
        return
    mp = MPServer(srv.url, "--api-key-file", str(key_file))
    try:
        mp.wait_ready()
        assert http_status(f"{mp.http}/") == 200  # public, as /healthcheck
        assert http_status(f"{mp.http}/status") == 401
        assert http_status(f"{mp.http}/status", key="wrong") == 401
        assert http_status(f"{mp.http}/status", key=key) == 200
        req = urllib.request.Request(
            f"{mp.http}/config/adapters", headers={"Authorization": f"Bearer {key}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            adapters = json.dumps(json.load(r))
        assert "native_plugin" in adapters or "RemoteKVL2Connector" in adapters, adapters
    finally:
        mp.stop()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mp_server_without_a_key_keeps_its_admin_api_open(server_factory):
    """No key (the compose file sets none): every route answers, on both releases."""
    srv = server_factory(workers=1, capacity="16MiB")
    env = {k: "" for k in ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE")}
    mp = MPServer(srv.url, env=env)
    try:
        mp.wait_ready()
        assert http_status(f"{mp.http}/status") == 200
    finally:
        mp.stop()
