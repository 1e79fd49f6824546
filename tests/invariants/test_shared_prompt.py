"""Shared-prompt packing equals unshared packing: log-probs, loss and every parameter gradient (DESIGN.md,
"Shared-prompt attention"), in fp32 on tiny random Qwen2 and Llama models.

The unshared layout (one right-padded row `[prompt, response]` per sample) is the reference: it is what every peer
trains on. The shared layout (`[prompt, r1, ..., rG]`, block mask, position ids restarting at len(prompt)) must give
the same numbers up to fp32 rounding. Negative control: the same row with a plain causal mask (each response also
sees the earlier responses of its group) must break the log-prob assertion.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models.packing as packing
from models import objectives
from models.packing import Group, pack_shared, pack_unshared, packed_logits, token_costs, token_logprobs, use_shared
from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer, RolloutGroup

torch.set_num_threads(1)

VOCAB = 40
PAD = 0
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
LOGP_ATOL = 1e-5  # max abs difference of per-token log-probs
LOSS_RTOL = 1e-6  # relative difference of the loss
GRAD_RTOL = 1e-4  # max abs difference of a parameter's gradient, relative to that gradient's max abs
# Seen on these models (torch 2.13 CPU, SDPA): log-probs differ by <= 2.4e-7, gradients by <= 7e-7 relative, losses
# by <= 1e-7 relative: summation order only. The leaky mask (negative control) moves log-probs by 2e-2..4e-2.


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=gen).tolist()  # ids 0..3 are the special tokens


def _case(name: str) -> list[Group]:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "g1":  # one response: the shared row is the unshared row
        return [Group(_ids(g, 9), [_ids(g, 6)])]
    if name == "g5_unequal":  # G > 2, every response a different length
        return [Group(_ids(g, 8), [_ids(g, n) for n in (5, 1, 7, 3, 4)])]
    if name == "empty_response":  # a length-0 response in the middle of a group: mask all zero, contributes nothing
        return [Group(_ids(g, 7), [_ids(g, 4), [], _ids(g, 6), _ids(g, 2)])]
    if name == "multi_group":  # several groups with different prompt lengths in one micro-batch
        return [
            Group(_ids(g, 12), [_ids(g, 3), _ids(g, 5), _ids(g, 2)]),
            Group(_ids(g, 4), [_ids(g, 6), _ids(g, 1)]),
            Group(_ids(g, 9), [_ids(g, 2), _ids(g, 2), _ids(g, 4), _ids(g, 3), _ids(g, 1)]),
        ]
    if name == "padding":  # rows of very different lengths in both layouts (short group padded to the long one)
        return [
            Group(_ids(g, 3), [_ids(g, 1), _ids(g, 2)]),
            Group(_ids(g, 15), [_ids(g, 9), _ids(g, 8), [], _ids(g, 10)]),
        ]
    raise ValueError(name)


CASES = ["g1", "g5_unequal", "empty_response", "multi_group", "padding"]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request) -> torch.nn.Module:
    return build_tiny_model(VOCAB, arch=request.param, seed=3, **TINY)


@pytest.fixture(scope="module")
def stale(model) -> torch.nn.Module:
    """A stale old policy: the model with every weight moved by N(0, 0.02^2). Ratios then span ~0.7..1.5, so the loss
    value depends on the policy's log-probs and some tokens are clipped (no gradient through them)."""
    old = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return old


def _logprobs(model: torch.nn.Module, packed: packing.Packed) -> torch.Tensor:
    return token_logprobs(packed_logits(model, packed), packed.targets)  # (S, T)


def _assert_logprobs_close(shared: torch.Tensor, unshared: torch.Tensor, mask: torch.Tensor) -> None:
    diff = float(((shared - unshared).abs() * mask).max())
    assert diff <= LOGP_ATOL, f"shared vs unshared log-probs differ by {diff:.3e} (max abs) > {LOGP_ATOL}"


