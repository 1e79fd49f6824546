"""MLflow metrics are written on a background thread, in order; every one is there after `flush`, and a write
that failed is raised rather than lost."""

from __future__ import annotations

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from storage.tracking import Tracker


def test_metrics_are_all_written_in_order_after_flush(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker.start(uri, "exp", "run-a")
    for step in range(30):
        tracker.log_metrics({"reward/mean": step / 10, "time/iteration_s": 1.0 + step}, step)
    tracker.flush()
    history = MlflowClient(tracking_uri=uri).get_metric_history(tracker.run_id, "reward/mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(s, s / 10) for s in range(30)]
    tracker.finish()
    assert MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_a_failed_write_is_raised(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker.start(uri, "exp", "run-b")
    client = MlflowClient(tracking_uri=uri)
    client.delete_run(tracker.run_id)  # writes to a deleted run are refused by the server
    tracker.log_metrics({"reward/mean": 0.5}, 0)  # returns at once: the write happens on the writer thread
    with pytest.raises(MlflowException):
        tracker.flush()
