"""What the sync and the async client share: everything that does no I/O.

:mod:`eg_kv.client.sync` (standard library, :mod:`eg_kv.client.http11`) and
:mod:`eg_kv.client.aio` (aiohttp) differ only in how bytes move; what they decide is
written once, the way httpx's clients share ``BaseClient``:

* :mod:`eg_kv.client.settings`: the config, built once;
* :mod:`eg_kv.client.rules`: keys to addresses, and answers to hits or misses;
* this module: :class:`ClientCore`, a connector's state (request heads, checksums and the
  block key, leases, reads of the slab on the server's host, warnings) and
  :class:`OneServer`, the base of both single-server connectors;
* :mod:`eg_kv.client.plans`: the calls that take several requests.

The rules against a far end that cannot be trusted (a broken server, a proxy, an attacker
on the path), kept alike in both clients by living there:

* only a final answer counts (interim ``1xx`` answers are skipped by the transports);
* a block answer is read only when it is ``200``, unencoded, and framed by a
  ``Content-Length`` no larger than ``max_block_size``; anything else is a miss before a
  byte is allocated. Other answers (JSON, error lines) are read up to
  :data:`~eg_kv.client.rules.SMALL_ANSWER_MAX`;
* redirects are never followed: a ``3xx`` is a miss;
* a request that changes state (``PUT``, ``DELETE``) is never sent twice
  (:func:`~eg_kv.client.rules.may_resend`).
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

from .. import wire
from ..blockkey import ForgedBlock, forged_failures
from ..checksum import HASH_PIECE, ChecksumMismatch, ChecksumMissing, Failures, Verifier
from ..checksum import decode as decode_checksum
from ..errors import ConfigError, RemoteError, Unauthorized
from ..procs import after_fork_in_child
from ..slab.local import LocalSlab, LocalUnavailable
from ..slab.view import BlockReader
from ..wire import AUTHORIZATION, BLOCK_PREFIX

# The content types the connectors send, re-exported for them (defined in eg_kv.wire).
from ..wire import BLOCK_TYPE as BLOCK_TYPE
from ..wire import JSON_TYPE as JSON_TYPE
from .localreads import LocalReads
from .rules import DeadlineSpent, OutOfStep, ProbeUnanswered
from .settings import ACCEPT_IDENTITY, KvCacheConfig, resolve_config

T = TypeVar("T")
_CHECKSUM_NAME = wire.CHECKSUM_HEADER.encode("ascii")

log = logging.getLogger("eg_kv.kvcache")

#: What :meth:`ClientCore.local_fetch` returns when a read must go over HTTP.
OVER_HTTP: Any = object()


#: Hits answered unleased a client remembers (:meth:`ClientCore.note_unleased`).
UNLEASED_MAX = 65536


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
        self._warned: set[str] = set()
        #: Called with each transport error (refused, reset, timed out) of this
        #: connector: a server set marks the member down (:mod:`eg_kv.client.sets`).
        self.on_unreachable: Callable[[BaseException], None] | None = None
        #: Reads from the server's slab when this client is on its host.
        self.local = LocalReads(config.local_reads)
        #: Whether block answers' checksums are checked: off to measure them
        #: (``verify_checksums``), and with a block key, whose tag checks every byte the
        #: checksum would (and the address): one check per block, not two.
        self.checks_checksums = config.verify_checksums and config.block_key is None
        #: Blocks whose bytes failed their checksum (a miss each), logged once per address.
        self.checksum_failures = Failures("client")
        #: Blocks whose block-key tag failed (forged: a miss each), logged once per address.
        self.forged_blocks = forged_failures("client")
        #: Batch lookups go in the compact format until a server refuses it (then JSON).
        self.compact_batches = True
        #: Hits answered unleased (a lease cap), by address: their releases are not sent.
        self._unleased: dict[str, int] = {}
        self._unleased_lock = threading.Lock()
        after_fork_in_child(self)

    def after_fork_in_child(self) -> None:
        """A new lock in a forked child: a parent's thread may have held it at the fork."""
        self._unleased_lock = threading.Lock()

    @property
    def probes_inline(self) -> bool:
        """Whether a call asks the server where its slab is before its own request, when
        that is due (:class:`LocalReads`). Not a set's member (it reports its transport
        errors): a member that accepts and never answers cost a get two timeouts, the
        probe's then the request's, where a set promises one; its probe runs beside."""
        return self.on_unreachable is None

    def probed(self, failure: BaseException | None) -> None:
        """After a call's inline probe, which ended in ``failure`` (None: answered).

        Raises:
            ProbeUnanswered: it got no answer (logged): the call's miss.
        """
        if failure is not None:
            raise ProbeUnanswered(f"no answer to where the slab is ({type(failure).__name__})")

    def _unreachable_hook(self, exc: BaseException) -> None:
        if (
            self.on_unreachable is not None
            and isinstance(exc, OSError)
            and not isinstance(exc, DeadlineSpent)
        ):
            # TimeoutError and ConnectionError are OSErrors; PoolWaitTimeout (our own
            # pool was full) is not one, nor is a timeout of the caller's own short
            # deadline (DeadlineSpent): the member did nothing wrong.
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
        elif isinstance(exc, ChecksumMissing):
            self.checksum_failures.add()
            self._warn_once("checksum", "%s: every such load is a miss; does a proxy drop "
                            "the X-Eg-Kv-* headers?", exc)  # fmt: skip
        elif isinstance(exc, ChecksumMismatch):
            self.checksum_failures.record(address, str(exc))
        elif isinstance(exc, OutOfStep):
            self._warn_once("step", "%s (a miss; warned once)", exc)
        elif isinstance(exc, ForgedBlock):
            self.forged_blocks.record(address, str(exc))
        self._unreachable_hook(exc)
        log.debug("eg-kv %s %s: miss (%s: %s)", what, address, type(exc).__name__, exc)

    def checked(
        self, checksum: bytes | str | None, sink: Callable[..., T], length: int,
        read_exact: Callable[[memoryview], None],
    ) -> T:  # fmt: skip
        """``sink(length, read_exact)``, its bytes checked against ``checksum`` (a block
        answer's :data:`~eg_kv.wire.CHECKSUM_HEADER`; None: a miss) unless
        :attr:`checks_checksums` is off.

        Raises:
            ChecksumMismatch: the bytes are not the block's (the caller's miss).
            BadRequest: the header is not a checksum (a miss too).
            Exception: what ``sink`` raises.
        """
        expected = self._expected(checksum)
        if expected is None:
            return sink(length, read_exact)
        verifier = Verifier(expected, read_exact, HASH_PIECE)
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
        salt, tag = key.seal(address, views)
        return [memoryview(salt), *views, memoryview(tag)]

    def opened(self, address: str, block: bytes) -> bytes:
        """A whole block read, its block-key tag checked and cut off (with a key).

        Raises:
            ForgedBlock: see :meth:`eg_kv.blockkey.BlockKey.keyed`.
        """
        key = self.config.block_key
        return block if key is None else key.open(address, block)

    def verifier(self, checksum: bytes | str | None) -> Verifier | None:
        """A :class:`~eg_kv.checksum.Verifier` of a block answer's bytes, from its
        :data:`~eg_kv.wire.CHECKSUM_HEADER`; None: nothing to check (:attr:`checks_checksums`
        off).

        Raises:
            BadRequest: the header is not a checksum (the caller's miss).
        """
        expected = self._expected(checksum)
        return None if expected is None else Verifier(expected)

    def _expected(self, checksum: bytes | str | None) -> int | None:
        """The checksum a block answer's header gives, None when there is nothing to
        check (:attr:`checks_checksums` off).

        Raises:
            BadRequest: the header is not a checksum. ChecksumMismatch: there is none
                (every eg-kv server sends one: a proxy that drops it, or a server that
                is not eg-kv, is a miss, counted, not bytes taken unchecked).
        """
        if not self.checks_checksums:
            return None
        if checksum is None:
            raise ChecksumMissing(f"the block answer carries no {wire.CHECKSUM_HEADER}")
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
        # A miss its disk tier may hold is the server's to answer.
        return OVER_HTTP if got is None and slab.disk_may_hold((address,)) else got

    def local_copy(
        self, slab: LocalSlab, reader: BlockReader, address: str, sink: Callable[..., Any]
    ) -> Any:
        """``sink``'s result for ``reader`` (from :meth:`local_open`), None on a miss, or
        :data:`OVER_HTTP`. Any thread may run it; never raises."""
        return self._locally(address, slab.copy_out, reader, sink, self.checks_checksums)

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
        return None if _disk_may_hold_misses(slab, addresses, found) else found

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
            if lease and lease_ms and _none_on_disk(slab, addresses):
                found = slab.lease_addresses(addresses, lease_ms)
                if found is not None:
                    return found
            found = slab.exists_addresses(addresses)
        except LocalUnavailable as exc:
            self.local.step_aside(exc)
            return None
        # Hits to lease are the server's to lease; misses its disk tier may hold, its to answer.
        if (lease and any(found)) or _disk_may_hold_misses(slab, addresses, found):
            return None
        return found

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

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        """Warn of ``kind`` once per connector (so once per server): what a server or the
        path to it does to every answer must not flood the engine's log."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("eg-kv at %s: " + message, self.config.base_url, *args)

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


class OneServer:
    """What both single-server connectors share besides their transport: building from a
    config or keywords (one server only), their :class:`ClientCore` (``_core``), their
    ``repr`` (never the token), and what they report of loads that failed a check."""

    config: KvCacheConfig
    _core: ClientCore

    def _start(
        self, config: KvCacheConfig | None, settings: dict[str, Any],
        on_unreachable: Callable[[BaseException], None] | None, set_names: str,
    ) -> None:  # fmt: skip
        """Resolve the config and make the core.

        Raises:
            ConfigError: a setting cannot be used, or it names a server set (which
                ``set_names`` serve).
        """
        self.config = resolve_config(config, settings)
        if not self.config.single:
            raise ConfigError(
                f"{type(self).__name__} serves one server; a server set needs {set_names}"
            )
        self._core = ClientCore(self.config)
        self._core.on_unreachable = on_unreachable

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.base_url!r})"

    @property
    def checksum_failures(self) -> int:
        """Blocks this client read whose bytes failed their checksum (each a miss)."""
        return self._core.checksum_failures.count

    @property
    def forged_blocks(self) -> int:
        """Blocks this client read whose block-key tag failed (each a miss)."""
        return self._core.forged_blocks.count


def _misses(addresses: list[str], found: list[bool]) -> list[str]:
    """The addresses a local lookup did not find."""
    return [a for a, hit in zip(addresses, found, strict=True) if not hit]


def _disk_may_hold_misses(slab: LocalSlab, addresses: list[str], found: list[bool]) -> bool:
    """Whether the server's disk tier may hold a miss of a local lookup (then the server
    answers the lookup); the misses are listed only where it has a disk tier."""
    return slab.info.disk and slab.disk_may_hold(_misses(addresses, found))


def _none_on_disk(slab: LocalSlab, addresses: list[str]) -> bool:
    """Whether no address the local slab misses may be on its server's disk tier (a
    leasing lookup is answered locally only then: a block the disk holds is the server's
    to promote and lease). A block evicted to disk between this look and the lease is
    a miss, as a block evicted a moment before the lookup would be."""
    return not slab.info.disk or not slab.disk_may_hold(
        _misses(addresses, slab.exists_addresses(addresses))
    )
