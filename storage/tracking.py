"""MLflow tracking: one MLflow run per lockstep run, step = iteration (step 0 = the initial model).

Calls go through an explicit `MlflowClient` and run id (no global "active run"), so tasks on any thread
can log. The default backend is a SQLite file; MLflow 3 refuses the plain file store.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient


@dataclass
class Tracker:
    client: MlflowClient | None
    run_id: str | None
    seconds: float = field(default=0.0)  # time spent in tracking calls (part of overhead_fraction)

    @classmethod
    def start(cls, uri: str, experiment: str, run_name: str, tags: dict[str, str] | None = None) -> Tracker:
        t0 = time.perf_counter()
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
        existing = client.search_runs([exp_id], filter_string=f"tags.`lockstep.run_id` = '{run_name}'", max_results=1)
        if existing:  # a resumed run keeps logging into the same MLflow run
            run_id = existing[0].info.run_id
            client.update_run(run_id, status="RUNNING")
        else:
            run = client.create_run(exp_id, run_name=run_name, tags={"lockstep.run_id": run_name, **(tags or {})})
            run_id = run.info.run_id
        tracker = cls(client, run_id)
        tracker.seconds += time.perf_counter() - t0
        return tracker

    @classmethod
    def disabled(cls) -> Tracker:
        return cls(None, None)

    def log_params(self, params: dict) -> None:
        if self.client is None:
            return
        t0 = time.perf_counter()
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        self.seconds += time.perf_counter() - t0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None or not metrics:
            return
        t0 = time.perf_counter()
        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])
        self.seconds += time.perf_counter() - t0

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self.client is None:
            return
        t0 = time.perf_counter()
        self.client.log_artifact(self.run_id, path, artifact_path)
        self.seconds += time.perf_counter() - t0

    def finish(self, status: str = "FINISHED") -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status=status)
