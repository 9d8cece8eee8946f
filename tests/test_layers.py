"""Imports point one way: base, then the store, then the server and the clients, then the
integrations (docs/design.md has the table). And the clients need none of the server's
packages: the sync client runs with aiohttp, posix_ipc and prometheus_client unimportable.
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

#: Every module of eg_kv and its layer. A new module must be placed here.
LAYERS = {
    "base": {"errors", "units", "address", "procs", "config", "tenants", "batchwire"},
    # The slab's layout and its read side, which clients on the slab's host map read-only.
    "slab reading": {"layout", "slabview", "localslab"},
    "store": {"slab"},
    "server": {"_compat", "connections", "replies", "metrics", "runstate", "app", "hints"},
    "clients": {"http11", "clientcore", "localreads", "client", "aio", "placement", "members",
                "cluster"},
    "integrations": {"kvcache", "lmcache_l2", "lmcache_remote", "lmcache_adapter",
                     "store_warnings", "write_gate"},
}  # fmt: skip
#: What each layer may import from eg_kv (besides itself).
MAY_IMPORT = {
    "base": {"base"},
    "slab reading": {"base", "slab reading"},
    "store": {"base", "slab reading", "store"},
    "server": {"base", "slab reading", "store", "server"},
    "clients": {"base", "slab reading", "clients"},
    "integrations": {"base", "clients", "integrations"},
}
#: Base modules a layer must not use all the same: the store takes its sizes as arguments,
#: never the server's settings.
MAY_NOT_IMPORT = {"store": {"config"}, "slab reading": {"config"}}
LAYER_OF = {mod: layer for layer, mods in LAYERS.items() for mod in mods}


def _eg_kv_imports(path: Path) -> set[str]:
    """The eg_kv modules a file imports (relative or absolute, at any depth)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1 or base.startswith("eg_kv"):
                base = base.removeprefix("eg_kv").lstrip(".")
                if base:
                    out.add(base.split(".")[0])
                else:  # from . import x, y
                    out.update(alias.name for alias in node.names)
            elif base.startswith("workers") or (node.level and base.startswith("workers")):
                out.add("workers")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eg_kv."):
                    out.add(alias.name.split(".")[1])
                elif alias.name.startswith("workers"):
                    out.add("workers")
    return out


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(LAYER_OF), (
        f"place new modules in LAYERS: {sorted(modules - set(LAYER_OF))}; "
        f"gone: {sorted(set(LAYER_OF) - modules)}"
    )


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_imports_point_downwards(module):
    layer = LAYER_OF[module]
    imported = _eg_kv_imports(PACKAGE / f"{module}.py") - {module}
    assert "workers" not in imported, f"eg_kv.{module} imports workers"
    wrong = {m for m in imported if LAYER_OF.get(m) not in MAY_IMPORT[layer]}
    wrong |= imported & MAY_NOT_IMPORT.get(layer, set())
    assert not wrong, (
        f"eg_kv.{module} ({layer}) imports {sorted(wrong)} "
        f"({', '.join(sorted({LAYER_OF.get(m, '?') for m in wrong}))})"
    )


def test_the_import_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from .slab import Slab\nfrom eg_kv import app\nimport workers.worker\n")
    assert _eg_kv_imports(bad) == {"slab", "app", "workers"}


_BLOCKED_CLIENT = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"aiohttp", "posix_ipc", "prometheus_client"}:
                raise ImportError(f"{name} is blocked for this test")
            return None

    sys.meta_path.insert(0, Block())
    from eg_kv.kvcache import RemoteKVConnector

    with RemoteKVConnector(base_url=sys.argv[1]) as kv:
        assert kv.put("layered", b"x" * 100_000)
        assert kv.get("layered") == b"x" * 100_000
        assert kv.exists_many(["layered", "nope"]) == [True, False]
        assert kv.delete("layered")
    blocked = ("aiohttp", "posix_ipc", "prometheus_client", "eg_kv.slab.store", "eg_kv.server.app")
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
