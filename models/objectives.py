"""RL objectives: group advantages, loss aggregation, PPO-family policy losses, KL estimators, A-3PO proximal policy.

Every function here is pure: tensors and scalars in, ``(value, metrics)`` out (a few helpers return a bare tensor).
Metrics are python floats, gathered with one device sync per call. Nothing logs, reads a config or touches storage.
Variants are ``Literal`` strings dispatched once per function, ending in a ``raise ValueError`` that lists the choices.

Shape letters: ``B`` sequences (one response per row), ``T`` tokens, ``V`` vocabulary, ``G`` responses per group.
A ``mask`` is ``(B, T)``, bool or 0/1 float, true on response tokens that take part in the loss. Masked positions may
hold garbage (padding, ``-inf`` log-probs): every function selects with ``torch.where`` so that garbage cannot leak
into a value. See ``models/OBJECTIVES.md`` for how the names map onto verl and TRL.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "AdvantageKind",
    "KLKind",
    "ISLevel",
    "ISMode",
    "LossAgg",
    "ProxKind",
    "aggregate",
    "aggregate_parts",
    "compute_advantages",
    "decoupled_policy_loss",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "entropy_from_logprobs",
    "kl_divergence",
    "kl_penalized_token_rewards",
    "masked_mean",
    "overlong_penalty",
    "policy_loss",
    "prox_error_ratios",
    "proximal_logprobs",
    "staleness_alpha",
    "trust_region_agreement",
    "whiten_advantages",
]

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3"]
ProxKind = Literal["recompute", "loglinear", "linear"]
ISMode = Literal["cap", "mask"]
ISLevel = Literal["token", "sequence", "geometric"]


# ----------------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------------


def _choices(literal: object) -> str:
    return ", ".join(repr(c) for c in get_args(literal))


def _floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Turn 0-d tensors into python floats with a single device sync (one ``tolist`` for the whole dict)."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, Tensor)}
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if tensors:
        stacked = torch.stack([v.detach().to(torch.float64).reshape(()) for v in tensors.values()])
        out.update(zip(tensors, stacked.cpu().tolist(), strict=True))
    return {k: out[k] for k in metrics}


def _bool_mask(mask: Tensor, shape: torch.Size, name: str = "mask") -> Tensor:
    """Validate a (B, T) mask against ``shape`` and return it as bool."""
    if mask.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but must have shape {tuple(shape)} (one entry per token); "
            "build it from the same padded batch as the per-token tensors"
        )
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"{name} must hold only 0 and 1; pass a bool mask, and fold per-token weights into the per-token "
            "loss instead of the mask"
        )
    return mask != 0


def _check_shape(expected: torch.Size, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != expected:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but must have shape {tuple(expected)} like logp; "
                "pass per-token tensors of one padded (B, T) batch"
            )


def _token_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    """(B,) or (B, T) advantages -> (B, T), detached: advantages are constants of the loss."""
    if advantages.shape == shape:
        return advantages.detach()
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages.detach().unsqueeze(-1).expand(shape)  # (B, 1) -> (B, T)
    raise ValueError(
        f"advantages have shape {tuple(advantages.shape)}; expected ({shape[0]},) per sequence or "
        f"{tuple(shape)} per token"
    )


def _masked_stats(x: Tensor, m: Tensor, empty: float) -> tuple[Tensor, Tensor, Tensor]:
    """Masked mean, max and min of x (B, T) over m; ``empty`` for each when the mask selects nothing."""
    n = m.sum()
    fill = x.new_tensor(empty)
    mean = torch.where(m, x, 0.0).sum() / n.clamp(min=1)
    mx = torch.where(n > 0, torch.where(m, x, -torch.inf).max(), fill) if x.numel() else fill
    mn = torch.where(n > 0, torch.where(m, x, torch.inf).min(), fill) if x.numel() else fill
    return torch.where(n > 0, mean, fill), mx, mn


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true; 0 where nothing is selected.

    x: (B, T) (any shape), mask: same shape. Returns a 0-d tensor, or the reduced tensor when ``dim`` is given.
    Plain arithmetic mean, no paper: stated here because every figure ``*/mean`` of DESIGN.md is this mean.
    """
    m = _bool_mask(mask, x.shape)
    total = torch.where(m, x, 0.0).sum() if dim is None else torch.where(m, x, 0.0).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1)


# ----------------------------------------------------------------------------------------------------------------
# advantages
# ----------------------------------------------------------------------------------------------------------------


