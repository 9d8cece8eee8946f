"""A client's settings: :class:`KvCacheConfig`, built once from keywords and the
environment (``EPISTEMIC_GRAPH_KVCACHE_*``) and passed down, frozen, to every connector
(:class:`~eg_kv.client.core.ClientCore` holds it)."""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from ..blockkey import BlockKey
from ..blockkey import from_env as block_key_from_env
from ..blockkey import from_file as block_key_from_file
from ..config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BLOCK_SIZE,
    DEFAULT_PORT,
    ENV_ADDR,
    ENV_TIMEOUT,
    ENV_TLS_VERIFY,
    ENV_TOKEN,
    ENV_URL,
    format_hostport,
    parse_addr,
    parse_bool,
    parse_size,
    shown_url,
)
from ..errors import ConfigError

# The content types the connectors send, re-exported for them (defined in eg_kv.wire).
from ..wire import BLOCK_TYPE as BLOCK_TYPE
from ..wire import JSON_TYPE as JSON_TYPE

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_NUM_WORKERS = 8
DEFAULT_MAX_CONNECTIONS = 16
#: The largest block a client reads (default: the server's default ``--max-block-size``).
ENV_MAX_BLOCK_SIZE = "EPISTEMIC_GRAPH_KVCACHE_MAX_BLOCK_SIZE"
#: The keywords every connector takes (and LMCache's ``adapter_params`` / ``extra_config``).
CONFIG_KEYWORDS = (
    "base_url", "addr", "token", "timeout_s", "num_workers", "max_connections", "verify_tls",
    "max_block_size", "refresh_s", "dns_server", "local_reads", "verify_checksums",
    "block_key_file",
)  # fmt: skip
#: ``0``/``false``/``no``/``off``: never read the server's slab directly, even on its host.
ENV_LOCAL_READS = "EPISTEMIC_GRAPH_KVCACHE_LOCAL_READS"
ENV_VERIFY_CHECKSUMS = "EPISTEMIC_GRAPH_KVCACHE_VERIFY_CHECKSUMS"
#: Seconds between re-resolutions of a server set's DNS entries (and the window in which a
#: miss at an address's new home asks its previous home).
ENV_REFRESH = "EPISTEMIC_GRAPH_KVCACHE_REFRESH_S"
#: The DNS server a ``dns+`` / ``dnssrv+`` set asks (``host[:port]``; default the system's).
ENV_DNS_SERVER = "EPISTEMIC_GRAPH_KVCACHE_DNS_SERVER"
DEFAULT_REFRESH_S = 15.0


