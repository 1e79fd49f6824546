"""Synthetic arithmetic task: long few-shot prompts, short answers, exact-match reward with optional partial credit.

A problem is `a op b` with operands in [0, max_operand]. Every prompt carries `n_shots` solved examples drawn
from the training split (different per prompt, fixed by the prompt's index), so prompts run ~100-200 tokens
while answers are a few digits: the regime where the prompt dominates compute.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> str:
        return str(OPS[self.op](self.a, self.b))

    @property
    def question(self) -> str:
        return f"{self.a}{self.op}{self.b}=?"


@dataclass(frozen=True)
class Prompt:
    """One prompt of a split: its stable id, the text given to the model, the reference answer and, for a dataset's
    prompt, the extra fields a user's reward function receives (`task.dataset.extra_fields`)."""

    prompt_id: int
    text: str
    answer: str
    extra: dict = field(default_factory=dict, hash=False)


def _format_shot(p: Problem) -> str:
    return f"Q: {p.question}\nA: {p.answer}\n"


def build_splits(
    max_operand: int = 30, ops: tuple[str, ...] = ("+",), n_eval: int = 200, split_seed: int = 1234
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic (train, held-out) split of every problem `a op b`, a, b in [0, max_operand]."""
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown operator {op!r}: expected one of {sorted(OPS)}")
    problems = [Problem(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if n_eval >= len(problems):
        raise ValueError(f"n_eval={n_eval} leaves no training problems out of {len(problems)}")
    random.Random(split_seed).shuffle(problems)
    return problems[n_eval:], problems[:n_eval]


def make_prompts(problems: list[Problem], shots_from: list[Problem], n_shots: int, seed: int) -> list[Prompt]:
    """Few-shot prompts; prompt i's shots are drawn with a generator seeded by (seed, i), never the problem itself."""
    prompts = []
    for i, p in enumerate(problems):
        rng = random.Random(seed * 1_000_003 + i)
        shots = [s for s in rng.sample(shots_from, min(len(shots_from), n_shots + 1)) if s != p][:n_shots]
        text = "".join(_format_shot(s) for s in shots) + f"Q: {p.question}\nA: "
        prompts.append(Prompt(prompt_id=i, text=text, answer=p.answer))
    return prompts


def make_train_prompts(train: list[Problem], n_shots: int, split_seed: int, shot_sets: int = 1) -> list[Prompt]:
    """The training prompts: `shot_sets` prompts per training problem, each set with its own shots, set after set
    and numbered in that order (set k's problem i is prompt k * len(train) + i).

    Set 0 is seeded by `split_seed` (the prompts of one set, as ever), set k > 0 by `split_seed + 1 + k`:
    `split_seed + 1` seeds the held-out prompts, whose problem i would otherwise get the same shots as set 1's.
    More sets show each problem in several contexts (the demo's 4 sets: README has what they did to its gains).
    """
    prompts = []
    for k in range(shot_sets):
        for p in make_prompts(train, train, n_shots, split_seed + (k and k + 1)):
            prompts.append(Prompt(k * len(train) + p.prompt_id, p.text, p.answer))
    return prompts


def extract_answer(response: str) -> str:
    """The model's answer: the response up to the first newline, stripped."""
    return response.split("\n", 1)[0].strip()


def reward(response: str, answer: str, partial_credit: float = 0.0) -> float:
    """1.0 for an exact match; otherwise `partial_credit` x the fraction of digit positions that match.

    Positions are aligned from the right (units with units) over the longer of the two strings, so a
    wrong length is penalised: "19" vs "19" -> 1.0; "18" vs "19" -> 0.5 x partial_credit; "9" vs "19" -> 0.5 x pc.
    """
    got = extract_answer(response)
    if got == answer:
        return 1.0
    if partial_credit <= 0.0 or not got:
        return 0.0
    width = max(len(got), len(answer))
    matched = sum(1 for x, y in zip(got.rjust(width), answer.rjust(width)) if x == y and x != " ")
    return partial_credit * matched / width
