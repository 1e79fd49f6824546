"""`tasks.session`'s held-out split and evaluation: a dataset's held-out rows depend on `task.split_seed` only and
number exactly `task.n_eval` (from the file itself or `eval_uri`), the training rows keep the file's order; the
arithmetic held-out prompts are fixed texts; `evaluate` scores the held-out prompts at `eval.max_new_tokens` and
`accuracy` leaves the model in the mode it found it; resume sets aside exactly the rollouts of versions newer than
the promoted one."""

from __future__ import annotations

import hashlib
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from models.arithmetic import Prompt
from models.rewards import reward_function
from models.tiny import build_char_tokenizer
from storage.lake import Lake
from tasks import session as session_module

torch.set_num_threads(1)


def _rows(path, n: int) -> str:
    path.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) + "\n" for i in range(n)))
    return str(path)


def _dataset_cfg(tmp_path, *extra):
    uri = _rows(tmp_path / "rows.jsonl", 12)
    return load_config(
        None,
        ["task.kind=dataset", "task.n_shots=0", f"task.dataset={{uri: {uri}}}", "task.n_eval=3", *extra],
    )


def test_a_datasets_held_out_rows_depend_on_the_split_seed_only_and_training_rows_keep_the_file_order(tmp_path):
    """n_eval rows are held out; the rest train in the file's order; another run seed holds out the same rows
    (runs compared across seeds evaluate on the same prompts), another split seed other ones."""
    tok = build_char_tokenizer()
    train, _, held, _ = session_module.task_prompts(_dataset_cfg(tmp_path, "run.seed=1"), tok)
    answers = lambda prompts: [int(p.answer) for p in prompts]  # noqa: E731
    assert len(held) == 3 and len(train) == 9
    assert sorted(answers(train) + answers(held)) == list(range(12))
    assert answers(train) == sorted(answers(train))
    _, _, same, _ = session_module.task_prompts(_dataset_cfg(tmp_path, "run.seed=2"), tok)
    assert answers(same) == answers(held)
    others = [
        answers(session_module.task_prompts(_dataset_cfg(tmp_path, f"task.split_seed={s}"), tok)[2]) for s in (5, 6)
    ]
    assert any(o != answers(held) for o in others)


def test_a_separate_eval_file_gives_at_most_n_eval_held_out_prompts(tmp_path):
    """With `task.dataset.eval_uri` the held-out prompts are that file's first n_eval rows, and every row of the
    training file trains."""
    uri = _rows(tmp_path / "rows.jsonl", 12)
    eval_uri = _rows(tmp_path / "eval.jsonl", 8)
    cfg = load_config(
        None,
        ["task.kind=dataset", "task.n_shots=0", f"task.dataset={{uri: {uri}, eval_uri: {eval_uri}}}", "task.n_eval=3"],
    )
    train, _, held, _ = session_module.task_prompts(cfg, build_char_tokenizer())
    assert [int(p.answer) for p in held] == [0, 1, 2] and len(train) == 12


def test_the_arithmetic_held_out_prompts_are_fixed_texts():
    """The held-out prompts (their few-shot examples included) are part of what a run's accuracy means: the same
    config gives the same texts in every version, so accuracies of runs and of resumes compare. Pinned by digest."""
    cfg = load_config(
        None, ["task.max_operand=5", "task.n_eval=5", "task.n_shots=2", "rollout.prompts_per_iteration=4"]
    )
    _, _, held, _ = session_module.task_prompts(cfg, build_char_tokenizer())
    digest = hashlib.sha256("\n\n".join(p.text + "|" + p.answer for p in held).encode()).hexdigest()[:16]
    assert digest == "fe7d1def91956648"


