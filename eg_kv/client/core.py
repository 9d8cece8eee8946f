"""What the sync and the async client share: everything that does no I/O.

:mod:`eg_kv.client.sync` (standard library, :mod:`eg_kv.client.http11`) and :mod:`eg_kv.client.aio`
(aiohttp) differ only in how bytes move. Settings, addresses, request heads, the rules
that turn an answer into a hit or a miss, batch splitting and the shared exceptions live
here, written once (the way httpx's clients share ``BaseClient``).

The rules against a far end that cannot be trusted (a broken server, a proxy, an attacker
on the path) are here too, so both clients keep them alike:

* only a final answer counts (interim ``1xx`` answers are skipped by the transports);
* a block answer is read only when it is ``200``, unencoded, and framed by a
  ``Content-Length`` no larger than ``max_block_size``; anything else is a miss before a
  byte is allocated. Other answers (JSON, error lines) are read up to
  :data:`SMALL_ANSWER_MAX`;
* redirects are never followed: a ``3xx`` is a miss;
* a request that changes state (``PUT``, ``DELETE``) is never sent twice
  (:func:`may_resend`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .. import wire
from ..address import address_for_key, all_valid, validate
from ..blockkey import BlockKey, ForgedBlock
from ..blockkey import from_env as block_key_from_env
from ..blockkey import from_file as block_key_from_file
from ..checksum import SOCKET_PIECE, ChecksumMismatch, Failures, Verifier
from ..checksum import Running as RunningChecksum
from ..checksum import decode as decode_checksum
from ..checksum import encode as encode_checksum
from ..checksum import of as checksum_of
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
)
from ..errors import ConfigError, InvalidAddress, RemoteError, Unauthorized
from ..slab.local import LocalSlab, LocalUnavailable
from ..slab.view import BlockReader
from ..wire import AUTHORIZATION, BATCH_EXISTS_MAX, BLOCK_PREFIX

# The content types the connectors send, re-exported for them (defined in eg_kv.wire).
from ..wire import BLOCK_TYPE as BLOCK_TYPE
from ..wire import JSON_TYPE as JSON_TYPE
from .localreads import LocalReads

T = TypeVar("T")
_CHECKSUM_NAME = wire.CHECKSUM_HEADER.encode("ascii")

log = logging.getLogger("eg_kv.kvcache")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_NUM_WORKERS = 8
DEFAULT_MAX_CONNECTIONS = 16
#: The largest block a client reads (default: the server's default ``--max-block-size``).
ENV_MAX_BLOCK_SIZE = "EPISTEMIC_GRAPH_KVCACHE_MAX_BLOCK_SIZE"
#: Largest non-block answer read (JSON, error lines). The largest real one, a batch answer
#: for 1024 addresses, is about 7 KiB.
SMALL_ANSWER_MAX = 1024 * 1024
#: PUT bodies larger than this ask ``Expect: 100-continue`` first, so a server that
#: answers from the head alone (a dedup hit, a refusal) is not sent the body.
EXPECT_CONTINUE_MIN = 64 * 1024
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


#: What :meth:`ClientCore.local_fetch` returns when a read must go over HTTP.
OVER_HTTP: Any = object()


class PoolWaitTimeout(RemoteError):
    """No pooled connection of this client freed up within the timeout: the client is
    busy, not the server unreachable (deliberately not an OSError, so a server set does
    not mark a live member down for it)."""


class Miss(Exception):
    """Internal to the clients: the answer cannot be used (a miss, never raised to users)."""


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
                f"base_url {self.base_url!r} must look like http://host:port or https://host:port"
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


# --------------------------------------------------------------------------- stats


@dataclasses.dataclass(frozen=True)
class KvCacheStats:
    """``GET /kv/stats``: occupancy and dedup counters; ``extra`` holds any other field."""

    unique_blocks: int = 0
    total_refs: int = 0
    resident_bytes: int = 0
    logical_bytes: int = 0
    dedup_savings_bytes: int = 0
    dedup_hits: int = 0
    get_hits: int = 0
    get_misses: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, doc: Any) -> KvCacheStats:
        """Build from the decoded JSON body.

        Raises:
            RemoteError: the body is not an object or a known counter is not an integer.
        """
        if not isinstance(doc, dict):
            raise RemoteError("/kv/stats did not answer a JSON object")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        values: dict[str, Any] = {}
        for name in names:
            v = doc.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int):
                raise RemoteError(f"/kv/stats field {name!r} is not an integer")
            values[name] = v
        extra = {k: v for k, v in doc.items() if k not in values}
        return cls(**values, extra=extra)


# --------------------------------------------------------------------------- keys


def to_address(key: str | bytes) -> str:
    """The server address for a key.

    A string that is already a valid address (a token hash such as ``abc123``) is used
    verbatim, as the contract's ``PUT /kv/<hash>`` says; anything else (LMCache keys hold
    ``/``, bytes, over-long keys, ``.`` and ``..``) becomes the stable digest of
    :func:`eg_kv.address.address_for_key`, the same in every process and host.
    """
    if isinstance(key, str):
        try:
            validate(key)
            return key
        except InvalidAddress:
            pass
    return address_for_key(key)


def to_addresses(keys: Sequence[str | bytes]) -> list[str]:
    """:func:`to_address` of each key: checked as one batch when every key is an address
    already (as an adapter's digests are), key by key otherwise."""
    if all_valid(keys):
        return list(keys)  # type: ignore[arg-type]
    return [to_address(k) for k in keys]


def parts_checksum(views: Sequence[Any]) -> str:
    """The wire form of the checksum of a PUT body's ``views`` (buffers, in order)."""
    if len(views) == 1:
        return encode_checksum(checksum_of(views[0]))
    running = RunningChecksum()
    for view in views:
        running.update(view)
    return encode_checksum(running.intdigest())


def checksum_line(views: Sequence[Any]) -> bytes:
    """The ``X-Eg-Kv-Checksum`` header line of a PUT body's ``views``."""
    return b"%s: %s\r\n" % (_CHECKSUM_NAME, parts_checksum(views).encode("ascii"))


def batches(addresses: Sequence[str]) -> Iterator[list[str]]:
    """Split addresses into ``POST /kv/batch/exists`` requests the server accepts."""
    for i in range(0, len(addresses), BATCH_EXISTS_MAX):
        yield list(addresses[i : i + BATCH_EXISTS_MAX])


def batch_body(addresses: list[str]) -> bytes:
    """The JSON body of one ``POST /kv/batch/exists``."""
    return json.dumps({"addresses": addresses}, separators=(",", ":")).encode()


def batch_answer(doc: Any, n: int) -> tuple[list[bool], int]:
    """Check a ``POST /kv/batch/exists`` answer for ``n`` addresses.

    Returns:
        (one boolean per address, the length of the leading run of hits).

    Raises:
        Miss: the answer does not hold one boolean per address.
    """
    found = doc.get("exists") if isinstance(doc, dict) else None
    if (
        not isinstance(found, list)
        or len(found) != n
        or not all(isinstance(b, bool) for b in found)
    ):
        raise Miss("batch answer does not hold one boolean per address")
    prefix = doc.get("prefix_hits")
    if not isinstance(prefix, int) or isinstance(prefix, bool):
        prefix = next((i for i, b in enumerate(found) if not b), len(found))
    return found, prefix


class CompactRefused(Miss):
    """The server answered a compact batch with something else: one that predates it."""


def compact_answer(status: int, content_type: bytes | None, body: bytes, n: int) -> list[bool]:
    """Check a compact ``POST /kv/batch/exists`` answer (:mod:`eg_kv.wire`) for ``n``
    addresses.

    Returns:
        One boolean per address.

    Raises:
        CompactRefused: a 4xx answer of another type (a server that only speaks JSON).
        Miss: any other answer that is not ``n`` flags.
    """
    ctype = (content_type or b"").split(b";", 1)[0].strip().lower()
    if ctype != wire.FLAGS_TYPE.encode():
        if 400 <= status < 500:
            raise CompactRefused(f"HTTP {status} to a compact batch")
        raise Miss(f"HTTP {status} to a compact batch")
    found = wire.decode_flags(body, n) if status == 200 else None
    if found is None:
        raise Miss(f"compact batch answer is not {n} flags")
    return found


#: Hits answered unleased a client remembers (:meth:`ClientCore.note_unleased`).
UNLEASED_MAX = 65536


def leading_hits(found: list[bool]) -> int:
    """How many of ``found``, from the first, are True without a gap."""
    try:
        return found.index(False)
    except ValueError:
        return len(found)


def exists_answer(doc: Any) -> bool:
    """The ``exists`` boolean of a ``GET /kv/<addr>/exists`` answer.

    Raises:
        Miss: the answer holds no boolean ``exists``.
    """
    found = doc.get("exists") if isinstance(doc, dict) else None
    if not isinstance(found, bool):
        raise Miss("no boolean 'exists' in the answer")
    return found


# --------------------------------------------------------------------------- rules


def may_resend(method: str, target: str) -> bool:
    """Whether a request may go out again after its connection failed mid-exchange.

    Only requests that change nothing: ``GET``, ``HEAD`` and the batch existence probe
    (a ``POST`` that only reads). A ``PUT`` or ``DELETE`` whose head went out may have
    been applied (a ``DELETE`` sent twice releases two references), so it is a miss.
    """
    return method in ("GET", "HEAD") or (
        method == "POST" and target.endswith(wire.BATCH_EXISTS_PATH)
    )


def wants_continue(method: str, size: int) -> bool:
    """Whether a request asks ``Expect: 100-continue`` (a PUT body over 64 KiB)."""
    return method == "PUT" and size > EXPECT_CONTINUE_MIN


def check_final(status: int) -> None:
    """The rules every final answer passes before its body is looked at.

    Raises:
        Unauthorized: 401, the server wants a (valid) bearer token.
        Miss: a redirect (3xx): never followed, so a proxy cannot send the request (or
            the token) elsewhere.
    """
    if status == 401:
        raise Unauthorized("the server wants a valid bearer token")
    if 300 <= status < 400:
        raise Miss(f"HTTP {status}: redirects are not followed")


def block_to_read(status: int, length: int | None, encoding: str | None, limit: int) -> bool:
    """Whether a ``GET /kv/<addr>`` answer carries a block worth reading.

    Args:
        status: the final status.
        length: its Content-Length, None when unframed (chunked or read-to-close).
        encoding: its Content-Encoding, None when absent.
        limit: the config's ``max_block_size``.

    Returns:
        True for a block to read (``length`` bytes, at most ``limit``); False for a plain
        miss (404 and other refusals) whose small body may be drained.

    Raises:
        Unauthorized, Miss: see :func:`check_final`; and a block that is encoded,
            unframed or over ``limit`` (a miss before anything is allocated).
    """
    check_final(status)
    if status != 200:
        return False
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise Miss(f"block sent with Content-Encoding {encoding[:20]!r}; asked for identity")
    if length is None:
        raise Miss("block answer without a Content-Length")
    if length > limit:
        raise Miss(f"block of {length} bytes is over max_block_size {limit}")
    return True


def json_answer(status: int, body: bytes) -> Any:
    """The decoded body of a JSON answer (``/exists``, batch, stats, healthz).

    Raises:
        Miss: not a 200, or not JSON.
    """
    if status != 200:
        raise Miss(f"HTTP {status}")
    try:
        return json.loads(body)
    except ValueError:
        raise Miss("the answer is not JSON") from None


class LoadFailures:
    """What both single-server connectors report of the loads that failed a check (a
    base of each: they hold a :class:`ClientCore` as ``_core``)."""

    _core: ClientCore

    @property
    def checksum_failures(self) -> int:
        """Blocks this client read whose bytes failed their checksum (each a miss)."""
        return self._core.checksum_failures.count

    @property
    def forged_blocks(self) -> int:
        """Blocks this client read whose block-key tag failed (each a miss)."""
        return self._core.forged_blocks.count


class ClientCore:
    """The part of a connector that does no I/O: its config, request heads and misses.

    Both :class:`~eg_kv.client.sync.RemoteKVConnector` and
    :class:`~eg_kv.client.aio.AsyncRemoteKVConnector` hold one.

    Attributes:
        config: the resolved settings.
        prefix: the base URL's path prefix (``""`` unless behind a reverse proxy).
        headers: the header fields every request carries (token, identity encoding).
    """

    def __init__(self, config: KvCacheConfig) -> None:
        self.config = config
        self.prefix = urllib.parse.urlsplit(config.base_url).path.rstrip("/")
        self._block_prefix = self.prefix + BLOCK_PREFIX  # joined once, not per request
        self.headers: dict[str, str] = dict((ACCEPT_IDENTITY,))
        if config.token:
            # The one place the token lives besides the config: a header value.
            self.headers[AUTHORIZATION] = f"Bearer {config.token}"
        self._warned_401 = False
        self._warned_unreachable = False
        #: Called with each transport error (refused, reset, timed out) of this
        #: connector: a server set marks the member down (:mod:`eg_kv.client.sets`).
        self.on_unreachable: Callable[[BaseException], None] | None = None
        #: Reads from the server's slab when this client is on its host.
        self.local = LocalReads(config.local_reads)
        #: Blocks whose bytes failed their checksum (a miss each), logged once per address.
        self.checksum_failures = Failures("client")
        #: Blocks whose block-key tag failed (forged: a miss each), logged once per address.
        self.forged_blocks = Failures(
            "client", "failed its block-key tag",
            "not stored by a holder of this engine's block key (a forger, a lying server, "
            "or an engine with another key)",
        )  # fmt: skip
        #: Hits answered unleased (a lease cap), by address: their releases are not sent.
        self._unleased: dict[str, int] = {}
        self._unleased_lock = threading.Lock()

    def _unreachable_hook(self, exc: BaseException) -> None:
        if self.on_unreachable is not None and isinstance(exc, OSError):
            # TimeoutError and ConnectionError are OSErrors; PoolWaitTimeout (our own
            # pool was full) is not one: the member did nothing wrong.
            self.on_unreachable(exc)

    def block_path(self, address: str, suffix: str = "") -> str:
        """The request target of a block route."""
        return f"{self._block_prefix}{address}{suffix}"

    def path(self, route: str) -> str:
        """The request target of a fixed route (``/kv/stats``, ``/healthz``, ...)."""
        return f"{self.prefix}{route}"

    def miss(self, what: str, address: str, exc: BaseException) -> None:
        """Log a miss. A refused token and a server that refuses connections (or whose
        name does not resolve) are a warning once, a block that failed its checksum an
        error once per address (and counted); the rest is debug, so a dead server cannot
        flood the engine's logs."""
        if isinstance(exc, Unauthorized):
            self.warn_unauthorized()
        elif isinstance(exc, (ConnectionRefusedError, socket.gaierror)):
            self.warn_unreachable(exc)
        elif isinstance(exc, ChecksumMismatch):
            self.checksum_failures.record(address, str(exc))
        elif isinstance(exc, ForgedBlock):
            self.forged_blocks.record(address, str(exc))
        self._unreachable_hook(exc)
        log.debug("eg-kv %s %s: miss (%s: %s)", what, address, type(exc).__name__, exc)

    def checked(
        self, checksum: bytes | str | None, sink: Callable[..., T], length: int,
        read_exact: Callable[[memoryview], None],
    ) -> T:  # fmt: skip
        """``sink(length, read_exact)``, its bytes checked against ``checksum`` (a block
        answer's :data:`~eg_kv.wire.CHECKSUM_HEADER`; None: a server that sends none, whose
        bytes go unchecked) unless ``verify_checksums`` is off.

        Raises:
            ChecksumMismatch: the bytes are not the block's (the caller's miss).
            BadRequest: the header is not a checksum (a miss too).
            Exception: what ``sink`` raises.
        """
        expected = self._expected(checksum)
        if expected is None:
            return sink(length, read_exact)
        verifier = Verifier(expected, read_exact, SOCKET_PIECE)
        result = sink(length, verifier.read_exact)
        verifier.check()
        return result

    def keyed(self, address: str, sink: Callable[..., T]) -> Callable[..., T]:
        """A load's ``sink``, wrapped to check and cut off the block key's tag when this
        client has a key (:meth:`eg_kv.blockkey.BlockKey.keyed`); else ``sink``."""
        key = self.config.block_key
        return sink if key is None else key.keyed(address, sink)

    def sealed(self, address: str, views: list[memoryview]) -> list[memoryview]:
        """A PUT body's ``views``, with the block key's tag after them when this client has
        a key."""
        key = self.config.block_key
        if key is None:
            return views
        return [*views, memoryview(key.tag(address, views))]

    def opened(self, address: str, block: bytes) -> bytes:
        """A whole block read, its block-key tag checked and cut off (with a key).

        Raises:
            ForgedBlock: see :meth:`eg_kv.blockkey.BlockKey.keyed`.
        """
        key = self.config.block_key
        return block if key is None else key.open(address, block)

    def verifier(self, checksum: bytes | str | None) -> Verifier | None:
        """A :class:`~eg_kv.checksum.Verifier` of a block answer's bytes, from its
        :data:`~eg_kv.wire.CHECKSUM_HEADER`; None: nothing to check (no header: a server
        that sends none; or ``verify_checksums`` off).

        Raises:
            BadRequest: the header is not a checksum (the caller's miss).
        """
        expected = self._expected(checksum)
        return None if expected is None else Verifier(expected)

    def _expected(self, checksum: bytes | str | None) -> int | None:
        """The checksum a block answer's header gives, None when there is nothing to
        check (no header, or ``verify_checksums`` off).

        Raises:
            BadRequest: the header is not a checksum.
        """
        if checksum is None or not self.config.verify_checksums:
            return None
        return decode_checksum(checksum)

    def check_body(self, checksum: bytes | str | None, body: Any) -> None:
        """Check a whole block answer's ``body`` against its checksum header.

        Raises:
            ChecksumMismatch: it fails (the caller's miss). BadRequest: a bad header.
        """
        verifier = self.verifier(checksum)
        if verifier is not None:
            verifier.add(body)
            verifier.check()

    def local_fetch(self, slab: LocalSlab | None, address: str, sink: Callable[..., Any]) -> Any:
        """A GET served from the local slab (:mod:`eg_kv.client.localreads`): ``sink``'s result,
        None on a miss, or :data:`OVER_HTTP` when the read must go over HTTP (no mapping,
        or one that could not serve it exactly). :meth:`local_open`, then
        :meth:`local_copy`. Never raises."""
        reader = self.local_open(slab, address)
        if slab is None or not isinstance(reader, BlockReader):
            return reader  # OVER_HTTP or a miss
        return self.local_copy(slab, reader, address, sink)

    def local_open(self, slab: LocalSlab | None, address: str) -> Any:
        """The local block to copy (a :class:`~eg_kv.slab.view.BlockReader`), None on a
        miss, or :data:`OVER_HTTP`. Never raises."""
        if slab is None:
            return OVER_HTTP
        got = self._locally(address, slab.open_to_fetch, address, self.config.max_block_size)
        return OVER_HTTP if got is None and slab.info.disk else got  # its disk tier may hold it

    def local_copy(
        self, slab: LocalSlab, reader: BlockReader, address: str, sink: Callable[..., Any]
    ) -> Any:
        """``sink``'s result for ``reader`` (from :meth:`local_open`), None on a miss, or
        :data:`OVER_HTTP`. Any thread may run it; never raises."""
        return self._locally(address, slab.copy_out, reader, sink, self.config.verify_checksums)

    def _locally(self, address: str, step: Callable[..., Any], *args: Any) -> Any:
        try:
            return step(*args)
        except LocalUnavailable as exc:
            self.local.step_aside(exc)
            return OVER_HTTP
        except Exception as exc:
            self.miss("GET", address, exc)
            return None

    def local_exists(self, slab: LocalSlab | None, addresses: list[str]) -> list[bool] | None:
        """Which ``addresses`` are resident, from the local slab; None: ask over HTTP.

        Raises:
            InvalidAddress: as the server would answer 400 (the caller's miss).
        """
        if slab is None:
            return None
        try:
            found = slab.exists_addresses(addresses)
        except LocalUnavailable as exc:
            self.local.step_aside(exc)
            return None
        return None if slab.info.disk and not all(found) else found  # misses: ask the disk

    def local_lookup(
        self, slab: LocalSlab | None, addresses: list[str], lease_ms: int | None
    ) -> list[bool] | None:
        """A batch lookup answered from the local slab; None: ask over HTTP.

        A leasing lookup (``lease_ms`` above 0) leases its hits locally
        (:meth:`~eg_kv.slab.local.LocalSlab.lease_addresses`); where this reader cannot, it
        still answers an all-miss lookup here (nothing to lease) and asks the server about
        the rest, which takes the leases.

        Raises:
            InvalidAddress: as the server would answer 400 (the caller's miss).
        """
        if slab is None:
            return None
        lease = bool(lease_ms and lease_ms > 0)
        try:
            if lease and lease_ms:
                found = slab.lease_addresses(addresses, lease_ms)
                if found is not None:
                    return found
            found = slab.exists_addresses(addresses)
        except LocalUnavailable as exc:
            self.local.step_aside(exc)
            return None
        # Hits to lease are the server's to lease; misses, its disk tier's to answer.
        return None if (lease and any(found)) or (slab.info.disk and not all(found)) else found

    def note_unleased(self, addresses: list[str], found: list[bool]) -> None:
        """Remember the hits of a leasing lookup the server answered unleased (a lease cap,
        ``X-Eg-Kv-Lease-Refused``): their releases must not be sent, or they would end
        another client's lease on the block. Bounded: the oldest are forgotten first."""
        with self._unleased_lock:
            unleased = self._unleased
            for address, hit in zip(addresses, found, strict=True):
                if hit:
                    unleased[address] = unleased.get(address, 0) + 1
            while len(unleased) > UNLEASED_MAX:
                del unleased[next(iter(unleased))]

    def _to_release(self, addresses: list[str]) -> list[str]:
        """``addresses`` less one unleased hit each (:meth:`note_unleased`)."""
        if not self._unleased:
            return addresses
        out = []
        with self._unleased_lock:
            unleased = self._unleased
            for address in addresses:
                count = unleased.get(address, 0)
                if count > 1:
                    unleased[address] = count - 1
                elif count:
                    del unleased[address]
                else:
                    out.append(address)
        return out

    def local_release(self, addresses: list[str]) -> tuple[int, list[str]]:
        """End the leases this client took on the local slab on ``addresses``.

        Returns:
            How many were released here (a lease that had ended counts 0, as the server
            counts it), and the addresses it holds no local lease on: the server's to
            release (``POST /kv/batch/release``), less the hits it answered unleased.
        """
        slab = self.local.slab
        if slab is None:
            return 0, self._to_release(addresses)
        released, rest = slab.release_leases(addresses)
        return released, self._to_release(rest)

    def release_header(self, slab: LocalSlab | None, address: str, release_lease: bool) -> bool:
        """Whether a GET of ``address`` that ends a lease asks the server to end it: not
        when the lease is this client's on the local slab (released here after the read:
        the server would end another client's), nor when its lookup was answered unleased
        (the caller's release after the read forgets it)."""
        return (
            release_lease
            and (slab is None or not slab.holds_lease(address))
            and address not in self._unleased
        )

    def local_has(self, slab: LocalSlab | None, what: str, address: str) -> bool | None:
        """Whether ``address`` is resident, from the local slab; None: ask over HTTP. A bad
        address is a logged miss (False), as the server's 400 would be. Never raises."""
        try:
            found = self.local_exists(slab, [address])
        except Exception as exc:
            self.miss(what, address, exc)
            return False
        return None if found is None else found[0]

    def warn_unreachable(self, exc: BaseException) -> None:
        """Warn, once per connector (so once per server), that nothing answers at its
        address: every call is a miss until it does (the misses themselves are debug)."""
        if not self._warned_unreachable:
            self._warned_unreachable = True
            log.warning(
                "eg-kv at %s is unreachable (%s: %s): every call is a miss until it answers; "
                "is the server running, and is the URL right?",
                self.config.base_url, type(exc).__name__, exc,
            )  # fmt: skip

    def warn_unauthorized(self) -> None:
        """Warn, once per connector, that the server refused the token."""
        if not self._warned_401:
            self._warned_401 = True
            log.warning("eg-kv at %s refused the bearer token (401)", self.config.base_url)

    def unreachable(self, what: str, exc: BaseException) -> RemoteError:
        """The one-line error of a call that raises (``stats()``)."""
        self._unreachable_hook(exc)
        return RemoteError(
            f"cannot read {what} from {self.config.base_url}: {type(exc).__name__}: {exc}"
        )
