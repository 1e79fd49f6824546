"""models/engine.py: the built-in generation engine against the trainer's recomputation (models/packing.py), seeds,
temperature, top-p, greedy and stopping. fp32 throughout."""

from __future__ import annotations

import math

import pytest
import torch

from models.engine import SamplingParams, _sampling_logprobs, generate_groups, sample_seed
from models.packing import Group, pack, packed_logits, token_logprobs
from models.tiny import single_token_id

PAD, EOS = 0, 2
G = 4


@pytest.fixture
def model(tiny_hf):
    # A random tiny model is nearly uniform over 53 tokens (entropy ~ln 53 = 3.97); scaling the final norm by 6 gives
    # entropy ~3.0 nats and a top-0.5 nucleus of ~5 tokens, so sampling, temperature and top-p all matter.
    m = tiny_hf.model
    with torch.no_grad():
        m.model.norm.weight.mul_(6.0)
    return m


@pytest.fixture
def prompts(tiny_hf):
    tok = tiny_hf.tokenizer
    texts = ["Q: 12+7=?\nA: ", "Q: 3+4=?\nA: 7\nQ: 20+9=?\nA: ", "Q: 0+0=?\nA: 0\nQ: 1+1"]  # 13, 27, 20 tokens
    return [tok(t)["input_ids"] for t in texts]


def seeds_for(prompt_ids: list[int], group_size: int = G, run_seed: int = 0, iteration: int = 0) -> list[list[int]]:
    return [[sample_seed(run_seed, iteration, p, j) for j in range(group_size)] for p in prompt_ids]


def generate(model, prompts, params, seeds=None, group_size=G, eos=EOS):
    seeds = seeds if seeds is not None else seeds_for(list(range(len(prompts))), group_size)
    return generate_groups(model, prompts, group_size, params, seeds, eos_token_id=eos, pad_token_id=PAD)


def recompute(model, prompts, groups, shared: bool):
    """The trainer's view of the same tokens: logits (S, T, V), targets (S, T), mask (S, T)."""
    packed = pack([Group(p, [s.response_ids for s in g]) for p, g in zip(prompts, groups, strict=True)], PAD, shared)
    with torch.no_grad():
        logits = packed_logits(model, packed)
    return logits, packed.targets, packed.mask


def stored(groups) -> torch.Tensor:
    """Engine log-probs as (S, T), zero-padded like the packing's targets."""
    flat = [s.logprobs for g in groups for s in g]
    out = torch.zeros(len(flat), max(len(x) for x in flat))
    for i, lp in enumerate(flat):
        out[i, : len(lp)] = torch.tensor(lp)
    return out


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


# ------------------------------------------------------------------------------------------------ parity with the trainer


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_engine_logprobs_equal_trainer_recompute(model, tiny_hf, prompts, shared, temperature, ragged):
    # ragged: stop at ' ' (this model's most frequent token) so responses end at different steps and the packing
    # has padding inside the (S, T) table and between responses of a shared row
    stop = single_token_id(tiny_hf.tokenizer, " ") if ragged else None
    groups = generate(
        model, prompts, SamplingParams(max_new_tokens=8, temperature=temperature, stop_on_newline_id=stop)
    )
    if ragged:
        assert len({len(s.response_ids) for g in groups for s in g}) > 1
    logits, targets, mask = recompute(model, prompts, groups, shared)
    assert mask.sum() == sum(len(s.response_ids) for g in groups for s in g) > 0
    engine = stored(groups)
    assert max_masked_diff(engine, token_logprobs(logits, targets, temperature), mask) <= 1e-4
    if temperature != 1.0:
        # negative control: the log-probs at T=1 are not those of the T=0.5 distribution actually sampled from
        assert max_masked_diff(engine, token_logprobs(logits, targets, 1.0), mask) > 0.1


def test_negative_control_wrong_model_breaks_parity(model, tiny_hf, prompts):
    """Recomputing with other weights (a stale policy) breaks the same 1e-4 bound by a wide margin."""
    groups = generate(model, prompts, SamplingParams(max_new_tokens=8))
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)  # a 1% change of one tensor
    logits, targets, mask = recompute(model, prompts, groups, shared=True)
    assert max_masked_diff(stored(groups), token_logprobs(logits, targets), mask) > 1e-3


