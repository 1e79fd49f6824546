"""Answer verification for math datasets with `math-verify` (Hugging Face's maintained verifier, PyPI).

It parses the reference and the model's answer (plain numbers, fractions, LaTeX, `\\boxed{}`) and compares
them symbolically, so "72", "72.0", "$72$" and "\\boxed{72}" all match 72; "1,000" matches 1000.
"""

from __future__ import annotations

import importlib.util
import threading

INSTALL = "pip install 'math-verify>=0.7'"


def _require():
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(f"the math verifier needs math-verify: {INSTALL}")
    import math_verify

    return math_verify


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference (after `####` if present), else 0.0.

    math-verify limits its parsing and comparing to 5 s each with `signal.alarm`, which works on the main thread
    only: on another (a rollout worker's scoring thread, `pipeline.overlap_scoring`) they run without those limits
    instead of failing, as math-verify advises; a response that would have run out of time is then scored by its full
    result, and one that never finishes holds the thread (README, "Scoring beside generation")."""
    mv = _require()
    main = threading.current_thread() is threading.main_thread()
    parse_limit, verify_limit = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    final = response.rsplit("####", 1)[-1] if "####" in response else response
    gold = mv.parse(answer, **parse_limit)
    if not gold:
        return 0.0
    try:
        return 1.0 if mv.verify(gold, mv.parse(final, **parse_limit), **verify_limit) else 0.0
    except Exception:  # the verifier's own parse/compare errors mean "not verified", never a crash of a worker
        return 0.0
