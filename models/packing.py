"""Packing of rollout groups into model inputs, and per-token log-probs gathered back to (sample, token) order.

Two layouts, one gather:
- unshared: one row per sample, `[prompt, response]`, right-padded (what peers do);
- shared:   one row per group, `[prompt, r1, ..., rG]` (the shared-prompt layout of DESIGN.md); each response
            attends causally to the prompt and to itself only, and its position ids restart at len(prompt).
For every sample, `gather_pos[s, t]` is the position in row `gather_row[s]` whose logits predict response
token t, so both layouts give log-probs of the same (S, T) shape.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from models.objectives import entropy_from_logprobs


@dataclass
class Group:
    """One prompt and its G responses (token ids only): the unit packed and trained together."""

    prompt_ids: list[int]
    responses: list[list[int]]


@dataclass
class Packed:
    input_ids: torch.Tensor  # (rows, L)
    position_ids: torch.Tensor  # (rows, L)
    attention_mask: torch.Tensor  # (rows, L) long for unshared; (rows, 1, L, L) bool for shared (True = attend)
    gather_row: torch.Tensor  # (S,)
    gather_pos: torch.Tensor  # (S, T)
    targets: torch.Tensor  # (S, T) response token ids, pad where mask is 0
    mask: torch.Tensor  # (S, T) float, 1 on real response tokens
    segments: torch.Tensor | None = None  # shared: (rows, L) -1 padding, 0 prompt, j+1 response j (FlexAttention)

    @property
    def num_tokens(self) -> int:
        """Tokens the model actually processes (padding included): the compute cost of this layout."""
        return int(self.input_ids.numel())


def response_mask(responses: list[list[int]]) -> torch.Tensor:
    """(S, T) float, 1 on each response's tokens: the loss mask of a packed batch of these responses, in either
    layout (what the loss's normaliser counts)."""
    T = max([len(r) for r in responses] + [1])
    mask = torch.zeros((len(responses), T), dtype=torch.float32)
    for s, r in enumerate(responses):
        mask[s, : len(r)] = 1.0
    return mask


def _sample_table(groups: list[Group], pad_id: int):
    samples = [r for g in groups for r in g.responses]
    mask = response_mask(samples)
    targets = torch.full(mask.shape, pad_id, dtype=torch.long)
    for s, r in enumerate(samples):
        targets[s, : len(r)] = torch.tensor(r, dtype=torch.long)
    return samples, targets, mask


def pack_unshared(groups: list[Group], pad_id: int) -> Packed:
    """One right-padded row `[prompt, response]` per sample."""
    samples, targets, mask = _sample_table(groups, pad_id)
    prompts = [g.prompt_ids for g in groups for _ in g.responses]
    L = max(len(p) + len(r) for p, r in zip(prompts, samples, strict=True))
    S, T = targets.shape
    input_ids = torch.full((S, L), pad_id, dtype=torch.long)
    attn = torch.zeros((S, L), dtype=torch.long)
    gather_pos = torch.zeros((S, T), dtype=torch.long)
    for s, (p, r) in enumerate(zip(prompts, samples, strict=True)):
        seq = p + r
        input_ids[s, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[s, : len(seq)] = 1
        # logits at position len(p)-1+t predict response token t
        gather_pos[s, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
    position_ids = torch.arange(L).unsqueeze(0).expand(S, L).contiguous()
    return Packed(input_ids, position_ids, attn, torch.arange(S), gather_pos, targets, mask)


def pack_shared(groups: list[Group], pad_id: int) -> Packed:
    """One row `[prompt, r1, ..., rG]` per group with a block mask: response j sees the prompt and its own past."""
    samples, targets, mask = _sample_table(groups, pad_id)
    lengths = [len(g.prompt_ids) + sum(len(r) for r in g.responses) for g in groups]
    L = max(lengths)
    n = len(groups)
    S, T = targets.shape
    input_ids = torch.full((n, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n, L), dtype=torch.long)
    allowed = torch.zeros((n, 1, L, L), dtype=torch.bool)
    segments = torch.full((n, L), -1, dtype=torch.long)
    gather_row = torch.zeros(S, dtype=torch.long)
    gather_pos = torch.zeros((S, T), dtype=torch.long)
    causal = torch.ones((L, L), dtype=torch.bool).tril()
    s = 0
    for gi, g in enumerate(groups):
        P = len(g.prompt_ids)
        input_ids[gi, :P] = torch.tensor(g.prompt_ids, dtype=torch.long)
        position_ids[gi, :P] = torch.arange(P)
        allowed[gi, 0, :P, :P] = causal[:P, :P]
        segments[gi, :P] = 0
        start = P
        for j, r in enumerate(g.responses):
            R = len(r)
            end = start + R
            if R:
                input_ids[gi, start:end] = torch.tensor(r, dtype=torch.long)
                position_ids[gi, start:end] = torch.arange(P, P + R)
                allowed[gi, 0, start:end, :P] = True  # the prompt
                allowed[gi, 0, start:end, start:end] = causal[:R, :R]  # its own causal past
                segments[gi, start:end] = j + 1
                # token 0 is predicted by the prompt's last position, token t>0 by response position t-1
                gather_pos[s, 0] = P - 1
                gather_pos[s, 1:R] = torch.arange(start, end - 1)
            gather_row[s] = gi
            start = end
            s += 1
        # padding rows attend to themselves only, so softmax never sees an empty row
        idx = torch.arange(lengths[gi], L)
        allowed[gi, 0, idx, idx] = True
    return Packed(input_ids, position_ids, allowed, gather_row, gather_pos, targets, mask, segments)


def shared_mask_mod(segments: torch.Tensor):
    """The shared layout's attention rule as a FlexAttention mask_mod over segment ids (no L x L tensor): a token
    sees earlier-or-same positions of its own segment and of the prompt (segment 0); padding sees itself only."""

    def mask_mod(b, h, q, kv):
        sq, skv = segments[b, q], segments[b, kv]
        return ((kv <= q) & (skv >= 0) & (sq >= 0) & ((skv == sq) | (skv == 0))) | (q == kv)

    return mask_mod


def flex_block_mask(packed: Packed, device):
    """A FlexAttention BlockMask of the shared layout: blocks where no response sees another are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    if packed.segments is None:
        raise ValueError("flex_block_mask needs the shared layout (pack_shared)")
    seg = packed.segments.to(device)
    rows, L = seg.shape
    return create_block_mask(shared_mask_mod(seg), B=rows, H=None, Q_LEN=L, KV_LEN=L, device=device)


def token_costs(groups: list[Group]) -> tuple[int, int]:
    """(unshared, shared) token counts of a micro-batch before padding."""
    unshared = sum(len(g.prompt_ids) * len(g.responses) + sum(len(r) for r in g.responses) for g in groups)
    shared = sum(len(g.prompt_ids) + sum(len(r) for r in g.responses) for g in groups)
    return unshared, shared


# Sharing replaces G copies of the prompt by one but needs a dense (L x L) mask instead of the fused causal
# kernel; below this token saving the dense mask costs more than the saved tokens (G = 1, short prompts).
MIN_SHARED_SAVING = 1.5


def use_shared(groups: list[Group], min_saving: float | None = None) -> bool:
    """Whether the shared layout saves at least `min_saving` x tokens (default: `MIN_SHARED_SAVING`, read at call time
    so that setting the module constant, e.g. to 0 to force sharing in a test, takes effect)."""
    if min_saving is None:
        min_saving = MIN_SHARED_SAVING
    unshared, shared = token_costs(groups)
    return shared > 0 and unshared / shared >= min_saving


def pack(groups: list[Group], pad_id: int, shared: bool) -> Packed:
    return pack_shared(groups, pad_id) if shared else pack_unshared(groups, pad_id)


def _dense_mask_for(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """The shared layout's (rows, 1, L, L) bool mask in the form the model's attention kernel applies.

    Transformers passes a 4-D mask through untouched. SDPA reads a bool mask as "True = attend", but the eager
    kernel *adds* the mask to the scores, so a bool mask there adds 1.0 or 0.0 and masks nothing (every response
    would see the others): eager gets the additive form (0 where allowed, dtype min elsewhere). Kernels that take no
    dense mask (flash-attention) would drop it silently, so they are refused.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    raise ValueError(
        f"the shared-prompt layout needs a dense attention mask or a FlexAttention block mask, which "
        f"attn_implementation={impl!r} does not take; use 'flex_attention', 'sdpa' or 'eager', or set "
        "train.shared_prompt=false"
    )


def _model_inputs(model: torch.nn.Module, packed: Packed) -> dict:
    """The keyword arguments of `model`'s (or its decoder's) forward pass over `packed`, on the model's device."""
    device = next(model.parameters()).device
    attn = packed.attention_mask.to(device)
    if attn.dim() == 4:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        attn = flex_block_mask(packed, device) if impl == "flex_attention" else _dense_mask_for(model, attn)
    return dict(
        input_ids=packed.input_ids.to(device),
        attention_mask=attn,
        position_ids=packed.position_ids.to(device),
        use_cache=False,
    )


def packed_logits(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """Logits at the positions that predict each response token: (S, T, V)."""
    logits = model(**_model_inputs(model, packed)).logits  # (rows, L, V)
    device = logits.device
    return logits[packed.gather_row.to(device).unsqueeze(-1), packed.gather_pos.to(device)]  # (S, T, V)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target]: (S, T, V), (S, T) -> (S, T)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.to(logits.device).unsqueeze(-1)).squeeze(-1)


class LogitsSplitError(ValueError):
    """`check_logits_split`'s refusal: the model's logits are not its output layer applied to its decoder's output."""


def check_logits_split(model: torch.nn.Module) -> None:
    """Raise LogitsSplitError (a ValueError), naming the setting, unless `model`'s logits are exactly its output
    layer applied to its decoder's last hidden state (what `chunked_logprobs` computes them as). Judged in one forward
    pass of 8 tokens (eval mode, no grad) with hooks: the decoder must receive the input ids, attention mask and
    position ids the model was given, the output layer must take the decoder's last hidden state, and the logits must
    be the output layer's output, each bit for bit (and in the same dtype). Most causal LMs (Llama, Qwen2/3, Mistral,
    GPT-2, OPT...) are; a model that rescales or soft-caps its logits after the output layer (Gemma 2's
    final_logit_softcapping, Cohere's logit_scale) is not, nor a multimodal wrapper that gives its language model
    embeddings instead of ids. In eval mode: what a model would do between its decoder and its output layer in
    training only is not seen."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        reason = "it has no separate decoder and output layer (get_decoder / get_output_embeddings)"
    else:
        reason = _split_mismatch(model, decoder, head)
    if reason is not None:
        raise LogitsSplitError(
            f"train.logits_chunk_tokens: the model ({type(model).__name__}) cannot have its logits computed in "
            f"chunks: {reason}; set train.logits_chunk_tokens=null"
        )


def _split_mismatch(model: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module) -> str | None:
    """What in one probe pass of `model` differs from `head(decoder(inputs))`, or None."""
    device = next(model.parameters()).device
    sizes = [getattr(model.get_input_embeddings(), "num_embeddings", None), getattr(head, "out_features", None)]
    vocab = min([s for s in sizes if s] or [8])  # ids both the embedding and the output layer have
    given = {
        "input_ids": torch.arange(8, device=device).mul(7919).remainder(vocab).unsqueeze(0),  # (1, 8) over the vocab
        "attention_mask": torch.ones((1, 8), dtype=torch.long, device=device),
        "position_ids": torch.arange(8, device=device).unsqueeze(0),
    }
    seen: dict = {}

    def decoder_inputs(module, args, kwargs):
        seen["inputs"] = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments

    def decoder_output(_module, _args, out):
        seen["hidden"] = out[0]  # last_hidden_state, as chunked_logprobs reads it

    def head_io(_module, args, out):
        seen["head_in"], seen["head_out"] = args[0], out

    hooks = [
        decoder.register_forward_pre_hook(decoder_inputs, with_kwargs=True),
        decoder.register_forward_hook(decoder_output),
        head.register_forward_hook(head_io),
    ]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(**given, use_cache=False).logits
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    if "hidden" not in seen or "head_out" not in seen:
        return "its forward pass did not run its decoder and its output layer"
    for key, value in given.items():
        passed = seen["inputs"].get(key)
        if not isinstance(passed, torch.Tensor) or passed.shape != value.shape or not torch.equal(passed, value):
            return f"its forward pass does not give its decoder the {key} it was given"
    head_in, hidden = seen["head_in"], seen["hidden"]
    if head_in.dtype != hidden.dtype or head_in.shape != hidden.shape or not torch.equal(head_in, hidden):
        return "its output layer does not take its decoder's last hidden state"
    if seen["head_out"].shape != logits.shape or not torch.equal(seen["head_out"].float(), logits.float()):
        return "its logits differ from its output layer's output"
    return None


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy):
    """(n, H), (n,) -> log-probs (n,) with grad of softmax(head(hidden) / T), and with `entropy` its entropies
    (n,) without (else None)."""
    logp = torch.log_softmax(head(hidden).float() / temperature, dim=-1)  # (n, V)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked, None
    with torch.no_grad():  # after the last saved tensor: checkpoint's recomputation stops before it
        return picked, entropy_from_logprobs(logp)


def chunked_logprobs(
    model: torch.nn.Module, packed: Packed, temperature: float, chunk_tokens: int, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs(packed_logits(model, packed), ...)` and the entropies of the same distributions, without the
    (S, T, V) logits: the decoder's hidden states of the response tokens (mask 1 only) go through the output layer
    `chunk_tokens` at a time; with grad, each chunk under `torch.utils.checkpoint`, so its logits live only while
    the chunk is computed (forward, then again in the backward). Padding positions get 0. Returns (S, T) and, with
    `entropy`, (S, T) (else None); the entropies carry no grad. The model must pass `check_logits_split`."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(**_model_inputs(model, packed))[0]  # last_hidden_state (rows, L, H)
    device = hidden.device
    rows, pos = packed.gather_row.to(device).unsqueeze(-1), packed.gather_pos.to(device)  # (S, 1), (S, T)
    sel = packed.mask.to(device) > 0  # (S, T)
    h = hidden[rows.expand_as(pos)[sel], pos[sel]]  # (N, H): the response tokens only
    targets = packed.targets.to(device)[sel]  # (N,)
    logps, entropies = [], []
    for i in range(0, max(h.shape[0], 1), chunk_tokens):  # no response token: one empty chunk, still in the graph
        args = (head, h[i : i + chunk_tokens], targets[i : i + chunk_tokens], temperature, entropy)
        if torch.is_grad_enabled():
            lp, ent = torch.utils.checkpoint.checkpoint(
                _chunk_logprobs,
                *args,
                use_reentrant=False,
                preserve_rng_state=False,  # no randomness to replay
            )
        else:
            lp, ent = _chunk_logprobs(*args)
        logps.append(lp)
        entropies.append(ent)
    S, T = sel.shape
    logp = torch.zeros((S, T), dtype=torch.float32, device=device).masked_scatter(sel, torch.cat(logps))
    if not entropy:
        return logp, None
    return logp, torch.zeros((S, T), dtype=torch.float32, device=device).masked_scatter(sel, torch.cat(entropies))
