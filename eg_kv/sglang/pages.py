"""SGLang's host-pool pages as eg-kv blocks: what a page's block holds, and its address.

A page is ``page_size`` tokens of every layer of one rank's KV, in SGLang's host memory
pool. Its block holds the page in SGLang's *flat page* order, whatever the pool's layout::

    MHA   [ K: layer 0 .. L-1 ][ V: layer 0 .. L-1 ]   a layer: page_size x heads x head_dim
    MLA   [ layer 0 .. L-1 ]                           a layer: page_size x 1 x kv_cache_dim

``get_page_buffer_meta`` hands the page's pieces where they lie: ``[K, V]`` (page-first
layouts: each piece already every layer) or ``[K_0, V_0, K_1, V_1, ...]`` (layer-first)
for MHA, ``[page]`` or ``[layer_0, layer_1, ...]`` for MLA; :func:`page_views` puts the K
pieces before the V pieces, which is the flat order (``get_data_page``) in every layout,
so the legacy copy path stores the same bytes as the zero-copy one. Within K (and V) the
flat order is the pool's own, though: ``page_first`` keeps a page token by token (each
token's every layer: SGLang's buffer is ``(2, size, layers, ...)``), ``layer_first`` and
``page_first_direct`` layer by layer. So the order is part of the page's format (its
address): a ``layer_first`` engine and a ``page_first_direct`` one load each other's
pages, a ``page_first`` engine finds neither's (it would load their keys transposed).

The address of a page is a BLAKE2b digest of SGLang's key (its SHA-256 chain of the page's
tokens), keyed with a digest of the page's format (:class:`PageFormat`): the engine's binding
(:mod:`eg_kv.binding`: model, revision and weights where known, the KV element type,
quantization), the page's shape (page size, layers, heads, head dims) and byte order, MHA
or MLA, and the
rank whose slice of the KV the page is (tensor, pipeline and context parallel; not the
tensor rank for MLA, whose every tensor rank holds the same KV). No SGLang import.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ..binding import EngineBinding
from ..engine import ENGINE_HASH_MAX, EngineName, chained_names
from ..errors import ConfigError

#: Bumped whenever a page's block changes its byte order or meaning (2: the order named).
PAGE_FORMAT_VERSION = 2


@functools.lru_cache(maxsize=64)  # a pool has one or two piece lengths
def _array_type(nbytes: int) -> Any:
    """``c_ubyte * nbytes``, made once per length: ctypes keeps every array type it made,
    so a type per call would leak (LMCache #3767)."""
    return ctypes.c_ubyte * nbytes


def view_at(pointer: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``pointer`` (host pool memory): no copy."""
    return memoryview(_array_type(nbytes).from_address(pointer)).cast("B")


def page_views(
    pointers: Sequence[int], sizes: Sequence[int], pages: int, mla: bool
) -> list[list[memoryview]]:
    """Each page's pieces, in the block's (flat page) order, from ``get_page_buffer_meta``.

    Raises:
        ValueError: the pieces do not split evenly into ``pages`` pages.
    """
    if pages <= 0 or len(pointers) != len(sizes) or len(pointers) % pages:
        raise ValueError(f"{len(pointers)} buffer pieces for {pages} pages")
    per = len(pointers) // pages
    if not mla and per % 2:
        raise ValueError(f"an MHA page in {per} pieces: K and V come in pairs")
    views = list(map(view_at, pointers, sizes))
    out = []
    for n in range(pages):
        piece = views[n * per : (n + 1) * per]
        out.append(piece if mla else piece[0::2] + piece[1::2])  # every K, then every V
    return out


@dataclasses.dataclass(frozen=True)
class PageFormat:
    """What, besides SGLang's key, decides a page's bytes; :meth:`address` mixes it in.

    Attributes:
        binding: the engine's binding, described (:meth:`EngineBinding.describe`).
        mla: an MLA pool (one copy of the KV for every tensor rank).
        shape: the pool's page shape: page size, layers, heads, head dims.
        ranks: the parallel ranks and sizes whose slice of the KV this rank holds.
        page_bytes: the bytes of one page's block.
        order: how K (and V) lie in the block: ``token_major`` or ``layer_major``
            (:data:`LAYOUT_ORDER`).
    """

    binding: str
    mla: bool
    shape: tuple[tuple[str, int], ...]
    ranks: tuple[tuple[str, int], ...]
    page_bytes: int
    order: str = "token_major"

    def describe(self) -> str:
        """The format as canonical JSON."""
        fields = dataclasses.asdict(self)
        fields["version"] = PAGE_FORMAT_VERSION
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def _mac_key(self) -> bytes:
        return hashlib.blake2b(self.describe().encode(), digest_size=32).digest()

    @property
    def page_tokens(self) -> int:
        """Tokens in a page (0: the pool did not say)."""
        return dict(self.shape).get("page_size", 0)

    def address(self, key: str) -> str:
        """The eg-kv address of the page SGLang names ``key`` (the same on every host): a
        BLAKE2b-160 of the key, keyed with the format's digest (one short hash a key)."""
        digest = hashlib.blake2b(key.encode(), digest_size=20, key=self._mac_key)
        return "k" + digest.hexdigest()


def _engine_hash(key: str) -> bytes:
    """SGLang's key as bytes when it is the page's hash in hex (SHA-256: 64 digits)."""
    if 2 <= len(key) <= 2 * ENGINE_HASH_MAX and len(key) % 2 == 0:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(key)
    return b""


def engine_names(keys: list[str], page_tokens: int) -> list[EngineName]:
    """Each page's name as SGLang knows it, for the server's KV events: its key (the hash
    chained over its tokens), the key before it in the batch as its parent (SGLang's keys
    come in prefix order), and the page size in tokens. A key that is not hex: none."""
    return chained_names([_engine_hash(k) for k in keys], page_tokens)


#: The host pool's attributes that give a page's shape (those a pool has).
_SHAPE_ATTRS = ("page_size", "layer_num", "head_num", "head_dim", "v_head_dim",
                "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim")  # fmt: skip
#: The storage config's ranks that name an MLA page's slice (its tensor rank does not).
_MLA_RANKS = ("pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size", "dcp_rank", "dcp_size")
#: And an MHA page's: every rank, and how heads are split across tensor ranks.
_MHA_RANKS = ("tp_rank", "tp_size", *_MLA_RANKS, "tp_lcm_size", "should_split_heads")


def page_format(storage_config: Any, pool: Any, binding: EngineBinding) -> PageFormat:
    """The format of ``pool``'s pages (SGLang's host pool) on the rank ``storage_config``
    (SGLang's ``HiCacheStorageConfig``) describes.

    Raises:
        ConfigError: the pool's layout keeps a page's bytes in another order than the
            ones this format knows.
    """
    layout = str(getattr(pool, "layout", "page_first"))
    if layout not in SUPPORTED_LAYOUTS:
        raise ConfigError(
            f"eg-kv's SGLang backend reads host pools laid out as "
            f"{', '.join(SUPPORTED_LAYOUTS)}, not {layout!r}: set --hicache-mem-layout"
        )
    mla = bool(storage_config.is_mla_model)
    shape = tuple((a, int(getattr(pool, a))) for a in _SHAPE_ATTRS if getattr(pool, a, None))
    names = _MLA_RANKS if mla else _MHA_RANKS
    ranks = tuple((n, int(getattr(storage_config, n, 0) or 0)) for n in names)
    return PageFormat(
        binding=binding.describe(),
        mla=mla,
        shape=shape,
        ranks=ranks,
        page_bytes=_page_bytes(pool),
        order=LAYOUT_ORDER[layout],
    )


def _page_bytes(pool: Any) -> int:
    """The bytes of one page's block: what the zero-copy path reads of a page (its pieces
    from ``get_page_buffer_meta``), which pools with K and V of other head dims (MiMo-V2)
    give while their flat page (``get_dummy_flat_data_page``) raises; the flat page
    where the pieces cannot be had."""
    import torch  # SGLang's: the backend runs inside it

    try:
        _, sizes = pool.get_page_buffer_meta(torch.arange(int(pool.page_size)))
        return int(sum(sizes))
    except Exception:
        flat = pool.get_dummy_flat_data_page()
        return int(flat.numel() * flat.element_size())


#: Host pool layouts whose pages :func:`page_views` reads in the flat order, and the order
#: of K (and V) in that flat page: a token's every layer, or a layer's every token.
LAYOUT_ORDER = {"page_first": "token_major", "page_first_direct": "layer_major",
                "layer_first": "layer_major"}  # fmt: skip
SUPPORTED_LAYOUTS = tuple(LAYOUT_ORDER)