def compute_advantages(
    rewards: Tensor, kind: AdvantageKind = "grpo", eps: float = 1e-6, unbiased_std: bool = True
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative outcome advantages, one per response.

    - ``grpo``: Shao et al. 2024 (DeepSeekMath), §4.1.2 outcome supervision, the advantage of the GRPO objective
      (eq. 3): ``A_i = (r_i - mean(r)) / (std(r) + eps)``. ``unbiased_std`` picks Bessel's correction (torch, verl
      and TRL default) or the population std.
    - ``drgrpo``: Liu et al. 2025, "Understanding R1-Zero-Like Training", §3, the Dr. GRPO objective: the std
      division removed, ``A_i = r_i - mean(r)``.
    - ``rloo``: Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!" (leave-one-out baseline; as used
      by Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i}(r_j) = G/(G-1) * (r_i - mean(r))``.

    Departure: a group whose rewards are all identical (zero variance) or that has one response (G = 1) gets
    advantage exactly 0, not a rounding residue and not the raw reward (verl gives a single-sample group
    ``A = r``). Such groups carry no learning signal; they are counted in the metrics.

    rewards: (n_groups, G) float, finite. Returns ``adv`` (n_groups, G), detached, and metrics
    ``adv/mean``, ``adv/std`` (population), ``adv/abs_max``, ``adv/zero_var_groups`` (G >= 2, all rewards equal),
    ``adv/single_sample_groups`` (G = 1); the last two are counts and never overlap.
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be (n_groups, G), got shape {tuple(rewards.shape)}; reshape a flat batch with "
            "rewards.view(-1, G) (for one group use rewards.unsqueeze(0))"
        )
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf; fix the reward function or drop those groups before training")
    n_groups, g = r.shape
    mean = r.mean(dim=1, keepdim=True)  # (n_groups, 1)
    if kind == "grpo":
        if g > 1:
            std = r.std(dim=1, keepdim=True, correction=1 if unbiased_std else 0)  # (n_groups, 1)
        else:
            std = torch.ones_like(mean)  # G = 1: zeroed below
        adv = (r - mean) / (std + eps)  # (n_groups, G)
    elif kind == "drgrpo":
        adv = r - mean  # (n_groups, G)
    elif kind == "rloo":
        if g > 1:
            others_mean = (r.sum(dim=1, keepdim=True) - r) / (g - 1)  # (n_groups, G) mean of the G-1 others
            adv = r - others_mean
        else:
            adv = torch.zeros_like(r)
    else:
        raise ValueError(f"unknown advantage kind {kind!r}; choose one of {_choices(AdvantageKind)}")

    degenerate = (r == r[:, :1]).all(dim=1, keepdim=True)  # (n_groups, 1): every reward equal (always for G = 1)
    adv = torch.where(degenerate, torch.zeros_like(adv), adv)  # exactly 0, whatever the rounding of the mean
    n_degenerate = degenerate.sum()
    zero = r.new_zeros(())
    metrics: dict[str, Tensor | float] = {
        "adv/mean": adv.mean() if adv.numel() else zero,
        "adv/std": adv.std(correction=0) if adv.numel() else zero,
        "adv/abs_max": adv.abs().max() if adv.numel() else zero,
        "adv/zero_var_groups": n_degenerate if g > 1 else zero,
        "adv/single_sample_groups": float(n_groups) if g == 1 else 0.0,
    }
    return adv, _floats(metrics)


def whiten_advantages(adv: Tensor, mask: Tensor | None = None, eps: float = 1e-8) -> tuple[Tensor, dict[str, float]]:
    """Batch-level whitening ``(A - mean) / sqrt(var + eps)`` over the selected entries (PPO practice; Schulman et al.
    2017 use normalised advantages in their baselines implementation, not an equation of the paper).

    Only valid when the whole batch is present: in periodic (streaming) mode a micro-batch is trained before the
    rest of the batch exists, so lockstep normalises per group (``compute_advantages``) and must not whiten across
    the batch; doing so would make a micro-batch's gradient depend on samples not yet generated and break
    periodic == sync. The variance is the population variance (no Bessel correction).

    adv: (B,) or (B, T); mask: same shape or None (all entries). Returns whitened adv (same shape, 0 where masked
    out) and ``adv/whiten_mean``, ``adv/whiten_std`` (the statistics before whitening).
    """
    m = torch.ones_like(adv, dtype=torch.bool) if mask is None else _bool_mask(mask, adv.shape)
    a = adv.detach()
    n = m.sum().clamp(min=1)
    mean = torch.where(m, a, 0.0).sum() / n  # ()
    var = torch.where(m, (a - mean) ** 2, 0.0).sum() / n  # ()
    out = torch.where(m, (a - mean) * torch.rsqrt(var + eps), 0.0)
    return out, _floats({"adv/whiten_mean": mean, "adv/whiten_std": var.sqrt()})


# ----------------------------------------------------------------------------------------------------------------
# loss aggregation
# ----------------------------------------------------------------------------------------------------------------


