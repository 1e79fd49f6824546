"""Failures that must stop an iteration before promotion and leave the previous promoted checkpoint intact."""

from __future__ import annotations

import re

import pytest
import torch

import models.objectives
import storage.checkpoints
from flows.train import train_flow
from models.trainer import PolicyTrainer
from storage import checkpoints, ledger
from storage.lake import Lake
from tests.integration.runs import mlflow_run, write_config


def test_nan_loss_fails_the_iteration_before_promotion(tmp_path, monkeypatch):
    real_loss, real_step = models.objectives.policy_loss, PolicyTrainer.optimizer_step
    steps = {"n": 0}

    def poisoned(*args, **kwargs):
        per_token, metrics = real_loss(*args, **kwargs)
        if steps["n"] >= 1:  # iteration 0 trains normally; every loss of iteration 1 is NaN
            per_token = per_token * torch.tensor(float("nan"))
        return per_token, metrics

    def counted(self):
        figures = real_step(self)
        steps["n"] += 1
        return figures

    monkeypatch.setattr(models.objectives, "policy_loss", poisoned)
    monkeypatch.setattr(PolicyTrainer, "optimizer_step", counted)
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        train_flow(config_path=write_config(tmp_path, "nan", {"run.iterations": 3}))
    lake = Lake(str(tmp_path / "lake"))
    assert checkpoints.promoted_version(lake, "nan") == 1
    rec = ledger.read_record(lake, "nan", 1)
    assert rec["state"] == "failed" and "non-finite loss" in rec["reason"]
    assert not lake.fs.exists(lake.checkpoint_dir("nan", 2))
    assert mlflow_run(tmp_path, "nan")[1].info.status == "FAILED"


def test_checkpoint_write_error_keeps_the_promoted_version(tmp_path, monkeypatch):
    real = storage.checkpoints._write_model_dir

    def failing(local, *args, **kwargs):
        real(local, *args, **kwargs)
        if str(local).endswith("-v000002"):  # v0 and v1 write fine; v2 breaks after its files are written
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.checkpoints, "_write_model_dir", failing)
    with pytest.raises(OSError, match="No space left"):
        train_flow(config_path=write_config(tmp_path, "enospc", {"run.iterations": 3}))
    lake = Lake(str(tmp_path / "lake"))
    assert checkpoints.promoted_version(lake, "enospc") == 1
    checkpoints.verify_checkpoint(lake, lake.checkpoint_dir("enospc", 1))  # intact
    assert not lake.fs.exists(lake.checkpoint_dir("enospc", 2))
    assert lake.fs.glob(f"{lake.run_dir('enospc')}/_tmp/*v000002*") == []  # the half-written folder is gone
    assert ledger.read_record(lake, "enospc", 1)["state"] == "failed"


def test_prefect_retry_of_the_flow_resumes_the_run(tmp_path, monkeypatch):
    """A flow run that Prefect retries continues the run it started instead of refusing the existing run, or, as
    here, starting another: its run id was made up at its start (no run.run_id), and the flow run took it as its
    name, where the retry finds it."""
    import yaml
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    import tasks.iteration

    real = tasks.iteration.micro_batches
    state = {"failed": False, "calls": 0}

    def flaky(groups, budget, shared):
        state["calls"] += 1
        if state["calls"] == 6 and not state["failed"]:  # once, in iteration 1
            state["failed"] = True
            raise ConnectionError("transient storage outage")
        return real(groups, budget, shared)

    monkeypatch.setattr(tasks.iteration, "micro_batches", flaky)
    path = write_config(tmp_path, "retry", {"run.iterations": 3, "run.name": "retry"})
    cfg = yaml.safe_load(open(path))
    del cfg["run"]["run_id"]
    open(path, "w").write(yaml.safe_dump(cfg))
    summary = train_flow.with_options(retries=1)(config_path=path)
    lake = Lake(str(tmp_path / "lake"))
    [run_id] = [p.rsplit("/", 1)[-1] for p in lake.fs.ls(f"{lake.root}/runs")]  # one run, not a second one
    assert re.fullmatch(r"retry-\d{8}-\d{6}", run_id) and summary["run_id"] == run_id
    with get_client(sync_client=True) as prefect:
        [flow_run] = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id])))
    assert flow_run.run_count == 2 and flow_run.state.is_completed()
    assert state["failed"] and summary["promoted_version"] == 3
    assert [r["state"] for r in ledger.read_all(lake, run_id)] == ["promoted"] * 3
    history = [h["state"] for h in ledger.read_record(lake, run_id, 1)["history"]]
    assert history[:3] == ["planned", "rolling_out", "failed"] and history[-1] == "promoted"
    assert summary["iterations"] == 3 and len(summary["history"]) == 2  # the retry trained iterations 1 and 2
    client, run = mlflow_run(tmp_path, run_id)
    evals = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")]
    # v1 evaluated after iteration 0, and again where the retry starts: at its version's step, not at step 0
    assert [step for step, _ in evals] == [0, 1, 1, 2, 3]
    assert evals[1][1] == evals[2][1]  # greedy evaluation of one version


