"""MLflow tracking: one MLflow run per lockstep run, step = iteration (step 0 = the initial model).

Calls go through an explicit `MlflowClient` and run id (no global "active run"), so tasks on any thread
can log. The default backend is a SQLite file; MLflow 3 refuses the plain file store.

Per-iteration metrics are written by one background thread, in order, off the iteration's critical path (each
batch is a SQLite transaction, ~10 ms on 2 cores); `flush` and `finish` wait for them and raise the first error.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts (report figures, the config): `mlruns/` beside a SQLite store's
    file, where MLflow's default is `./mlruns` in whatever folder the process started in (the test suite left 35
    runs' artifacts in the repository that way); a server's own choice otherwise."""
    if not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return None
    db = uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(os.path.abspath(db)).parent.joinpath("mlruns").as_uri()


@dataclass
class Tracker:
    client: MlflowClient | None
    run_id: str | None
    seconds: float = field(default=0.0)  # time the caller spent in tracking calls (part of overhead_fraction)
    _writer: ThreadPoolExecutor | None = field(default=None, repr=False)
    _pending: list[Future] = field(default_factory=list, repr=False)

    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        tags: dict[str, str] | None = None,
        *,
        resume: bool = False,
        run_key: str | None = None,
    ) -> Tracker:
        """The MLflow run of lockstep run `run_name`, tagged `lockstep.run_id` and `lockstep.run_key`. A new run always
        gets a new MLflow run; a resumed one continues the newest MLflow run of its name and key, or of its name and
        no key (started before keys were tagged: it is given the key), or gets a new one where there is none (killed
        before it made one). `run_key`, the digest of the run's frozen config, tells it from a run of the same name
        in another lake; one of the same config in the same place (a lake deleted and the run started again) is told
        apart by being older."""
        t0 = time.perf_counter()
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = (
            exp.experiment_id
            if exp is not None
            else client.create_experiment(experiment, artifact_location=artifact_location(uri))
        )
        existing = []
        if resume:  # a resumed run keeps logging into its MLflow run
            named = client.search_runs(
                [exp_id],
                filter_string=f"tags.`lockstep.run_id` = '{run_name}'",
                order_by=["attributes.start_time DESC"],
            )
            existing = [r for r in named if r.data.tags.get("lockstep.run_key") in (run_key, None)]
        if existing:
            run_id = existing[0].info.run_id
            client.update_run(run_id, status="RUNNING")
            if run_key and "lockstep.run_key" not in existing[0].data.tags:  # from before keys: its own from now on
                client.set_tag(run_id, "lockstep.run_key", run_key)
        else:
            own = {"lockstep.run_id": run_name, **({"lockstep.run_key": run_key} if run_key else {})}
            run = client.create_run(exp_id, run_name=run_name, tags={**own, **(tags or {})})
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
        data = self.client.get_run(self.run_id).data  # a resumed run's params, from its first start
        logged, tags = data.params, data.tags
        values = {k: str(v)[:6000] for k, v in params.items()}
        items = [Param(k, v) for k, v in values.items() if k not in logged]
        # MLflow refuses to change a param; a resume may legitimately name the lake another way (a relative path, a
        # moved folder, a cache in front of a bucket): the latest start's value is kept as a tag beside the first one
        changed = [
            RunTag(f"lockstep.resumed.{k}", v)
            for k, v in values.items()
            if k in logged and (logged[k] != v or f"lockstep.resumed.{k}" in tags)
        ]
        for i in range(0, max(len(items), len(changed)), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100], tags=changed[i : i + 100])
        self.seconds += time.perf_counter() - t0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None or not metrics:
            return
        t0 = time.perf_counter()
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        self._raise_failed()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-mlflow")
        self._pending.append(self._writer.submit(self.client.log_batch, self.run_id, metrics=batch))
        self.seconds += time.perf_counter() - t0

    def _raise_failed(self) -> None:
        """Forget written batches; raise the error of the first one that failed."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()

    def flush(self) -> None:
        """Wait until every metric logged so far is written (raises the first write error)."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        try:
            for f in pending:
                f.result()
        finally:
            self.seconds += time.perf_counter() - t0

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self.client is None:
            return
        t0 = time.perf_counter()
        self.client.log_artifact(self.run_id, path, artifact_path)
        self.seconds += time.perf_counter() - t0

    def finish(self, status: str = "FINISHED") -> None:
        """Write what is still queued, then close the MLflow run. A queued write that failed marks the run FAILED
        and is raised, unless the run is already failing (its own error is the one to report)."""
        if self.client is None:
            return
        error = None
        try:
            self.flush()
        except Exception as e:
            if status != "FINISHED":
                logging.getLogger("lockstep").warning(
                    "MLflow: queued metrics of failing run %s not written: %s", self.run_id, e
                )
            error, status = (e if status == "FINISHED" else None), "FAILED"
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.client.set_terminated(self.run_id, status=status)
        if error is not None:
            raise error