def _loss_and_grads(model, packed, old_logp, adv) -> tuple[float, dict[str, torch.Tensor]]:
    """PPO-clip token-mean loss against a fixed old policy, backpropagated: (loss, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    logp = _logprobs(model, packed)  # (S, T) with grad
    per_token, _ = objectives.policy_loss(logp, old_logp, adv, packed.mask, clip_low=0.2, clip_high=0.2)
    loss = objectives.aggregate(per_token, packed.mask, "token-mean")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _assert_grads_close(shared: dict[str, torch.Tensor], unshared: dict[str, torch.Tensor]) -> None:
    assert shared.keys() == unshared.keys()
    for name, ref in unshared.items():
        scale = float(ref.abs().max())
        assert scale > 0, f"{name} received no gradient: the loss does not reach it"
        rel = float((shared[name] - ref).abs().max()) / scale
        assert rel <= GRAD_RTOL, f"gradient of {name}: shared vs unshared differ by {rel:.3e} of its max abs"


@pytest.mark.parametrize("case", CASES)
def test_shared_equals_unshared(model, stale, case):
    groups = _case(case)
    shared, unshared = pack_shared(groups, PAD), pack_unshared(groups, PAD)
    # both layouts describe the same (sample, token) table
    assert torch.equal(shared.targets, unshared.targets) and torch.equal(shared.mask, unshared.mask)
    mask = unshared.mask  # (S, T)
    S = mask.shape[0]
    if case == "empty_response":
        assert mask[1].sum() == 0
    if case in ("multi_group", "padding"):  # the case really pads: rows of different real lengths
        assert len({len(g.prompt_ids) + sum(map(len, g.responses)) for g in groups}) > 1

    with torch.no_grad():
        ref_logp = _logprobs(model, unshared)  # (S, T)
        _assert_logprobs_close(_logprobs(model, shared), ref_logp, mask)
        old_logp = _logprobs(stale, unshared)  # (S, T) the same old log-probs for both layouts
    adv = torch.randn(S, generator=torch.Generator().manual_seed(7))  # (S,) mixed signs, non-trivial
    loss_s, grads_s = _loss_and_grads(model, shared, old_logp, adv)
    loss_u, grads_u = _loss_and_grads(model, unshared, old_logp, adv)
    assert loss_u != 0.0
    assert abs(loss_s - loss_u) <= LOSS_RTOL * abs(loss_u), f"loss {loss_s!r} (shared) vs {loss_u!r} (unshared)"
    _assert_grads_close(grads_s, grads_u)

    if case == "empty_response":  # the empty response contributes nothing: dropping it changes no number
        keep = [i for i in range(S) if mask[i].sum() > 0]
        without = [Group(g.prompt_ids, [r for r in g.responses if r]) for g in groups]
        for pack_fn, loss_ref, grads_ref in ((pack_shared, loss_s, grads_s), (pack_unshared, loss_u, grads_u)):
            loss_w, grads_w = _loss_and_grads(model, pack_fn(without, PAD), old_logp[keep], adv[keep])
            assert abs(loss_w - loss_ref) <= LOSS_RTOL * abs(loss_ref)
            _assert_grads_close(grads_w, grads_ref)


def _leaky(packed: packing.Packed, groups: list[Group]) -> packing.Packed:
    """The shared pack with a plain causal mask over each group's row: response j also sees responses 1..j-1."""
    leaky = copy.copy(packed)
    allowed = packed.attention_mask.clone()  # (rows, 1, L, L)
    for gi, g in enumerate(groups):
        n = len(g.prompt_ids) + sum(map(len, g.responses))
        allowed[gi, 0, :n, :n] = torch.ones((n, n), dtype=torch.bool).tril()
    leaky.attention_mask = allowed
    return leaky


