"""A run with DAPO's soft overlong punishment (`algorithm.overlong_buffer`) through the real flow: the shards and the
catalog keep the task's rewards, the catalog's advantages are those the trainer took (of the punished rewards), the
punishment's figure per iteration is the stored responses' own, and a replay reproduces every checkpoint."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from flows.replay import replay_flow
from flows.train import train_flow
from models.objectives import compute_advantages
from models.trainer import shaped_rewards
from storage import catalog
from storage.lake import Lake
from tests.integration.runs import all_samples, mlflow_run, write_config

OVERLONG = (4, 2, 1.0)  # the runs' max_new_tokens 4, the last 2 tokens punished: 3 -> -0.5, 4 -> -1


def test_an_overlong_run_catalogs_replays_and_reports_its_punishment(tmp_path):
    settings = {"run.iterations": 2, "algorithm.overlong_buffer": 2}
    train_flow(config_path=write_config(tmp_path, "long", settings))
    lake_uri = str(tmp_path / "lake")
    samples = all_samples(lake_uri, "long")
    groups = defaultdict(list)
    for (it, gid, _), rec in sorted(samples.items()):
        groups[(it, gid)].append(rec)
    rows = {
        r["sample_id"]: r
        for r in catalog.query(catalog.catalog_uri(Lake(lake_uri), "long"), catalog.ROLLOUTS).to_pylist()
    }
    assert len(rows) == len(samples) == 2 * 8 * 4
    differs = 0
    for (it, gid), recs in groups.items():
        task = [r.reward for r in recs]
        punished, _ = shaped_rewards(task, [r.response_ids for r in recs], OVERLONG)
        expected = compute_advantages(punished.unsqueeze(0))[0].squeeze(0)
        stored = torch.tensor([rows[f"long/{it}/{gid}/{r.sample_index}"]["advantage"] for r in recs])
        assert torch.allclose(stored, expected, atol=1e-6), (it, gid)
        assert [rows[f"long/{it}/{gid}/{r.sample_index}"]["reward"] for r in recs] == task  # the task's rewards
        differs += not torch.allclose(stored, compute_advantages(torch.tensor([task]))[0].squeeze(0), atol=1e-6)
    assert differs > 0  # the punishment changed some group's advantages (else the checks above could not tell)

    client, run = mlflow_run(tmp_path, "long")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward/overlong_penalty")}
    assert sorted(history) == [0, 1]  # logged at the step of the iteration
    for it in (0, 1):
        recs = [r for (i, _), rs in groups.items() if i == it for r in rs]
        _, penalty = shaped_rewards([r.reward for r in recs], [r.response_ids for r in recs], OVERLONG)
        assert history[it] == pytest.approx(float(penalty.mean()), abs=1e-6)
    assert any(v < 0 for v in history.values())  # some responses were punished

    replayed = replay_flow(run_id="long", lake_uri=lake_uri, to_run_id="long-again")
    assert [r["version"] for r in replayed] == [1, 2] and all(r["max_abs_diff"] == 0.0 for r in replayed), replayed
