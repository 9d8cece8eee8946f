"""Import before SGLang's host pools: an empty stand-in for ``torchvision``.

SGLang's model-config package imports ``torchvision.transforms`` at module level for its
vision models, and the host pools import that package. No torchvision build matches the
CPU torch of ``.venv-vllm`` (PyPI's needs CUDA: ``operator torchvision::nms does not
exist``), and nothing on the KV path uses it: every ``torchvision`` module imported after
this one is an empty module whose attributes are inert placeholders.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Inert:
    """Whatever a vision config asks of torchvision at import time: a callable, an
    attribute, a base class."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    def __getattr__(self, _name: str) -> _Inert:
        return _Inert()

    def __call__(self, *_args: object, **_kwargs: object) -> _Inert:
        return _Inert()

    def __mro_entries__(self, _bases: tuple) -> tuple:
        return (object,)


class _Module(types.ModuleType):
    __version__ = "0+none"

    def __getattr__(self, name: str) -> _Inert:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