@pytest.mark.parametrize("case", ["g5_unequal", "multi_group"])
def test_negative_control_leaky_mask_breaks_parity(model, case):
    groups = _case(case)
    shared, unshared = pack_shared(groups, PAD), pack_unshared(groups, PAD)
    leaky = _leaky(shared, groups)
    assert not torch.equal(leaky.attention_mask, shared.attention_mask)
    with torch.no_grad():
        ref_logp = _logprobs(model, unshared)
        leaky_logp = _logprobs(model, leaky)
    with pytest.raises(AssertionError, match="log-probs differ"):
        _assert_logprobs_close(leaky_logp, ref_logp, unshared.mask)
    assert float(((leaky_logp - ref_logp).abs() * unshared.mask).max()) > 1e-3
    # the first response of each group sees only the prompt in both masks: the leak is all that changed
    first = torch.tensor([i == 0 for g in groups for i in range(len(g.responses))])
    diff_first = ((leaky_logp - ref_logp).abs() * unshared.mask)[first]
    assert float(diff_first.max()) <= LOGP_ATOL


def test_trainer_shared_equals_unshared(monkeypatch):
    """Through PolicyTrainer (GRPO advantages, PPO-clip, k3 KL to a reference): same figures, same gradients."""
    monkeypatch.setattr(packing, "MIN_SHARED_SAVING", 0.0)  # force sharing, even where it saves little
    base = build_tiny_model(VOCAB, arch="llama", seed=5, **TINY)
    ref = build_tiny_model(VOCAB, arch="llama", seed=6, **TINY)
    gen = torch.Generator().manual_seed(11)
    groups = []
    for g in _case("multi_group") + _case("empty_response"):
        G = len(g.responses)
        groups.append(
            RolloutGroup(
                g.prompt_ids,
                g.responses,
                torch.rand(G, generator=gen).tolist(),
                [[-1.0] * len(r) for r in g.responses],
                [[0] * len(r) for r in g.responses],
            )
        )
    (one,) = _case("g1")
    g1 = RolloutGroup(one.prompt_ids, one.responses, [1.0], [[-1.0] * len(one.responses[0])], [[0] * 6])
    loss = LossSettings(kl_coef=0.1, loss_agg="seq-mean-token-mean")
    grads, figures, layouts = {}, {}, {}
    for shared in (True, False):
        model = copy.deepcopy(base)
        seen = []
        model.register_forward_hook(
            lambda m, a, kw, out, seen=seen: seen.append(kw["attention_mask"].dim()), with_kwargs=True
        )
        trainer = PolicyTrainer(model, ref, lr=1e-3, loss=loss, pad_token_id=PAD, shared_prompt=shared)
        trainer.micro_step(groups[:3])
        trainer.micro_step(groups[3:])  # the group with an empty response
        trainer.micro_step([g1])  # G = 1 saves nothing: shared only because MIN_SHARED_SAVING is 0 here
        grads[shared] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        figures[shared] = trainer.optimizer_step()
        layouts[shared] = seen
    assert layouts == {True: [4, 4, 4], False: [2, 2, 2]}  # shared really ran the 4-D mask layout
    assert figures[True]["train/shared_fallbacks"] == 0.0
    for key in ("loss/policy", "kl/mean", "entropy/mean"):
        a, b = figures[True][key], figures[False][key]
        assert abs(a - b) <= 1e-5 * max(abs(b), 1e-3), f"{key}: {a!r} (shared) vs {b!r} (unshared)"
    assert figures[True]["train/tokens"] == figures[False]["train/tokens"]
    _assert_grads_close(grads[True], grads[False])


def test_sharing_is_chosen_at_exactly_the_minimum_saving():
    # prompt 4, two responses of 2: unshared 2 x (4 + 2) = 12 tokens, shared 4 + 2 + 2 = 8; 12 / 8 = 1.5
    group = Group([1, 2, 3, 4], [[5, 6], [7, 8]])
    assert token_costs([group]) == (12, 8)
    assert use_shared([group], min_saving=1.5)
    assert not use_shared([group], min_saving=1.51)


def test_eager_attention_gets_an_additive_mask():
    """The eager kernel adds the mask to the scores: a bool mask there would leak; packed_logits must convert it."""
    model = build_tiny_model(VOCAB, arch="qwen2", seed=3, **TINY)
    model.config._attn_implementation = "eager"
    groups = _case("multi_group")
    shared, unshared = pack_shared(groups, PAD), pack_unshared(groups, PAD)
    with torch.no_grad():
        _assert_logprobs_close(_logprobs(model, shared), _logprobs(model, unshared), unshared.mask)
    model.config._attn_implementation = "flash_attention_2"  # takes no dense mask: refused, never silently wrong
    with pytest.raises(ValueError, match="dense attention mask"):
        packed_logits(model, shared)


