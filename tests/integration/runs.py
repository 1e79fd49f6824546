"""Helpers shared by the integration, invariant and resilience tests: tiny runs through the real flow."""

from __future__ import annotations

import atexit
import functools
import shutil
import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path

import yaml
from safetensors.torch import load

from storage.lake import Lake
from storage.shards import read_shard, table_to_records

# Small enough to run a few iterations in seconds on 2 cores, big enough that rewards vary within groups
# (a short bootstrap gives partial credit), so a wrong gradient shows in the parameters.
TINY = {
    "run": {"name": "t", "seed": 3, "iterations": 3},
    "model": {
        "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}
    },
    "task": {"max_operand": 12, "n_shots": 3, "n_eval": 20, "partial_credit": 0.5},
    "bootstrap": {"steps": 40, "batch_size": 16, "lr": 3e-3},
    "rollout": {"prompts_per_iteration": 8, "group_size": 4, "max_new_tokens": 4},
    "trainer": {"lr": 1e-3},
    "train": {"micro_batch_tokens": 256},
    "pipeline": {"shard_groups": 2},
    "eval": {"every": 1},
}


def write_config(tmp_path: Path, name: str, overrides: dict | None = None, lake: str | None = None) -> str:
    cfg = yaml.safe_load(yaml.safe_dump(TINY))
    for dotted, value in (overrides or {}).items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    cfg.setdefault("lake", {})["uri"] = lake or str(tmp_path / "lake")
    cfg["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cfg["run"]["run_id"] = name
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    seed_mlflow_store(tmp_path / "mlflow.db")
    return str(path)


@functools.cache
def _empty_mlflow_store() -> Path:
    """A new MLflow store, made once per process in a folder removed at its exit."""
    from mlflow.tracking import MlflowClient

    folder = Path(tempfile.mkdtemp(prefix="lockstep-mlflow-"))
    atexit.register(shutil.rmtree, folder, True)
    MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()  # makes the store
    return folder / "mlflow.db"


def seed_mlflow_store(db: Path) -> None:
    """Where there is no MLflow store at `db` yet, put a copy of a new, empty one there (SQLite's backup, a consistent
    copy). MLflow makes a new SQLite store by running its schema migrations: ~1.5 s of CPU per run on this 2-core
    machine, in every test that runs the flow; the copy, made once per process, takes ~0.05 s and holds what a new
    store holds (the tables at the current revision and the Default experiment, which lockstep does not use; as in
    any new store, its artifact location names the working folder of the process that made the store). Making a new
    store is tested where it is the subject: tests/unit/test_tracking.py and test_preflight.py."""
    if db.exists():
        return
    with closing(sqlite3.connect(_empty_mlflow_store())) as src, closing(sqlite3.connect(db)) as dst:
        src.backup(dst)


def mlflow_run(tmp_path: Path, run_id: str):
    """(client, run): the MLflow run of lockstep run `run_id` in the store `write_config` gives it, as it is now."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string=f"tags.`lockstep.run_id` = '{run_id}'"
    )
    return client, run


def final_params(lake_uri: str, run_id: str, version: int) -> dict:
    lake = Lake(lake_uri)
    return load(lake.fs.cat_file(f"{lake.checkpoint_dir(run_id, version)}/model.safetensors"))


def all_samples(lake_uri: str, run_id: str) -> dict:
    """(iteration, group_id, sample_index) -> record, over every shard of the run."""
    lake = Lake(lake_uri)
    out = {}
    for path in lake.fs.glob(f"{lake.run_dir(run_id)}/rollouts/*/*/*.arrow"):
        for r in table_to_records(read_shard(lake, path)):
            out[(r.iteration, r.group_id, r.sample_index)] = r
    return out


def trained(tmp_path: Path, name: str, settings: dict) -> tuple[dict, dict]:
    """Run `name` through the flow with `settings` (`run.iterations` among them) in `tmp_path`'s lake: the weights of
    its last version and every sample it stored."""
    from flows.train import train_flow

    train_flow(config_path=write_config(tmp_path, name, settings))
    lake = str(tmp_path / "lake")
    return final_params(lake, name, settings["run.iterations"]), all_samples(lake, name)