# ------------------------------------------------------------------------------------------------ seeds


def test_same_seed_same_tokens_regardless_of_batch(model, prompts):
    params = SamplingParams(max_new_tokens=8)
    a_seeds = seeds_for([42])[0]
    alone = generate(model, [prompts[0]], params, seeds=[a_seeds])[0]
    # prompt 0 is the shortest: in a batch it is left-padded, and its neighbours differ
    batch = generate(
        model, [prompts[1], prompts[0], prompts[2]], params, seeds=[seeds_for([7])[0], a_seeds, seeds_for([8])[0]]
    )[1]
    assert [s.response_ids for s in alone] == [s.response_ids for s in batch]
    assert [s.seed for s in batch] == a_seeds
    for x, y in zip(alone, batch, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_same_seeds_are_reproducible(model, prompts):
    params = SamplingParams(max_new_tokens=8, top_p=0.9)
    a = generate(model, prompts, params)
    b = generate(model, prompts, params)
    assert [[s.response_ids for s in g] for g in a] == [[s.response_ids for s in g] for g in b]
    assert [[s.logprobs for s in g] for g in a] == [[s.logprobs for s in g] for g in b]


def test_different_seeds_give_different_samples(model, prompts):
    params = SamplingParams(max_new_tokens=8)
    a = generate(model, prompts, params, seeds=seeds_for([0, 1, 2], iteration=0))
    b = generate(model, prompts, params, seeds=seeds_for([0, 1, 2], iteration=1))
    for ga, gb in zip(a, b, strict=True):
        ra, rb = [tuple(s.response_ids) for s in ga], [tuple(s.response_ids) for s in gb]
        assert len(set(ra)) == G  # the G samples of a group differ from each other
        assert all(x != y for x, y in zip(ra, rb, strict=True))  # and from the samples of another iteration


def test_sample_seed_is_stable():
    # blake2b(b"0/0/0/0", digest_size=8) read little-endian, top bit cleared; computed once and frozen here:
    # a change would silently re-randomise every replayed or resumed run.
    assert sample_seed(0, 0, 0, 0) == 2485315603693661936
    assert sample_seed(1234, 7, 42, 3) == 5570260508882111957


def test_sample_seed_is_distinct_across_arguments():
    seeds = {sample_seed(r, i, p, j) for r in range(3) for i in range(4) for p in range(10) for j in range(8)}
    assert len(seeds) == 3 * 4 * 10 * 8
    assert all(0 <= s < 2**63 for s in seeds)
    # the separator keeps digit strings apart: (1, 23) and (12, 3) are different arguments
    assert sample_seed(1, 23, 0, 0) != sample_seed(12, 3, 0, 0)
    assert sample_seed(0, 0, 1, 2) != sample_seed(0, 0, 2, 1)


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_is_deterministic_and_argmax(model, prompts):
    a = generate(model, prompts, SamplingParams(max_new_tokens=8, greedy=True), seeds=seeds_for([0, 1, 2]))
    b = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=8, greedy=True, temperature=0.5),
        seeds=seeds_for([5, 6, 7], run_seed=9),
    )
    assert [[s.response_ids for s in g] for g in a] == [[s.response_ids for s in g] for g in b]
    for g in a:
        assert all(s.response_ids == g[0].response_ids for s in g)  # seeds do not matter
    logits, targets, mask = recompute(model, prompts, a, shared=False)
    assert torch.equal(logits.argmax(-1)[mask.bool()], targets[mask.bool()])
    assert max_masked_diff(stored(a), token_logprobs(logits, targets), mask) <= 1e-4


def test_greedy_logprobs_ignore_temperature_and_top_p(model, prompts):
    """Greedy decoding samples nothing: its log-probs are the model's own (log softmax of the raw logits), the same
    whatever temperature and top_p say, as the trainer recomputes them at temperature 1."""
    a = generate(model, prompts, SamplingParams(max_new_tokens=8, greedy=True))
    b = generate(model, prompts, SamplingParams(max_new_tokens=8, greedy=True, temperature=0.5, top_p=0.5))
    assert [[s.response_ids for s in g] for g in a] == [[s.response_ids for s in g] for g in b]
    torch.testing.assert_close(stored(b), stored(a), atol=1e-6, rtol=0)
    # no near-certain argmax: a sharpened (T=0.5) or truncated (top-p) log-prob would differ visibly
    assert max(lp for g in a for s in g for lp in s.logprobs) < -0.05


