"""Settings in one place: the environment grammar of the contract, size parsing, defaults.

Everything a process needs is built once into a frozen :class:`Settings` and passed down.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from .errors import ConfigError
from .units import (  # re-exported: sizes are part of the settings' grammar
    DEFAULT_MAX_BLOCK_SIZE,
    DEFAULT_PAGE_SIZE,
    GiB,
    MiB,
    format_size,
    parse_size,
)

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

    def __post_init__(self) -> None:
        if not self.slab_name:
            object.__setattr__(self, "slab_name", f"/eg-kv-{self.port}")
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
        for flag, value in (("--header-timeout", self.header_timeout_s),
                            ("--body-timeout", self.body_timeout_s),
                            ("--keepalive-timeout", self.keepalive_timeout_s)):  # fmt: skip
            if not value > 0:
                raise ConfigError(f"{flag} must be a positive number of seconds, not {value}")
        if self.min_upload_rate < 0:
            raise ConfigError(
                "--min-upload-rate must be a size a second, e.g. 64KiB, or 0 for no minimum"
            )
        if self.max_connections < 0:
            raise ConfigError("--max-connections must be 0 (derive it from the fd limit) or more")

    @property
    def bind(self) -> str:
        return format_hostport(self.host, self.port)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"


def settings_from_env(env: Mapping[str, str] | None = None, **overrides) -> Settings:
    """Build :class:`Settings` from the environment, then apply explicit overrides.

    ``overrides`` whose value is None are ignored, so CLI flags that were not given fall
    back to the environment and then to the defaults. An ``addr`` override is parsed with
    the same grammar as ``EPISTEMIC_GRAPH_KVCACHE_ADDR``.
    """
    env = os.environ if env is None else env
    values: dict = {}
    addr = overrides.pop("addr", None) or env.get(ENV_ADDR)
    if addr:
        values["host"], values["port"] = parse_addr(addr)
    token = env.get(ENV_TOKEN)
    if token:
        values["token"] = token
    if env.get(ENV_TOKENS_FILE):
        values["tokens_file"] = env[ENV_TOKENS_FILE]
    for key, var in (("tls_cert", ENV_TLS_CERT), ("tls_key", ENV_TLS_KEY)):
        if env.get(var):
            values[key] = env[var]
    for key in ("capacity", "page_size", "max_block_size", "chunked_spool", "min_upload_rate"):
        if overrides.get(key) is not None:
            overrides[key] = parse_size(overrides[key])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)
