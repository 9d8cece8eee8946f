"""The front door and the docs site: README.md stays short and points at pages that exist,
the docs' endpoint table lists exactly the server's routes, every page is in the site's
nav, and the site builds with warnings as errors (``mkdocs build --strict``: a broken link
or anchor fails) where mkdocs is installed (the ``docs`` extra; ``.ci/run`` builds it too).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eg_kv.config import Settings
from eg_kv.server.app import make_app

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
API = DOCS / "api.md"
#: Issue 25: a README a newcomer reads in ten minutes; the rest lives in docs/.
README_MAX_BYTES = 15 * 1024

_ROW = re.compile(r"^\| `([A-Z]+)` \| `([^`]+)` \|", re.M)
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move detail into docs/"


def test_the_readme_holds_no_commit_ids_or_measurement_history():
    # A commit id is hex with a letter and a digit; the headline table carries ratios only.
    ids = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", readme()) if re.search(r"[a-f]", w)
           and re.search(r"[0-9]", w)]  # fmt: skip
    assert not ids, ids
    assert "commit" not in readme().lower()


def test_the_readme_links_resolve():
    targets = [m.group(1) for m in _LINK.finditer(readme()) if "://" not in m.group(1)]
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_readme_names_every_extra():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    named = set(re.findall(r"^\| `\[([a-z0-9-]+)\]` \|", readme(), re.M))
    assert named == extras, f"README's extras table: {sorted(named)}; pyproject: {sorted(extras)}"
    assert "docs" in extras


def _documented_routes() -> set[tuple[str, str]]:
    text = API.read_text(encoding="utf-8")
    found = re.search(r"<!-- endpoints -->\n(.*?)<!-- /endpoints -->", text, re.S)
    assert found, "docs/api.md lost its <!-- endpoints --> ... <!-- /endpoints --> markers"
    rows = {(method, path.replace("<hash>", "{hash}")) for method, path in _ROW.findall(found[1])}
    assert rows, "no rows in the endpoint table"
    return rows


def _served_routes() -> set[tuple[str, str]]:
    # The app as a worker builds it; building attaches no slab (that happens on start-up).
    app = make_app(Settings())
    served = set()
    for route in app.router.routes():
        if route.method == "*":  # the catch-alls: wrong methods and unknown paths
            continue
        assert route.resource is not None
        served.add((route.method, route.resource.canonical))
    return served


def test_the_endpoint_table_lists_exactly_the_servers_routes():
    documented, served = _documented_routes(), _served_routes()
    assert ("PUT", "/kv/{hash}") in served and ("GET", "/healthz") in served
    assert documented == served, (
        f"docs/api.md's endpoint table differs from eg_kv/server/app.py's routes: "
        f"undocumented {sorted(served - documented)}, not served {sorted(documented - served)}"
    )


def _nav_files(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    return []


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    yaml = pytest.importorskip("yaml")
    with open(ROOT / "mkdocs.yml", encoding="utf-8") as f:
        config = yaml.safe_load(f)
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav)), "a page twice in the nav"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - set(nav) == set(), f"pages missing from mkdocs.yml's nav: {pages - set(nav)}"
    assert set(nav) - pages == set(), f"nav entries without a page: {set(nav) - pages}"
    assert config.get("strict") is True


@pytest.mark.timeout(180)
def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        mkdocs = Path(shutil.which("mkdocs") or "")
    if not mkdocs.is_file():
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
        capture_output=True, text=True, timeout=170, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    # Belt and braces: strict counts warnings only where they are logged (not under -q).
    assert "WARNING" not in out.stderr, out.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
