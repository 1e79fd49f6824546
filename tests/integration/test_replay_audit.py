"""Replay from the lake reproduces every promoted checkpoint; the LanceDB catalog answers audits per version."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from flows.cli import main as cli
from flows.replay import replay_flow
from flows.train import train_flow
from storage import catalog, checkpoints
from storage.lake import Lake
from tests.cli_output import cli_stderr, squash
from tests.integration.runs import all_samples, final_params, write_config


def test_replay_and_audit(tmp_path, capsys, monkeypatch):
    train_flow(config_path=write_config(tmp_path, "orig", {"run.iterations": 2, "pipeline.catalog_compact_every": 1}))
    lake_uri = str(tmp_path / "lake")

    rows = replay_flow(run_id="orig", lake_uri=lake_uri, to_run_id="again")
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["max_abs_diff"] <= 1e-5 for r in rows), rows
    # the replayed run's checkpoints exist and match too; replay moved the weights away from v0
    again, orig = final_params(lake_uri, "again", 2), final_params(lake_uri, "orig", 2)
    assert max(float((again[k] - orig[k]).abs().max()) for k in orig) <= 1e-5
    for target in ("again", "orig"):  # never over an existing run (it rewrote "again" back to v0 before)
        with pytest.raises(FileExistsError, match=f"replay target run {target} already exists"):
            replay_flow(run_id="orig", lake_uri=lake_uri, to_run_id=target)
    assert checkpoints.promoted_version(Lake(lake_uri), "again") == 2
    v0 = final_params(lake_uri, "orig", 0)
    assert max(float((orig[k] - v0[k]).abs().max()) for k in orig) > 1e-4
    assert all(torch.equal(v0[k], t) for k, t in final_params(lake_uri, "again", 0).items())

    # a checkpoint that is not what its shards train to is found: one element of one tensor (not the first
    # compared) of v2 moved by 0.25; the CLI prints each version's max abs difference and the worst
    lake = Lake(lake_uri)
    weights = f"{lake.checkpoint_dir('orig', 2)}/model.safetensors"
    original_bytes = open(weights, "rb").read()
    names = list(orig)
    tampered = dict(orig)
    tampered[names[len(names) // 2]] = orig[names[len(names) // 2]].clone()
    tampered[names[len(names) // 2]].view(-1)[3] += 0.25
    save_file(tampered, weights)
    capsys.readouterr()
    assert cli(["replay", "orig", "--lake", lake_uri]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    (d1,), (d2,) = ([float(ln.split()[-1]) for ln in lines if ln.split()[:2] == ["v", str(v)]] for v in (1, 2))
    assert d1 <= 1e-5 and abs(d2 - 0.25) <= 1e-5, lines
    assert lines[-1] == f"replayed 2 versions of orig; worst max_abs_diff {d2:.3e}"
    # stderr shows each version as it is replayed (here every version: a line every max(1, 2 // 20) = 1)
    progress = [ln.split(", eta")[0] for ln in captured.err.splitlines() if ln.startswith("replayed ")]
    assert progress == [f"replayed 1/2: v1 max_abs_diff {d1:.3e}", f"replayed 2/2: v2 max_abs_diff {d2:.3e}"]
    with open(weights, "wb") as f:  # the run as it was, for the audit below
        f.write(original_bytes)

    # catalog: one row per trained sample, no duplicates, advantages present, tags per promoted version
    uri = catalog.catalog_uri(Lake(lake_uri), "orig")
    table = catalog.query(uri, catalog.ROLLOUTS).to_pylist()
    assert len(table) == 2 * 8 * 4 == len({r["sample_id"] for r in table})
    assert {(r["iteration"], r["group_id"], r["sample_index"]) for r in table} == set(all_samples(lake_uri, "orig"))
    for gid in {r["group_id"] for r in table}:  # GRPO advantages sum to 0 within a group
        assert abs(sum(r["advantage"] for r in table if r["group_id"] == gid)) < 1e-4
    import lancedb

    tags = lancedb.connect(uri).open_table(catalog.ROLLOUTS).tags.list()
    assert {"v1", "v2"} <= set(tags)

    # the CLI: version filter and a SQL where, as JSON
    assert (
        cli(
            [
                "audit",
                "orig",
                "--lake",
                lake_uri,
                "--version",
                "1",
                "--where",
                "reward >= 0",
                "--limit",
                "100",
                "--format",
                "json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 8 * 4 and {r["policy_version"] for r in out} == {1}
    shards = {r["shard"] for r in out}  # where each sample came from: a shard of version 1 in the lake
    assert len(shards) == 8 // 2  # 8 prompts, pipeline.shard_groups 2 per shard
    assert all(Lake(lake_uri).fs.exists(path) and "/policy_version=1/" in path for path in shards)
    assert cli(["audit", "orig", "--lake", lake_uri, "--version", "0", "--limit", "0", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)  # version 0 alone (not "from 0 on"); limit 0: every row
    assert len(out) == 8 * 4 and {r["policy_version"] for r in out} == {0}
    assert cli(["audit", "orig", "--lake", lake_uri, "--where", "no_such_column > 1"]) == 2
    # report: PNG + HTML on disk and in the MLflow run
    assert cli(["report", "orig", "--lake", lake_uri, "--out", str(tmp_path / "rep")]) == 0
    png, page = tmp_path / "rep" / "orig-report.png", (tmp_path / "rep" / "orig-report.html").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "reward/mean" in page and "time/train_busy_s" in page and "data:image/png;base64," in page
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("t").experiment_id], filter_string="tags.`lockstep.run_id` = 'orig'"
    )
    assert {a.path for a in client.list_artifacts(run.info.run_id, "report")} == {
        "report/orig-report.png",
        "report/orig-report.html",
    }
    # the page is written but MLflow refuses it: exit 1 (not 0, not an input error), both paths named
    from mlflow.exceptions import MlflowException

    def refuse(*args, **kwargs):
        raise MlflowException("database is locked")

    capsys.readouterr()
    monkeypatch.setattr(MlflowClient, "log_artifact", refuse)
    assert cli(["report", "orig", "--lake", lake_uri, "--out", str(tmp_path / "rep2")]) == 1
    assert squash(
        f"{tmp_path / 'rep2' / 'orig-report.png'} {tmp_path / 'rep2' / 'orig-report.html'} error: written, "
        f"but not logged to MLflow run {run.info.run_id}: database is locked"
    ) in cli_stderr(capsys)
    assert (tmp_path / "rep2" / "orig-report.html").is_file()
    monkeypatch.undo()
    capsys.readouterr()
    assert cli(["runs", "--lake", lake_uri]) == 0
    listing = capsys.readouterr().out
    assert "orig" in listing and "finished" in listing and "version 2" in listing


def test_export_round_trip(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.tiny import load_hf
    from storage import checkpoints

    train_flow(config_path=write_config(tmp_path, "exp", {"run.iterations": 1, "pipeline.catalog": False}))
    lake_uri = str(tmp_path / "lake")
    out = tmp_path / "hf"
    assert cli(["export", "exp", "--version", "1", "--out", str(out), "--lake", lake_uri]) == 0
    assert not (out / "trainer_state").exists() and (out / "model.safetensors").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    original, tok = load_hf(Lake(lake_uri).checkpoint_dir("exp", 1))
    ids = AutoTokenizer.from_pretrained(out)("Q: 3+4=?\nA: ", return_tensors="pt")["input_ids"]
    assert ids.shape[1] == len("Q: 3+4=?\nA: ")
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, original(ids).logits)
    assert cli(["export", "exp", "--out", str(out), "--lake", lake_uri]) == 2  # refuses a non-empty target
    assert cli(["export", "nope", "--out", str(tmp_path / "x"), "--lake", lake_uri]) == 2
    assert cli(["export", "exp", "--version", "0", "--out", str(tmp_path / "v0"), "--lake", lake_uri]) == 0
    assert (tmp_path / "v0" / "model.safetensors").is_file()  # the starting weights export like any version
    assert checkpoints.promoted_version(Lake(lake_uri), "exp") == 1
    capsys.readouterr()
    # what is wrong, named: a version that does not exist (was "has no MANIFEST.json (incomplete write)"), a
    # negative one, a file as target (was a NotADirectoryError traceback)
    for argv, expected in [
        (["--version", "9"], "error: run exp has no checkpoint v9; it has v0, v1"),
        (["--version", "-1"], "error: --version -1: versions start at 0"),
        (["--out", str(out / "config.json")], "is a file; choose a new directory"),
        (["--out", str(out / "config.json" / "sub")], f"File exists: {out / 'config.json'}"),
    ]:
        argv = ["--out", str(tmp_path / "new"), *argv] if "--out" not in argv else argv
        assert cli(["export", "exp", "--lake", lake_uri, *argv]) == 2
        assert squash(expected) in cli_stderr(capsys)
    assert not (tmp_path / "new").exists()


def test_replay_of_a_run_frozen_before_skip_zero_advantage_trains_as_it_did(tmp_path):
    """A run made before `train.skip_zero_advantage` existed ran every group; its config.json lacks the field. Its
    replay reads it as false and reproduces the checkpoints bitwise; read with today's default (true) the same
    batches train otherwise (the run had groups with zero advantage to skip)."""
    from storage import ledger

    train_flow(
        config_path=write_config(
            tmp_path, "old", {"run.iterations": 2, "train.skip_zero_advantage": False, "pipeline.catalog": False}
        )
    )
    lake = Lake(str(tmp_path / "lake"))
    zero = sum(r["figures"]["adv/zero_groups"] for r in ledger.read_all(lake, "old"))
    assert zero > 0  # otherwise the control below could not differ
    path = tmp_path / "lake/runs/old/config.json"
    frozen = json.loads(path.read_text())
    del frozen["train"]["skip_zero_advantage"]
    path.write_text(json.dumps(frozen))
    rows = replay_flow(run_id="old", lake_uri=str(tmp_path / "lake"))
    assert [r["max_abs_diff"] for r in rows] == [0.0, 0.0]
    frozen["train"]["skip_zero_advantage"] = True
    path.write_text(json.dumps(frozen))
    rows = replay_flow(run_id="old", lake_uri=str(tmp_path / "lake"))
    assert max(r["max_abs_diff"] for r in rows) > 0.0
