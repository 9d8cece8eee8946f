#!/usr/bin/env python3
"""Build the tiny Llama model of scripts/e2e_vllm into a directory, with no download: the
model the CPU compose stack (services/vllm/compose.cpu.yml) serves.

    python scripts/tiny_model.py --out /models/tiny [--layers N] [--hidden N]

The recipe is e2e_vllm's own ``build_model`` (random bfloat16 weights, a BPE tokenizer
trained on the spot), loaded from that file (it has no ``.py`` suffix), so the stack and the
end-to-end check serve the same model; ``--layers`` and ``--hidden`` default to e2e_vllm's.
The model is built once, in ``.tiny-model/l<layers>-h<hidden>`` beside OUT, and OUT is a
relative symbolic link to it, replaced atomically: a rerun with the same settings does
nothing; other settings build that model and repoint the link. Needs torch, transformers
and tokenizers (the vllm-cpu image and .venv-vllm have them).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

E2E = Path(__file__).resolve().with_name("e2e_vllm")
BUILDS = ".tiny-model"


def load_e2e() -> ModuleType:
    """scripts/e2e_vllm as a module (its ``main`` is not run)."""
    loader = importlib.machinery.SourceFileLoader("eg_kv_e2e_vllm", str(E2E))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def parse_args(argv: list[str], e2e: ModuleType | None = None) -> argparse.Namespace:
    defaults = (e2e or load_e2e()).parse_args([])
    p = argparse.ArgumentParser(prog="scripts/tiny_model.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the model's path (a link)")
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--hidden", type=int, default=defaults.hidden)
    return p.parse_args(argv)


def build(out: Path, layers: int, hidden: int, e2e: ModuleType | None = None) -> Path:
    """Build (or find) the model and point ``out`` at it; returns the model's directory."""
    e2e = e2e or load_e2e()
    out = out.absolute()
    builds = out.parent / BUILDS
    args = e2e.parse_args(
        ["--model-dir", str(builds), "--layers", str(layers), "--hidden", str(hidden)]
    )
    model: Path = e2e.build_model(args)
    target = os.path.relpath(model, out.parent)
    if not (out.is_symlink() and os.readlink(out) == target):
        if out.exists() and not out.is_symlink():
            raise SystemExit(f"{out} exists and is not a link this script made")
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, out)
    print(f"model: {out} -> {target}", flush=True)
    return model


def main(argv: list[str]) -> int:
    e2e = load_e2e()
    args = parse_args(argv, e2e)
    build(args.out, args.layers, args.hidden, e2e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
