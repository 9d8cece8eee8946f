"""The ``eg-kv`` command: ``serve``, ``stats`` and ``check`` (and ``--version``).

``python -m workers serve ...`` and the ``eg-kv`` console script are the same entry point.
What it prints for people shows sizes in binary units (``1.5 GiB``); ``--json`` keeps the
raw integers. A command that talks to a server takes its token from
``$EPISTEMIC_GRAPH_KVCACHE_TOKEN`` or ``--token-file PATH``, never from the command line
(where ``ps`` shows it to every user of the host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any

from eg_kv import __version__
from eg_kv.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_ADDR,
    ENV_TLS_VERIFY,
    ENV_TOKEN,
    ENV_URL,
    SERVER_SETTINGS,
    format_hostport,
    help_text,
    parse_addr,
    parse_bool,
    settings_from_env,
)
from eg_kv.errors import ConfigError, EgKvError, SlabError
from eg_kv.units import human_size

#: How long ``eg-kv check`` waits for the slab lock at a time (a supervisor kills a holder
#: that hangs within --lock-timeout, 2 s by default).
CHECK_LOCK_WAIT_S = 30.0
#: The ``serve`` arguments that become settings: one per declared setting with a flag.
SERVE_FLAGS = tuple(setting.name for setting in SERVER_SETTINGS if setting.flag)
#: argparse's conversion of a flag's argument, by kind; sizes and addresses stay text for
#: settings_from_env to parse (a bad one is a ConfigError naming the grammar, exit 1).
_ARG_TYPES: dict[str, type[int] | type[float]] = {"int": int, "float": float}
#: How a command that talks to a server takes its token (its --help says so).
TOKEN_HELP = (
    f"The token, when the server wants one: the {ENV_TOKEN} environment variable, or "
    "--token-file PATH (a file holding it), never on the command line."
)
#: The one line a 401 answer prints (it never shows the token).
TOKEN_HINT = f"set {ENV_TOKEN} or pass --token-file PATH (a file holding the token)"
#: Where to point a command at another server.
ADDR_HINT = f"point --addr or --url at it (or set ${ENV_ADDR} / ${ENV_URL})"
#: Stats fields that are sizes in bytes besides those named ``*_bytes``.
SIZE_FIELDS = frozenset({"page_size", "max_block_size"})


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``eg-kv`` command (every subcommand)."""
    p = argparse.ArgumentParser(
        prog="eg-kv",
        description="eg-kv: a shared, content-addressed KV-cache block store over HTTP.",
    )
    p.add_argument("--version", action="version", version=f"eg-kv {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="run the server (supervisor + workers)",
        description="Run the server: a supervisor that owns the shared-memory slab and N "
        "worker processes sharing one port. A flag overrides its environment variable.",
        epilog="From the environment only: "
        + "; ".join(help_text(one) for one in SERVER_SETTINGS if not one.flag),
    )
    _add_serve_flags(s)

    st = sub.add_parser(
        "stats",
        allow_abbrev=False,  # --token must not be taken for --token-file (and shown)
        help="print a running server's (or a server set's) /kv/stats",
        description="Print a running server's /kv/stats (sizes in GiB/MiB...; --json keeps "
        "the raw integers). An admin of a server with tenants also gets one line per "
        "namespace; a server set gets the sum and one line per member.",
        epilog=TOKEN_HELP,
    )
    st.add_argument(
        "--url",
        help=f"server URL or server set (a,b,c; dnssrv+http://...; dns+http://...:port) "
        f"(default: ${ENV_URL}, else from --addr / ${ENV_ADDR}, else "
        f"{DEFAULT_HOST}:{DEFAULT_PORT}); a set prints the sum over its members and one "
        "line per member",
    )
    st.add_argument("--addr", help="server address, as for serve (host:port, a port...)")
    _add_token_file(st)
    st.add_argument("--json", action="store_true", help="print the raw JSON (sizes in bytes)")
    st.add_argument(
        "--insecure", action="store_true", help="do not verify the server's TLS certificate"
    )
    st.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")

    c = sub.add_parser(
        "check",
        allow_abbrev=False,
        help="check a live slab's invariants; exit 1 on any violation",
        description="Check a live slab's invariants; exit 1 on any violation. It reads the "
        "slab in this host's shared memory, not over HTTP: run it on the server's host, as "
        "the server's user. It sends no request, so it needs no token (--token-file and "
        f"${ENV_TOKEN}, which the commands that talk to a server take, do not apply).",
    )
    c.add_argument(
        "--addr",
        help=f"the server's address (names its slab /eg-kv-<port>; default: ${ENV_ADDR}, "
        f"else {DEFAULT_HOST}:{DEFAULT_PORT})",
    )
    c.add_argument("--slab-name", dest="slab_name", help="the slab's name, if not the default")
    c.add_argument("--json", action="store_true", help="print the report as JSON (raw integers)")
    c.add_argument(
        "--deep",
        action="store_true",
        help="also hash every block and compare it with its checksum (names each that fails)",
    )
    c.add_argument(
        "--repair",
        action="store_true",
        help="with --deep: free every block that fails its checksum (it is never served again)",
    )
    return p


