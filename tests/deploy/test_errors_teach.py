"""Errors that teach (issue 36, item 3): every answer and message a user meets first says
what happened in their terms and names the fix. Real servers, the real command."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys

import pytest
from helpers.common import ROOT, free_port, unique_slab_name

from eg_kv.client.aio_connectors import AsyncRemoteKVConnector
from eg_kv.client.connectors import RemoteKVConnector

pytestmark = pytest.mark.timeout(120)


def eg_kv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(workers=1, capacity="16MiB", extra=("--max-block-size", "1MiB"))


def raw(srv, method: str, path: str, body: bytes = b"", length: int | None = None) -> bytes:
    """The whole raw answer (head and body) of one request on its own connection; a
    ``length`` announces a body that is never sent."""
    announced = len(body) if length is None else length
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  f"Content-Length: {announced}\r\n\r\n".encode() + body)  # fmt: skip
        out = b""
        while b"\r\n\r\n" not in out and (chunk := s.recv(65536)):
            out += chunk
        head, _, body = out.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n")[0])
        while len(body) < length and (chunk := s.recv(65536)):
            body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("GET", "/healthz", b""), ("GET", "/kv/stats", b""),
     ("POST", "/kv/batch/exists", b'{"addresses": ["a", "b"]}'),
     ("GET", "/kv/nope/exists", b"")],
)  # fmt: skip
def test_json_answers_end_with_a_newline(server, method, path, body):
    head, _, payload = raw(server, method, path, body).partition(b"\r\n\r\n")
    assert b"application/json" in head, head
    assert payload.endswith(b"}\n") and json.loads(payload)


def test_a_413_says_the_sizes_in_human_units_and_names_the_flag(server):
    answer = raw(server, "PUT", "/kv/too-big", length=3 << 20)
    status, _, payload = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), status
    text = payload.decode()
    assert "3,145,728 bytes" in text and "1 MiB" in text and "--max-block-size" in text, text


def test_a_mistyped_flag_shows_the_subcommands_usage():
    out = eg_kv("serve", "--capcity", "1GiB")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: eg-kv serve"), out.stderr
    assert "unrecognized arguments: --capcity" in out.stderr


@pytest.mark.parametrize("form", ["{port}", "localhost:{port}", "127.0.0.1:{port}"])
def test_stats_url_takes_what_addr_takes(server, form):
    out = eg_kv("stats", "--json", "--url", form.format(port=server.port))
    assert out.returncode == 0, out.stderr
    assert "unique_blocks" in json.loads(out.stdout)


def test_check_json_reports_an_error_as_json():
    out = eg_kv("check", "--json", "--slab-name", unique_slab_name())
    assert out.returncode == 1
    answer = json.loads(out.stdout)
    assert answer["command"] == "check" and "no slab" in answer["error"]


def test_the_slab_line_shows_human_sizes_and_no_allocating_line_precedes_a_refusal():
    port = free_port()
    out = eg_kv("serve", "--addr", f"127.0.0.1:{port}", "--workers", "1", "--capacity",
                "64TiB", "--slab-name", unique_slab_name())  # fmt: skip
    assert out.returncode != 0
    assert "lower --capacity" in out.stderr, out.stderr
    assert "allocating and prefaulting" not in out.stderr
    from workers.supervisor import shown_size

    assert shown_size(100_000_000) == "95.4 MiB (100,000,000 bytes)"
    assert shown_size(64 << 20) == "64MiB"


def test_a_client_warns_once_when_nothing_answers_and_misses_quietly_after(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.DEBUG, logger="eg_kv")
    with RemoteKVConnector(base_url=url, timeout_s=2, local_reads=False) as kv:
        for _ in range(3):
            assert kv.get("k") is None and kv.put("k", b"v") is False
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "unreachable" in warned[0].getMessage()
    assert url.removeprefix("http://") in warned[0].getMessage()


@pytest.mark.parametrize("value", ["text", 42, None, ["b"]])
def test_a_value_that_is_not_bytes_like_is_a_type_error_not_a_miss(server, value):
    with RemoteKVConnector(base_url=server.url) as kv:
        with pytest.raises(TypeError, match="bytes-like"):
            kv.put("typed", value)
        assert kv.put("typed", b"ok") is True

    async def aio() -> None:
        async with AsyncRemoteKVConnector(base_url=server.url) as akv:
            with pytest.raises(TypeError, match="bytes-like"):
                await akv.put("typed", value)

    asyncio.run(aio())


def test_free_space_is_never_rounded_up_to_the_capacity():
    from eg_kv.units import GiB, KiB, MiB, human_size

    assert human_size(GiB - 64 * KiB) == "1023.9 MiB"  # one page used: not "1024 MiB"
    assert human_size(GiB) == "1 GiB" and human_size(999 * MiB) == "999 MiB"


def test_the_e2e_script_reads_stats_with_the_token_from_the_environment(
    server_factory, monkeypatch
):
    import importlib.machinery
    import importlib.util

    token = "e2e-token-" + "x" * 24
    srv = server_factory(workers=1, capacity="8MiB", env={"EPISTEMIC_GRAPH_KVCACHE_TOKEN": token})
    loader = importlib.machinery.SourceFileLoader("e2e_vllm", str(ROOT / "scripts" / "e2e_vllm"))
    spec = importlib.util.spec_from_loader("e2e_vllm", loader)
    script = importlib.util.module_from_spec(spec)
    loader.exec_module(script)
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", token)
    assert "unique_blocks" in script.kv_stats(srv.url)
