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
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_CHUNKED_SPOOL,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_LOCK_TIMEOUT_S,
    DEFAULT_MIN_UPLOAD_RATE,
    DEFAULT_UPLOAD_SHARE,
    ENV_TLS_VERIFY,
    ENV_TOKEN,
    ENV_URL,
    format_size,
    parse_bool,
    settings_from_env,
)
from eg_kv.errors import EgKvError

#: How long ``eg-kv check`` waits for the slab lock at a time (a supervisor kills a holder
#: that hangs within --lock-timeout, 2 s by default).
CHECK_LOCK_WAIT_S = 30.0
SERVE_FLAGS = ("addr", "workers", "capacity", "page_size", "max_block_size", "keep", "fresh",
               "slab_name", "tls_cert", "tls_key", "drain_timeout_s", "access_log",
               "upload_share", "chunked_spool", "heartbeat_timeout_s", "lock_timeout_s",
               "header_timeout_s", "body_timeout_s", "keepalive_timeout_s",
               "max_connections", "tokens_file", "min_upload_rate")  # fmt: skip


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
        "worker processes sharing one port. Flags override the environment "
        "(EPISTEMIC_GRAPH_KVCACHE_ADDR, _TOKEN, _TLS_CERT, _TLS_KEY).",
    )
    s.add_argument(
        "--addr",
        help="bind address: 1/true/yes/on, a port, host:port or "
        "[v6]:port (default: $EPISTEMIC_GRAPH_KVCACHE_ADDR, else 127.0.0.1:9130)",
    )
    s.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    s.add_argument("--capacity", help="slab data capacity, e.g. 8GiB (default 1GiB)")
    s.add_argument("--page-size", dest="page_size", help="slab page size (default 64KiB)")
    s.add_argument(
        "--max-block-size", dest="max_block_size",
        help="largest block accepted, at most --capacity (default 64MiB, or the capacity)",
    )  # fmt: skip
    s.add_argument(
        "--upload-share", dest="upload_share", type=float,
        help="fraction of the slab that uploads in flight may reserve; a new upload beyond "
        f"it gets 503 + Retry-After (default {DEFAULT_UPLOAD_SHARE:g})",
    )  # fmt: skip
    s.add_argument(
        "--chunked-spool", dest="chunked_spool",
        help="memory one worker may hold spooling chunked PUT bodies; beyond it a chunked "
        f"PUT gets 503 + Retry-After (default {format_size(DEFAULT_CHUNKED_SPOOL)})",
    )  # fmt: skip
    s.add_argument(
        "--keep",
        action="store_true",
        default=None,
        help="leave the slab in /dev/shm at exit, for a warm restart",
    )
    s.add_argument(
        "--fresh",
        action="store_true",
        default=None,
        help="discard a slab left by a previous server instead of re-attaching",
    )
    s.add_argument(
        "--slab-name", dest="slab_name", help="POSIX shared-memory name (default /eg-kv-<port>)"
    )
    s.add_argument(
        "--tokens",
        dest="tokens_file",
        help="TOML file of tenants (tokens' sha256, roles, namespaces, quotas); SIGHUP "
        "reloads it (env EPISTEMIC_GRAPH_KVCACHE_TOKENS_FILE)",
    )
    s.add_argument("--tls-cert", dest="tls_cert", help="PEM certificate: serve HTTPS")
    s.add_argument("--tls-key", dest="tls_key", help="PEM private key of --tls-cert")
    s.add_argument(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        help=f"seconds in-flight requests get on SIGTERM (default {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--access-log",
        dest="access_log",
        action="store_true",
        default=None,
        help="log every request (off by default: it costs throughput)",
    )
    s.add_argument(
        "--header-timeout", dest="header_timeout_s", metavar="S", type=float,
        help="seconds a request head may take from its first byte "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )  # fmt: skip
    s.add_argument(
        "--body-timeout", dest="body_timeout_s", metavar="S", type=float,
        help="seconds an upload, or an answer being sent, may move no byte before it is cut "
        f"(default {DEFAULT_BODY_TIMEOUT_S:g})",
    )  # fmt: skip
    s.add_argument(
        "--min-upload-rate", dest="min_upload_rate", metavar="RATE",
        help="bytes a second a request body must average once --body-timeout has passed "
        "since it began, else it is cut and its pages freed; 0: no minimum "
        f"(default {format_size(DEFAULT_MIN_UPLOAD_RATE)}, i.e. per second)",
    )  # fmt: skip
    s.add_argument(
        "--keepalive-timeout", dest="keepalive_timeout_s", metavar="S", type=float,
        help=f"seconds an idle connection is kept (default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})",
    )  # fmt: skip
    s.add_argument(
        "--max-connections", dest="max_connections", metavar="N", type=int,
        help="open connections per worker; beyond it the oldest idle ones are closed "
        "(default: from the fd limit, at most 10000)",
    )  # fmt: skip

    s.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        type=float,
        help="seconds a worker may go without a heartbeat (stopped, stuck) before the "
        f"supervisor kills and replaces it (default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--lock-timeout",
        dest="lock_timeout_s",
        type=float,
        help="seconds a worker may hold the slab lock before the supervisor kills it "
        f"(default {DEFAULT_LOCK_TIMEOUT_S:g}, plus the time a full repair of the slab takes)",
    )

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
    from eg_kv.client.sets import ClusterConnector, sum_stats
    from eg_kv.client.sync import KvCacheConfig

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
