"""`train.logits_chunk_tokens`: the trainer's log-probs from the decoder's hidden states through the output layer a
chunk of response tokens at a time (`models.packing.chunked_logprobs`), never the micro-batch's whole (S, T, V)
logits. The log-probs, the entropies and the gradients are those of the whole logits up to float32 rounding, in both
layouts and for chunks of 1, 5 and all tokens; the reference's and the proximal model's log-probs come the same way;
the setting reaches the data-parallel ranks' replicas; a model whose logits are not its output layer applied to its
decoder's output is refused, naming the setting."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from configs.schema import ConfigError, load_config
from models import objectives
from models.packing import Group, check_logits_split, chunked_logprobs, pack, packed_logits, token_logprobs
from models.trainer import LossSettings, PolicyTrainer
from tasks.session import build_trainer
from tasks.train_ranks import _build_replica, rank_spec
from tests.unit.test_dropout import VOCAB, _gpt2, _llama, _opt
from tests.unit.test_trainer_step import _group, _model, _with_behaviour

torch.set_num_threads(1)


def _gemma2(softcap: float | None = 30.0, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny Gemma 2 of two layers: its logits are soft-capped (tanh) after the output layer unless `softcap` is
    None."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=softcap,
    )
    return Gemma2ForCausalLM(config).eval()


def _groups(model) -> list:
    return [_with_behaviour(model, _group(s, lens=(3, 1, 7, 2)), 0.0) for s in (1, 2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |a| (Frobenius norms)."""
    return float((a - b).norm() / a.norm())


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "one-row-per-sample"])
@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_log_probs_entropies_and_gradients_are_the_whole_logits(shared, chunk):
    model = _model().train()
    groups = [Group(g.prompt_ids, g.responses) for g in _groups(model)]
    packed = pack(groups, 0, shared)
    mask = packed.mask > 0

    logits = packed_logits(model, packed)
    whole = token_logprobs(logits, packed.targets, 0.7)
    whole_entropy = objectives.entropy_from_logits(logits.detach() / 0.7)
    (whole * packed.mask).sum().backward()
    whole_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    logp, entropy = chunked_logprobs(model, packed, 0.7, chunk, entropy=True)
    assert logp.shape == entropy.shape == mask.shape and not entropy.requires_grad
    assert torch.allclose(logp[mask], whole[mask].detach(), atol=2e-6, rtol=0)
    assert torch.allclose(entropy[mask], whole_entropy[mask], atol=2e-6, rtol=0)
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()  # padding is not computed
    (logp * packed.mask).sum().backward()
    for (name, p), g in zip(model.named_parameters(), whole_grads, strict=True):
        assert _rel(g, p.grad) < 1e-5, name
    assert mask.numel() > int(mask.sum()) > 5  # padding to leave out, and several chunks of 5


def test_without_grad_it_is_the_same_and_keeps_no_graph():
    model = _model()
    packed = pack([Group(g.prompt_ids, g.responses) for g in _groups(model)], 0, True)
    with torch.no_grad():
        plain, _ = chunked_logprobs(model, packed, 1.0, 4)
    logp, none = chunked_logprobs(model, packed, 1.0, 4)
    assert none is None and plain.grad_fn is None and logp.grad_fn is not None
    assert torch.equal(plain, logp.detach())


