"""A run on a JSONL dataset of GSM8K-style records, rewarded by the math verifier, through the real flow."""

from __future__ import annotations

import json
import random

import pytest

from flows.train import train_flow
from storage import ledger
from storage.lake import Lake
from tests.integration.runs import all_samples, write_config


def _dataset(path, n: int, bad: int) -> None:
    rng = random.Random(0)
    with open(path, "wb") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(
                json.dumps({"question": f"what is {a}+{b}?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}).encode()
                + b"\n"
            )
        for _ in range(bad):
            f.write(b'{"question": "", "answer": "#### 1"}\n')  # empty prompt
            f.write(b'{"answer": "#### 1"}\n')  # missing field
            f.write(b'{"question": "caf\xe9?", "answer": "#### 1"}\n')  # invalid UTF-8


def test_gsm8k_style_jsonl_run(tmp_path):
    data = tmp_path / "train.jsonl"
    _dataset(data, 40, bad=1)
    overrides = {
        "task.kind": "dataset",
        "task.reward": "math_verify",
        "task.n_eval": 8,
        "task.dataset": {"uri": str(data), "template": "Question: {question}\nAnswer: "},
        "run.iterations": 2,
        "bootstrap.steps": 20,
    }
    summary = train_flow(config_path=write_config(tmp_path, "gsm", overrides))
    lake = str(tmp_path / "lake")
    samples = all_samples(lake, "gsm")
    assert len(samples) == 2 * 8 * 4
    prompts = {r.prompt_text for r in samples.values()}
    assert all(p.startswith("Question: what is ") and p.endswith("?\nAnswer: ") for p in prompts)
    # the math verifier scored them: rewards are 0 or 1 and match the verifier on the stored text
    from models.verifier import math_reward

    for r in samples.values():
        answer = str(eval(r.prompt_text.split("what is ")[1].split("?")[0]))  # noqa: S307 - digits and '+'
        assert r.reward == math_reward(r.response_text, answer) and r.reward in (0.0, 1.0)
    assert [rec["state"] for rec in ledger.read_all(Lake(lake), "gsm")] == ["promoted", "promoted"]
    assert 0.0 <= summary["eval_accuracy_final"] <= 1.0


def test_bad_rows_fail_when_asked(tmp_path):
    data = tmp_path / "train.jsonl"
    _dataset(data, 40, bad=1)
    overrides = {
        "task.kind": "dataset",
        "task.reward": "math_verify",
        "task.n_eval": 8,
        "task.dataset": {"uri": str(data)},
        "data.on_bad_row": "fail",
        "run.iterations": 1,
    }
    from storage.datasets import DatasetError

    with pytest.raises(DatasetError, match=r"train\.jsonl, row 40: empty 'question'"):
        train_flow(config_path=write_config(tmp_path, "gsmfail", overrides))
    lake = Lake(str(tmp_path / "lake"))
    assert not lake.fs.exists(lake.run_dir("gsmfail"))  # refused before the run existed: fix the data, train again
