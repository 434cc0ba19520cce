"""No module of ``tpattn`` uses a private name of a third-party library.

A private name is one with a leading underscore that is not a dunder (``__version__``) or an
IPython display hook (``_repr_html_``). Flagged, by reading each module's syntax tree:

- ``from lib._x import y``, ``import lib._x``, ``from lib import _y`` for a library that is not
  ``tpattn`` (relative imports are the package's own);
- ``obj._name`` where ``obj`` is a name bound to a third-party import (``torch._C``,
  ``FT2Font._layout`` after ``from matplotlib.ft2font import FT2Font``), or where ``_name`` is
  not defined anywhere in ``tpattn`` (so it must be someone else's: ``text._renderer``,
  ``legend._loc``);
- ``getattr(obj, "_name")`` likewise.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import tpattn

PACKAGE = pathlib.Path(tpattn.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
#: Underscore names of the standard library that its documentation makes public.
DOCUMENTED = {("os", "_exit")}


def is_private(name: str) -> bool:
    hook = name.startswith("_repr_") and name.endswith("_")
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and not hook


def defined_names(trees) -> set[str]:
    """Every name ``tpattn`` itself defines: functions, classes, assignments, attributes set
    on objects (``self._x = …``), arguments, import aliases."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names


def third_party_bindings(tree) -> dict[str, str]:
    """Local name → the library it was imported from, for absolute imports not of tpattn."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "tpattn":
                    bound[(alias.asname or alias.name).split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "tpattn":
                for alias in node.names:
                    bound[alias.asname or alias.name] = node.module.split(".")[0]
    return bound


def root_name(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(tree, own: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for each use of a third-party private name in ``tree``."""
    bound = third_party_bindings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] != "tpattn"
                      and any(is_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "tpattn":
                continue
            if any(is_private(part) for part in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import …"))
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if is_private(a.name)]
        elif isinstance(node, ast.Attribute) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base, attr = ((node.value, node.attr) if isinstance(node, ast.Attribute)
                          else (node.args[0], node.args[1].value))
            if not is_private(attr):
                continue
            library = bound.get(root_name(base))
            if (library, attr) in DOCUMENTED:
                continue
            if library is not None or attr not in own:
                found.append((node.lineno, f"{ast.unparse(base)}.{attr}"))
    return found


TREES = {path: ast.parse(path.read_text(), str(path)) for path in MODULES}
OWN = defined_names(TREES.values())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_of_a_third_party_library(path):
    uses = private_uses(TREES[path], OWN)
    assert not uses, f"{path.relative_to(PACKAGE)}: " + "; ".join(f"line {n}: {w}" for n, w in uses)


@pytest.mark.parametrize("code, flagged", [
    ("from matplotlib.ft2font import FT2Font\nFT2Font._layout", "FT2Font._layout"),
    ("from matplotlib._mathtext import Parser", "from matplotlib._mathtext import …"),
    ("import torch\ntorch._C._get_tracing_state()", "torch._C"),
    ("import torch.distributed._tensor", "import torch.distributed._tensor"),
    ("from ipywidgets.widgets.widget import _remove_buffers",
     "from ipywidgets.widgets.widget import _remove_buffers"),
    ("def f(text):\n    return text._renderer_of_someone_else", "text._renderer_of_someone_else"),
    ("def f(legend):\n    return getattr(legend, '_loc_of_someone_else')",
     "legend._loc_of_someone_else"),
])
def test_the_check_catches_private_names(code, flagged):
    assert flagged in [what for _, what in private_uses(ast.parse(code), OWN)]


@pytest.mark.parametrize("code", [
    "import torch\ntorch.__version__",
    "import os\nos._exit(1)",
    "from ..lazy import lazy_names",
    "class A:\n    def f(self):\n        return self._standing",
    "def f(widget):\n    return widget._repr_mimebundle_",
])
def test_the_check_allows_public_and_own_names(code):
    assert private_uses(ast.parse(code), OWN | {"_standing"}) == []


def own_private_imports(tree, module_names: set[str]) -> list[str]:
    """``from .x import _y``, ``from ._x import y`` and ``x._y`` (``x`` a tpattn module): a
    private name of one tpattn module used in another."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tpattn")):
            parts = (node.module or "").split(".")
            found += [f"module {node.module}" for p in parts if is_private(p)]
            found += [f"from {node.module} import {a.name}" for a in node.names if is_private(a.name)]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in module_names and is_private(node.attr)):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_tpattn_module_uses_another_modules_private_name():
    module_names = {p.stem for p in MODULES}
    uses = [f"{p.relative_to(PACKAGE)}:{what}" for p in MODULES
            for what in own_private_imports(ast.parse(p.read_text()), module_names)]
    assert uses == []


@pytest.mark.parametrize("code", ["from .zoo import _clip", "from ._lazy import x",
                                  "from . import zoo\nzoo._dense_step"])
def test_the_own_check_catches_a_private_import(code):
    assert own_private_imports(ast.parse(code), {"zoo"}) != []
