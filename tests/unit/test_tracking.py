"""MLflow metrics are written on a background thread, in order; every one is there after `flush`, and a write
that failed is raised rather than lost (by the next call, or by `finish`, which marks the run FAILED). A resumed
run logs into its MLflow run; params are logged in full, long values cut."""

from __future__ import annotations

import time

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from storage.tracking import Tracker, artifact_location


def _uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_metrics_are_all_written_in_order_after_flush(tmp_path):
    uri = _uri(tmp_path)
    tracker = Tracker.start(uri, "exp", "run-a")
    for step in range(30):
        tracker.log_metrics({"reward/mean": step / 10, "time/iteration_s": 1.0 + step}, step)
    tracker.flush()
    history = MlflowClient(tracking_uri=uri).get_metric_history(tracker.run_id, "reward/mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(s, s / 10) for s in range(30)]
    tracker.finish()
    assert MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_a_failed_write_is_raised(tmp_path):
    uri = _uri(tmp_path)
    tracker = Tracker.start(uri, "exp", "run-b")
    client = MlflowClient(tracking_uri=uri)
    client.delete_run(tracker.run_id)  # writes to a deleted run are refused by the server
    tracker.log_metrics({"reward/mean": 0.5}, 0)  # returns at once: the write happens on the writer thread
    with pytest.raises(MlflowException):
        tracker.flush()


def _wait_written(tracker: Tracker) -> None:
    deadline = time.monotonic() + 30
    while not all(f.done() for f in tracker._pending):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _failed_write(tracker: Tracker, client: MlflowClient) -> None:
    """A queued write that fails (the run is deleted while it is written), the run alive again afterwards."""
    client.delete_run(tracker.run_id)
    tracker.log_metrics({"reward/mean": 0.5}, 0)
    _wait_written(tracker)
    client.restore_run(tracker.run_id)


def test_resumed_run_logs_into_the_same_mlflow_run(tmp_path):
    uri = _uri(tmp_path)
    first = Tracker.start(uri, "exp", "run-r", tags={"lockstep.mode": "periodic"})
    first.log_metrics({"reward/mean": 0.1}, 0)
    first.finish()
    again = Tracker.start(uri, "exp", "run-r")
    client = MlflowClient(tracking_uri=uri)
    assert again.run_id == first.run_id
    run = client.get_run(again.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags["lockstep.run_id"] == "run-r" and run.data.tags["lockstep.mode"] == "periodic"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    other = Tracker.start(uri, "exp", "run-s")
    assert other.run_id != first.run_id


def test_a_resumed_run_logs_new_params_and_keeps_a_changed_one_as_a_tag(tmp_path):
    """`lockstep resume run --lake lake` from the lake's folder names the lake by a relative path where the first
    start had an absolute one: MLflow refuses to change a param (the resume failed there); the first value stays,
    the new one is a tag, and a field the config gained since is logged."""
    uri = _uri(tmp_path)
    first = Tracker.start(uri, "exp", "run-c")
    first.log_params({"lake.uri": "/data/lake", "trainer.lr": 0.001})
    first.finish()
    again = Tracker.start(uri, "exp", "run-c")
    again.log_params({"lake.uri": "lake", "trainer.lr": 0.001, "resources.train_ranks": 1})
    run = MlflowClient(tracking_uri=uri).get_run(again.run_id)
    assert run.data.params == {"lake.uri": "/data/lake", "trainer.lr": "0.001", "resources.train_ranks": "1"}
    assert run.data.tags["lockstep.resumed.lake.uri"] == "lake"
    assert not any(k.startswith("lockstep.resumed.") and k != "lockstep.resumed.lake.uri" for k in run.data.tags)
    third = Tracker.start(uri, "exp", "run-c")  # a later resume by the first name again: the tag follows it
    third.log_params({"lake.uri": "/data/lake", "trainer.lr": 0.001, "resources.train_ranks": 1})
    run = MlflowClient(tracking_uri=uri).get_run(again.run_id)
    assert run.data.params["lake.uri"] == "/data/lake" and run.data.tags["lockstep.resumed.lake.uri"] == "/data/lake"


@pytest.mark.parametrize("mlflow_truncates", ["true", "false"])
def test_params_are_all_logged_and_long_values_truncated(tmp_path, monkeypatch, mlflow_truncates):
    # the tracker cuts values itself: MLflow refuses a long one when MLFLOW_TRUNCATE_LONG_VALUES=false
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", mlflow_truncates)
    uri = _uri(tmp_path)
    tracker = Tracker.start(uri, "exp", "run-p")
    params = {f"p{i:03d}": i for i in range(250)}
    params["long"] = "x" * 10_000
    tracker.log_params(params)
    logged = MlflowClient(tracking_uri=uri).get_run(tracker.run_id).data.params
    assert len(logged) == 251
    assert logged["p000"] == "0" and logged["p249"] == "249"
    assert logged["long"] == "x" * 6000


def test_a_failed_write_is_raised_by_the_next_log_call(tmp_path):
    uri = _uri(tmp_path)
    tracker = Tracker.start(uri, "exp", "run-n")
    _failed_write(tracker, MlflowClient(tracking_uri=uri))
    with pytest.raises(MlflowException):
        tracker.log_metrics({"reward/mean": 0.6}, 1)
    tracker.log_metrics({"reward/mean": 0.7}, 2)  # the error is raised once, then forgotten
    tracker.flush()


def test_finish_raises_a_failed_write_and_marks_the_run_failed(tmp_path):
    uri = _uri(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    tracker = Tracker.start(uri, "exp", "run-f")
    _failed_write(tracker, client)
    with pytest.raises(MlflowException):
        tracker.finish()
    assert client.get_run(tracker.run_id).info.status == "FAILED"


def test_a_failing_run_is_marked_failed_without_raising_a_write_error(tmp_path):
    uri = _uri(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    tracker = Tracker.start(uri, "exp", "run-k")
    _failed_write(tracker, client)
    tracker.finish("KILLED")  # the run's own error is the one to report: nothing raised here
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    plain = Tracker.start(uri, "exp", "run-k2")
    plain.finish("KILLED")
    assert client.get_run(plain.run_id).info.status == "KILLED"


def test_artifacts_of_a_sqlite_store_go_beside_its_file(tmp_path, monkeypatch):
    # MLflow's default artifact root is ./mlruns of the current folder, wherever the database is
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    t = Tracker.start(f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}", "exp", "r1")
    t.client.log_text(t.run_id, "hello", "note.txt")
    t.finish("FINISHED")
    assert (tmp_path / "elsewhere" / "mlruns").is_dir() and not (tmp_path / "mlruns").exists()
    assert [p.read_text() for p in (tmp_path / "elsewhere" / "mlruns").rglob("note.txt")] == ["hello"]
    assert artifact_location("sqlite:///mlflow.db") == (tmp_path / "mlruns").as_uri()  # relative: this folder
    assert artifact_location("http://127.0.0.1:5000") is None
