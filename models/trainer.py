"""The policy trainer: micro-steps that accumulate an exactly normalised gradient, then one optimizer step.

`micro_step` runs, on one packed micro-batch, the tri-model step of DESIGN.md: the reference log-probs (no grad,
only when a KL term is used), the policy log-probs (with grad) and the old-policy log-probs (on-policy: the current
policy detached, since with one optimizer step per batch the ratio is exactly 1, so that pass is free; off-policy with
`prox_logp: recompute`, the proximal policy's, from the weights of one version back). It backpropagates the
loss *numerator* only; the batch's normaliser (tokens or sequences) is known only when the batch is complete, so
`optimizer_step` divides the accumulated gradient by the accumulated denominator. The sum over micro-batches then
equals the whole-batch loss gradient whatever the split or the order of arrival (DESIGN.md, Propositions 1-2).
A group whose rewards (as `shaped_rewards` gives them: with DAPO's overlong punishment, once punished) are all equal
(zero advantage) adds only its tokens to that denominator: without a KL term its gradient is exactly 0, so its forward
and backward passes are skipped (`LossSettings.skip_zero_advantage`).
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models import objectives
from models.packing import (
    Group,
    check_logits_split,
    chunked_logprobs,
    pack,
    packed_logits,
    response_mask,
    token_logprobs,
    use_shared,
)


@dataclass
class RolloutGroup:
    """A finished group as the trainer consumes it: prompt, G responses, their rewards and behaviour data."""

    prompt_ids: list[int]
    responses: list[list[int]]
    rewards: list[float]
    behavior_logprobs: list[list[float]]
    token_versions: list[list[int]]
    prompt_id: int = -1  # the prompt's id in the task (its place in the batch's plan decides its mini-batch)


def group_tokens(group: RolloutGroup, shared: bool) -> int:
    """The tokens a group packs into: its prompt once and every response (shared), or the prompt per response."""
    if shared:
        return len(group.prompt_ids) + sum(len(r) for r in group.responses)
    return sum(len(group.prompt_ids) + len(r) for r in group.responses)


def lr_factor(step: int, total: int, *, kind: str = "constant", warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate of batch `step` (0-based) of `total`, as a fraction of the peak.

    Warm-up rises linearly over the first `warmup` batches ((step + 1) / warmup, so the first step is not wasted);
    then `linear` or `cosine` decays from 1 at batch `warmup` to `min_ratio` at the last batch, `total - 1`.
    A function of the batch index alone, so a resumed run and a replay take the same rates as the first run."""
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {kind!r}: expected constant, linear or cosine")
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    shape = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


# decoupled PPO's importance-weight figures, token-weighted over the batch: the raw weight's mean, the applied one's
# (after the cap or mask), and the fractions of tokens capped and masked out (`is_weight/max` is the raw maximum)
IS_WEIGHT_TOKEN_FIGURES = (
    "is_weight/mean",
    "is_weight/applied_mean",
    "is_weight/capped_fraction",
    "is_weight/masked_fraction",
)


@dataclass
class LossSettings:
    advantage: objectives.AdvantageKind = "grpo"
    loss_agg: objectives.LossAgg = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: objectives.KLKind = "k3"
    temperature: float = 1.0
    norm_len: int | None = None  # constant normaliser for seq-mean-token-sum-norm (the max response length)
    # off-policy (async) batches: decoupled PPO with a proximal policy (DESIGN.md, A-3PO)
    decoupled: bool = False
    prox_logp: str = "loglinear"  # recompute | loglinear | linear | metrics (trains on recompute, logs the errors)
    is_cap: float | None = 5.0
    is_mode: objectives.ISMode = "cap"
    is_level: objectives.ISLevel = "token"
    # a group whose rewards are all equal has zero advantage, so without a KL term it adds exactly 0 to the
    # gradient: micro_step counts its tokens in the loss normaliser and leaves it out of the forward and backward
    skip_zero_advantage: bool = True
    # DAPO's soft overlong punishment (max_len, buffer, factor), added to each reward before its advantage
    overlong: tuple[int, int, float] | None = None


