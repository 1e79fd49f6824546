"""`lockstep eval` on a run trained through the real flow: each version's accuracy, measured again from its
checkpoint by the command (its own model, loaded from the lake), is the accuracy the run logged."""

from __future__ import annotations

import json

from flows import cli
from flows.train import train_flow
from tests.integration.runs import mlflow_run, write_config

# small sums and differences (answers -4..8) after a longer bootstrap: the versions answer some of the 20 held-out
# problems, not all equally many, so a version measured on another's weights would show
EASY = {
    "task.max_operand": 4,
    "task.ops": ["+", "-"],
    "task.n_eval": 20,
    "bootstrap.steps": 200,
    "run.iterations": 4,
    "eval.every": 1,
}


def test_eval_gives_the_accuracy_the_run_logged_for_each_version(tmp_path, capsys):
    train_flow(config_path=write_config(tmp_path, "ev", EASY))
    client, run = mlflow_run(tmp_path, "ev")
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/accuracy")}
    assert sorted(logged) == [0, 1, 2, 3, 4]
    assert len(set(logged.values())) > 1 and max(logged.values()) > 0, logged  # else the comparison shows nothing
    capsys.readouterr()
    assert cli.main(["eval", "ev", "--lake", str(tmp_path / "lake"), "--every", "1", "--format", "json"]) == 0
    again = {r["version"]: r["accuracy"] for r in json.loads(capsys.readouterr().out)}
    assert again == logged
