"""Groups with zero advantage (every reward equal) are counted, not run (`train.skip_zero_advantage`).

Each test trains the same batches with two trainers of the same weights, one skipping and one running every group,
and compares weights and figures after several optimizer steps; a forward hook counts the rows the policy ran."""

from __future__ import annotations

import copy

import pytest
import torch

from models.packing import Group, pack, packed_logits, token_logprobs
from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer, RolloutGroup

torch.set_num_threads(1)

VOCAB = 40
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
FLAT = (1.0, 1.0, 1.0, 1.0)  # every sample right: zero advantage


def _group(seed: int, rewards=None, lens=(3, 1, 4, 2), version: int = 0) -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, VOCAB, (8,), generator=gen).tolist()
    responses = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]
    if rewards is None:
        rewards = torch.rand(len(lens), generator=gen).tolist()
    behaviour = [(-2.0 - torch.rand(n, generator=gen)).tolist() for n in lens]
    return RolloutGroup(prompt, responses, list(rewards), behaviour, [[version] * n for n in lens])


def _batches() -> list[list[list[RolloutGroup]]]:
    """Three batches of micro-batches: zero-advantage groups mixed in (all right, all wrong, one sample, equal
    partial credit), a micro-batch of them alone, and a last batch of nothing else."""
    flat = [FLAT, (0.0,) * 4, (0.5,) * 4]
    return [
        [[_group(1), _group(2, flat[0]), _group(3)], [_group(4, flat[1]), _group(5, flat[2])], [_group(6)]],
        [[_group(7, flat[2]), _group(8), _group(9, (1.0,), lens=(5,))], [_group(10), _group(11, flat[0])]],
        [[_group(12, flat[0]), _group(13, flat[1])], [_group(14, flat[2], lens=(2, 6, 1, 3))]],
    ]


class RowCount:
    """Rows (samples, or groups in the shared layout) of every forward pass of a model."""

    def __init__(self, model: torch.nn.Module):
        self.rows = 0
        model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.rows += kwargs["input_ids"].shape[0]


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _train(trainer: PolicyTrainer, batches, version: int = 0, behavior_old: bool = False) -> list[dict]:
    figures = []
    for batch in batches:
        for mb in batch:
            trainer.micro_step(mb, version, behavior_old=behavior_old)
        figures.append(trainer.optimizer_step())
    return figures


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("shared_prompt", [True, False])
def test_skipping_gives_the_steps_of_running_every_group(loss_agg, shared_prompt):
    """Weights within 1e-5 (the periodic invariant's tolerance) after three AdamW steps at lr 1e-2 (the last batch
    all zero advantage: its gradient is 0 and AdamW's moments still move the weights), the same loss and counts, and
    the policy never runs a skipped group. The gradients differ by ~1e-7 relative (fp32 sums over other padded
    shapes; measured 1.2e-7 / 2.5e-7 unshared / shared), which AdamW's normalised steps carry to ~2e-6."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    kw = dict(lr=1e-2, grad_clip=1.0, shared_prompt=shared_prompt)
    skip = PolicyTrainer(model, None, loss=LossSettings(loss_agg=loss_agg, norm_len=6), **kw)
    run_all = PolicyTrainer(
        copy.deepcopy(model), None, loss=LossSettings(loss_agg=loss_agg, norm_len=6, skip_zero_advantage=False), **kw
    )
    rows_skip, rows_all = RowCount(skip.model), RowCount(run_all.model)
    batches = _batches()
    before_last = None
    figures = {"skip": [], "all": []}
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            before_last = copy.deepcopy(skip.model)
        figures["skip"] += _train(skip, [batch])
        figures["all"] += _train(run_all, [batch])

    assert _max_diff(skip.model, run_all.model) < 1e-5
    assert _max_diff(skip.model, before_last) > 1e-4  # the all-zero batch stepped (momentum), as without skipping
    for a, b in zip(figures["skip"], figures["all"], strict=True):
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-5, abs=1e-9)
        assert a["grad/norm"] == pytest.approx(b["grad/norm"], rel=1e-5, abs=1e-9)
        assert (a["adv/zero_groups"], a["train/samples"]) == (b["adv/zero_groups"], b["train/samples"])
        assert a["train/tokens"] + a["train/skipped_tokens"] == b["train/tokens"]
        assert b["train/skipped_groups"] == b["train/skipped_tokens"] == 0.0
    assert [f["train/skipped_groups"] for f in figures["skip"]] == [3.0, 3.0, 3.0]
    assert [f["adv/zero_groups"] for f in figures["skip"]] == [3.0, 3.0, 3.0]
    assert [f["train/skipped_tokens"] for f in figures["skip"]] == [30.0, 25.0, 32.0]
    assert figures["skip"][2]["train/tokens"] == 0.0 and figures["skip"][2]["loss/policy"] == 0.0
    # no token trained in the last batch: no entropy or mismatch figure (a 0 there would read as a collapse)
    assert "entropy/mean" not in figures["skip"][2] and "mismatch/logp_abs" not in figures["skip"][2]
    assert "entropy/mean" in figures["all"][2] and "entropy/mean" in figures["skip"][1]
    if not shared_prompt:  # one row per sample: the 5 groups with signal (20 samples) of 14 (53 samples)
        assert (rows_skip.rows, rows_all.rows) == (20, 53)


def test_dropping_the_groups_instead_changes_the_step():
    """Negative control: leaving the zero-advantage groups out of the batch altogether (DAPO's dynamic-sampling
    filter, which also drops their tokens from the loss normaliser) gives other weights, far beyond the 1e-5 above."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    skip = PolicyTrainer(model, None, lr=1e-2, grad_clip=1.0)
    dropped = PolicyTrainer(copy.deepcopy(model), None, lr=1e-2, grad_clip=1.0)
    batches = _batches()[:2]
    _train(skip, batches)
    kept = [[[g for g in mb if not skip.skips(g)] for mb in batch] for batch in batches]
    _train(dropped, [[mb for mb in batch if mb] for batch in kept])
    assert _max_diff(skip.model, dropped.model) > 1e-4


