"""The five measures as text: labels, ``format_measure`` and ``measures_table`` (no matplotlib)."""
from __future__ import annotations

import itertools
from typing import Mapping, Sequence

from tpattn.check.core import MEASURES

__all__ = ["MEASURE_LABELS", "SHORT_MEASURE_LABELS", "format_measure", "measures_table"]

_LABELS = {  # measure: (label, column header of measures_table(..., compact=True))
    "forward_max_abs_diff": ("forward output", "forward"),
    "loss_abs_diff": ("loss", "loss"),
    "input_grad_max_abs_diff": ("input grad dX", "dX"),
    "parameter_grad_max_abs_diff": ("parameter grads dW", "dW"),
    "post_step_weight_max_abs_diff": ("weights after a step", "weights"),
}
#: Short labels of the five measures, in ``MEASURES`` order.
MEASURE_LABELS = {m: label for m, (label, _) in _LABELS.items()}
#: Column headers of ``measures_table(..., compact=True)``, in ``MEASURES`` order.
SHORT_MEASURE_LABELS = {m: header for m, (_, header) in _LABELS.items()}


def format_measure(value: float) -> str:
    """A measure as text with 3 significant digits (``"7.01e-01"``, ``"3.58e-08"``)."""
    return f"{value:.2e}"


def measures_table(results: Sequence[Mapping], measures: Sequence[str] = MEASURES,
                   labels: Sequence[str] | None = None, compact: bool = False) -> str:
    """A fixed-width table of ``run()`` results: seed, mode (or ``labels``, "variant"), each
    measure (``format_measure``), verdict. ``compact=True`` (< 70 characters): short headers
    and, instead of a mode column, one section per run of equal modes (or labels)."""
    second = "mode" if labels is None else "variant"
    labels = [r["mode"] for r in results] if labels is None else list(labels)
    names, extra = (SHORT_MEASURE_LABELS, []) if compact else (MEASURE_LABELS, [second])
    headers = ["seed", *extra] + [names.get(m, m) for m in measures] + ["verdict"]
    rows = [[str(r["seed"])] + ([] if compact else [label]) + [format_measure(r[m]) for m in measures]
            + ["PASSED" if r["passed"] else "FAILED"] for r, label in zip(results, labels)]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    def table(body) -> str:
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                         for line in [headers, ["-" * w for w in widths], *body])
    if not compact:
        return table(rows)
    return "\n\n".join(f"{label}\n" + table(row for row, _ in section)
                       for label, section in itertools.groupby(zip(rows, labels), lambda p: p[1]))
