"""The streaming train task's gradient accumulation (DESIGN.md): micro-steps on groups as they land, one optimizer
step when the batch is complete, and the accumulated gradient equals the gradient of the whole batch's loss,
computed here independently in one autograd pass over the batch packed at once. The batch's normaliser (token or
sequence count) is known only at the end, so each micro-step adds a numerator and the step divides once.

The periodic-equals-sync invariant compares two runs of the same trainer code, so an error in the accumulation
(a wrong normaliser, a missing 1/denominator, the KL term's sign) cancels there; Adam's update barely changes when
the gradient is scaled by a constant. This test compares the gradient itself, just before the optimizer uses it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models import objectives as obj
from models.packing import Group, pack, packed_logits, token_logprobs
from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer, RolloutGroup

torch.set_num_threads(1)

VOCAB = 40
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
KL_COEF = 0.1
NORM_LEN = 8  # seq-mean-token-sum-norm's constant (>= the longest response below)


def _batch() -> list[RolloutGroup]:
    """Three groups of 4 with different prompt and response lengths (so token and sequence counts differ per
    micro-step) and distinct rewards (non-zero advantages)."""
    gen = torch.Generator().manual_seed(3)
    groups = []
    for n in range(3):
        prompt = torch.randint(4, VOCAB, (6 + 3 * n,), generator=gen).tolist()
        lens = [1 + (2 * j + n) % 6 for j in range(4)]
        responses = [torch.randint(4, VOCAB, (k,), generator=gen).tolist() for k in lens]
        groups.append(
            RolloutGroup(
                prompt,
                responses,
                torch.rand(4, generator=gen).tolist(),
                [[-1.0] * k for k in lens],
                [[0] * k for k in lens],
            )
        )
    return groups


def _whole_batch(policy, ref, groups, advantage: str, loss_agg: str) -> dict:
    """Gradient and figures of the batch's loss in one pass: GRPO/PPO on-policy (old = current, detached) plus the
    k3 KL to the reference, aggregated over the whole batch."""
    model = copy.deepcopy(policy)
    packed = pack([Group(g.prompt_ids, g.responses) for g in groups], 0, False)
    logits = packed_logits(model, packed)
    logp = token_logprobs(logits, packed.targets)
    with torch.no_grad():
        ref_logp = token_logprobs(packed_logits(ref, packed), packed.targets)
    adv = obj.compute_advantages(torch.tensor([g.rewards for g in groups]), advantage)[0].flatten()
    per_token = obj.policy_loss(logp, logp.detach(), adv, packed.mask)[0] + KL_COEF * obj.kl_divergence(
        logp, ref_logp, "k3"
    )
    loss = obj.aggregate(per_token, packed.mask, loss_agg, NORM_LEN)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return {
        "grads": grads,
        "grad/norm": float(torch.sqrt(sum((g**2).sum() for g in grads))),
        "entropy/mean": float(obj.masked_mean(obj.entropy_from_logits(logits.detach()), packed.mask)),
        "kl/mean": float(obj.masked_mean(obj.kl_divergence(logp.detach(), ref_logp, "k3"), packed.mask)),
    }


def _accumulate(policy, ref, groups, settings: LossSettings, grad_clip: float, shared_prompt: bool = False):
    """The trainer's way: one micro-step per group, as shards land, then one optimizer step. Returns the step's
    figures and the gradient the optimizer received (after scaling and clipping)."""
    model = copy.deepcopy(policy)
    trainer = PolicyTrainer(model, ref, lr=1e-3, grad_clip=grad_clip, loss=settings, shared_prompt=shared_prompt)
    seen = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        seen["grads"] = [p.grad.clone() for p in model.parameters()]
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    for g in groups:
        trainer.micro_step([g])
    return trainer.optimizer_step(), seen["grads"]


@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_accumulated_gradient_equals_the_whole_batch_loss_gradient(loss_agg, advantage, shared_prompt):
    policy, ref = build_tiny_model(VOCAB, seed=0, **TINY), build_tiny_model(VOCAB, seed=1, **TINY)
    groups = _batch()
    want = _whole_batch(policy, ref, groups, advantage, loss_agg)
    settings = LossSettings(advantage=advantage, loss_agg=loss_agg, kl_coef=KL_COEF, kl_kind="k3", norm_len=NORM_LEN)
    figures, grads = _accumulate(policy, ref, groups, settings, grad_clip=1e9, shared_prompt=shared_prompt)

    for got, expected in zip(grads, want["grads"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    assert figures["grad/norm"] == pytest.approx(want["grad/norm"], rel=1e-4)
    assert figures["entropy/mean"] == pytest.approx(want["entropy/mean"], rel=1e-5)  # token-weighted over the batch
    assert figures["kl/mean"] == pytest.approx(want["kl/mean"], rel=1e-5)
    assert want["grad/norm"] > 1e-3 and want["kl/mean"] > 1e-3  # a real gradient and a real KL term


def test_the_clip_applies_to_the_scaled_gradient():
    """`trainer.grad_clip` bounds the norm of the batch's gradient (after the 1/denominator), not of the sum."""
    policy, ref = build_tiny_model(VOCAB, seed=0, **TINY), build_tiny_model(VOCAB, seed=1, **TINY)
    groups = _batch()
    want = _whole_batch(policy, ref, groups, "grpo", "token-mean")
    clip = want["grad/norm"] / 2
    figures, grads = _accumulate(policy, ref, groups, LossSettings(kl_coef=KL_COEF, kl_kind="k3"), grad_clip=clip)
    assert figures["grad/norm"] == pytest.approx(want["grad/norm"], rel=1e-4)  # the norm before clipping
    assert float(torch.sqrt(sum((g**2).sum() for g in grads))) == pytest.approx(clip, rel=1e-4)