def aggregate_parts(
    per_token: Tensor, mask: Tensor, mode: LossAgg, norm_len: int | None = None
) -> tuple[Tensor, float]:
    """Split a loss aggregation into ``(numerator, denominator)`` so that gradient accumulation is exact.

    For any split of the batch's rows into micro-batches, ``sum(numerators) / sum(denominators)`` equals the
    whole-batch aggregate (value and gradient): every numerator is a sum over rows, every denominator a count.

    - ``token-mean``: ``sum(l*m) / sum(m)``. DAPO (Yu et al. 2025) eq. 12, token-level policy-gradient loss.
    - ``seq-mean-token-mean``: ``sum_i mean_t(l_i) / n_seqs``. GRPO as written in DeepSeekMath eq. 3.
    - ``seq-mean-token-sum``: ``sum_i sum_t l_i / n_seqs``.
    - ``seq-mean-token-sum-norm``: ``sum(l*m) / (n_seqs * norm_len)``, Dr. GRPO (Liu et al. 2025, §3): the
      per-response length normaliser is replaced by a constant (the maximum response length), ``norm_len``.

    Choice (the brief left it open): a row with no mask token is absent from the batch in every mode: it adds 0 to
    the numerator and is not counted in ``n_seqs``. So padding rows added by a micro-batcher, or a response masked
    out entirely (e.g. an overlong one), never dilute the loss, and the aggregate does not depend on how the batch
    was padded or split. verl's current ``agg_loss`` also excludes such rows; TRL's ``grpo`` loss counts them.

    per_token: (B, T) with grad; mask: (B, T) bool or 0/1. Returns numerator (0-d tensor, carries grad) and
    denominator (python float; 0.0 when the mask selects nothing). ``norm_len`` is required for
    ``seq-mean-token-sum-norm`` and ignored by the other modes.
    """
    if per_token.dim() != 2:
        raise ValueError(f"per_token must be (B, T), got shape {tuple(per_token.shape)}")
    m = _bool_mask(mask, per_token.shape)
    masked = torch.where(m, per_token, 0.0)  # (B, T)
    tokens_per_seq = m.sum(dim=1)  # (B,)
    if mode == "token-mean":
        return masked.sum(), float(tokens_per_seq.sum())
    elif mode == "seq-mean-token-mean":
        seq_mean = masked.sum(dim=1) / tokens_per_seq.clamp(min=1)  # (B,); empty rows are 0
        return seq_mean.sum(), float((tokens_per_seq > 0).sum())
    elif mode == "seq-mean-token-sum":
        return masked.sum(), float((tokens_per_seq > 0).sum())
    elif mode == "seq-mean-token-sum-norm":
        if norm_len is None:
            raise ValueError(
                "loss aggregation 'seq-mean-token-sum-norm' needs norm_len: pass the maximum response length "
                "(a constant for the whole run, e.g. the generation max_new_tokens)"
            )
        if norm_len <= 0:
            raise ValueError(f"norm_len must be a positive token count, got {norm_len}")
        return masked.sum(), float((tokens_per_seq > 0).sum()) * float(norm_len)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {_choices(LossAgg)}")


def aggregate(per_token: Tensor, mask: Tensor, mode: LossAgg, norm_len: int | None = None) -> Tensor:
    """Whole-batch aggregate ``numerator / denominator`` of ``aggregate_parts`` (same papers and modes).

    per_token, mask: (B, T). Returns a 0-d tensor; 0 (with a graph) when the mask selects nothing.
    """
    numerator, denominator = aggregate_parts(per_token, mask, mode, norm_len)
    return numerator / max(denominator, 1.0)  # denominator is 0 only when the numerator is exactly 0


# ----------------------------------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------------------------------


