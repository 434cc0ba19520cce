"""The shape of tpattn's code: no function longer than ``MAX_FUNCTION_LINES``, no module docstring
longer than ``MAX_MODULE_DOCSTRING_LINES``, each public name defined once; outside
the modules ``BEING_REWORKED`` (test_layering.py)."""
import ast
import pathlib

from tests.package.test_layering import ROOT, being_reworked

#: The longest a function may be, from its ``def`` line (decorators excluded) to its last line.
MAX_FUNCTION_LINES = 60


def longest_function(source: str) -> tuple[int, str]:
    """``(lines, name)`` of the longest function or method in ``source`` (``(0, "")``: none)."""
    spans = [(node.end_lineno - node.lineno + 1, node.name) for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return max(spans, default=(0, ""))


def modules() -> dict[str, pathlib.Path]:
    """Every tpattn module: dotted name → path."""
    out = {}
    for path in sorted((ROOT / "tpattn").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_no_function_is_longer_than_the_limit():
    too_long = {}
    for name, path in modules().items():
        lines, function = longest_function(path.read_text())
        if lines > MAX_FUNCTION_LINES and not being_reworked(name):
            too_long[f"{name}.{function}"] = lines
    assert too_long == {}


def test_longest_function_measures_nested_and_methods():
    source = "def a():\n    pass\n\nclass B:\n    def c(self):\n        def d():\n" + (
        "            x = 1\n" * 70)
    assert longest_function(source) == (72, "c")
    assert longest_function("x = 1\n") == (0, "")


def test_the_modules_include_packages_and_being_reworked_matches_whole_parts():
    names = modules()
    assert "tpattn.viz" in names and "tpattn.viz.heads" in names
    parts = ("tpattn.check", "tpattn.exercises")
    assert being_reworked("tpattn.check.core", parts) and being_reworked("tpattn.exercises", parts)
    assert not being_reworked("tpattn.checks", parts) and not being_reworked("tpattn.viz.kv", parts)


def public_names(source: str) -> set[str]:
    """The public names ``source`` defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


def test_each_public_name_is_defined_once():
    where: dict[str, list[str]] = {}
    for name, path in modules().items():
        for defined in public_names(path.read_text()):
            where.setdefault(defined, []).append(name)
    twice = {defined: places for defined, places in where.items()
             if len(places) > 1 and defined != "main"  # each command-line module's entry point
             and not all(being_reworked(place) for place in places)}
    assert twice == {}


def test_public_names_reads_definitions_not_imports():
    source = "import os\nfrom x import y\nA = 1\nB: int = 2\n_c = 3\ndef f(): pass\nclass K: pass\n"
    assert public_names(source) == {"A", "B", "f", "K"}


#: The longest a module docstring may be, in lines.
MAX_MODULE_DOCSTRING_LINES = 10
#: Modules whose docstrings are still to be cut to ``MAX_MODULE_DOCSTRING_LINES``.
LONG_DOCSTRINGS_TO_CUT = ()


def test_module_docstrings_are_short():
    too_long = {}
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if (len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES and not being_reworked(name)
                and name not in LONG_DOCSTRINGS_TO_CUT):
            too_long[name] = len(doc.splitlines())
    assert too_long == {}
