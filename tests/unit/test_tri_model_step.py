"""The tri-model micro-step (DESIGN.md): per micro-batch one policy forward (with grad), one reference forward only
when a KL term is used, and no forward at all for the old policy (on-policy: old = current detached, ratio 1).
Also the shared-prompt fallback counter: a micro-batch where sharing saves nothing trains unshared and is counted.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models import objectives
from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer, RolloutGroup

torch.set_num_threads(1)

VOCAB = 40
PAD = 0
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _groups(n_groups: int, G: int, prompt_len: int, seed: int = 0) -> list[RolloutGroup]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_groups):
        prompt = torch.randint(4, VOCAB, (prompt_len,), generator=gen).tolist()
        lens = torch.randint(1, 6, (G,), generator=gen).tolist()
        responses = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]
        rewards = torch.rand(G, generator=gen).tolist()  # distinct: non-zero GRPO advantages when G > 1
        out.append(RolloutGroup(prompt, responses, rewards, [[-1.0] * n for n in lens], [[0] * n for n in lens]))
    return out


class ForwardLog:
    """Records every top-level forward of a model: (grad enabled, 4-D mask, rows)."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[tuple[bool, bool, int]] = []
        model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.calls.append((torch.is_grad_enabled(), kwargs["attention_mask"].dim() == 4, kwargs["input_ids"].shape[0]))


@pytest.fixture
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return build_tiny_model(VOCAB, seed=0, **TINY), build_tiny_model(VOCAB, seed=1, **TINY)


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_one_policy_and_one_reference_forward_per_micro_step(models, monkeypatch, shared_prompt):
    policy, ref = models
    policy_log, ref_log = ForwardLog(policy), ForwardLog(ref)
    ratios = []

    def spy(*args, **kwargs):  # the trainer's PPO loss, with its ratio figures kept
        loss, metrics = real_policy_loss(*args, **kwargs)
        ratios.append((metrics["ratio/min"], metrics["ratio/max"], metrics["clip/fraction"]))
        return loss, metrics

    real_policy_loss = objectives.policy_loss
    monkeypatch.setattr(objectives, "policy_loss", spy)
    # clip range 0: any ratio other than exactly 1 would count as clipped
    loss = LossSettings(kl_coef=0.05, clip_low=0.0, clip_high=0.0)
    trainer = PolicyTrainer(policy, ref, lr=1e-2, loss=loss, pad_token_id=PAD, shared_prompt=shared_prompt)
    before = [p.detach().clone() for p in policy.parameters()]
    batches = [_groups(2, 4, 12, seed=1), _groups(1, 3, 20, seed=2), _groups(3, 4, 10, seed=3)]
    for i, mb in enumerate(batches, start=1):
        trainer.micro_step(mb)
        assert len(policy_log.calls) == i, "the policy ran more than one forward in a micro-step (old policy pass?)"
        assert len(ref_log.calls) == i
    assert all(grad for grad, _, _ in policy_log.calls)  # the policy forward carries grad
    assert not any(grad for grad, _, _ in ref_log.calls)  # the reference never does
    # policy and reference see the same packed micro-batch (same layout, same rows)
    assert [c[1:] for c in policy_log.calls] == [c[1:] for c in ref_log.calls]
    assert all(is4d == shared_prompt for _, is4d, _ in policy_log.calls)

    figures = trainer.optimizer_step()
    assert ratios == [(1.0, 1.0, 0.0)] * 3  # old = current detached: the ratio is exactly 1 on every token
    assert figures["clip/fraction"] == 0.0
    assert figures["kl/mean"] > 0.0  # the reference differs from the policy: the KL term is really there
    assert all(not torch.equal(b, p) for b, p in zip(before, policy.parameters(), strict=True)), (
        "a parameter did not change"
    )


def test_no_reference_forward_without_kl(models):
    policy, ref = models
    policy_log, ref_log = ForwardLog(policy), ForwardLog(ref)
    trainer = PolicyTrainer(policy, ref, lr=1e-2, loss=LossSettings(kl_coef=0.0), pad_token_id=PAD)
    trainer.micro_step(_groups(2, 4, 12, seed=1))
    trainer.micro_step(_groups(1, 4, 12, seed=2))
    figures = trainer.optimizer_step()
    assert len(policy_log.calls) == 2
    assert ref_log.calls == []
    assert "kl/mean" not in figures
    assert figures["clip/fraction"] == 0.0