def _clipped_surrogate(
    log_ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    max_log_ratio: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The one implementation of the clip math. log_ratio, adv, m: (B, T). Returns per-token loss and metrics."""
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020 use 3), got {dual_clip}; pass None to disable it")
    if max_log_ratio <= 0.0:
        raise ValueError(f"max_log_ratio must be > 0, got {max_log_ratio}")
    log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)  # (B, T): exp cannot overflow
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T) pessimistic bound, PPO eq. 7
    negative = adv < 0
    r = ratio.detach()
    high = m & (adv > 0) & (r > 1.0 + clip_high)  # pushed up past the trust region: no gradient
    low = m & negative & (r < 1.0 - clip_low)  # pushed down past the trust region: no gradient
    if dual_clip is not None:
        bound = -adv * dual_clip  # (B, T) = c * |A| where A < 0
        dual = m & negative & (loss.detach() > bound)  # ratio > c: the loss would grow without bound
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    else:
        dual = torch.zeros_like(m)
    loss = torch.where(m, loss, 0.0)  # (B, T)

    n = m.sum().clamp(min=1)
    ratio_mean, ratio_max, ratio_min = _masked_stats(r, m, empty=1.0)
    k3 = torch.expm1(log_ratio.detach()) - log_ratio.detach()  # (B, T) Schulman k3 of KL(old || new), x ~ old
    metrics = {
        "clip/fraction": (high | low | dual).sum() / n,
        "clip/low_fraction": low.sum() / n,
        "clip/high_fraction": high.sum() / n,
        "clip/dual_fraction": dual.sum() / n,
        "ratio/mean": ratio_mean,
        "ratio/max": ratio_max,
        "ratio/min": ratio_min,
        "kl/approx": torch.where(m, k3, 0.0).sum() / n,
    }
    return loss, metrics


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token PPO-clip loss with asymmetric clipping and optional dual clip.

    Schulman et al. 2017 (PPO) eq. 7, negated for minimisation, with the decoupled bounds of DAPO's clip-higher
    (Yu et al. 2025, eq. 10):

        r_t = exp(logp_t - old_logp_t),   loss_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))

    and, when ``dual_clip = c > 1``, the dual clip of Ye et al. 2020 ("Mastering Complex Control in MOBA Games with
    Deep Reinforcement Learning", dual-clip PPO objective) for A < 0: ``loss_t = min(loss_t, -A c)``, so a token with
    a negative advantage and a huge ratio contributes at most ``c |A|``.

    Departure: the log-ratio is clamped to ``[-max_log_ratio, max_log_ratio]`` before ``exp`` (as verl does with 20)
    so that a diverged token cannot produce inf; past the clamp that token's gradient is 0.

    On-policy shortcut (DESIGN.md, tri-model micro-step): with ``old_logp = logp.detach()`` the ratio is exactly 1,
    nothing is clipped and the gradient of ``loss_t`` with respect to ``logp_t`` is ``-A_t``.

    logp: (B, T) with grad; old_logp: (B, T) (detached here); advantages: (B,) or (B, T); mask: (B, T).
    Returns the per-token loss (B, T), 0 where the mask is 0, and metrics ``clip/fraction`` (tokens with any clip
    active: low, high or dual; they pass no gradient), ``clip/low_fraction``, ``clip/high_fraction``,
    ``clip/dual_fraction``, ``ratio/mean``, ``ratio/max``, ``ratio/min`` and ``kl/approx`` (Schulman's k3 estimate
    of KL(old || new), masked mean). Fractions are over mask tokens; an empty mask reports ratio 1 and zeros.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    _check_shape(logp.shape, old_logp=old_logp)
    m = _bool_mask(mask, logp.shape)
    adv = _token_advantages(advantages, logp.shape)  # (B, T)
    log_ratio = logp - old_logp.detach()  # (B, T)
    loss, metrics = _clipped_surrogate(log_ratio, adv, m, clip_low, clip_high, dual_clip, max_log_ratio)
    return loss, _floats(metrics)


def decoupled_policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_cap: float | None = 5.0,
    is_mode: ISMode = "cap",
    is_level: ISLevel = "token",
    max_log_ratio: float = 20.0,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token decoupled PPO loss for off-policy (async) batches.

    Hilton, Cobbe & Schulman 2022, "Batch size-invariance for policy optimization", decoupled PPO objective (the
    proximal policy replaces the behaviour policy as the trust-region anchor); as used by AReaL (Fu et al. 2025) and
    A-3PO (DESIGN.md):

        r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_b (detached),   loss_t = max(-A r_t, -A clip(r_t)) * w_t

    The clip (and dual clip) math is ``policy_loss``'s, with ``prox_logp`` in place of ``old_logp``.

    Importance weight ``w`` (``is_level``):
    - ``token``: per token, ``exp(prox_t - b_t)``.
    - ``sequence``: per sequence, the product over its mask tokens, ``exp(sum_t (prox_t - b_t))`` - the exact
      likelihood ratio of the whole response (verl's ``rollout_is="sequence"``, TRL's ``sequence_*`` modes);
      unbiased but high-variance for long responses, hence the cap.
    - ``geometric``: per sequence, the geometric mean ``exp(mean_t (prox_t - b_t))``; biased, low variance.
    The log-weight is clamped to ``[-max_log_ratio, max_log_ratio]`` before ``exp``.

    ``is_cap`` (None: no cap) with ``is_mode``:
    - ``cap``: truncated IS, ``w = min(w, is_cap)``.
    - ``mask``: tokens (all tokens of a sequence, at sequence levels) with ``w > is_cap`` get weight 0 (AReaL's
      ``behav_imp_weight_cap``). They stay in the aggregation denominator, like a token with zero advantage; to
      remove them from the denominator too, drop them from the mask before aggregating.

    logp: (B, T) with grad; prox_logp, behavior_logp: (B, T) (detached here); advantages: (B,) or (B, T); mask (B, T).
    Returns per-token loss (B, T), 0 where masked, and the metrics of ``policy_loss`` plus ``is_weight/mean`` and
    ``is_weight/max`` (of the raw weight, before cap or mask: they measure how off-policy the batch is),
    ``is_weight/applied_mean`` (after), ``is_weight/capped_fraction`` and ``is_weight/masked_fraction``.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    _check_shape(logp.shape, prox_logp=prox_logp, behavior_logp=behavior_logp)
    m = _bool_mask(mask, logp.shape)
    adv = _token_advantages(advantages, logp.shape)  # (B, T)
    prox = prox_logp.detach()
    surrogate, metrics = _clipped_surrogate(logp - prox, adv, m, clip_low, clip_high, dual_clip, max_log_ratio)

    log_w_tok = torch.where(m, prox - behavior_logp.detach(), 0.0)  # (B, T)
    if is_level == "token":
        log_w = log_w_tok  # (B, T)
    elif is_level == "sequence":
        log_w = log_w_tok.sum(dim=1, keepdim=True).expand_as(log_w_tok)  # (B, 1) -> (B, T)
    elif is_level == "geometric":
        n_tok = m.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
        log_w = (log_w_tok.sum(dim=1, keepdim=True) / n_tok).expand_as(log_w_tok)  # (B, 1) -> (B, T)
    else:
        raise ValueError(f"unknown is_level {is_level!r}; choose one of {_choices(ISLevel)}")
    w_raw = torch.exp(log_w.clamp(-max_log_ratio, max_log_ratio))  # (B, T)

    no_flag = torch.zeros_like(m)
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}; pass None to disable the cap")
    over = m & (w_raw > is_cap) if is_cap is not None else no_flag  # (B, T)
    if is_mode == "cap":
        w = w_raw.clamp(max=is_cap) if is_cap is not None else w_raw
        capped, masked_out = over, no_flag
    elif is_mode == "mask":
        w = torch.where(over, 0.0, w_raw)
        capped, masked_out = no_flag, over
    else:
        raise ValueError(f"unknown is_mode {is_mode!r}; choose one of {_choices(ISMode)}")

    loss = torch.where(m, surrogate * w, 0.0)  # (B, T)
    n = m.sum().clamp(min=1)
    w_mean, w_max, _ = _masked_stats(w_raw, m, empty=1.0)
    metrics.update(
        {
            "is_weight/mean": w_mean,
            "is_weight/max": w_max,
            "is_weight/applied_mean": _masked_stats(w, m, empty=1.0)[0],
            "is_weight/capped_fraction": capped.sum() / n,
            "is_weight/masked_fraction": masked_out.sum() / n,
        }
    )
    return loss, _floats(metrics)


# ----------------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------------


def kl_divergence(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3", clamp: float | None = 10.0) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    Schulman 2020, "Approximating KL Divergence" (k1, k2, k3); k3 is also DeepSeekMath (Shao et al. 2024) eq. 4.
    With ``delta = ref_logp - logp``:
    - ``k1 = -delta``: unbiased, high variance, can be negative.
    - ``k2 = delta**2 / 2``: biased, low variance, non-negative.
    - ``k3 = exp(delta) - delta - 1``: unbiased, low variance, non-negative (verl ``low_var_kl``).

    Clamps (when ``clamp`` is not None; verl's defaults): ``delta`` is clamped to [-20, 20] before ``exp`` so k3
    cannot overflow (an overflow would turn the zero gradient of the outer clamp into NaN), and the estimate is
    clamped to [-clamp, clamp]. Past either clamp the token's gradient is 0: a safety net against a few exploding
    tokens, at the price of bias there. ``clamp=None`` gives the raw estimators.

    logp: (B, T) (gradient flows through it); ref_logp: (B, T) (detached here). Returns (B, T); mask it yourself.
    """
    _check_shape(logp.shape, ref_logp=ref_logp)
    delta = ref_logp.detach() - logp  # (B, T)
    if kind == "k1":
        kl = -delta
    elif kind == "k2":
        kl = 0.5 * delta.square()
    elif kind == "k3":
        if clamp is not None:
            delta = delta.clamp(-20.0, 20.0)
        kl = torch.expm1(delta) - delta
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {_choices(KLKind)}")
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"clamp must be > 0 or None, got {clamp}")
        kl = kl.clamp(-clamp, clamp)
    return kl


