"""Chapter 10, the matrix: which measures a reader needs to tell the three modes apart."""
from __future__ import annotations

from itertools import combinations

from tpattn.check.core import MEASURES, MODES
from tpattn.exercises.graders import Wrong, as_names, exercise, mode_runs


def _signatures() -> dict[str, frozenset]:
    """Each mode's failing measures on every checked run (seeds × shapes × simulations);
    ``Wrong`` if a mode's runs disagree."""
    found = {}
    for mode in MODES:
        sets = {failing for failing, _ in mode_runs(mode)}
        if len(sets) != 1:  # pragma: no cover - not seen in the package
            raise Wrong(f"the runs of {mode} do not agree on which measures fail.")
        found[mode] = sets.pop()
    return found


def _confused(chosen: set, signatures: dict) -> tuple[str, str] | None:
    """The first pair of modes whose signatures agree on every measure of ``chosen``."""
    for a, b in combinations(MODES, 2):
        if all((m in signatures[a]) == (m in signatures[b]) for m in chosen):
            return a, b
    return None


@exercise("two measures that tell the modes apart", 10)
def check_separating_measures(pick) -> str:
    """Check ``pick() -> set``: two measures (``MEASURES`` names) whose pass/fail alone tells
    equivalence, a missing g and a missing f apart on every checked run."""
    chosen = as_names(pick(), MEASURES, "measure")
    signatures = _signatures()
    if len(chosen) < 2:
        raise Wrong(f"{len(chosen)} measure{'s' if len(chosen) != 1 else ''} can pass or fail "
                    f"in at most 2 ways, and there are 3 modes to tell apart; pick two.")
    pair = _confused(chosen, signatures)
    if pair:
        raise Wrong(f"{pair[0]} and {pair[1]} pass and fail alike on "
                    f"{', '.join(m for m in MEASURES if m in chosen)}: one of the two measures "
                    f"must fail without f (the backward pass), the other only without g (the "
                    f"forward pass).")
    if len(chosen) > 2:
        raise Wrong(f"these {len(chosen)} measures tell the modes apart, but two suffice: keep "
                    f"one that fails only without g and one that fails without either.")
    runs = len(mode_runs(MODES[0])) * len(MODES)
    return (f"right: {' and '.join(m for m in MEASURES if m in chosen)} tell the three modes "
            f"apart on all {runs} checked runs (every mode, 3 seeds, 3 shapes, both "
            f"simulations).")
