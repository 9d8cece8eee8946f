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
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    ENV_TLS_VERIFY,
    ENV_TOKEN,
    ENV_URL,
    parse_bool,
    settings_from_env,
)
from eg_kv.errors import EgKvError

SERVE_FLAGS = ("addr", "workers", "capacity", "page_size", "max_block_size", "keep", "fresh",
               "slab_name", "tls_cert", "tls_key", "drain_timeout_s", "access_log",
               "header_timeout_s", "body_timeout_s", "keepalive_timeout_s",
               "max_connections")  # fmt: skip


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
        "--max-block-size", dest="max_block_size", help="largest block accepted (default 64MiB)"
    )
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
        "--keepalive-timeout", dest="keepalive_timeout_s", metavar="S", type=float,
        help=f"seconds an idle connection is kept (default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})",
    )  # fmt: skip
    s.add_argument(
        "--max-connections", dest="max_connections", metavar="N", type=int,
        help="open connections per worker; beyond it the oldest idle ones are closed "
        "(default: from the fd limit, at most 10000)",
    )  # fmt: skip

    st = sub.add_parser("stats", help="print a running server's /kv/stats")
    st.add_argument(
        "--url",
        help=f"server URL (default: ${ENV_URL}, else from --addr / $EPISTEMIC_GRAPH_KVCACHE_ADDR)",
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


def _check(args: argparse.Namespace) -> int:
    from eg_kv.slab import Slab

    settings = settings_from_env(addr=args.addr, slab_name=args.slab_name)
    with Slab.attach(settings.slab_name) as slab:
        problems = slab.check()
        stats = slab.stats()
    for problem in problems:
        print(f"eg-kv check: {problem}")
    if problems:
        print(f"eg-kv check: slab {settings.slab_name}: {len(problems)} problem(s)")
        return 1
    print(f"eg-kv check: slab {settings.slab_name} is clean: {stats['unique_blocks']} blocks, "
          f"{stats['resident_bytes']} bytes resident")  # fmt: skip
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
