"""How `tasks.session` opens a run's session around its trainer: the shared-memory weights start as the trainer's
v0, a resumed run sets aside the rollouts of versions never promoted, and a session that fails to open gives back
what it had started (workers, MLflow run, shared-memory file, trainer, lease)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from storage import checkpoints, lease
from storage.lake import Lake
from tasks import session as session_module
from tasks.workers import SharedWeights

torch.set_num_threads(1)

SMALL = ["task.max_operand=5", "task.n_eval=5", "task.n_shots=2", "rollout.prompts_per_iteration=4"]


@pytest.fixture
def opening(tmp_path, tiny_hf, monkeypatch):
    """A sync run's config with shared-memory weights and tracking on, its trainer, and records of what the fake
    worker pool and MLflow run were asked to do."""
    cfg = load_config(
        None,
        [
            f"lake.uri={tmp_path / 'lake'}",
            "run.run_id=r1",
            "pipeline.mode=sync",
            "pipeline.push_weights=true",
            "tracking.enabled=true",
            *SMALL,
        ],
    )
    events = []
    monkeypatch.setattr(
        session_module, "WorkerPool", lambda n, spec, **kw: SimpleNamespace(close=lambda: events.append("pool closed"))
    )
    tracker = SimpleNamespace(log_params=lambda p: None, finish=lambda status: events.append(f"tracker {status}"))
    monkeypatch.setattr(session_module.Tracker, "start", staticmethod(lambda *a, **kw: tracker))
    trainer = session_module.build_trainer(cfg, tiny_hf.model, tiny_hf.tokenizer, torch.device("cpu"))
    yield cfg, Lake(cfg.lake.uri), trainer, tiny_hf.tokenizer, events
    trainer.close()


def _open(cfg, lake, trainer, tok, version=None):
    return session_module._open_with_trainer(
        cfg, lake, "r1", torch.device("cpu"), version, trainer, tok, "unused-model-dir", False
    )


def test_the_shared_weights_start_as_the_trainers_v0(opening):
    """The workers' first load of the shared weights must find v0 (not a zero-filled file)."""
    cfg, lake, trainer, tok, events = opening
    s = _open(cfg, lake, trainer, tok)
    try:
        assert s.version == 0 and checkpoints.promoted_version(lake, "r1") == 0
        params = dict(trainer.model.named_parameters())
        views = s.weights._views()
        assert all(torch.equal(views[k], params[k].detach()) for k in views)
    finally:
        s.weights.unlink()


def test_a_session_that_fails_after_its_workers_started_ends_them_its_mlflow_run_and_its_shared_weights(
    opening, monkeypatch
):
    cfg, lake, trainer, tok, events = opening
    created = []
    real_create = SharedWeights.create.__func__

    def create(cls, model, directory=None):
        created.append(real_create(cls, model, directory))
        return created[-1]

    def write(self, model):
        raise OSError("no space left on /dev/shm")

    monkeypatch.setattr(SharedWeights, "create", classmethod(create))
    monkeypatch.setattr(SharedWeights, "write", write)
    with pytest.raises(OSError, match="no space left"):
        _open(cfg, lake, trainer, tok)
    assert sorted(events) == ["pool closed", "tracker FAILED"]
    [weights] = created
    assert not os.path.exists(weights.path)


def test_a_resumed_session_sets_aside_the_rollouts_of_versions_never_promoted(opening):
    """v1's rollouts were generated (its weights pushed to the workers) but its checkpoint never promoted: resuming
    at v0 retrains v1, so those samples are moved to quarantine/, v0's stay."""
    cfg, lake, trainer, tok, events = opening
    checkpoints.save_checkpoint(lake, "r1", 0, trainer.model, tok, trainer.optimizer)
    checkpoints.promote(lake, "r1", 0)
    rollouts = os.path.join(lake.run_dir("r1"), "rollouts")
    for v in (0, 1):
        os.makedirs(os.path.join(rollouts, f"policy_version={v}"))
    s = _open(cfg, lake, trainer, tok, version=0)
    s.weights.unlink()
    assert os.listdir(rollouts) == ["policy_version=0"]
    [aside] = os.listdir(os.path.join(lake.run_dir("r1"), "quarantine"))
    assert os.listdir(os.path.join(lake.run_dir("r1"), "quarantine", aside)) == ["policy_version=1"]


def test_a_session_that_fails_to_open_closes_its_trainer_and_gives_back_the_lease(tmp_path, monkeypatch):
    """A data-parallel trainer's other ranks are processes: a failure after the trainer was built ends them, and the
    run's lease is released (a later resume must not find the run in use by a process that has given up)."""
    cfg = load_config(
        None,
        [f"lake.uri={tmp_path / 'lake'}", "tracking.enabled=false", "run.run_id=r1", "bootstrap.steps=0", *SMALL],
    )
    closed = []
    real_build = session_module.build_trainer

    def build_trainer(*args):
        trainer = real_build(*args)
        real_close = trainer.close
        trainer.close = lambda: closed.append(True) or real_close()
        return trainer

    def fail(*args):
        raise OSError("MLflow unreachable")

    monkeypatch.setattr(session_module, "build_trainer", build_trainer)
    monkeypatch.setattr(session_module, "_open_with_trainer", fail)
    with pytest.raises(OSError, match="MLflow unreachable"):
        session_module.open_session(cfg)
    assert closed == [True]
    assert lease.holder(Lake(cfg.lake.uri), "r1") is None
