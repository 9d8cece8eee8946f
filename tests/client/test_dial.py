"""The sync client's connect is held to its timeout (eg_kv.client.dial): a DNS server that
never answers cost 6 s with timeout_s=1 (the resolver's own timeouts), and a name whose
three addresses drop every SYN 3 s (each address got the whole timeout). Run in a private
network and mount namespace (``unshare -r -m -n``), so the DNS and hosts files it needs
touch nothing outside (tests/client/dial_proc.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers.common import ROOT

pytestmark = pytest.mark.timeout(60)
DRIVER = ROOT / "tests" / "client" / "dial_proc.py"


def test_a_silent_dns_server_and_dropping_addresses_cost_one_timeout(tmp_path):
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) for a private namespace")
    resolv, hosts = tmp_path / "resolv.conf", tmp_path / "hosts"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:3 attempts:2\n")
    hosts.write_text("127.0.0.1 localhost\n" + "".join(
        f"127.0.0.{i} kv.test\n" for i in (2, 3, 4)))  # fmt: skip
    script = (f"ip link set lo up && mount --bind {resolv} /etc/resolv.conf && "
              f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {DRIVER}")  # fmt: skip
    probe = subprocess.run(["unshare", "-r", "-m", "-n", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no private namespace here: {probe.stderr.decode()[:200]}")
    proc = subprocess.run(["unshare", "-r", "-m", "-n", "sh", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    got = json.loads(lines[-1][7:])
    assert got["addresses"] == 3, got
    assert got["dns"] < 1.5, got
    assert got["addresses_dropping"] < 1.5, got
