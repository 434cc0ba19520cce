"""The drafts of the chapter "Around the block" (``book/_drafts/around_*.py``, percent format):
every code cell runs, in order, with its asserts; cells fit the book's column."""
import re
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

DRAFTS = sorted((Path(__file__).resolve().parents[2] / "book" / "_drafts").glob("around_*.py"))
MINE = ("around_mesh.py", "around_spmd.py", "around_loading.py")


def cells(path: Path) -> list[tuple[str, str, str]]:
    """``(kind, header, source)`` per cell: kind ``markdown`` or ``code``."""
    out, kind, header, lines = [], None, "", []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            if kind:
                out.append((kind, header, "\n".join(lines).strip("\n")))
            kind = "markdown" if "[markdown]" in line else "code"
            header, lines = line, []
        else:
            lines.append(line)
    out.append((kind, header, "\n".join(lines).strip("\n")))
    return out


@pytest.mark.parametrize("name", MINE)
def test_draft_cells_fit_the_column(name):
    path = next(p for p in DRAFTS if p.name == name)
    for kind, _, source in cells(path):
        assert all(len(line) <= 77 for line in source.splitlines()), source
        if kind == "code":
            assert len(source.splitlines()) <= 40
        else:
            assert all(line == "#" or line.startswith("# ") for line in source.splitlines())


@pytest.mark.parametrize("name", MINE)
def test_draft_runs_with_its_asserts_and_its_solutions_pass(name):
    import matplotlib.pyplot as plt

    path = next(p for p in DRAFTS if p.name == name)
    namespace = {"__name__": "draft"}
    verdicts, after_solution = [], False
    for kind, header, source in cells(path):
        if kind != "code":
            continue
        value = None
        *body, last = source.splitlines() or [""]
        if re.match(r"^exercises\.check_\w+\(\w+\)$", last):
            exec(compile("\n".join(body), str(path), "exec"), namespace)
            value = eval(last, namespace)
            verdicts.append((after_solution, value))
        else:
            exec(compile(source, str(path), "exec"), namespace)
        after_solution = "exercise-solution" in header
    plt.close("all")
    assert len(verdicts) == 4
    for solution, result in verdicts:
        assert result.passed == solution, result.message
        if not solution:
            assert result.message.startswith("not written yet")


def test_mesh_figures_draw_the_groups_they_say():
    import matplotlib.pyplot as plt

    from tpattn.config import Config
    from tpattn.viz.around_mesh import (gathered_sources, mesh_groups_figure, mesh_panels,
                                        sp_gather_figure)

    cfg = Config(data_parallel=2)
    panels = {p["mode"]: p for p in mesh_panels(cfg)}
    assert panels["loss_reduced_over_world"]["wrong"] == [[0, 1, 2, 3]]
    assert panels["dp_grad_group_of_one"]["wrong"] == [[0], [1], [2], [3]]
    assert all(p["right"] == [[0, 2], [1, 3]] for p in panels.values())
    sp = Config(data_parallel=2, sequence_parallel=True, seq=4)
    assert gathered_sources(sp, "tp")[2] == [(1, 0), (1, 1)]
    assert gathered_sources(sp, "dp")[2] == [(0, 0), (1, 0)]
    assert len(mesh_groups_figure(cfg).axes) == 6
    assert len(sp_gather_figure(sp).axes) == 2
    plt.close("all")
