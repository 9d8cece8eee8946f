"""Server settings in one place: each declared once, with the environment grammar and defaults.

Every ``eg-kv serve`` setting is one :class:`ServerSetting` in :data:`SERVER_SETTINGS` (its
flag, environment variable, kind, help and how its default reads); from that one list come
the command's flags (``workers/__main__.py`` loops over it), the environment parsing of
:func:`settings_from_env`, and the README's settings table (``python -m eg_kv.config
--markdown``; tests/deploy/test_settings.py fails when the README differs). The values
themselves are built once into a frozen :class:`Settings` and passed down; its field
defaults are the defaults, the declarations only say how to show them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, Literal

from .errors import ConfigError, SlabError
from .shm import segment_name

# Re-exported (``as`` says so to strict mypy): sizes are part of the settings' grammar.
from .units import DEFAULT_MAX_BLOCK_SIZE as DEFAULT_MAX_BLOCK_SIZE
from .units import DEFAULT_PAGE_SIZE as DEFAULT_PAGE_SIZE
from .units import GiB as GiB
from .units import MiB as MiB
from .units import format_size as format_size
from .units import parse_size as parse_size

ENV_ADDR = "EPISTEMIC_GRAPH_KVCACHE_ADDR"
ENV_TOKEN = "EPISTEMIC_GRAPH_KVCACHE_TOKEN"
ENV_TOKENS_FILE = "EPISTEMIC_GRAPH_KVCACHE_TOKENS_FILE"
ENV_URL = "EPISTEMIC_GRAPH_KVCACHE_URL"
ENV_TIMEOUT = "EPISTEMIC_GRAPH_KVCACHE_TIMEOUT_S"
ENV_TLS_VERIFY = "EPISTEMIC_GRAPH_KVCACHE_TLS_VERIFY"
ENV_TLS_CERT = "EPISTEMIC_GRAPH_KVCACHE_TLS_CERT"
ENV_TLS_KEY = "EPISTEMIC_GRAPH_KVCACHE_TLS_KEY"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9130
ENABLE_TOKENS = frozenset({"1", "true", "yes", "on"})

DEFAULT_CAPACITY = 1 * GiB
DEFAULT_DRAIN_TIMEOUT_S = 10.0
#: Fraction of the slab that uploads in flight may reserve together. Half keeps the other
#: half for resident blocks (hits and small PUTs go on whatever stalls), while 512 MiB of a
#: 1 GiB slab is 36 uploads of 14 MiB (LMCache's chunk) at once, nine times what the
#: benchmark's four 14 MiB writers hold.
DEFAULT_UPLOAD_SHARE = 0.5
#: Fraction of the slab's pages (and of a namespace's quota) that leases may hold: past
#: it a lookup answers its hits without leasing them, so one client re-leasing every block
#: cannot leave the others' puts a full slab (issue 31).
DEFAULT_LEASE_SHARE = 0.5
#: Memory one worker may hold spooling chunked bodies (their length is unknown until the
#: end, so they wait outside the slab): four bodies of the default 64 MiB maximum block.
DEFAULT_CHUNKED_SPOOL = 256 * MiB
#: A worker whose event loop has not beat for this long is killed and replaced. Long
#: enough that a loaded host's scheduling hiccups never trip it, short enough that a
#: stopped worker's share of new connections hangs for seconds, not forever.
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
#: A worker that holds the slab lock this long is killed. The longest honest critical
#: section is a full repair: 0.34 s at 2 GiB of 4 KiB pages (measured).
DEFAULT_LOCK_TIMEOUT_S = 2.0
#: A request head (at most ~1 MiB of headers, usually one packet) must be complete this
#: long after its first byte: any client sends it in one write; only a dripping one (a
#: slowloris) takes longer. Go's servers commonly use 10 s; Apache starts at 20 s.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: An upload (or an answer being sent) that moves no byte for this long is stalled: it is
#: cut and its pages freed. Long enough for a congested link or a paused client; nginx's
#: client_body_timeout is 60 s, but a stalled upload here pins slab pages.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Once ``--body-timeout`` has passed since an upload began, its body must average at
#: least this many bytes a second (Apache mod_reqtimeout's ``MinRate``): an upload may take
#: the body timeout plus a second per this many bytes received. Without it, a body that
#: drips a byte just inside the body timeout held its reserved pages for good. 64 KiB/s
#: (half a megabit) only cuts what is no transfer: a 64 MiB block at that rate takes
#: 17 minutes, where recomputing it takes seconds; any real link moves thousands of times
#: more, and a congested one is covered by the body timeout's head start.
DEFAULT_MIN_UPLOAD_RATE = 64 * 1024
#: An idle keep-alive connection is closed after this long (nginx's default): longer than
#: the clients' own pool idle timeouts (aiohttp's is 15 s), so the server rarely closes a
#: connection a client is about to reuse; aiohttp's own default was over an hour.
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
ENV_LEASE_MS = "EPISTEMIC_GRAPH_KVCACHE_LEASE_MS"
#: The longest lease a lookup may take (eg_kv.slab.leases), in ms: a scheduler's lookup is
#: loaded within a step or a few (milliseconds to a second); a holder that dies pins its
#: blocks this long at most.
DEFAULT_LEASE_MS = 5000
#: The largest --lease-ms accepted: ten minutes (past it, a dead holder pins too long).
MAX_LEASE_MS = 600_000
ENV_EVENTS = "EPISTEMIC_GRAPH_KVCACHE_EVENTS"
#: Entries of the event log (eg_kv.slab.events: 384 bytes each, 24 MiB of /dev/shm): at
#: the rate a 2-core server creates and evicts 4 KiB blocks (~10 k/s each), about three
#: seconds of churn for a reader to fall behind before it must resync from a snapshot;
#: far more at the rates 14 MiB blocks change.
DEFAULT_EVENTS = 65536
#: The bounds of a non-zero event log (eg_kv.slab.events.MIN_EVENTS / MAX_EVENTS).
EVENTS_RANGE = (16, 1 << 24)
ENV_KV_EVENTS_ENDPOINT = "EPISTEMIC_GRAPH_KVCACHE_KV_EVENTS_ENDPOINT"
ENV_DISK = "EPISTEMIC_GRAPH_KVCACHE_DISK"
ENV_DISK_CAPACITY = "EPISTEMIC_GRAPH_KVCACHE_DISK_CAPACITY"
#: The disk tier's file when ``--disk`` is given without a capacity (preallocated at start).
DEFAULT_DISK_CAPACITY = 16 * GiB
#: A ZMQ endpoint the publisher binds: a TCP host and port, or an IPC path.
_ZMQ_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}|ipc://\S+")
#: A medium as vLLM and llm-d spell them (GPU, CPU, STORAGE, SHARED_STORAGE...).
_MEDIUM = re.compile(r"[A-Z][A-Z0-9_]{0,31}")
#: A topic's pool or model: llm-d splits the topic at '@'.
_TOPIC_PART = re.compile(r"[!-?A-~]{1,128}")
#: What :func:`topic_part` accepts, for the messages that refuse a value.
TOPIC_PART_RULE = "1-128 printable characters without '@' or spaces"


def topic_part(value: object) -> bool:
    """Whether ``value`` may be part of a KV-events topic (a pool's or a model's name):
    :data:`TOPIC_PART_RULE`."""
    return isinstance(value, str) and _TOPIC_PART.fullmatch(value) is not None


def parse_addr(value: str) -> tuple[str, int]:
    """Parse ``EPISTEMIC_GRAPH_KVCACHE_ADDR`` (or ``--addr``) into ``(host, port)``.

    The contract's grammar: a bare enable token (``1``, ``true``, ``yes``, ``on``) means
    ``127.0.0.1:9130``; a bare port means ``127.0.0.1:<port>``; ``host:port`` is used
    verbatim, an IPv6 host in brackets (``[::1]:9130``).

    Raises:
        ConfigError: the value fits none of those forms.
    """
    text = value.strip()
    if text.lower() in ENABLE_TOKENS:
        return DEFAULT_HOST, DEFAULT_PORT
    if text.isdigit():
        return DEFAULT_HOST, _port(text, value)
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":") or not host:
            raise ConfigError(f"bad address {value!r}: write an IPv6 host as [::1]:9130")
        return host, _port(rest[1:], value)
    host, sep, port = text.rpartition(":")
    if not sep or not host or ":" in host:
        raise ConfigError(
            f"bad address {value!r}: use 1/true/yes/on, a port, host:port or [v6]:port"
        )
    return host, _port(port, value)


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"bad port in address {whole!r}: want 1-65535")
    return int(text)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) reaches this machine only: ``localhost``, or an
    IP address in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


_CREDENTIALS = re.compile(r"(?<=://)[^/@]*@")


def shown_url(text: str) -> str:
    """A URL (or a server set) as an error message may show it: never a user, password,
    query or fragment (a token pasted into a URL must not reach a log)."""
    return repr(_CREDENTIALS.sub("***@", re.split(r"[?#]", text, maxsplit=1)[0]))


def format_hostport(host: str, port: int) -> str:
    """``host:port`` with an IPv6 host in brackets, as URLs and logs want it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_bool(text: str, name: str) -> bool:
    """Parse a boolean environment value; raises ConfigError naming the variable."""
    low = text.strip().lower()
    if low in ENABLE_TOKENS:
        return True
    if low in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name} must be one of 1/true/yes/on or 0/false/no/off")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the server needs, built once by the CLI and passed to every process.

    The token is kept out of ``repr`` so it can never reach a log line.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    capacity: int = DEFAULT_CAPACITY
    page_size: int = DEFAULT_PAGE_SIZE
    #: 0: the default, 64 MiB or the capacity if that is smaller.
    max_block_size: int = 0
    slab_name: str = ""
    keep: bool = False
    fresh: bool = False
    token: str | None = dataclasses.field(default=None, repr=False)
    #: a TOML file of tenants (eg_kv.server.tenants); replaces ``token`` when given
    tokens_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    access_log: bool = False
    upload_share: float = DEFAULT_UPLOAD_SHARE
    chunked_spool: int = DEFAULT_CHUNKED_SPOOL
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    #: Bytes a second a request body must average after the body timeout; 0: no minimum.
    min_upload_rate: int = DEFAULT_MIN_UPLOAD_RATE
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    #: Open connections per worker; 0: derived from the fd limit (eg_kv.server.connections).
    max_connections: int = 0
    #: The longest lease a batch lookup may take, in ms (eg_kv.slab.leases); 0: none.
    lease_ms: int = DEFAULT_LEASE_MS
    #: Fraction of the slab's pages, and of each namespace's quota, leases may hold.
    lease_share: float = DEFAULT_LEASE_SHARE
    #: Entries of the event log (GET /kv/events); 0: no log.
    events: int = DEFAULT_EVENTS
    #: The KV-events publisher (eg_kv.kvevents): its PUB endpoint ("": none), its replay
    #: endpoint, the medium and locality its events carry, its topics' pool and model,
    #: and vLLM's older positional form instead of tagged maps.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_medium: str = "SHARED_STORAGE"
    kv_events_locality: str = ""
    kv_events_pool: str = "eg-kv"
    kv_events_model: str = "default"
    kv_events_arrays: bool = False
    #: The disk tier (eg_kv.disk): its directory ("": none) and its file's size.
    disk: str = ""
    disk_capacity: int = DEFAULT_DISK_CAPACITY

    def __post_init__(self) -> None:
        try:  # one spelling everywhere (logs, /dev/shm paths, clients' local reads)
            name = segment_name(self.slab_name or f"/eg-kv-{self.port}")
        except SlabError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "slab_name", name)
        if self.workers < 1:
            raise ConfigError("--workers must be at least 1")
        room = self.capacity // self.page_size * self.page_size if self.page_size > 0 else 0
        if not self.max_block_size:
            object.__setattr__(self, "max_block_size", min(DEFAULT_MAX_BLOCK_SIZE, room) or 1)
        elif self.max_block_size > room:
            raise ConfigError(
                f"--max-block-size {format_size(self.max_block_size)} is larger than the "
                f"slab's capacity of {format_size(room)}: no such block could be stored; "
                "lower --max-block-size or raise --capacity"
            )
        if not 0 < self.upload_share <= 1:
            raise ConfigError(
                f"--upload-share {self.upload_share:g} must be a fraction in (0, 1], e.g. 0.5"
            )
        if self.chunked_spool < 1:
            raise ConfigError("--chunked-spool must be at least 1 byte, e.g. 256MiB")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if not self.heartbeat_timeout_s > 0.2:
            raise ConfigError("--heartbeat-timeout must be more than 0.2 seconds")
        if not self.lock_timeout_s > 0.1:
            raise ConfigError("--lock-timeout must be more than 0.1 seconds")
        if not 0 <= self.drain_timeout_s < math.inf:  # NaN: SIGTERM would wait for good
            raise ConfigError(
                f"--drain-timeout must be 0 or more seconds, not {self.drain_timeout_s}"
            )
        for flag, value in (("--header-timeout", self.header_timeout_s),
                            ("--body-timeout", self.body_timeout_s),
                            ("--keepalive-timeout", self.keepalive_timeout_s)):  # fmt: skip
            if not value > 0:
                raise ConfigError(f"{flag} must be a positive number of seconds, not {value}")
        if self.min_upload_rate < 0:
            raise ConfigError(
                "--min-upload-rate must be a size a second, e.g. 64KiB, or 0 for no minimum"
            )
        if self.events and not EVENTS_RANGE[0] <= self.events <= EVENTS_RANGE[1]:
            raise ConfigError(
                f"--events {self.events}: want 0 (no event log) or "
                f"{EVENTS_RANGE[0]}-{EVENTS_RANGE[1]} entries"
            )
        if not 0 <= self.lease_ms <= MAX_LEASE_MS:
            raise ConfigError(
                f"--lease-ms {self.lease_ms}: want 0 (no leases) to {MAX_LEASE_MS} ms"
            )
        if not 0 < self.lease_share <= 1:
            raise ConfigError(
                f"--lease-share {self.lease_share:g} must be a fraction in (0, 1], e.g. 0.5"
            )
        if self.max_connections < 0:
            raise ConfigError("--max-connections must be 0 (derive it from the fd limit) or more")
        self._check_kv_events()
        self._check_disk()

    def _check_disk(self) -> None:
        if not self.disk:
            return
        if not self.events:
            raise ConfigError("--disk follows the event log to spill blocks: --events must "
                              "not be 0")  # fmt: skip
        # The superblock, and one record of the largest block (eg_kv.disk.layout).
        least = 4096 + 4096 + -(-self.max_block_size // 4096) * 4096
        if self.disk_capacity < least:
            raise ConfigError(
                f"--disk-capacity {format_size(self.disk_capacity)} cannot hold one block of "
                f"--max-block-size {format_size(self.max_block_size)}: give it at least "
                f"{format_size(least)}"
            )

    def _check_kv_events(self) -> None:
        endpoints = {"--kv-events-endpoint": self.kv_events_endpoint,
                     "--kv-events-replay-endpoint": self.kv_events_replay_endpoint}  # fmt: skip
        for flag, value in endpoints.items():
            if value and not _ZMQ_ENDPOINT.fullmatch(value):
                raise ConfigError(
                    f"{flag} {value}: want tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557) or "
                    "ipc://PATH"
                )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.kv_events_endpoint and not self.events:
            raise ConfigError("--kv-events-endpoint publishes the event log: --events must "
                              "not be 0")  # fmt: skip
        if not _MEDIUM.fullmatch(self.kv_events_medium):
            raise ConfigError(f"--kv-events-medium {self.kv_events_medium}: want capitals and "
                              "_, e.g. SHARED_STORAGE or STORAGE")  # fmt: skip
        if self.kv_events_locality not in ("", "LOCAL", "REMOTE"):
            raise ConfigError(f"--kv-events-locality {self.kv_events_locality}: want LOCAL, "
                              "REMOTE or nothing")  # fmt: skip
        for flag, value in (("--kv-events-pool", self.kv_events_pool),
                            ("--kv-events-model", self.kv_events_model)):  # fmt: skip
            if not topic_part(value):
                raise ConfigError(f"{flag} {value!r}: want {TOPIC_PART_RULE} (it is part of "
                                  "the topic)")  # fmt: skip

    @property
    def kv_events_open(self) -> bool:
        """Whether the publisher listens beyond loopback (ZMQ has no authentication)."""
        for endpoint in (self.kv_events_endpoint, self.kv_events_replay_endpoint):
            if endpoint.startswith("tcp://"):
                host = endpoint[6:].rsplit(":", 1)[0].strip("[]")
                if not is_loopback(host):
                    return True
        return False

    @property
    def bind(self) -> str:
        return format_hostport(self.host, self.port)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"


#: How a setting's text (a flag's argument or a variable's value) becomes its value:
#: ``text`` as written; ``int`` and ``float`` converted by argparse for a flag (a bad number
#: exits 2 there); ``size`` by :func:`parse_size` in :func:`settings_from_env` (``8GiB``; a
#: bad one is a ConfigError, exit 1); ``switch`` a flag without argument (a variable would
#: take ``1``/``0``...); ``addr`` the contract's address grammar, into ``host`` and ``port``.
SettingKind = Literal["text", "int", "float", "size", "switch", "addr"]


@dataclasses.dataclass(frozen=True)
class ServerSetting:
    """One ``eg-kv serve`` setting: what its flag, its variable, ``--help`` and the README need.

    The value's type and default are the :class:`Settings` field's (``name``); this says
    how the setting is given and shown.
    """

    #: The :class:`Settings` field, and the flag's argparse ``dest``; ``addr`` fills
    #: ``host`` and ``port``.
    name: str
    #: The ``eg-kv serve`` flag; None: the setting is read from the environment only.
    flag: str | None
    #: The variable a flag not given falls back to; None: the flag only.
    env: str | None
    kind: SettingKind
    #: What it does, in light Markdown (``--help`` shows it without the backticks).
    help: str
    #: The flag's argument as help and the README name it (``SIZE``, ``S``).
    metavar: str | None = None
    #: Written after a default shown from the value: ``s`` for seconds.
    unit: str = ""
    #: The default in words (Markdown), where the field's default is not the value itself
    #: (0, "" or None standing for one derived at start); empty: shown from the field.
    default_text: str = ""
    #: README only: why this default, what the setting bounds.
    more: str = ""


_S = ServerSetting  # the table below reads as a table
#: Every ``eg-kv serve`` setting, in the order of ``--help`` and the README's table.
SERVER_SETTINGS: tuple[ServerSetting, ...] = (
    _S("addr", "--addr", ENV_ADDR, "addr", metavar="ADDR",
       help="bind address: `1`/`true`/`yes`/`on` → `127.0.0.1:9130`; a bare port → "
       "`127.0.0.1:<port>`; `host:port` verbatim (IPv6 as `[::1]:9130`)",
       default_text=f"`{format_hostport(DEFAULT_HOST, DEFAULT_PORT)}`"),
    _S("token", None, ENV_TOKEN, "text",
       help="when set, every route but `/healthz` needs `Authorization: Bearer <token>` "
       "(compared in constant time, never logged)",
       default_text="none: every client is a token holder"),
    _S("tokens_file", "--tokens", ENV_TOKENS_FILE, "text", metavar="FILE",
       help="TOML file of tenants (tokens' sha256, roles, namespaces, quotas), in place of "
       "the single token; `SIGHUP` reloads it",
       default_text="none"),
    _S("tls_cert", "--tls-cert", ENV_TLS_CERT, "text", metavar="PEM",
       help="PEM certificate: serve HTTPS with it and `--tls-key`", default_text="none: HTTP"),
    _S("tls_key", "--tls-key", ENV_TLS_KEY, "text", metavar="PEM",
       help="PEM private key of `--tls-cert`", default_text="none"),
    _S("workers", "--workers", None, "int", metavar="N",
       help="worker processes sharing the port", default_text="one per core"),
    _S("capacity", "--capacity", None, "size", metavar="SIZE",
       help="slab data capacity, e.g. `8GiB`; `/dev/shm` needs about 2% more"),
    _S("page_size", "--page-size", None, "size", metavar="SIZE",
       help="slab page size: a block takes whole pages"),
    _S("max_block_size", "--max-block-size", None, "size", metavar="SIZE",
       help="largest block accepted (a larger PUT gets `413` before its body is read), at "
       "most `--capacity`",
       default_text=f"`{format_size(DEFAULT_MAX_BLOCK_SIZE)}`, or the capacity if smaller"),
    _S("keep", "--keep", None, "switch",
       help="leave the slab in `/dev/shm` at exit, for a warm restart"),
    _S("fresh", "--fresh", None, "switch",
       help="discard a slab left by a previous server instead of re-attaching (only a "
       "segment that carries eg-kv's magic)"),
    _S("slab_name", "--slab-name", None, "text", metavar="NAME",
       help="POSIX shared-memory name of the slab (`foo` is `/foo`: the file `/dev/shm/foo`)",
       default_text="`/eg-kv-<port>`"),
    _S("drain_timeout_s", "--drain-timeout", None, "float", metavar="S", unit="s",
       help="seconds in-flight requests get on `SIGTERM`"),
    _S("access_log", "--access-log", None, "switch",
       help="log every request (it costs throughput: small block requests then skip the "
            "fast lane)"),
    _S("upload_share", "--upload-share", None, "float", metavar="F",
       help="fraction of the slab that uploads in flight may reserve together; a new upload "
       "beyond it gets `503` + `Retry-After`",
       more="Half keeps the other half for resident blocks, and 512 MiB of the default slab "
       "is 36 uploads of 14 MiB at once."),
    _S("chunked_spool", "--chunked-spool", None, "size", metavar="SIZE",
       help="memory one worker may hold spooling chunked PUT bodies (their length is unknown "
       "until they end); beyond it a chunked PUT gets `503` + `Retry-After` (`413` for one "
       "body over the block size)",
       more="The default is four of the default maximum block."),
    _S("header_timeout_s", "--header-timeout", None, "float", metavar="S", unit="s",
       help="seconds a request head may take from its first byte"),
    _S("body_timeout_s", "--body-timeout", None, "float", metavar="S", unit="s",
       help="seconds an upload, or an answer being sent, may move no byte before it is cut"),
    _S("min_upload_rate", "--min-upload-rate", None, "size", metavar="RATE",
       unit="a second",
       help="bytes a second a request body must average once `--body-timeout` has passed "
       "since it began, else it is cut and its pages freed; `0`: no minimum",
       more="As Apache's `mod_reqtimeout` `MinRate`: an upload may take the body timeout "
       "plus a second per 64 KiB received. One that falls behind is cut, its pages freed at "
       'once (`eg_kv_connection_timeouts_total{limit="rate"}`).'),
    _S("keepalive_timeout_s", "--keepalive-timeout", None, "float", metavar="S", unit="s",
       help="seconds an idle keep-alive connection is kept"),
    _S("max_connections", "--max-connections", None, "int", metavar="N",
       help="open connections per worker; beyond it the oldest idle ones are closed",
       # eg_kv.server.connections.DEFAULT_MAX_CONNECTIONS (test_settings checks the number)
       default_text="from the fd limit, at most 10000"),
    _S("events", "--events", ENV_EVENTS, "int", metavar="N",
       help="entries of the event log of stores and removals (`GET /kv/events`), 384 bytes "
       "each in `/dev/shm`; `0`: no log",
       more="A reader that falls more than this many events behind resyncs from "
       "`GET /kv/events/snapshot` (docs/events.md)."),
    _S("kv_events_endpoint", "--kv-events-endpoint", ENV_KV_EVENTS_ENDPOINT, "text",
       metavar="URL", default_text="none",
       help="publish the event log as vLLM's KV events on this ZMQ PUB endpoint "
       "(`tcp://127.0.0.1:5557`); empty: no publisher",
       more="One publisher per server, for KV-aware routers (llm-d, Dynamo): docs/events.md. "
       "ZMQ has no authentication: keep it on loopback or behind a NetworkPolicy."),
    _S("kv_events_replay_endpoint", "--kv-events-replay-endpoint", None, "text",
       metavar="URL", default_text="none",
       help="a ZMQ ROUTER endpoint that replays missed KV events from a given seq (vLLM's "
       "replay protocol); empty: none"),
    _S("kv_events_medium", "--kv-events-medium", None, "text", metavar="NAME",
       help="the `medium` of the published events: `SHARED_STORAGE` (llm-d scores it) or "
       "`STORAGE` (vLLM's, with `--kv-events-locality`)"),
    _S("kv_events_locality", "--kv-events-locality", None, "text", metavar="WHERE",
       default_text="none",
       help="the `locality` of the published events: `LOCAL`, `REMOTE`, or empty (not sent)"),
    _S("kv_events_pool", "--kv-events-pool", None, "text", metavar="NAME",
       help="the pool in the events' topic `kv@pool:<pool>@<model>` (a tenant's namespace "
       "publishes on `kv@pool:<pool>/<namespace>@<model>`)"),
    _S("kv_events_model", "--kv-events-model", None, "text", metavar="NAME",
       help="the model in the events' topic (the name your router knows the model by)"),
    _S("kv_events_arrays", "--kv-events-arrays", None, "switch",
       help="publish events in vLLM's older positional form instead of tagged maps"),
    _S("disk", "--disk", ENV_DISK, "text", metavar="DIR", default_text="none",
       help="a directory for the disk tier under the slab: evicted blocks stay there and "
       "come back on a hit, and a restart keeps them; empty: no disk tier",
       more="One preallocated file of `--disk-capacity` (docs/disk.md); the directory must "
       "be the server's own and not writable by others."),
    _S("disk_capacity", "--disk-capacity", ENV_DISK_CAPACITY, "size", metavar="SIZE",
       help="the size of the disk tier's file, reserved at start (`fallocate`)"),
    _S("lease_ms", "--lease-ms", ENV_LEASE_MS, "int", metavar="MS", unit="ms",
       help="the longest lease a batch lookup may take on its hits (`X-Eg-Kv-Lease-Ms`: "
       "eviction passes over them until loaded, released or expired); `0`: no leases",
       more="A client asks for a time and gets at most this; a holder that dies pins its "
       "blocks this long at most (docs/leases.md)."),
    _S("lease_share", "--lease-share", None, "float", metavar="F",
       help="fraction of the slab's pages, and of each namespace's quota, that leases may "
       "hold; past it a lookup answers its hits without leasing them",
       more="So one client that leases every block it finds cannot leave the others' "
       "puts a full slab (docs/leases.md)."),
    _S("heartbeat_timeout_s", "--heartbeat-timeout", None, "float", metavar="S", unit="s",
       help="seconds a worker may go without a heartbeat (stopped, stuck) before the "
       "supervisor kills and replaces it"),
    _S("lock_timeout_s", "--lock-timeout", None, "float", metavar="S",
       unit="s, plus the time a full repair of the slab takes",
       help="seconds a worker may hold the slab lock before the supervisor kills it"),
)  # fmt: skip
del _S


#: Each Settings field's default, as :func:`default_markdown` shows it.
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def show_value(setting: ServerSetting, value: object) -> str:
    """``value`` of ``setting`` as it would be typed: ``1GiB``, ``0.5``, ``off``."""
    if setting.kind == "size" and isinstance(value, int):
        return format_size(value)
    if setting.kind == "float" and isinstance(value, float):
        return f"{value:g}"
    if setting.kind == "switch":
        return "on" if value else "off"
    return str(value)


def default_markdown(setting: ServerSetting) -> str:
    """How the README shows ``setting``'s default (Markdown): from the field, or in words."""
    if setting.default_text:
        return setting.default_text
    shown = f"`{show_value(setting, _FIELD_DEFAULTS[setting.name])}`"
    return f"{shown} {setting.unit}" if setting.unit else shown


def help_text(setting: ServerSetting) -> str:
    """``setting``'s line in ``eg-kv serve --help``: what it does, its default, its variable.

    A setting without a flag is named by its variable first (the help's epilog lists them).
    """
    default = f"default {default_markdown(setting)}"
    if not setting.flag:
        line = f"{setting.env}: {setting.help} ({default})"
    elif setting.env:
        line = f"{setting.help} ({default}; env {setting.env})"
    else:
        line = f"{setting.help} ({default})"
    return line.replace("`", "")


def settings_markdown() -> str:
    """The README's table of server settings (flag, variable, default, meaning), generated."""
    rows = ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for setting in SERVER_SETTINGS:
        flag = setting.flag and " ".join(filter(None, (setting.flag, setting.metavar)))
        cells = (
            f"`{flag}`" if flag else "—",
            f"`{setting.env}`" if setting.env else "—",
            default_markdown(setting),
            f"{setting.help}. {setting.more}" if setting.more else setting.help,
        )
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _typed(setting: ServerSetting, given: object) -> object:
    """A flag's or variable's ``given`` value of ``setting`` as its Settings field holds it."""
    if setting.kind == "size":
        return parse_size(given if isinstance(given, int) else str(given))
    if not isinstance(given, str) or setting.kind == "text":
        return given  # argparse already converted it, or a caller passed the value
    if setting.kind == "switch":
        return parse_bool(given, setting.env or setting.name)
    try:
        return int(given) if setting.kind == "int" else float(given)
    except ValueError:
        raise ConfigError(f"{setting.env or setting.flag}={given!r} is not a number") from None


def settings_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build :class:`Settings` from the environment, then apply explicit overrides.

    ``overrides`` are named as :data:`SERVER_SETTINGS` name them (``addr``, ``capacity``...,
    with a size as text or bytes) or as :class:`Settings` fields; those whose value is None
    are ignored, so CLI flags that were not given fall back to the environment and then to
    the defaults. An ``addr`` override is parsed with the same grammar as
    ``EPISTEMIC_GRAPH_KVCACHE_ADDR``.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for setting in SERVER_SETTINGS:
        given = overrides.pop(setting.name, None)
        # A flag not given falls back to the variable; an empty address is no address
        # either (the grammar has none), and an empty variable is an unset one.
        if setting.env and (given is None or (setting.kind == "addr" and not given)):
            given = env.get(setting.env) or None
        if given is None:
            continue
        if setting.kind == "addr":
            values["host"], values["port"] = parse_addr(str(given))
        else:
            values[setting.name] = _typed(setting, given)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)


def main(argv: list[str] | None = None) -> int:
    """``python -m eg_kv.config --markdown``: print the README's settings table."""
    if (sys.argv[1:] if argv is None else argv) != ["--markdown"]:
        print("usage: python -m eg_kv.config --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(settings_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