def test_nothing_is_skipped_with_a_kl_term():
    """With a KL term to the reference a zero-advantage group still has a gradient: every group is run."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    ref = copy.deepcopy(model).requires_grad_(False)
    trainer = PolicyTrainer(model, ref, lr=1e-2, loss=LossSettings(kl_coef=0.1), shared_prompt=True)
    rows = RowCount(model)
    group = _group(1, FLAT)
    assert not trainer.skips(group)
    trainer.micro_step([group, _group(2)])
    figures = trainer.optimizer_step()
    assert rows.rows == 2 and figures["train/skipped_groups"] == 0.0 and figures["adv/zero_groups"] == 1.0


def _stale(model: torch.nn.Module, group: RolloutGroup, noise: float, seed: int) -> RolloutGroup:
    """`group` as an older policy generated it: behaviour log-probs the model's own plus noise."""
    packed = pack([Group(group.prompt_ids, group.responses)], 0, shared=False)
    with torch.no_grad():
        lp = token_logprobs(packed_logits(model, packed), packed.targets)
    gen = torch.Generator().manual_seed(seed)
    out = copy.copy(group)
    out.behavior_logprobs = [
        (lp[i, : len(r)] + noise * torch.randn(len(r), generator=gen)).tolist() for i, r in enumerate(group.responses)
    ]
    return out


