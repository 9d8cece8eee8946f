"""Every fenced code block of README.md and docs/**/*.md runs, parses, or says why it cannot
(issue 25, item 3).

The convention (tests/docs/md_blocks.py's docstring, in full in tests/docs/README.md): the
line before a fence may carry ``<!-- example: run|start|parse|skip: REASON -->``; yaml, json
and toml default to ``parse``; python and shell blocks must be marked. ``run`` blocks are
executed against a real eg-kv server this test starts (the documented port 9130 becomes a
free one), ``start`` blocks (servers: ``eg-kv serve``, ``lmcache server``) must come up and
listen, then are stopped by pid; ``skip`` blocks show up as skipped, with their reason.
"""

from __future__ import annotations

import pytest
from block_runs import exercise, parse_block
from helpers.common import ROOT
from md_blocks import Block, collect

BLOCKS, PROBLEMS = collect(ROOT)
#: Seconds a test gets besides its block's own timeout: starting the test's server,
#: stopping what the block left.
SLACK = 90


def _params(modes: tuple[str, ...]) -> list:
    """One test per block in ``modes``; a block that repeats another word for word (the
    README's LMCache command is also on its docs page) is run once, under both places."""
    params = []
    first: dict[tuple, str] = {}
    for b in BLOCKS:
        if b.mode not in modes:
            continue
        key = (b.mode, b.lang, b.text, b.flags, b.timeout, b.expected)
        if b.mode in ("run", "start") and key in first:
            continue
        first[key] = b.where
        marks = [pytest.mark.timeout(b.timeout + SLACK)]
        if "lmcache" in b.text.lower() and b.mode != "skip":
            marks.append(pytest.mark.lmcache)
        if b.mode in ("run", "start"):
            marks.append(pytest.mark.slow)
        also = [o.where for o in BLOCKS if o is not b and o.mode == b.mode and o.text == b.text]
        also = also if b.mode in ("run", "start") else []
        params.append(pytest.param(b, id="+".join([b.where, *also]), marks=marks))
    return params


def test_every_block_runs_parses_or_says_why():
    """No python or shell block without a marker, no marker that is malformed or stray."""
    assert BLOCKS, "no code block found in README.md and docs/"
    assert not PROBLEMS, "\n" + "\n".join([*PROBLEMS, "(the convention: tests/docs/README.md)"])


@pytest.mark.parametrize("block", _params(("run", "start")))
def test_block_runs(block: Block, tmp_path):
    exercise(block, tmp_path)


@pytest.mark.parametrize("block", _params(("parse",)))
def test_block_parses(block: Block, tmp_path):
    assert parse_block(block, tmp_path)


@pytest.mark.parametrize("block", _params(("skip",)))
def test_block_not_runnable_here(block: Block):
    pytest.skip(f"{block.where}: {block.reason}")


def test_the_readmes_lmcache_server_command_is_started():
    """The issue's failing command: README's ``lmcache server ... --l2-adapter`` is a
    ``start`` block (run with the pinned LMCache by test_block_runs), on loopback."""
    found = [b for b in BLOCKS if "lmcache server" in b.text and "--l2-adapter" in b.text]
    readme = [b for b in found if b.path == "README.md"]
    assert readme, "README.md has no `lmcache server ... --l2-adapter` block"
    for b in found:
        assert b.mode == "start", f"{b.where}: mark it <!-- example: start -->, not {b.mode}"
        assert "--http-host 127.0.0.1" in b.text, f"{b.where}: LMCache's HTTP API off loopback"


def test_the_quick_start_and_the_client_examples_run():
    """The issue's other failures as pasted: the Quick start's page PUT with curl, and the
    client API's Python (sync and async) must stay ``run`` blocks, never skipped or parsed."""
    front = ("README.md", "docs/getting-started.md", "docs/clients.md")
    python = [b for b in BLOCKS if b.path in front and b.lang == "python"]
    curl = [b for b in BLOCKS if b.path in front and "--data-binary @$D/page.bin" in b.text]
    assert len({b.path for b in python}) == 3 and curl, "the examples moved: update this test"
    for b in python + curl:
        assert b.mode == "run", f"{b.where} is {b.mode!r}: it must run as pasted"
    assert any("asyncio.run(" in b.text for b in python), "the async client's example"
