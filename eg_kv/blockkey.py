"""The engines' block key: a keyed MAC over (address, bytes) that only engines hold.

A block checksum (:mod:`eg_kv.checksum`) proves a block's bytes are the bytes stored; it
cannot say who stored them. With a block key set in the engines' environment
(:data:`ENV_BLOCK_KEY`, or a file named by :data:`ENV_BLOCK_KEY_FILE`), every block a
project client stores carries :data:`OVERHEAD` more bytes: a random salt before its bytes
and a MAC tag after them, over the block's address and bytes, under a key drawn from the
secret and the salt. Every load checks them and hands on only the bytes between. A token
holder without the key, or a server that lies, can make a load miss, never load: forged
bytes fail the tag. The key is never sent to the server, never logged, never in a repr.

Layout of a keyed block, and its tag::

    +-----------+---------------------------+-----------+
    | salt (16) |   bytes (what was stored) |  tag (16) |
    +-----------+---------------------------+-----------+

    block key   K   = BLAKE3-derive-key("eg-kv 2026-12 block key v1", secret)   32 bytes
    block's key K_s = BLAKE3-keyed(K, salt)                                   32 bytes
    tag             = GMAC(AES-256 K_s, nonce 0^96,
                           len(address) as u16 LE || address || bytes)        16 bytes

Why GMAC (AES-GCM with no plaintext, from ``cryptography``): a real MAC at 26-37 GB/s on
one core here (AES-NI and carry-less multiply), against 7.7 GB/s for keyed BLAKE3 and
0.7-0.8 for keyed BLAKE2b (``scripts/bench_integrity.py``), and it lets go of the GIL. Each
block has a key of its own, drawn from a fresh 128-bit salt: a fixed nonce is then used
once per key (GCM's one rule), with no limit on blocks per secret (random 96-bit nonces
under one key would allow 2^32). The salt comes first so a load checks the tag as the
bytes arrive, in one pass. Without a key a block is its bytes alone, so a keyed and an
unkeyed engine read each other's blocks as misses (another length), never as data.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .errors import ConfigError, NotFound

log = logging.getLogger("eg_kv.blockkey")

#: The secret, in the engines' environment only (never the server's).
ENV_BLOCK_KEY = "EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY"
#: A file holding the secret (its bytes, surrounding whitespace stripped).
ENV_BLOCK_KEY_FILE = "EPISTEMIC_GRAPH_KVCACHE_BLOCK_KEY_FILE"
#: Bytes of the salt before a keyed block's bytes.
SALT = 16
#: Bytes of the tag after them.
TAG = 16
#: What a block key adds to each block.
OVERHEAD = SALT + TAG
#: The shortest secret accepted (bytes): a guessable key is no key.
SECRET_MIN = 16
_CONTEXT = "eg-kv 2026-12 block key v1"
#: GCM's nonce: each block's key is its own, so one fixed nonce is used once per key.
_NONCE = bytes(12)
_T = TypeVar("_T")


class ForgedBlock(NotFound):
    """A block whose tag does not match its address and bytes under this engine's key:
    not stored by a holder of the key (a forger, a lying server, another fleet): a miss."""


class Opening:
    """One keyed block being read, in order: :attr:`salt` (read into it), then
    :meth:`begin`, the bytes (each piece to :meth:`update`), then :attr:`tag` (read into
    it) and :meth:`check`. A load's bytes are handed on only once :meth:`check` passed."""

    __slots__ = ("_address", "_key", "_mac", "data_length", "salt", "tag")

    def __init__(self, key: BlockKey, address: str, length: int) -> None:
        """Args:
            length: the stored block's whole length (salt and tag included).

        Raises:
            ForgedBlock: too short to hold a salt and a tag.
        """
        if length < OVERHEAD:
            raise ForgedBlock(f"a block of {length} bytes holds no {OVERHEAD}-byte salt and tag")
        self._key, self._address = key, address
        self._mac: Any = None
        self.salt, self.tag = bytearray(SALT), bytearray(TAG)
        self.data_length = length - OVERHEAD

    def begin(self) -> None:
        """The salt is in: start the block's MAC."""
        self._mac = self._key.mac(self._address, self.salt)

    def update(self, view: Any) -> None:
        self._mac.authenticate_additional_data(view)

    def check(self) -> None:
        """Raises:
        ForgedBlock: the tag is not the tag of the salt, address and bytes read."""
        self._key.check(self._mac, self.tag)


