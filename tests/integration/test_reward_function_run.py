"""A run whose reward is the user's own function (`task.reward: MODULE:FUNCTION`), through the real flow: the spawned
rollout workers import the module themselves (from the path the run was started with), every stored reward is
what the function returned for that sample, and held-out accuracy counts the answers it gives full reward."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import uuid

import pytest

from flows.train import train_flow
from storage.lake import Lake
from tests.integration.runs import all_samples, mlflow_run, write_config

REWARD_MODULE = """
import json, os

def score(response, answer, prompt):
    # full credit (1.0) for an answer of the right length, 0.25 more for a prompt of odd length; each call is logged
    got = response.strip()
    value = float(len(got) == len(answer)) + 0.25 * (len(prompt) % 2)
    with open(os.path.join(os.environ["LOCKSTEP_TEST_REWARD_LOG"], f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"prompt": prompt, "response": response, "answer": answer, "value": value}) + "\\n")
    return value
"""


def test_a_run_scored_by_a_users_module(tmp_path, monkeypatch):
    module = f"lockstep_user_reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{module}.py").write_text(REWARD_MODULE)
    log = tmp_path / "calls"
    log.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    monkeypatch.setenv("LOCKSTEP_TEST_REWARD_LOG", str(log))
    rid = f"reward-fn-{uuid.uuid4().hex[:8]}"
    cfg = write_config(tmp_path, rid, {"run.iterations": 2, "task.reward": f"{module}:score"})
    try:
        summary = train_flow(config_path=cfg)
    finally:
        sys.modules.pop(module, None)

    frozen = json.loads(Lake(str(tmp_path / "lake")).fs.cat_file(f"{tmp_path}/lake/runs/{rid}/config.json"))
    assert frozen["task"]["reward"] == f"{module}:score"
    calls: dict[int, list[dict]] = {}
    for path in log.iterdir():
        calls[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines()]
    workers = {pid for pid in calls if pid != os.getpid()}
    assert workers, "no rollout worker called the function"
    by_sample = {(c["prompt"], c["response"]): c for pid in workers for c in calls[pid]}

    samples = all_samples(str(tmp_path / "lake"), rid)
    assert len(samples) == 2 * 8 * 4
    for r in samples.values():
        call = by_sample[(r.prompt_text, r.response_text)]
        assert r.reward == call["value"]
        got = r.response_text.strip()
        assert r.reward == float(len(got) == len(call["answer"])) + 0.25 * (len(r.prompt_text) % 2)
    assert len({r.reward for r in samples.values()}) > 1  # rewards differ, so the groups have advantages
    client, run = mlflow_run(tmp_path, rid)
    source = (tmp_path / "code" / f"{module}.py").read_bytes()
    assert run.data.params["task.reward_sha256"] == hashlib.sha256(source).hexdigest()  # which code scored it
    for k in range(2):
        (logged,) = [m.value for m in client.get_metric_history(run.info.run_id, "reward/mean") if m.step == k]
        mean = statistics.fmean(r.reward for key, r in samples.items() if key[0] == k)
        assert abs(logged - mean) < 1e-9

    # held-out accuracy: this process scored the greedy answers; correct = reward >= 1.0, here an answer of the right
    # length (the tiny model's exact-match accuracy is 0)
    held_out = calls[os.getpid()]
    assert len(held_out) == 3 * 20  # v0, v1 (eval.every 1) and the final v2, 20 held-out prompts each
    final = held_out[-20:]  # n_eval 20: the last evaluation (of the final version)
    assert summary["eval_accuracy_final"] == sum(c["value"] >= 1.0 for c in final) / 20
    assert summary["eval_accuracy_final"] == sum(len(c["response"].strip()) == len(c["answer"]) for c in final) / 20
    assert {1.0, 1.25} <= {c["value"] for c in final}  # both count as correct


EXTRA_REWARD = """
import json, os

def score(response, answer, prompt, accepted, weight):
    # full credit for the reference answer or one the row accepts, plus the row's weight; each call is logged
    value = float(response.strip() in [answer, *accepted]) + weight
    with open(os.path.join(os.environ["LOCKSTEP_TEST_REWARD_LOG"], f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"prompt": prompt, "accepted": accepted, "weight": weight, "value": value}) + "\\n")
    return value
"""


EXTRA_REWARD_BATCHED = """
import json, os, threading, time

