"""`replay_flow`: retrain a run from its stored rollouts only (no generation) and compare every version.

For each promoted iteration, in order, the shards the trainer consumed (as the ledger lists them, verified by
checksum) are trained again from the run's v0 with the run's frozen config; the result is compared with the
original checkpoint of that version. With `to_run_id`, the replayed checkpoints are written as a new run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from configs.schema import Config, frozen_config
from flows import api_server
from models.trainer import RolloutGroup
from storage import checkpoints, lease, ledger, scratch
from storage.lake import Lake, atomic_write_bytes, read_json
from storage.shards import read_shard
from tasks.iteration import BatchSteps, groups_of
from tasks.preflight import check_replayable, replay_target_exists, resolve_device
from tasks.session import build_trainer

# a script that calls replay_flow gets the same temporary Prefect API server as the CLI (flows/api_server.py)
api_server.install()


def _no_progress(event: dict) -> None:
    pass


# what the CLI shows of a replay as it goes (stderr): {"event": "start", "run_id", "versions"} once v0 is loaded, then
# {"event": "version", "version", "max_abs_diff"} per version replayed
progress_hook: Callable[[dict], None] = _no_progress


def recorded_batch(lake: Lake, record: dict) -> list[list[RolloutGroup]]:
    """The groups of each shard an iteration's trainer consumed, in that order (checksums verified)."""
    return [groups_of(read_shard(lake, sh["path"], sh["checksum"])) for sh in record["shards"]]


def train_recorded_batch(trainer, cfg: Config, record: dict, batch: list[list[RolloutGroup]]) -> dict:
    """Train one recorded batch as the train task did: the same version, plan, shard order and optimizer steps."""
    plan, rounds = record.get("prompt_ids") or [], record.get("rounds")
    steps = BatchSteps(trainer, cfg, plan, record.get("policy_version", 0), rounds=rounds)
    for groups in batch:
        steps.add(groups)
    return steps.finish()


@task(name="replay-iteration", cache_policy=NO_CACHE)
def _replay_iteration(trainer, cfg: Config, lake: Lake, record: dict) -> dict:
    return train_recorded_batch(trainer, cfg, record, recorded_batch(lake, record))


@flow(name="lockstep-replay")
def replay_flow(run_id: str, lake_uri: str = "./lake", to_run_id: str | None = None) -> list[dict]:
    """Per replayed version: {"version", "max_abs_diff"} against the original checkpoint."""
    lake = Lake(lake_uri)
    check_replayable(lake, run_id, to_run_id)
    if to_run_id is None:
        return _replay(run_id, lake)
    with lease.acquire(lake, to_run_id, "replay"):  # its own lease files do not make the target exist
        if lease.other_entries(lake, to_run_id):  # created while this one started
            raise replay_target_exists(lake, to_run_id)
        return _replay(run_id, lake, to_run_id)


def _replay(run_id: str, lake: Lake, to_run_id: str | None = None) -> list[dict]:
    import torch

    from models.tiny import load_hf

    cfg = frozen_config(read_json(lake, lake.config_file(run_id)))
    torch.set_num_threads(cfg.resources.train_threads)
    v0 = lake.checkpoint_dir(run_id, 0)
    with tempfile.TemporaryDirectory(prefix=scratch.prefix("v0")) as copies:  # an object-store lake's v0, once loaded
        model, tokenizer = load_hf(checkpoints.local_copy(lake, v0, copies))
    trainer = build_trainer(cfg, model, tokenizer, resolve_device(cfg.trainer.device))
    try:
        return _replay_versions(trainer, cfg, lake, run_id, tokenizer, to_run_id)
    finally:
        trainer.close()  # a data-parallel trainer's other ranks


def _replay_versions(trainer, cfg, lake: Lake, run_id: str, tokenizer, to_run_id: str | None) -> list[dict]:
    if to_run_id:
        new_cfg = cfg.model_copy(deep=True)
        new_cfg.run.run_id = to_run_id
        atomic_write_bytes(lake, to_run_id, lake.config_file(to_run_id), new_cfg.model_dump_json(indent=2).encode())
        checkpoints.save_checkpoint(lake, to_run_id, 0, trainer.model, tokenizer, trainer.optimizer)
        checkpoints.promote(lake, to_run_id, 0)
    records = ledger.read_all(lake, run_id)
    promoted = next((k for k, r in enumerate(records) if r["state"] != "promoted"), len(records))
    progress_hook({"event": "start", "run_id": run_id, "versions": promoted})
    out = []
    for record in records[:promoted]:
        version = record["promoted_version"]
        _replay_iteration(trainer, cfg, lake, record)
        # as it lies: a checkpoint changed since its promotion is what the comparison reports, version by version
        original = checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, version), checked=False)
        replayed = trainer.model.state_dict()
        diff = max(float((replayed[k].detach().cpu() - v).abs().max()) for k, v in original.items())
        out.append({"version": version, "max_abs_diff": diff})
        progress_hook({"event": "version", **out[-1]})
        if to_run_id:
            checkpoints.save_checkpoint(
                lake, to_run_id, version, trainer.model, tokenizer, trainer.optimizer, {"replayed_from": run_id}
            )
            checkpoints.promote(lake, to_run_id, version)
    return out