class BlockKey:
    """A derived block key. Its repr never shows it.

    Args:
        secret: the shared secret (at least :data:`SECRET_MIN` bytes).

    Raises:
        ConfigError: the secret is too short.
    """

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_MIN:
            raise ConfigError(
                f"the block key must be at least {SECRET_MIN} bytes (e.g. `openssl rand -hex "
                f"32`), not {len(secret)}"
            )
        self._key = blake3.blake3(secret, derive_key_context=_CONTEXT).digest()

    def __repr__(self) -> str:
        return "BlockKey(<hidden>)"

    def mac(self, address: str, salt: Any) -> Any:
        """A running MAC of the block stored under ``address`` with ``salt``: feed its
        bytes to ``authenticate_additional_data``, then :meth:`tag_of`."""
        own = blake3.blake3(salt, key=self._key).digest()
        running = Cipher(algorithms.AES(own), modes.GCM(_NONCE)).encryptor()
        raw = address.encode("ascii")
        running.authenticate_additional_data(len(raw).to_bytes(2, "little") + raw)
        return running

    @staticmethod
    def tag_of(running: Any) -> bytes:
        running.finalize()
        return bytes(running.tag)

    def seal(self, address: str, parts: Iterable[Any]) -> tuple[bytes, bytes]:
        """The salt to store before the concatenation of ``parts`` under ``address``, and
        the tag to store after it."""
        salt = os.urandom(SALT)
        running = self.mac(address, salt)
        for part in parts:
            running.authenticate_additional_data(part)
        return salt, self.tag_of(running)

    def opening(self, address: str, length: int) -> Opening:
        """The check of a keyed block of ``length`` bytes read under ``address``.

        Raises:
            ForgedBlock: too short to hold a salt and a tag.
        """
        return Opening(self, address, length)

    def keyed(self, address: str, sink: Callable[..., _T]) -> Callable[..., _T]:
        """Wrap a load's ``sink(length, read_exact)``: the sink is handed the block's
        bytes without the salt and tag, and the tag is checked once they are read.

        Raises (from the wrapped sink):
            ForgedBlock: shorter than a salt and a tag, or the tag does not match.
        """

        def keyed_sink(length: int, read_exact: Callable[[memoryview], None]) -> _T:
            opening = self.opening(address, length)
            read_exact(memoryview(opening.salt))
            opening.begin()

            def read_data(view: memoryview) -> None:
                read_exact(view)
                opening.update(view)

            result = sink(opening.data_length, read_data)
            read_exact(memoryview(opening.tag))
            opening.check()
            return result

        return keyed_sink

    def check(self, running: Any, tag: Any) -> None:
        """Raises:
        ForgedBlock: ``tag`` is not the tag of what ``running`` hashed."""
        if not hmac.compare_digest(self.tag_of(running), bytes(tag)):
            raise ForgedBlock("its tag does not match: not stored by a holder of the block key")

    def open(self, address: str, block: bytes) -> bytes:
        """A whole keyed block's bytes, its tag checked, its salt and tag cut off.

        Raises:
            ForgedBlock: see :meth:`keyed`.
        """
        view = memoryview(block)
        opening = self.opening(address, len(view))
        opening.salt[:] = view[:SALT]
        opening.begin()
        data = view[SALT:-TAG]
        opening.update(data)
        opening.tag[:] = view[-TAG:]
        opening.check()
        return bytes(data)


def from_env(env: Mapping[str, str] | None = None) -> BlockKey | None:
    """The block key the environment names: :data:`ENV_BLOCK_KEY` (the secret itself),
    else :data:`ENV_BLOCK_KEY_FILE` (a file holding it); None: no key.

    Raises:
        ConfigError: both are set, the file cannot be read, or the secret is too short.
    """
    env = os.environ if env is None else env
    value, path = env.get(ENV_BLOCK_KEY), env.get(ENV_BLOCK_KEY_FILE)
    if value and path:
        raise ConfigError(f"set {ENV_BLOCK_KEY} or {ENV_BLOCK_KEY_FILE}, not both")
    if path:
        return from_file(path)
    return BlockKey(value.strip().encode()) if value else None


def from_file(path: str) -> BlockKey:
    """The block key held in file ``path`` (surrounding whitespace stripped).

    Raises:
        ConfigError: it cannot be read, or holds too short a secret.
    """
    try:
        with open(path, "rb") as f:
            secret = f.read(4096).strip()
    except OSError as e:
        raise ConfigError(f"cannot read the block key file {path}: {e.strerror}") from None
    return BlockKey(secret)


_said: list[bool] = [False]


def say_once(key: BlockKey | None) -> None:
    """Log, once per process, what the engine's loads can detect (the key never shown)."""
    if _said[0]:
        return
    _said[0] = True
    if key is not None:
        log.info("eg-kv: block key set: each block is tagged (GMAC); forged ones are misses")
    else:
        log.warning(
            "eg-kv: no block key (%s): loads catch corrupted bytes (checksums), not forged "
            "ones: another writer of this namespace, or a lying server, could have this "
            "engine load its KV; set a key shared by the engines only (docs/security.md)",
            ENV_BLOCK_KEY,
        )