def score(responses, answers, prompts, accepted, weight):
    # as `score` above, for lists: each call is logged with its length, its thread, and each response's value; 0.1 s
    # a call
    time.sleep(0.1)
    values = [float(r.strip() in [a, *acc]) + w for r, a, acc, w in zip(responses, answers, accepted, weight)]
    thread = threading.current_thread().name
    with open(os.path.join(os.environ["LOCKSTEP_TEST_REWARD_LOG"], f"{os.getpid()}.jsonl"), "a") as f:
        for p, acc, w, v in zip(prompts, accepted, weight, values):
            row = {"prompt": p, "accepted": acc, "weight": w, "value": v, "call_of": len(responses), "thread": thread}
            f.write(json.dumps(row) + "\\n")
    return values
"""


@pytest.mark.parametrize(
    "batch, overlap", [(False, False), (True, False), (True, True)], ids=["one-at-a-time", "batched", "batched-beside"]
)
def test_a_dataset_runs_extra_fields_reach_the_users_function_in_workers_and_in_evaluation(
    tmp_path, monkeypatch, batch, overlap
):
    """`task.dataset.extra_fields: [accepted, weight]`: every stored reward, made in a spawned rollout worker, and
    every held-out score, made in this process, is the function of that prompt's own row. Batched
    (`task.reward_batch`), the same with one call per shard's responses (2 groups of 4) in the workers, and one per
    evaluation of the 8 held-out prompts; with `pipeline.overlap_scoring` too, the workers call it on their scoring
    thread, beside generation."""
    import random

    rng = random.Random(0)
    rows = {}
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(40):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            row = {"question": f"what is {a}+{b}?", "answer": f"#### {a + b}", "accepted": [str(a + b + i % 2)]}
            row["weight"] = (i % 4) / 8
            rows.setdefault(f"Question: {row['question']}\nAnswer: ", []).append(row)
            f.write(json.dumps(row) + "\n")
    rows = {text: same[0] for text, same in rows.items() if len(same) == 1}  # a question asked twice: ambiguous
    (tmp_path / "extra_reward.py").write_text(EXTRA_REWARD_BATCHED if batch else EXTRA_REWARD)
    log = tmp_path / "calls"
    log.mkdir()
    monkeypatch.setenv("LOCKSTEP_TEST_REWARD_LOG", str(log))
    overrides = {
        "task.kind": "dataset",
        "task.reward": f"{tmp_path}/extra_reward.py:score",
        "task.n_eval": 8,
        "task.dataset": {"uri": str(tmp_path / "train.jsonl"), "extra_fields": ["accepted", "weight"]},
        "run.iterations": 1,
        "bootstrap.steps": 10,
        "task.reward_batch": batch,
        "pipeline.overlap_scoring": overlap,
    }
    summary = train_flow(config_path=write_config(tmp_path, "extra", overrides))

    calls = {int(p.stem): [json.loads(line) for line in p.read_text().splitlines()] for p in log.iterdir()}
    assert set(calls) - {os.getpid()}, "no rollout worker called the function"
    for made in calls.values():
        for c in made:
            if c["prompt"] in rows:
                assert (c["accepted"], c["weight"]) == (rows[c["prompt"]]["accepted"], rows[c["prompt"]]["weight"])
    samples = all_samples(str(tmp_path / "lake"), "extra")
    assert len(samples) == 8 * 4
    checked = 0
    for r in samples.values():
        row = rows.get(r.prompt_text)
        if row is None:
            continue
        answer = row["answer"].removeprefix("#### ")
        assert r.reward == float(r.response_text.strip() in [answer, *row["accepted"]]) + row["weight"]
        checked += 1
    assert checked >= 16 and len({r.reward for r in samples.values()}) > 1
    held_out = calls[os.getpid()]
    assert len(held_out) == 2 * 8  # v0 and v1, 8 held-out prompts each
    if batch:  # a worker's call scores a shard's 8 responses, an evaluation's the 8 held-out answers
        assert {c["call_of"] for made in calls.values() for c in made} == {8}
        in_workers = {c["thread"] for pid, made in calls.items() if pid != os.getpid() for c in made}
        assert in_workers == ({"scoring-0_0"} if overlap else {"MainThread"})
        # the iteration's 4 shards, 0.1 s a call: the scoring time the one rollout worker reports, inside its busy time
        (fig,) = summary["history"]
        assert 0.4 <= fig["time/reward_s"] <= fig["time/rollout_busy_s"]
    assert summary["eval_accuracy_final"] == sum(c["value"] >= 1.0 for c in held_out[-8:]) / 8
