"""Installing eg-kv as users do (issue 25, item 6), each into a fresh venv:

(a) ``pip install -e '.[lmcache]'`` from a copy of the checkout into a venv that has the
    CPU torch already (the README's first step) and LMCache's files (both linked in from
    the tests' own venv, see :func:`link_installed`), then ``eg-kv --version`` and
    ``import eg_kv.kvcache``;
(b) ``python -m build`` a wheel, install it alone (its dependencies from the index), run
    ``eg-kv serve`` from it on a free loopback port, PUT and GET a block, stop it by pid.

Slow (about a minute: (b) builds a wheel and installs its dependencies). pip's cache is the
user's (``PIP_CACHE_DIR`` or pip's default) and its configuration (indexes, find-links)
too, so what scripts/setup downloaded is not downloaded again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from helpers.common import ROOT, free_port, unique_slab_name, wait_for

from eg_kv import __version__
from eg_kv.slab.store import Slab

pytestmark = pytest.mark.slow


def sh(*argv: str | Path, cwd: Path | None = None, timeout: float = 600) -> str:
    """Run ``argv``; return its stdout. Raises AssertionError with its output on failure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["LMCACHE_TRACK_USAGE"] = "false"
    res = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{argv} exited {res.returncode}:\n{out[-6000:]}"
    return res.stdout


def fresh_venv(path: Path) -> Path:
    """A new venv at ``path`` with the base interpreter of the one running the tests;
    returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    sh(base, "-m", "venv", path)
    return path / "bin" / "python"


def pip(python: Path, *args: str | Path, timeout: float = 900) -> str:
    return sh(python, "-m", "pip", "--disable-pip-version-check", "-q", *args, timeout=timeout)


def link_installed(python: Path, names: list[str]) -> None:
    """Give the venv of ``python`` the distributions ``names`` as the tests' own venv has
    them, with everything they require, as links to the installed files (copies across
    file systems).

    The README's first step installs a CPU torch: that is pip's and PyTorch's work (about
    50 s here for 750 MB), not eg-kv's, and what the next step must find there. LMCache
    and what it needs are what ``pip install -e '.[lmcache]'`` resolves; scripts/setup
    installs them from the index into a fresh venv on every CI run, so linking them here
    leaves this test what is its own: that the extra names them (pip checks each one is
    there, at the pinned version) and that ``eg_kv.kvcache`` imports with that extra
    alone (about 60 s less).
    """
    from importlib import metadata

    from packaging.requirements import Requirement

    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        dist = metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel)).resolve()
            dest = site / rel
            if rel.parts[0] == ".." or not src.is_file() or dest.exists():
                continue  # scripts outside site-packages are not needed
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dest)
            except OSError:
                shutil.copy2(src, dest)


def checkout_copy(dest: Path) -> Path:
    """The files a checkout has (tracked, and untracked ones git does not ignore), copied."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture
def tmp_path(tmp_path):
    """pytest's tmp_path, emptied afterwards: a venv with torch is 2 GB, and pytest keeps
    the last three runs' directories."""
    yield tmp_path
    for entry in tmp_path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


@pytest.mark.timeout(1500)
def test_editable_install_with_the_lmcache_extra(tmp_path):
    src = checkout_copy(tmp_path / "eg-kv")
    py = fresh_venv(tmp_path / "venv")
    t0 = time.monotonic()
    link_installed(py, ["torch", "lmcache"])
    torch = sh(py, "-c", "import torch; print(torch.__version__)").strip()
    (tmp_path / "torch.txt").write_text(f"torch=={torch}\n")
    pip(py, "install", "-e", f"{src}[lmcache]", "-c", tmp_path / "torch.txt", timeout=1200)
    took = time.monotonic() - t0
    print(f"torch and lmcache linked in, then pip install -e '.[lmcache]': {took:.0f} s")
    eg_kv = tmp_path / "venv" / "bin" / "eg-kv"
    assert sh(eg_kv, "--version").split() == ["eg-kv", __version__]
    where = sh(py, "-c", "import eg_kv.kvcache, eg_kv; print(eg_kv.__file__)", cwd=tmp_path)
    assert where.strip() == str(src / "eg_kv" / "__init__.py")  # editable: the checkout
    # The extra brought the pinned LMCache, and the plugins LMCache loads import with it.
    version = "from importlib.metadata import version; print(version('lmcache'))"
    assert sh(py, "-c", version).strip() == "0.5.6"
    # ...because the installed eg-kv's extra names it (LMCache's files were linked in).
    requires = "from importlib.metadata import requires; print(*requires('eg-kv'), sep='\\n')"
    named = [r.replace(" ", "") for r in sh(py, "-c", requires).splitlines()]
    assert 'lmcache==0.5.6;extra=="lmcache"' in named, named
    sh(py, "-c", "from eg_kv.kvcache import RemoteKVL2Connector, EgKvConnectorAdapter")


@pytest.mark.timeout(900)
def test_a_built_wheel_installs_and_serves(tmp_path):
    pytest.importorskip("build", reason="needs `build` (the dev extra: scripts/setup)")
    src = checkout_copy(tmp_path / "eg-kv")
    sh(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("eg_kv-*.whl")
    assert wheel.name.startswith(f"eg_kv-{__version__}-py3-none-any")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("eg_kv_workers/__main__.py", "eg_kv/kvcache.py", "eg_kv/vllm/connector.py",
                   "eg_kv/kvevents/publisher.py"):  # fmt: skip
        assert module in names, f"{module} is not in {wheel.name}"
    # No generic top-level package: the checkout's workers/ installs as eg_kv_workers.
    assert not any(n.startswith("workers/") for n in names), sorted(names)[:20]
    py = fresh_venv(tmp_path / "venv")
    pip(py, "install", wheel)
    eg_kv = tmp_path / "venv" / "bin" / "eg-kv"
    where = sh(py, "-c", "import eg_kv; print(eg_kv.__file__)", cwd=tmp_path)
    assert str(tmp_path / "venv") in where, where  # the wheel's copy, not the checkout
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    gone = subprocess.run([py, "-c", "import workers"], cwd=tmp_path, capture_output=True,
                          env=clean)  # fmt: skip
    assert gone.returncode != 0 and b"No module named 'workers'" in gone.stderr

    port, slab = free_port(), unique_slab_name("wheel")
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [eg_kv, "serve", "--addr", f"127.0.0.1:{port}", "--workers", "1",
             "--capacity", "16MiB", "--slab-name", slab,
             "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items()
                 if not k.startswith(("EPISTEMIC_GRAPH_KVCACHE_", "PYTHON"))},
        )  # fmt: skip
    try:

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, timeout=60, what="the wheel's eg-kv serve")
        # Every package made it into the wheel: the publisher's process imports its own.
        wait_for(lambda: b"KV events published on" in log.read_bytes(), timeout=30,
                 what="the wheel's KV-events publisher")  # fmt: skip
        page = os.urandom(70_000)
        put = urllib.request.Request(url + "/kv/wheel-test", data=page, method="PUT")
        with urllib.request.urlopen(put, timeout=10) as r:
            assert r.status == 201
        with urllib.request.urlopen(url + "/kv/wheel-test", timeout=10) as r:
            assert r.read() == page
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        Slab.unlink_named(slab)
    assert proc.returncode == 0, log.read_text()
