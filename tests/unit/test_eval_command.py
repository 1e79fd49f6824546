"""`lockstep eval RUN_ID`: which versions it evaluates, that each is measured on its own checkpoint's weights, what it
prints, and its refusals (one `error:` line, exit 2, nothing written to the lake)."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

import tasks.session
from configs.schema import frozen_config, load_config, resolved_json
from flows import cli, evaluate
from storage import checkpoints
from storage.lake import Lake
from tests.cli_output import cli_stderr, squash

CONFIG = ["run.run_id=r1", "task.n_eval=12", "eval.max_new_tokens=3", "resources.train_threads=2"]


def _lake_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def _save_versions(lake: Lake, tiny_hf, versions: int, promoted: int | None = None) -> None:
    """Checkpoints v0..v{versions - 1} of run r1, each with its own weights (v0 the fixture's model, each next one
    moved by a different amount), and the newest (or `promoted`) promoted."""
    lake.fs.makedirs(lake.run_dir("r1"), exist_ok=True)
    lake.fs.pipe(lake.config_file("r1"), resolved_json(load_config(None, CONFIG)).encode())
    torch.manual_seed(1)
    for v in range(versions):
        if v:
            with torch.no_grad():
                for p in tiny_hf.model.parameters():
                    p.add_(0.05 * v * torch.randn_like(p))
        checkpoints.save_checkpoint(lake, "r1", v, tiny_hf.model, tiny_hf.tokenizer)
    checkpoints.promote(lake, "r1", versions - 1 if promoted is None else promoted)


@pytest.fixture
def run_lake(tmp_path, tiny_hf) -> Path:
    """A local lake holding run r1 with checkpoints v0-v5, v5 promoted."""
    _save_versions(Lake(str(tmp_path / "lake")), tiny_hf, 6)
    return tmp_path / "lake"


def _fingerprint(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


@pytest.fixture
def fingerprints(monkeypatch) -> list[float]:
    """`tasks.session.accuracy` replaced by a fingerprint of the weights it is given (each call's, in order)."""
    seen: list[float] = []

    def fake(model, *args):
        seen.append(_fingerprint(model))
        return seen[-1]

    monkeypatch.setattr(tasks.session, "accuracy", fake)
    return seen


# ------------------------------------------------------------------------------------------------ versions


@pytest.mark.parametrize(
    ("versions", "every", "expected"),
    [
        ([], None, [5]),  # the promoted version
        ([3, 1, 3], None, [1, 3]),  # each once, ascending
        ([], 2, [0, 2, 4, 5]),  # every 2nd and the promoted one
        ([], 5, [0, 5]),
        ([], 1, [0, 1, 2, 3, 4, 5]),
        ([3], 4, [0, 3, 4, 5]),
    ],
)
def test_the_versions_chosen(run_lake, versions, every, expected):
    assert evaluate.chosen_versions(Lake(str(run_lake)), "r1", versions, every) == expected


def test_versions_past_the_promoted_one_are_refused(tmp_path, tiny_hf):
    """v3 was written but v2 is the promoted version (a crash between checkpoint and promotion): not the run's yet."""
    lake = Lake(str(tmp_path / "lake"))
    _save_versions(lake, tiny_hf, 4, promoted=2)
    assert evaluate.chosen_versions(lake, "r1", [], 1) == [0, 1, 2]
    for bad in (3, -1):
        with pytest.raises(ValueError, match=rf"--version {bad}: run r1 has versions 0 to 2 \(the newest promoted\)"):
            evaluate.chosen_versions(lake, "r1", [1, bad], None)


def test_a_missing_checkpoint_is_named_before_any_evaluation(run_lake):
    lake = Lake(str(run_lake))
    for v in (2, 4):
        lake.fs.rm(lake.checkpoint_dir("r1", v), recursive=True)
    with pytest.raises(FileNotFoundError, match="run r1 has no checkpoint of version v2, v4 in"):
        evaluate.chosen_versions(lake, "r1", [], 2)
    assert evaluate.chosen_versions(lake, "r1", [1, 3], None) == [1, 3]


def test_a_run_without_a_promoted_version_and_a_bad_every(tmp_path, run_lake):
    lake = Lake(str(run_lake))
    with pytest.raises(ValueError, match="--every 0: give a number of versions of at least 1"):
        evaluate.chosen_versions(lake, "r1", [], 0)
    lake.fs.rm(f"{lake.run_dir('r1')}/checkpoints/PROMOTED")
    with pytest.raises(FileNotFoundError, match="run r1 has no promoted version in"):
        evaluate.chosen_versions(lake, "r1", [0], None)


# ------------------------------------------------------------------------------------------------ evaluation


def test_each_version_is_measured_on_its_own_checkpoints_weights(run_lake, fingerprints):
    lake = Lake(str(run_lake))
    cfg = frozen_config(json.loads(Path(lake.config_file("r1")).read_text()))
    events: list[dict] = []
    rows = list(evaluate.evaluate_versions(cfg, lake, "r1", [0, 2, 3, 5], events.append))
    stored = {}
    for v in range(6):
        weights = load(Path(lake.checkpoint_dir("r1", v), "model.safetensors").read_bytes())
        stored[v] = float(sum(t.double().sum() for t in weights.values()))
    assert len(set(stored.values())) == 6  # the versions' weights differ, so a mix-up would show
    assert [r["version"] for r in rows] == [0, 2, 3, 5]
    assert [r["accuracy"] for r in rows] == pytest.approx([stored[v] for v in (0, 2, 3, 5)], abs=1e-9)
    assert all(r["prompts"] == 12 for r in rows)  # task.n_eval of the frozen config
    assert events[0]["event"] == "start" and events[0]["versions"] == 4 and events[0]["prompts"] == 12
    assert [e["version"] for e in events[1:]] == [0, 2, 3, 5] and all(e["event"] == "version" for e in events[1:])


def test_answers_are_taken_in_eval_mode_and_the_callers_mode_is_given_back(tiny_hf):
    """The run evaluates its trainer's model, which training leaves in train mode: a model with dropout answered
    with it on, so the run's figures and `lockstep eval`'s (a model loaded in eval mode) differed."""
    cfg = load_config(None, CONFIG)
    _, _, prompts, ids = tasks.session.task_prompts(cfg, tiny_hf.tokenizer)
    modes: list[bool] = []
    tiny_hf.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    tiny_hf.model.train()
    tasks.session.accuracy(tiny_hf.model, tiny_hf.tokenizer, ids, prompts, 3, None, True)
    assert modes and not any(modes)
    assert tiny_hf.model.training


def test_the_thread_setting_is_the_runs_and_is_given_back(run_lake, fingerprints):
    import torch

    lake = Lake(str(run_lake))
    cfg = frozen_config(json.loads(Path(lake.config_file("r1")).read_text()))
    before = torch.get_num_threads()
    for threads, expected in ((None, cfg.resources.train_threads), (3, 3)):
        events: list[dict] = []
        for _ in evaluate.evaluate_versions(cfg, lake, "r1", [1], events.append, threads):
            assert torch.get_num_threads() == expected
        assert events[0] == {
            "event": "start",
            "versions": 1,
            "prompts": 12,
            "device": "cpu",
            "attention": "sdpa",
            "threads": expected,
        }
        assert torch.get_num_threads() == before


def test_an_object_store_runs_v0_is_loaded_from_a_copy_it_removes(tiny_hf, tmp_path, monkeypatch, fingerprints):
    lake = Lake(f"memory://lockstep-eval-{uuid.uuid4().hex}")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    try:
        _save_versions(lake, tiny_hf, 2)
        cfg = frozen_config(json.loads(lake.fs.cat_file(lake.config_file("r1"))))
        rows = list(evaluate.evaluate_versions(cfg, lake, "r1", [1]))
    finally:
        lake.fs.rm(lake.root, recursive=True)
    assert rows[0]["accuracy"] == pytest.approx(_fingerprint(tiny_hf.model), abs=1e-9)  # v1: the fixture's model now
    assert os.listdir(temp) == []


# ------------------------------------------------------------------------------------------------ the command


def test_eval_prints_each_version_and_writes_nothing(run_lake, capsys, fingerprints):
    before = _lake_files(run_lake)
    assert cli.main(["eval", "r1", "--lake", str(run_lake), "--every", "2", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert [r["version"] for r in rows] == [0, 2, 4, 5]
    assert [r["accuracy"] for r in rows] == fingerprints
    assert set(rows[0]) == {"version", "accuracy", "correct", "prompts", "seconds"}
    assert "evaluating v0, v2, v4, v5 of run r1 on its 12 held-out prompts (cpu, attention sdpa, 2 threads)" in err
    assert "evaluated 4/4: v5 accuracy" in err  # not a terminal: progress lines
    best = max(zip(fingerprints, [0, 2, 4, 5]))
    assert f"best: v{best[1]} accuracy {best[0]:.3f} of 4 versions" in err
    assert _lake_files(run_lake) == before

    assert cli.main(["eval", "r1", "--lake", str(run_lake), "--version", "1", "--format", "csv"]) == 0
    [row] = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert row["version"] == "1" and float(row["accuracy"]) == pytest.approx(fingerprints[-1])

    assert cli.main(["eval", "r1", "--lake", str(run_lake)]) == 0  # the promoted version, as a table
    out, err = capsys.readouterr()
    [line] = out.splitlines()
    assert "best:" not in err  # one version: nothing to compare
    assert line.startswith(f"v     5  accuracy {fingerprints[-1]:.3f}  (")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ghost"], "error: run ghost does not exist in lake {lake} ({lake}/runs/ghost/config.json is missing)"),
        (["r1", "--version", "6"], "error: --version 6: run r1 has versions 0 to 5 (the newest promoted)"),
        (["r1", "--every", "-2"], "error: --every -2: give a number of versions of at least 1"),
        (["r1", "--threads", "0"], "error: --threads 0: give at least 1"),
        (["../r1"], "invalid run id '../r1'"),
    ],
)
def test_eval_refusals(run_lake, capsys, fingerprints, argv, message):
    before = _lake_files(run_lake)
    assert cli.main(["eval", *argv, "--lake", str(run_lake)]) == 2
    assert squash(message.format(lake=run_lake)) in cli_stderr(capsys)
    assert fingerprints == []  # nothing was evaluated
    assert _lake_files(run_lake) == before


def test_eval_of_a_damaged_checkpoint_names_it_after_the_versions_before_it(run_lake, capsys):
    weights = run_lake / "runs/r1/checkpoints/v000003/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    argv = ["eval", "r1", "--lake", str(run_lake), "--version", "2", "--version", "3", "--format", "json"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert [r["version"] for r in json.loads(out)] == [2]  # evaluated before v3 was read: not lost
    assert squash(
        f"error: cannot evaluate 'r1': checkpoint file {run_lake}/runs/r1/checkpoints/v000003/model.safetensors does "
        "not match its manifest"
    ) in squash(err)


@pytest.mark.parametrize(
    ("error", "code", "said"),
    [
        (KeyboardInterrupt(), 130, "interrupted: evaluation of r1 stopped after 2 versions"),
        (
            PermissionError(13, "Permission denied", "/data/eval.jsonl"),
            2,
            "error: cannot evaluate 'r1': Permission denied: /data/eval.jsonl",
        ),
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            2,
            "error: cannot evaluate 'r1': "
            "out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB); wait for the run's end, or free "
            "the device",
        ),
    ],
)
def test_eval_stopped_midway_prints_the_versions_it_has(run_lake, capsys, monkeypatch, error, code, said):
    calls: list[float] = []

    def accuracy(model, *args):
        if len(calls) == 2:
            raise error
        calls.append(_fingerprint(model))
        return calls[-1]

    monkeypatch.setattr(tasks.session, "accuracy", accuracy)
    assert cli.main(["eval", "r1", "--lake", str(run_lake), "--every", "1", "--format", "json"]) == code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert [r["version"] for r in json.loads(out)] == [0, 1]
    assert squash(said) in squash(err)