def kl_penalized_token_rewards(
    token_rewards: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    coef: float,
    kind: KLKind = "k1",
    mask: Tensor | None = None,
    clamp: float | None = None,
) -> Tensor:
    """Per-token rewards with the KL applied as a reward penalty: ``r_t - coef * kl_t`` with ``kl_t`` detached.

    Ouyang et al. 2022 (InstructGPT) eq. 2, following Ziegler et al. 2019; DeepSeekMath (Shao et al. 2024) eq. 2,
    the per-token PPO reward of their §4.1.1. With ``k1`` the penalty, carried by the policy-gradient estimator
    (not differentiated here), gives an unbiased gradient of the reverse KL; k2 and k3 are allowed but biased in
    this position.

    token_rewards, logp, ref_logp: (B, T); mask: (B, T) or None. Where the mask is 0 the reward is returned as is.
    Returns (B, T), no grad.
    """
    _check_shape(token_rewards.shape, logp=logp, ref_logp=ref_logp)
    kl = kl_divergence(logp.detach(), ref_logp, kind=kind, clamp=clamp)  # (B, T)
    penalized = token_rewards.detach() - coef * kl
    if mask is None:
        return penalized
    return torch.where(_bool_mask(mask, token_rewards.shape), penalized, token_rewards.detach())


