"""training.checks: the one number check every user input goes through (file names: test_file_names.py).

Issue 13: D5 (NaN passes range checks).
"""
from __future__ import annotations

import math

import pytest

from training.checks import number_problem, show
from training.settings import TrainSettings

NUMBERS = [
    # value, lo, hi, integer, expected phrase (None = accepted)
    (0.5, 0.0, 1.0, False, None),
    (0, 0, 10, True, None),
    (float("nan"), 0.0, 1000.0, False, "is not a finite number; use a value in [0, 1000]"),
    (float("inf"), None, None, False, "is not a finite number; use a finite number"),
    (-float("inf"), 0.0, None, False, "is not a finite number; use a value >= 0"),
    (150.0, 0.0, 100.0, False, "is above the maximum 100; use a value in [0, 100]"),
    (-1, 0, 2**31 - 1, True, "is below the minimum 0"),
    (2.5, 0, 10, True, "is not an integer"),
    ("abc", 0.01, 0.99, False, "is not a number (got str); use a value in [0.01, 0.99]"),
    (True, 0, 1, False, "is not a number (got bool)"),
    (None, 0, 1, True, "is not an integer (got NoneType)"),
    (10**30, 0, 2**64 - 1, True, "is above the maximum"),
]


@pytest.mark.parametrize("value, lo, hi, integer, expected", NUMBERS, ids=[repr(n[0])[:20] for n in NUMBERS])
def test_number_problem(value, lo, hi, integer, expected):
    got = number_problem(value, lo, hi, integer=integer)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got


def test_show_shortens_long_values_and_says_how_long():
    assert show("abc") == "'abc'"
    long = show("x" * 5000)
    assert len(long) < 100 and "(5000 characters)" in long


@pytest.mark.parametrize("field", ["max_grad_norm", "dop_multiplier", "weight_decay", "logit_mean", "learning_rate",
                                   "shift", "loraplus_ratio"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_train_settings_refuse_non_finite_floats(field, bad):
    """D5: max_grad_norm=NaN used to disable clipping silently, dop_multiplier=NaN DOP, weight_decay=NaN
    reached torch as a raw error."""
    with pytest.raises(ValueError, match=rf"TrainSettings\.{field}={bad!r}: is not a finite number"):
        TrainSettings(**{field: bad}).validate()


def test_train_settings_still_accept_their_defaults_and_zero_where_meaningful():
    TrainSettings().validate()
    TrainSettings(max_grad_norm=0.0, dop_multiplier=0.0, weight_decay=0.0).validate()
    assert math.isfinite(TrainSettings().learning_rate)