# ------------------------------------------------------------------------------------------------ top-p


def test_top_p_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3]]))  # (2, 3)
    # top_p=0.7: mass before each sorted token is [0, .5, .8]; keep while < .7 -> nucleus {0.5, 0.3};
    # renormalised: .5/.8 = .625, .3/.8 = .375, the rest -inf. Row 2 is the same distribution permuted.
    p = _sampling_logprobs(logits, 1.0, 0.7).exp()
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0], [0.0, 0.625, 0.375]]), atol=1e-6, rtol=0)
    assert torch.isinf(_sampling_logprobs(logits, 1.0, 0.7)[0, 2])
    # top_p=0.45: only the top token (it is always kept)
    p = _sampling_logprobs(logits, 1.0, 0.45).exp()
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    # top_p=1: no truncation
    p = _sampling_logprobs(logits, 1.0, 1.0).exp()
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3]]), atol=1e-6, rtol=0)


def test_top_p_drops_a_token_whose_preceding_mass_equals_top_p():
    # probabilities exact in binary: the mass before the 2nd token is exactly .5, before the 3rd exactly .75
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    p = _sampling_logprobs(logits, 1.0, 0.5).exp()
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    p = _sampling_logprobs(logits, 1.0, 0.75).exp()  # {.5, .25} / .75
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_top_p_just_below_one_still_truncates():
    logits = torch.log(torch.tensor([[0.99995, 0.00005]], dtype=torch.float64))
    p = _sampling_logprobs(logits, 1.0, 0.9999).exp()  # the mass before the 2nd (.99995) >= .9999: dropped
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0]]), atol=1e-6, rtol=0)


def test_top_p_of_one_keeps_a_token_whose_preceding_mass_rounds_to_one():
    """top_p=1 means no truncation: p = e^-30 lies below fp32 resolution (the mass before it is 1.0 in fp32) and still
    keeps its log-prob of -30 instead of being cut from the distribution."""
    logits = torch.tensor([[0.0, -30.0]])
    logp = _sampling_logprobs(logits, 1.0, 1.0)
    assert torch.isfinite(logp).all()
    torch.testing.assert_close(logp, torch.log_softmax(logits, dim=-1), atol=1e-6, rtol=0)


def test_a_uniform_of_exactly_zero_never_picks_a_token_outside_the_nucleus(model, monkeypatch):
    # torch.rand can return 0 (p = 2^-24 per draw); searchsorted of 0 lands on the first token of the vocabulary,
    # which top_p 1e-3 excludes: the engine must fall back to a token of the nucleus, with a finite log-prob
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.zeros(()))
    out = generate_groups(model, [[5, 6, 7]], 2, SamplingParams(4, 1.0, 1e-3), [[1, 2]], eos_token_id=1, pad_token_id=0)
    for sample in out[0]:
        assert 0 not in sample.response_ids
        assert all(abs(lp) < 1e-6 for lp in sample.logprobs), sample.logprobs  # the only token kept: log 1


