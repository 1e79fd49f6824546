"""The trainer's optimizer step and its figures: each batch steps on its own gradient, a refused step leaves nothing
behind, the reported policy loss is the batch's loss, and the clip range is applied as configured."""

from __future__ import annotations

import copy

import pytest
import torch

from models import objectives
from models.packing import Group, pack, packed_logits, token_logprobs
from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer, RolloutGroup, lr_factor

torch.set_num_threads(1)

VOCAB = 40
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _model() -> torch.nn.Module:
    return build_tiny_model(VOCAB, seed=0, **TINY)


def _group(seed: int, rewards=(0.0, 1.0, 0.5, 0.25), lens=(3, 1, 4, 2)) -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, VOCAB, (8,), generator=gen).tolist()
    responses = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]
    return RolloutGroup(prompt, responses, list(rewards), [[-1.0] * n for n in lens], [[0] * n for n in lens])


def _with_behaviour(model, group: RolloutGroup, shift: float) -> RolloutGroup:
    """`group` with behaviour log-probs = `model`'s own log-probs of its tokens + `shift`."""
    packed = pack([Group(group.prompt_ids, group.responses)], 0, shared=False)
    with torch.no_grad():
        lp = token_logprobs(packed_logits(model, packed), packed.targets)
    out = copy.copy(group)
    out.behavior_logprobs = [(lp[i, : len(r)] + shift).tolist() for i, r in enumerate(group.responses)]
    return out


def test_each_batch_steps_on_its_own_gradient():
    """After an optimizer step the gradient is cleared: the next batch's gradient is that batch's alone (the same as
    a fresh trainer of the stepped weights computes), not added to the previous batch's."""
    model = _model()
    trainer = PolicyTrainer(model, None, lr=1e-2, grad_clip=None)
    trainer.micro_step([_group(1)])
    trainer.optimizer_step()
    assert all(p.grad is None for p in model.parameters())
    fresh = copy.deepcopy(model)
    trainer.micro_step([_group(2)])
    PolicyTrainer(fresh, None, lr=1e-2, grad_clip=None).micro_step([_group(2)])
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_a_refused_step_leaves_no_gradient_behind():
    """A non-finite gradient norm refuses the step (weights unchanged) and drops the batch's gradient and
    accumulators: the next batch trains normally instead of inheriting the non-finite gradient."""
    model = _model()
    trainer = PolicyTrainer(model, None, lr=1e-2)
    trainer.micro_step([_group(1)])
    next(model.parameters()).grad.view(-1)[0] = float("inf")  # a gradient gone non-finite
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError, match="non-finite gradient norm .*: the step was not applied"):
        trainer.optimizer_step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and trainer.pending_samples == 0
    trainer.micro_step([_group(2)])
    figures = trainer.optimizer_step()
    assert torch.isfinite(torch.tensor(figures["grad/norm"])) and figures["train/samples"] == 4.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole-logits", "chunked"])
def test_a_batch_without_response_tokens_is_refused_by_name(chunk):
    """Every response empty (e.g. an engine that stopped at once): the step is refused with the reason, not a
    ZeroDivisionError, and the weights stay as they were (with chunked log-probs too: one empty chunk, still in the
    graph)."""
    model = _model()
    trainer = PolicyTrainer(model, None, lr=1e-2, logits_chunk_tokens=chunk)
    before = copy.deepcopy(model.state_dict())
    trainer.micro_step([RolloutGroup([5, 6, 7], [[], []], [0.0, 1.0], [[], []], [[], []])])
    with pytest.raises(RuntimeError, match="loss denominator is 0.0: the batch has no response tokens"):
        trainer.optimizer_step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_policy_loss_figure_is_the_batch_token_mean_loss():
    """`loss/policy` is the batch's aggregated loss (numerators summed over micro-steps / the batch's token count),
    not the raw numerator: on-policy the per-token loss is -A, so it is sum_i(-A_i n_i) / sum_i n_i."""
    model = _model()
    trainer = PolicyTrainer(model, None, lr=1e-2)
    groups = [_group(1), _group(2, rewards=(1.0, 0.0, 0.0, 0.0), lens=(5, 2, 2, 1))]
    for g in groups:  # two micro-steps
        trainer.micro_step([g])
    num = den = 0.0
    for g in groups:
        adv, _ = objectives.compute_advantages(torch.tensor(g.rewards).unsqueeze(0), kind="grpo")
        for a, r in zip(adv.squeeze(0).tolist(), g.responses):
            num += -a * len(r)
            den += len(r)
    figures = trainer.optimizer_step()
    assert figures["train/tokens"] == den == 20.0
    assert figures["loss/policy"] == pytest.approx(num / den, abs=1e-6)
    assert abs(num / den) > 1e-3  # a non-trivial value (unequal lengths): a wrong normaliser would show


