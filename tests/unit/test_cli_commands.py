"""`lockstep replay`, `audit`, `serve`, and `train`'s handling of input errors found inside the flow: a missing
run, a bad run id or config, an unreachable Prefect API exit 2 with one `error:` line, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from configs.schema import ConfigError, load_config, resolved_json
from flows import cli
from storage.datasets import DatasetError
from tests.cli_output import cli_stderr, squash

REPO = Path(__file__).resolve().parents[2]
ARITH = str(REPO / "configs" / "arith-tiny.yaml")


@pytest.fixture
def lake_with_run(tmp_path) -> Path:
    """A lake holding run `r1`'s frozen config, as every run has from its start."""
    run = tmp_path / "lake" / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(resolved_json(load_config(None, ["run.run_id=r1"])))
    return tmp_path / "lake"


@pytest.fixture
def no_replay(monkeypatch):
    import flows.replay

    def fail(**kwargs):
        raise AssertionError("the replay flow must not start")

    monkeypatch.setattr(flows.replay, "replay_flow", fail)


# ------------------------------------------------------------------------------------------------ replay


def test_replay_of_a_missing_run(lake_with_run, capsys, no_replay):
    assert cli.main(["replay", "ghost", "--lake", str(lake_with_run)]) == 2
    assert squash(f"error: cannot replay 'ghost': run ghost does not exist in lake {lake_with_run} "
                  f"({lake_with_run}/runs/ghost/config.json is missing)") in cli_stderr(capsys)
    assert not (lake_with_run / "runs" / "ghost").exists()


@pytest.mark.parametrize("argv", [["../r1"], ["r1", "--to", "a/b"]])
def test_replay_with_an_invalid_run_id(lake_with_run, capsys, no_replay, argv):
    assert cli.main(["replay", *argv, "--lake", str(lake_with_run)]) == 2
    bad = argv[-1]
    assert squash(f"invalid run id {bad!r}: use 1-128 letters") in cli_stderr(capsys)


def test_replay_flow_errors_exit_2(lake_with_run, capsys, monkeypatch):
    import flows.replay

    def exists(run_id, lake_uri, to_run_id):
        raise FileExistsError(f"run {to_run_id} already exists in {lake_uri}: choose another --to")

    monkeypatch.setattr(flows.replay, "replay_flow", exists)
    assert cli.main(["replay", "r1", "--lake", str(lake_with_run), "--to", "r1"]) == 2
    assert squash(f"error: cannot replay 'r1': run r1 already exists in {lake_with_run}") in cli_stderr(capsys)


# ------------------------------------------------------------------------------------------------ audit


def test_audit_of_a_missing_run_says_so_and_writes_nothing(lake_with_run, capsys):
    assert cli.main(["audit", "ghost", "--lake", str(lake_with_run)]) == 2
    err = cli_stderr(capsys)
    assert squash(f"error: run ghost does not exist in lake {lake_with_run}") in err
    assert "promoted" not in err
    assert not (lake_with_run / "runs" / "ghost").exists()  # LanceDB used to create runs/ghost/catalog


# ------------------------------------------------------------------------------------------------ serve


@pytest.mark.parametrize("api_url", [None, "http://127.0.0.1:9/api"])
def test_serve_with_a_bad_config_exits_2(monkeypatch, capsys, api_url):
    if api_url is None:  # the config is checked first: its errors are the ones to fix whatever the server
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
    else:
        monkeypatch.setenv("PREFECT_API_URL", api_url)
    assert cli.main(["serve", ARITH, "-o", "trainer.lr=-1"]) == 2
    assert squash("trainer.lr: Input should be greater than 0 (got -1)") in cli_stderr(capsys)
    assert cli.main(["serve", ARITH, "-o", "model.path=/nonexistent/model"]) == 2
    assert squash("error: model.path '/nonexistent/model' is not a directory") in cli_stderr(capsys)


def test_serve_with_an_unreachable_prefect_api(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "serve", ARITH], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: the Prefect API at PREFECT_API_URL=http://127.0.0.1:{port}/api is unreachable" in proc.stderr


# ------------------------------------------------------------------------------------------------ train


@pytest.mark.parametrize("error", [DatasetError("train.jsonl, row 40: empty 'question' (set data.on_bad_row: skip "
                                                "to skip such rows)"),
                                   ConfigError("task.dataset.uri: train.jsonl: no usable rows")])
def test_train_input_error_inside_the_flow_exits_2(monkeypatch, capsys, tmp_path, error):
    import flows.train

    def flow(**kwargs):
        raise error

    monkeypatch.setattr(flows.train, "train_flow", flow)
    assert cli.main(["train", ARITH, "-o", f"lake.uri={tmp_path / 'lake'}"]) == 2
    assert squash(f"error: {error}") in cli_stderr(capsys)


def test_train_of_an_existing_run_prints_one_line_not_prefects_traceback(lake_with_run, capfd):
    # the real flow (Prefect's engine and loggers): open_session finds runs/r1 and raises RunExistsError, which
    # Prefect logged with its traceback ("Encountered exception during execution") before the CLI's own line
    code = cli.main(["train", ARITH, "-o", f"lake.uri={lake_with_run}", "-o", "run.run_id=r1",
                     "-o", "tracking.enabled=false"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "Encountered exception" not in err
    assert squash(f"error: run r1 already exists in {lake_with_run}: continue it with `lockstep resume r1") in (
        squash(err))