#: Sent with every request: the clients never decompress, so a compressed body (a
#: "gzip bomb" included) can only be a miss.
ACCEPT_IDENTITY = ("Accept-Encoding", "identity")


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class KvCacheConfig:
    """Where and how a client reaches an eg-kv server. Frozen; the token stays out of repr.

    Attributes:
        base_url: ``http://host:port`` or ``https://host:port`` (an optional path prefix
            is kept, for a server behind a reverse proxy); or a server set: a
            comma-separated list of such URLs, ``dnssrv+http(s)://NAME`` or
            ``dns+http(s)://NAME:port`` entries (:mod:`eg_kv.client.members`), served by
            :mod:`eg_kv.client.sets`.
        token: bearer token sent as ``Authorization: Bearer <token>``, or None.
        timeout_s: the most one operation waits on the network (connect, send, answer).
        num_workers: threads of the LMCache L2 adapter's pool.
        max_connections: most connections open at once to the server (and kept idle).
        verify_tls: check the server's certificate on ``https``.
        max_block_size: the largest block answer read; a longer (or unframed) one is a
            miss before anything is allocated, which bounds a client's memory.
        refresh_s: a server set's DNS refresh period (and previous-home window).
        dns_server: ``host[:port]`` of the DNS server a DNS set asks; None: the system's.
        server_name: the name TLS verifies and sends as SNI when it is not the URL's
            host (a member found through DNS, connected at its address); None: the host.
        local_reads: on the server's host, read blocks and existence straight from its
            slab, read-only (:mod:`eg_kv.client.localreads`); anywhere else, or when that is not
            allowed, HTTP as always.
        verify_checksums: check every block read against its checksum (the server's
            ``X-Eg-Kv-Checksum``, the slab's record on a local read): a block whose bytes
            fail it is a miss, counted and logged once (:mod:`eg_kv.checksum`). Off only
            to measure what it costs.
        block_key: the engines' block key (:mod:`eg_kv.blockkey`): every block stored
            carries its MAC, every load checks it (a forged block is a miss); None: none.
            From ``EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY`` (or ``_BLOCK_KEY_FILE``, or the
            ``block_key_file`` setting). Never in a repr.
    """

    base_url: str = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    token: str | None = dataclasses.field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_workers: int = DEFAULT_NUM_WORKERS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    verify_tls: bool = True
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE
    refresh_s: float = DEFAULT_REFRESH_S
    dns_server: str | None = None
    server_name: str | None = None
    local_reads: bool = True
    verify_checksums: bool = True
    block_key: BlockKey | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        if not _is_plain_url(self.base_url):
            # A server set: eg_kv.client.members parses it (and says what is wrong with it).
            from .members import parse_server_set

            object.__setattr__(self, "base_url", self.base_url.strip())
            parse_server_set(self.base_url)
            return
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"base_url {shown_url(self.base_url)} must look like http://host:port or "
                "https://host:port"
            )
        if parts.username or parts.password or parts.query or parts.fragment:
            # A token in the URL would end up in logs; it belongs in the token field.
            raise ConfigError("base_url must hold no user, password, query or fragment")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    def _check_numbers(self) -> None:
        if not self.refresh_s > 0:
            raise ConfigError(f"{ENV_REFRESH} / refresh_s must be a positive number of seconds")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s must be a positive number of seconds")
        if self.num_workers < 1:
            raise ConfigError("num_workers must be at least 1")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")
        if self.max_block_size < 1:
            raise ConfigError("max_block_size must be at least 1 byte (e.g. 64MiB)")

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        base_url: str | None = None,
        addr: str | None = None,
        token: str | None = None,
        timeout_s: float | str | None = None,
        num_workers: int | None = None,
        max_connections: int | None = None,
        verify_tls: bool | str | None = None,
        max_block_size: int | str | None = None,
        refresh_s: float | str | None = None,
        dns_server: str | None = None,
        local_reads: bool | str | None = None,
        verify_checksums: bool | str | None = None,
        block_key_file: str | None = None,
    ) -> KvCacheConfig:
        """Build a config: explicit keywords first, then the environment, then defaults.

        The server is found from ``base_url``, else ``addr`` (the server's address grammar:
        ``1``/``true``/``yes``/``on``, a port, ``host:port`` or ``[v6]:port``), else
        ``EPISTEMIC_GRAPH_KVCACHE_URL``, else ``EPISTEMIC_GRAPH_KVCACHE_ADDR``, else
        ``http://127.0.0.1:9130``. ``EPISTEMIC_GRAPH_KVCACHE_TOKEN``, ``_TIMEOUT_S``,
        ``_TLS_VERIFY``, ``_MAX_BLOCK_SIZE``, ``_LOCAL_READS`` and ``_VERIFY_CHECKSUMS`` fill
        the token, timeout, TLS check, largest block, local reads and checksum checks.

        Args:
            env: the environment to read (default ``os.environ``).
            base_url, addr, token, timeout_s, num_workers, max_connections, verify_tls,
            max_block_size: explicit settings; None means "not given". A size may be
                written like ``64MiB``.

        Returns:
            The frozen config.

        Raises:
            ConfigError: a value (given or from the environment) cannot be used.
        """
        env = os.environ if env is None else env
        if not base_url:
            if addr:
                base_url = _url_from_addr(str(addr))
            elif env.get(ENV_URL):
                base_url = env[ENV_URL].strip()
            elif env.get(ENV_ADDR):
                base_url = _url_from_addr(env[ENV_ADDR])
            else:
                base_url = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
        if token is None:
            token = env.get(ENV_TOKEN) or None
        timeout = _seconds(timeout_s, env, ENV_TIMEOUT, "timeout_s", DEFAULT_TIMEOUT_S)
        if max_block_size is None:
            max_block_size = env.get(ENV_MAX_BLOCK_SIZE) or DEFAULT_MAX_BLOCK_SIZE
        refresh = _seconds(refresh_s, env, ENV_REFRESH, "refresh_s", DEFAULT_REFRESH_S)
        return cls(
            base_url=base_url,
            token=token or None,
            timeout_s=timeout,
            num_workers=int(num_workers) if num_workers is not None else DEFAULT_NUM_WORKERS,
            max_connections=(
                int(max_connections) if max_connections is not None else DEFAULT_MAX_CONNECTIONS
            ),
            verify_tls=_flag(verify_tls, env, ENV_TLS_VERIFY),
            max_block_size=parse_size(max_block_size),
            refresh_s=refresh,
            dns_server=dns_server or env.get(ENV_DNS_SERVER) or None,
            local_reads=_flag(local_reads, env, ENV_LOCAL_READS),
            verify_checksums=_flag(verify_checksums, env, ENV_VERIFY_CHECKSUMS),
            block_key=block_key_from_file(block_key_file)
            if block_key_file
            else block_key_from_env(env),
        )

    @property
    def single(self) -> bool:
        """True when ``base_url`` names one plain server (today's direct client)."""
        return _is_plain_url(self.base_url)


def _is_plain_url(text: str) -> bool:
    """One ``http(s)://`` URL, no list, no DNS scheme: served without placement."""
    return "," not in text and text.strip().lower().startswith(("http://", "https://"))


def _seconds(
    given: float | str | None, env: Mapping[str, str], var: str, name: str, default: float
) -> float:
    """A number of seconds: the keyword ``name`` if given, else ``var`` in ``env``, else
    ``default``.

    Raises:
        ConfigError: the value is not a number.
    """
    value = given if given is not None else (env.get(var) or default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{var} / {name} must be a number of seconds") from None


def _flag(given: bool | str | None, env: Mapping[str, str], var: str) -> bool:
    """An on/off setting: the keyword if given, else ``var`` in ``env``, else on.

    Raises:
        ConfigError: a string that is not a boolean word (see :func:`parse_bool`).
    """
    value = given if given is not None else (env.get(var) or True)
    return parse_bool(value, var) if isinstance(value, str) else bool(value)


def _url_from_addr(value: str) -> str:
    host, port = parse_addr(value)
    return f"http://{format_hostport(host, port)}"


def resolve_config(config: KvCacheConfig | None, overrides: dict[str, Any]) -> KvCacheConfig:
    """The config a connector uses: the one given, else ``from_env`` with the keywords.

    Raises:
        ConfigError: both a config and keywords were given, or a keyword is unknown.
    """
    if config is not None:
        if overrides:
            raise ConfigError("pass either a KvCacheConfig or keyword settings, not both")
        return config
    allowed = set(CONFIG_KEYWORDS)
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(allowed)}")
    return KvCacheConfig.from_env(**overrides)
