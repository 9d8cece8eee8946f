"""Imports point one way, and the folders say which way (docs/design.md, "Folders").

A module's layer is its folder: ``eg_kv/*.py`` is the base (``kvcache.py`` and
``__init__.py`` are the public face, above everything), ``eg_kv/slab/`` the slab,
``eg_kv/disk/`` the disk tier beside it, ``eg_kv/server/`` the server, ``eg_kv/client/``
the clients, ``eg_kv/lmcache/`` the LMCache plugins. Every import is read from the source
(at any depth: inside functions and ``TYPE_CHECKING`` blocks too), so an upward edge or a
cycle fails here even when it is written to dodge Python's import order. And the clients
need none of the server's packages: the sync client runs with aiohttp, posix_ipc and
prometheus_client unimportable.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "eg_kv"

#: The layers, bottom up, and what each may import from eg_kv besides itself.
MAY_IMPORT = {
    "base": set(),
    "slab": {"base"},
    "disk": {"base", "slab"},
    "server": {"base", "slab", "disk"},
    "client": {"base", "slab-read"},
    "lmcache": {"base", "client"},
    "vllm": {"base", "client"},
    "sglang": {"base", "client"},
    "kvevents": {"base", "slab"},
    "public": {"base", "client", "lmcache"},
}
#: The slab's read side: what a client on the slab's host maps (no posix_ipc). The clients
#: may import these and nothing else of the slab; they import nothing else of the slab.
SLAB_READ_SIDE = {"eg_kv.slab", "eg_kv.slab.layout", "eg_kv.slab.view", "eg_kv.slab.local",
                  "eg_kv.slab.local_leases"}  # fmt: skip
#: Base modules a layer must not use all the same: the slab takes its sizes as arguments,
#: never the server's settings.
MAY_NOT_IMPORT = {"slab": {"eg_kv.config"}}
#: Over this many lines a module is a bag, unless its docstring says why it is a hot path.
MAX_LINES = 900


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module in {"eg_kv", "eg_kv.kvcache"}:
        return "public"
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return "base"
    return parts[1]


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The eg_kv modules (or packages) one ``from ... import ...`` names."""
    if node.level:
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        base = package[: len(package) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    if target.split(".")[0] not in {"eg_kv", "workers"}:
        return []
    out = []
    for alias in node.names:  # `from pkg import module` names a module, else a name in it
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def imports_of(module: str, source: str | None = None) -> set[str]:
    """Every eg_kv (or workers) module ``module`` imports, at any depth."""
    tree = ast.parse(source if source is not None else MODULES[module].read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in {"eg_kv", "workers"})
    return out - {module}


GRAPH = {m: imports_of(m) for m in MODULES}


def _allowed(module: str, target: str) -> bool:
    if target.split(".")[0] == "workers":
        return False
    if target not in MODULES:  # a name that is no module: a typo, or a package that went
        return False
    mine, theirs = layer_of(module), layer_of(target)
    if target in MAY_NOT_IMPORT.get(mine, set()):
        return False
    if mine == theirs:
        # The slab's read side never reaches into the store (posix_ipc).
        return not (module in SLAB_READ_SIDE and target not in SLAB_READ_SIDE)
    if theirs == "slab" and "slab-read" in MAY_IMPORT[mine]:
        return target in SLAB_READ_SIDE
    return theirs in MAY_IMPORT[mine]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_downwards(module):
    wrong = sorted(t for t in GRAPH[module] if not _allowed(module, t))
    assert not wrong, (
        f"{module} ({layer_of(module)}) imports {wrong} "
        f"({', '.join(layer_of(t) if t in MODULES else '?' for t in wrong)}); "
        "docs/design.md says what each folder may import"
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_even_within_a_layer():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_a_cycle_and_a_wrong_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = textwrap.dedent(
        """
        from .store import Slab
        from .. import wire
        from ..server import app
        import workers.worker

        def later():
            from ..client.sync import RemoteKVConnector
        """
    )
    got = imports_of("eg_kv.slab.view", source)
    assert got == {
        "eg_kv.slab.store", "eg_kv.wire", "eg_kv.server.app", "workers.worker",
        "eg_kv.client.sync",
    }  # fmt: skip
    assert not _allowed("eg_kv.slab.view", "eg_kv.slab.store")  # the read side, into the store
    assert not _allowed("eg_kv.client.sync", "eg_kv.slab.store")
    assert _allowed("eg_kv.client.sync", "eg_kv.slab.view")
    assert not _allowed("eg_kv.slab.store", "eg_kv.config")
    assert not _allowed("eg_kv.client.sets", "eg_kv.lmcache.l2")
    assert not _allowed("eg_kv.errors", "workers.worker")


def test_every_folder_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(MAY_IMPORT), f"a new folder needs a row in MAY_IMPORT: {folders}"
    assert not [p for p in PACKAGE.rglob("*.py") if not (p.parent / "__init__.py").exists()]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_a_bag(module):
    """Every module says its one job; none is over MAX_LINES unless it says it is a hot
    path kept whole (and why)."""
    source = MODULES[module].read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    assert doc.strip(), f"{module} has no docstring saying its job"
    lines = source.count("\n")
    assert lines <= MAX_LINES or "hot path" in doc.lower(), (
        f"{module} is {lines} lines: split it along its jobs, or say in its docstring why "
        "it is a hot path kept whole"
    )


_BLOCKED_CLIENT = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"aiohttp", "posix_ipc", "prometheus_client"}:
                raise ImportError(f"{name} is blocked for this test")
            return None

    sys.meta_path.insert(0, Block())
    import eg_kv
    from eg_kv.kvcache import RemoteKVConnector

    with RemoteKVConnector(base_url=sys.argv[1]) as kv:
        assert kv.put("layered", b"x" * 100_000)
        assert kv.get("layered") == b"x" * 100_000
        assert kv.exists_many(["layered", "nope"]) == [True, False]
        assert kv.delete("layered")
    assert eg_kv.RemoteKVConnector is RemoteKVConnector
    blocked = ("aiohttp", "posix_ipc", "prometheus_client", "eg_kv.slab.store", "eg_kv.server")
    for name in blocked:
        assert name not in sys.modules, name
    print("ok")
    """
)


def test_sync_client_runs_without_the_servers_packages(server_factory):
    srv = server_factory(workers=1)
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKED_CLIENT, srv.url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_wheel_lists_every_package():
    """A folder of eg_kv missing from pyproject's packages is missing from the wheel (and
    its imports fail only where eg-kv was installed from one)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {module_name(p.parent / "__init__.py") for p in PACKAGE.rglob("__init__.py")}
    assert folders <= listed, f"add to pyproject.toml's packages: {sorted(folders - listed)}"