def test_shared_fallback_counter(models):
    policy, _ = models
    log = ForwardLog(policy)
    keep = LossSettings(skip_zero_advantage=False)  # a G = 1 group has zero advantage: it would not be run at all
    trainer = PolicyTrainer(policy, None, lr=1e-2, pad_token_id=PAD, shared_prompt=True, loss=keep)

    trainer.micro_step(_groups(1, 1, 40, seed=1))  # G = 1: the shared row is the unshared row, nothing to save
    assert log.calls[-1][1:] == (False, 1)  # 2-D mask, one row: the unshared layout
    figures = trainer.optimizer_step()
    assert figures["train/shared_fallbacks"] == 1.0 and figures["train/micro_batches"] == 1.0

    trainer.micro_step(_groups(1, 8, 64, seed=2))  # G = 8, prompt 64 >> responses (<= 5): saving ~6x
    assert log.calls[-1][1:] == (True, 1)  # 4-D mask, one row for the whole group: the shared layout
    trainer.micro_step(_groups(2, 8, 48, seed=3))  # two such groups: one row each
    assert log.calls[-1][1:] == (True, 2)
    figures = trainer.optimizer_step()
    assert figures["train/shared_fallbacks"] == 0.0 and figures["train/micro_batches"] == 2.0

    # with sharing switched off nothing is a fallback
    off = PolicyTrainer(policy, None, lr=1e-2, pad_token_id=PAD, shared_prompt=False, loss=keep)
    off.micro_step(_groups(1, 1, 40, seed=1))
    off.micro_step(_groups(1, 8, 64, seed=2))
    assert log.calls[-1][1:] == (False, 8)
    assert off.optimizer_step()["train/shared_fallbacks"] == 0.0


# ------------------------------------------------------------------------------------------------ decoupled PPO (async)


def _stale_groups(policy: torch.nn.Module, token_version: int, noise: float, seed: int) -> list[RolloutGroup]:
    """Groups whose behaviour log-probs are the policy's own plus noise (an older policy), all tokens of one version."""
    from models.packing import Group, pack, packed_logits, token_logprobs

    groups = _groups(2, 4, 12, seed=seed)
    packed = pack([Group(g.prompt_ids, g.responses) for g in groups], PAD, False)
    with torch.no_grad():
        lp = token_logprobs(packed_logits(policy, packed), packed.targets)
    gen = torch.Generator().manual_seed(seed)
    rows = iter(range(lp.shape[0]))
    for g in groups:
        for j, r in enumerate(g.responses):
            i = next(rows)
            g.behavior_logprobs[j] = (lp[i, : len(r)] + noise * torch.randn(len(r), generator=gen)).tolist()
            g.token_versions[j] = [token_version] * len(r)
    return groups


