"""Unit tests of models/objectives.py: hand-computed values (arithmetic in the comments) and hypothesis properties."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import objectives as obj

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LN = math.log


def f64(x) -> torch.Tensor:
    return x.detach().double() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def close(actual, expected, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(f64(actual), f64(expected), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------ advantages


def test_grpo_unbiased_std():
    # rewards [1,0,0,1]: mean .5, unbiased std sqrt((4 * .25) / 3) = sqrt(1/3) = .57735 -> adv ±.5/.57735 = ±.86603
    adv, m = obj.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "grpo", eps=0.0)
    close(adv, [[0.866025, -0.866025, -0.866025, 0.866025]])
    close(m["adv/abs_max"], 0.866025)
    close(m["adv/mean"], 0.0)
    assert m["adv/zero_var_groups"] == 0.0 and m["adv/single_sample_groups"] == 0.0


def test_grpo_population_std_and_eps():
    # population std of [1,0,0,1] is .5 -> adv ±1; with eps=.5: ±.5/(.5+.5) = ±.5
    adv, _ = obj.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "grpo", eps=0.0, unbiased_std=False)
    close(adv, [[1.0, -1.0, -1.0, 1.0]])
    adv, _ = obj.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "grpo", eps=0.5, unbiased_std=False)
    close(adv, [[0.5, -0.5, -0.5, 0.5]])


def test_drgrpo_is_centered_reward():
    # [3,1,2]: mean 2 -> [1,-1,0]; [1,0,0,1] -> ±.5 (no std division)
    adv, _ = obj.compute_advantages(torch.tensor([[3.0, 1.0, 2.0]]), "drgrpo")
    close(adv, [[1.0, -1.0, 0.0]])
    adv, _ = obj.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "drgrpo")
    close(adv, [[0.5, -0.5, -0.5, 0.5]])


def test_rloo_leave_one_out():
    # [1,0,0,1]: r=1 -> others (0+0+1)/3 = 1/3 -> 2/3; r=0 -> others (1+0+1)/3 = 2/3 -> -2/3
    # equals G/(G-1) * (r - mean) = 4/3 * ±.5 = ±2/3
    adv, _ = obj.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "rloo")
    close(adv, [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    # G=2, [5,1]: 5-1 = 4, 1-5 = -4
    adv, _ = obj.compute_advantages(torch.tensor([[5.0, 1.0]]), "rloo")
    close(adv, [[4.0, -4.0]])


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_zero_variance_groups_are_exactly_zero_and_counted(kind):
    # 0.1 three times: mean (0.1+0.1+0.1)/3 is not exactly 0.1 in float32, yet the advantage must be exactly 0
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [7.0, 7.0, 7.0]])
    adv, m = obj.compute_advantages(rewards, kind)
    assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(adv[2], torch.zeros(3))
    assert adv[1].abs().min() > 0
    assert m["adv/zero_var_groups"] == 2.0 and m["adv/single_sample_groups"] == 0.0


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_single_sample_groups_are_exactly_zero_and_counted(kind):
    adv, m = obj.compute_advantages(torch.tensor([[3.0], [-1.0], [0.5]]), kind)  # 3 groups of G=1
    assert torch.equal(adv, torch.zeros(3, 1))
    assert m["adv/single_sample_groups"] == 3.0 and m["adv/zero_var_groups"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_advantages_bad_input():
    with pytest.raises(ValueError, match=r"view\(-1, G\)"):
        obj.compute_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="choose one of 'grpo', 'drgrpo', 'rloo'"):
        obj.compute_advantages(torch.ones(1, 4), kind="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN or inf"):
        obj.compute_advantages(torch.tensor([[1.0, float("nan")]]))


def test_whiten_advantages():
    # [1,2,3,4]: mean 2.5, population var (2.25+.25+.25+2.25)/4 = 1.25, std 1.118034
    # -> [-1.5, -.5, .5, 1.5] / 1.118034 = [-1.341641, -.447214, .447214, 1.341641]
    out, m = obj.whiten_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    close(out, [-1.341641, -0.447214, 0.447214, 1.341641], atol=1e-5)
    close(m["adv/whiten_mean"], 2.5)
    close(m["adv/whiten_std"], 1.118034)
    # masked: [1, 3, (99 ignored)]: mean 2, var 1 -> [-1, 1, 0]
    out, _ = obj.whiten_advantages(torch.tensor([1.0, 3.0, 99.0]), torch.tensor([True, True, False]))
    close(out, [-1.0, 1.0, 0.0], atol=1e-6)


# ------------------------------------------------------------------------------------------------ aggregation

PT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # row 2 is empty (padding row)


@pytest.mark.parametrize(
    "mode, norm_len, num, den, value",
    [
        # token-mean: (1+2+3+4) / 4 tokens = 2.5
        ("token-mean", None, 10.0, 4.0, 2.5),
        # seq-mean-token-mean: (mean(1,2,3)=2 + mean(4)=4) / 2 non-empty rows = 3
        ("seq-mean-token-mean", None, 6.0, 2.0, 3.0),
        # seq-mean-token-sum: (6 + 4) / 2 rows = 5
        ("seq-mean-token-sum", None, 10.0, 2.0, 5.0),
        # Dr.GRPO: 10 / (2 rows * norm_len 4) = 1.25
        ("seq-mean-token-sum-norm", 4, 10.0, 8.0, 1.25),
    ],
)
def test_aggregate_hand_values(mode, norm_len, num, den, value):
    n, d = obj.aggregate_parts(PT, MK, mode, norm_len=norm_len)
    close(n, num)
    assert d == den and isinstance(d, float)
    close(obj.aggregate(PT, MK, mode, norm_len=norm_len), value)
    # the empty row changes nothing: same values without it (choice documented in aggregate_parts)
    close(obj.aggregate(PT[:2], MK[:2], mode, norm_len=norm_len), value)


def test_aggregate_float_mask_and_garbage_in_masked_positions():
    pt = torch.tensor([[1.0, float("inf")], [3.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    close(obj.aggregate(pt, mask, "token-mean"), 2.0)  # (1+3)/2; inf/nan at masked positions never leak


def test_aggregate_empty_batch_is_zero_with_graph():
    x = torch.randn(2, 3, requires_grad=True)
    out = obj.aggregate(x, torch.zeros(2, 3, dtype=torch.bool), "seq-mean-token-mean")
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_aggregate_bad_input():
    with pytest.raises(ValueError, match="needs norm_len: pass the maximum response length"):
        obj.aggregate_parts(PT, MK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="choose one of 'token-mean'"):
        obj.aggregate_parts(PT, MK, "token_mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must have shape \(3, 3\)"):
        obj.aggregate_parts(PT, MK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="only 0 and 1"):
        obj.aggregate_parts(PT, MK.float() * 0.5, "token-mean")


@PROPS
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 7),
    t=st.integers(1, 6),
    n_micro=st.integers(1, 4),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]),
)
def test_aggregation_accumulates_exactly_over_any_split(seed, b, t, n_micro, mode):
    # float64 so that the test checks the algebra (exactness of the split), not float32 summation order
    g = torch.Generator().manual_seed(seed)
    per_token = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.6  # includes empty rows
    assignment = torch.randint(0, n_micro, (b,), generator=g)  # any (non-contiguous) split; some may be empty
    norm_len = t + 3

    whole_leaf = per_token.clone().requires_grad_(True)
    whole = obj.aggregate(whole_leaf, mask, mode, norm_len=norm_len)
    whole.backward()

    split_leaf = per_token.clone().requires_grad_(True)
    nums, dens = [], 0.0
    for k in range(n_micro):
        rows = (assignment == k).nonzero().flatten()
        num, den = obj.aggregate_parts(split_leaf[rows], mask[rows], mode, norm_len=norm_len)
        nums.append(num)
        dens += den
    if dens == 0.0:  # whole batch masked: the trainer refuses that batch; aggregate() returns 0
        assert whole.item() == 0.0
        return
    accumulated = torch.stack(nums).sum() / dens
    accumulated.backward()
    close(accumulated, whole, rtol=1e-6, atol=1e-12)
    close(split_leaf.grad, whole_leaf.grad, rtol=1e-6, atol=1e-12)


# ------------------------------------------------------------------------------------------------ policy loss


def test_policy_loss_hand_values_and_metrics():
    # one token per row: (A, ratio) = (1, 1.5), (-1, .5), (-1, 4), (1, .5); eps .2/.2, dual clip 3
    # (1, 1.5):  max(-1.5, -1.2) = -1.2      high clip
    # (-1, .5):  max(.5, .8) = .8            low clip
    # (-1, 4):   max(4, 1.2) = 4 -> min(4, 3) = 3   dual clip
    # (1, .5):   max(-.5, -.8) = -.5         no clip (moving down with A>0 is never clipped)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    ratio = torch.tensor([[1.5], [0.5], [4.0], [0.5]])
    old = torch.zeros(4, 1)
    loss, m = obj.policy_loss(ratio.log(), old, adv, torch.ones(4, 1, dtype=torch.bool), dual_clip=3.0)
    close(loss, [[-1.2], [0.8], [3.0], [-0.5]])
    assert m["clip/high_fraction"] == 0.25 and m["clip/low_fraction"] == 0.25 and m["clip/dual_fraction"] == 0.25
    assert m["clip/fraction"] == 0.75
    close(m["ratio/mean"], (1.5 + 0.5 + 4 + 0.5) / 4)  # 1.625
    close(m["ratio/max"], 4.0)
    close(m["ratio/min"], 0.5)
    # k3 = r - 1 - log r: 1.5 -> .5 - .405465 = .094535; .5 -> -.5 + .693147 = .193147 (twice);
    # 4 -> 3 - 1.386294 = 1.613706; mean = 2.094535 / 4 = .523634
    close(m["kl/approx"], 0.523634, atol=1e-5)
    assert all(isinstance(v, float) for v in m.values())


def test_policy_loss_without_dual_clip_is_unbounded():
    # (-1, 4): max(4, 1.2) = 4 when no dual clip
    loss, m = obj.policy_loss(torch.tensor([[LN(4.0)]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    close(loss, [[4.0]])
    assert m["clip/fraction"] == 0.0


def test_clip_higher_is_asymmetric():
    # clip_low .2, clip_high .28 (DAPO), A = 1: ratio 1.25 stays (-1.25), ratio 1.3 -> -1.28; A = -1: ratio .75 -> .8
    logp = torch.tensor([[LN(1.25), LN(1.3), LN(0.75)]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = obj.policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, -1.28, 0.8]])
    close(m["clip/high_fraction"], 1 / 3)
    close(m["clip/low_fraction"], 1 / 3)


def test_on_policy_shortcut_ratio_one_and_gradient():
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 5, generator=g) - 2.0).requires_grad_(True)
    adv = torch.tensor([0.7, -1.3, 0.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    per_token, m = obj.policy_loss(logp, logp.detach(), adv, mask)
    assert m["ratio/mean"] == 1.0 and m["ratio/max"] == 1.0 and m["ratio/min"] == 1.0
    assert m["clip/fraction"] == 0.0 and m["kl/approx"] == 0.0
    # value: -A per token
    close(per_token, -adv[:, None] * mask, atol=0, rtol=0)
    num, den = obj.aggregate_parts(per_token, mask, "token-mean")
    (num / den).backward()
    # gradient: -A * mask / denominator (9 tokens)
    assert den == 9.0
    close(logp.grad, -adv[:, None] * mask / 9.0, atol=1e-7, rtol=0)


def test_policy_loss_masked_garbage_gives_zero_finite_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -float("inf")]])  # padding position holds -inf
    loss, m = obj.policy_loss(logp, old, torch.tensor([1.0]), torch.tensor([[True, False]]))
    assert loss[0, 1].item() == 0.0
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1].item() == 0.0
    assert m["ratio/max"] == 1.0


def test_policy_loss_bad_input():
    with pytest.raises(ValueError, match=r"old_logp has shape \(2, 4\) but must have shape \(2, 3\)"):
        obj.policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"expected \(2,\) per sequence or \(2, 3\) per token"):
        obj.policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        obj.policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), dual_clip=0.5)


@PROPS
@given(
    log_past=st.floats(0.01, 5.0),
    a=st.floats(0.01, 10.0),
    positive=st.booleans(),
    clip_low=st.floats(0.0, 0.5),
    clip_high=st.floats(0.0, 0.5),
)
def test_clip_never_rewards_moving_further(log_past, a, positive, clip_low, clip_high):
    # ratio strictly past the clip in the advantage's direction -> the token passes no gradient
    if positive:
        adv, log_r = a, math.log1p(clip_high) + log_past  # A > 0, ratio > 1 + eps_high
    else:
        adv, log_r = -a, math.log1p(-clip_low) - log_past  # A < 0, ratio < 1 - eps_low
    logp = torch.tensor([[log_r]], dtype=torch.float64, requires_grad=True)
    old, one = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1)
    kw = dict(clip_low=clip_low, clip_high=clip_high)
    loss, m = obj.policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64), one, **kw)
    loss.sum().backward()
    assert logp.grad.item() == 0.0
    assert m["clip/fraction"] == 1.0
    # negative control: the same ratio with the opposite advantage sign is not clipped and has gradient -A' r
    logp2 = logp.detach().clone().requires_grad_(True)
    loss2, m2 = obj.policy_loss(logp2, old, torch.tensor([-adv], dtype=torch.float64), one, **kw)
    loss2.sum().backward()
    close(logp2.grad.item(), adv * math.exp(log_r), rtol=1e-9, atol=1e-12)
    assert m2["clip/fraction"] == 0.0


@PROPS
@given(log_r=st.floats(-20.0, 20.0), a=st.floats(0.01, 100.0), c=st.floats(1.01, 10.0))
def test_dual_clip_bounds_negative_advantage_loss(log_r, a, c):
    logp = torch.tensor([[log_r]], dtype=torch.float64)
    old, adv = torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-a], dtype=torch.float64)
    loss, _ = obj.policy_loss(logp, old, adv, torch.ones(1, 1), dual_clip=c)
    assert loss.item() <= c * a * (1 + 1e-12)
    # negative control: without the dual clip the loss exceeds c|A| whenever ratio > c
    loss_nd, _ = obj.policy_loss(logp, old, adv, torch.ones(1, 1))
    if math.exp(log_r) > c * (1 + 1e-9):
        assert loss_nd.item() > c * a


# ------------------------------------------------------------------------------------------------ KL


def test_kl_estimators_hand_values():
    # logp = log .5, ref = log .25: delta = ref - logp = log .5 = -.693147
    # k1 = -delta = .693147; k2 = .5 * .693147^2 = .240227; k3 = e^delta - delta - 1 = .5 + .693147 - 1 = .193147
    logp, ref = torch.tensor([[LN(0.5)]]), torch.tensor([[LN(0.25)]])
    close(obj.kl_divergence(logp, ref, "k1"), [[0.693147]])
    close(obj.kl_divergence(logp, ref, "k2"), [[0.240227]])
    close(obj.kl_divergence(logp, ref, "k3"), [[0.193147]])


def test_kl_clamps():
    # delta = 15: k3 = e^15 - 15 - 1 = 3269001.37 raw, clamped to 10; k1 = -15 clamped to -10
    logp, ref = torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), 15.0, dtype=torch.float64)
    close(obj.kl_divergence(logp, ref, "k3", clamp=None), [[math.exp(15) - 16]], rtol=1e-9)
    close(obj.kl_divergence(logp, ref, "k3"), [[10.0]])
    close(obj.kl_divergence(logp, ref, "k1"), [[-10.0]])
    # delta = 200 would overflow exp in float32: the clamp keeps both value and gradient finite
    lp = torch.zeros(1, 1, requires_grad=True)
    kl = obj.kl_divergence(lp, torch.full((1, 1), 200.0), "k3")
    kl.sum().backward()
    assert kl.item() == 10.0 and lp.grad.item() == 0.0


def test_kl_penalized_token_rewards():
    # rewards [0, 0, 1], k1 = logp - ref = [.1, -.2, .3], coef .5 -> [-.05, .1, .85]; last token masked -> kept 1
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = (ref + torch.tensor([[0.1, -0.2, 0.3]])).requires_grad_(True)
    out = obj.kl_penalized_token_rewards(rewards, logp, ref, coef=0.5, kind="k1")
    close(out, [[-0.05, 0.1, 0.85]])
    assert not out.requires_grad
    out = obj.kl_penalized_token_rewards(rewards, logp, ref, 0.5, "k1", mask=torch.tensor([[True, True, False]]))
    close(out, [[-0.05, 0.1, 1.0]])


def test_kl_bad_kind():
    with pytest.raises(ValueError, match="choose one of 'k1', 'k2', 'k3'"):
        obj.kl_divergence(torch.zeros(1, 1), torch.zeros(1, 1), "low_var_kl")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ A-3PO


def test_staleness_alpha_hand_values():
    # d = 0, 1 -> 0; d = 2 -> 1 - 1/2 = .5; d = 4 -> .75; d = -3 -> 0; int input works
    close(obj.staleness_alpha(torch.tensor([0.0, 1.0, 2.0, 4.0, -3.0])), [0.0, 0.0, 0.5, 0.75, 0.0])
    close(obj.staleness_alpha(torch.tensor([2, 8])), [0.5, 0.875])


@PROPS
@given(d=st.floats(-100.0, 1.0))
def test_alpha_is_zero_for_d_at_most_one(d):
    assert obj.staleness_alpha(torch.tensor([d], dtype=torch.float64)).item() == 0.0


@PROPS
@given(d1=st.floats(1.0, 1e4), gap=st.floats(1e-3, 1e4))
def test_alpha_strictly_increases_toward_one(d1, gap):
    a1, a2 = obj.staleness_alpha(torch.tensor([d1, d1 + gap], dtype=torch.float64)).tolist()
    assert 0.0 <= a1 < a2 < 1.0


def test_proximal_hand_values():
    # pb = .2, ptheta = .8
    # d=2: alpha .5 -> loglinear log(sqrt(.2*.8)) = log .4; linear log(.5*.2 + .5*.8) = log .5
    # d=1 and d=0: alpha 0 -> log .2 (behaviour); d=4: alpha .75 -> loglinear log .2 + .75 log 4 = log(.2 * 4^.75)
    b = torch.full((1, 4), LN(0.2))
    cur = torch.full((1, 4), LN(0.8))
    versions = torch.tensor([[3, 4, 5, 1]])  # trainer 5 -> d = [2, 1, 0, 4]
    mask = torch.ones(1, 4, dtype=torch.bool)
    prox, m = obj.proximal_logprobs(b, cur, versions, 5, mask, "loglinear")
    close(prox, [[LN(0.4), LN(0.2), LN(0.2), LN(0.2 * 4**0.75)]])
    assert prox[0, 1] == b[0, 1] and prox[0, 2] == b[0, 2]  # exactly behaviour at d <= 1
    close(m["staleness/mean"], (2 + 1 + 0 + 4) / 4)
    close(m["staleness/max"], 4.0)
    close(m["prox/alpha_mean"], (0.5 + 0.75) / 4)
    prox, _ = obj.proximal_logprobs(b, cur, versions, 5, mask, "linear")
    close(prox, [[LN(0.5), LN(0.2), LN(0.2), LN(0.25 * 0.2 + 0.75 * 0.8)]])


def test_proximal_error_metrics_and_recompute():
    # d = 2: loglinear gives log .4; the recomputed proximal is log .45
    # abs_err = |log .4 - log .45| = .117783; rel_err = .117783 / |log .45| = .117783 / .798508 = .147504
    # gap_ratio = .117783 / |log .45 - log .2| = .117783 / .810930 = .145245
    # is_weight_err = |.4/.2 - .45/.2| = |2 - 2.25| = .25
    b, cur, rec = torch.tensor([[LN(0.2)]]), torch.tensor([[LN(0.8)]]), torch.tensor([[LN(0.45)]])
    v, mask = torch.tensor([[3]]), torch.ones(1, 1)
    _, m = obj.proximal_logprobs(b, cur, v, 5, mask, "loglinear", recomputed_logp=rec)
    close(m["prox/abs_err"], 0.117783, atol=1e-5)
    close(m["prox/rel_err"], 0.147504, atol=1e-5)
    close(m["prox/gap_ratio"], 0.145245, atol=1e-5)
    close(m["prox/is_weight_err"], 0.25, atol=1e-5)
    prox, m = obj.proximal_logprobs(b, cur, v, 5, mask, "recompute", recomputed_logp=rec)
    assert torch.equal(prox, rec) and "prox/abs_err" not in m


def test_recompute_uses_the_previous_version_only_two_or_more_versions_behind():
    # trainer 5, versions [3, 4, 5, 1] -> d = [2, 1, 0, 4]. The proximal policy is v4 (one step behind the trainer),
    # never older than the token's own policy: recomputed v4 log-probs at d = 2 and 4, behaviour at d = 1 (the token's
    # policy is v4 itself) and d = 0 (on-policy).
    b = torch.full((1, 4), LN(0.2))
    cur = torch.full((1, 4), LN(0.8))
    rec = torch.tensor([[LN(0.45), LN(0.3), LN(0.7), LN(0.6)]])
    versions = torch.tensor([[3, 4, 5, 1]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    prox, _ = obj.proximal_logprobs(b, cur, versions, 5, mask, "recompute", recomputed_logp=rec)
    assert prox.tolist() == [[rec[0, 0].item(), b[0, 1].item(), b[0, 2].item(), rec[0, 3].item()]]
    # the approximations' errors are measured against that same per-token proximal policy: at d <= 1 both are b,
    # so only d = 2 (loglinear log .4 vs log .45: .117783) and d = 4 (log(.2 * 4^.75) = log .565685 vs log .6:
    # .058892) count; abs_err = (.117783 + .058892) / 4 = .044169
    _, m = obj.proximal_logprobs(b, cur, versions, 5, mask, "loglinear", recomputed_logp=rec)
    close(m["prox/abs_err"], 0.044169, atol=1e-5)


def test_trust_region_agreement_hand_values():
    # pi_theta = .6, pi_b = .2 everywhere, clip .2 / .2, no IS cap: an unclipped token's gradient coefficient is
    # d loss / d logp = -A w r = -A pi_theta / pi_b = -3 A, a clipped one's 0.
    # token 0 (A = 1):  reference prox .45 -> r = 1.333 > 1.2 clipped (g 0); approximation .55 -> r 1.091 (g -3)
    # token 1 (A = 1):  reference .55 (g -3); approximation .45 clipped (g 0)
    # token 2 (A = -1): reference .9 -> r .667 < .8 clipped (g 0); approximation .7 -> r .857 (g +3)
    # token 3 (A = 0):  no gradient either way, not counted as zeroed
    # token 4 (A = 1):  reference .45 -> r 1.333 clipped; approximation .4 -> r 1.5 clipped: zeroed by both
    # grad_abs_err = (3 + 3 + 3 + 0 + 0) / 5 = 1.8; grad_abs = 3 / 5 = .6 (the reference's); zeroed: approximation
    # {1, 4}, reference {0, 2, 4}, shared {4}. Not symmetric: swapping the two policies changes every figure but the
    # error, so a swap inside the function fails here.
    logp, b = torch.full((1, 5), LN(0.6)), torch.full((1, 5), LN(0.2))
    ref = torch.tensor([[LN(0.45), LN(0.55), LN(0.9), LN(0.5), LN(0.45)]])
    approx = torch.tensor([[LN(0.55), LN(0.45), LN(0.7), LN(0.5), LN(0.4)]])
    adv, mask = torch.tensor([[1.0, 1.0, -1.0, 0.0, 1.0]]), torch.ones(1, 5)
    m = obj.trust_region_agreement(logp, approx, ref, b, adv, mask, is_cap=None)
    close(m["grad_abs_err"], 1.8, atol=1e-5)
    close(m["grad_abs"], 0.6, atol=1e-5)
    close(m["zeroed_fraction"], 0.4, atol=1e-6)
    close(m["reference_zeroed_fraction"], 0.6, atol=1e-6)
    close(m["zeroed_shared_fraction"], 0.2, atol=1e-6)
    # masked tokens count nowhere: masking token 0 leaves the errors of tokens 1 and 2, over 4 tokens
    m = obj.trust_region_agreement(logp, approx, ref, b, adv, torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]]), is_cap=None)
    close(m["grad_abs_err"], 1.5, atol=1e-5)
    close(m["grad_abs"], 0.75, atol=1e-5)
    assert (m["zeroed_fraction"], m["reference_zeroed_fraction"], m["zeroed_shared_fraction"]) == (0.5, 0.5, 0.25)


def test_trust_region_agreement_without_a_trust_region_the_gradients_are_equal():
    # no clip (ratio bounds never reached) and no cap: w r = pi_theta / pi_b whatever pi_prox, so any two proximal
    # policies give the same gradient, and none zeroes a token
    g = torch.Generator().manual_seed(0)
    logp, b = -torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    ref, approx = -torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    adv = torch.randn(4, generator=g)
    m = obj.trust_region_agreement(
        logp, approx, ref, b, adv, torch.ones(4, 6), clip_low=0.99, clip_high=100.0, is_cap=None
    )
    assert m["grad_abs_err"] < 1e-5 * m["grad_abs"] and m["grad_abs"] > 0.1
    assert m["zeroed_fraction"] == m["reference_zeroed_fraction"] == 0.0
    # with the default clip and cap they differ
    assert obj.trust_region_agreement(logp, approx, ref, b, adv, torch.ones(4, 6))["grad_abs_err"] > 1e-2


def test_proximal_masked_positions_return_behavior():
    b = torch.tensor([[-1.0, -2.0, -3.0]])
    cur = torch.tensor([[-0.5, -0.5, -0.5]])
    rec = torch.tensor([[-0.7, -0.7, -0.7]])
    versions = torch.tensor([[0, 99, 0]])  # garbage (future) version on a prompt position is not checked
    mask = torch.tensor([[True, False, True]])
    for kind in ("loglinear", "linear", "recompute"):
        prox, _ = obj.proximal_logprobs(b, cur, versions, 4, mask, kind, recomputed_logp=rec)
        assert prox[0, 1].item() == -2.0


def test_proximal_bad_input():
    b = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs recomputed_logp: run the proximal forward pass"):
        obj.proximal_logprobs(b, b, torch.zeros(1, 2, dtype=torch.long), 1, torch.ones(1, 2), "recompute")
    with pytest.raises(ValueError, match="choose one of 'recompute', 'loglinear', 'linear'"):
        obj.proximal_logprobs(b, b, torch.zeros(1, 2, dtype=torch.long), 1, torch.ones(1, 2), "cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceed trainer_version"):
        obj.proximal_logprobs(b, b, torch.full((1, 2), 7), 3, torch.ones(1, 2), "loglinear")
    with pytest.raises(ValueError, match=r"current_logp has shape \(1, 3\)"):
        obj.proximal_logprobs(b, torch.zeros(1, 3), torch.zeros(1, 2, dtype=torch.long), 1, torch.ones(1, 2), "linear")


logprob = st.floats(-12.0, -1e-3)


@PROPS
@given(lb=logprob, lc=logprob)
def test_loglinear_is_behavior_at_d1_and_tends_to_current(lb, lc):
    b = torch.tensor([[lb]], dtype=torch.float64)
    c = torch.tensor([[lc]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    prox1, _ = obj.proximal_logprobs(b, c, torch.tensor([[9]]), 10, mask, "loglinear")  # d = 1
    assert prox1.item() == lb
    gaps = []
    for d in (2, 4, 16, 256, 65536):
        prox, _ = obj.proximal_logprobs(b, c, torch.tensor([[0]]), d, mask, "loglinear")
        gaps.append(abs(prox.item() - lc))
        assert gaps[-1] <= abs(lb - lc) / d + 1e-12  # |prox - cur| = |b - cur| / d
    assert all(g1 >= g2 for g1, g2 in pairwise(gaps))


@PROPS
@given(lb=logprob, lc=logprob, d=st.integers(0, 1000))
def test_linear_probability_lies_between_behavior_and_current(lb, lc, d):
    b = torch.tensor([[lb]], dtype=torch.float64)
    c = torch.tensor([[lc]], dtype=torch.float64)
    prox, _ = obj.proximal_logprobs(b, c, torch.tensor([[0]]), d, torch.ones(1, 1), "linear")
    p, lo, hi = math.exp(prox.item()), min(math.exp(lb), math.exp(lc)), max(math.exp(lb), math.exp(lc))
    assert lo * (1 - 1e-12) <= p <= hi * (1 + 1e-12)


# ------------------------------------------------------------------------------------------------ decoupled loss


def _decoupled_inputs():
    # 2 rows x 2 tokens; prox - b = [[log 2, log 3], [log .5, log 1]]; logp = prox (ratio 1), A = [1, 1]
    b = torch.full((2, 2), -2.0)
    prox = b + torch.tensor([[LN(2.0), LN(3.0)], [LN(0.5), 0.0]])
    return prox.clone(), prox, b, torch.tensor([1.0, 1.0]), torch.ones(2, 2, dtype=torch.bool)


def test_decoupled_token_level_cap_and_mask():
    logp, prox, b, adv, mask = _decoupled_inputs()
    # ratio 1 -> surrogate -A = -1; token weights [[2, 3], [.5, 1]]
    loss, m = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=None)
    close(loss, [[-2.0, -3.0], [-0.5, -1.0]], atol=1e-5)
    close(m["is_weight/mean"], (2 + 3 + 0.5 + 1) / 4)  # 1.625
    close(m["is_weight/max"], 3.0, atol=1e-5)
    # cap 2.5: 3 -> 2.5
    loss, m = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=2.5, is_mode="cap")
    close(loss, [[-2.0, -2.5], [-0.5, -1.0]], atol=1e-5)
    assert m["is_weight/capped_fraction"] == 0.25 and m["is_weight/masked_fraction"] == 0.0
    close(m["is_weight/applied_mean"], (2 + 2.5 + 0.5 + 1) / 4, atol=1e-5)  # 1.5
    close(m["is_weight/max"], 3.0, atol=1e-5)  # raw weight is reported
    # mask 2.5: the token with weight 3 contributes 0
    loss, m = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=2.5, is_mode="mask")
    close(loss, [[-2.0, 0.0], [-0.5, -1.0]], atol=1e-5)
    assert m["is_weight/masked_fraction"] == 0.25 and m["is_weight/capped_fraction"] == 0.0


def test_decoupled_sequence_and_geometric_levels():
    logp, prox, b, adv, mask = _decoupled_inputs()
    # sequence (product): row 0: 2*3 = 6, row 1: .5*1 = .5; cap 5 -> 5
    loss, m = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=None, is_level="sequence")
    close(loss, [[-6.0, -6.0], [-0.5, -0.5]], atol=1e-5)
    loss, _ = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=5.0, is_level="sequence")
    close(loss, [[-5.0, -5.0], [-0.5, -0.5]], atol=1e-5)
    # mask at sequence level drops the whole sequence: 2 of 4 tokens
    loss, m = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=5.0, is_mode="mask", is_level="sequence")
    close(loss, [[0.0, 0.0], [-0.5, -0.5]], atol=1e-5)
    assert m["is_weight/masked_fraction"] == 0.5
    # geometric: row 0 sqrt(6) = 2.449490, row 1 sqrt(.5) = .707107
    loss, _ = obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_cap=None, is_level="geometric")
    close(loss, [[-2.449490, -2.449490], [-0.707107, -0.707107]], atol=1e-5)


def test_decoupled_reduces_to_policy_loss_when_prox_is_behavior():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 4, generator=g).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(3, 4, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.rand(3, 4, generator=g) > 0.3
    ref, m_ref = obj.policy_loss(logp, old, adv, mask, dual_clip=3.0)
    dec, m_dec = obj.decoupled_policy_loss(logp, old, old, adv, mask, dual_clip=3.0)  # w = 1
    torch.testing.assert_close(dec, ref, rtol=0, atol=0)
    assert {k: m_dec[k] for k in m_ref} == m_ref
    assert m_dec["is_weight/mean"] == 1.0


def test_decoupled_bad_input():
    logp, prox, b, adv, mask = _decoupled_inputs()
    with pytest.raises(ValueError, match="choose one of 'cap', 'mask'"):
        obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choose one of 'token', 'sequence', 'geometric'"):
        obj.decoupled_policy_loss(logp, prox, b, adv, mask, is_level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"behavior_logp has shape \(2, 3\)"):
        obj.decoupled_policy_loss(logp, prox, torch.zeros(2, 3), adv, mask)


# ---------------------------------------------------------------------- boundaries and detached inputs (mutation audit)
# Each test below kills a change to models/objectives.py that the tests above let through (a comparison's edge, a
# mask forgotten in a count, a .detach() removed); see the commit that added them.


def test_a_zero_advantage_token_is_never_counted_as_clipped():
    # ratio .5 with A = 0: neither side of the clip applies (A < 0 clips low, A > 0 clips high)
    _, m = obj.policy_loss(
        torch.tensor([[LN(0.5)], [LN(1.5)]]), torch.zeros(2, 1), torch.tensor([0.0, 0.0]), torch.ones(2, 1)
    )
    assert m["clip/low_fraction"] == 0.0 and m["clip/high_fraction"] == 0.0 and m["clip/fraction"] == 0.0


def test_dual_clip_starts_above_c():
    # A = -1 and a ratio of exactly c: the loss is c either way; the token is not counted as dual-clipped and keeps
    # a gradient (half of r: at the tie torch's min splits it between the two branches)
    log_r = torch.tensor([[LN(4.0)]], dtype=torch.float64)
    c = float(torch.exp(log_r))
    logp = log_r.clone().requires_grad_(True)
    loss, m = obj.policy_loss(
        logp,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([-1.0], dtype=torch.float64),
        torch.ones(1, 1),
        dual_clip=c,
    )
    loss.sum().backward()
    assert m["clip/dual_fraction"] == 0.0
    close(logp.grad, [[c / 2]])


@pytest.mark.parametrize("which", ["old", "advantages"])
def test_policy_loss_passes_no_gradient_to_old_logp_or_advantages(which):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.5]], requires_grad=which == "old")  # ratios 1.105 and .607: neither clipped
    adv = torch.tensor([0.7], requires_grad=which == "advantages")
    loss, _ = obj.policy_loss(logp, old, adv, torch.ones(1, 2))
    loss.sum().backward()
    assert old.grad is None and adv.grad is None
    assert logp.grad is not None and bool((logp.grad != 0).all())


def test_decoupled_loss_passes_no_gradient_to_the_proximal_or_behaviour_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.1, -1.9]], requires_grad=True)
    b = torch.tensor([[-1.3, -2.2]], requires_grad=True)
    loss, _ = obj.decoupled_policy_loss(logp, prox, b, torch.tensor([1.0]), torch.ones(1, 2))
    loss.sum().backward()
    assert prox.grad is None and b.grad is None
    assert logp.grad is not None


def test_geometric_weight_averages_over_the_mask_tokens_only():
    # mask [1, 0]: the padded token's log 100 is not part of the mean, and the mean divides by 1 token, not 2
    b = torch.full((1, 2), -3.0)
    prox = b + torch.tensor([[LN(4.0), LN(100.0)]])
    loss, m = obj.decoupled_policy_loss(
        prox.clone(), prox, b, torch.tensor([1.0]), torch.tensor([[True, False]]), is_cap=None, is_level="geometric"
    )
    close(loss, [[-4.0, 0.0]], atol=1e-5)
    close(m["is_weight/mean"], 4.0, atol=1e-5)


@pytest.mark.parametrize("is_mode", ["cap", "mask"])
def test_a_weight_equal_to_the_cap_is_kept(is_mode):
    # prox = behaviour: every weight is exactly 1 = the cap; nothing capped or masked, the loss is PPO's
    g = torch.Generator().manual_seed(0)
    logp, b = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    loss, m = obj.decoupled_policy_loss(logp, b, b, adv, mask, is_cap=1.0, is_mode=is_mode)
    assert m["is_weight/capped_fraction"] == 0.0 and m["is_weight/masked_fraction"] == 0.0
    torch.testing.assert_close(loss, obj.policy_loss(logp, b, adv, mask)[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("is_mode", "key"), [("cap", "is_weight/capped_fraction"), ("mask", "is_weight/masked_fraction")]
)
def test_sequence_level_fractions_count_mask_tokens_only(is_mode, key):
    # row 0 (2 mask tokens + 1 padding) has weight 2*3 = 6 > cap 5; row 1 (3 tokens) .5: 2 of 5 mask tokens
    b = torch.full((2, 3), -3.0)
    prox = b + torch.tensor([[LN(2.0), LN(3.0), 0.0], [LN(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    _, m = obj.decoupled_policy_loss(
        prox.clone(), prox, b, torch.ones(2), mask, is_cap=5.0, is_mode=is_mode, is_level="sequence"
    )
    close(m[key], 0.4)


def test_sequence_weight_of_a_long_response_is_clamped_finite():
    # 100 tokens each 1 nat above behaviour: exp(100) as a product, clamped to exp(max_log_ratio = 20)
    b = torch.full((1, 100), -5.0)
    prox = b + 1.0
    loss, m = obj.decoupled_policy_loss(
        prox.clone(), prox, b, torch.tensor([1.0]), torch.ones(1, 100), is_cap=None, is_level="sequence"
    )
    assert bool(torch.isfinite(loss).all())
    close(m["is_weight/max"], math.exp(20.0), rtol=1e-5)


# ------------------------------------------------------------- A-3PO figures and contracts (decoupled-parts audit)
# Each test below kills a change to the A-3PO / decoupled parts of models/objectives.py that the tests above let
# through: a figure computed over every position instead of the mask tokens, a boundary of the version check, a
# .detach() removed, a default changed.


def _proximal_with_padding():
    # trainer 5, versions [3, 4, 0] -> d = [2, 1, 5]; the third position is padding (mask 0) with finite garbage
    # (behaviour -2, current -.1, recomputed -.3): were it a response token, d = 5 would move every figure
    b = torch.tensor([[LN(0.2), LN(0.2), -2.0]])
    cur = torch.tensor([[LN(0.8), LN(0.8), -0.1]])
    rec = torch.tensor([[LN(0.45), LN(0.3), -0.3]])
    return b, cur, rec, torch.tensor([[3, 4, 0]]), torch.tensor([[True, True, False]])


@pytest.mark.parametrize("kind", ["loglinear", "linear", "recompute"])
def test_proximal_figures_are_over_the_mask_tokens_only(kind):
    # over the 2 mask tokens: staleness mean (2 + 1) / 2 = 1.5, max 2 (not 5); alpha mean (.5 + 0) / 2 = .25.
    # A stale padding position (d = 5, alpha .8) still returns its behaviour log-prob, for every kind.
    b, cur, rec, v, mask = _proximal_with_padding()
    prox, m = obj.proximal_logprobs(b, cur, v, 5, mask, kind, recomputed_logp=rec)
    assert (m["staleness/mean"], m["staleness/max"]) == (1.5, 2.0)
    close(m["prox/alpha_mean"], 0.25)
    assert prox[0, 2].item() == -2.0


@pytest.mark.parametrize(
    ("kind", "err"),
    [("loglinear", abs(LN(0.4) - LN(0.45))), ("linear", abs(LN(0.5) - LN(0.45)))],
    ids=["loglinear", "linear"],
)
def test_proximal_error_figures_are_over_the_mask_tokens_only(kind, err):
    # only the d = 2 token differs from the recomputed policy (loglinear log .4, linear log .5 vs log .45); the d = 1
    # token is behaviour in both. Over the 2 mask tokens: abs_err = err / 2; rel_err = err / (|log .45| + |log .2|)
    # (the padding's |-2| is not in the sum); gap_ratio = err / |log .45 - log .2|; is_weight_err = |w - .45/.2| / 2
    # with w = .4/.2 = 2 (loglinear) or .5/.2 = 2.5 (linear): .25 / 2 = .125 either way
    b, cur, rec, v, mask = _proximal_with_padding()
    _, m = obj.proximal_logprobs(b, cur, v, 5, mask, kind, recomputed_logp=rec)
    close(m["prox/abs_err"], err / 2, atol=1e-6)
    close(m["prox/rel_err"], err / (abs(LN(0.45)) + abs(LN(0.2))), atol=1e-6)
    close(m["prox/gap_ratio"], err / abs(LN(0.45) - LN(0.2)), atol=1e-6)
    close(m["prox/is_weight_err"], 0.125, atol=1e-5)


def test_proximal_error_figures_ignore_infinite_garbage_off_the_mask():
    # the module's promise: masked positions may hold -inf log-probs. There prox = ref = behaviour = -inf, and
    # -inf - (-inf) is NaN: the error must be selected away, not computed and summed
    b, cur, rec, v, mask = _proximal_with_padding()
    b[0, 2] = cur[0, 2] = rec[0, 2] = -math.inf
    _, m = obj.proximal_logprobs(b, cur, v, 5, mask, "loglinear", recomputed_logp=rec)
    close(m["prox/abs_err"], abs(LN(0.4) - LN(0.45)) / 2, atol=1e-6)
    assert all(math.isfinite(x) for x in m.values())


def test_a_token_one_version_ahead_of_the_trainer_is_refused():
    # d = -1 on a response token: the smallest impossible staleness is refused like any larger one; d = 0 is fine
    b = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="exceed trainer_version"):
        obj.proximal_logprobs(b, b, torch.tensor([[3, 4]]), 3, mask, "loglinear")
    obj.proximal_logprobs(b, b, torch.tensor([[3, 3]]), 3, mask, "loglinear")


@pytest.mark.parametrize("kind", ["loglinear", "linear"])
def test_approximated_proximal_logprobs_are_detached(kind):
    # the proximal policy is a constant of the loss: no graph back to the current or behaviour log-probs
    b = torch.tensor([[-1.5, -2.0]], requires_grad=True)
    cur = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    prox, _ = obj.proximal_logprobs(b, cur, torch.tensor([[1, 2]]), 4, torch.ones(1, 2), kind)
    assert not prox.requires_grad and prox.grad_fn is None


def test_decoupled_loss_caps_the_weight_at_5_by_default():
    # the signature's default cap is the configured one (5, truncated IS): a raw weight of 8 counts 5
    b = torch.full((1, 1), -3.0)
    prox = b + LN(8.0)
    loss, m = obj.decoupled_policy_loss(prox.clone(), prox, b, torch.tensor([1.0]), torch.ones(1, 1))
    close(loss, [[-5.0]], atol=1e-5)
    assert m["is_weight/capped_fraction"] == 1.0 and m["is_weight/masked_fraction"] == 0.0
    close(m["is_weight/max"], 8.0, atol=1e-5)


def test_token_weight_figures_are_over_the_mask_tokens_only():
    # token level, mask [1, 0]: the mask token's weight is 4; the padding (weight exp(0) = 1 once masked, 100 as
    # garbage) counts in no figure: mean, max and applied mean (cap 2: the 4 counts 2) are the mask token's alone
    b = torch.full((1, 2), -3.0)
    prox = b + torch.tensor([[LN(4.0), LN(100.0)]])
    _, m = obj.decoupled_policy_loss(
        prox.clone(), prox, b, torch.tensor([1.0]), torch.tensor([[True, False]]), is_cap=2.0
    )
    close(m["is_weight/mean"], 4.0, atol=1e-5)
    close(m["is_weight/max"], 4.0, atol=1e-5)
    close(m["is_weight/applied_mean"], 2.0, atol=1e-5)
    assert m["is_weight/capped_fraction"] == 1.0


def test_decoupled_loss_on_an_empty_mask_reports_weight_one():
    # like policy_loss's ratio figures, an empty mask reports the neutral weight 1 (not 0) and zero fractions
    b = torch.full((1, 2), -3.0)
    prox = b + LN(8.0)
    loss, m = obj.decoupled_policy_loss(prox.clone(), prox, b, torch.tensor([1.0]), torch.zeros(1, 2))
    assert loss.tolist() == [[0.0, 0.0]]
    assert m["is_weight/mean"] == m["is_weight/max"] == m["is_weight/applied_mean"] == 1.0
    assert m["is_weight/capped_fraction"] == m["is_weight/masked_fraction"] == 0.0


# ------------------------------------------------------------------------------------------------ entropy, DAPO


def test_entropy_from_logits():
    # uniform over 4: log 4 = 1.386294; p = [.5, .25, .25]: .5 ln 2 + 2 * .25 ln 4 = .346574 + .693147 = 1.039721
    # [0, -inf]: one certain token -> 0 (no NaN from 0 * -inf)
    close(obj.entropy_from_logits(torch.zeros(4)), 1.386294)
    close(obj.entropy_from_logits(torch.tensor([LN(0.5), LN(0.25), LN(0.25)]) + 7.0), 1.039721)
    assert obj.entropy_from_logits(torch.tensor([0.0, -float("inf")])).item() == 0.0
    assert obj.entropy_from_logits(torch.zeros(2, 3, 5)).shape == (2, 3)
    out = obj.entropy_from_logits(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    close(out, [LN(8.0)] * 2)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    close(obj.masked_mean(x, torch.tensor([[1, 0], [1, 0]])), 2.0)  # (1 + 3) / 2
    close(obj.masked_mean(x, torch.tensor([[True, True], [False, True]]), dim=1), [1.5, 4.0])
    assert obj.masked_mean(x, torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0


def test_overlong_penalty():
    # max_len 20, cache 4 -> free up to 16; L=18: (16-18)/4 = -.5; L=20: -1; L=25: -1; factor 2 doubles
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    close(obj.overlong_penalty(lengths, 20, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(obj.overlong_penalty(lengths, 20, 4, penalty_factor=2.0), [0.0, 0.0, -0.5, -1.0, -2.0, -2.0])
    # cache 0: hard step after max_len
    close(obj.overlong_penalty(torch.tensor([20, 21]), 20, 0), [0.0, -1.0])
    with pytest.raises(ValueError, match="cache_len <= max_len"):
        obj.overlong_penalty(lengths, 20, 30)


def test_dynamic_sampling_keep():
    # [1,1]: all equal -> drop; [0,1]: keep; [.5, .5+1e-9] kept at atol 0, dropped at atol 1e-6
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5 + 1e-9]], dtype=torch.float64)
    keep, m = obj.dynamic_sampling_keep(rewards)
    assert keep.tolist() == [False, True, True]
    assert m == {"filter/dropped_groups": 1.0, "filter/kept_groups": 2.0}
    keep, m = obj.dynamic_sampling_keep(rewards, atol=1e-6)
    assert keep.tolist() == [False, True, False] and m["filter/dropped_groups"] == 2.0
    keep, _ = obj.dynamic_sampling_keep(torch.tensor([[1.0], [0.0]]))  # G = 1 never has signal
    assert keep.tolist() == [False, False]
