"""Packages that import their heavy modules on first use (PEP 562), for ``viz`` and ``widgets``."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, Sequence


def lazy_names(package: str, namespace: dict, eager: Sequence[str],
               modules: Sequence[str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` (``namespace``: its ``globals()``): the
    ``__all__`` names of ``modules``, and submodules, imported on first use and stored."""
    found: dict[str, str] = {}

    def names() -> dict[str, str]:
        """Every public name of ``modules`` → its module (imports them, once)."""
        if not found:
            for module in modules:
                for name in importlib.import_module(f".{module}", package).__all__:
                    found.setdefault(name, module)
        return found

    def __getattr__(name: str):
        if name == "__all__":
            value = [*eager, *names()]
        elif importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f".{name}", package)  # a submodule
        else:
            module = names().get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *eager, *names()})

    return __getattr__, __dir__
