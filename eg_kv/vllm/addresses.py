"""Block addresses for vLLM's KV cache: a chain hash of the token ids, bound to what
changes the bytes.

A vLLM block of ``block_size`` tokens is one eg-kv block holding the KV of every layer
(of one KV shard: a tensor- and pipeline-parallel rank). Its address is

* the **token chain**: ``d_i = blake2b(d_{i-1} || tokens of block i as int32 LE)``, from a
  root that binds what else the request's KV depends on for the same tokens (a cache salt,
  a LoRA adapter): so block ``i``'s digest names the whole prefix up to it;
* mixed with the **format** (:class:`BlockFormat`): model, KV dtype, block size, KV
  layout, parallel sizes, the shard's rank, the engine's binding (revision, weights,
  element type as allocated, quantization: :mod:`eg_kv.binding`) and
  :data:`FORMAT_VERSION`: two engines whose bytes for the same tokens would differ never
  share an address.

Everything here is plain ``hashlib`` over explicit byte encodings: the same in every
process and on every host, whatever ``PYTHONHASHSEED`` (never Python's ``hash()``, which
vLLM's default block hash may use). No vLLM import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

from ..address import validate
from ..binding import binding_of

#: Bumped whenever the bytes of a stored block change meaning (its layout, its header).
FORMAT_VERSION = 2  # 2: the engine's binding (eg_kv.binding)
#: What every token chain starts from (with the request's own extras mixed in).
_CHAIN_ROOT = b"eg-kv/vllm/token-chain/1"
#: Addresses read ``egv<version>-<40 hex digits>``: valid eg-kv addresses (eg_kv.address).
ADDRESS_PREFIX = f"egv{FORMAT_VERSION}-"
_DIGEST = 32
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """What, besides the tokens, decides a stored block's bytes.

    Attributes:
        model: the model's name or path (and revision, when one is given).
        dtype: the KV cache's element type (``bfloat16``, ``fp8_e4m3``, ...).
        block_size: tokens per vLLM block.
        layout: the KV layout of one block as this shard stores it: each layer's name,
            per-block shape and element type, in the order they are concatenated (the
            connector's worker writes it; the scheduler learns it through vLLM's
            handshake).
        tp_size: tensor-parallel world size.
        pp_size: pipeline-parallel world size.
        binding: the engine's :class:`~eg_kv.binding.EngineBinding`, described
            (canonical JSON): revision, weights, KV element type, quantization.
    """

    model: str
    dtype: str
    block_size: int
    layout: str
    tp_size: int = 1
    pp_size: int = 1
    binding: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tp_size and pp_size must be at least 1")

    @property
    def shards(self) -> int:
        """How many KV shards (ranks) hold one block's KV: ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    def shard_of(self, tp_rank: int, pp_rank: int = 0) -> int:
        """A rank's shard index (``pp_rank * tp_size + tp_rank``)."""
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size):
            raise ValueError(
                f"rank tp={tp_rank} pp={pp_rank} is outside tp_size={self.tp_size} "
                f"pp_size={self.pp_size}"
            )
        return pp_rank * self.tp_size + tp_rank

    def salt(self, shard: int) -> bytes:
        """The digest every address of ``shard`` mixes in (canonical JSON, hashed)."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} is outside 0..{self.shards - 1}")
        doc = {**dataclasses.asdict(self), "shard": shard, "version": FORMAT_VERSION}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode("utf-8"), digest_size=_DIGEST).digest()


def chain_root(extras: Sequence[str] = ()) -> bytes:
    """The chain's starting digest: the fixed root, with ``extras`` (a request's cache
    salt, its LoRA adapter: anything that changes its KV for the same tokens) mixed in."""
    h = hashlib.blake2b(_CHAIN_ROOT, digest_size=_DIGEST)
    for extra in extras:
        raw = extra.encode("utf-8")
        h.update(struct.pack("<Q", len(raw)))
        h.update(raw)
    return h.digest()


def token_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extras: Sequence[str] = (),
    max_blocks: int | None = None,
    known: Sequence[bytes] = (),
) -> list[bytes]:
    """One digest per WHOLE block of ``token_ids`` (a partial last block has none).

    Block ``i``'s digest hashes block ``i - 1``'s digest and block ``i``'s token ids as
    little-endian int32, so it names the whole prefix ``token_ids[: (i + 1) * block_size]``.

    Args:
        max_blocks: stop after this many blocks.
        known: the chain's first digests, already computed for these tokens (a request
            that grew): they are kept and only the blocks after them are hashed.

    Raises:
        ValueError: a token id outside ``0 .. 2**31 - 1``, or ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max(0, max_blocks))
    pack = struct.Struct(f"<{block_size}i").pack
    out: list[bytes] = list(known[:count])
    parent = out[-1] if out else chain_root(extras)
    for i in range(len(out), count):
        block = token_ids[i * block_size : (i + 1) * block_size]
        try:
            raw = pack(*block)
        except struct.error as exc:
            raise ValueError(f"token ids must lie in 0..{_INT32_MAX}: {exc}") from None
        if min(block) < 0:
            raise ValueError(f"token ids must lie in 0..{_INT32_MAX}: got {min(block)}")
        h = hashlib.blake2b(parent, digest_size=_DIGEST)
        h.update(raw)
        parent = h.digest()
        out.append(parent)
    return out


def block_address(digest: bytes, salt: bytes) -> str:
    """The eg-kv address of one block: its chain digest mixed with a shard's salt."""
    address = ADDRESS_PREFIX + hashlib.blake2b(salt + digest, digest_size=20).hexdigest()
    validate(address)
    return address


def block_addresses(chain: Sequence[bytes], fmt: BlockFormat, shard: int = 0) -> list[str]:
    """The addresses of ``chain``'s blocks as ``shard`` stores them."""
    salt = fmt.salt(shard)
    return [block_address(d, salt) for d in chain]


def lookup_addresses(chain: Sequence[bytes], formats: Sequence[BlockFormat]) -> list[str]:
    """Every shard's address of every block, block by block (``len(formats)`` per block),
    for one prefix lookup: a block counts only when every shard holds it, so the stored
    prefix is ``contains_prefix(lookup_addresses(...)) // len(formats)`` whole blocks.

    Args:
        formats: each shard's format, by shard index (their layouts may differ: pipeline
            stages hold different layers).
    """
    salts = [fmt.salt(shard) for shard, fmt in enumerate(formats)]
    return [block_address(d, salt) for d in chain for salt in salts]


def connector_format(vllm_config: Any, layout: Sequence[str], kv_dtype: str) -> BlockFormat:
    """EgKvConnector's :class:`BlockFormat` for an engine: its model (``name@revision``),
    the KV tensors' element type and layout as registered (``layout``: one
    ``name:shape:dtype`` per layer), vLLM's block size, the parallel sizes, and the
    engine's binding."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    revision = getattr(model, "revision", None)
    return BlockFormat(
        model=f"{model.model}@{revision}" if revision else str(model.model),
        dtype=kv_dtype,
        block_size=int(vllm_config.cache_config.block_size),
        # The row, then its address's tag (eg_kv.vllm.trailers): blocks stored before it
        # had none, and are other addresses (their length would have refused the new ones).
        layout=";".join([*layout, "tag:xxh3-128"]),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        binding=binding_of(vllm_config).describe(),
    )
