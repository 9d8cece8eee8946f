"""The ``eg-kv`` command helps (issue 25, item 4): ``--version``; the token the same
documented ways (``$EPISTEMIC_GRAPH_KVCACHE_TOKEN`` or ``--token-file``) and a 401 that
names both; sizes in human units (``--json`` raw); namespaces and set members as aligned
tables; which address was tried and how to point elsewhere; start-up progress and what
``--fresh`` dropped. Real processes, real servers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers.common import ROOT, free_port, unique_slab_name
from helpers.server_http import request
from helpers.tenants import token_of, write_tokens

import eg_kv
from eg_kv.slab.store import Slab
from workers.supervisor import PROGRESS_EVERY_S, ProgressLog

ENV_TOKEN = "EPISTEMIC_GRAPH_KVCACHE_TOKEN"
ENV_ADDR = "EPISTEMIC_GRAPH_KVCACHE_ADDR"
#: Variables that would point the command elsewhere or lend it a token.
_CLEAN = (ENV_TOKEN, ENV_ADDR, "EPISTEMIC_GRAPH_KVCACHE_URL")


def eg_kv_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    return subprocess.run(
        [sys.executable, "-m", "workers", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={**base, **(env or {})},
    )  # fmt: skip


def columns(line: str) -> list[int]:
    """The end offset of each cell of an aligned (right-aligned) table line."""
    return [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_version():
    out = eg_kv_cmd("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"eg-kv {eg_kv.__version__}"
    script = os.path.join(ROOT, ".venv", "bin", "eg-kv")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"eg-kv {eg_kv.__version__}"


def test_help_names_the_token_ways_and_the_addresses():
    stats = " ".join(eg_kv_cmd("stats", "--help").stdout.split())
    assert ENV_TOKEN in stats and "--token-file PATH" in stats and "never on the command" in stats
    assert ENV_ADDR in stats and "127.0.0.1:9130" in stats and "--json" in stats
    check = " ".join(eg_kv_cmd("check", "--help").stdout.split())
    assert "needs no token" in check and ENV_TOKEN in check and "--token-file" in check
    assert ENV_ADDR in check and "--json" in check
    # A token is never an argument: there is no --token to put one in ps.
    assert eg_kv_cmd("stats", "--token", "x").returncode == 2


def test_stats_token_ways_and_the_401_line(server_factory, tmp_path):
    secret = "tok-cli-help-7Hq2"
    srv = server_factory(workers=1, capacity="16MiB", env={ENV_TOKEN: secret})
    request(srv, "PUT", "/kv/t1", b"x" * 70_000)
    by_env = eg_kv_cmd("stats", "--url", srv.url, "--json", env={ENV_TOKEN: secret})
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["resident_bytes"] == 70_000  # --json: raw integers
    good = tmp_path / "token"
    good.write_text(secret + "\n")
    by_file = eg_kv_cmd("stats", "--addr", str(srv.port), "--token-file", str(good))
    assert by_file.returncode == 0, by_file.stderr
    shown = dict(line.split(None, 1) for line in by_file.stdout.splitlines() if line.strip())
    assert shown["resident_bytes"] == "68.4 KiB" and shown["capacity_bytes"] == "16 MiB"
    assert shown["page_size"] == "64 KiB" and shown["unique_blocks"] == "1"

    none = eg_kv_cmd("stats", "--url", srv.url)
    assert none.returncode == 1 and none.stdout == ""
    assert len(none.stderr.strip().splitlines()) == 1, none.stderr
    assert "401" in none.stderr and "none was sent" in none.stderr
    assert ENV_TOKEN in none.stderr and "--token-file" in none.stderr
    bad = tmp_path / "wrong"
    bad.write_text("not-the-token-9x")
    wrong = eg_kv_cmd("stats", "--url", srv.url, "--token-file", str(bad))
    assert wrong.returncode == 1 and f"--token-file {bad} was refused" in wrong.stderr
    assert ENV_TOKEN in wrong.stderr and "not-the-token-9x" not in wrong.stderr
    wrong = eg_kv_cmd("stats", "--url", srv.url, env={ENV_TOKEN: "wrong-tok-5"})
    assert f"${ENV_TOKEN} was refused" in wrong.stderr and "wrong-tok-5" not in wrong.stderr
    missing = eg_kv_cmd("stats", "--url", srv.url, "--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "cannot read --token-file" in missing.stderr
    (tmp_path / "empty").write_text("\n")
    empty = eg_kv_cmd("stats", "--url", srv.url, "--token-file", str(tmp_path / "empty"))
    assert empty.returncode == 1 and "is empty" in empty.stderr


def test_admin_stats_namespaces_table(server_factory, tmp_path):
    path = write_tokens(tmp_path / "tokens.toml", [
        {"name": "boss", "role": "admin"},
        {"name": "team-a", "quota": "4MiB"},
        {"name": "b", "namespace": "team-bee"},
    ])  # fmt: skip
    srv = server_factory(workers=1, capacity="16MiB", extra=("--tokens", str(path)))
    assert request(srv, "PUT", "/kv/a1", b"a" * 100_000, token=token_of("team-a")).status == 201
    assert request(srv, "PUT", "/kv/b1", b"b" * 3_000, token=token_of("b")).status == 201
    assert request(srv, "GET", "/kv/a1", token=token_of("team-a")).status == 200
    assert request(srv, "GET", "/kv/zz", token=token_of("team-a")).status == 404
    tok = tmp_path / "admin-token"
    tok.write_text(token_of("boss"))
    out = eg_kv_cmd("stats", "--url", srv.url, "--token-file", str(tok))
    assert out.returncode == 0, out.stderr
    assert "{" not in out.stdout  # no Python dict
    lines = out.stdout.splitlines()
    head = lines.index("namespaces (4):")  # the admin's own ("boss") too
    table = lines[head + 1 : head + 6]
    assert table[0].split() == ["namespace", "blocks", "resident", "logical", "quota", "used",
                                "quota", "hits", "misses", "hit", "rate"]  # fmt: skip
    rows = {row.split()[0]: row for row in table[1:]}
    assert set(rows) == {"default", "boss", "team-a", "team-bee"}
    assert rows["team-a"].split()[1:9] == ["1", "97.7", "KiB", "97.7", "KiB", "128", "KiB",
                                           "4"]  # fmt: skip
    assert rows["team-a"].endswith("50.0%")
    assert "2.93 KiB" in rows["team-bee"] and "none" in rows["team-bee"]
    edges = {tuple(columns(row)[1:]) for row in table}
    assert len(edges) == 1, table  # right-aligned: each column ends at one offset
    shown = dict(line.split(None, 1) for line in lines[:head] if line.strip())
    assert shown["resident_bytes"] == "101 KiB"
    raw = json.loads(eg_kv_cmd("stats", "--url", srv.url, "--token-file", str(tok),
                               "--json").stdout)  # fmt: skip
    assert raw["namespaces"]["team-a"]["quota_bytes"] == 4 << 20


def test_set_stats_members_table(server_factory):
    one = server_factory(workers=1, capacity="16MiB")
    two = server_factory(workers=1, capacity="32MiB")
    request(one, "PUT", "/kv/m1", b"1" * 5_000)
    down = f"127.0.0.1:{free_port()}"
    url = f"{one.url},{two.url},http://{down}"
    out = eg_kv_cmd("stats", "--url", url, "--timeout", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"server set {url}: 2 of 3 member(s) up")
    shown = dict(line.split(None, 1) for line in lines[1:] if line.strip() and "  " in line)
    assert shown["capacity_bytes"] == "48 MiB" and shown["resident_bytes"] == "4.88 KiB"
    start = next(k for k, line in enumerate(lines) if line.startswith("member "))
    header, *rows = lines[start : start + 4]
    assert header.split()[:6] == ["member", "state", "blocks", "resident", "capacity", "hit"]
    by_id = {row.split()[0]: row for row in rows}
    assert by_id[f"127.0.0.1:{one.port}"].split()[1:6] == ["up", "1", "4.88", "KiB", "16"]
    assert by_id[f"127.0.0.1:{two.port}"].split()[1:3] == ["up", "0"]
    assert by_id[down].split()[1] == "down"
    ups = [columns(by_id[f"127.0.0.1:{srv.port}"]) for srv in (one, two)]
    assert ups[0][1:] == ups[1][1:]  # aligned
    raw = json.loads(eg_kv_cmd("stats", "--url", url, "--timeout", "2", "--json").stdout)
    assert raw["sum"]["capacity_bytes"] == 48 << 20


def test_no_server_names_the_address_and_how_to_point_elsewhere():
    port = free_port()
    out = eg_kv_cmd("stats", "--addr", f"127.0.0.1:{port}")
    err = out.stderr
    assert out.returncode == 1 and len(err.strip().splitlines()) == 1
    assert f"no eg-kv server answers at http://127.0.0.1:{port} (from --addr)" in err
    assert "eg-kv serve" in err and "--addr" in err and ENV_ADDR in err
    out = eg_kv_cmd("stats", env={ENV_ADDR: str(port)})
    assert f"127.0.0.1:{port} (from ${ENV_ADDR})" in out.stderr
    out = eg_kv_cmd("check", "--addr", f"127.0.0.1:{port}")
    assert out.returncode == 1
    assert f"no slab /eg-kv-{port} on this host" in out.stderr
    assert f"a server at 127.0.0.1:{port}, from --addr" in out.stderr
    assert "--addr" in out.stderr and ENV_ADDR in out.stderr and "--slab-name" in out.stderr


def test_check_human_and_json(server_factory):
    port = free_port()
    srv = server_factory(workers=1, capacity="16MiB", port=port, slab_name=f"/eg-kv-{port}")
    request(srv, "PUT", "/kv/c1", b"c" * 70_000)
    out = eg_kv_cmd("check", "--addr", f"127.0.0.1:{port}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 blocks in 1 namespace(s), 68.4 KiB resident of 16 MiB" in out.stdout
    out = eg_kv_cmd("check", "--addr", f"127.0.0.1:{port}", "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["clean"] and report["problems"] == []
    assert report["resident_bytes"] == 70_000 and report["capacity_bytes"] == 16 << 20


def test_fresh_logs_what_it_dropped(server_factory):
    name = unique_slab_name("fresh")
    first = server_factory(workers=1, capacity="16MiB", slab_name=name, extra=("--keep",))
    request(first, "PUT", "/kv/f1", b"f" * 5_000)
    request(first, "PUT", "/kv/f2", b"g" * 5_000)
    assert first.stop() == 0 and Slab.exists_named(name)
    again = server_factory(workers=1, capacity="16MiB", slab_name=name, port=first.port,
                           extra=("--keep",))  # fmt: skip
    assert again.stop() == 0
    log = again.log()
    assert f"re-attaching slab {name} (16MiB) left by pid {first.pid}" in log
    assert re.search(rf"re-attached slab {name} left by pid {first.pid} in [\d.]+ s: 2 blocks", log)
    fresh = server_factory(workers=1, capacity="16MiB", slab_name=name, extra=("--fresh",))
    log = fresh.log()
    assert (f"--fresh: dropped slab {name} (16MiB in 64KiB pages, left by pid {again.pid}): "
            "2 blocks, 9.77 KiB resident") in log  # fmt: skip
    assert log.index("--fresh: dropped") < log.index(f"creating slab {name}: 16MiB")


def test_progress_log_reports_chunks_with_a_percentage(caplog):
    name = unique_slab_name("prog")
    seen: list[tuple[str, int, int]] = []
    slab = Slab.create(name, 600 << 20, progress=lambda *a: seen.append(a))
    try:
        steps = [s for s, _, _ in seen]
        assert steps.count("allocating") == 3 and steps.count("prefaulting") == 3
        assert seen[-1][1] == seen[-1][2] == slab.geometry.total_size
        walked: list[tuple[str, int, int]] = []
        slab.repair(progress=lambda *a: walked.append(a))
        assert walked and walked[0] == ("checking slots", 0, slab.geometry.nslots)
    finally:
        slab.close()
        slab.unlink()
    caplog.set_level("INFO", logger="eg_kv.supervisor")
    report = ProgressLog("creating slab /x", every=0.01)
    report("prefaulting", 1 << 30, 4 << 30)  # too soon after the start: quiet
    time.sleep(0.02)
    report("prefaulting", 3 << 30, 4 << 30)
    assert [r.getMessage() for r in caplog.records] == [
        "creating slab /x: prefaulting 75% (3 GiB of 4 GiB, 0 s so far)"
    ]


@pytest.mark.slow
def test_a_slab_of_gibs_logs_before_and_while_it_is_made(server_factory):
    # The server allocates without prefaulting (~0.25 s a GiB here): a 3 GiB slab logs its
    # first line, and progress where it took over 2 s.
    if os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize < 4 << 30:
        pytest.skip("/dev/shm has under 4 GiB free")
    srv = server_factory(workers=1, capacity="3GiB", ready_s=120)
    log = srv.log()
    first = log.index("creating slab")
    assert "(allocating it)" in log[first : log.index("\n", first)]
    took = re.search(r"created slab \S+: 3GiB .* in ([\d.]+) s", log)
    assert took, log
    if float(took.group(1)) > PROGRESS_EVERY_S + 0.5:  # how fast depends on the host
        assert re.search(r"creating slab \S+: allocating \d+% \(", log), log


def test_set_stats_takes_the_token_the_same_ways(server_factory, tmp_path):
    secret = "tok-set-help-4Kd9"
    one, two = (server_factory(workers=1, capacity="8MiB", env={ENV_TOKEN: secret})
                for _ in range(2))  # fmt: skip
    url = f"{one.url},{two.url}"
    tok = tmp_path / "token"
    tok.write_text(secret)
    out = eg_kv_cmd("stats", "--url", url, "--token-file", str(tok))
    assert out.returncode == 0 and "2 of 2 member(s) up" in out.stdout, out.stderr
    out = eg_kv_cmd("stats", "--url", url, env={ENV_TOKEN: secret})
    assert out.returncode == 0 and "2 of 2 member(s) up" in out.stdout, out.stderr
    out = eg_kv_cmd("stats", "--url", url, "--timeout", "2")
    assert out.returncode == 1 and secret not in out.stderr + out.stdout
    assert "answered 401 and none was sent" in out.stderr and ENV_TOKEN in out.stderr
    assert "--token-file PATH" in out.stderr
