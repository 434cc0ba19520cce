"""check_int carries the package's integer checks: check_seed, check_count, viz's ranges."""
import pytest

from tpattn.check.core import check_count, check_int, check_seed


def test_check_int_returns_the_value_inside_its_range():
    assert check_int("n", 3, 1) == 3
    assert check_int("n", 0, 0, 0) == 0
    assert check_seed(2**63 - 101) == 2**63 - 101
    assert check_count("layers", 1) == 1


@pytest.mark.parametrize("call, message", [
    (lambda: check_int("position", 17, 0, 16),
     r"position must be an integer in \[0, 16\] \(got 17\)"),
    (lambda: check_int("head_dim", 1, 2), r"head_dim must be an integer >= 2 \(got 1\)"),
    (lambda: check_int("n", True, 0), r"n must be an integer >= 0 \(got True\)"),
    (lambda: check_int("n", 2.0, 0), r"n must be an integer >= 0 \(got 2.0\)"),
    (lambda: check_seed(-1), r"seed must be an integer in \[0, 9223372036854775707\] \(got -1\)"),
    (lambda: check_count("steps", 0), r"steps must be an integer >= 1 \(got 0\)"),
])
def test_check_int_names_the_field_and_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()