def test_evaluate_scores_the_held_out_prompts_at_the_eval_token_budget(monkeypatch):
    calls = []
    monkeypatch.setattr(session_module, "accuracy", lambda *args: calls.append(args) or 0.75)
    cfg = load_config(
        None,
        ["eval.max_new_tokens=7", "rollout.max_new_tokens=9", "task.reward=math_verify", "task.stop_at_newline=false"],
    )
    s = SimpleNamespace(
        cfg=cfg,
        trainer=SimpleNamespace(model="model"),
        tokenizer="tok",
        train_prompts=["train"],
        train_token_ids=[[1]],
        eval_prompts=["held-out"],
        eval_token_ids=[[2]],
        scorer=None,
    )
    assert session_module.evaluate(s) == 0.75
    (call,) = calls  # without the session's scorer, one built from the task's reward settings
    assert call[:5] + call[6:] == ("model", "tok", [[2]], ["held-out"], 7, False)
    assert call[5]("\\boxed{72}", "72.0") == 1.0 and call[5]("71", "72") == 0.0  # math_verify's equality
    s.scorer = loaded = lambda response, answer, prompt="": 1.0  # the session's, loaded once at its start
    assert session_module.evaluate(s) == 0.75
    assert calls[-1] == ("model", "tok", [[2]], ["held-out"], 7, loaded, False)


def test_accuracy_counts_exact_answers_and_leaves_the_model_in_its_mode(tiny_hf, monkeypatch):
    """Greedy decoding switches the model to eval mode; a trainer's model must come back in training mode."""
    tok, model = tiny_hf.tokenizer, tiny_hf.model
    outs = [tok("12\n", add_special_tokens=False)["input_ids"], tok("7\n", add_special_tokens=False)["input_ids"]]

    def greedy(m, ids, **kw):
        m.eval()
        return outs

    monkeypatch.setattr(session_module, "greedy_answers", greedy)
    prompts = [Prompt(0, "7+5=", "12"), Prompt(0, "4+4=", "8")]
    for training in (True, False):
        model.train(training)
        assert session_module.accuracy(model, tok, [[1], [2]], prompts, 4) == 0.5
        assert model.training is training


def test_accuracy_counts_a_reward_of_at_least_one_as_correct_and_gives_the_function_the_prompt(
    tiny_hf, monkeypatch, tmp_path
):
    """A user's reward (`task.reward: FILE.py:FUNCTION`): a greedy answer is correct when its reward is >= 1.0 (1.25
    counts; 0.999 does not), and the function sees the prompt's text."""
    tok = tiny_hf.tokenizer
    outs = [tok(a, add_special_tokens=False)["input_ids"] for a in ("12", "7", "8")]
    monkeypatch.setattr(session_module, "greedy_answers", lambda m, ids, **kw: outs)
    (tmp_path / "r.py").write_text(
        "SEEN = []\n"
        "def score(response, answer, prompt):\n"
        "    SEEN.append(prompt)\n"
        "    return {'12': 1.25, '7': 0.999, '8': 1.0}[response]\n"
    )
    prompts = [Prompt(0, t, "a") for t in ("p0", "p1", "p2")]
    acc = session_module.accuracy(
        tiny_hf.model, tok, [[1], [2], [3]], prompts, 4, reward_function(f"{tmp_path}/r.py:score")
    )
    assert acc == 2 / 3  # 1.25 and 1.0 are correct, 0.999 is not
    import sys

    (module,) = [
        m
        for name, m in sys.modules.items()
        if name.startswith("lockstep_reward_") and m.__file__ == str(tmp_path / "r.py")
    ]
    assert module.SEEN == ["p0", "p1", "p2"]


