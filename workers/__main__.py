"""The ``eg-kv`` command: ``serve``, ``stats`` and ``check``.

``python -m workers serve ...`` and the ``eg-kv`` console script are the same entry point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
import urllib.error
import urllib.request

from eg_kv.config import (
    ENV_TLS_VERIFY,
    ENV_TOKEN,
    ENV_URL,
    SERVER_SETTINGS,
    help_text,
    parse_bool,
    settings_from_env,
)
from eg_kv.errors import EgKvError

#: How long ``eg-kv check`` waits for the slab lock at a time (a supervisor kills a holder
#: that hangs within --lock-timeout, 2 s by default).
CHECK_LOCK_WAIT_S = 30.0
#: The ``serve`` arguments that become settings: one per declared setting with a flag.
SERVE_FLAGS = tuple(setting.name for setting in SERVER_SETTINGS if setting.flag)
#: argparse's conversion of a flag's argument, by kind; sizes and addresses stay text for
#: settings_from_env to parse (a bad one is a ConfigError naming the grammar, exit 1).
_ARG_TYPES: dict[str, type[int] | type[float]] = {"int": int, "float": float}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``eg-kv`` command (every subcommand)."""
    p = argparse.ArgumentParser(
        prog="eg-kv",
        description="eg-kv: a shared, content-addressed KV-cache block store over HTTP.",
    )
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

    st = sub.add_parser("stats", help="print a running server's (or a server set's) /kv/stats")
    st.add_argument(
        "--url",
        help=f"server URL or server set (a,b,c; dnssrv+http://...; dns+http://...:port) "
        f"(default: ${ENV_URL}, else from --addr / $EPISTEMIC_GRAPH_KVCACHE_ADDR); a set "
        "prints the sum over its members and one line per member",
    )
    st.add_argument("--addr", help="server address, as for serve")
    st.add_argument("--json", action="store_true", help="print the raw JSON")
    st.add_argument(
        "--insecure", action="store_true", help="do not verify the server's TLS certificate"
    )
    st.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")

    c = sub.add_parser("check", help="check a live slab's invariants; exit 1 on any violation")
    c.add_argument("--addr", help="the server's address (names the slab /eg-kv-<port>)")
    c.add_argument("--slab-name", dest="slab_name", help="the slab's name, if not the default")
    return p


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
    from workers.supervisor import serve

    overrides = {k: getattr(args, k) for k in SERVE_FLAGS}
    settings = settings_from_env(**overrides)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s eg-kv[%(process)d] %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    return serve(settings)


def _stats(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get(ENV_URL)
    if not url:
        s = settings_from_env(addr=args.addr)
        url = f"{s.scheme}://{s.bind}"
    if "," in url or not url.strip().lower().startswith(("http://", "https://")):
        return _set_stats(url, args)
    req = urllib.request.Request(url.rstrip("/") + "/kv/stats")
    token = os.environ.get(ENV_TOKEN)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    verify = not args.insecure
    if verify and os.environ.get(ENV_TLS_VERIFY):
        verify = parse_bool(os.environ[ENV_TLS_VERIFY], ENV_TLS_VERIFY)
    ctx = None
    if url.startswith("https") and not verify:
        ctx = ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(req, timeout=args.timeout, context=ctx) as r:
            stats = json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(f"eg-kv stats: {url} answered {e.code}: {e.read().decode(errors='replace')}"
              .strip(), file=sys.stderr)  # fmt: skip
        return 1
    except (OSError, ValueError) as e:
        print(f"eg-kv stats: cannot read {url}/kv/stats: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        width = max(map(len, stats))
        for key, value in stats.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _set_stats(url: str, args: argparse.Namespace) -> int:
    """``eg-kv stats`` of a server set: the sum, then one line per member."""
    from eg_kv.client.core import KvCacheConfig
    from eg_kv.client.sets import ClusterConnector
    from eg_kv.client.setstats import sum_stats

    verify = None if not args.insecure else False
    config = KvCacheConfig.from_env(base_url=url, timeout_s=args.timeout, verify_tls=verify)
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
        width = max(map(len, fields))
        for key, value in fields.items():
            print(f"{key:<{width}}  {value}")
        idw = max([len("member"), *(len(line.member.id) for line in lines)])
        print(f"\n{'member':<{idw}}  {'state':<5}  {'blocks':>10}  {'bytes':>14}  hit rate")
        for line in lines:
            st = line.stats
            if st is None:
                print(f"{line.member.id:<{idw}}  {'down':<5}  {'-':>10}  {'-':>14}  -")
                continue
            rate = "-" if line.hit_rate is None else f"{line.hit_rate:.1%}"
            print(f"{line.member.id:<{idw}}  {'up':<5}  {st.unique_blocks:>10}  "
                  f"{st.resident_bytes:>14}  {rate}")  # fmt: skip
    if not answered:
        why = lines[0].error if lines else "the set has no member"
        print(f"eg-kv stats: no member of {url} answered: {why}", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> int:
    from eg_kv.slab.store import Slab

    settings = settings_from_env(addr=args.addr, slab_name=args.slab_name)
    name = settings.slab_name
    with Slab.attach(name) as slab:
        # In slices: a live server's requests wait a few ms at a time, never the whole walk.
        # A lock stuck for longer than CHECK_LOCK_WAIT_S ends the check with its holder's pid.
        report = slab.check_live(timeout=CHECK_LOCK_WAIT_S)
        stats = slab.stats()
        spaces = slab.namespace_stats(timeout=CHECK_LOCK_WAIT_S)
    for problem in report.problems:
        print(f"eg-kv check: {problem}")
    for note in report.unchecked:
        print(f"eg-kv check: not checked: {note}")
    for note in report.notes:
        print(f"eg-kv check: note: {note}")
    held = (
        f"{report.slices} slices; lock held at most {report.longest_hold_s * 1000:.1f} ms "
        f"at a time, {report.longest_hold_cpu_s * 1000:.1f} ms CPU"
    )
    if report.problems:
        print(f"eg-kv check: slab {name}: {len(report.problems)} problem(s) ({held})")
        return 1
    what = "clean as far as checked" if report.unchecked else "clean"
    used = sum(1 for one in spaces.values() if one["unique_blocks"])
    print(f"eg-kv check: slab {name} is {what}: {stats['unique_blocks']} blocks in {used} "
          f"namespace(s), {stats['resident_bytes']} bytes resident ({held})")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eg-kv`` command. Returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "stats":
            return _stats(args)
        return _check(args)
    except EgKvError as e:
        print(f"eg-kv {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (eg-kv stats | head): quietly, as Python's docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