@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
def test_decoupled_ppo_skips_too(prox):
    """Off-policy batches (tokens 3 versions behind, decoupled PPO with the IS cap): the same weights within 1e-5,
    and recompute's proximal pass does not run the skipped groups either."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    kw = dict(lr=1e-2, grad_clip=1.0, shared_prompt=False)
    loss = dict(decoupled=True, prox_logp=prox, is_cap=2.0)
    skip = PolicyTrainer(model, None, loss=LossSettings(**loss), **kw)
    run_all = PolicyTrainer(copy.deepcopy(model), None, loss=LossSettings(skip_zero_advantage=False, **loss), **kw)
    for t in (skip, run_all):
        if t.prox_model is not None:
            t.prox_version = 3  # the proximal weights of trainer version 4 (copies of the initial ones here)
    prox_rows = [RowCount(t.prox_model) for t in (skip, run_all) if t.prox_model is not None]
    batch = [[_stale(model, _group(s, FLAT if s % 2 else None, version=1), 0.3, s) for s in range(1, 5)]]
    _train(skip, [batch], version=4)
    _train(run_all, [batch], version=4)
    assert _max_diff(skip.model, run_all.model) < 1e-5
    if prox_rows:  # one row per sample: the two groups with signal, of four
        assert [r.rows for r in prox_rows] == [8, 16]


@pytest.mark.parametrize(
    "variant",
    [
        dict(loss=dict(dual_clip=3.0, clip_high=0.28), behavior_old=True, clipped=True),
        dict(loss=dict(), behavior_old=True, clipped=True),  # a PPO mini-batch after the first: old = behaviour
        dict(loss=dict(decoupled=True, prox_logp="loglinear", is_mode="mask", is_cap=1.5)),
        dict(loss=dict(decoupled=True, prox_logp="loglinear", is_level="sequence")),
        dict(loss=dict(decoupled=True, prox_logp="linear", is_level="geometric", dual_clip=3.0)),
        dict(loss=dict(decoupled=True, prox_logp="metrics")),
    ],
    ids=["dual-clip", "behaviour-old", "is-mask", "is-sequence", "is-geometric", "metrics"],
)
def test_every_loss_variant_steps_alike(variant):
    """The dual clip, PPO mini-batches on behaviour log-probs, the importance-weight mask and its sequence and
    geometric levels, and metrics mode: the same loss, gradient norm (before clipping) and weights (1e-5) after two
    steps on batches whose behaviour log-probs are off the policy, every group's token 3 versions behind."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    kw = dict(lr=1e-2, grad_clip=1.0, shared_prompt=True)
    skip = PolicyTrainer(model, None, loss=LossSettings(**variant["loss"]), **kw)
    run_all = PolicyTrainer(
        copy.deepcopy(model), None, loss=LossSettings(skip_zero_advantage=False, **variant["loss"]), **kw
    )
    for t in (skip, run_all):
        if t.prox_model is not None:
            t.prox_version = 3
    behaviour_old = variant.get("behavior_old", False)
    for step in range(2):
        batch = [
            [_stale(model, _group(10 * step + s, FLAT if s % 3 == 0 else None, version=1), 0.5, s) for s in range(3)]
            for _ in range(2)
        ]
        a, b = (_train(t, [batch], version=4 + step, behavior_old=behaviour_old)[0] for t in (skip, run_all))
        assert a["train/skipped_groups"] == 2.0 and b["train/skipped_groups"] == 0.0
        for key in ("loss/policy", "grad/norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), key
        assert _max_diff(skip.model, run_all.model) < 1e-5
    assert b["grad/norm"] > 0
    if variant.get("clipped"):  # the trust region acted on the tokens run
        assert a["clip/fraction"] > 0 and b["clip/fraction"] > 0


def test_a_non_finite_reward_is_refused_not_skipped():
    """Rewards all inf are all equal, but the advantage estimators refuse them: the group is run, and refused."""
    trainer = PolicyTrainer(build_tiny_model(VOCAB, seed=0, **TINY), None, lr=1e-2)
    group = _group(1, (float("inf"),) * 4)
    assert not trainer.skips(group)
    with pytest.raises(ValueError, match="NaN or inf"):
        trainer.micro_step([group])


def test_a_parameter_no_forward_uses_stays_untouched_by_a_skipped_batch():
    """A trainable parameter the forward pass never uses has no gradient when the groups are run, so AdamW (with
    weight decay) leaves it alone; a batch of skipped groups zero-fills only what AdamW has stepped before."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    model.unused = torch.nn.Parameter(torch.ones(3))
    kw = dict(lr=1e-2, grad_clip=1.0, weight_decay=0.1)
    skip = PolicyTrainer(model, None, **kw)
    run_all = PolicyTrainer(copy.deepcopy(model), None, loss=LossSettings(skip_zero_advantage=False), **kw)
    for batch in ([[_group(1), _group(2, FLAT)]], [[_group(3, FLAT)]]):
        for t in (skip, run_all):
            _train(t, [batch])
    assert torch.equal(skip.model.unused, torch.ones(3)) and torch.equal(run_all.model.unused, torch.ones(3))
    assert _max_diff(skip.model, run_all.model) < 1e-5


def test_a_first_batch_with_nothing_to_learn_steps_as_running_it_would():
    """The run's first batch all zero advantage: no parameter has optimizer state yet, so every trainable one gets
    the zero gradient AdamW steps on (its step count, weight decay), as the backward passes would have given; the
    later batches then step as without skipping."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    kw = dict(lr=1e-2, grad_clip=1.0, weight_decay=0.1)
    skip = PolicyTrainer(model, None, **kw)
    run_all = PolicyTrainer(copy.deepcopy(model), None, loss=LossSettings(skip_zero_advantage=False), **kw)
    rows = RowCount(skip.model)
    batches = [[[_group(1, FLAT), _group(2, (0.0,) * 4)]], [[_group(3), _group(4)]], [[_group(5)]]]
    first = [_train(t, batches[:1])[0] for t in (skip, run_all)]
    assert rows.rows == 0 and first[0]["train/skipped_groups"] == 2.0
    assert _max_diff(skip.model, run_all.model) < 1e-6
    for t in (skip, run_all):
        _train(t, batches[1:])
    steps = [[float(s["step"]) for s in t.optimizer.state.values()] for t in (skip, run_all)]
    assert steps[0] == steps[1] and set(steps[0]) == {3.0}
    assert _max_diff(skip.model, run_all.model) < 1e-5


def test_the_equality_test_is_the_advantage_estimators_fp32_one():
    """Rewards equal in fp32 (1 and 1 + 1e-9) have zero advantage: skipped and counted. Rewards fp32 tells apart
    (1 and 1 + 1e-6: std ~5e-7 against eps 1e-6) have a small non-zero advantage: run, and trained on as without
    skipping (an fp16 test would skip them and lose their gradient; an fp64 one would run the equal ones)."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    skip = PolicyTrainer(model, None, lr=1e-2, grad_clip=1.0)
    run_all = PolicyTrainer(
        copy.deepcopy(model), None, lr=1e-2, grad_clip=1.0, loss=LossSettings(skip_zero_advantage=False)
    )
    same = _group(1, (1.0, 1.0 + 1e-9, 1.0, 1.0 + 1e-9))
    apart = _group(2, (1.0, 1.0 + 1e-6, 1.0, 1.0 + 1e-6))
    assert skip.skips(same) and not skip.skips(apart)
    a, b = (_train(t, [[[same, apart]]])[0] for t in (skip, run_all))
    assert a["train/skipped_groups"] == 1.0 and a["adv/zero_groups"] == b["adv/zero_groups"] == 1.0
    assert b["grad/norm"] > 0 and a["grad/norm"] == pytest.approx(b["grad/norm"], rel=1e-5)
    assert _max_diff(skip.model, run_all.model) < 1e-5
