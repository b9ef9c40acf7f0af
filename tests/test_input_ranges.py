"""Counts out of range are refused by name, never crash: an infinite count raised an
OverflowError (int(inf)) instead of the ValueError every other bad count gets."""

from __future__ import annotations

import pytest

import privmon

COUNTS = {"true_positives": 90, "false_negatives": 10, "false_positives": 10, "true_negatives": 90}


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan"), -1, 2.5])
@pytest.mark.parametrize("name", sorted(COUNTS))
def test_a_count_that_is_no_whole_number_is_refused_naming_it(name, bad):
    with pytest.raises(ValueError, match=rf"^{name} must be a non-negative integer count, got"):
        privmon.epsilon_from_counts(**{**COUNTS, name: bad})


def test_a_whole_float_count_is_the_integer_it_holds():
    as_floats = {k: float(v) for k, v in COUNTS.items()}
    assert privmon.epsilon_from_counts(**as_floats) == privmon.epsilon_from_counts(**COUNTS)
