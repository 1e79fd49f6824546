"""`flows.replay._replay_versions`: which ledger records it replays (promoted ones, in order, up to the first that is
not), what it compares each with (the original checkpoint of that very version, worst tensor difference) and what a
`--to` target run receives (its own config, every version written and promoted, each naming its source). The
training of one recorded batch is replaced by a known weight change, so the figures are exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from flows import replay
from storage import checkpoints, lease, ledger
from storage.lake import Lake, read_json
from tasks.session import build_trainer

torch.set_num_threads(1)


def _shift(model, amount: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


@pytest.fixture
def run(tmp_path, tiny_hf, monkeypatch):
    """Run r1 whose v1 and v2 are v0 shifted by 0.5 and 1.0, then a 0.25 change in one tensor of v2 only; its ledger:
    two promoted iterations, one failed, one promoted after it (never replayed: the chain stops at the failure)."""
    lake = Lake(str(tmp_path / "lake"))
    cfg = load_config(None, ["run.run_id=r1", f"lake.uri={lake.uri}", "tracking.enabled=false"])
    model, tok = tiny_hf.model, tiny_hf.tokenizer
    checkpoints.save_checkpoint(lake, "r1", 0, model, tok)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    originals = {}
    for version, amount in ((1, 0.5), (2, 1.0), (3, 1.5)):
        state = {k: v + amount for k, v in v0.items()}
        if version == 2:
            first = next(k for k in state if k.endswith("norm.weight"))  # not a tied tensor
            state[first] = state[first] + 0.25
        model.load_state_dict(state)
        checkpoints.save_checkpoint(lake, "r1", version, model, tok)
        originals[version] = state
    model.load_state_dict(v0)
    records = [
        {"iteration": 0, "state": "promoted", "promoted_version": 1},
        {"iteration": 1, "state": "promoted", "promoted_version": 2},
        {"iteration": 2, "state": "failed"},
        {"iteration": 3, "state": "promoted", "promoted_version": 3},
    ]
    monkeypatch.setattr(ledger, "read_all", lambda lake_, run_id: records if run_id == "r1" else [])
    replayed = []

    def fake_iteration(trainer, cfg_, lake_, record):
        replayed.append((record["iteration"], checkpoints.promoted_version(lake_, "r2")))
        _shift(trainer.model, 0.5)
        return {}

    monkeypatch.setattr(replay, "_replay_iteration", fake_iteration)
    trainer = build_trainer(cfg, model, tok, torch.device("cpu"))
    yield lake, cfg, trainer, tok, replayed
    trainer.close()


def test_replay_compares_each_promoted_version_with_its_own_checkpoint_and_stops_at_the_first_gap(run):
    """v1 replays exactly (diff 0); v2 differs by the 0.25 of its one changed tensor (the worst tensor, not the
    best: the others match); the failed iteration ends the chain, so iteration 3 is never trained."""
    lake, cfg, trainer, tok, replayed = run
    out = replay._replay_versions(trainer, cfg, lake, "r1", tok, None)
    assert [r["version"] for r in out] == [1, 2]
    assert out[0]["max_abs_diff"] == pytest.approx(0.0, abs=1e-6)
    assert out[1]["max_abs_diff"] == pytest.approx(0.25, abs=1e-5)
    assert [iteration for iteration, _ in replayed] == [0, 1]
    assert not lake.fs.exists(lake.run_dir("r2"))  # no target: nothing written


def test_replay_to_a_target_writes_a_run_of_its_own_with_every_version_promoted(run):
    """The target gets the source's config under its own run id, v0 and each replayed version written and promoted
    (so it resumes and serves like any run), each replayed checkpoint naming the run it came from."""
    lake, cfg, trainer, tok, replayed = run
    out = replay._replay_versions(trainer, cfg, lake, "r1", tok, "r2")
    assert [r["version"] for r in out] == [1, 2]
    assert replayed == [(0, 0), (1, 1)]  # v0 promoted first: a target cut short at any point can be resumed
    assert read_json(lake, f"{lake.run_dir('r2')}/config.json")["run"]["run_id"] == "r2"
    assert checkpoints.promoted_version(lake, "r2") == 2
    for version in (0, 1, 2):
        checkpoints.verify_checkpoint(lake, lake.checkpoint_dir("r2", version))
    state = read_json(lake, f"{lake.checkpoint_dir('r2', 2)}/trainer_state/state.json")
    assert state == {"version": 2, "replayed_from": "r1"}
    weights = checkpoints.load_weights(lake, lake.checkpoint_dir("r2", 1))
    v1 = checkpoints.load_weights(lake, lake.checkpoint_dir("r1", 1))
    assert all(torch.equal(weights[k], v1[k]) for k in v1)  # the replayed weights, not v0's


def test_an_existing_target_is_refused_before_anything_is_written_into_it(tmp_path, monkeypatch):
    """`--to` an existing run (or the source itself) fails by name before the target's lease is taken: replay writes
    nothing, not even a lease file, into a run folder it did not create."""
    lake = Lake(str(tmp_path / "lake"))
    for run_id in ("r1", "r2"):
        (tmp_path / "lake" / "runs" / run_id).mkdir(parents=True)
        (tmp_path / "lake" / "runs" / run_id / "config.json").write_text("{}")
    monkeypatch.setattr(lease, "acquire", lambda *a: pytest.fail("the target's lease was taken"))
    monkeypatch.setattr(replay, "_replay", lambda *a: pytest.fail("the replay started"))
    for target in ("r2", "r1"):
        with pytest.raises(FileExistsError, match=f"replay target run {target} already exists"):
            replay.replay_flow.fn(run_id="r1", lake_uri=lake.uri, to_run_id=target)
    assert sorted(p.name for p in (tmp_path / "lake" / "runs" / "r2").iterdir()) == ["config.json"]


def test_a_recorded_batch_is_trained_at_its_recorded_version_plan_and_shard_order(monkeypatch):
    """The replayed optimizer steps are the original ones only if the batch is trained as the train task did: the
    version the ledger recorded, its prompt plan (and dynamic sampling's rounds of it), the shards in the order it
    consumed them."""
    calls = []

    class Steps:
        def __init__(self, trainer, cfg, prompt_ids, version, rounds):
            calls.append(("start", prompt_ids, version, rounds))

        def add(self, groups):
            calls.append(("add", groups))

        def finish(self):
            return {"done": True}

    monkeypatch.setattr(replay, "BatchSteps", Steps)
    record = {"prompt_ids": [3, 1, 7], "policy_version": 4, "rounds": [2, 1]}
    assert replay.train_recorded_batch("trainer", "cfg", record, [["a"], ["b"], ["c"]]) == {"done": True}
    assert calls == [("start", [3, 1, 7], 4, [2, 1]), ("add", ["a"]), ("add", ["b"]), ("add", ["c"])]


def test_the_replays_trainer_is_closed_when_the_replay_fails(tmp_path, tiny_hf, monkeypatch):
    """A data-parallel trainer's other ranks are processes: a replay that fails (a damaged shard) must end them."""
    lake = Lake(str(tmp_path / "lake"))
    cfg = load_config(None, ["run.run_id=r1", f"lake.uri={lake.uri}"])
    (tmp_path / "lake" / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "lake" / "runs" / "r1" / "config.json").write_text(cfg.model_dump_json())
    checkpoints.save_checkpoint(lake, "r1", 0, tiny_hf.model, tiny_hf.tokenizer)
    closed = []
    monkeypatch.setattr(replay, "build_trainer", lambda *a: SimpleNamespace(close=lambda: closed.append(True)))

    def fail(*args):
        raise checkpoints.CheckpointError("shard checksum mismatch")

    monkeypatch.setattr(replay, "_replay_versions", fail)
    with pytest.raises(checkpoints.CheckpointError, match="checksum mismatch"):
        replay._replay("r1", lake)
    assert closed == [True]