@pytest.mark.parametrize("batch", [False, True], ids=["one-at-a-time", "batched"])
def test_accuracy_gives_a_users_reward_each_prompts_extra_fields(tiny_hf, monkeypatch, tmp_path, batch):
    """Held-out answers of a dataset with `extra_fields` are scored with each prompt's own values (here the answers
    a prompt accepts besides the reference). Batched (`task.reward_batch`), in one call with every greedy answer,
    reference, prompt and field value as lists in the prompts' order; a value of at least 1.0 is correct."""
    tok = tiny_hf.tokenizer
    outs = [tok(a, add_special_tokens=False)["input_ids"] for a in ("12", "7", "8")]
    monkeypatch.setattr(session_module, "greedy_answers", lambda m, ids, **kw: outs)
    (tmp_path / "r.py").write_text(
        "CALLS = []\n"
        "def score(response, answer, accepted):\n    return float(response == answer or response in accepted)\n"
        "def judge(responses, answers, prompts, accepted):\n"
        "    CALLS.append((responses, answers, prompts, accepted))\n"
        "    return [1.0 if r == a or r in acc else 0.999 for r, a, acc in zip(responses, answers, accepted)]\n"
    )
    prompts = [Prompt(0, "p0", "x", {"accepted": ["12"]}), Prompt(1, "p1", "7", {"accepted": []})]
    prompts.append(Prompt(2, "p2", "x", {"accepted": ["9"]}))
    scorer = reward_function(f"{tmp_path}/r.py:{'judge' if batch else 'score'}", fields=("accepted",), batch=batch)
    assert session_module.accuracy(tiny_hf.model, tok, [[1], [2], [3]], prompts, 4, scorer) == 2 / 3
    import sys

    (module,) = [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(tmp_path / "r.py")]
    calls = [(["12", "7", "8"], ["x", "7", "x"], ["p0", "p1", "p2"], [["12"], [], ["9"]])] if batch else []
    assert module.CALLS == calls


def test_accuracy_ends_answers_at_a_newline_only_when_asked(tiny_hf, monkeypatch):
    tok, stops = tiny_hf.tokenizer, []

    def greedy(m, ids, **kw):
        stops.append((kw["stop_token_id"], kw["other_eos_ids"]))
        return [tok("12", add_special_tokens=False)["input_ids"]]

    monkeypatch.setattr(session_module, "greedy_answers", greedy)
    prompts = [Prompt(0, "7+5=", "12")]
    assert session_module.accuracy(tiny_hf.model, tok, [[1]], prompts, 4) == 1.0
    tiny_hf.model.generation_config.eos_token_id = [tok.eos_token_id, 9]  # an end of the model's beside EOS
    assert session_module.accuracy(tiny_hf.model, tok, [[1]], prompts, 4, None, stop_at_newline=False) == 1.0
    assert stops == [(tok("\n", add_special_tokens=False)["input_ids"][0], ()), (None, (9,))]


def test_resume_sets_aside_only_the_rollouts_of_versions_newer_than_the_promoted_one(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    root = f"{lake.run_dir('r1')}/rollouts"
    for v in (1, 2, 3, 4):
        (tmp_path / "lake" / "runs" / "r1" / "rollouts" / f"policy_version={v}").mkdir(parents=True)
        (tmp_path / "lake" / "runs" / "r1" / "rollouts" / f"policy_version={v}" / "shard.parquet").write_bytes(b"x")
    moved = session_module.set_aside_unpromoted_rollouts(lake, "r1", 2)
    assert sorted(m.rsplit("/", 1)[-1] for m in moved) == ["policy_version=3", "policy_version=4"]
    assert all(lake.fs.exists(f"{m}/shard.parquet") for m in moved)
    assert sorted(p.rsplit("/", 1)[-1] for p in lake.fs.ls(root, detail=False)) == [
        "policy_version=1",
        "policy_version=2",
    ]
    assert session_module.set_aside_unpromoted_rollouts(Lake(str(tmp_path / "lake")), "ghost", 0) == []


def test_bad_dataset_rows_are_reported_once_before_the_bootstrap(tmp_path, caplog):
    """Rows `data.on_bad_row: skip` drops while reading are logged once, by the checks before a new run (before its
    bootstrap's minutes: they were said after it), not again by its session, which reads the same file (`warn` is
    left off there but for a resume)."""
    path = tmp_path / "rows.jsonl"
    good = "".join(json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) + "\n" for i in range(12))
    path.write_text(good + json.dumps({"question": "no answer?"}) + "\n")
    cfg = load_config(
        None,
        [
            "task.kind=dataset",
            "task.n_shots=0",
            f"task.dataset={{uri: {path}}}",
            "task.n_eval=3",
            "data.on_bad_row=skip",
            "rollout.prompts_per_iteration=2",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        session_module.check_task(cfg)
        train, _, held, _ = session_module.task_prompts(cfg, build_char_tokenizer())
    assert len(train) + len(held) == 12
    assert len(caplog.records) == 1 and "rows.jsonl" in caplog.text
