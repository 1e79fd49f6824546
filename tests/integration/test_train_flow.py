"""A 2-iteration run through the real Prefect flow, lake and MLflow (issue 2's integration test)."""

from __future__ import annotations

import json
import os
import uuid

import torch
from mlflow.tracking import MlflowClient

from flows.train import train_flow
from models.engine import sample_seed
from storage import lease, ledger
from storage.checkpoints import verify_checkpoint
from storage.lake import Lake
from storage.shards import read_shard, table_to_records
from tests.integration.runs import all_samples, final_params, write_config


def test_two_iterations_through_prefect(tmp_path):
    rid = f"flow2-{uuid.uuid4().hex[:8]}"  # Prefect artifacts outlive the test's lake: keys must be new
    cfg = write_config(
        tmp_path, rid, {"run.iterations": 2, "lake.keep_optimizer_state": 1, "resources.borrow_rollout_threads": True}
    )
    summary = train_flow(config_path=cfg)
    lake_uri = str(tmp_path / "lake")
    lake = Lake(lake_uri)
    # the run's lease was held (its LOCK file) and is given back with the session: `lockstep resume` may follow
    assert (tmp_path / f"lake/runs/{rid}/LOCK").exists() and lease.holder(lake, rid) is None

    # the ephemeral Prefect API server this run started yields the CPU to rollout and training (nice 10)
    from prefect.server.api.server import SubprocessASGIServer

    servers = [
        x.server_process
        for x in SubprocessASGIServer._instances.values()
        if getattr(x, "server_process", None) is not None and x.server_process.poll() is None
    ]
    assert servers and all(os.getpriority(os.PRIO_PROCESS, p.pid) >= 10 for p in servers)

    # every parameter tensor changed between v0 and v2
    v0, v2 = final_params(lake_uri, rid, 0), final_params(lake_uri, rid, 2)
    assert v0.keys() == v2.keys()
    unchanged = [k for k in v0 if torch.equal(v0[k], v2[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"

    # retention (keep_optimizer_state 1): only the promoted v2 keeps AdamW's moments; v1 still verifies
    ckpt = tmp_path / f"lake/runs/{rid}/checkpoints"
    assert not (ckpt / "v000001/trainer_state/optimizer.safetensors").exists()
    assert (ckpt / "v000002/trainer_state/optimizer.safetensors").exists()
    verify_checkpoint(lake, lake.checkpoint_dir(rid, 1))

    # shards: 8 groups x 4 samples per iteration, all of their own iteration's version
    samples = all_samples(lake_uri, rid)
    assert len(samples) == 2 * 8 * 4
    assert all(r.policy_version == r.iteration for r in samples.values())
    assert all(set(r.token_versions) <= {r.iteration} for r in samples.values())

    # ledger: both iterations promoted, with their shards' checksums
    records = ledger.read_all(lake, rid)
    assert [r["state"] for r in records] == ["promoted", "promoted"]
    assert [r["promoted_version"] for r in records] == [1, 2]
    assert sum(sh["groups"] for sh in records[0]["shards"]) == 8
    assert [h["state"] for h in records[0]["history"]] == ["planned", "rolling_out", "trained", "promoted"]
    # each iteration's plan is cut into chunks of pipeline.shard_groups (2) groups, each published and trained
    # once, every sample seeded by (run seed, iteration, prompt, index)
    for rec in records:
        assert len({sh["path"] for sh in rec["shards"]}) == 4 and [sh["groups"] for sh in rec["shards"]] == [2] * 4
        chunks = {}
        for sh in rec["shards"]:
            rows = table_to_records(read_shard(lake, sh["path"], sh["checksum"]))
            chunks[int(sh["path"].rsplit("-", 1)[1].removesuffix(".arrow"))] = list(
                dict.fromkeys(r.prompt_id for r in rows)
            )
            assert [r.seed for r in rows] == [sample_seed(3, r.iteration, r.prompt_id, r.sample_index) for r in rows]
        plan = rec["prompt_ids"]
        assert [chunks[i] for i in sorted(chunks)] == [plan[i : i + 2] for i in range(0, 8, 2)]
    # the groups whose rewards are all equal were counted, not trained (train.skip_zero_advantage, the default)
    for rec in records:
        rewards: dict[int, set] = {}
        for r in samples.values():
            if r.iteration == rec["iteration"]:
                rewards.setdefault(r.prompt_id, set()).add(r.reward)
        flat = sum(len(v) == 1 for v in rewards.values())
        fig = rec["figures"]
        assert fig["train/skipped_groups"] == fig["adv/zero_groups"] == flat and fig["train/samples"] == 8 * 4
        assert fig["train/skipped_tokens"] == sum(
            len(r.response_ids)
            for r in samples.values()
            if r.iteration == rec["iteration"] and len(rewards[r.prompt_id]) == 1
        )

    # summary.json and the frozen config
    on_disk = json.loads((tmp_path / f"lake/runs/{rid}/summary.json").read_text())
    assert on_disk["promoted_version"] == 2 and on_disk["mode"] == "periodic" and on_disk["iterations"] == 2
    assert 0.0 <= on_disk["eval_accuracy_final"] <= 1.0
    assert summary["run_id"] == rid
    frozen = json.loads((tmp_path / f"lake/runs/{rid}/config.json").read_text())
    assert frozen["run"]["run_id"] == rid and frozen["rollout"]["group_size"] == 4

    # MLflow: reward/mean for steps 0, 1 and eval/accuracy for steps 0, 1, 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`lockstep.run_id` = '{rid}'")
    assert run.info.status == "FINISHED"
    reward_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/mean"))
    acc_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy"))
    assert reward_steps == [0, 1]
    assert acc_steps == [0, 1, 2]
    for name in (
        "loss/policy",
        "entropy/mean",
        "mismatch/logp_abs",
        "perf/samples_per_s",
        "time/first_shard_s",
        "time/reward_s",
        "perf/overhead_fraction",
        "staleness/max",
    ):
        assert len(client.get_metric_history(run.info.run_id, name)) == 2, name
    # once its rollouts were in, each batch finished with the idle worker's thread too (1 + 1 on 2 cores)
    threads = client.get_metric_history(run.info.run_id, "train/threads")
    assert [m.value for m in threads] == [float(min(os.cpu_count(), 2))] * 2
    # memory per iteration: the flow's process holds torch and the model, each worker its engine and weights
    if os.path.exists("/proc/self/statm"):
        for name in ("mem/rss_mb", "mem/rollout_workers_rss_mb"):
            values = [m.value for m in client.get_metric_history(run.info.run_id, name)]
            assert len(values) == 2 and all(100 < v < 20_000 for v in values), (name, values)
    # on-policy: the trainer's log-probs of the sampled tokens equal the engine's
    mismatch = client.get_metric_history(run.info.run_id, "mismatch/logp_abs")
    assert max(m.value for m in mismatch) < 1e-4
    assert run.data.params["rollout.group_size"] == "4"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "curves.png"} <= artifacts

    # a Prefect markdown artifact per iteration with the reward statistics and the worst samples
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as prefect:
        arts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"{rid}-iter-0", f"{rid}-iter-1"]))
        )
    assert sorted(a.key for a in arts) == [f"{rid}-iter-0", f"{rid}-iter-1"]
    assert all("lowest-reward samples" in a.data and "reward mean" in a.data for a in arts)
