"""Periodic asynchrony equals synchronous training (DESIGN.md, Propositions 1-2).

Same seed, 3 iterations: the rollouts must be token-identical and the parameters equal within 1e-5 (fp32).
The sync run's workers load each version from its promoted checkpoint (`pipeline.push_weights: false`), the
periodic run's get it through shared memory while the checkpoint is written in the background: both weight
paths are covered by the same assertion.
Negative control: a trainer that trains one shard twice (what a watcher that re-reads a shard would do)
must break the same assertion, so the test can tell a wrong pipeline from a right one.
"""

from __future__ import annotations

import torch

import tasks.iteration
from tests.integration.runs import final_params, trained

ITERS = 3


def _max_param_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run(tmp_path, name, mode, **extra):
    return trained(tmp_path, name, {"pipeline.mode": mode, "run.iterations": ITERS, **extra})


def test_periodic_equals_sync_and_negative_control(tmp_path, monkeypatch):
    sync_params, sync_samples = _run(tmp_path, "sync", "sync", **{"pipeline.push_weights": False})
    per_params, per_samples = _run(tmp_path, "periodic", "periodic")
    v0 = final_params(str(tmp_path / "lake"), "sync", 0)

    # token-identical rollouts, same behaviour log-probs and rewards
    assert sync_samples.keys() == per_samples.keys()
    assert len(sync_samples) == ITERS * 8 * 4
    for key, a in sync_samples.items():
        b = per_samples[key]
        assert a.response_ids == b.response_ids, key
        assert a.reward == b.reward, key
        assert max((abs(x - y) for x, y in zip(a.behavior_logprobs, b.behavior_logprobs)), default=0.0) < 1e-6
    # the rewards varied, so the gradient was not trivially zero, and training moved the weights
    assert len({r.reward for r in sync_samples.values()}) > 1
    assert _max_param_diff(sync_params, v0) > 1e-3
    diff = _max_param_diff(sync_params, per_params)
    assert diff <= 1e-5, f"periodic differs from sync by {diff}"

    # negative control: train every micro-batch of the first shard twice
    original = tasks.iteration.micro_batches
    calls = {"n": 0}

    def twice(groups, budget, shared):
        calls["n"] += 1
        mbs = original(groups, budget, shared)
        return mbs + mbs if calls["n"] == 1 else mbs

    monkeypatch.setattr(tasks.iteration, "micro_batches", twice)
    bad_params, _ = _run(tmp_path, "double", "periodic")
    assert calls["n"] > 1
    bad = _max_param_diff(sync_params, bad_params)
    assert bad > 1e-5, f"negative control went unnoticed: {bad}"
    assert torch.isfinite(torch.tensor(bad))


def test_ppo_mini_batches_with_two_workers_equal_sync(tmp_path):
    """Two optimizer steps per batch (`algorithm.ppo_mini_batches: 2`): shards land in any order from two workers,
    a group of the second mini-batch waits for the first step, and the result still equals sync training."""
    mb = {"algorithm.ppo_mini_batches": 2}
    sync_params, sync_samples = _run(tmp_path, "sync-mb", "sync", **mb)
    per_params, per_samples = _run(tmp_path, "periodic-mb", "periodic", **mb, **{"resources.rollout_workers": 2})
    assert sync_samples.keys() == per_samples.keys()
    assert all(a.response_ids == per_samples[k].response_ids for k, a in sync_samples.items())
    diff = _max_param_diff(sync_params, per_params)
    assert diff <= 1e-5, f"periodic with mini-batches differs from sync by {diff}"
    one_params, _ = _run(tmp_path, "sync-one", "sync")  # control: one step per batch is another update
    assert _max_param_diff(sync_params, one_params) > 1e-4
