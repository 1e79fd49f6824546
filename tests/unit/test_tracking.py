"""MLflow metrics are written on a background thread, in order; every one is there after `flush`, and a write
that failed is raised rather than lost (by the next call, or by `finish`, which marks the run FAILED). A resumed
run logs into its MLflow run, a new one of the same name never does; params are logged in full, long values cut."""

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
    first = Tracker.start(uri, "exp", "run-r", tags={"lockstep.mode": "periodic"}, run_key="k1")
    first.log_metrics({"reward/mean": 0.1}, 0)
    first.finish()
    again = Tracker.start(uri, "exp", "run-r", resume=True, run_key="k1")
    client = MlflowClient(tracking_uri=uri)
    assert again.run_id == first.run_id
    run = client.get_run(again.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags["lockstep.run_id"] == "run-r" and run.data.tags["lockstep.mode"] == "periodic"
    assert run.data.tags["lockstep.run_key"] == "k1"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    other = Tracker.start(uri, "exp", "run-s", resume=True, run_key="k2")  # killed before it made its MLflow run
    assert other.run_id != first.run_id


def test_a_new_run_of_a_taken_name_never_writes_into_the_earlier_runs_mlflow_run(tmp_path):
    """The same run id in another lake, or again after its lake was deleted: a new MLflow run, the earlier one left
    FINISHED with its own metrics; a resume finds the run of its own key (the newest of them), or a run started
    before keys were tagged, never another key's."""
    uri = _uri(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    a = Tracker.start(uri, "exp", "same", tags={"lockstep.mode": "sync"}, run_key="lake-a")
    a.log_metrics({"reward/mean": 0.1}, 0)
    a.finish()
    b = Tracker.start(uri, "exp", "same", tags={"lockstep.mode": "periodic"}, run_key="lake-b")
    b.log_metrics({"reward/mean": 0.9}, 0)
    b.finish()
    assert b.run_id != a.run_id
    first = client.get_run(a.run_id)
    assert first.info.status == "FINISHED" and first.data.tags["lockstep.mode"] == "sync"
    assert [m.value for m in client.get_metric_history(a.run_id, "reward/mean")] == [0.1]
    assert [m.value for m in client.get_metric_history(b.run_id, "reward/mean")] == [0.9]
    for key, run_id in (("lake-a", a.run_id), ("lake-b", b.run_id)):  # a resume of each: its own, whatever is newer
        resumed = Tracker.start(uri, "exp", "same", resume=True, run_key=key)
        assert resumed.run_id == run_id
        resumed.finish()
    legacy = client.create_run(first.info.experiment_id, tags={"lockstep.run_id": "old"})  # no key: before keys
    client.set_terminated(legacy.info.run_id)
    assert Tracker.start(uri, "exp", "old", resume=True, run_key="k").run_id == legacy.info.run_id
    assert client.get_run(legacy.info.run_id).data.tags["lockstep.run_key"] == "k"  # adopted: its key from now on


def test_a_resumed_run_logs_new_params_and_keeps_a_changed_one_as_a_tag(tmp_path):
    """`lockstep resume run --lake lake` from the lake's folder names the lake by a relative path where the first
    start had an absolute one: MLflow refuses to change a param (the resume failed there); the first value stays,
    the new one is a tag, and a field the config gained since is logged."""
    uri = _uri(tmp_path)
    first = Tracker.start(uri, "exp", "run-c", run_key="k")
    first.log_params({"lake.uri": "/data/lake", "trainer.lr": 0.001})
    first.finish()
    again = Tracker.start(uri, "exp", "run-c", resume=True, run_key="k")
    again.log_params({"lake.uri": "lake", "trainer.lr": 0.001, "resources.train_ranks": 1})
    run = MlflowClient(tracking_uri=uri).get_run(again.run_id)
    assert run.data.params == {"lake.uri": "/data/lake", "trainer.lr": "0.001", "resources.train_ranks": "1"}
    assert run.data.tags["lockstep.resumed.lake.uri"] == "lake"
    assert not any(k.startswith("lockstep.resumed.") and k != "lockstep.resumed.lake.uri" for k in run.data.tags)
    third = Tracker.start(
        uri, "exp", "run-c", resume=True, run_key="k"
    )  # a later resume by the first name again: the tag follows it
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