def test_eval_of_a_run_whose_config_is_not_a_config(run_lake, capsys):
    (run_lake / "runs/r1/config.json").write_text('{"run": {"iterations": "many"}}')
    assert cli.main(["eval", "r1", "--lake", str(run_lake)]) == 2
    assert squash(f"error: {run_lake}/runs/r1/config.json is not a valid run config") in cli_stderr(capsys)


def test_the_best_of_equal_accuracies_is_the_earliest_version(run_lake, capsys, monkeypatch):
    monkeypatch.setattr(tasks.session, "accuracy", lambda model, *args: 0.25)
    assert cli.main(["eval", "r1", "--lake", str(run_lake), "--version", "3", "--version", "1"]) == 0
    out, err = capsys.readouterr()
    assert [ln.split()[1] for ln in out.splitlines()] == ["1", "3"]
    assert "best: v1 accuracy 0.250 of 2 versions" in err


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_a_run_whose_reward_file_moved_is_refused_before_any_work(
    run_lake, capsys, fingerprints, tmp_path, monkeypatch, command
):
    """`eval` scores held-out answers and `resume` trains with the run's reward: a user's file moved since the run is
    named as the run's frozen setting, with what to do, before any version is evaluated or the flow starts."""
    from tests.unit.test_cli_commands import replace_flow

    server = replace_flow(monkeypatch, lambda **kwargs: pytest.fail("the flow must not start"))
    gone = tmp_path / "moved_reward.py"
    (run_lake / "runs/r1/config.json").write_text(
        resolved_json(load_config(None, [*CONFIG, f"task.reward={gone}:score"]))
    )
    assert cli.main([command, "r1", "--lake", str(run_lake)]) == 2
    assert squash(
        f"error: task.reward '{gone}:score': no file {gone}; this is the run's frozen setting: put the file (or a "
        "link to it) back at that path"
    ) in cli_stderr(capsys)
    assert fingerprints == [] and server == []
