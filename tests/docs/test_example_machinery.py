"""The machinery of test_examples.py on Markdown written here: the collector finds what the
convention forbids, and a block that fails, prints otherwise, forgets the token, talks to no
server, hangs, or leaves a process behind fails its test (or is stopped)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest
from block_runs import exercise, parse_block, substitute_ports
from md_blocks import Block, collect, console_parts, output_matches


def blocks_of(tmp_path, markdown: str) -> tuple[list[Block], list[str]]:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "page.md").write_text(textwrap.dedent(markdown))
    return collect(tmp_path)


def one(tmp_path, markdown: str) -> Block:
    blocks, problems = blocks_of(tmp_path, markdown)
    assert not problems and len(blocks) == 1, (blocks, problems)
    return blocks[0]


def test_the_collector_finds_what_the_convention_forbids(tmp_path):
    blocks, problems = blocks_of(
        tmp_path,
        """\
        ```bash
        echo unmarked
        ```
        <!-- example: skip -->
        ```python
        print("a skip without a reason")
        ```
        <!-- example: sprint -->
        ```python
        print("an unknown mode")
        ```
        <!-- example: run -->

        ```python
        print("a blank line between marker and fence")
        ```
        <!-- example: output -->
        ```text
        after no run block
        ```
        <!-- example: run tokn -->
        ```bash
        echo an unknown option
        ```
        <!-- example: run -->
        ```text
        not code
        ```
        ```yaml
        a: 1
        ```
        <!-- example: run -->
        ```yaml
        b: 2
        ```
        """,
    )
    wheres = sorted(int(p.split(":")[1]) for p in problems)
    # 12 is the stray marker, 14 the block it was meant for.
    assert wheres == [1, 5, 9, 12, 14, 18, 22, 26, 33], "\n".join(problems)
    assert [(b.lang, b.mode, b.line) for b in blocks] == [("yaml", "parse", 29)]


def test_markers_options_indented_fences_and_output(tmp_path):
    blocks, problems = blocks_of(
        tmp_path,
        """\
        1. In a list:

           <!-- example: run token timeout=7 -->
           ```python
           print("hi")
           ```
           <!-- example: output -->
           ```text
           hi
           ```
        <!-- example: skip: needs a GPU -->
        ~~~console
        $ nvidia-smi
        ~~~
        <!-- example: start no-server -->
        ````bash
        eg-kv serve
        ```
        ````
        """,
    )
    assert not problems, problems
    run, skip, start = blocks
    assert (run.mode, run.flags, run.timeout, run.expected) == (
        "run", {"token"}, 7.0, "hi\n"
    )  # fmt: skip
    assert run.text == 'print("hi")\n'
    assert (skip.mode, skip.reason, skip.lang) == ("skip", "needs a GPU", "console")
    assert (start.mode, start.flags, start.text) == ("start", {"no-server"}, "eg-kv serve\n```\n")


def test_console_blocks_and_output_matching():
    commands, output = console_parts("$ echo a \\\n  b\na b\n$ true\n")
    assert (commands, output) == ("echo a \\\n  b\ntrue\n", "a b")
    assert output_matches("a\n...\nz", "a\nb\nc\nz\n")
    assert output_matches("a\n...\nz", "a\nz")
    stats = "KvCacheStats(unique_blocks=1, ...)"
    assert output_matches(stats, "KvCacheStats(unique_blocks=1, x=2)")
    assert not output_matches(stats, "KvCacheStats(unique_=1)")
    assert not output_matches("a\nz", "a\nb\nz")
    assert not output_matches("a...", "a\nb")


