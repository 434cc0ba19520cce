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

