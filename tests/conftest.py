"""Shared fixtures: the golden files copied from the seed fixture (tests need no ../shared)."""
import json
import os
import pathlib

import pytest
import torch
from hypothesis import settings

#: Under CI=true the property tests draw the same examples on every run (derived from each
#: test's name), so a red CI names a change, not a draw; elsewhere each run draws new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")

DATA = pathlib.Path(__file__).parent / "data"
ROOT = pathlib.Path(__file__).parent.parent


def load_golden(name: str):
    """``tests/data/golden_<name>.json`` parsed."""
    return json.loads((DATA / f"golden_{name}.json").read_text())


@pytest.fixture
def golden():
    return load_golden



@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    its matmuls are tiny, and threads only contend (10x slower on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