def _logprobs(model: torch.nn.Module, groups: list[RolloutGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, T) log-probs of `model` on the unshared packing of `groups`, and its mask."""
    from models.packing import Group, pack, packed_logits, token_logprobs

    packed = pack([Group(g.prompt_ids, g.responses) for g in groups], PAD, False)
    with torch.no_grad():
        return token_logprobs(packed_logits(model, packed), packed.targets), packed.mask


def _decoupled_trainer(policy, prox: str, previous=None, previous_version: int | None = None, **loss):
    trainer = PolicyTrainer(
        policy, None, lr=1e-2, pad_token_id=PAD, loss=LossSettings(decoupled=True, prox_logp=prox, **loss)
    )
    if previous is not None and trainer.prox_model is not None:  # what a resumed run loads: one version back
        trainer.prox_model.load_state_dict(previous.state_dict())
        trainer.prox_version = previous_version
    return trainer


@pytest.mark.parametrize("prox", ["recompute", "metrics", "loglinear", "linear"])
def test_decoupled_forward_count_and_proximal_values(models, monkeypatch, prox):
    """recompute / metrics: one extra no-grad pass per micro-step, of the proximal weights (trainer version - 1), whose
    log-probs are the proximal ones of every token 2 versions behind; loglinear / linear: no extra pass, and at
    staleness d=2 (alpha=1/2) log pi_prox lies halfway between behaviour and current in log space (loglinear)."""
    policy, previous = models
    groups = _stale_groups(policy, token_version=1, noise=0.3, seed=4)  # trained at version 3: d = 2
    seen = []
    real = objectives.proximal_logprobs

    def spy(behavior, current, versions, version, mask, kind, recomputed=None):
        out = real(behavior, current, versions, version, mask, kind, recomputed)
        seen.append((kind, behavior, current.detach(), recomputed, mask.bool(), out[0]))
        return out

    monkeypatch.setattr(objectives, "proximal_logprobs", spy)
    trainer = _decoupled_trainer(policy, prox, previous, 2, is_cap=None)
    log = ForwardLog(policy)
    prox_log = ForwardLog(trainer.prox_model) if trainer.prox_model is not None else None
    trainer.micro_step(groups, version=3)
    assert log.calls == [(True, False, 8)]  # the policy: one forward with grad (2 groups x 4 rows, unshared)
    kind, b, cur, rec, m, out = seen[0]
    if prox in ("recompute", "metrics"):
        assert prox_log.calls == [(False, False, 8)]  # the proximal weights: one no-grad forward of the same rows
        expected, _ = _logprobs(previous, groups)
        assert kind == "recompute" and float((rec - expected).abs()[m].max()) <= 1e-6
        assert float((rec - cur).abs()[m].max()) > 1e-2  # not the current policy: the weights one version back
        assert torch.equal(out[m], rec[m])
    if prox == "loglinear":
        assert torch.allclose(out[m], (b + 0.5 * (cur - b))[m], atol=1e-6)
    figures = trainer.optimizer_step()
    assert figures["is_weight/max"] >= figures["is_weight/mean"] > 0
    assert figures["time/prox_s"] > 0
    if prox == "metrics":  # both approximations' errors against the recomputed pass are logged, and not zero
        assert [s[0] for s in seen] == ["recompute", "loglinear", "linear"]
        assert figures["prox/loglinear/abs_err"] > 1e-3 and figures["prox/linear/abs_err"] > 1e-3
        for approx in ("loglinear", "linear"):  # and how far the gradient of the loss moves with them
            f = {k.split("/")[-1]: v for k, v in figures.items() if k.startswith(f"prox/{approx}/")}
            assert f["grad_abs"] > 0 and f["grad_abs_err"] > 0
            assert 0 <= f["zeroed_shared_fraction"] <= min(f["zeroed_fraction"], f["reference_zeroed_fraction"])
        assert figures["prox/loglinear/reference_zeroed_fraction"] == figures["prox/linear/reference_zeroed_fraction"]
        # the no-trust-region baseline (uncapped here): it zeroes nothing, so it shares nothing; it is measured
        # against the same recomputed gradient (grad_abs identical, same tensors and ops), from which it differs
        # where recompute's clip acts
        f = {k.split("/")[-1]: v for k, v in figures.items() if k.startswith("prox/no_clip/")}
        assert f["zeroed_fraction"] == f["zeroed_shared_fraction"] == 0.0
        assert f["grad_abs"] == figures["prox/loglinear/grad_abs"]
        assert figures["prox/loglinear/reference_zeroed_fraction"] > 0 and f["grad_abs_err"] > 0  # 4.3%, 0.043 here
    else:
        assert not any(k.startswith(("prox/loglinear", "prox/linear", "prox/no_clip")) for k in figures)


def test_recompute_skips_the_pass_when_no_token_is_two_versions_behind(models):
    """Tokens 0 or 1 versions behind have their behaviour policy as proximal policy: no extra pass, no proximal
    weights needed, and the proximal log-probs are the behaviour log-probs exactly (importance weight exactly 1)."""
    policy, _ = models
    trainer = _decoupled_trainer(policy, "recompute")  # holds no proximal weights
    prox_log = ForwardLog(trainer.prox_model)
    trainer.micro_step(_stale_groups(policy, token_version=2, noise=0.3, seed=4), version=3)  # d = 1
    trainer.micro_step(_stale_groups(policy, token_version=3, noise=0.3, seed=5), version=3)  # d = 0
    assert prox_log.calls == []
    figures = trainer.optimizer_step()
    assert figures["is_weight/mean"] == 1.0 and figures["is_weight/max"] == 1.0  # w = exp(prox - b) = exp(0)


def test_the_proximal_weights_follow_the_optimizer_steps(models):
    """Before each optimizer step the trainer keeps the weights it steps from: they are the proximal policy of the
    next version. A trainer asked for a proximal policy it does not hold refuses with what to do."""
    import copy

    policy, _ = models
    trainer = _decoupled_trainer(policy, "recompute")
    with pytest.raises(
        RuntimeError,
        match=r"proximal policy of trainer version 3 is v2, but the trainer holds no "
        r"proximal weights: load them into prox_model",
    ):
        trainer.micro_step(_stale_groups(policy, token_version=1, noise=0.3, seed=4), version=3)
    trainer.micro_step(_stale_groups(policy, token_version=0, noise=0.3, seed=4), version=0)
    v0 = copy.deepcopy(policy.state_dict())
    trainer.optimizer_step()
    assert trainer.prox_version == 0
    assert all(torch.equal(v0[k], t) for k, t in trainer.prox_model.state_dict().items())
    assert not torch.equal(v0["model.embed_tokens.weight"], policy.state_dict()["model.embed_tokens.weight"])
    groups = _stale_groups(policy, token_version=0, noise=0.3, seed=6)  # trained at version 2: d = 2, prox v1 wanted
    with pytest.raises(RuntimeError, match="proximal policy of trainer version 2 is v1, but the trainer holds v0"):
        trainer.micro_step(groups, version=2)
    trainer.micro_step(_stale_groups(policy, token_version=0, noise=0.3, seed=7), version=1)  # d = 1: no pass
    v1 = copy.deepcopy(policy.state_dict())
    trainer.optimizer_step()
    assert trainer.prox_version == 1
    assert all(torch.equal(v1[k], t) for k, t in trainer.prox_model.state_dict().items())
    trainer.micro_step(groups, version=2)  # now it holds v1


def test_metrics_mode_trains_exactly_like_recompute(models):
    policy, previous = models
    import copy

    grads = {}
    for prox in ("recompute", "metrics", "loglinear"):
        p = copy.deepcopy(policy)
        trainer = _decoupled_trainer(p, prox, previous, 3)
        trainer.micro_step(_stale_groups(policy, token_version=0, noise=1.0, seed=5), version=4)
        grads[prox] = torch.cat([q.grad.flatten() for q in p.parameters() if q.grad is not None])
    assert torch.equal(grads["recompute"], grads["metrics"])
    assert not torch.allclose(grads["recompute"], grads["loglinear"], rtol=1e-3)  # the approximation is not exact


def test_metrics_mode_logs_exactly_the_approximation_figures(models):
    """`prox_logp: metrics` logs, besides the trained (recomputed) proximal policy's alpha, per approximation its
    log-prob errors and its gradient agreement with the recomputed policy, and for the no-trust-region baseline the
    agreement figures other than the reference's zeroed fraction (the approximations' already carry it): no figure
    left out (a dashboard would read nothing), none duplicated under another name."""
    policy, previous = models
    trainer = _decoupled_trainer(policy, "metrics", previous, 2)
    trainer.micro_step(_stale_groups(policy, token_version=1, noise=0.3, seed=4), version=3)
    figures = trainer.optimizer_step()
    agreement = ["grad_abs_err", "grad_abs", "zeroed_fraction", "zeroed_shared_fraction"]
    per_approx = ["abs_err", "rel_err", "gap_ratio", "is_weight_err", *agreement, "reference_zeroed_fraction"]
    assert {k for k in figures if k.startswith("prox/")} == {
        "prox/alpha_mean",
        *(f"prox/{a}/{k}" for a in ("loglinear", "linear") for k in per_approx),
        *(f"prox/no_clip/{k}" for k in agreement),
    }
    assert figures["prox/alpha_mean"] == pytest.approx(0.5)  # every token 2 versions behind


def test_metrics_mode_error_ratios_do_not_depend_on_the_micro_batch_split(models):
    """`prox/*/rel_err` and `prox/*/gap_ratio` are ratios of sums over the batch's tokens: one micro-step of a stale
    and an on-policy batch gives the figures of two micro-steps of the same groups, and both equal the ratios taken
    by hand over all the tokens. (Averaged per micro-step, the on-policy one, with no gap, halved the gap ratio.)"""
    policy, previous = models
    stale = _stale_groups(policy, token_version=0, noise=0.3, seed=4)  # trained at version 3: d = 3
    fresh = _stale_groups(policy, token_version=3, noise=0.3, seed=5)  # d = 0: pi_prox = pi_b, no error, no gap
    figures = []
    for split in ([stale + fresh], [stale, fresh], [fresh, stale]):
        trainer = _decoupled_trainer(copy.deepcopy(policy), "metrics", previous, 2)  # each from the same weights
        for groups in split:
            trainer.micro_step(groups, version=3)
        figures.append(trainer.optimizer_step())
    # by hand over every token: loglinear's prox at d = 3 is b + 2/3 (cur - b), the recomputed one prev's log-probs
    cur, m = _logprobs(policy, stale)
    prev, _ = _logprobs(previous, stale)
    b = torch.zeros_like(cur)
    rows = iter(range(cur.shape[0]))
    for g in stale:
        for j, r in enumerate(g.responses):
            b[next(rows), : len(r)] = torch.tensor(g.behavior_logprobs[j])
    m = m.bool()
    err = ((b + 2 / 3 * (cur - b)) - prev).abs()[m].sum()
    fresh_ref = sum(abs(x) for g in fresh for lp in g.behavior_logprobs for x in lp)  # |recomputed| = |b| at d = 0
    want_rel = float(err / (prev.abs()[m].sum() + fresh_ref))
    want_gap = float(err / (prev - b).abs()[m].sum())
    for f in figures:
        assert f["prox/loglinear/rel_err"] == pytest.approx(want_rel, rel=1e-4)
        assert f["prox/loglinear/gap_ratio"] == pytest.approx(want_gap, rel=1e-4)
        assert "prox/loglinear/ref_abs" not in f and "prox/loglinear/gap_abs" not in f  # the means behind them
    assert 0.05 < want_gap < 0.95  # an approximation that is neither exact nor pi_b


def test_entropy_is_that_of_the_policy_at_the_sampling_temperature(models):
    """`entropy/mean` is the mean entropy of softmax(logits / T) over the response tokens: the policy that is
    sampled and trained (token_logprobs), not the raw logits' softmax."""
    from models.packing import Group, pack, packed_logits

    policy, _ = models
    groups = _groups(2, 4, 12, seed=6)
    trainer = PolicyTrainer(policy, None, lr=1e-2, pad_token_id=PAD, loss=LossSettings(temperature=0.25))
    packed = pack([Group(g.prompt_ids, g.responses) for g in groups], PAD, False)
    with torch.no_grad():
        logits = packed_logits(policy, packed)
    trainer.micro_step(groups)
    got = trainer.optimizer_step()["entropy/mean"]
    m = packed.mask.bool()
    at_t, at_1 = (
        objectives.entropy_from_logits(logits / 0.25)[m].mean(),
        objectives.entropy_from_logits(logits)[m].mean(),
    )
    assert got == pytest.approx(float(at_t), rel=1e-5)
    assert float(at_1 - at_t) > 0.1  # the temperature matters here (the untrained model is nearly uniform)


