"""The times the docs and the scripts quote (set-up, the suite, the vLLM end to end, what
``slow`` means) are the ones measured, kept in one place: ``scripts/times.toml``; and what
scripts/setup installs is what the docs say.

Each quote is found by its own words; a quote that is reworded fails here too (the
pattern no longer matches), so it cannot drift away unseen.
"""

from __future__ import annotations

import re

import pytest
from helpers.common import ROOT

try:  # Python 3.11+; the tomli backport before (as eg_kv.server.tenants)
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib

TIMES = tomllib.loads((ROOT / "scripts" / "times.toml").read_text())

#: (what, file, pattern with one group: the figure quoted there).
QUOTES = [
    ("suite", "README.md", r"the whole suite: about (\S+) minutes on 2 cores"),
    ("setup", "README.md", r"the whole suite: about \S+ minutes on 2 cores, \+(\S+) to set up"),
    ("suite", "docs/development.md", r"the whole suite: about (\S+) minutes on 2 cores"),
    ("suite", "scripts/test", r"processes: about (\S+) minutes on 2 cores"),
    ("setup_venv", "scripts/setup", r"building \.venv .*: about (\S+) minutes, once"),
    ("setup_vllm", "scripts/setup-vllm", r"building \$V .*: about (\S+) minutes, once"),
    ("e2e_vllm", "scripts/e2e_vllm", r"What it does \(about (\S+) minutes on 2 cores"),
    ("e2e_vllm", "docs/benchmarks.md", r"`scripts/e2e_vllm` \(about (\S+) minutes on 2 cores"),
    ("e2e_vllm", "docs/lmcache-vllm.md", r"the script takes about (\S+) minutes\s+on 2 cores"),
    ("slow", "README.md", r'`scripts/test -m "not slow"` skips the tests of (\S+) s or more'),
    ("slow", "docs/development.md", r"without the tests of (\S+) s or more"),
    ("slow", "pyproject.toml", r"slow: takes (\S+) s or more here"),
]


@pytest.mark.parametrize(
    ("what", "path", "pattern"), QUOTES, ids=[f"{q[1]}:{q[0]}" for q in QUOTES]
)
def test_a_quoted_time_is_the_measured_one(what, path, pattern):
    text = (ROOT / path).read_text()
    found = re.findall(pattern, text)
    assert found, f"{path} no longer quotes the {what} time as {pattern!r}: update QUOTES"
    figure = TIMES[what].get("minutes", TIMES[what].get("seconds"))
    assert set(found) == {figure}, f"{path} says {found} for {what}; scripts/times.toml: {figure}"


def test_the_extras_scripts_setup_installs_are_the_ones_the_docs_name():
    """``scripts/setup``'s ``pip install -e '.[...]'`` and docs/development.md's account of
    it name the same extras."""
    installed = re.findall(
        r"pip install -e '\.\[([a-z,]+)\]'", (ROOT / "scripts" / "setup").read_text()
    )
    named = re.findall(
        r"`scripts/setup`: eg-kv with `\[([a-z,]+)\]`",
        (ROOT / "docs" / "development.md").read_text(),
    )
    assert named and installed, "the quotes moved: update this test"
    assert named[0] == installed[-1], (
        f"docs/development.md: {named[0]}; scripts/setup: {installed[-1]}"
    )