def test_a_chunks_logits_are_recomputed_in_the_backward():
    """With grad, each chunk's output layer runs once in the forward and once more in the backward (its logits are
    not kept); without grad, once."""
    model = _model().train()
    packed = pack([Group(g.prompt_ids, g.responses) for g in _groups(model)], 0, True)
    calls = [0]
    model.get_output_embeddings().register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    n_tokens = int(packed.mask.sum())
    chunks = -(-n_tokens // 4)
    logp, _ = chunked_logprobs(model, packed, 1.0, 4)
    assert calls[0] == chunks
    logp.sum().backward()
    assert calls[0] == 2 * chunks
    with torch.no_grad():
        chunked_logprobs(model, packed, 1.0, 4)
    assert calls[0] == 3 * chunks


def _micro_step(model, groups, chunk, loss=None, ref=None, version=0, prox_version=None):
    trainer = PolicyTrainer(
        copy.deepcopy(model), ref, lr=1e-3, loss=loss, shared_prompt=True, logits_chunk_tokens=chunk
    )
    trainer.prox_version = prox_version
    if trainer.prox_model is not None:  # a proximal policy apart from the behaviour one, the same in both trainers
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in trainer.prox_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.micro_step(groups, version=version)
    return trainer, trainer.optimizer_step()


@pytest.mark.parametrize(
    "case",
    ["grpo", "kl", "decoupled-metrics"],
)
def test_the_trainer_step_is_the_same(case):
    """One micro-step and optimizer step with chunks against one without: the batch's figures (the loss, the
    entropy, the KL term against the reference, decoupled PPO's proximal figures from the proximal model) and the
    stepped weights agree to float32 rounding."""
    model = _model()
    groups = _groups(model)
    kwargs: dict = {}
    if case == "kl":
        kwargs = dict(loss=LossSettings(kl_coef=0.1), ref=copy.deepcopy(model))
    if case == "decoupled-metrics":
        kwargs = dict(loss=LossSettings(decoupled=True, prox_logp="metrics"), version=2, prox_version=1)
        for g in groups:  # two versions behind: the proximal model is run
            g.token_versions = [[0] * len(r) for r in g.responses]
    whole, m_whole = _micro_step(model, groups, None, **kwargs)
    chunked, m_chunked = _micro_step(model, groups, 3, **kwargs)
    keys = ["loss/policy", "entropy/mean"] + {
        "kl": ["kl/mean"],
        "decoupled-metrics": ["prox/loglinear/abs_err", "prox/linear/abs_err"],
    }.get(case, [])
    for key in keys:
        assert key in m_whole, key
        assert m_chunked[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-6), key
    for (name, a), b in zip(whole.model.named_parameters(), chunked.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    moved = [
        float((a - b).detach().abs().max()) for a, b in zip(whole.model.parameters(), model.parameters(), strict=True)
    ]
    assert max(moved) > 1e-4  # the step moved the weights far beyond the tolerance above


@pytest.mark.parametrize("build", [_model, _llama, _gpt2, _opt, lambda: _gemma2(None)])
def test_models_whose_logits_are_their_output_layer_pass(build):
    model = build().train()
    check_logits_split(model)
    assert model.training  # the probe ran in eval mode and gave the mode back


def test_a_model_that_soft_caps_its_logits_is_refused_naming_the_setting():
    refusal = r"train\.logits_chunk_tokens: the model \(Gemma2ForCausalLM\) cannot .*: its logits differ"
    with pytest.raises(ValueError, match=refusal):
        check_logits_split(_gemma2())
    with pytest.raises(ValueError, match=refusal):
        PolicyTrainer(_gemma2(), None, lr=1e-3, logits_chunk_tokens=8)
    PolicyTrainer(_gemma2(), None, lr=1e-3)  # off, nothing is asked of the model
    with pytest.raises(ValueError, match="logits_chunk_tokens must be >= 1"):
        PolicyTrainer(_model(), None, lr=1e-3, logits_chunk_tokens=0)


def test_the_setting_reaches_the_session_trainer_and_the_ranks_replicas():
    assert load_config(None, []).train.logits_chunk_tokens is None
    with pytest.raises(ConfigError, match="logits_chunk_tokens"):
        load_config(None, ["train.logits_chunk_tokens=0"])
    tokenizer = SimpleNamespace(pad_token_id=0)
    for value in (None, 64):
        cfg = load_config(None, [f"train.logits_chunk_tokens={'null' if value is None else value}"])
        assert build_trainer(cfg, _model(), tokenizer, torch.device("cpu")).logits_chunk_tokens == value
        trainer = PolicyTrainer(_model(), _model(), lr=1e-3, loss=LossSettings(kl_coef=0.1), logits_chunk_tokens=value)
        replica = _build_replica(rank_spec(trainer, threads=1, shard_optimizer=False), torch.device("cpu"))
        assert replica.logits_chunk_tokens == value


def test_a_model_path_that_cannot_is_refused_before_any_work(tmp_path, monkeypatch):
    """`check_inputs`, before the run's config is frozen: a model directory whose logits are soft-capped is named
    with the setting (probed on a one-layer model of its config, its vocabulary of 100 cut to 64); one whose are not
    passes; a config whose shrunk model is over the probe's budget is left to the trainer."""
    import models.packing
    import tasks.preflight
    from models.tiny import build_char_tokenizer, save_hf
    from tasks.preflight import InputError, check_inputs

    tok = build_char_tokenizer()
    gemma = _gemma2(vocab=100)  # the tokenizer's 53 tokens fit
    capped = save_hf(gemma, tok, tmp_path / "gemma2")
    gemma.config.final_logit_softcapping = None
    plain = save_hf(gemma, tok, tmp_path / "gemma2-plain")
    built = []
    real = models.packing.check_logits_split  # tasks.preflight imports it when it probes
    monkeypatch.setattr(models.packing, "check_logits_split", lambda m: built.append(m) or real(m))
    arith = ["task.n_shots=0", f"lake.uri={tmp_path / 'lake'}"]
    check_inputs(load_config(None, [*arith, f"model.path={capped}"]))  # off: any model
    assert built == []
    refusal = r"model.path .*gemma2.*: train\.logits_chunk_tokens: the model \(Gemma2ForCausalLM\) cannot"
    with pytest.raises(InputError, match=refusal):
        check_inputs(load_config(None, [*arith, f"model.path={capped}", "train.logits_chunk_tokens=64"]))
    assert [(m.config.num_hidden_layers, m.config.vocab_size) for m in built] == [(1, 64)]
    check_inputs(load_config(None, [*arith, f"model.path={plain}", "train.logits_chunk_tokens=64"]))
    monkeypatch.setattr(tasks.preflight, "PROBE_MAX_PARAMS", 1000)  # the one-layer model has more: not probed
    check_inputs(load_config(None, [*arith, f"model.path={capped}", "train.logits_chunk_tokens=64"]))
    assert len(built) == 2 and not (tmp_path / "lake").exists()
    monkeypatch.setattr(tasks.preflight, "PROBE_MAX_PARAMS", 10**9)

    def broken(model):  # the shrunk model's own forward pass fails (transformers raises ValueError for many such)
        raise ValueError("a forward pass that one layer breaks")

    monkeypatch.setattr(models.packing, "check_logits_split", broken)  # not a refusal: left to the trainer
    check_inputs(load_config(None, [*arith, f"model.path={capped}", "train.logits_chunk_tokens=64"]))
