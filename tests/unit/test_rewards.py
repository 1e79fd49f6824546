"""`task.reward` to its scoring function: partial credit passed through, the response scored against the
reference, an unknown kind named."""

from __future__ import annotations

import pytest

from models.rewards import score


def test_score_arithmetic_passes_partial_credit_through():
    assert score("arithmetic", "19", "19", 0.5) == 1.0
    assert score("arithmetic", "18", "19", 0.5) == pytest.approx(0.25)  # 0.5 x 1 of 2 positions
    assert score("arithmetic", "18", "19") == 0.0  # default: exact match only


def test_score_math_verify_reads_the_response_not_the_reference():
    # the response's final answer is after its last ####; a \boxed{} before it is working, not the answer
    assert score("math_verify", "\\boxed{5} then #### 7", "7") == 1.0
    assert score("math_verify", "0.5", "1/2") == 1.0
    assert score("math_verify", "8", "7") == 0.0


@pytest.mark.parametrize("kind", ["Arithmetic", "math-verify", "exact", ""])
def test_score_unknown_kind_is_an_error_naming_it(kind):
    with pytest.raises(ValueError) as e:
        score(kind, "19", "19")
    assert str(e.value) == f"unknown reward kind {kind!r}: expected 'arithmetic' or 'math_verify'"
