"""The rules that turn answers into hits or misses, and keys into addresses: pure
functions both clients call (:mod:`eg_kv.client.core`'s docstring lists the rules against
a far end that cannot be trusted)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .. import wire
from ..address import address_for_key, all_valid, validate
from ..checksum import Running as RunningChecksum
from ..checksum import encode as encode_checksum
from ..checksum import of as checksum_of
from ..errors import InvalidAddress, RemoteError, Unauthorized
from ..wire import BATCH_EXISTS_MAX

# The content types the connectors send, re-exported for them (defined in eg_kv.wire).
from ..wire import BLOCK_TYPE as BLOCK_TYPE
from ..wire import JSON_TYPE as JSON_TYPE

T = TypeVar("T")
_CHECKSUM_NAME = wire.CHECKSUM_HEADER.encode("ascii")

#: Largest non-block answer read (JSON, error lines). The largest real one, a batch answer
#: for 1024 addresses, is about 7 KiB.
SMALL_ANSWER_MAX = 1024 * 1024
#: PUT bodies larger than this ask ``Expect: 100-continue`` first, so a server that
#: answers from the head alone (a dedup hit, a refusal) is not sent the body.
EXPECT_CONTINUE_MIN = 64 * 1024


class PoolWaitTimeout(RemoteError):
    """No pooled connection of this client freed up within the timeout: the client is
    busy, not the server unreachable (deliberately not an OSError, so a server set does
    not mark a live member down for it)."""


class Miss(Exception):
    """Internal to the clients: the answer cannot be used (a miss, never raised to users)."""


class ProbeUnanswered(Miss):
    """A call's inline probe of where the server's slab is got no answer (it timed out,
    was refused, or waited for our full pool): the call is a miss, its own request not
    sent (it would have waited as long again: a call took two whole timeouts)."""


class OutOfStep(Miss):
    """A block answer echoes another address than the one asked
    (:data:`~eg_kv.wire.ADDRESS_HEADER`): the connection's answers are out of step with its
    requests (a server or proxy sent one unasked). A miss; the connection is closed."""


def check_echo(address: str, echoed: bytes | str | None, method: str = "GET") -> None:
    """Check that a block answer is for ``address``, by the address it echoes (None: a
    server that echoes none, which predates the header: nothing to check).

    Raises:
        OutOfStep: it echoes another address.
    """
    if echoed is None:
        return
    if isinstance(echoed, bytes):
        echoed = echoed.decode("latin-1")
    if echoed != address:
        raise OutOfStep(
            f"the answer to {method} {address[:80]} is for {echoed[:80]!r}: a server or proxy "
            "sent an answer nobody asked for; the connection is dropped"
        )


def status_answer(method: str, address: str, status: int, echoed: bytes | str | None) -> int:
    """The status of ``method`` on ``/kv/<addr>``; a ``HEAD``'s ``200`` echoes the address.

    Raises:
        OutOfStep: a ``HEAD``'s ``200`` that echoes another address (an answer out of step:
            another block, not this one, is resident).
    """
    if method == "HEAD" and status == 200:
        check_echo(address, echoed, "HEAD")
    return status


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


class DeadlineSpent(TimeoutError):
    """A request ran out of a short deadline its caller gave it (what was left of a
    batch's): the caller's miss, no sign that the server is down (a set keeps it up)."""


#: A request that timed out with less than this share of the config's ``timeout_s`` ran
#: out of its caller's deadline (:func:`own_deadline`); with more, the server was slow.
OWN_DEADLINE_SHARE = 0.5


def own_deadline(timeout_s: float | None, config_s: float) -> bool:
    """Whether a request that timed out with ``timeout_s`` (None: the config's
    ``config_s``) ran out of its caller's deadline, not of the server's time to answer:
    a GET sent with 25 ms left of a batch marked a healthy member of a set down (its
    blocks then placed elsewhere: every caller's misses) until a probe passed."""
    return timeout_s is not None and timeout_s < config_s * OWN_DEADLINE_SHARE


def capped(timeout_s: float | None, config_s: float) -> float | None:
    """A call's own deadline (``timeout_s``: what is left of an engine's batch), never
    longer than the config's ``config_s``; None: the config's."""
    return None if timeout_s is None else min(timeout_s, config_s)


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


def leading_hits(found: list[bool]) -> int:
    """How many of ``found``, from the first, are True without a gap."""
    try:
        return found.index(False)
    except ValueError:
        return len(found)


def exists_answer(address: str, doc: Any) -> bool:
    """The ``exists`` boolean of a ``GET /kv/<addr>/exists`` answer, which names the
    address asked in ``"hash"``.

    Raises:
        Miss: the answer holds no boolean ``exists``.
        OutOfStep: it names another address (an answer out of step).
    """
    found = doc.get("exists") if isinstance(doc, dict) else None
    if not isinstance(found, bool):
        raise Miss("no boolean 'exists' in the answer")
    named = doc.get("hash")
    check_echo(address, named if isinstance(named, str) else None, "exists")
    return found


# --------------------------------------------------------------------------- rules


#: Headers that make a read change state: a lookup that leases its hits, a GET that
#: ends a lease (as the clients spell them; the raw form for the sync client's heads).
_LEASE, _RELEASE = wire.LEASE_HEADER, wire.RELEASE_HEADER
_LEASE_RAW, _RELEASE_RAW = _LEASE.encode() + b":", _RELEASE.encode() + b":"


def may_resend(method: str, target: str, headers: bytes | Mapping[str, str] | None = None) -> bool:
    """Whether a request may go out again after its connection failed mid-exchange.

    Only requests that change nothing: ``GET``, ``HEAD`` and the batch existence probe
    (a ``POST`` that only reads). A ``PUT`` or ``DELETE`` whose head went out may have
    been applied (a ``DELETE`` sent twice releases two references), so it is a miss; so
    is a read with a lease header (``headers``: raw header lines or a mapping): a lookup
    sent twice leased its hits twice, a GET sent twice ended two of the caller's leases.
    """
    if headers:  # (a test per header, not a loop: this runs for every request)
        if isinstance(headers, bytes):
            if _LEASE_RAW in headers or _RELEASE_RAW in headers:
                return False
        elif _LEASE in headers or _RELEASE in headers:
            return False
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
    except (ValueError, RecursionError):  # (nested too deep)
        raise Miss("the answer is not JSON") from None