def test_temperature_applies_before_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    # T=0.5 squares the probabilities: [.25, .09, .04] / .38 = [.657895, .236842, .105263]
    p = _sampling_logprobs(logits, 0.5, 1.0).exp()
    torch.testing.assert_close(p, torch.tensor([[0.25, 0.09, 0.04]]) / 0.38, atol=1e-6, rtol=0)
    # then top_p=0.7: mass before the 3rd is .894737 >= .7 -> dropped; [.25, .09] / .34 = [.735294, .264706, 0]
    p = _sampling_logprobs(logits, 0.5, 0.7).exp()
    torch.testing.assert_close(p, torch.tensor([[0.25 / 0.34, 0.09 / 0.34, 0.0]]), atol=1e-6, rtol=0)
    # top_p=0.6 tells the orders apart: on the sharpened probs the mass before the 2nd is .657895 >= .6, so only the
    # top token stays -> [1, 0, 0]; truncating the unsharpened probs first (.5 < .6) would keep {0, 1} -> [.735, .265]
    p = _sampling_logprobs(logits, 0.5, 0.6).exp()
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_top_p_samples_lie_in_the_nucleus_with_renormalised_logprobs(model, prompts):
    top_p = 0.5
    groups = generate(model, prompts, SamplingParams(max_new_tokens=8, top_p=top_p))
    logits, targets, mask = recompute(model, prompts, groups, shared=True)
    probs = torch.softmax(logits.double(), dim=-1)  # (S, T, V), computed independently of the engine
    engine = stored(groups)
    truncated = renormalised = 0
    for s in range(mask.shape[0]):
        for t in range(int(mask[s].sum())):
            p = probs[s, t]
            sorted_p, order = torch.sort(p, descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p
            nucleus = order[before < top_p]  # tokens whose preceding mass is below top_p
            tok = int(targets[s, t])
            assert tok in nucleus.tolist(), (s, t)
            expected = math.log(float(p[tok]) / float(p[nucleus].sum()))
            assert abs(float(engine[s, t]) - expected) <= 1e-4, (s, t)
            truncated += len(nucleus) < p.numel()
            renormalised += abs(expected - math.log(float(p[tok]))) > 1e-3
    n = int(mask.sum())
    assert truncated == n and renormalised == n  # the nucleus really cut the tail at every step


# ------------------------------------------------------------------------------------------------ stopping


def test_eos_stops_every_sample(model, prompts):
    # add 50 to the EOS logit: p(EOS) >= 1 / (1 + 52 * e^(max_gap - 50)) ~ 1 for this model's logit range
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 50.0
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    try:
        for params in (SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, greedy=True)):
            for g in generate(model, prompts, params):
                for s in g:
                    assert s.response_ids == [EOS] and s.finish_reason == "stop"
                    assert abs(s.logprobs[0]) < 1e-6  # log p(EOS) ~ 0
    finally:
        handle.remove()


def test_without_stop_samples_run_to_the_length_limit(model, prompts):
    groups = generate(model, prompts, SamplingParams(max_new_tokens=5), eos=999)  # an id the model never emits
    assert all(s.finish_reason == "length" and len(s.response_ids) == len(s.logprobs) == 5 for g in groups for s in g)


@pytest.mark.parametrize("how", ["eos", "stop_id", "other_eos"])
def test_stop_token_mid_stream_truncates_only_that_sample(model, prompts, how):
    free = generate(model, prompts, SamplingParams(max_new_tokens=8), eos=999)
    # a token that sample 0 first emits at position 2 or later
    first = free[0][0].response_ids
    stop = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i])
    if how == "eos":
        stopped = generate(model, prompts, SamplingParams(max_new_tokens=8), eos=stop)
    elif how == "stop_id":
        stopped = generate(model, prompts, SamplingParams(max_new_tokens=8, stop_on_newline_id=stop), eos=999)
    else:  # another end id of the model's generation config
        stopped = generate(model, prompts, SamplingParams(max_new_tokens=8, other_eos_ids=(998, stop)), eos=999)
    n_stopped = 0
    for gf, gs in zip(free, stopped, strict=True):
        for f, s in zip(gf, gs, strict=True):
            if stop in f.response_ids:
                cut = f.response_ids.index(stop) + 1  # the stop token is kept in the response
                assert s.response_ids == f.response_ids[:cut] and s.finish_reason == "stop"
                n_stopped += 1
            else:
                assert s.response_ids == f.response_ids and s.finish_reason == "length"
            torch.testing.assert_close(
                torch.tensor(s.logprobs), torch.tensor(f.logprobs[: len(s.logprobs)]), atol=1e-5, rtol=0
            )
    assert n_stopped >= 1 and stopped[0][0].response_ids == first[: first.index(stop) + 1]


# ------------------------------------------------------------------------------------------------ input checks


def test_input_validation(model, prompts):
    params = SamplingParams(max_new_tokens=2)
    assert generate_groups(model, [], G, params, [], EOS, PAD) == []
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        generate(model, [prompts[0], []], params)
    with pytest.raises(ValueError, match="seeds must be 2 lists of 4 seeds"):
        generate(model, prompts[:2], params, seeds=[[1, 2, 3, 4], [1, 2, 3]])
    for rows in (seeds_for([0, 1, 2]), seeds_for([0])):  # one seed row per prompt, no more, no fewer
        with pytest.raises(ValueError, match="seeds must be 2 lists of 4 seeds"):
            generate(model, prompts[:2], params, seeds=rows)


