"""What an engine's KV bytes depend on besides the tokens: one binding that every path
which loads bytes into an engine mixes into its addresses (EgKvConnector and EgKvTier for
vLLM, the LMCache in-engine plugin and L2 adapter), so two engines whose KV for the same
tokens would differ never share one.

The binding holds the model's name and revision, the identity of its weights (the hub
commit vLLM loaded, or, for a local directory, a digest of its weight files' names, sizes
and modification times: two checkpoints served from one path at two times differ), the
KV cache's element type as allocated (``cache_dtype``, or the model's dtype when it is
``auto``: never the setting ``auto`` itself), the cache's quantization and the weights'.
It is built from vLLM's own config objects where a path runs inside vLLM
(:func:`binding_of`, :func:`current_binding`), else from what the path is told
(:func:`declared_binding`: the LMCache multiprocess server's adapter, a tier built outside
a worker). Block size, layout and the parallel ranks and sizes are each path's own format;
LoRA and the cache salt are per request. No vLLM import.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import xxhash

#: Files whose names, sizes and times make a local checkpoint's identity.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


@dataclasses.dataclass(frozen=True)
class EngineBinding:
    """What, besides the tokens and the layout, decides an engine's KV bytes.

    Attributes:
        model: the model's name or path.
        revision: its revision (``--revision``), "" when none was given.
        weights: the weights' identity: ``hub:<commit>``, ``files:<digest>`` for a local
            directory, or "" when neither is known.
        kv_dtype: the KV cache's element type as allocated (``bfloat16``, ``fp8``, ...).
        quantization: the weights' quantization method, "" when none.
    """

    model: str
    revision: str
    weights: str
    kv_dtype: str
    quantization: str

    def describe(self) -> str:
        """The binding as canonical JSON (what addresses mix in)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


def binding_of(vllm_config: Any) -> EngineBinding:
    """The binding of the engine ``vllm_config`` (vLLM's ``VllmConfig``) describes."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    return EngineBinding(
        model=str(model.model),
        revision=str(getattr(model, "revision", None) or ""),
        weights=weights_identity(model),
        kv_dtype=kv_element_dtype(model, cache),
        quantization=str(getattr(model, "quantization", None) or ""),
    )


def declared_binding(
    model: str, *, revision: str = "", weights: str = "", kv_dtype: str = "", quantization: str = ""
) -> EngineBinding:
    """The binding of an engine known only by what a path is told: ``model``, and the
    ``revision``, ``weights``, ``kv_dtype`` and ``quantization`` its settings declare.
    The weights' identity, when not declared, is what the model's name shows on this host
    (:func:`weights_of`)."""
    return EngineBinding(
        model=model,
        revision=revision,
        weights=weights or weights_of(model, revision),
        kv_dtype=kv_dtype.removeprefix("torch."),
        quantization=quantization,
    )


def kv_element_dtype(model_config: Any, cache_config: Any) -> str:
    """The KV cache's element type as vLLM allocates it: ``cache_dtype`` unless it is
    ``auto``, then the model's dtype (resolved by vLLM: ``--dtype auto`` is the
    checkpoint's)."""
    setting = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if setting != "auto":
        return setting
    return str(model_config.dtype).removeprefix("torch.")


def weights_identity(model_config: Any) -> str:
    """``hub:<commit>`` when vLLM loaded the model from the hub (the commit transformers
    recorded), ``files:<digest>`` for a local directory (its weight files' names, sizes
    and modification times: cheap, and two checkpoints written at one path differ), else
    ""."""
    commit = getattr(getattr(model_config, "hf_config", None), "_commit_hash", None)
    if commit:
        return f"hub:{commit}"
    path = str(getattr(model_config, "model_weights", "") or model_config.model)
    return weights_of(path, str(getattr(model_config, "revision", None) or ""))


def weights_of(name: str, revision: str = "") -> str:
    """The weights' identity from a model's name alone (what the tier sees): a local
    directory's files (:func:`weights_identity`), or the commit the local Hugging Face
    cache holds for ``name`` at ``revision`` (offline: its ``refs`` file), else ""."""
    if not os.path.isdir(name):
        return _hub_commit(name, revision)
    path = name
    digest = xxhash.xxh3_128()
    found = False
    try:
        names = sorted(os.listdir(path))
    except OSError:  # not this process's to read (another user's): no identity known
        return ""
    for name in names:
        if not name.endswith(WEIGHT_SUFFIXES):
            continue
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:  # a dangling link (a snapshot whose blob went), a file going away
            continue
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        found = True
    return f"files:{digest.hexdigest()}" if found else ""


def _hub_commit(name: str, revision: str) -> str:
    """``hub:<commit>`` the local Hugging Face cache records for ``name`` at ``revision``
    (``main`` when none), read from its ``refs`` file; "" when it holds none."""
    if name.count("/") != 1:
        return ""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return ""
    refs = os.path.join(HF_HUB_CACHE, "models--" + name.replace("/", "--"), "refs")
    try:
        with open(os.path.join(refs, revision or "main")) as f:
            commit = f.read(64).strip()
    except OSError:
        # A revision that is itself a commit has no ref: it names the weights already.
        return f"hub:{revision}" if len(revision) == 40 else ""
    return f"hub:{commit}" if commit else ""


def current_binding(model_name: str) -> EngineBinding | None:
    """The binding of the engine vLLM is setting up now (its current config), when that
    config serves ``model_name``; None when vLLM has none current (a caller built outside
    an engine, as a test may)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # an older vLLM
        return None
    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None)
    if model is None or str(model.model) != model_name:
        return None
    return binding_of(config)
