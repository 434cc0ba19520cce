"""Chapter 20's checkers (``tpattn.exercises.loss_curve``) reject known-wrong answers with the
message that names the mistake; ``tests/frontends/test_exercises.py`` runs them with every
other chapter's (``WRONG_LOSS_CURVE``) and checks the reference solutions of the notebook."""
from tpattn import exercises as ex


def first_outside(divergence, envelope, margin, nan_outside=True, base=1, scale=True):
    """A parametrised ``leaves``: each wrong answer switches off one of its rules."""
    bound = margin * envelope if scale else envelope
    outside = ~(divergence <= bound) if nan_outside else divergence > bound
    found = outside.nonzero()
    return int(found[0]) + base if len(found) else None


WRONG_LOSS_CURVE = [
    ("check_leaves", lambda d, e, m: first_outside(d, e, m, base=0),
     "steps count from 1 (the first update), not from 0"),
    ("check_leaves", lambda d, e, m: first_outside(d, e, m, nan_outside=False),
     "a NaN is outside"),
    ("check_leaves", lambda d, e, m: first_outside(d, e, m, scale=False),
     "the first step above margin x envelope is None"),
    ("check_leaves", lambda d, e, m: bool(first_outside(d, e, m)),
     "should return a step number (an int) or None, but it gave bool"),
    ("check_step_one", lambda mode, seed: mode != "lm_equivalence",
     "mlp_input_grad_reduce_missing at seed 11"),
    ("check_step_one", lambda mode, seed: False,
     "embed_reduce_missing at seed 11"),
    ("check_step_one", lambda mode, seed: "yes",
     "should return True or False, but it gave str"),
]


def test_a_wrong_answer_points_to_chapter_20():
    # every answer of WRONG_LOSS_CURVE gets its message in test_exercises.py's ALL_WRONG
    result = ex.check_step_one(WRONG_LOSS_CURVE[-1][1])
    assert not result.passed
    assert "chapter 20 (a loss curve you can trust)" in result.message


def test_the_right_answers_pass():
    assert ex.check_leaves(first_outside).passed
    assert ex.check_step_one(ex.loss_curve.step_one_differs).passed
