"""The fenced code blocks of the project's Markdown and their ``<!-- example: ... -->`` markers.

The convention (also in tests/docs/README.md): the line directly before an opening fence
may carry a marker that says what the test does with the block:

- ``<!-- example: run [token] [no-server] [timeout=N] -->``: executed to completion;
- ``<!-- example: start [token] [no-server] [timeout=N] -->``: a server command, started,
  waited on until it listens, stopped;
- ``<!-- example: parse -->``: syntax-checked only;
- ``<!-- example: skip: REASON -->``: not runnable here, for the reason given;
- ``<!-- example: output -->``: the expected stdout of the ``run`` block just before it.

Blocks in ``yaml``/``yml``/``json``/``toml`` default to ``parse``; ``python`` and the shell
languages must carry a marker; other info strings (``text``, none) are not collected.

This module only reads Markdown; tests/docs/block_runs.py runs what it finds.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

#: Info strings collected, by the family the runner knows them as.
LANGS = {
    "python": "python", "py": "python",
    "bash": "bash", "sh": "bash", "shell": "bash", "console": "console",
    "yaml": "yaml", "yml": "yaml", "json": "json", "toml": "toml",
}  # fmt: skip
#: Families parsed when a block carries no marker; the others must be marked.
PARSED_BY_DEFAULT = {"yaml", "json", "toml"}
MODES = {"run", "start", "parse", "skip", "output"}
#: Options ``run`` and ``start`` take (``timeout=N`` besides).
FLAGS = {"token", "no-server"}
DEFAULT_TIMEOUT = 60.0

_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<body>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")


@dataclasses.dataclass
class Block:
    """One fenced block: where it is, its language family, text and what to do with it.

    ``line`` is the 1-based line of the opening fence; ``text`` has the fence's
    indentation removed. ``expected`` is the text of a following ``output`` block.
    """

    path: str
    line: int
    lang: str
    info: str
    text: str
    mode: str
    flags: frozenset[str] = frozenset()
    timeout: float = DEFAULT_TIMEOUT
    reason: str = ""
    marked: bool = False
    expected: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_marker(body: str) -> tuple[str, frozenset[str], float, str]:
    """Split a marker's body (what follows ``example:``).

    Returns:
        ``(mode, flags, timeout, reason)``.
    Raises:
        ValueError: an unknown mode or option, a skip without a reason, a bad timeout.
    """
    mode, _, rest = body.partition(":") if body.startswith("skip") else (body, "", "")
    if mode.strip() == "skip":
        reason = rest.strip()
        if not reason:
            raise ValueError("'skip' needs a reason: <!-- example: skip: REASON -->")
        return "skip", frozenset(), DEFAULT_TIMEOUT, reason
    words = body.split()
    if not words or words[0] not in MODES:
        raise ValueError(f"unknown mode {body!r}: one of {sorted(MODES)}")
    mode, options = words[0], words[1:]
    flags: set[str] = set()
    timeout = DEFAULT_TIMEOUT
    for opt in options:
        if mode not in ("run", "start"):
            raise ValueError(f"{mode!r} takes no options (got {opt!r})")
        if opt.startswith("timeout="):
            try:
                timeout = float(opt.split("=", 1)[1])
            except ValueError:
                raise ValueError(f"bad timeout {opt!r}") from None
        elif opt in FLAGS:
            flags.add(opt)
        else:
            raise ValueError(f"unknown option {opt!r}: {sorted(FLAGS)} or timeout=N")
    return mode, frozenset(flags), timeout, ""


def _fences(lines: list[str]):
    """Yield ``(open_index, close_index, indent, info)`` for each fenced block."""
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            j += 1
        yield i, j, indent, m["info"].strip()
        i = j + 1


def _dedent(lines: list[str], indent: str) -> str:
    return "".join(ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines)


def read_blocks(path: Path, root: Path) -> tuple[list[Block], list[str]]:
    """Collect the blocks of one Markdown file.

    Params:
        path: the Markdown file; root: what its reported path is relative to.
    Returns:
        ``(blocks, problems)``: problems are one line each, ``file:line: what is wrong``
        (an unmarked shell or python block, a marker that is not before a fence, a bad
        marker, an ``output`` block that follows no ``run`` block).
    """
    rel = str(path.relative_to(root))
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    blocks: list[Block] = []
    problems: list[str] = []
    marker_lines: set[int] = set()
    inside: set[int] = set()
    for start, end, indent, info in _fences(lines):
        inside.update(range(start, end + 1))
        lang_word = info.split()[0].lower() if info else ""
        lang = LANGS.get(lang_word.strip("{}."), "")
        marker = _MARKER.match(lines[start - 1]) if start else None
        where = f"{rel}:{start + 1}"
        mode, flags, timeout, reason = "", frozenset[str](), DEFAULT_TIMEOUT, ""
        if marker:
            marker_lines.add(start - 1)
            try:
                mode, flags, timeout, reason = parse_marker(marker["body"])
            except ValueError as e:
                problems.append(f"{where}: {e}")
                continue
        text = _dedent(lines[start + 1 : end], indent)
        if mode == "output":
            prev = blocks[-1] if blocks else None
            if prev is None or prev.mode != "run" or prev.expected is not None:
                problems.append(f"{where}: an 'output' block must follow a 'run' block")
            else:
                prev.expected = text
            continue
        if not lang:
            if marker:
                problems.append(f"{where}: a marker on a {info or 'plain'!r} block (not run)")
            continue
        if not mode:
            if lang not in PARSED_BY_DEFAULT:
                problems.append(
                    f"{where}: a {lang_word} block without a marker: put "
                    "<!-- example: run|start|parse|skip: REASON --> on the line before it"
                )
                continue
            mode = "parse"
        if mode == "start" and lang not in ("bash", "console"):
            problems.append(f"{where}: 'start' is for shell blocks")
            continue
        if mode in ("run", "start") and lang in ("json", "toml", "yaml"):
            problems.append(f"{where}: a {lang} block cannot run; mark it 'parse'")
            continue
        blocks.append(
            Block(rel, start + 1, lang, info, text, mode, flags, timeout, reason, bool(marker))
        )
    for i, ln in enumerate(lines):
        if i not in inside and i not in marker_lines and _MARKER.match(ln):
            problems.append(f"{rel}:{i + 1}: a marker not directly before a fence")
    return blocks, problems


def markdown_files(root: Path) -> list[Path]:
    """README.md and every ``docs/**/*.md`` under ``root``, sorted."""
    files = [root / "README.md"] if (root / "README.md").exists() else []
    return files + sorted((root / "docs").rglob("*.md"))


def collect(root: Path, files: list[Path] | None = None) -> tuple[list[Block], list[str]]:
    """All blocks and problems of ``files`` (default: :func:`markdown_files`)."""
    blocks: list[Block] = []
    problems: list[str] = []
    for path in files if files is not None else markdown_files(root):
        b, p = read_blocks(path, root)
        blocks += b
        problems += p
    return blocks, problems


def console_parts(text: str) -> tuple[str, str]:
    """Split a ``console`` block into its commands (``$ `` lines, with ``\\`` continuations)
    and the expected output (every other line)."""
    commands: list[str] = []
    output: list[str] = []
    continuing = False
    for ln in text.splitlines():
        if continuing or ln.startswith("$ "):
            cmd = ln[2:] if ln.startswith("$ ") and not continuing else ln
            commands.append(cmd)
            continuing = cmd.rstrip().endswith("\\")
        else:
            output.append(ln)
    return "\n".join(commands) + "\n", "\n".join(output).strip("\n")


def output_matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` matches ``expected`` line by line (trailing spaces and blank edges
    ignored): ``...`` in a line matches anything on that line; a line that is only ``...``
    matches any number of lines."""
    parts: list[str] = []
    for ln in expected.strip("\n").splitlines():
        ln = ln.rstrip()
        if ln.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(r"[^\n]*".join(re.escape(p) for p in ln.split("...")) + r"[ \t]*\n")
    actual_lines = "".join(ln.rstrip() + "\n" for ln in actual.strip("\n").splitlines())
    return re.fullmatch("".join(parts), actual_lines) is not None