def test_mask_positions_gather_hand_drawn():
    """P = 2, responses of lengths 2 and 1, plus a second, shorter group that is padded."""
    a = Group([11, 12], [[21, 22], [31]])  # row 0: [p0 p1 | a0 a1 | b0], length 5
    b = Group([13], [[41]])  # row 1: [p0 | c0 | pad pad pad]
    packed = pack_shared([a, b], PAD)
    T, F = True, False
    expected = torch.tensor(
        [
            [  # row 0; query (row of the matrix) attends to key (column) where True
                [T, F, F, F, F],  # p0
                [T, T, F, F, F],  # p1
                [T, T, T, F, F],  # a0: prompt + itself
                [T, T, T, T, F],  # a1: prompt + a0 + itself
                [T, T, F, F, T],  # b0: prompt + itself, never a0/a1
            ],
            [  # row 1
                [T, F, F, F, F],  # p0
                [T, T, F, F, F],  # c0
                [F, F, T, F, F],  # pad: itself only (no softmax over an empty row)
                [F, F, F, T, F],  # pad
                [F, F, F, F, T],  # pad
            ],
        ]
    ).unsqueeze(1)  # (rows, 1, L, L)
    assert packed.attention_mask.dtype == torch.bool
    assert torch.equal(packed.attention_mask, expected)
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 31], [13, 41, PAD, PAD, PAD]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 2]  # b0 restarts at len(prompt) = 2
    assert packed.position_ids[1, :2].tolist() == [0, 1]
    # logits at gather_pos predict: a0 <- p1 (1), a1 <- a0 (2); b0 <- p1 (1); c0 <- p0 (0)
    assert packed.gather_row.tolist() == [0, 0, 1]
    assert packed.gather_pos.tolist() == [[1, 2], [1, 0], [0, 0]]
    assert packed.targets.tolist() == [[21, 22], [31, PAD], [41, PAD]]
    assert packed.mask.tolist() == [[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]]


def test_unshared_layout_hand_drawn():
    """One right-padded row [prompt, response] per sample: position ids 0..L-1 in every row (as the engine numbers a
    prompt and its response), mask 1 on the real tokens, pad_id (here 99, not 0) everywhere else."""
    groups = [Group([11, 12], [[21, 22, 23], [31]]), Group([13], [[41]])]
    packed = pack_unshared(groups, 99)
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23], [11, 12, 31, 99, 99], [13, 41, 99, 99, 99]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    # logits at gather_pos predict: 21 <- 12 (1), 22 <- 21 (2), 23 <- 22 (3); 31 <- 12 (1); 41 <- 13 (0)
    assert packed.gather_row.tolist() == [0, 1, 2]
    assert packed.gather_pos.tolist() == [[1, 2, 3], [1, 0, 0], [0, 0, 0]]
    assert packed.targets.tolist() == [[21, 22, 23], [31, 99, 99], [41, 99, 99]]
    assert packed.mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_nothing_to_pack_is_never_shared():
    """No tokens at all (an empty micro-batch): no layout saves anything, and no division by zero."""
    assert token_costs([]) == (0, 0)
    assert not use_shared([])
    assert not use_shared([Group([], [[]])], min_saving=0.0)