def test_the_upper_clip_bound_is_clip_high():
    """Asymmetric clipping (DAPO clip-higher): with clip_high 5 a ratio of e^0.5 = 1.65 is inside the trust region
    (nothing clipped above), while the lower bound clip_low 0.2 still clips a ratio of e^-0.5 = 0.61."""
    model = _model()
    settings = LossSettings(clip_low=0.2, clip_high=5.0)
    up = PolicyTrainer(copy.deepcopy(model), None, lr=1e-2, loss=settings)
    up.micro_step([_with_behaviour(model, _group(3), shift=-0.5)], behavior_old=True)  # ratio e^0.5 on every token
    f_up = up.optimizer_step()
    assert f_up["clip/high_fraction"] == 0.0 and f_up["clip/fraction"] == 0.0
    down = PolicyTrainer(copy.deepcopy(model), None, lr=1e-2, loss=settings)
    down.micro_step([_with_behaviour(model, _group(3), shift=0.5)], behavior_old=True)  # ratio e^-0.5
    f_down = down.optimizer_step()
    assert f_down["clip/low_fraction"] > 0.0 and f_down["clip/high_fraction"] == 0.0


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_rate_stays_at_the_floor_past_the_last_batch(kind):
    """A batch index past the schedule's end (step >= total) trains at the floor, never below it (a linear decay
    continued past its end would reach a negative rate: gradient ascent)."""
    assert [lr_factor(s, 10, kind=kind, warmup=2, min_ratio=0.1) for s in (9, 10, 14)] == pytest.approx([0.1] * 3)


# ------------------------------------------------------------------------------------------------ decoupled PPO figures

LN2 = 0.6931471805599453


