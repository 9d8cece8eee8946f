"""The synchronous eg-kv client: standard library only, kept-alive pooled connections.

:class:`RemoteKVConnector` speaks the HTTP contract (``GET/PUT/HEAD/DELETE /kv/<addr>``,
``GET /kv/<addr>/exists``, ``POST /kv/batch/exists``, ``GET /kv/stats``) over HTTP/1.1
connections (:mod:`eg_kv.http11`, standard library only) that are kept alive and reused
from a small thread-safe pool.

The hot path (``get``, ``get_into``, ``put``, ``contains``, ``exists``, ``delete``,
``contains_prefix``, ``exists_many``) never raises: any transport or protocol error is a
miss (``None`` / ``False`` / ``0``), and no call waits longer than about the configured
timeout. ``stats()`` raises :class:`~eg_kv.errors.RemoteError` (or
:class:`~eg_kv.errors.Unauthorized`) with a one-line message instead.

The bearer token is sent in a header only; it never appears in a URL, a log line, a
``repr`` or an error message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .address import address_for_key, validate
from .config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_ADDR,
    ENV_TIMEOUT,
    ENV_TLS_VERIFY,
    ENV_TOKEN,
    ENV_URL,
    format_hostport,
    parse_addr,
    parse_bool,
)
from .errors import ConfigError, EgKvError, InvalidAddress, RemoteError, Unauthorized
from .http11 import Connection, Deadline, Response, StaleConnection, host_header

log = logging.getLogger("eg_kv.kvcache")

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_NUM_WORKERS = 8
DEFAULT_MAX_CONNECTIONS = 16
#: The server's limit on addresses per ``POST /kv/batch/exists``.
BATCH_EXISTS_MAX = 1024
#: The keywords every connector takes (and LMCache's ``adapter_params`` / ``extra_config``).
CONFIG_KEYWORDS = (
    "base_url", "addr", "token", "timeout_s", "num_workers", "max_connections", "verify_tls",
)  # fmt: skip


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class KvCacheConfig:
    """Where and how a client reaches an eg-kv server. Frozen; the token stays out of repr.

    Attributes:
        base_url: ``http://host:port`` or ``https://host:port`` (an optional path prefix
            is kept, for a server behind a reverse proxy).
        token: bearer token sent as ``Authorization: Bearer <token>``, or None.
        timeout_s: the most one operation waits on the network (connect, send, answer).
        num_workers: threads of the LMCache L2 adapter's pool.
        max_connections: most connections open at once to the server (and kept idle).
        verify_tls: check the server's certificate on ``https``.
    """

    base_url: str = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    token: str | None = dataclasses.field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_workers: int = DEFAULT_NUM_WORKERS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    verify_tls: bool = True

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"base_url {self.base_url!r} must look like http://host:port or https://host:port"
            )
        if parts.username or parts.password or parts.query or parts.fragment:
            # A token in the URL would end up in logs; it belongs in the token field.
            raise ConfigError("base_url must hold no user, password, query or fragment")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s must be a positive number of seconds")
        if self.num_workers < 1:
            raise ConfigError("num_workers must be at least 1")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")

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
    ) -> KvCacheConfig:
        """Build a config: explicit keywords first, then the environment, then defaults.

        The server is found from ``base_url``, else ``addr`` (the server's address grammar:
        ``1``/``true``/``yes``/``on``, a port, ``host:port`` or ``[v6]:port``), else
        ``EPISTEMIC_GRAPH_KVCACHE_URL``, else ``EPISTEMIC_GRAPH_KVCACHE_ADDR``, else
        ``http://127.0.0.1:9130``. ``EPISTEMIC_GRAPH_KVCACHE_TOKEN``,
        ``_TIMEOUT_S`` and ``_TLS_VERIFY`` fill the token, timeout and TLS check.

        Args:
            env: the environment to read (default ``os.environ``).
            base_url, addr, token, timeout_s, num_workers, max_connections, verify_tls:
                explicit settings; None means "not given".

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
        if timeout_s is None:
            timeout_s = env.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S
        try:
            timeout = float(timeout_s)
        except (TypeError, ValueError):
            raise ConfigError(f"{ENV_TIMEOUT} / timeout_s must be a number of seconds") from None
        if verify_tls is None:
            verify_tls = env.get(ENV_TLS_VERIFY) or True
        if isinstance(verify_tls, str):
            verify_tls = parse_bool(verify_tls, ENV_TLS_VERIFY)
        return cls(
            base_url=base_url,
            token=token or None,
            timeout_s=timeout,
            num_workers=int(num_workers) if num_workers is not None else DEFAULT_NUM_WORKERS,
            max_connections=(
                int(max_connections) if max_connections is not None else DEFAULT_MAX_CONNECTIONS
            ),
            verify_tls=bool(verify_tls),
        )


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
    ``/``, bytes, over-long keys) becomes the stable digest of
    :func:`eg_kv.address.address_for_key`, the same in every process and host.
    """
    if isinstance(key, str):
        try:
            validate(key)
            return key
        except InvalidAddress:
            pass
    return address_for_key(key)


# --------------------------------------------------------------------------- transport


class _Miss(Exception):
    """Internal: the answer cannot be used (short body, wrong length, bad JSON)."""


def batch_answer(doc: Any, n: int) -> tuple[list[bool], int]:
    """Check a ``POST /kv/batch/exists`` answer for ``n`` addresses.

    Returns:
        (one boolean per address, the length of the leading run of hits).

    Raises:
        _Miss: the answer does not hold one boolean per address.
    """
    found = doc.get("exists") if isinstance(doc, dict) else None
    if (
        not isinstance(found, list)
        or len(found) != n
        or not all(isinstance(b, bool) for b in found)
    ):
        raise _Miss("batch answer does not hold one boolean per address")
    prefix = doc.get("prefix_hits")
    if not isinstance(prefix, int) or isinstance(prefix, bool):
        prefix = next((i for i, b in enumerate(found) if not b), len(found))
    return found, prefix


#: Largest non-block answer read (JSON, error lines).
_SMALL_ANSWER = 16 * 1024 * 1024


class _Pool:
    """A LIFO pool of kept-alive connections, bounded by ``max_connections``.

    Thread-safe: a connection is used by one thread at a time. At most ``max_connections``
    exist at once; a caller beyond that waits for one (within its deadline).
    """

    def __init__(self, config: KvCacheConfig) -> None:
        parts = urllib.parse.urlsplit(config.base_url)
        self.host = parts.hostname or DEFAULT_HOST
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.host_header = host_header(self.host, self.port, self.https)
        self.ssl_context: ssl.SSLContext | None = None
        if self.https:
            self.ssl_context = ssl.create_default_context()
            if not config.verify_tls:
                self.ssl_context.check_hostname = False
                self.ssl_context.verify_mode = ssl.CERT_NONE
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(config.max_connections)
        self._closed = False

    def acquire(self, deadline: Deadline) -> Connection:
        if not self._slots.acquire(timeout=deadline.left()):
            raise TimeoutError("no free eg-kv connection within the timeout")
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return Connection(self.host, self.port, self.host_header, self.ssl_context)

    def release(self, conn: Connection, reusable: bool) -> None:
        if reusable and not self._closed:
            with self._lock:
                self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


Sink = Callable[[int, Callable[[memoryview], None]], T]


class RemoteKVConnector:
    """Synchronous eg-kv client (standard library only). Thread-safe; a context manager.

    Build it with keywords (``RemoteKVConnector(base_url=..., token=...)``), with a
    :class:`KvCacheConfig`, or from the environment with :meth:`from_env`.

    Keys: a string that is a valid address (a token hash) is used verbatim; any other key
    (an LMCache key with ``/``, bytes) is mapped to a stable digest (:func:`to_address`).
    """

    def __init__(self, config: KvCacheConfig | None = None, **settings: Any) -> None:
        """Args:
            config: a ready config; or leave it out and pass ``settings``.
            **settings: ``base_url``, ``addr``, ``token``, ``timeout_s``, ``num_workers``,
                ``max_connections``, ``verify_tls``; what is left out comes from the
                environment (:meth:`KvCacheConfig.from_env`).

        Raises:
            ConfigError: a setting cannot be used.
        """
        self.config = resolve_config(config, settings)
        self._pool = _Pool(self.config)
        # The one place the token lives besides the config: a ready-made header line.
        self._auth = b""
        if self.config.token:
            self._auth = b"Authorization: Bearer %s\r\n" % self.config.token.encode("latin-1")
        self._warned_401 = False
        self._closed = False

    @classmethod
    def from_env(cls, **settings: Any) -> RemoteKVConnector:
        """A connector configured from ``EPISTEMIC_GRAPH_KVCACHE_*`` (keywords override).

        Raises:
            ConfigError: a setting cannot be used.
        """
        return cls(KvCacheConfig.from_env(**settings))

    def __repr__(self) -> str:
        return f"RemoteKVConnector({self.config.base_url!r})"

    def __enter__(self) -> RemoteKVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection. Idempotent; later calls are misses."""
        self._closed = True
        self._pool.close()

    # ------------------------------------------------------------------ the engine

    def _path(self, address: str, suffix: str = "") -> str:
        return f"{self._pool.prefix}/kv/{address}{suffix}"

    def _exchange(
        self,
        method: str,
        target: str,
        on_response: Callable[[Response], T],
        body: Sequence[Any] = (),
        headers: bytes = b"",
    ) -> T:
        """Send one request and hand the response to ``on_response``.

        ``on_response`` must read the body fully (the connection is then kept) or raise.
        A kept-alive connection the server closed while idle fails before any answer;
        that one case is retried once on a fresh connection (every request here is
        idempotent).

        Raises:
            Any transport error, TimeoutError, ProtocolError, or what ``on_response``
            raises.
        """
        if self._closed:
            raise RemoteError("the connector is closed")
        deadline = Deadline(self.config.timeout_s)
        parts = [memoryview(b).cast("B") for b in body]
        head = self._auth + headers
        if method in ("PUT", "POST"):
            head += b"Content-Length: %d\r\n" % sum(len(p) for p in parts)
        for attempt in (0, 1):
            conn = self._pool.acquire(deadline)
            keep = False
            try:
                resp = conn.request(method, target, head, parts, deadline)
                result = on_response(resp)
                keep = conn.reusable(resp)
                return result
            except StaleConnection:
                # The server closed this idle connection; a fresh one gets a real answer.
                if attempt == 0:
                    continue
                raise
            finally:
                self._pool.release(conn, keep)
        raise RemoteError("unreachable")  # pragma: no cover

    def _miss(self, what: str, address: str, exc: BaseException) -> None:
        # Misses are expected under failure; log at debug so a dead server cannot flood logs.
        if isinstance(exc, Unauthorized) and not self._warned_401:
            self._warned_401 = True
            log.warning("eg-kv at %s refused the bearer token (401)", self.config.base_url)
        log.debug("eg-kv %s %s: miss (%s: %s)", what, address, type(exc).__name__, exc)

    @staticmethod
    def _check_auth(resp: Response) -> None:
        if resp.status == 401:
            resp.read_all(_SMALL_ANSWER)
            raise Unauthorized("the server wants a valid bearer token")

    def _json(self, resp: Response) -> Any:
        self._check_auth(resp)
        data = resp.read_all(_SMALL_ANSWER)
        if resp.status != 200:
            raise _Miss(f"HTTP {resp.status}")
        try:
            return json.loads(data)
        except ValueError:
            raise _Miss("the answer is not JSON") from None

    def fetch(self, key: str | bytes, sink: Sink[T]) -> T | None:
        """GET a block and hand its body to ``sink(length, read_exact)``; None on a miss.

        ``sink`` must call ``read_exact(view)`` with views that add up to ``length`` bytes
        (in order) and return its result; if it raises, the block is a miss. A body cut
        short (the server evicted the block mid-stream) is a miss, never partial bytes.

        Never raises on a transport or protocol error.
        """
        address = to_address(key)

        def on_response(resp: Response) -> T | None:
            self._check_auth(resp)
            if resp.status != 200:
                resp.read_all(_SMALL_ANSWER)
                return None
            if resp.length is None:
                # Chunked or read-to-close: not what the server sends for a block, but
                # still well-formed; take it through memory.
                data = memoryview(resp.read_all(1 << 40))
                offset = 0

                def read_exact(view: memoryview) -> None:
                    nonlocal offset
                    view = memoryview(view).cast("B")
                    if offset + len(view) > len(data):
                        raise _Miss("sink asked for more bytes than the block holds")
                    view[:] = data[offset : offset + len(view)]
                    offset += len(view)

                result = sink(len(data), read_exact)
                if offset != len(data):
                    raise _Miss("sink left part of the body unread")
                return result

            def read_exact(view: memoryview) -> None:
                resp.read_exact(memoryview(view).cast("B"))

            result = sink(resp.length, read_exact)
            if not resp.complete:
                raise _Miss("sink left part of the body unread")
            return result

        try:
            return self._exchange("GET", self._path(address), on_response)
        except Exception as exc:
            self._miss("GET", address, exc)
            return None

    # ------------------------------------------------------------------ the API

    def get(self, key: str | bytes) -> bytes | None:
        """``GET /kv/<addr>``: the block's bytes, or None on a miss or any error."""

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> bytes:
            buf = bytearray(length)
            read_exact(memoryview(buf))
            return bytes(buf)

        return self.fetch(key, sink)

    def get_into(self, key: str | bytes, buffer: Any) -> int | None:
        """``GET /kv/<addr>`` straight into ``buffer`` (a writable buffer, no extra copy).

        Returns:
            The block's length when it fits in ``buffer`` (the first bytes of ``buffer``
            now hold it); None on a miss, an error, or a block larger than ``buffer``.
        """
        view = memoryview(buffer).cast("B")

        def sink(length: int, read_exact: Callable[[memoryview], None]) -> int:
            if length > len(view):
                raise _Miss(f"block of {length} bytes does not fit a {len(view)}-byte buffer")
            read_exact(view[:length])
            return length

        return self.fetch(key, sink)

    def put(self, key: str | bytes, data: Any) -> bool:
        """``PUT /kv/<addr>``: store ``data`` (any bytes-like object; sent without a copy).

        Returns:
            True when the server holds the block (201 new, 200 deduplicated); False on any
            refusal or error.
        """
        return self.put_parts(key, (data,))

    def put_parts(self, key: str | bytes, parts: Iterable[Any]) -> bool:
        """``PUT /kv/<addr>`` of the concatenation of ``parts``, each sent without a copy.

        Returns:
            True on 200/201, False on any refusal or error.
        """
        address = to_address(key)
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError as exc:
            self._miss("PUT", address, exc)
            return False

        def on_response(resp: Response) -> bool:
            self._check_auth(resp)
            resp.read_all(_SMALL_ANSWER)
            return resp.status in (200, 201)

        try:
            return self._exchange(
                "PUT",
                self._path(address),
                on_response,
                body=views,
                headers=b"Content-Type: application/octet-stream\r\n",
            )
        except Exception as exc:
            self._miss("PUT", address, exc)
            return False

    # put_status: interim, replaced by the client-core version at merge
    def put_status(self, key: str | bytes, parts: Iterable[Any]) -> int | None:
        """``PUT /kv/<addr>`` of the concatenation of ``parts``, each sent without a copy.

        Returns:
            The final HTTP status (200, 201, 409, 413, 503, 507, 401, ...), or None when
            no answer came (a transport failure, a timeout, unusable parts).
        """
        address = to_address(key)
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError as exc:
            self._miss("PUT", address, exc)
            return None

        def on_response(resp: Response) -> int:
            resp.read_all(_SMALL_ANSWER)
            return resp.status

        try:
            return self._exchange(
                "PUT",
                self._path(address),
                on_response,
                body=views,
                headers=b"Content-Type: application/octet-stream\r\n",
            )
        except Exception as exc:
            self._miss("PUT", address, exc)
            return None

    def _status(self, method: str, address: str, path: str) -> int | None:
        def on_response(resp: Response) -> int:
            self._check_auth(resp)
            resp.read_all(_SMALL_ANSWER)
            return resp.status

        try:
            return self._exchange(method, path, on_response)
        except Exception as exc:
            self._miss(method, address, exc)
            return None

    def contains(self, key: str | bytes) -> bool:
        """``HEAD /kv/<addr>``: True when the block is resident; False on a miss or error."""
        address = to_address(key)
        return self._status("HEAD", address, self._path(address)) == 200

    def delete(self, key: str | bytes) -> bool:
        """``DELETE /kv/<addr>``: release one reference. True on 204; False otherwise."""
        address = to_address(key)
        return self._status("DELETE", address, self._path(address)) == 204

    def exists(self, key: str | bytes) -> bool:
        """``GET /kv/<addr>/exists``: True when resident; False on a miss or any error."""
        address = to_address(key)
        try:
            doc = self._exchange("GET", self._path(address, "/exists"), self._json)
            found = doc.get("exists") if isinstance(doc, dict) else None
            if not isinstance(found, bool):
                raise _Miss("no boolean 'exists' in the answer")
            return found
        except Exception as exc:
            self._miss("exists", address, exc)
            return False

    def _batch_exists(self, addresses: list[str]) -> tuple[list[bool], int]:
        """One ``POST /kv/batch/exists`` for at most 1024 addresses. Raises on error."""
        body = json.dumps({"addresses": addresses}, separators=(",", ":")).encode()
        doc = self._exchange(
            "POST",
            f"{self._pool.prefix}/kv/batch/exists",
            self._json,
            body=(body,),
            headers=b"Content-Type: application/json\r\n",
        )
        return batch_answer(doc, len(addresses))

    def exists_many(self, keys: Sequence[str | bytes]) -> list[bool]:
        """Which keys are resident: one batch request per 1024 keys.

        Returns:
            One bool per key; all False for a batch that failed.
        """
        addresses = [to_address(k) for k in keys]
        out: list[bool] = []
        for i in range(0, len(addresses), BATCH_EXISTS_MAX):
            chunk = addresses[i : i + BATCH_EXISTS_MAX]
            found = self._try_batch(chunk)
            out.extend(found if found is not None else [False] * len(chunk))
        return out

    def try_exists_many(self, keys: Sequence[str | bytes]) -> list[bool] | None:
        """Like :meth:`exists_many`, but None when any batch request failed (so a caller
        can tell "absent" from "could not ask"). Never raises."""
        return self.try_exists_addresses([to_address(k) for k in keys])

    def try_exists_addresses(self, addresses: Sequence[str]) -> list[bool] | None:
        """:meth:`try_exists_many` for ready-made addresses (no per-key mapping: the L2
        connector's lookups are latency-bound). Never raises."""
        out: list[bool] = []
        for i in range(0, len(addresses), BATCH_EXISTS_MAX):
            found = self._try_batch(list(addresses[i : i + BATCH_EXISTS_MAX]))
            if found is None:
                return None
            out.extend(found)
        return out

    def _try_batch(self, chunk: list[str]) -> list[bool] | None:
        try:
            return self._batch_exists(chunk)[0]
        except Exception as exc:
            self._miss("batch/exists", f"[{len(chunk)} addresses]", exc)
            return None

    def contains_prefix(self, keys: Sequence[str | bytes]) -> int:
        """How many of ``keys``, from the first, are resident without a gap (prefix hits).

        Returns:
            The prefix length; 0 on any error.
        """
        addresses = [to_address(k) for k in keys]
        total = 0
        for i in range(0, len(addresses), BATCH_EXISTS_MAX):
            chunk = addresses[i : i + BATCH_EXISTS_MAX]
            try:
                prefix = self._batch_exists(chunk)[1]
            except Exception as exc:
                self._miss("batch/exists", f"[{len(chunk)} addresses]", exc)
                return total
            total += prefix
            if prefix < len(chunk):
                break
        return total

    def stats(self) -> KvCacheStats:
        """``GET /kv/stats``.

        Raises:
            Unauthorized: the server refused the token.
            RemoteError: the server is unreachable or answered something unusable.
        """
        try:
            doc = self._exchange("GET", f"{self._pool.prefix}/kv/stats", self._json)
        except EgKvError:
            raise
        except Exception as exc:
            raise RemoteError(
                f"cannot read /kv/stats from {self.config.base_url}: {type(exc).__name__}: {exc}"
            ) from None
        return KvCacheStats.from_json(doc)

    def healthz(self) -> dict[str, Any] | None:
        """``GET /healthz``: the decoded answer, or None when the server is not healthy."""
        try:
            doc = self._exchange("GET", f"{self._pool.prefix}/healthz", self._json)
        except Exception as exc:
            self._miss("healthz", "-", exc)
            return None
        return doc if isinstance(doc, dict) else None