def _add_token_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"read the bearer token from this file (default: ${ENV_TOKEN}, else none)",
    )


def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """One flag per declared setting (eg_kv.config.SERVER_SETTINGS), in its order."""
    for setting in SERVER_SETTINGS:
        if not setting.flag:
            continue
        # Not given, a flag is None, so settings_from_env falls back to the variable.
        help_line = help_text(setting).replace("%", "%%")  # argparse formats help with %
        if setting.kind == "switch":
            serve.add_argument(
                setting.flag, dest=setting.name, help=help_line, action="store_true", default=None
            )
        elif setting.kind in _ARG_TYPES:
            serve.add_argument(
                setting.flag, dest=setting.name, help=help_line, metavar=setting.metavar,
                type=_ARG_TYPES[setting.kind],
            )  # fmt: skip
        else:
            serve.add_argument(
                setting.flag, dest=setting.name, help=help_line, metavar=setting.metavar
            )


def _serve(args: argparse.Namespace) -> int:
    from .supervisor import serve

    overrides = {k: getattr(args, k) for k in SERVE_FLAGS}
    settings = settings_from_env(**overrides)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s eg-kv[%(process)d] %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    return serve(settings)


def _read_token(args: argparse.Namespace) -> tuple[str | None, str]:
    """The bearer token (``--token-file``, else ``$EPISTEMIC_GRAPH_KVCACHE_TOKEN``) and
    where it came from, for messages (which never show the token).

    Raises:
        ConfigError: the token file cannot be read or is empty.
    """
    path = getattr(args, "token_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__  # never its content
            raise ConfigError(f"cannot read --token-file {path}: {why}") from None
        if not token:
            raise ConfigError(f"--token-file {path} is empty")
        return token, f"the token from --token-file {path}"
    env_token = os.environ.get(ENV_TOKEN) or None
    return env_token, f"the token in ${ENV_TOKEN}" if env_token else "no token"


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """The URL (or server set) ``stats`` asks, and where it came from."""
    if args.url:
        return _as_url(args.url), "--url"
    if os.environ.get(ENV_URL):
        return os.environ[ENV_URL], f"${ENV_URL}"
    s = settings_from_env(addr=args.addr)
    where = "--addr" if args.addr else f"${ENV_ADDR}" if os.environ.get(ENV_ADDR) else (
        "the default address")  # fmt: skip
    return f"{s.scheme}://{s.bind}", where


def _as_url(text: str) -> str:
    """``--url`` as a URL: a port (``9130``) or ``host:port`` (``localhost:9130``, what
    ``--addr`` takes) means ``http://`` on it; a URL or a server set is kept as given."""
    plain = text.strip()
    if "://" in plain or "," in plain or not plain:
        return text
    host, port = parse_addr(plain)
    return f"http://{format_hostport(host, port)}"


def _is_size(key: str) -> bool:
    return key.endswith("_bytes") or key in SIZE_FIELDS


def _show(key: str, value: Any) -> str:
    """A stats value for a person: sizes in binary units, counts with thousands commas."""
    if isinstance(value, bool) or not isinstance(value, int):
        return str(value)
    return human_size(value) if _is_size(key) else f"{value:,}"


def _table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Aligned columns: those in ``left`` (text) left-aligned, the others (numbers)
    right-aligned."""
    widths = [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            cell.ljust(w) if k in left else cell.rjust(w)
            for k, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _rate(hits: int, misses: int) -> str:
    return "-" if hits + misses == 0 else f"{hits / (hits + misses):.1%}"


def _print_fields(stats: dict[str, Any]) -> None:
    """The scalar fields, one aligned ``key  value`` line each."""
    scalars = {k: v for k, v in stats.items() if not isinstance(v, (dict, list))}
    width = max(map(len, scalars), default=0)
    for key, value in scalars.items():
        print(f"{key:<{width}}  {_show(key, value)}")


def _print_namespaces(spaces: dict[str, dict[str, Any]]) -> None:
    """An admin's ``namespaces``: one aligned line per namespace."""
    header = ["namespace", "blocks", "resident", "logical", "quota used", "quota", "hits",
              "misses", "hit rate"]  # fmt: skip
    rows = []
    for name, one in spaces.items():
        quota = int(one.get("quota_bytes", 0))
        hits, misses = int(one.get("get_hits", 0)), int(one.get("get_misses", 0))
        rows.append([
            name, f"{int(one.get('unique_blocks', 0)):,}",
            human_size(int(one.get("resident_bytes", 0))),
            human_size(int(one.get("logical_bytes", 0))),
            human_size(int(one.get("quota_used_bytes", 0))),
            human_size(quota) if quota else "none", f"{hits:,}", f"{misses:,}",
            _rate(hits, misses),
        ])  # fmt: skip
    print(f"\nnamespaces ({len(rows)}):")
    for text in _table(header, rows):
        print(text)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are answers, never followed: urllib would send the bearer token on to
    whatever host a proxy names (as the clients, eg_kv.client.rules, never follow one)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _stats(args: argparse.Namespace) -> int:
    url, where = _target(args)
    token, whose = _read_token(args)
    if "," in url or not url.strip().lower().startswith(("http://", "https://")):
        return _set_stats(url, where, token, whose, args)
    req = urllib.request.Request(url.rstrip("/") + "/kv/stats")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    verify = not args.insecure
    if verify and os.environ.get(ENV_TLS_VERIFY):
        verify = parse_bool(os.environ[ENV_TLS_VERIFY], ENV_TLS_VERIFY)
    ctx = None
    if url.startswith("https") and not verify:
        ctx = ssl._create_unverified_context()
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(req, timeout=args.timeout) as r:
            stats = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            print(f"eg-kv stats: {url} (from {where}) answered {e.code}, a redirect to "
                  f"{e.headers.get('Location')!r}: not followed (the token would go with it); "
                  f"point --url at the eg-kv server itself", file=sys.stderr)  # fmt: skip
            return 1
        if e.code == 401:
            refused = "none was sent" if token is None else f"{whose} was refused"
            print(f"eg-kv stats: {url} (from {where}) answered 401, it wants a valid bearer "
                  f"token and {refused}: {TOKEN_HINT}", file=sys.stderr)  # fmt: skip
            return 1
        body = e.read().decode(errors="replace").strip()[:300]
        print(f"eg-kv stats: {url} (from {where}) answered {e.code}: {body}", file=sys.stderr)
        return 1
    except OSError as e:
        why = getattr(e, "reason", e)
        print(f"eg-kv stats: no eg-kv server answers at {url} (from {where}): {why}: start "
              f"one (eg-kv serve) or {ADDR_HINT}", file=sys.stderr)  # fmt: skip
        return 1
    except ValueError as e:
        print(
            f"eg-kv stats: {url} (from {where}) answered something other than eg-kv's "
            f"stats ({e}): is it an eg-kv server? If not, {ADDR_HINT}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    _print_fields(stats)
    if isinstance(stats.get("namespaces"), dict):
        _print_namespaces(stats["namespaces"])
    return 0


def _set_stats(
    url: str, where: str, token: str | None, whose: str, args: argparse.Namespace
) -> int:
    """``eg-kv stats`` of a server set: the sum, then one line per member."""
    from eg_kv.client.sets import ClusterConnector
    from eg_kv.client.setstats import sum_stats
    from eg_kv.client.settings import KvCacheConfig

    verify = None if not args.insecure else False
    config = KvCacheConfig.from_env(
        base_url=url, timeout_s=args.timeout, verify_tls=verify, token=token
    )
    with ClusterConnector(config) as cluster:
        lines = cluster.member_stats()
    answered = [line.stats for line in lines if line.stats is not None]
    total = sum_stats(answered)
    fields = {**{k: getattr(total, k) for k in total.__dataclass_fields__ if k != "extra"},
              **total.extra}  # fmt: skip
    if args.json:
        members = [
            {"id": line.member.id, "up": line.up, "error": line.error or None,
             "stats": None if line.stats is None else
             {**{k: getattr(line.stats, k) for k in fields if hasattr(line.stats, k)},
              **line.stats.extra}}
            for line in lines
        ]  # fmt: skip
        print(json.dumps({"sum": fields, "members": members}, indent=2))
    else:
        print(f"server set {url}: {len(answered)} of {len(lines)} member(s) up; the sum:")
        _print_fields(fields)
        rows = []
        for line in lines:
            st = line.stats
            if st is None:
                rows.append([line.member.id, "down", "-", "-", "-", "-", line.error])
                continue
            cap = st.extra.get("capacity_bytes")
            rows.append([
                line.member.id, "up", f"{st.unique_blocks:,}", human_size(st.resident_bytes),
                human_size(cap) if isinstance(cap, int) else "-",
                _rate(st.get_hits, st.get_misses), "",
            ])  # fmt: skip
        print()
        header = ["member", "state", "blocks", "resident", "capacity", "hit rate", "error"]
        for text in _table(header, rows, left=(0, 1, 6)):
            print(text)
    if any("bearer token" in line.error for line in lines):
        refused = "none was sent" if token is None else f"{whose} was refused"
        print(f"eg-kv stats: member(s) of {url} answered 401 and {refused}: {TOKEN_HINT}",
              file=sys.stderr)  # fmt: skip
    if not answered:
        why = lines[0].error if lines else "the set has no member"
        print(f"eg-kv stats: no member of {url} (from {where}) answered: {why}: start them "
              f"(eg-kv serve) or {ADDR_HINT}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _check(args: argparse.Namespace) -> int:
    from eg_kv.slab.contents import verify_contents
    from eg_kv.slab.store import Slab

    settings = settings_from_env(addr=args.addr, slab_name=args.slab_name)
    name = settings.slab_name
    if not Slab.exists_named(name):
        if args.slab_name:
            whose = "from --slab-name"
        else:
            where = "--addr" if args.addr else f"${ENV_ADDR}" if os.environ.get(ENV_ADDR) else (
                "the default address")  # fmt: skip
            whose = (f"the slab of a server at {format_hostport(settings.host, settings.port)}"
                     f", from {where}")  # fmt: skip
        raise SlabError(
            f"no slab {name} on this host ({whose}): start a server (eg-kv serve) or point "
            f"--addr (or ${ENV_ADDR}) or --slab-name at the server's; eg-kv check reads "
            "the slab in shared memory, so it runs on the server's host, as its user"
        )
    if args.repair and not args.deep:
        raise ConfigError("--repair frees the blocks --deep finds: give both")
    with Slab.attach(name) as slab:
        # In slices: a live server's requests wait a few ms at a time, never the whole walk.
        # A lock stuck for longer than CHECK_LOCK_WAIT_S ends the check with its holder's pid.
        report = slab.check_live(timeout=CHECK_LOCK_WAIT_S)
        # Freeing a block along pages another block shares frees that block's too: on a
        # slab whose structure is damaged, --repair frees nothing.
        repair = args.repair and not report.problems
        deep = verify_contents(slab, repair, CHECK_LOCK_WAIT_S) if args.deep else None
        stats = slab.stats()
        spaces = slab.namespace_stats(timeout=CHECK_LOCK_WAIT_S)
    bad = [] if deep is None else deep.bad
    failed = bool(report.problems or bad)  # freed or not, a block failed
    used = sum(1 for one in spaces.values() if one["unique_blocks"])
    if args.json:
        print(json.dumps({
            "slab": name, "clean": not report.problems, "problems": report.problems,
            "unchecked": report.unchecked, "notes": report.notes,
            "unique_blocks": stats["unique_blocks"], "namespaces_used": used,
            "resident_bytes": stats["resident_bytes"],
            "capacity_bytes": stats["capacity_bytes"], "slices": report.slices,
            "longest_hold_s": report.longest_hold_s,
            "longest_hold_cpu_s": report.longest_hold_cpu_s,
            **({} if deep is None else {
                "blocks_hashed": deep.checked, "bytes_hashed": deep.checked_bytes,
                "checksum_failures": [dataclasses.asdict(b) for b in bad],
            }),
        }, indent=2))  # fmt: skip
        return 1 if failed else 0
    for problem in report.problems:
        print(f"eg-kv check: {problem}")
    for note in report.unchecked:
        print(f"eg-kv check: not checked: {note}")
    for note in report.notes:
        print(f"eg-kv check: note: {note}")
    for b in bad:
        where = f" in namespace {b.namespace}" if b.namespace else ""
        done = (
            "freed" if b.freed
            else "not freed: the slab's structure is damaged (above); restart the server "
            "with --keep (re-attaching repairs it), then run eg-kv check --deep --repair"
            if args.repair
            else "run eg-kv check --deep --repair to free it"
        )  # fmt: skip
        print(f"eg-kv check: block {b.address}{where} ({b.length} bytes) fails its checksum: "
              f"stored {b.stored:016x}, its bytes {b.found:016x}; {done}")  # fmt: skip
    if deep is not None:
        print(f"eg-kv check: hashed {deep.checked} blocks ({human_size(deep.checked_bytes)}): "
              f"{len(bad)} failed their checksum")  # fmt: skip
    held = (
        f"{report.slices} slices; lock held at most {report.longest_hold_s * 1000:.1f} ms "
        f"at a time, {report.longest_hold_cpu_s * 1000:.1f} ms CPU"
    )
    if failed:
        print(f"eg-kv check: slab {name}: {len(report.problems) + len(bad)} problem(s) ({held})")
        return 1
    what = "clean as far as checked" if report.unchecked else "clean"
    print(f"eg-kv check: slab {name} is {what}: {stats['unique_blocks']} blocks in {used} "
          f"namespace(s), {human_size(stats['resident_bytes'])} resident of "
          f"{human_size(stats['capacity_bytes'])} ({held})")  # fmt: skip
    return 0


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers, by name."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eg-kv`` command. Returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's, names what it takes
        _commands(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "stats":
            return _stats(args)
        return _check(args)
    except EgKvError as e:
        if getattr(args, "json", False):  # a script reading --json gets JSON, errors too
            print(json.dumps({"error": str(e), "command": args.command}))
        print(f"eg-kv {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (eg-kv stats | head): quietly, as Python's docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
