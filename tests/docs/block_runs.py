"""Running and parsing the blocks tests/docs/md_blocks.py collects, as the convention says.

``run`` and ``start`` blocks run alone in a fresh directory that looks like a checkout
(symlinks to its top-level entries), with the venv's ``bin`` first on PATH and the
documented ports replaced with free ones; whatever a block leaves running (its process
group) is stopped by pid. ``parse`` blocks go through their language's parser, LMCache
configs through LMCache's own loader, Kubernetes objects through kubernetes-validate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from helpers.common import ROOT, free_port, wait_for
from helpers.servers import Server, start_server, stop_server
from md_blocks import Block, console_parts, output_matches

from eg_kv.slab.store import Slab

#: The documented ports: each, as a whole word in a block, becomes a free port.
#: 9130 is eg-kv's (the test's server's, unless ``no-server``), 9131 a second eg-kv the
#: docs start on "another port"; 5555, 8080 and 9090 are LMCache's server, its HTTP admin
#: API and its Prometheus endpoint.
PORTS = (9130, 9131, 5555, 8080, 9090)
EG_KV_PORT = 9130
SECOND_EG_KV_PORT = 9131
#: An access-log line of eg-kv's aiohttp workers: the method, path and status.
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3}) ')
#: Top-level keys that make a YAML mapping an LMCache configuration.
_LMCACHE_KEYS = {"chunk_size", "local_cpu", "max_local_cpu_size", "remote_url",
                 "remote_storage_plugins", "remote_serde", "extra_config"}  # fmt: skip


@dataclasses.dataclass
class Result:
    """What a block did: exit status (None: still running when stopped), output, ports."""

    returncode: int | None
    stdout: str
    stderr: str
    ports: dict[int, int]

    def show(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def substitute_ports(text: str, ports: dict[int, int]) -> str:
    """Replace each documented port written as a whole word with its free port."""
    for old, new in ports.items():
        text = re.sub(rf"(?<![\w.]){old}(?![\w])", str(new), text)
    return text


def port_map(eg_kv_port: int | None = None) -> dict[int, int]:
    """A free port for each documented one (eg-kv's may be given: the test server's)."""
    return {p: (eg_kv_port if p == EG_KV_PORT and eg_kv_port else free_port()) for p in PORTS}


def checkout_like(workdir: Path) -> None:
    """Fill ``workdir`` with symlinks to the checkout's top-level entries (not .git), so a
    block's ``scripts/...``, ``services/...``, ``.venv/bin/...`` work; what it writes
    stays in ``workdir``."""
    for entry in ROOT.iterdir():
        if entry.name != ".git" and not (workdir / entry.name).exists():
            (workdir / entry.name).symlink_to(entry)


def block_env(ports: dict[int, int], token: str | None, tmpdir: Path) -> dict[str, str]:
    """The environment of a running block: the venv first on PATH, eg-kv's documented
    variables pointing at the test's port, no stray eg-kv variable from outside, and
    ``TMPDIR`` inside the test's own directory (what a block's ``mktemp -d`` makes goes
    with it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_KVCACHE_")}
    port = ports[EG_KV_PORT]
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        EPISTEMIC_GRAPH_KVCACHE_URL=f"http://127.0.0.1:{port}",
        EPISTEMIC_GRAPH_KVCACHE_ADDR=f"127.0.0.1:{port}",
        LMCACHE_TRACK_USAGE="false",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmpdir),
    )
    if token:
        env["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = token
    return env


def command(block: Block, workdir: Path, ports: dict[int, int]) -> tuple[list[str], str]:
    """The argv that runs ``block`` in ``workdir`` and the expected stdout (or ``""``).

    Python goes to a file (tracebacks name it) run by this interpreter; shell blocks run
    with ``bash -e``; a console block's ``$`` lines are its commands, the rest its output.
    """
    text, expected = block.text, block.expected or ""
    if block.lang == "console":
        text, shown = console_parts(text)
        expected = expected or shown
    text = substitute_ports(text, ports)
    script = workdir / ("example.py" if block.lang == "python" else "example.sh")
    script.write_text(text)
    if block.lang == "python":
        return [sys.executable, str(script)], expected
    return ["bash", "-e", str(script)], expected


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop ``proc``'s process group (it leads one: ``start_new_session``) by its pid:
    SIGTERM, then SIGKILL past ``timeout``; wait until no member is left."""
    pgid = proc.pid

    def gone() -> bool:
        proc.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        if gone():
            return
    raise AssertionError(f"process group {pgid} survived SIGKILL")


@contextlib.contextmanager
def launched(
    block: Block, workdir: Path, ports: dict[int, int], token: str | None
) -> Iterator[tuple[subprocess.Popen, str, Path, Path]]:
    """Start ``block`` in its own process group; yield ``(proc, expected, out, err)`` and
    stop the group afterwards, whatever happened."""
    argv, expected = command(block, workdir, ports)
    out, err, tmpdir = workdir / ".stdout", workdir / ".stderr", workdir / ".tmp"
    tmpdir.mkdir(exist_ok=True)
    # Files, not pipes: a background child the block leaves holds a pipe open forever.
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            argv, cwd=workdir, env=block_env(ports, token, tmpdir), stdin=subprocess.DEVNULL,
            stdout=o, stderr=e, start_new_session=True,
        )  # fmt: skip
    try:
        yield proc, expected, out, err
    finally:
        stop_group(proc)


def run_block(block: Block, workdir: Path, ports: dict[int, int], token: str | None) -> Result:
    """Run a ``run`` block to completion (within its timeout).

    Raises:
        AssertionError: it ran past its timeout, exited non-zero, or printed other than
        its expected output.
    """
    with launched(block, workdir, ports, token) as (proc, expected, out, err):
        try:
            code: int | None = proc.wait(block.timeout)
        except subprocess.TimeoutExpired:
            code = None
    res = Result(code, out.read_text(errors="replace"), err.read_text(errors="replace"), ports)
    assert code is not None, f"{block.where}: still running after {block.timeout}s\n{res.show()}"
    assert code == 0, f"{block.where}: failed\n{res.show()}"
    if expected:
        assert output_matches(expected, res.stdout), (
            f"{block.where}: printed other than its expected output\n--- expected\n"
            f"{expected}\n{res.show()}"
        )
    return res


def start_block(
    block: Block, workdir: Path, ports: dict[int, int], token: str | None, serving: bool
) -> Result:
    """Start a ``start`` block, wait until it listens on every documented port it names
    outside comments (eg-kv's too when the test runs no server: ``serving`` False; eg-kv's
    alone when it names none), check it is still up, then stop it.

    Raises:
        AssertionError: it exited, or did not listen within its timeout.
    """
    # Ports in comments (``# 127.0.0.1:9130``, ``# another port: --addr 9131``) only explain.
    code = re.sub(r"(^|\s)#.*", "", block.text)
    names = {p for p in PORTS if re.search(rf"(?<![\w.]){p}(?![\w])", code)}
    if serving:
        names.discard(EG_KV_PORT)
    wanted = sorted(ports[p] for p in names) or [ports[EG_KV_PORT]]
    with launched(block, workdir, ports, token) as (proc, _, out, err):

        def show() -> str:
            code = proc.poll()
            return Result(code, out.read_text(errors="replace"),
                          err.read_text(errors="replace"), ports).show()  # fmt: skip

        def up() -> bool:
            assert proc.poll() is None, f"{block.where}: exited before listening\n{show()}"
            return all(listening(p) for p in wanted)

        try:
            wait_for(up, timeout=block.timeout, interval=0.2, what=f"{block.where} to listen")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{show()}") from None
        assert proc.poll() is None, f"{block.where}: exited after listening\n{show()}"
    return Result(proc.returncode, out.read_text(errors="replace"),
                  err.read_text(errors="replace"), ports)  # fmt: skip


def access_lines(log: str) -> list[tuple[str, str, int]]:
    """``(method, path, status)`` of each request in an eg-kv server's access log."""
    return [(m["method"], m["path"], int(m["status"])) for m in _ACCESS.finditer(log)]


def check_requests(block: Block, log: str) -> list[tuple[str, str, int]]:
    """A ``run`` block with a test server must have sent it a request, none answered
    401/403 (a forgotten token) or 5xx.

    Returns:
        The requests seen. Raises: AssertionError otherwise.
    """
    seen = access_lines(log)
    assert seen, f"{block.where}: sent no request to the test's eg-kv server (say no-server)"
    bad = [r for r in seen if r[2] in (401, 403) or r[2] >= 500]
    assert not bad, f"{block.where}: requests answered {bad}"
    return seen


def mark_log(srv: Server) -> int:
    """Where the block's requests begin in ``srv``'s log: after a marked /healthz of ours.

    start_server's own /healthz polls are logged as their answers go out, possibly after
    it returned: a length taken then could count one as the block's.
    """
    mark = f"/healthz?example-begins={secrets.token_hex(4)}"
    with urllib.request.urlopen(srv.url + mark, timeout=10) as r:
        r.read()

    def marked() -> str:
        text = srv.log()  # the whole line: the mark and its end
        return text if mark in text and "\n" in text[text.index(mark) :] else ""

    log = wait_for(marked, timeout=10, what="the mark in the access log")
    return log.index("\n", log.index(mark)) + 1


def exercise(block: Block, tmp: Path) -> Result:
    """Run or start ``block`` as the convention says: the test's eg-kv server first (unless
    ``no-server``; with a token under ``token``), the block in a checkout-like directory,
    then the server's access log checked (``run``); everything stopped by pid after.

    ``os.environ`` must hold no ``EPISTEMIC_GRAPH_KVCACHE_*`` variable (tests/docs/conftest.py
    removes them): the test's server would read them.

    Returns:
        The block's :class:`Result`. Raises: AssertionError on any failure.
    """
    workdir = tmp / "work"
    workdir.mkdir()
    checkout_like(workdir)
    token = secrets.token_hex(16) if "token" in block.flags else None
    serving = "no-server" not in block.flags
    srv = None
    if serving:
        env = {"EPISTEMIC_GRAPH_KVCACHE_TOKEN": token} if token else None
        srv = start_server(tmp, workers=1, capacity="64MiB", extra=("--access-log",), env=env)
    ports = port_map(srv.port if srv else None)
    try:
        before = mark_log(srv) if srv else 0
        if block.mode == "start":
            return start_block(block, workdir, ports, token, serving)
        res = run_block(block, workdir, ports, token)
        left = _written(workdir)
        assert not left, f"{block.where} writes {left} into the checkout: use a temporary directory"
        if srv is not None:
            # The worker writes its access line as the answer goes out: wait for one.
            with contextlib.suppress(AssertionError):
                wait_for(lambda: access_lines(srv.log()[before:]), timeout=3, what="a request")
            check_requests(block, srv.log()[before:])
        return res
    finally:
        if srv is not None:
            stop_server(srv)
        else:
            # A block that ran eg-kv itself, on a port it was given, named its slab after
            # it; SIGTERM removes it, this is for one that was killed.
            for port in (ports[EG_KV_PORT], ports[SECOND_EG_KV_PORT]):
                with contextlib.suppress(Exception):
                    Slab.unlink_named(f"/eg-kv-{port}")


#: What the runner itself puts in a block's directory.
_RUNNERS_OWN = {".stdout", ".stderr", ".tmp", "example.py", "example.sh"}


def _written(workdir: Path) -> list[str]:
    """What a block left in its checkout-like directory besides the checkout's own links
    and the runner's files."""
    return sorted(e.name for e in workdir.iterdir()
                  if not e.is_symlink() and e.name not in _RUNNERS_OWN)  # fmt: skip


# ------------------------------------------------------------------------------- parse


def _importable(obj: object, where: str) -> None:
    """A mapping naming ``module_path`` and ``class_name`` (an LMCache plugin) must name a
    class that imports."""
    if isinstance(obj, dict) and {"module_path", "class_name"} <= obj.keys():
        module = importlib.import_module(obj["module_path"])
        assert hasattr(module, obj["class_name"]), f"{where}: no {obj['class_name']} in module"


def _lmcache_config(doc: dict, block: Block, tmp: Path) -> None:
    """Load an LMCache configuration with LMCache's own loader; import each remote storage
    plugin it names."""
    from lmcache.v1.config import LMCacheEngineConfig

    path = tmp / "lmcache.yaml"
    path.write_text(block.text)
    config = LMCacheEngineConfig.from_file(str(path))
    config.validate()
    extra = doc.get("extra_config") or {}
    for name in doc.get("remote_storage_plugins") or []:
        prefix = f"remote_storage_plugin.{name}."
        _importable(
            {"module_path": extra.get(prefix + "module_path"),
             "class_name": extra.get(prefix + "class_name")}, block.where,
        )  # fmt: skip


def _kubernetes(doc: dict, where: str) -> bool:
    """Validate a Kubernetes object offline, where kubernetes-validate has its schema
    (not for kustomize's files nor custom resources). Returns whether it was validated."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return False
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{where}: not a valid {doc.get('kind')}: {e}") from None
    return True


def parse_block(block: Block, tmp: Path) -> str:
    """Check a ``parse`` block's syntax in its language (see the module docstring).

    Returns:
        What was checked, e.g. ``"yaml, LMCache config"``. Raises: AssertionError, or the
        parser's own error.
    """
    lang, text, where = block.lang, block.text, block.where
    if lang == "python":
        compile(text, where, "exec")  # to bytecode: an await outside a function fails here
        return "python syntax"
    if lang in ("bash", "console"):
        script = console_parts(text)[0] if lang == "console" else text
        res = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert res.returncode == 0, f"{where}: bash -n: {res.stderr}"
        return "bash -n"
    if lang == "json":
        _importable(json.loads(text), where)
        return "json"
    if lang == "toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        tomllib.loads(text)
        return "toml"
    import yaml

    checked = ["yaml"]
    for doc in yaml.safe_load_all(text):
        if not isinstance(doc, dict):
            continue
        if "apiVersion" in doc and "kind" in doc:
            if _kubernetes(doc, where):
                checked.append(f"kubernetes {doc['kind']}")
        elif doc.keys() & _LMCACHE_KEYS and "services" not in doc:
            _lmcache_config(doc, block, tmp)
            checked.append("LMCache config")
    return ", ".join(checked)
