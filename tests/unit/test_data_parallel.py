"""Data-parallel training (`resources.train_ranks`): two trainer processes over gloo give the batch gradient of one.

Each test builds a real `DataParallelTrainer` (a spawned rank 1, collectives over `torch.distributed`) beside a
`PolicyTrainer` fed the same micro-batches, and compares weights and figures after several optimizer steps."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import signal

import pytest
import torch

from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer, RolloutGroup
from tasks.train_ranks import DataParallelTrainer, TrainRankError, split_groups
from tasks.workers import ended

KILLED = re.escape(f"({ended(-9)})")  # how a SIGKILLed rank is said to have ended

torch.set_num_threads(1)

VOCAB = 40
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _group(seed: int, version: int = 0, lens=(3, 1, 4, 2)) -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, VOCAB, (8,), generator=gen).tolist()
    responses = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]
    rewards = torch.rand(len(lens), generator=gen).tolist()
    behaviour = [(-2.0 - torch.rand(n, generator=gen)).tolist() for n in lens]
    return RolloutGroup(prompt, responses, rewards, behaviour, [[version] * n for n in lens])


def _flat(seed: int) -> RolloutGroup:
    """A group whose rewards are all equal: zero advantage."""
    return dataclasses.replace(_group(seed), rewards=[1.0] * 4)


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _pair(loss: LossSettings, kl: bool = False, shard: bool = False, **kwargs):
    one = build_tiny_model(VOCAB, seed=0, **TINY)
    two = copy.deepcopy(one)
    ref = (lambda m: copy.deepcopy(m).requires_grad_(False)) if kl else (lambda m: None)
    kw = dict(lr=1e-2, grad_clip=1.0, loss=loss, shared_prompt=True, **kwargs)
    dp = DataParallelTrainer(two, ref(two), ranks=2, threads=1, shard_optimizer=shard, **kw)
    return PolicyTrainer(one, ref(one), **kw), dp


def test_two_ranks_equal_one_with_kl_and_ppo_mini_batches():
    """Three batches of five micro-batches of three groups (the second batch in two PPO mini-batches, the later one
    on behaviour log-probs), with a KL term to the reference that rank 1 receives once: weights within 1e-5 of one
    process, the loss and counts the same, and each micro-batch split between the two ranks."""
    one, two = _pair(LossSettings(kl_coef=0.1), kl=True)
    try:
        v0 = copy.deepcopy(one.model)
        plan = [[5], [2, 3], [5]]  # micro-batches per optimizer step
        seed = 0
        for batch, steps in enumerate(plan):
            for m, n in enumerate(steps):
                for _ in range(n):
                    seed += 3
                    for t in (one, two):
                        t.micro_step([_group(seed), _group(seed + 1), _group(seed + 2)], batch, behavior_old=m > 0)
                a, b = one.optimizer_step(), two.optimizer_step()
                assert two.rank_micro_batches == [n, n]  # one part of each micro-batch per rank
                assert b["train/samples"] == a["train/samples"] and b["train/tokens"] == a["train/tokens"]
                assert a["train/micro_batches"] == n and b["train/micro_batches"] == 2 * n  # forward passes
                assert b["train/ranks"] == 2.0 and "train/ranks" not in a
                for key in ("loss/policy", "kl/mean", "grad/norm", "entropy/mean", "clip/fraction"):
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
                diff = _max_diff(one.model, two.model)
                assert diff <= 1e-5, f"step {batch}.{m}: two ranks differ from one by {diff}"
        assert a["kl/mean"] > 0  # the reference was used and had drifted from the policy
        assert _max_diff(one.model, v0) > 1e-3  # and training moved the weights
    finally:
        two.close()


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded-optimizer"])
def test_decoupled_recompute_sends_the_proximal_weights(shard):
    """Async's decoupled loss with `prox_logp: recompute`: tokens two versions behind need the weights of one version
    back, which rank 1 gets from rank 0 with each batch (with a sharded optimizer every rank keeps them itself before
    its step: nothing is broadcast); the figures (is-weights, proximal time) come from both."""
    one, two = _pair(LossSettings(decoupled=True, prox_logp="recompute", is_cap=None), shard=shard)
    try:
        for version in range(4):
            for j in range(4):
                g = [_group(10 * version + j + k, version=max(0, version - 2 + k)) for k in range(2)]
                for t in (one, two):
                    t.micro_step(g, version)
            a, b = one.optimizer_step(), two.optimizer_step()
            assert two.rank_micro_batches == [4, 4]
            assert b["is_weight/max"] == pytest.approx(a["is_weight/max"], rel=1e-5)
            assert b["is_weight/mean"] == pytest.approx(a["is_weight/mean"], rel=1e-5)
            diff = _max_diff(one.model, two.model)
            assert diff <= 1e-5, f"version {version}: two ranks differ from one by {diff}"
        assert two.prox_version == one.prox_version == 3
        assert _max_diff(one.prox_model, two.prox_model) <= 1e-5
    finally:
        two.close()


def test_zero_advantage_groups_stay_on_rank_0_uncounted_in_the_split():
    """Groups with zero advantage are only counted (`train.skip_zero_advantage`): rank 0 keeps them, the split
    balances the others, a micro-batch of them alone reaches no other rank, and a batch of them alone still steps
    (AdamW's moments) as one process running every group does: weights within 1e-5 of it."""
    one, two = _pair(LossSettings())
    one.loss = LossSettings(skip_zero_advantage=False)
    try:
        batches = [
            [[_flat(1), _group(2), _flat(3), _group(4)], [_flat(5), _flat(6)], [_group(7), _group(8)]],
            [[_flat(9)], [_flat(10), _flat(11)]],
        ]
        for batch in batches:
            for mb in batch:
                for t in (one, two):
                    t.micro_step(mb)
            if batch is batches[0]:
                signal = [g for mb in batch for g in mb if not two.skips(g)]
                assert sum(two.rank_tokens) == sum(len(g.prompt_ids) + sum(map(len, g.responses)) for g in signal)
                assert two.rank_micro_batches == [2, 2]  # the micro-batch of zero groups went nowhere
            else:
                assert two.rank_micro_batches == [0, 0] and two.rank_tokens == [0, 0]
            a, b = one.optimizer_step(), two.optimizer_step()
            assert a["train/skipped_groups"] == 0.0
            assert b["train/skipped_groups"] == a["adv/zero_groups"] == (4.0 if batch is batches[0] else 3.0)
            for key in ("loss/policy", "grad/norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key
            diff = _max_diff(one.model, two.model)
            assert diff <= 1e-5, f"two ranks differ from one by {diff}"
    finally:
        two.close()


def test_a_rank_that_dies_is_named_and_the_trainer_closes():
    """Rank 1 SIGKILLed mid-batch: the next call that needs it names it and its exit code, every later call is
    refused with that reason, `close` returns, and this process can make another data-parallel trainer."""
    _, two = _pair(LossSettings())
    try:
        two.micro_step([_group(1), _group(2)])
        proc = two._procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        with pytest.raises(TrainRankError, match=r"^trainer rank 1 \(pid \d+\) died " + KILLED + r"$"):
            two.optimizer_step()
        with pytest.raises(TrainRankError, match=r"cannot go on: trainer rank 1 \(pid \d+\) died"):
            two.micro_step([_group(3)])
    finally:
        two.close()
    assert not proc.is_alive()
    _, again = _pair(LossSettings())
    again.close()


def test_a_rank_that_dies_inside_the_gradient_sum_is_named(monkeypatch):
    """Rank 1 gone after it answered `collect`, while rank 0 is in the collective: gloo's "connection closed" becomes
    an error naming the rank, and the trainer closes."""
    import tasks.train_ranks

    _, two = _pair(LossSettings())
    real = tasks.train_ranks.sum_gradients

    def killed_first(module, dst=0, wait=None):
        proc = two._procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        real(module, dst, wait=wait)

    monkeypatch.setattr(tasks.train_ranks, "sum_gradients", killed_first)
    try:
        two.micro_step([_group(1), _group(2)])
        with pytest.raises(
            TrainRankError,
            match=r"^trainer rank 1 \(pid \d+\) died " + KILLED + r" during the gradient sum(: [^\n]*closed[^\n]*)?$",
        ):
            two.optimizer_step()
        with pytest.raises(TrainRankError, match="cannot go on: trainer rank 1 .* during the gradient sum"):
            two.micro_step([_group(3)])
    finally:
        two.close()


def test_a_rank_that_stops_answering_breaks_the_trainer_for_good():
    """Rank 1 stopped (SIGSTOP) before it answers `collect`: after the timeout the step fails naming it, and every
    later call is refused (the ranks now wait for different messages: a next collective would hang)."""
    _, two = _pair(LossSettings())
    proc = two._procs[0]
    try:
        two.micro_step([_group(1), _group(2)])
        os.kill(proc.pid, signal.SIGSTOP)
        two.reply_timeout_s = 1.0
        with pytest.raises(TrainRankError, match=r"trainer rank 1 \(pid \d+\) sent no 'collected' within 1 s"):
            two.optimizer_step()
        with pytest.raises(TrainRankError, match="cannot go on: TrainRankError: trainer rank 1 .* sent no 'collected'"):
            two.micro_step([_group(3), _group(4)])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        two.close()
    assert not proc.is_alive() and proc.exitcode == 0  # it read `close` as the verdict and left (not killed)


def test_a_failed_micro_step_on_another_rank_refuses_the_step():
    """A micro-batch rank 1 cannot compute (a token id outside the vocabulary): the optimizer step raises its
    traceback and is not applied on any rank; the next batch trains on both ranks again."""
    one, two = _pair(LossSettings())
    try:
        before = copy.deepcopy(two.model)
        bad = _group(1)
        bad.responses[0][0] = VOCAB + 5
        two.micro_step([bad, _group(2)])  # the first group goes to rank 1 (ties: the other ranks first)
        with pytest.raises(TrainRankError, match=r"trainer rank 1 failed a micro-step(.|\n)*IndexError"):
            two.optimizer_step()
        assert _max_diff(before, two.model) == 0.0
        assert all(p.grad is None for p in two.model.parameters())
        for j in range(3):
            for t in (one, two):
                t.micro_step([_group(10 + j), _group(20 + j)])
        one.optimizer_step(), two.optimizer_step()
        assert two.rank_micro_batches == [3, 3]
        assert _max_diff(one.model, two.model) <= 1e-5
    finally:
        two.close()


def test_one_process_group_at_a_time():
    _, two = _pair(LossSettings())
    try:
        with pytest.raises(TrainRankError, match="already belongs to a torch.distributed process group"):
            _pair(LossSettings())
    finally:
        two.close()


def test_split_groups_balances_packed_tokens_over_the_batch():
    """Each group to the rank with the fewest tokens so far in the batch (ties: rank 1 first): single-group
    micro-batches alternate, and a large group is balanced by the next ones."""
    small, large = (_group(s, lens=(1,) * 4) for s in range(2)), _group(9, lens=(10,) * 4)  # 12 and 48 tokens
    a, b = small
    loads = [0, 0]
    assert split_groups([a], loads, shared=True) == [[], [a]] and loads == [0, 12]
    assert split_groups([b], loads, shared=True) == [[b], []] and loads == [12, 12]
    assert split_groups([large, a, b], loads, shared=True) == [[a, b], [large]] and loads == [36, 60]
    assert split_groups([a], loads, shared=False) == [[a], []] and loads == [72, 60]  # unshared: 4 x (8 + 1)
    three = [0, 0, 0]
    assert split_groups([a, b, large, a], three, shared=True) == [[large], [a, a], [b]] and three == [48, 24, 12]


def test_sum_gradients_keeps_a_parameter_no_rank_has_a_gradient_for_without_one():
    """AdamW skips a parameter whose gradient is None (no decay, no moment update), so the sum must leave None where
    no rank had a gradient, not a zero: here in a one-rank group, where the sum is the rank's own gradient."""
    import torch.distributed as dist

    from models.data_parallel import sum_gradients

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        net[0](torch.ones(1, 3)).sum().backward()  # the second layer takes no part
        expected = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
        sum_gradients(net)
        for p, e in zip(net.parameters(), expected):
            assert (p.grad is None) == (e is None)
            if e is not None:
                assert torch.equal(p.grad, e)
        assert [p.grad is None for p in net.parameters()] == [False, False, True, True]
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_with_the_overlong_punishment():
    """DAPO's overlong punishment across ranks: groups it makes unequal (equal task rewards, lengths in its ramp) are
    trained on either rank, groups it leaves equal stay on rank 0 skipped; weights within 1e-5 of one process, and its
    figures over every sample of both ranks."""
    one, two = _pair(LossSettings(overlong=(4, 2, 1.0)))  # lengths 1, 2 -> 0; 3 -> -0.5; 4 -> -1
    try:
        v0 = copy.deepcopy(one.model)
        for batch in range(2):
            for seed in range(4 * batch, 4 * batch + 4):
                short = _group(seed + 200, lens=(1, 1, 1, 1))  # unpunished: trained if its rewards differ
                if seed % 2:
                    short = dataclasses.replace(short, rewards=[1.0] * 4)  # all equal and unpunished: skipped
                groups = [_group(seed), _flat(seed + 100), short]  # _flat: lengths 3, 1, 4, 2, so trained
                for t in (one, two):
                    t.micro_step(groups, batch)
            a, b = one.optimizer_step(), two.optimizer_step()
            assert a["train/skipped_groups"] == b["train/skipped_groups"] == 2.0
            for key in ("reward/overlong_penalty", "reward/overlong_fraction", "loss/policy"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
            assert a["reward/overlong_penalty"] == pytest.approx(-1.5 * 8 / 48)  # two punished groups a micro-batch
            assert sum(two.rank_micro_batches[1:]) > 0
            assert _max_diff(one.model, two.model) <= 1e-5
        assert _max_diff(one.model, v0) > 1e-3
    finally:
        two.close()


def test_two_ranks_with_chunked_log_probs_equal_one_with_the_whole_logits():
    """`logits_chunk_tokens` given to a two-rank trainer (its replicas get it: `test_logits_chunking.py`) against one
    process with the whole logits, with a KL term: weights within 1e-5 after two batches, the loss, the KL and the
    entropy figures the same."""
    one = build_tiny_model(VOCAB, seed=0, **TINY)
    two = copy.deepcopy(one)
    kw = dict(lr=1e-2, grad_clip=1.0, loss=LossSettings(kl_coef=0.1), shared_prompt=True)
    frozen = lambda m: copy.deepcopy(m).requires_grad_(False)  # noqa: E731
    plain = PolicyTrainer(one, frozen(one), **kw)
    chunked = DataParallelTrainer(
        two, frozen(two), ranks=2, threads=1, shard_optimizer=False, logits_chunk_tokens=5, **kw
    )
    try:
        assert chunked.logits_chunk_tokens == 5
        v0 = copy.deepcopy(one)
        for batch in range(2):
            for seed in range(0, 12, 3):
                for t in (plain, chunked):
                    t.micro_step([_group(seed + batch), _group(seed + 1), _group(seed + 2)], batch)
            a, b = plain.optimizer_step(), chunked.optimizer_step()
            for key in ("loss/policy", "kl/mean", "entropy/mean"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
            assert sum(chunked.rank_micro_batches[1:]) > 0
            assert _max_diff(plain.model, chunked.model) <= 1e-5
        assert _max_diff(plain.model, v0) > 1e-3
    finally:
        chunked.close()
