"""Failures that must stop an iteration before promotion and leave the previous promoted checkpoint intact."""

from __future__ import annotations

import pytest
import torch

import models.objectives
import storage.checkpoints
from flows.train import train_flow
from models.trainer import PolicyTrainer
from storage import checkpoints, ledger
from storage.lake import Lake
from tests.integration.runs import write_config


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
    """A flow run that Prefect retries continues the run it started instead of refusing the existing run."""
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
    summary = train_flow.with_options(retries=1)(config_path=write_config(tmp_path, "retry", {"run.iterations": 3}))
    lake = Lake(str(tmp_path / "lake"))
    assert state["failed"] and summary["promoted_version"] == 3
    assert [r["state"] for r in ledger.read_all(lake, "retry")] == ["promoted"] * 3
    history = [h["state"] for h in ledger.read_record(lake, "retry", 1)["history"]]
    assert history[:3] == ["planned", "rolling_out", "failed"] and history[-1] == "promoted"