@pytest.mark.parametrize(
    ("is_level", "is_cap", "is_mode", "dual_clip"),
    [
        ("token", None, "cap", None),
        ("sequence", None, "cap", None),
        ("sequence", 3.0, "cap", None),
        ("sequence", 3.0, "mask", None),
        ("geometric", 3.0, "cap", 1.5),
    ],
)
def test_the_decoupled_loss_takes_the_configured_settings_and_logs_its_figures(is_level, is_cap, is_mode, dual_clip):
    """Async (`decoupled`, `prox_logp: loglinear`), every token 2 versions behind (alpha = 1/2), two micro-steps of
    one group each (lengths 3, 1, 4, 2). Group 1's behaviour log-probs lie 2 ln 2 below the policy's, group 2's 2 ln 2
    above, so log pi_prox - log pi_b = +-ln 2 and log pi_theta - log pi_prox = +-ln 2: token weights w = 2 and 1/2,
    ratios r = 2 and 1/2. clip_low .6 and clip_high 5 clip neither ratio; a dual clip c = 1.5 bounds group 1's
    negative-advantage tokens at c |A| (counted in clip/fraction). Per sequence the weight is w^n (sequence) or w
    (geometric), capped or masked above the cap. So `loss/policy` = sum_i n_i s_i W_i / 20 with s_i the clipped
    surrogate, and the figures (raw and applied weight means, raw max, capped and masked fractions, alpha,
    |logp - behaviour| = 2 ln 2) are exact: each setting reaches the loss as configured, and each figure is the
    token-weighted one of the batch (a mask-mode run logged nothing of the tokens its mask dropped)."""
    model = _model()
    settings = LossSettings(
        decoupled=True,
        prox_logp="loglinear",
        clip_low=0.6,
        clip_high=5.0,
        dual_clip=dual_clip,
        is_cap=is_cap,
        is_mode=is_mode,
        is_level=is_level,
    )
    trainer = PolicyTrainer(model, None, lr=1e-2, loss=settings)
    groups = [_with_behaviour(model, _group(1), shift=-2 * LN2), _with_behaviour(model, _group(2), shift=2 * LN2)]
    for g in groups:  # token versions 0, trainer version 2: d = 2
        trainer.micro_step([g], version=2)
    figures = trainer.optimizer_step()

    num = w_sum = applied = capped = masked = clipped = 0.0
    w_max = 0.0
    for g, w, r in zip(groups, (2.0, 0.5), (2.0, 0.5), strict=True):
        adv, _ = objectives.compute_advantages(torch.tensor(g.rewards).unsqueeze(0), kind="grpo")
        for a, resp in zip(adv.squeeze(0).tolist(), g.responses):
            n = len(resp)
            s = -a * r  # neither ratio reaches clip_low / clip_high
            if dual_clip is not None and a < 0 and r > dual_clip:
                s, clipped = -a * dual_clip, clipped + n
            w_raw = w**n if is_level == "sequence" else w
            w_applied = w_raw
            if is_cap is not None and w_raw > is_cap:
                w_applied = is_cap if is_mode == "cap" else 0.0
                capped += n if is_mode == "cap" else 0.0
                masked += n if is_mode == "mask" else 0.0
            num += n * s * w_applied
            applied += n * w_applied
            w_sum, w_max = w_sum + n * w_raw, max(w_max, w_raw)
    assert figures["train/tokens"] == 20.0
    assert figures["loss/policy"] == pytest.approx(num / 20, abs=1e-5)
    assert figures["is_weight/mean"] == pytest.approx(w_sum / 20, rel=1e-5)
    assert figures["is_weight/max"] == pytest.approx(w_max, rel=1e-5)
    assert figures["is_weight/capped_fraction"] == pytest.approx(capped / 20)
    assert figures["is_weight/applied_mean"] == pytest.approx(applied / 20, rel=1e-5)
    assert figures["is_weight/masked_fraction"] == pytest.approx(masked / 20)
    assert figures["clip/fraction"] == pytest.approx(clipped / 20)
    assert figures["prox/alpha_mean"] == pytest.approx(0.5)
    assert figures["mismatch/logp_abs"] == pytest.approx(2 * LN2, rel=1e-5)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole-logits", "chunked"])
def test_a_micro_step_without_response_tokens_leaves_the_weight_figures_alone(chunk):
    """A micro-step whose responses are all empty trains no token: its neutral weight 1.0 (the empty mask's figure)
    must not become the batch's `is_weight/max` (it did: 1.0 beside tokens all of weight 1/2)."""
    model = _model()
    loss = LossSettings(decoupled=True, prox_logp="loglinear")
    trainer = PolicyTrainer(model, None, lr=1e-2, loss=loss, logits_chunk_tokens=chunk)
    trainer.micro_step([_with_behaviour(model, _group(2), shift=2 * LN2)], version=2)  # weights 1/2
    trainer.micro_step([_group(3, rewards=(0.0, 1.0), lens=(0, 0))], version=2)
    figures = trainer.optimizer_step()
    assert figures["train/tokens"] == 10.0
    assert figures["is_weight/max"] == pytest.approx(0.5, rel=1e-5)
    assert figures["is_weight/mean"] == pytest.approx(0.5, rel=1e-5)


def test_the_proximal_time_figure_sums_every_micro_step(monkeypatch):
    """`time/prox_s` is the batch's time spent on the proximal policy: the sum over its micro-steps, not the last
    one's. A clock that moves 1 s per reading gives each micro-step 1 s of proximal time."""
    import models.trainer as trainer_module

    clock = iter(range(1000))
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: float(next(clock)))
    model = _model()
    trainer = PolicyTrainer(model, None, lr=1e-2, loss=LossSettings(decoupled=True, prox_logp="loglinear"))
    for seed in (1, 2, 3):
        trainer.micro_step([_with_behaviour(model, _group(seed), shift=0.1)], version=2)
    assert trainer.optimizer_step()["time/prox_s"] == 3.0