# ------------------------------------------------------------------------------------------------ interruptible generation


def _switch_at(step: int, model, new_state: dict | None, version: int):
    """poll_update that loads `new_state` into `model` just before decoding step `step` (counted from 1)."""
    calls = {"n": 0}

    def poll():
        calls["n"] += 1
        if calls["n"] == step:
            if new_state is not None:
                model.load_state_dict(new_state)
            return version
        return None

    return poll


def test_interrupt_with_unchanged_weights_changes_nothing_but_versions(model, prompts):
    """Recomputing the KV cache of prompt + tokens so far on identical weights must continue every sample exactly
    as an uninterrupted run does: same tokens, log-probs equal to 1e-5; versions switch at the interruption."""
    params = SamplingParams(max_new_tokens=8)
    base = generate(model, prompts, params)
    seeds = seeds_for(list(range(len(prompts))))
    got = generate_groups(
        model, prompts, G, params, seeds, EOS, PAD, version=3, poll_update=_switch_at(3, model, None, 4)
    )
    for gb, gg in zip(base, got, strict=True):
        for sb, sg in zip(gb, gg, strict=True):
            assert sg.response_ids == sb.response_ids
            assert max(abs(a - b) for a, b in zip(sg.logprobs, sb.logprobs)) <= 1e-5
            n = len(sg.response_ids)
            assert sg.token_versions == ([3] * min(3, n) + [4] * max(0, n - 3))
    assert all(s.token_versions == [0] * len(s.response_ids) for g in base for s in g)


def test_interrupt_continues_on_the_new_weights(model, prompts):
    """After a weight update mid-generation, every later token's log-prob is the new policy's (recomputed by the
    trainer's packed forward on the new weights), every earlier one the old policy's; the earlier tokens are those
    an uninterrupted run on the old weights produces."""
    params = SamplingParams(max_new_tokens=8)
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    new_state = {k: v.clone() for k, v in old_state.items()}
    new_state["model.norm.weight"] = new_state["model.norm.weight"] * 0.7
    base = generate(model, prompts, params)
    seeds = seeds_for(list(range(len(prompts))))
    got = generate_groups(
        model, prompts, G, params, seeds, EOS, PAD, version=0, poll_update=_switch_at(4, model, new_state, 1)
    )
    logits_new, targets, mask = recompute(model, prompts, got, shared=True)  # model now holds the new weights
    model.load_state_dict(old_state)
    logits_old, _, _ = recompute(model, prompts, got, shared=True)
    engine = stored(got)
    versions = torch.zeros_like(mask)
    for i, s in enumerate(s for g in got for s in g):
        versions[i, : len(s.token_versions)] = torch.tensor(s.token_versions, dtype=torch.float32)
    new_tok, old_tok = mask * (versions == 1), mask * (versions == 0)
    assert new_tok.sum() > 0 and old_tok.sum() > 0
    assert max_masked_diff(engine, token_logprobs(logits_new, targets), new_tok) <= 1e-4
    assert max_masked_diff(engine, token_logprobs(logits_old, targets), old_tok) <= 1e-4
    # negative control: the post-update tokens are not the old policy's
    assert max_masked_diff(engine, token_logprobs(logits_old, targets), new_tok) > 1e-2
    for gb, gg in zip(base, got, strict=True):
        for sb, sg in zip(gb, gg, strict=True):
            assert sg.response_ids[:3] == sb.response_ids[:3]


def test_the_prefill_fills_the_kv_cache_under_the_name_the_model_takes(tiny_hf):
    """transformers renamed the forward's `past_key_values` to `cache`; the `cuda` extra's vLLM holds transformers below
    the rename, and a name the forward does not take is swallowed by its `**kwargs`: the cache stays empty and every
    decode step sees only its own token (measured with transformers 5.20.2: 13 of this file's tests failed)."""
    from models.engine import _cache_keyword, _prefill

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class Current(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None, **kwargs): ...

    assert _cache_keyword(Renamed) == "past_key_values" and _cache_keyword(Current) == "cache"
    cache, logits, attn, next_pos = _prefill(tiny_hf.model, [[5, 6, 7], [8, 9]], tiny_hf.tokenizer.pad_token_id, "cpu")
    assert cache.get_seq_length() == 3 and logits.shape[0] == 2 and next_pos.tolist() == [3, 2]
