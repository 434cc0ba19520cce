"""tools/clean_notebooks.py: notebooks keep only what the build uses; the Colab setup cell is
hidden in the HTML and installs from the repository URL of ``_config.yml`` (its one home)."""
from __future__ import annotations

import copy
import importlib.util
import json
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for p in (ROOT / "book").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)


def _load_tool():
    spec = importlib.util.spec_from_file_location("clean_notebooks",
                                                  ROOT / "tools" / "clean_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def test_the_url_is_read_from_config():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert tool.repository_url() == config["repository"]["url"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_clean_and_its_setup_cell_follows_config(path):
    nb = json.loads(path.read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert tool.setup_cell_url("".join(first["source"])) == tool.repository_url(), (
        f"{path.name}: the setup cell installs from another URL than _config.yml's")
    assert tool.clean(copy.deepcopy(nb), tool.repository_url()) == [], (
        f"{path.name} needs `python tools/clean_notebooks.py {path.relative_to(ROOT)}`")


def _explorer_output():
    return {"output_type": "execute_result", "execution_count": 3, "metadata": {},
            "data": {tool.WIDGET_VIEW: {"model_id": "abc", "version_major": 2},
                     "text/html": "<div class='tpx'>static</div>", "text/plain": "<explorer>"}}


def test_clean_drops_widget_state_and_views_with_a_static_twin_only():
    url = "https://example.org/me/tpattn"
    lone_view = {"output_type": "display_data", "metadata": {},
                 "data": {tool.WIDGET_VIEW: {"model_id": "x"}, "text/plain": "w"}}
    nb = {"metadata": {"kernelspec": {"name": "python3"}, "widgets": {"state": {}}},
          "nbformat": 4, "nbformat_minor": 5,
          "cells": [{"cell_type": "code", "execution_count": 1, "metadata": {}, "outputs": [],
                     "source": tool.setup_cell_source("https://github.com/old/place")},
                    {"cell_type": "code", "execution_count": 3, "metadata": {},
                     "outputs": [_explorer_output(), lone_view], "source": "explorer()"}]}
    changes = tool.clean(nb, url)
    assert len(changes) == 4
    assert "widgets" not in nb["metadata"] and nb["metadata"]["kernelspec"]
    explorer, lone = nb["cells"][1]["outputs"]
    assert set(explorer["data"]) == {"text/html", "text/plain"}
    assert explorer["execution_count"] == 3          # execution counts stay
    assert tool.WIDGET_VIEW in lone["data"]          # no twin: kept
    setup = nb["cells"][0]
    assert tool.setup_cell_url(setup["source"]) == url
    assert setup["metadata"]["tags"] == ["remove-cell"]
    assert tool.clean(nb, url) == []                 # idempotent


def test_a_first_code_cell_that_is_not_the_setup_cell_is_left_alone():
    nb = {"metadata": {}, "cells": [{"cell_type": "code", "metadata": {}, "outputs": [],
                                     "source": "print(1)"}]}
    assert tool.clean(nb, "https://example.org/x") == []
    assert nb["cells"][0]["metadata"] == {}


def test_consecutive_chunks_of_one_stream_are_joined_and_nothing_else():
    def stream(name, text):
        return {"output_type": "stream", "name": name, "text": text}

    shown = {"output_type": "display_data", "metadata": {}, "data": {"text/plain": "x"}}
    outputs = [stream("stdout", ["a\n", "b"]), stream("stdout", "\nc\n"), stream("stderr", "w\n"),
               stream("stdout", "d\n"), shown, stream("stdout", "e\n")]
    nb = {"metadata": {}, "cells": [{"cell_type": "code", "metadata": {}, "source": "run()",
                                     "outputs": outputs}]}
    assert tool.clean(nb, "https://example.org/x") == [
        "joined 1 stream chunk(s) into the output before"]
    kept = nb["cells"][0]["outputs"]
    assert [o.get("name") for o in kept] == ["stdout", "stderr", "stdout", None, "stdout"]
    assert kept[0]["text"] == "a\nb\nc\n"      # the text read is unchanged
    assert tool.clean(nb, "https://example.org/x") == []
