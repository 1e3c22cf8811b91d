"""Import-only stand-in for torchvision in the SGLang test venv (``scripts/sglang-venv``).

PyPI's torchvision does not load against the CPU build of torch 2.13.0, and transformers and
SGLang import it at module level (image processors, multimodal configs) on paths kvdock never
runs. Every ``torchvision.*`` submodule imports, and every name in one is a placeholder that
raises when it is called or used, so code that really needs torchvision fails loudly instead of
computing with a fake. Test-only: never installed outside that venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.28.0"


class _MissingType(type):
    def __getattr__(cls, name: str) -> Any:  # InterpolationMode.BILINEAR and the like
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__module__}.{cls.__name__}", name)


class _Missing(metaclass=_MissingType):
    """A placeholder for any torchvision name: usable as a base class, a dict key or in
    annotations, never as a working object."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("kvdock's torchvision stand-in: torchvision is not installed in this venv")

    def __class_getitem__(cls, item: Any) -> type:
        return cls


def _placeholder(module: str, name: str) -> type:
    return type(name, (_Missing,), {"__module__": module})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Finder())


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        raise AttributeError(name) from None