# ----------------------------------------------------------------------------------------------------------------
# A-3PO: staleness-aware proximal policy
# ----------------------------------------------------------------------------------------------------------------


def staleness_alpha(d: Tensor) -> Tensor:
    """A-3PO interpolation weight (Li, Wu & Shen 2025, "A-3PO", staleness-aware proximal approximation; DESIGN.md).

    ``alpha = 1 - 1/d`` for d >= 1, ``0`` for d <= 1. With the proximal policy one optimizer step behind the trainer
    (version v_theta - 1) and the token generated at v_b = v_theta - d, placing pi_prox by version between pi_b and
    pi_theta gives alpha = (v_prox - v_b) / (v_theta - v_b) = (d - 1) / d (AReaL's ``prox_approx`` formula).

    d: staleness (any shape), float or int. Returns alpha with the same shape, float, in [0, 1).
    """
    d = d if d.is_floating_point() else d.to(torch.get_default_dtype())
    return 1.0 - 1.0 / d.clamp(min=1.0)  # exactly 0 for d <= 1


def proximal_logprobs(
    behavior_logp: Tensor,
    current_logp: Tensor,
    token_versions: Tensor,
    trainer_version: int,
    mask: Tensor,
    kind: ProxKind,
    recomputed_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Proximal-policy log-probs for the decoupled loss: recomputed, or approximated without a forward pass.

    The proximal policy is the one A-3PO's interpolation places (Li, Wu & Shen 2025; AReaL's ``prox_approx``): one
    optimizer step behind the trainer, version ``v_prox = trainer_version - 1``, and never older than the token's
    own behaviour policy. Per token, with ``d = trainer_version - token_versions`` and
    ``alpha = staleness_alpha(d)``:
    - ``loglinear``: ``log pi_prox = log pi_b + alpha (log pi_theta - log pi_b)`` (interpolation in log space).
    - ``linear``: ``log pi_prox = log((1 - alpha) pi_b + alpha pi_theta)`` (in probability space; computed with
      ``logaddexp``, never leaving log space).
    - ``recompute``: decoupled PPO's exact proximal pass (Hilton et al. 2022): ``recomputed_logp`` are the log-probs
      of the weights of version ``trainer_version - 1``, required, and used where ``d >= 2``.
    At ``d <= 1`` (alpha = 0) every kind returns ``behavior_logp`` exactly: the token's behaviour policy is then the
    proximal one (d = 1) or the current one (d = 0, on-policy). ``current_logp`` is the log-prob of the forward
    pass the loss already runs; it is detached here.

    Departure from AReaL: its ``recompute`` evaluates the trainer's weights before the update (version
    ``trainer_version``) while its approximation targets ``trainer_version - 1``. With one optimizer step per
    batch that recomputed policy is the current one, so the ratio pi_theta / pi_prox is exactly 1 and the clip never
    acts; here ``recompute`` computes the policy that the approximations approximate, so ``metrics`` measures their
    error against their own target.

    Masked positions (prompt, padding) return ``behavior_logp`` for every kind; their versions are not checked.

    behavior_logp, current_logp, token_versions, mask, recomputed_logp: (B, T). Returns prox log-probs (B, T),
    detached, and metrics ``staleness/mean``, ``staleness/max``, ``prox/alpha_mean``; when ``recomputed_logp`` is
    given to an approximating kind, also ``prox/abs_err`` (mean |approx - recomputed|), ``prox/ref_abs`` (mean
    |recomputed|), ``prox/gap_abs`` (mean |recomputed - behavior|), ``prox/is_weight_err`` (mean |exp(approx - b) -
    exp(recomputed - b)|), all over mask tokens, ``recomputed`` standing for the recompute kind's proximal log-probs
    (behaviour where d <= 1), and the ratios of `prox_error_ratios`. The means are per token, so that token-weighted
    averages over micro-batches stay exact; the ratios are not: over several micro-batches, take them of the averaged
    means.
    """
    _check_shape(
        behavior_logp.shape,
        current_logp=current_logp,
        token_versions=token_versions,
        recomputed_logp=recomputed_logp,
    )
    m = _bool_mask(mask, behavior_logp.shape)
    b = behavior_logp.detach()
    cur = current_logp.detach()
    d = (trainer_version - token_versions).to(b.dtype)  # (B, T) staleness
    if bool((m & (d < 0)).any()):
        raise ValueError(
            f"token_versions exceed trainer_version={trainer_version} on response tokens: a token cannot come from a "
            "newer policy than the trainer's; check the version bookkeeping of the rollout shards"
        )
    alpha = staleness_alpha(d)  # (B, T)
    if kind == "recompute":
        if recomputed_logp is None:
            raise ValueError(
                "kind='recompute' needs recomputed_logp: run the proximal forward pass (the weights of version "
                "trainer_version - 1) and pass its log-probs, or use kind='loglinear' (A-3PO) to approximate it "
                "without that pass"
            )
        prox = recomputed_logp.detach()
    elif kind == "loglinear":
        prox = b + alpha * (cur - b)  # (B, T)
    elif kind == "linear":
        prox = torch.logaddexp(torch.log1p(-alpha) + b, torch.log(alpha) + cur)  # (B, T); log(0) = -inf is fine
    else:
        raise ValueError(f"unknown proximal kind {kind!r}; choose one of {_choices(ProxKind)}")
    prox = torch.where(m & (alpha > 0), prox, b)  # (B, T): behaviour at d <= 1 and off the mask, for every kind

    d_mean, d_max, _ = _masked_stats(d, m, empty=0.0)
    metrics: dict[str, Tensor | float] = {
        "staleness/mean": d_mean,
        "staleness/max": d_max,
        "prox/alpha_mean": _masked_stats(alpha, m, empty=0.0)[0],
    }
    if recomputed_logp is not None and kind != "recompute":
        ref = torch.where(m & (alpha > 0), recomputed_logp.detach(), b)  # (B, T) the recompute kind's prox
        err = torch.where(m, (prox - ref).abs(), 0.0)  # (B, T)
        n = m.sum().clamp(min=1)
        metrics["prox/abs_err"] = err.sum() / n
        metrics["prox/ref_abs"] = torch.where(m, ref.abs(), 0.0).sum() / n
        metrics["prox/gap_abs"] = torch.where(m, (ref - b).abs(), 0.0).sum() / n
        metrics |= prox_error_ratios(metrics["prox/abs_err"], metrics["prox/ref_abs"], metrics["prox/gap_abs"], "prox/")
        w_err = (torch.exp(prox - b) - torch.exp(ref - b)).abs()  # (B, T)
        metrics["prox/is_weight_err"] = torch.where(m, w_err, 0.0).sum() / n
    return prox, _floats(metrics)


def prox_error_ratios(abs_err: float | Tensor, ref_abs: float | Tensor, gap_abs: float | Tensor, prefix: str) -> dict:
    """The proximal approximation's relative errors from its per-token means (`proximal_logprobs`): ``rel_err`` =
    sum |approx - recomputed| / sum |recomputed| and ``gap_ratio`` = sum |approx - recomputed| / sum |recomputed -
    behavior| (1: no better than using pi_b, 0: exact), keyed ``prefix + name``. Means over the same tokens, so
    their ratios are the ratios of the sums; a zero denominator (no token two or more versions behind, so no
    error either) gives 0."""
    tiny = torch.finfo(torch.float32).tiny
    return {
        f"{prefix}rel_err": abs_err / max(float(ref_abs), tiny),
        f"{prefix}gap_ratio": abs_err / max(float(gap_abs), tiny),
    }


def trust_region_agreement(
    logp: Tensor,
    prox_logp: Tensor,
    reference_prox_logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **loss_kwargs: object,
) -> dict[str, float]:
    """How far the decoupled loss's gradient with an approximate proximal policy lands from the one with the reference
    (recomputed) proximal policy, token by token.

    The two proximal policies differ only through the loss: unclipped and uncapped, ``w * r = pi_theta / pi_b`` for
    any pi_prox, so the approximation matters where the trust region acts (clip, dual clip, IS cap or mask). Both
    losses are ``decoupled_policy_loss`` with ``loss_kwargs``; ``g_t = d loss_t / d logp_t`` is taken by autograd on
    a detached copy of ``logp`` (the loss's own math, nothing re-derived). ``g_t`` is the per-token coefficient
    before ``loss_agg``'s weighting (under the seq-mean modes the parameter gradient weights it by 1/length). A token
    is *zeroed* when it has a nonzero advantage and ``g_t == 0`` (its gradient cut by the clip, the IS mask or the
    loss's ±20 clamp of the log-ratio). Autograd runs inside, so it cannot be called under ``torch.inference_mode``.

    logp, prox_logp, reference_prox_logp, behavior_logp, mask: (B, T); advantages: (B,) or (B, T). Returns per-token
    means over the mask (so that token-weighted averages over micro-batches stay exact): ``grad_abs_err``
    (mean |g_approx - g_ref|), ``grad_abs`` (mean |g_ref|), ``zeroed_fraction`` (tokens the approximation zeroes),
    ``reference_zeroed_fraction`` and ``zeroed_shared_fraction`` (zeroed by both): shared / reference is the recall of
    the reference's trust region, shared / zeroed its precision.
    """
    m = _bool_mask(mask, logp.shape)
    adv = _token_advantages(advantages, logp.shape)  # (B, T)

    def gradient(prox: Tensor) -> Tensor:
        x = logp.detach().clone().requires_grad_(True)  # (B, T)
        with torch.enable_grad():
            loss, _ = decoupled_policy_loss(x, prox, behavior_logp, adv, mask, **loss_kwargs)
            (g,) = torch.autograd.grad(loss.sum(), x)
        return g  # (B, T)

    g_approx, g_ref = gradient(prox_logp), gradient(reference_prox_logp)
    live = m & (adv != 0)  # (B, T) tokens that would pass a gradient without a trust region
    zeroed, ref_zeroed = live & (g_approx == 0), live & (g_ref == 0)  # (B, T)
    n = m.sum().clamp(min=1)
    return _floats(
        {
            "grad_abs_err": torch.where(m, (g_approx - g_ref).abs(), 0.0).sum() / n,
            "grad_abs": torch.where(m, g_ref.abs(), 0.0).sum() / n,
            "zeroed_fraction": zeroed.sum() / n,
            "reference_zeroed_fraction": ref_zeroed.sum() / n,
            "zeroed_shared_fraction": (zeroed & ref_zeroed).sum() / n,
        }
    )


# ----------------------------------------------------------------------------------------------------------------
# entropy and DAPO extras
# ----------------------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Shannon entropy ``H = -sum_v p_v log p_v`` of the softmax of ``logits`` (Shannon 1948, Theorem 2).

    Computed in float32 (or the input's wider dtype) with ``log_softmax``; ``-inf`` logits (banned tokens) count as
    p = 0 and contribute 0. logits: (..., V). Returns (...), no reduction.
    """
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return entropy_from_logprobs(torch.log_softmax(x, dim=-1))


def entropy_from_logprobs(logp: Tensor) -> Tensor:
    """`entropy_from_logits` of a distribution given as its log-probs (a ``log_softmax``'s output): (..., V) ->
    (...); ``-inf`` entries count as p = 0."""
    p = logp.exp()
    return -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)  # (...)


def overlong_penalty(response_lengths: Tensor, max_len: int, cache_len: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``penalty_factor``.

    With L the response length: 0 if L <= max_len - cache_len; ``(max_len - cache_len - L) / cache_len`` (linear from
    0 to -1) if max_len - cache_len < L <= max_len; -1 if L > max_len. Added to the task reward. ``cache_len = 0``
    makes it a hard step at max_len.

    response_lengths: (B,) int or float. Returns (B,) float penalties in [-penalty_factor, 0].
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    floating = response_lengths.is_floating_point()
    length = response_lengths if floating else response_lengths.to(torch.get_default_dtype())  # (B,)
    start = float(max_len - cache_len)
    ramp = (start - length) / max(cache_len, 1)  # (B,) used only where start < L <= max_len, so cache_len >= 1
    pen = torch.where(length <= start, torch.zeros_like(length), torch.where(length <= max_len, ramp, -1.0))
    return pen * penalty_factor


def dynamic_sampling_keep(rewards: Tensor, atol: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11 constraint ``0 < |{o_i correct}| < G``), generalised to any
    reward: keep the groups whose rewards are not all equal (max - min > atol); the others have zero advantage.

    rewards: (n_groups, G). Returns keep (n_groups,) bool and ``filter/dropped_groups``, ``filter/kept_groups``
    (counts). A group with G = 1 is always dropped.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (n_groups, G), got shape {tuple(rewards.shape)}; use rewards.view(-1, G)")
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    r = rewards.detach()
    spread = r.max(dim=1).values - r.min(dim=1).values if r.shape[1] else r.new_zeros(r.shape[0])  # (n_groups,)
    keep = spread > atol  # (n_groups,)
    kept = keep.sum()
    return keep, _floats({"filter/dropped_groups": r.shape[0] - kept, "filter/kept_groups": kept})
