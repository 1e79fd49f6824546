"""Reward functions by name: the one dispatch from a task's `reward` setting to the function that scores."""

from __future__ import annotations

from models import arithmetic


def score(kind: str, response: str, answer: str, partial_credit: float = 0.0) -> float:
    """The reward of one response (1.0 = correct): `arithmetic` (exact match, optional per-digit partial credit)
    or `math_verify` (symbolic equality of the final answer)."""
    if kind == "arithmetic":
        return arithmetic.reward(response, answer, partial_credit)
    if kind == "math_verify":
        from models.verifier import math_reward

        return math_reward(response, answer)
    raise ValueError(f"unknown reward kind {kind!r}: expected 'arithmetic' or 'math_verify'")
