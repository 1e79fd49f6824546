"""Dynamic sampling through the real flow (`algorithm.dynamic_sampling`).

Groups of 2 after a short bootstrap: many have equal rewards, so iterations refill their batch from later rounds.
Asserted: periodic equals sync (token-identical rollouts, parameters within 1e-5); each iteration trained exactly
the first `prompts_per_iteration` groups with unequal rewards in plan order, round after round, and planned another
round exactly while it was short, of the size expected (both recomputed here from the stored shards); the catalog
gives an advantage to the trained samples only; replay from the lake reproduces every version; an iteration that
fails after planning its second round resumes to the uninterrupted run's weights, reusing every shard it had stored
as it was.
"""

from __future__ import annotations

import pytest

import tasks.iteration
from flows.replay import replay_flow
from flows.train import train_flow
from storage import catalog, ledger
from storage.lake import Lake
from tasks.iteration import chunk_index
from tests.integration.runs import all_samples, final_params, trained, write_config

ITERS = 2
B = 8
SETTINGS = {
    "run.iterations": ITERS,
    "algorithm.dynamic_sampling": True,
    "algorithm.dynamic_sampling_rounds": 3,
    "rollout.group_size": 2,
    "pipeline.catalog_compact_every": 1,
}


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _expected(record: dict, samples: dict, k: int) -> tuple[list[int], list[int]]:
    """(the batch's prompt ids, the size each round should have had) recomputed from the iteration's stored samples
    and its plan: a later round asks for the missing groups over the share kept, in whole chunks (shard_groups 2)."""
    rewards: dict[int, list[float]] = {}
    for (it, _, _), r in samples.items():
        if it == k:
            rewards.setdefault(r.prompt_id, []).append(r.reward)
    kept, start, sizes = [], 0, [B]
    for size in record["rounds"]:
        for pid in record["prompt_ids"][start : start + size]:
            if max(rewards[pid]) > min(rewards[pid]) and len(kept) < B:
                kept.append(pid)
        start += size
        if len(kept) < B and len(sizes) < SETTINGS["algorithm.dynamic_sampling_rounds"]:
            wanted = -(-(B - len(kept)) * start // len(kept)) if kept else B
            sizes.append(min(B, -(-wanted // 2) * 2))
    return kept, sizes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The sync run and the periodic run (two workers) in one lake: (its folder, {mode: (weights, samples)})."""
    tmp_path = tmp_path_factory.mktemp("dynamic-sampling")
    return tmp_path, {
        "sync": trained(tmp_path, "sync", {**SETTINGS, "pipeline.mode": "sync", "pipeline.push_weights": False}),
        "periodic": trained(
            tmp_path, "periodic", {**SETTINGS, "pipeline.mode": "periodic", "resources.rollout_workers": 2}
        ),
    }


def test_dynamic_sampling_periodic_equals_sync_trains_the_first_kept_groups_and_replays(runs):
    tmp_path, by_mode = runs
    (sync_params, sync_samples), (per_params, per_samples) = by_mode["sync"], by_mode["periodic"]
    lake_uri = str(tmp_path / "lake")
    lake = Lake(lake_uri)
    assert sync_samples.keys() == per_samples.keys()
    assert all(a.response_ids == per_samples[key].response_ids for key, a in sync_samples.items())
    diff = _diff(sync_params, per_params)
    assert diff <= 1e-5, f"periodic differs from sync by {diff}"
    assert _diff(sync_params, final_params(lake_uri, "sync", 0)) > 1e-3

    refilled = dropped = 0
    for name, samples in (("sync", sync_samples), ("periodic", per_samples)):
        for k in range(ITERS):
            rec = ledger.read_record(lake, name, k)
            kept, sizes = _expected(rec, samples, k)
            decided = rec["dynamic_sampling"]
            assert decided["trained"] == kept and not decided["fallback"], (name, k)
            assert rec["rounds"] == sizes, (name, k)  # another round exactly while short, of the size expected
            assert rec["figures"]["filter/kept_groups"] == len(kept)
            assert rec["figures"]["train/samples"] == 2 * len(kept)
            assert {r.prompt_id for (it, _, _), r in samples.items() if it == k} == set(rec["prompt_ids"])
            refilled += len(rec["rounds"]) > 1
            dropped += len(decided["dropped"])
    assert refilled >= 2 and dropped >= 4  # the rounds and the filter were exercised, not only planned

    uri = catalog.catalog_uri(lake, "periodic")
    rows = catalog.query(uri, catalog.ROLLOUTS).to_pylist()
    assert len(rows) == sum(1 for key in per_samples)  # every stored sample, trained or not
    for row in rows:
        rec_trained = ledger.read_record(lake, "periodic", row["iteration"])["dynamic_sampling"]["trained"]
        assert (row["advantage"] is not None) == (row["prompt_id"] in rec_trained), row["sample_id"]

    replayed = replay_flow("periodic", lake_uri)
    assert [r["version"] for r in replayed] == [1, 2]
    assert max(r["max_abs_diff"] for r in replayed) <= 1e-5


def test_an_iteration_failed_after_its_second_round_resumes_to_the_same_weights(runs, monkeypatch):
    tmp_path, by_mode = runs
    ref_params, ref_samples = by_mode["periodic"]  # (two workers; one here: the same samples, the same weights)
    real = tasks.iteration.plan_round
    state = {"failed": False}

    def flaky(s, run_id, iteration, count):
        new = real(s, run_id, iteration, count)
        if new and not state["failed"]:  # the first round planned after the first: recorded, then a failure
            state["failed"] = True
            raise ConnectionError("transient storage outage")
        return new

    monkeypatch.setattr(tasks.iteration, "plan_round", flaky)
    path = write_config(tmp_path, "flaky", {**SETTINGS, "pipeline.mode": "periodic"})
    with pytest.raises(ConnectionError):
        train_flow(config_path=path)
    lake_uri = str(tmp_path / "lake")
    lake = Lake(lake_uri)
    failed = next(r for r in ledger.read_all(lake, "flaky") if r["state"] == "failed")
    assert len(failed["rounds"]) == 2  # the second round was recorded before the failure
    stored = {p: lake.fs.info(p)["mtime"] for p in lake.fs.glob(f"{lake.run_dir('flaky')}/rollouts/*/*/*.arrow")}
    summary = train_flow(config_path=path, resume=True)
    assert summary["promoted_version"] == ITERS
    assert _diff(ref_params, final_params(lake_uri, "flaky", ITERS)) <= 1e-5
    samples = all_samples(lake_uri, "flaky")
    assert samples.keys() == ref_samples.keys()
    assert all(samples[key].response_ids == r.response_ids for key, r in ref_samples.items())
    resumed = ledger.read_record(lake, "flaky", failed["iteration"])
    assert resumed["state"] == "promoted"
    # every shard stored before the failure was reused as it was (not written again: same file time), and named so
    assert stored and all(lake.fs.info(p)["mtime"] == t for p, t in stored.items())
    mine = {chunk_index(p) for p in stored if f"/iter-{failed['iteration']:06d}/" in p}
    assert mine and sorted(mine) == sorted(resumed["reused_chunks"])