def test_only_whole_documented_ports_are_replaced():
    ports = {9130: 40001, 5555: 40002}
    text = "http://127.0.0.1:9130 --port 5555 91301 1.9130 x9130 :9130/kv"
    assert substitute_ports(text, ports) == (
        "http://127.0.0.1:40001 --port 40002 91301 1.9130 x9130 :40001/kv"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_block_against_the_test_server(tmp_path):
    """curl with the token, and the python client from the environment, both hit the
    documented port: each block passes, its output checked."""
    block = one(
        tmp_path,
        """\
        <!-- example: run token -->
        ```bash
        D=$(mktemp -d)
        head -c 70000 /dev/urandom > $D/page.bin
        curl -sf -X PUT -H "Authorization: Bearer $EPISTEMIC_GRAPH_KVCACHE_TOKEN" \\
          --data-binary @$D/page.bin http://127.0.0.1:9130/kv/doc-test-page
        python -c "
        from eg_kv.kvcache import RemoteKVConnector
        with RemoteKVConnector.from_env() as kv:
            print(len(kv.get('doc-test-page')))"
        ```
        <!-- example: output -->
        ```text
        ...
        70000
        ```
        """,
    )
    res = exercise(block, tmp_path)
    assert res.stdout.strip().endswith("70000")


def test_a_block_that_leaves_a_file_in_the_checkout_fails(tmp_path):
    """Examples write to a temporary directory (``mktemp -d``: the runner's TMPDIR lies in
    the test's own directory, removed with it); a file left beside the checkout fails."""
    block = one(
        tmp_path,
        """\
        <!-- example: run no-server -->
        ```bash
        D=$(mktemp -d)
        touch $D/fine.bin stray.bin
        ```
        """,
    )
    with pytest.raises(AssertionError, match=r"writes \['stray.bin'\] into the checkout"):
        exercise(block, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "body, why",
    [
        ("exit 3", "failed"),
        ("echo something else", "printed other than its expected output"),
        ("curl -s http://127.0.0.1:9130/kv/stats; echo", "requests answered [('GET'"),
        ("echo 70000", "sent no request"),
    ],
)
def test_a_failing_run_block_fails(tmp_path, body, why):
    block = one(
        tmp_path,
        f"""\
        <!-- example: run token -->
        ```bash
        {body}
        ```
        <!-- example: output -->
        ```text
        ...
        ```
        """,
    )
    block.expected = "70000\n" if "something" in body else block.expected
    with pytest.raises(AssertionError, match=why.replace("[", r"\[").replace("(", r"\(")):
        exercise(block, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_what_a_block_leaves_running_is_stopped_and_a_hang_times_out(tmp_path):
    block = one(
        tmp_path,
        """\
        <!-- example: run no-server timeout=3 -->
        ```bash
        sleep 600 &
        echo $! > child.pid
        sleep 600
        ```
        """,
    )
    with pytest.raises(AssertionError, match=r"still running after 3\.0s"):
        exercise(block, tmp_path)
    pid = int((tmp_path / "work" / "child.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_start_blocks_listen_or_fail(tmp_path):
    """A server on a documented port is waited on (not on one in a comment), then stopped;
    one that exits fails."""
    (tmp_path / "a").mkdir()
    ok = one(
        tmp_path / "a",
        """\
        <!-- example: start no-server timeout=20 -->
        ```bash
        python -m http.server --bind 127.0.0.1 5555   # a port in a comment: 9131
        ```
        """,
    )
    t0 = time.monotonic()
    exercise(ok, tmp_path / "a")
    assert time.monotonic() - t0 < 20
    (tmp_path / "b").mkdir()
    bad = one(
        tmp_path / "b",
        """\
        <!-- example: start no-server timeout=20 -->
        ```bash
        echo no server here; exit 0
        ```
        """,
    )
    with pytest.raises(AssertionError, match="exited before listening"):
        exercise(bad, tmp_path / "b")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "lang, text, error",
    [
        ("python", "await main()\n", SyntaxError),
        ("bash", "if true; then\n", AssertionError),
        ("json", '{"module_path": "eg_kv.kvcache", "class_name": "NoSuchClass"}', AssertionError),
        ("yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {portz: []}\n",
         AssertionError),
        ("toml", "[[tenant]]\nname = \n", Exception),
    ],
)  # fmt: skip
def test_a_bad_block_does_not_parse(tmp_path, lang, text, error):
    block = Block("x.md", 1, lang, lang, text, "parse")
    with pytest.raises(error):
        parse_block(block, tmp_path)


@pytest.mark.lmcache
@pytest.mark.timeout(60)
def test_lmcache_configs_go_through_lmcaches_loader(tmp_path):
    good = (
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 5\nremote_serde: naive\n"
        "remote_storage_plugins: [egkv]\nextra_config:\n"
        "  remote_storage_plugin.egkv.module_path: eg_kv.kvcache\n"
        "  remote_storage_plugin.egkv.class_name: EgKvConnectorAdapter\n"
    )
    checked = parse_block(Block("x.md", 1, "yaml", "yaml", good, "parse"), tmp_path)
    assert "LMCache config" in checked
    bad = good.replace("EgKvConnectorAdapter", "NoSuchAdapter")
    with pytest.raises(AssertionError, match="NoSuchAdapter"):
        parse_block(Block("x.md", 1, "yaml", "yaml", bad, "parse"), tmp_path)