def shaped_rewards(
    rewards: list[float], responses: list[list[int]], overlong: tuple[int, int, float] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A group's rewards as the trainer takes advantages of them, (G,) fp32, and the overlong punishment in them
    ((G,), or None without one): with `overlong` = (max_len, buffer, factor) each reward plus DAPO's soft overlong
    punishment of its response's length (`objectives.overlong_penalty`: 0 up to max_len - buffer tokens, then down
    linearly to -factor at max_len). The catalog's advantages are taken of the same."""
    r = torch.tensor(rewards, dtype=torch.float32)  # (G,)
    if overlong is None:
        return r, None
    max_len, buffer, factor = overlong
    lengths = torch.tensor([len(x) for x in responses])  # (G,)
    penalty = objectives.overlong_penalty(lengths, max_len, buffer, factor).to(torch.float32)  # (G,)
    return r + penalty, penalty


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn every dropout of `model` off, in train mode too: the rate of each `nn.Dropout` and the rates Hugging Face
    modules keep as float attributes and apply themselves (`attention_dropout` of Llama-family attention, OPT's
    `dropout`, LayerDrop's `layerdrop`). The model's config is left as it is (a checkpoint saved from it, or an
    export, keeps its dropout for other uses), so a model that reads a rate from its config as it runs keeps that
    one (transformers 5.25: Falcon's and Persimmon's decoder layers, whose released configs set them to 0).
    Returns how many non-zero rates were set to 0."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:  # Dropout, Dropout1d-3d, AlphaDropout
            module.p = 0.0
            changed += 1
        for name, value in vars(module).items():
            if "drop" in name.lower() and isinstance(value, float) and value:
                setattr(module, name, 0.0)
                changed += 1
    return changed


def check_checkpointing(model: torch.nn.Module | type) -> None:
    """Raise ValueError, naming the setting, unless `model` (or a model class) can checkpoint its layers (a
    transformers model whose class supports it: most causal LMs; in transformers 5.25 not CTRL, OpenAI GPT, XLNet,
    XLM, Reformer and a few more)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        name = model.__name__ if isinstance(model, type) else type(model).__name__
        raise ValueError(
            f"train.activation_checkpointing: the model ({name}) does not support activation "
            "checkpointing (its transformers class has supports_gradient_checkpointing = False): set "
            "train.activation_checkpointing=false"
        )


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them from the forward
    (gradient checkpointing): the layers' saved activations drop to their inputs, for one more forward pass of the
    layers per micro-step. The gradient is the same; on CPU bit for bit (`tests/unit/test_activation_checkpointing.py`:
    the recomputation repeats the forward's operations, and torch restores the forward's random state for dropout).
    Non-reentrant `torch.utils.checkpoint` (the reentrant kind needs an input that requires grad). Applies in train
    mode only: the engine's, the reference's and the proximal model's no-grad passes are unchanged."""
    check_checkpointing(model)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25's name; the older one warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class PolicyTrainer:
    """Owns the policy, the frozen reference and the optimizer; the loss math lives in `models.objectives`.

    Unless `keep_dropout`, the policy's and the reference's dropout is turned off (`disable_dropout`): the engine
    samples without it, so with it the first log-ratio of an on-policy batch would be noise instead of 0.
    `activation_checkpointing`: the policy's layers recompute their activations in the backward pass
    (`enable_activation_checkpointing`). `logits_chunk_tokens`: the log-probs of the policy, the reference and the
    proximal model come from their output layer `logits_chunk_tokens` response tokens at a time
    (`models.packing.chunked_logprobs`), never as the micro-batch's whole (S, T, V) logits; None: as a whole."""

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float | None = 1.0,
        loss: LossSettings | None = None,
        pad_token_id: int = 0,
        shared_prompt: bool = False,
        keep_dropout: bool = False,
        activation_checkpointing: bool = False,
        logits_chunk_tokens: int | None = None,
    ):
        self.model = model
        self.ref_model = ref_model
        self.keep_dropout = keep_dropout
        if not keep_dropout:  # before the proximal copy below, which then has none either
            for m in (model, ref_model):
                if m is not None:
                    disable_dropout(m)
        self.loss = loss or LossSettings()
        if self.loss.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.grad_clip = grad_clip
        self.pad_token_id = pad_token_id
        self.shared_prompt = shared_prompt
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.peak_lr = lr
        # decoupled PPO's proximal policy: the weights of one version back, kept from before each optimizer step
        self.prox_model: torch.nn.Module | None = None
        self.prox_version: int | None = None  # the version prox_model holds (None: none yet)
        if self.loss.decoupled and self.loss.prox_logp in ("recompute", "metrics"):
            self.prox_model = copy.deepcopy(model).requires_grad_(False).eval()
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing:  # the policy's backward only (the proximal copy above runs without grad)
            enable_activation_checkpointing(model)
        if logits_chunk_tokens is not None:
            if logits_chunk_tokens < 1:
                raise ValueError(f"logits_chunk_tokens must be >= 1 or None, got {logits_chunk_tokens}")
            for m in (model, ref_model):  # the proximal model is a copy of the policy
                if m is not None:
                    check_logits_split(m)
        self.logits_chunk_tokens = logits_chunk_tokens
        self._batch_version: int | None = None
        self._reset_accumulators()

    def _logprobs(
        self, model: torch.nn.Module, packed, entropy: bool = False
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor] | None]:
        """`model`'s log-probs of `packed`'s response tokens at the loss's temperature (S, T), with grad where grad is
        enabled; and, with `entropy`, a function giving the entropies of those distributions (S, T), without grad
        (called after the backward: from the whole logits, its (S, T, V) temporaries are then not beside the
        forward's graph). Chunked through the output layer with `logits_chunk_tokens`; else from the whole logits."""
        temperature = self.loss.temperature
        if self.logits_chunk_tokens is not None:
            logp, ent = chunked_logprobs(model, packed, temperature, self.logits_chunk_tokens, entropy=entropy)
            return logp, (lambda: ent) if entropy else None
        logits = packed_logits(model, packed)  # (S, T, V)
        logp = token_logprobs(logits, packed.targets, temperature)
        if not entropy:
            return logp, None
        # of the policy sampled and trained: softmax(logits / T), as token_logprobs takes it
        return logp, lambda: objectives.entropy_from_logits(logits.detach().float() / temperature)

    def set_lr_factor(self, factor: float) -> None:
        """The learning rate of the next optimizer steps: `factor` x the configured peak."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.peak_lr * factor

    def _reset_accumulators(self) -> None:
        self._denominator = 0.0
        self._sums: dict[str, float] = defaultdict(float)  # token-weighted metric sums
        self._tokens = 0.0
        self._maxes: dict[str, float] = {}
        self._samples = 0
        self._groups = 0

    @property
    def pending_samples(self) -> int:
        return self._samples

    def accumulators(self) -> dict:
        """What the micro-steps since the last optimizer step have summed (besides the gradient): denominator,
        token-weighted metric sums, counts. Another rank's, merged with `merge_accumulators`, make the batch's."""
        return {
            "denominator": self._denominator,
            "sums": dict(self._sums),
            "tokens": self._tokens,
            "maxes": dict(self._maxes),
            "samples": self._samples,
            "groups": self._groups,
        }

    def merge_accumulators(self, acc: dict) -> None:
        self._denominator += acc["denominator"]
        for key, value in acc["sums"].items():
            self._sums[key] += value
        self._tokens += acc["tokens"]
        for key, value in acc["maxes"].items():
            self._maxes[key] = max(self._maxes.get(key, value), value)
        self._samples += acc["samples"]
        self._groups += acc["groups"]

    def close(self) -> None:
        """Release what the trainer started (nothing here; a data-parallel trainer stops its other ranks)."""

    def skips(self, group: RolloutGroup) -> bool:
        """Whether `micro_step` leaves `group` out of its forward and backward passes (`skip_zero_advantage`): its
        rewards (as `shaped_rewards` gives them) are all equal, so every advantage estimator gives it exactly 0 (also
        with G = 1), and with no KL term its per-token loss and gradient are exactly 0 (decoupled PPO's too: its
        weights multiply the advantage)."""
        if not self.loss.skip_zero_advantage or self.loss.kl_coef > 0:
            return False
        r, _ = shaped_rewards(group.rewards, group.responses, self.loss.overlong)  # the estimators' equality, in fp32
        return bool(torch.isfinite(r).all() and (r == r[0]).all())  # a non-finite reward is refused when run

    def partition(self, groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], list[RolloutGroup]]:
        """`groups` as (to run, to skip) by `skips`, each in order."""
        run: list[RolloutGroup] = []
        skipped: list[RolloutGroup] = []
        for g in groups:
            (skipped if self.skips(g) else run).append(g)
        return run, skipped

    def _count_skipped(self, groups: list[RolloutGroup]) -> None:
        """What skipped groups add to the batch: their share of the loss normaliser (tokens or sequences, as the
        forward pass would have counted them: their response masks) and the counts; 0 to the numerator."""
        for g in groups:
            self._count_overlong(shaped_rewards(g.rewards, g.responses, self.loss.overlong)[1])
        mask = response_mask([r for g in groups for r in g.responses])  # (S, T)
        _, denominator = objectives.aggregate_parts(
            torch.zeros(mask.shape), mask, self.loss.loss_agg, norm_len=self.loss.norm_len
        )
        self._denominator += denominator
        self._samples += mask.shape[0]
        self._groups += len(groups)
        self._sums["adv/zero_groups"] += len(groups)
        self._sums["train/skipped_groups"] += len(groups)
        self._sums["train/skipped_tokens"] += float(mask.sum())

    def _count_overlong(self, penalty: torch.Tensor | None) -> None:
        """A group's overlong punishment in the batch's figures (`reward/overlong_*`, per sample)."""
        if penalty is not None:
            self._sums["reward/overlong_penalty"] += float(penalty.sum())
            self._sums["reward/overlong_samples"] += float((penalty < 0).sum())

    def micro_step(self, groups: list[RolloutGroup], version: int = 0, behavior_old: bool = False) -> dict[str, float]:
        """Forward + backward of the loss numerator on one micro-batch of whole groups; returns its figures.

        `version` is the trainer's policy version (the staleness of a token is version - its token version); it
        matters only to the decoupled loss. With `prox_logp: recompute` (or `metrics`) the proximal log-probs of
        tokens two or more versions behind come from an extra no-grad forward pass of the weights of version
        `version - 1` (`prox_model`, kept from before the last optimizer step) - decoupled PPO's proximal pass; a
        micro-batch with no such token needs no pass (its proximal policy is each token's behaviour policy).
        `loglinear` / `linear` (A-3PO) interpolate them without that pass.

        On-policy, the old policy is the current one (ratio exactly 1) until the batch's first optimizer step;
        `behavior_old` (PPO mini-batches after the first) takes the rollout's behaviour log-probs instead: the
        policy that generated the batch, which the trainer's weights have since moved away from.

        Groups with zero advantage are counted, not run (`skips`). Returns the response tokens and samples run."""
        if not groups:
            raise ValueError("micro_step needs at least one group")
        self.model.train()
        self._batch_version = version
        groups, skipped = self.partition(groups)
        if skipped:
            self._count_skipped(skipped)
            if not groups:
                return {"tokens": 0.0, "samples": 0}
        s = self.loss
        advs, penalties, zero_groups = [], [], 0
        for g in groups:  # per group: streaming never has the whole batch, so normalisation is per group
            r, penalty = shaped_rewards(g.rewards, g.responses, s.overlong)  # (G,)
            penalties.append(penalty)
            a, m = objectives.compute_advantages(r.unsqueeze(0), kind=s.advantage)
            advs.append(a.squeeze(0))
            zero_groups += m.get("adv/zero_var_groups", 0.0) + m.get("adv/single_sample_groups", 0.0)
        adv = torch.cat(advs)  # (S,)
        plain = [Group(g.prompt_ids, g.responses) for g in groups]
        shared = self.shared_prompt and use_shared(plain)
        packed = pack(plain, self.pad_token_id, shared)
        device = next(self.model.parameters()).device  # the loss's tensors live beside the log-probs
        S, T = packed.mask.shape
        behavior = torch.zeros((S, T))
        flat_beh = [lp for g in groups for lp in g.behavior_logprobs]
        for i, lp in enumerate(flat_beh):
            behavior[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        token_versions = None
        if s.decoupled:
            token_versions = torch.full((S, T), version, dtype=torch.long)
            for i, tv in enumerate(tv for g in groups for tv in g.token_versions):
                token_versions[i, : len(tv)] = torch.tensor(tv, dtype=torch.long)
            token_versions = token_versions.to(device)
        mask, adv, behavior = packed.mask.to(device), adv.to(device), behavior.to(device)  # (S, T), (S,), (S, T)

        ref_logp = None
        if s.kl_coef > 0:
            with torch.no_grad():
                self.ref_model.eval()
                ref_logp, _ = self._logprobs(self.ref_model, packed)
        logp, entropies = self._logprobs(self.model, packed, entropy=True)  # (S, T) with grad
        if s.decoupled:
            per_token, metrics = self._decoupled_loss(packed, logp, behavior, token_versions, version, adv, mask)
        else:
            old_logp = behavior if behavior_old else logp.detach()  # before any step of the batch: ratio exactly 1
            per_token, metrics = objectives.policy_loss(
                logp, old_logp, adv, mask, clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip
            )
        kl = None
        if ref_logp is not None:
            kl = objectives.kl_divergence(logp, ref_logp, kind=s.kl_kind)  # (S, T)
            per_token = per_token + s.kl_coef * kl
        numerator, denominator = objectives.aggregate_parts(per_token, mask, s.loss_agg, norm_len=s.norm_len)
        if not torch.isfinite(numerator):
            raise FloatingPointError(f"non-finite loss numerator {numerator.item()} in a micro-batch of {S} samples")
        numerator.backward()

        with torch.no_grad():
            ntok = float(mask.sum())
            entropy = objectives.masked_mean(entropies(), mask)
            mismatch = objectives.masked_mean((logp.detach() - behavior).abs(), mask)
            self._denominator += denominator
            self._tokens += ntok
            self._samples += S
            self._groups += len(groups)
            self._sums["loss_numerator"] += float(numerator)
            self._sums["entropy/mean"] += float(entropy) * ntok
            self._sums["mismatch/logp_abs"] += float(mismatch) * ntok
            for key in (
                "clip/fraction",
                "clip/low_fraction",
                "clip/high_fraction",
                *IS_WEIGHT_TOKEN_FIGURES,
                *(k for k in metrics if k.startswith("prox/")),
            ):
                if key in metrics:
                    self._sums[key] += metrics[key] * ntok
            if "is_weight/max" in metrics and ntok > 0:  # an empty micro-step's neutral 1.0 is no token's weight
                self._maxes["is_weight/max"] = max(self._maxes.get("is_weight/max", 0.0), metrics["is_weight/max"])
            self._sums["adv/zero_groups"] += zero_groups
            for penalty in penalties:
                self._count_overlong(penalty)
            self._sums["train/shared_fallbacks"] += float(self.shared_prompt and not shared)
            self._sums["train/micro_batches"] += 1.0
            if kl is not None:
                self._sums["kl/mean"] += float(objectives.masked_mean(kl.detach(), mask)) * ntok
        return {"tokens": ntok, "samples": S}

    def _decoupled_loss(self, packed, logp, behavior, token_versions, version, adv, mask):
        """Decoupled PPO on an off-policy micro-batch; the proximal log-probs by the configured method (timed)."""
        s = self.loss
        t0 = time.perf_counter()
        recomputed = None
        if s.prox_logp in ("recompute", "metrics"):
            recomputed = behavior  # (S, T): where no token is >= 2 versions behind, the proximal policy is pi_b
            if bool(((mask > 0) & (version - token_versions >= 2)).any()):
                if self.prox_version != version - 1:
                    raise RuntimeError(
                        f"the proximal policy of trainer version {version} is v{version - 1}, but the trainer holds "
                        f"{'no proximal weights' if self.prox_version is None else f'v{self.prox_version}'}: load "
                        "them into prox_model and set prox_version (a resumed run: its checkpoint one version back)"
                    )
                with torch.no_grad():
                    recomputed, _ = self._logprobs(self.prox_model, packed)
        kind = "recompute" if s.prox_logp == "metrics" else s.prox_logp
        prox, prox_metrics = objectives.proximal_logprobs(
            behavior, logp, token_versions, version, mask, kind, recomputed
        )
        self._sums["time/prox_s"] += time.perf_counter() - t0
        loss_kwargs = dict(
            clip_low=s.clip_low,
            clip_high=s.clip_high,
            dual_clip=s.dual_clip,
            is_cap=s.is_cap,
            is_mode=s.is_mode,
            is_level=s.is_level,
        )
        extra: dict[str, float] = {}
        if s.prox_logp == "metrics":  # how far each approximation lands from the recomputed proximal policy
            for approx in ("loglinear", "linear"):
                approx_prox, m = objectives.proximal_logprobs(
                    behavior, logp, token_versions, version, mask, approx, recomputed
                )
                m = {  # per-token means only: the ratios are taken of the batch's means (optimizer_step)
                    k[5:]: v
                    for k, v in m.items()
                    if k.startswith("prox/") and k not in ("prox/alpha_mean", "prox/rel_err", "prox/gap_ratio")
                }
                m.update(objectives.trust_region_agreement(logp, approx_prox, prox, behavior, adv, mask, **loss_kwargs))
                extra.update({f"prox/{approx}/{k}": v for k, v in m.items()})
            # the baseline an approximation's trust region is measured against: none at all (pi_prox = pi_theta, so
            # r = 1 and w = pi_theta / pi_b, capped or masked as configured)
            m = objectives.trust_region_agreement(logp, logp.detach(), prox, behavior, adv, mask, **loss_kwargs)
            extra.update({f"prox/no_clip/{k}": v for k, v in m.items() if k != "reference_zeroed_fraction"})
        per_token, metrics = objectives.decoupled_policy_loss(logp, prox, behavior, adv, mask, **loss_kwargs)
        metrics.update(extra)
        metrics["prox/alpha_mean"] = prox_metrics["prox/alpha_mean"]
        return per_token, metrics

    def optimizer_step(self) -> dict[str, float]:
        """Scale the accumulated gradient by 1/denominator, clip, step; returns the batch's figures."""
        scale = self._batch_scale()
        grad_norm = self._step(scale)
        if not math.isfinite(grad_norm):
            self._reset_accumulators()
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}: the step was not applied")
        return self._batch_figures(scale, grad_norm)

    def _batch_scale(self) -> float:
        """1 / the batch's loss denominator (the accumulated gradient is the numerator's)."""
        if self._samples == 0:
            raise RuntimeError("optimizer_step with no accumulated micro-steps")
        if self._denominator <= 0:
            raise RuntimeError(f"loss denominator is {self._denominator}: the batch has no response tokens")
        return 1.0 / self._denominator

    def _keep_prox(self) -> None:
        """Before a step: the weights now are the proximal policy of the next version."""
        if self.prox_model is not None:
            with torch.no_grad():
                for q, p in zip(self.prox_model.parameters(), self.model.parameters(), strict=True):
                    q.copy_(p)
            self.prox_version = self._batch_version

    def _step(self, scale: float) -> float:
        """The accumulated gradient times `scale`, clipped, stepped (the proximal weights kept first); returns the
        gradient norm before clipping. A non-finite norm leaves weights and optimizer state as they were."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params and self._sums["train/skipped_groups"]:
            # every group of the batch was skipped: its gradient is exactly 0, on which AdamW still steps (its moments
            # move the weights), as it would have after the backward passes that were skipped. Those would have given
            # a gradient to the parameters the forward pass uses: the ones AdamW has stepped before (a parameter no
            # pass ever used has no state and stays untouched), or all the trainable ones at the first step
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            params = [p for p in trainable if p in self.optimizer.state] or trainable
            for p in params:
                p.grad = torch.zeros_like(p)
        for p in params:
            p.grad.mul_(scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip else math.inf)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return float(grad_norm)
        self._keep_prox()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _batch_figures(self, scale: float, grad_norm: float) -> dict[str, float]:
        """The batch's figures after its step; resets the accumulators."""
        tok = self._tokens
        figures = {
            "loss/policy": self._sums["loss_numerator"] * scale,
            "grad/norm": grad_norm,
            "train/lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/tokens": self._tokens,
            "train/samples": float(self._samples),
            "adv/zero_groups": self._sums["adv/zero_groups"],
            "train/skipped_groups": self._sums["train/skipped_groups"],
            "train/skipped_tokens": self._sums["train/skipped_tokens"],
            "train/micro_batches": self._sums["train/micro_batches"],
            "train/shared_fallbacks": self._sums["train/shared_fallbacks"],
        }
        if self.loss.decoupled:
            figures["time/prox_s"] = self._sums["time/prox_s"]
        if self.loss.overlong is not None:  # per sample, the skipped groups' too
            figures["reward/overlong_penalty"] = self._sums["reward/overlong_penalty"] / self._samples
            figures["reward/overlong_fraction"] = self._sums["reward/overlong_samples"] / self._samples
        if tok > 0:  # figures of the tokens trained: none when every group was skipped (0 would read as a value)
            token_keys = [
                "entropy/mean",
                "mismatch/logp_abs",
                "clip/fraction",
                "clip/low_fraction",
                "clip/high_fraction",
            ]
            if self.loss.kl_coef > 0:
                token_keys.append("kl/mean")
            if self.loss.decoupled:
                token_keys += list(IS_WEIGHT_TOKEN_FIGURES)
                token_keys += [k for k in self._sums if k.startswith("prox/")]
                figures["is_weight/max"] = self._maxes.get("is_weight/max", 1.0)
            figures.update({k: self._sums[k] / tok for k in token_keys})
            for head in [k[: -len("/ref_abs")] for k in figures if k.endswith("/ref_abs")]:  # metrics mode's ratios
                means = (figures[f"{head}/abs_err"], figures.pop(f"{head}/ref_abs"), figures.pop(f"{head}/gap_abs"))
                figures |= objectives.prox_error_ratios(*means, prefix=f"{head}/")
        self._reset_accumulators()
        return figures
