"""How `tasks.session` opens a run's session around its trainer: the shared-memory weights start as the trainer's
v0, a resumed run sets aside the rollouts of versions never promoted, and a session that fails to open gives back
what it had started (workers, MLflow run, shared-memory file, trainer, lease)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from storage import catalog, checkpoints, lease
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


def _open(cfg, lake, trainer, tok, version=None, resume=False):
    return session_module._open_with_trainer(
        cfg,
        lake,
        "r1",
        torch.device("cpu"),
        version,
        trainer,
        tok,
        "unused-model-dir",
        False,
        resume=resume,
        run_key="k",
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


@pytest.mark.parametrize("indexed", ["catalog", "catalog off", "memory lake"])
def test_a_run_with_a_catalog_imports_lancedb_at_its_first_release(opening, indexed, memory_lake):
    """LanceDB's import (~1.7 s holding the GIL) is held for the first iteration's release, where the flow's thread
    only waits for the workers' first shard; left to the first audit, it ran beside iteration 1's training. A run
    without a catalog (turned off, or on a memory:// lake, where LanceDB cannot write one) imports nothing."""
    cfg, lake, trainer, tok, events = opening
    if indexed != "catalog":
        lake = memory_lake if indexed == "memory lake" else lake
        off = ["pipeline.catalog=false"] if indexed == "catalog off" else []
        cfg = load_config(None, [f"lake.uri={lake.uri}", "run.run_id=r1", *off, *SMALL])
    s = _open(cfg, lake, trainer, tok)
    try:
        assert s.held == ([catalog.import_in_background] if indexed == "catalog" else [])
    finally:
        if s.weights is not None:
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


def test_a_new_runs_session_leaves_the_task_warnings_to_check_task_and_a_resumes_says_them(opening, caplog):
    """`check_task` says a new run's task warnings before its bootstrap; its session, which builds the same prompts
    after it, must not say them again, and a resume (which runs no `check_task`) must say them once."""
    import logging

    cfg, lake, trainer, tok, events = opening
    cfg.task.ops, cfg.rollout.max_new_tokens = ["*"], 1  # answers up to 25: 2 tokens
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        session_module.check_task(cfg)
        assert [r.getMessage().split(" are longer than ")[1][:24] for r in caplog.records] == [
            "rollout.max_new_tokens=1"
        ]
        caplog.clear()
        _open(cfg, lake, trainer, tok).weights.unlink()  # a new run: v0 saved and promoted here
        assert caplog.records == []
        _open(cfg, lake, trainer, tok, version=0, resume=True).weights.unlink()
    assert [r.getMessage().split(" are longer than ")[1][:24] for r in caplog.records] == ["rollout.max_new_tokens=1"]


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

    def fail(*args, **kwargs):
        raise OSError("MLflow unreachable")

    monkeypatch.setattr(session_module, "build_trainer", build_trainer)
    monkeypatch.setattr(session_module, "_open_with_trainer", fail)
    with pytest.raises(OSError, match="MLflow unreachable"):
        session_module.open_session(cfg)
    assert closed == [True]
    assert lease.holder(Lake(cfg.lake.uri), "r1") is None


MADE_UP = "arith-tiny-20261205-120000"  # the id a run without run.run_id makes up, fixed here (it reads the clock)


@pytest.fixture
def choosing(tmp_path, monkeypatch):
    """`open_session` of a config without run.run_id, up to the run's lease: what it opens past that is recorded.
    Yields the config, its lake, a function that opens a session and returns it, and the ids `on_run_id` heard."""
    monkeypatch.setattr(session_module, "default_run_id", lambda cfg: cfg.run.run_id or MADE_UP)
    monkeypatch.setattr(
        session_module, "_open_held", lambda cfg, lake, run_id, *rest: SimpleNamespace(run_id=run_id, cfg=cfg)
    )
    cfg = load_config(None, [f"lake.uri={tmp_path / 'lake'}", "tracking.enabled=false", "bootstrap.steps=0", *SMALL])
    heard, opened = [], []

    def open_one():
        opened.append(session_module.open_session(cfg, on_run_id=heard.append))
        return opened[-1]

    yield cfg, Lake(cfg.lake.uri), open_one, heard
    for s in opened:
        s.lease.release()
        session_module.unregister(s.run_id)


def _created(lake: Lake, run_id: str) -> None:
    lake.fs.makedirs(lake.run_dir(run_id), exist_ok=True)
    lake.fs.pipe_file(f"{lake.run_dir(run_id)}/config.json", b"{}")


def test_a_made_up_run_id_takes_the_next_free_name_when_a_run_of_that_second_exists(choosing):
    """Two runs started in the same second (a scheduled run and a click, two clicks in the Prefect UI): the second
    was refused with "choose another run.run_id", which its user never set. Now it takes `-2`, `-3`, ..."""
    cfg, lake, open_one, heard = choosing
    _created(lake, MADE_UP)
    _created(lake, f"{MADE_UP}-2")
    s = open_one()
    assert s.run_id == f"{MADE_UP}-3" and s.cfg.run.run_id == f"{MADE_UP}-3" and heard == [f"{MADE_UP}-3"]
    assert lease.holder(lake, f"{MADE_UP}-3")["command"] == "train"
    assert session_module.session(f"{MADE_UP}-3") is s and cfg.run.run_id is None  # the caller's config untouched
    s2 = open_one()  # the next one of the same second: past the run just opened
    assert s2.run_id == f"{MADE_UP}-4" and heard[-1] == f"{MADE_UP}-4"


def test_a_made_up_run_id_passes_a_name_another_process_is_creating(choosing):
    """A run of the same second still checking its inputs holds the name's lease, its config.json not yet written;
    and one can write its config.json just before this one takes the lease: either way the next name is taken,
    and the lease of a name given up is released."""
    cfg, lake, open_one, heard = choosing
    acquire = lease.acquire

    def another_wrote_it_first(lake_, run_id, command):
        if run_id == f"{MADE_UP}-3":
            _created(lake, run_id)
        return acquire(lake_, run_id, command)

    with lease.acquire(lake, MADE_UP, "train"):  # the other run, still checking its inputs
        assert open_one().run_id == f"{MADE_UP}-2"
        session_module.lease.acquire = another_wrote_it_first
        try:
            assert open_one().run_id == f"{MADE_UP}-4"  # -2 is the run opened above, -3 written as it took the lease
        finally:
            session_module.lease.acquire = acquire
    assert lease.holder(lake, f"{MADE_UP}-3") is None and heard == [f"{MADE_UP}-2", f"{MADE_UP}-4"]
    assert open_one().run_id == MADE_UP  # its creator gave it up before writing it: free again


def test_a_given_run_id_is_never_changed(choosing, monkeypatch):
    """run.run_id set: an existing run of that id is refused, as before; a resume keeps it."""
    cfg, lake, open_one, heard = choosing
    cfg.run.run_id = MADE_UP
    _created(lake, MADE_UP)
    with pytest.raises(session_module.RunExistsError) as e:
        open_one()
    assert str(e.value) == (
        f"run {MADE_UP} already exists in {cfg.lake.uri}: continue it with `lockstep resume {MADE_UP} --lake "
        f"{cfg.lake.uri}` or choose another run.run_id"
    )
    lake.fs.pipe_file(f"{lake.run_dir(MADE_UP)}/summary.json", b"{}")  # finished: a resume would have nothing to do
    with pytest.raises(session_module.RunExistsError) as e:
        open_one()
    assert str(e.value) == (
        f"run {MADE_UP} already exists in {cfg.lake.uri} and has finished: choose another run.run_id, or leave it "
        "unset to name each run by its start time"
    )
    assert heard == [] and not lake.fs.exists(lake.run_dir(f"{MADE_UP}-2"))


def test_made_up_run_ids_run_out_after_a_hundred_names(choosing):
    cfg, lake, open_one, heard = choosing
    for n in range(1, session_module.MAX_DEFAULT_ID_TRIES + 1):
        _created(lake, MADE_UP if n == 1 else f"{MADE_UP}-{n}")
    with pytest.raises(session_module.RunExistsError) as e:
        open_one()
    assert str(e.value) == (
        f"runs {MADE_UP} to {MADE_UP}-100 all exist in {cfg.lake.uri}: set run.run_id, or another run.name"
    )
    assert heard == []
