"""Shared fixtures: the golden files copied from the seed fixture (tests need no ../shared)."""
import json
import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"
ROOT = pathlib.Path(__file__).parent.parent


def load_golden(name: str):
    """``tests/data/golden_<name>.json`` parsed."""
    return json.loads((DATA / f"golden_{name}.json").read_text())


@pytest.fixture
def golden():
    return load_golden


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``make test`` runs under pytest-xdist (``-n auto --dist loadgroup``): the cells of one
    notebook form one group, so nbval runs them in order on one worker, in one kernel; every
    other test is balanced across the workers on its own."""
    for item in items:
        path, sep, _ = item.nodeid.partition(".ipynb::")
        if sep:
            item.add_marker(pytest.mark.xdist_group(path + ".ipynb"))
