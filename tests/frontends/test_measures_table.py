"""viz.measures_table(compact=True) fits the book's text column and shows the same values."""
import pytest

pytest.importorskip("matplotlib")

import tpattn  # noqa: E402
from tpattn import viz  # noqa: E402


def test_compact_table_fits_the_column_and_keeps_every_value():
    results = tpattn.run_matrix(seeds=[11, 17])
    compact = viz.measures_table(results, compact=True)
    full = viz.measures_table(results)
    assert max(map(len, compact.splitlines())) < 70 < max(map(len, full.splitlines()))
    for mode in tpattn.MODES:  # one section per mode, headed by it
        assert f"\n{mode}\n" in f"\n{compact}\n"
    values = [viz.format_measure(r[m]) for r in results for m in tpattn.MEASURES]
    shown = [cell for line in compact.splitlines() for cell in line.split("  ")
             if cell.strip() and (cell.strip()[0] in "<0123456789" and "e" in cell)]
    assert [v.strip() for v in shown] == values
