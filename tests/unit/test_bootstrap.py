"""models/bootstrap.py: the SFT stage (loss over real tokens only, warm-up/decay schedule, early stop, eval mode on
return) and greedy answers (batched, argmax, stop token), on the tiny Qwen2 of conftest."""

from __future__ import annotations

import math

import pytest
import torch

from models.bootstrap import greedy_answers, sft

PAD, EOS = 0, 2
SEQS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]]


def run_sft(model, seqs=SEQS, **kw):
    args = dict(steps=4, batch_size=len(seqs), lr=1e-2, seed=0, pad_token_id=PAD)
    return sft(model, seqs, **{**args, **kw})


def test_zero_steps_is_a_no_op(tiny_hf):
    model = tiny_hf.model
    before = [p.detach().clone() for p in model.parameters()]
    assert run_sft(model, steps=0) == {"sft/steps": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_loss_is_the_mean_cross_entropy_over_real_tokens_only(tiny_hf):
    """One step on the whole (right-padded) set: the reported loss is the next-token cross-entropy averaged over the
    11 predicted real tokens, each sequence scored on its own; padding is neither a target nor changes a number."""
    model = tiny_hf.model
    with torch.no_grad():
        total = 0.0
        for s in SEQS:
            logits = model(input_ids=torch.tensor([s])).logits[0, :-1]  # (len-1, V)
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum"))
    n_targets = sum(len(s) - 1 for s in SEQS)
    stats = run_sft(model, steps=1)
    assert stats["sft/steps"] == 1.0
    assert math.isclose(stats["sft/final_loss"], total / n_targets, rel_tol=1e-5)


def test_learning_rate_warms_up_then_decays_to_a_five_percent_floor(tiny_hf, monkeypatch):
    """40 steps: warm-up over 40 // 20 = 2 steps, then linear decay, never below 5% of the peak."""
    made = []

    class SpyAdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    lrs = []  # on_progress(k) runs after k scheduler steps: the rate of step k (0-based) is lrs[k - 1]
    run_sft(tiny_hf.model, steps=40, lr=1.0, on_progress=lambda step, loss: lrs.append(made[0].param_groups[0]["lr"]))
    assert len(lrs) == 40
    # factor(s) = min(1, (s + 1) / 2) * max(0.05, 1 - s / 40)
    for k, expected in [(1, 0.975), (2, 0.95), (20, 0.5), (38, 0.05), (39, 0.05), (40, 0.05)]:
        assert math.isclose(lrs[k - 1], expected, rel_tol=1e-9), (k, lrs[k - 1], expected)


def test_stop_when_is_checked_every_check_every_steps_in_eval_mode_and_ends_the_stage(tiny_hf):
    model = tiny_hf.model
    seen, progress = [], []

    def stop_when(step: int) -> bool:
        seen.append((step, model.training))
        return step >= 4

    stats = run_sft(model, steps=10, check_every=2, stop_when=stop_when, on_progress=lambda s, loss: progress.append(s))
    assert seen == [(2, False), (4, False)]
    assert progress == [1, 2, 3, 4]
    assert stats["sft/steps"] == 4.0 and math.isfinite(stats["sft/final_loss"])
    assert not model.training  # v0 is saved and evaluated in eval mode


def test_the_model_is_in_eval_mode_after_a_full_stage(tiny_hf):
    model = tiny_hf.model
    stats = run_sft(model, steps=3)
    assert stats["sft/steps"] == 3.0
    assert not model.training


# ------------------------------------------------------------------------------------------------ greedy answers


def argmax_continuation(model, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    """Reference: full forward each step (no cache, no padding, no batch), argmax, stop after a stop token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt in stop:
                break
    return out


@pytest.fixture
def peaked(tiny_hf):
    """The tiny model with a sharper output (final norm x6), so greedy and sampled answers differ."""
    with torch.no_grad():
        tiny_hf.model.model.norm.weight.mul_(6.0)
    return tiny_hf.model


def test_greedy_answers_are_the_argmax_continuations_in_any_batch_size(peaked, tiny_hf):
    tok = tiny_hf.tokenizer
    texts = ["Q: 1+1=?\nA: ", "Q: 12+7=?\nA: ", "Q: 3*4=?\nA: 12\nQ: 5+5=?\nA: ", "7+", "Q: 0-9=?\nA: "]
    prompts = [tok(t)["input_ids"] for t in texts]  # different lengths: left padding inside each batch
    expected = [argmax_continuation(peaked, p, 6, {EOS}) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1
    for batch_size in (2, 64):
        got = greedy_answers(
            peaked, prompts, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, batch_size=batch_size
        )
        assert got == expected, batch_size
    assert not peaked.training


def test_greedy_answers_stop_after_the_stop_token(peaked, tiny_hf):
    """A stop token ends only the answer that emits it (kept as its last token); the other runs to the limit."""
    tok = tiny_hf.tokenizer
    prompts = [tok("Q: 12+7=?\nA: ")["input_ids"], tok("7+")["input_ids"]]
    free = [argmax_continuation(peaked, p, 6, {EOS}) for p in prompts]
    stop = free[0][0]
    assert stop not in free[1] and len(free[1]) == 6
    got = greedy_answers(peaked, prompts, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, stop_token_id=stop)
    assert got == [[stop], free[1]]
