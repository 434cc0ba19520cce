"""The figure of chapter 19, the whole model (``tpattn.viz.whole_model``): it draws one
collective per collective that one layer's step records, and the shapes of ``lm``."""
import collections

import matplotlib
import matplotlib.patches as mpatches

from tpattn.check.core import LR
from tpattn.config import Config
from tpattn.model.config import LMConfig
from tpattn.model.job import simulated_lm_job
from tpattn.viz.whole_model import lm_layout_figure, lm_layout_steps

matplotlib.use("Agg")


def test_the_figure_draws_each_collective_of_one_layers_step_once():
    lm = LMConfig(layers=1)
    ledger = simulated_lm_job(lm, 11, LR)["ledger"]
    model = [e for e in ledger if e["group"] == "tp" and e["phase"] in ("forward", "backward")]
    kinds = collections.Counter("g" if e["label"].startswith("g:") else
                                "f" if e["label"].startswith("f:") else "loss" for e in model)
    drawn = collections.Counter(
        {"g": "g", "f": "f"}.get(text, "loss")
        for row in lm_layout_steps(lm) for kind, text, _ in row if kind == "op")
    assert kinds == drawn == {"g": 3, "f": 3, "loss": 3}


def test_the_figure_writes_the_slices_of_the_lm_it_is_given():
    import matplotlib.pyplot as plt

    lm = LMConfig(block=Config(world_size=4, query_heads=4, kv_heads=4), vocab=40, tied=True)
    fig = lm_layout_figure(lm)
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "[10, H]" in texts and "12 of 48" in texts and "(tied)" in texts
    assert "One rank of 4" in fig.axes[0].get_title()
    circles = [p for p in fig.axes[0].patches if isinstance(p, mpatches.Circle)]
    assert len(circles) == 9
    plt.close("all")
