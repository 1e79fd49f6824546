"""Two data-parallel trainer ranks equal one trainer (`resources.train_ranks: 2`, DESIGN.md's Propositions 1-2 across
processes): the same periodic run, 3 iterations, gives token-identical rollouts and parameters within 1e-5 (fp32),
with both ranks training a share of every batch; and so do two ranks that shard the optimizer
(`resources.shard_optimizer`: each steps AdamW for half of the parameters, and every checkpoint's optimizer state is
gathered from both). Negative control: rank 0 stepping on its own share of the gradient alone (rank 1's left out of
the sum) breaks the same assertion."""

from __future__ import annotations

import models.data_parallel
import tasks.train_ranks
from tests.integration.runs import final_params, trained

ITERS = 3


def _run(tmp_path, name, ranks: int, shard: bool = False):
    settings = {"run.iterations": ITERS, "resources.train_ranks": ranks, "resources.shard_optimizer": shard}
    return trained(tmp_path, name, settings)


def _max_param_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_trainer_ranks_equal_one_and_negative_control(tmp_path, monkeypatch):
    shares = []
    real_step = tasks.train_ranks.DataParallelTrainer.optimizer_step

    def spy(self):
        figures = real_step(self)
        shares.append((list(self.rank_micro_batches), type(self.optimizer).__name__))
        assert figures["train/ranks"] == 2.0
        return figures

    monkeypatch.setattr(tasks.train_ranks.DataParallelTrainer, "optimizer_step", spy)
    one_params, one_samples = _run(tmp_path, "one", 1)
    two_params, two_samples = _run(tmp_path, "two", 2)
    sharded_params, sharded_samples = _run(tmp_path, "sharded", 2, shard=True)
    assert len(shares) == 2 * ITERS and all(s[0] > 0 and s[1] > 0 for s, _ in shares), shares
    assert [kind for _, kind in shares] == ["AdamW"] * ITERS + ["ShardedOptimizer"] * ITERS
    assert one_samples.keys() == two_samples.keys() and len(one_samples) == ITERS * 8 * 4
    assert all(a.response_ids == two_samples[k].response_ids for k, a in one_samples.items())
    assert _max_param_diff(one_params, final_params(str(tmp_path / "lake"), "one", 0)) > 1e-3  # training moved them
    diff = _max_param_diff(one_params, two_params)
    assert diff <= 1e-5, f"two trainer ranks differ from one by {diff}"
    assert all(a.response_ids == sharded_samples[k].response_ids for k, a in one_samples.items())
    diff = _max_param_diff(one_params, sharded_params)
    assert diff <= 1e-5, f"two ranks sharding the optimizer differ from one by {diff}"

    real_sum = models.data_parallel.sum_gradients

    def own_share_only(module, dst=0, **kwargs):  # on rank 0 (this process): the sum taken, rank 1's part dropped
        own = {p: None if p.grad is None else p.grad.clone() for p in module.parameters()}
        real_sum(module, dst, **kwargs)
        for p, g in own.items():
            p.grad = g

    monkeypatch.setattr(tasks.train_ranks, "sum_gradients", own_share_only)
    bad_params, _ = _run(tmp_path, "own-share", 2)
    bad = _max_param_diff(one_params, bad_params)
    assert bad > 1e-5, f"negative control went unnoticed: {bad}"