def test_token_logprobs_of_bf16_logits_are_fp32():
    """The trainer's log-probs of a bf16 model are taken in fp32 (the engine's are): bf16's 8-bit mantissa would move
    them by ~1e-2 and break the engine/trainer parity the importance ratios rest on."""
    logits = (torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    targets = torch.tensor([[5, 6, 7], [8, 9, 10]])
    got = token_logprobs(logits, targets, temperature=0.7)
    assert got.dtype == torch.float32
    ref = torch.log_softmax(logits.double() / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(0, 5), min_size=1, max_size=5)),
        min_size=1,
        max_size=3,
    )
)
def test_shared_layout_structure(shape):
    """For any groups: each response sees exactly the prompt and its own causal past, its position ids restart at
    len(prompt), and (gather_row, gather_pos) point at the position just before each response token."""
    groups, tok = [], 4
    for P, lens in shape:
        prompt = list(range(tok, tok + P))
        tok += P
        responses = []
        for n in lens:
            responses.append(list(range(tok, tok + n)))
            tok += n
        groups.append(Group(prompt, responses))
    packed = pack_shared(groups, PAD)
    allowed = packed.attention_mask[:, 0]  # (rows, L, L)
    s = 0
    for gi, g in enumerate(groups):
        P = len(g.prompt_ids)
        assert torch.equal(allowed[gi, :P, :P], torch.ones(P, P, dtype=torch.bool).tril())
        assert not allowed[gi, :P, P:].any()  # the prompt never sees a response
        start = P
        for r in g.responses:
            R, end = len(r), start + len(r)
            assert packed.position_ids[gi, start:end].tolist() == list(range(P, P + R))
            expected = torch.zeros(R, allowed.shape[-1], dtype=torch.bool)
            expected[:, :P] = True
            expected[:, start:end] = torch.ones(R, R, dtype=torch.bool).tril()
            assert torch.equal(allowed[gi, start:end], expected)
            assert packed.mask[s].sum() == R
            for t in range(R):
                pos = int(packed.gather_pos[s, t])
                assert int(packed.gather_row[s]) == gi
                # the position that predicts token t holds token t-1 (the prompt's last token for t = 0)
                assert int(packed.input_ids[gi, pos]) == (g.prompt_ids[-1] if t == 0 else r[t - 1])
                assert int(packed.input_ids[gi, start + t]) == r[t] == int(packed.targets[s, t])
            start, s = end, s + 1


# ------------------------------------------------------------------------------------------------ FlexAttention (CUDA path)


@pytest.mark.parametrize("case", CASES)
def test_flex_mask_mod_equals_the_dense_mask(case):
    """The FlexAttention rule over segment ids allows exactly the (query, key) pairs of the dense boolean mask."""
    packed = pack_shared(_case(case), PAD)
    rows, _, L, _ = packed.attention_mask.shape
    mod = packing.shared_mask_mod(packed.segments)
    b, q, kv = torch.meshgrid(torch.arange(rows), torch.arange(L), torch.arange(L), indexing="ij")
    assert torch.equal(mod(b, None, q, kv), packed.attention_mask[:, 0])


def test_flex_block_mask_refuses_the_unshared_layout():
    """The unshared layout has no segment ids: asking for its block mask is an error that says which layout to use."""
    with pytest.raises(ValueError, match=r"^flex_block_mask needs the shared layout \(pack_shared\)$"):
        packing.flex_block_mask(pack_unshared(_case("g1"), PAD), "cpu")


@pytest.mark.parametrize("case", ["padding"])  # several groups, unequal lengths, an empty response, padding
def test_flex_block_mask_forward_equals_unshared(model, case):
    """Shared packing through FlexAttention block masks gives the unshared log-probs (forward, no grad: FlexAttention
    has no backward on CPU, where the dense SDPA mask trains; its backward runs on CUDA). Negative control: a block
    mask that lets every response see the earlier ones breaks the same bound."""
    groups = _case(case)
    shared, unshared = pack_shared(groups, PAD), pack_unshared(groups, PAD)
    flex = copy.deepcopy(model)
    flex.set_attn_implementation("flex_attention")
    with torch.no_grad():
        ref = _logprobs(model, unshared)
        _assert_logprobs_close(_logprobs(flex, shared), ref, unshared.mask)
        leaky = copy.copy(shared)
        seg = shared.segments.clone()
        leaky.segments = torch.where(seg > 0, 0, seg)  # every response token counted as prompt: plain causal
        diff = ((_logprobs(flex, leaky) - ref).abs() * unshared.mask).max()
    assert diff > 10 * LOGP_ATOL, f"leaky block mask went unnoticed ({float(diff)})"
