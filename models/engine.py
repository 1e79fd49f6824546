"""Built-in generation engine (CPU and tests): KV cache, G samples per prompt sharing the prompt's KV,
temperature / top-p sampling, EOS stopping, per-token log-probs of the sampling distribution.

Randomness is per sample: sample j of prompt i draws from its own `torch.Generator` seeded by
`sample_seed(run_seed, iteration, prompt_id, j)`, so a sample's tokens do not depend on which worker made
it or on what else was in its batch (the batch composition itself is fixed by the plan, not by scheduling).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


def sample_seed(run_seed: int, iteration: int, prompt_id: int, sample_index: int) -> int:
    """A 63-bit seed derived from (run seed, iteration, prompt, sample); stable across processes and platforms."""
    digest = hashlib.blake2b(f"{run_seed}/{iteration}/{prompt_id}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Sample:
    """One generated response: tokens, log-probs of the sampling distribution, and why it stopped."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS emitted, included in response_ids) or "length"
    seed: int
    token_versions: list[int] = field(default_factory=list)  # the policy version that produced each token


@dataclass
class SamplingParams:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_on_newline_id: int | None = field(default=None)  # optional extra stop token (treated like EOS)
    other_eos_ids: tuple[int, ...] = ()  # the model's end ids beside the tokenizer's EOS (`models.tiny.other_eos_ids`)

    def stop_ids(self, eos_token_id: int) -> list[int]:
        """Every id a response ends at, for both engines: EOS, the model's other end ids, the newline if set."""
        newline = [self.stop_on_newline_id] if self.stop_on_newline_id is not None else []
        return [eos_token_id, *self.other_eos_ids, *newline]


def _sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from: softmax(logits / T), truncated to the top-p nucleus
    and renormalised. logits: (N, V) -> (N, V), -inf outside the nucleus."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(dim=-1)
        # keep a token if the mass before it is < top_p (the top token is always kept)
        drop_sorted = (cum - sorted_logp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """The name the model's forward takes its KV cache by: `cache` since transformers renamed `past_key_values` (5.2x,
    the old name a deprecated alias), which the `cuda` extra's vLLM caps transformers below. A name the forward does
    not take falls silently into its `**kwargs`: the cache stays empty and each step sees only its own token."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _prefill(model: torch.nn.Module, seqs: list[list[int]], pad_token_id: int, device):
    """Left-padded prefill of `seqs` (one row each): (cache, last-position logits (n, V), attention mask, next pos)."""
    width = max(len(p) for p in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long, device=device)  # (n, P) left-padded
    attn = torch.zeros((n, width), dtype=torch.long, device=device)
    for i, p in enumerate(seqs):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)  # (n, P)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{_cache_keyword(type(model)): cache},
    )
    next_pos = torch.tensor([len(p) for p in seqs], device=device)
    return cache, out.logits[:, -1, :], attn, next_pos


@torch.no_grad()
def generate_groups(
    model: torch.nn.Module,
    prompts: list[list[int]],
    group_size: int,
    params: SamplingParams,
    seeds: list[list[int]],
    eos_token_id: int,
    pad_token_id: int,
    version: int = 0,
    poll_update: Callable[[], int | None] | None = None,
) -> list[list[Sample]]:
    """Generate `group_size` samples for each prompt; returns one list of samples per prompt.

    The prompts are left-padded into one batch and prefilled once (one row per prompt); the cache is then
    repeated G times so the G samples of a group share the prompt's KV. seeds[i][j] seeds sample j of prompt i.

    Interruptible generation (async mode): `poll_update()`, called before every decoding step, may load new
    weights into `model` and return their version (None: no change). The samples then continue on the new
    weights: the KV cache of prompt + tokens so far is recomputed with them (a cache from the old weights would
    mix two policies inside one distribution), and every token records the version that produced it.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if len(seeds) != len(prompts) or any(len(s) != group_size for s in seeds):
        raise ValueError(f"seeds must be {len(prompts)} lists of {group_size} seeds")
    device = next(model.parameters()).device
    n, G = len(prompts), group_size
    cache, logits, attn, next_pos = _prefill(model, prompts, pad_token_id, device)  # (n, V)
    if G > 1:
        cache.batch_repeat_interleave(G)
        logits = logits.repeat_interleave(G, dim=0)  # (n*G, V)
        attn = attn.repeat_interleave(G, dim=0)
        next_pos = next_pos.repeat_interleave(G)  # (n*G,)

    N = n * G
    flat_seeds = [s for row in seeds for s in row]
    gens = [torch.Generator().manual_seed(s) for s in flat_seeds]
    cache_keyword = _cache_keyword(type(model))  # once, not per decode step
    stop_ids = set(params.stop_ids(eos_token_id))
    tokens: list[list[int]] = [[] for _ in range(N)]
    logps: list[list[float]] = [[] for _ in range(N)]
    versions: list[list[int]] = [[] for _ in range(N)]
    done = [False] * N
    reasons = ["length"] * N
    for step in range(params.max_new_tokens):
        if step > 0 and poll_update is not None:
            new_version = poll_update()
            if new_version is not None and new_version != version:
                version = new_version
                cache, logits, attn, next_pos = _prefill(
                    model, [prompts[r // G] + tokens[r] for r in range(N)], pad_token_id, device
                )
        if params.greedy:
            logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
            chosen = logp.argmax(dim=-1)  # (N,)
        else:
            logp = _sampling_logprobs(logits, params.temperature, params.top_p)  # (N, V)
            # inverse-CDF sampling with one uniform per row from that row's own generator
            u = torch.stack([torch.rand((), generator=g) for g in gens]).to(device)  # (N,)
            cdf = logp.exp().cumsum(dim=-1)  # (N, V)
            chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp(max=logp.shape[-1] - 1)
            # never pick a zero-probability token through rounding at the CDF's flat steps
            bad = torch.isinf(logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
            if bad.any():
                chosen = torch.where(bad, logp.argmax(dim=-1), chosen)
        chosen_logp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)  # (N,)
        ids = chosen.tolist()
        lps = chosen_logp.tolist()
        for r in range(N):
            if done[r]:
                continue
            tokens[r].append(ids[r])
            logps[r].append(lps[r])
            versions[r].append(version)
            if ids[r] in stop_ids:
                done[r] = True
                reasons[r] = "stop"
        if all(done):
            break
        feed = torch.tensor([pad_token_id if done[r] else ids[r] for r in range(N)], device=device).unsqueeze(-1)
        attn = torch.cat([attn, torch.ones((N, 1), dtype=attn.dtype, device=device)], dim=-1)
        out = model(
            input_ids=feed,
            attention_mask=attn,
            position_ids=next_pos.unsqueeze(-1),
            use_cache=True,
            **{cache_keyword: cache},
        )
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    results = []
    for i in range(n):
        group = []
        for j in range(G):
            r = i * G + j
            group.append(Sample(tokens[r], logps[r], reasons[r], flat_seeds[r], versions[r]))
        results.append(group)
    return results