def test_the_proximal_pass_uses_the_sampling_temperature(models, monkeypatch):
    """The recomputed proximal log-probs are those of the proximal weights at the rollout temperature, like the
    policy's own (a pass at temperature 1 would put a temperature ratio into every ratio and weight)."""
    from models.packing import Group, pack, packed_logits, token_logprobs

    policy, previous = models
    groups = _stale_groups(policy, token_version=1, noise=0.3, seed=4)  # trained at version 3: d = 2
    seen = []
    real = objectives.proximal_logprobs

    def spy(behavior, current, versions, version, mask, kind, recomputed=None):
        seen.append((recomputed, mask.bool()))
        return real(behavior, current, versions, version, mask, kind, recomputed)

    monkeypatch.setattr(objectives, "proximal_logprobs", spy)
    trainer = _decoupled_trainer(policy, "recompute", previous, 2, temperature=0.5)
    trainer.micro_step(groups, version=3)
    packed = pack([Group(g.prompt_ids, g.responses) for g in groups], PAD, False)
    with torch.no_grad():
        logits = packed_logits(previous, packed)
        at_t, at_1 = token_logprobs(logits, packed.targets, 0.5), token_logprobs(logits, packed.targets)
    rec, m = seen[0]
    assert float((rec - at_t).abs()[m].max()) <= 1e-6
    assert float((at_1 - at_t).abs()[m].max()) > 1e-2  # the temperature matters here