def test_failure_after_promotion_keeps_the_iteration_promoted(tmp_path, monkeypatch):
    """An error after an iteration produced its version (evaluation, tracking) fails the run, but the version written
    in the background is promoted and its ledger record says so: resume continues after it, replay and the catalog
    see it."""
    import collections

    import flows.train
    from flows.replay import replay_flow
    from storage import catalog

    real = flows.train.evaluate_task
    calls = {"n": 0}

    def flaky(run_id):
        calls["n"] += 1
        if calls["n"] == 2:  # the evaluation of v1, after iteration 0's promotion (call 1 evaluates v0)
            raise RuntimeError("evaluation failed")
        return real(run_id)

    monkeypatch.setattr(flows.train, "evaluate_task", flaky)
    config = write_config(tmp_path, "late", {"run.iterations": 3})
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train_flow(config_path=config)
    lake = Lake(str(tmp_path / "lake"))
    assert checkpoints.promoted_version(lake, "late") == 1
    assert ledger.read_record(lake, "late", 0)["state"] == "promoted"  # was `failed`, which can never be promoted
    summary = train_flow(config_path=config, resume=True)
    assert summary["promoted_version"] == 3
    assert [r["state"] for r in ledger.read_all(lake, "late")] == ["promoted"] * 3
    assert len(replay_flow(run_id="late", lake_uri=str(tmp_path / "lake"))) == 3
    rows = catalog.query(catalog.catalog_uri(lake, "late"), catalog.ROLLOUTS, columns=["iteration"]).to_pylist()
    assert collections.Counter(r["iteration"] for r in rows) == {0: 32, 1: 32, 2: 32}


def test_session_resources_end_when_tracking_fails(tmp_path, monkeypatch):
    """MLflow failing at the start of a run, or when the run is marked finished, must not leave the rollout workers
    or the shared-memory weights behind."""
    import glob
    import multiprocessing
    import os

    from storage.tracking import Tracker
    from tasks import session

    def live_workers():
        return [p for p in multiprocessing.active_children() if p.name.startswith("lockstep-rollout")]

    mine = f"/dev/shm/lockstep-weights-{os.getpid()}-*"  # this process's: other test workers run runs of their own
    before = set(glob.glob(mine))

    def fails_and_leaves_nothing(run_id: str, error: str) -> None:
        with pytest.raises(ConnectionError, match=error):
            train_flow(config_path=write_config(tmp_path, run_id, {"run.iterations": 1}))
        assert live_workers() == [] and run_id not in session.SESSIONS
        assert set(glob.glob(mine)) == before

    real_finish = Tracker.finish

    def failing_finish(self, status):
        real_finish(self, status)
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(Tracker, "finish", failing_finish)
    fails_and_leaves_nothing("finish", "went away")

    def failing_start(*args, **kwargs):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(Tracker, "start", failing_start)
    fails_and_leaves_nothing("start", "unreachable")


def test_resume_after_the_last_promotion(tmp_path):
    """Resume of a run past its last promotion: a finished run is left as it is (its summary not rewritten); one
    killed before its summary gets it (an IndexError before); and the promoted checkpoint is verified against its
    manifest before training on it, so a weight file damaged since (a disk fault) is named instead of loaded."""
    import json

    from storage.checkpoints import CheckpointError

    config = write_config(tmp_path, "done", {"run.iterations": 1})
    first = train_flow(config_path=config)
    lake = Lake(str(tmp_path / "lake"))
    summary_file = f"{lake.run_dir('done')}/summary.json"
    written = lake.fs.cat_file(summary_file)
    again = train_flow(config_path=config, resume=True)
    assert again["history"] == [] and lake.fs.cat_file(summary_file) == written
    assert {k: again[k] for k in json.loads(written)} == {k: first[k] for k in json.loads(written)}

    lake.fs.rm(summary_file)  # as if killed during the final evaluation
    late = train_flow(config_path=config, resume=True)
    assert late["promoted_version"] == 1 and late["eval_accuracy_final"] == first["eval_accuracy_final"]
    assert json.loads(lake.fs.cat_file(summary_file))["promoted_version"] == 1

    weights = f"{lake.checkpoint_dir('done', 1)}/model.safetensors"
    data = bytearray(lake.fs.cat_file(weights))
    data[-1] ^= 0xFF  # the last tensor's last byte: the file still parses
    lake.fs.pipe_file(weights, bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its manifest"):
        train_flow(config_path=config, resume=True)
    assert checkpoints.promoted_version(lake, "done") == 1


def test_the_audit_runs_with_either_half_enabled_and_its_failure_fails_the_run(tmp_path, monkeypatch):
    """The audit task (catalog rows, Prefect report) runs beside the next iteration; it runs when either half is on,
    and its error is the run's error, whichever iteration it was for (not only the last one's)."""
    import tasks.iteration

    real = tasks.iteration.markdown_report
    reported: list[int] = []

    def recorded(run_id, iteration, figures, **kwargs):
        reported.append(iteration)
        return real(run_id, iteration, figures, **kwargs)

    monkeypatch.setattr(tasks.iteration, "markdown_report", recorded)
    train_flow(config_path=write_config(tmp_path, "report-only", {"run.iterations": 2, "pipeline.catalog": False}))
    assert sorted(reported) == [0, 1]

    def broken(run_id, iteration, figures, **kwargs):
        if iteration == 0:
            raise RuntimeError("artifact store unreachable")
        return real(run_id, iteration, figures, **kwargs)

    monkeypatch.setattr(tasks.iteration, "markdown_report", broken)
    with pytest.raises(RuntimeError, match="artifact store unreachable"):
        train_flow(config_path=write_config(tmp_path, "audit-fails", {"run.iterations": 3}))
    lake = Lake(str(tmp_path / "lake"))
    assert not lake.fs.exists(f"{lake.run_dir('audit-fails')}/summary.json")
    rec = ledger.read_record(lake, "audit-fails", 0)
    assert rec["state"] == "promoted" and checkpoints.promoted_version(lake, "audit-fails") >= 1  # the version stands
