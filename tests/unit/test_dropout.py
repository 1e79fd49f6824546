"""The trainer turns the model's dropout off (`trainer.disable_dropout`, true by default): the engine samples without it, so
with it an on-policy batch's log-ratios were noise instead of 0. The built-in models have none; GPT-2, OPT and a
Llama config with `attention_dropout` do."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from configs.schema import Config, frozen_config, load_config, resolved_json
from models.trainer import LossSettings, PolicyTrainer, disable_dropout
from tasks.session import build_trainer
from tasks.train_ranks import RankSpec, _build_replica
from tests.unit.test_trainer_step import _group, _with_behaviour

VOCAB = 40


def _built(model_class, config_class, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_class(config_class(vocab_size=VOCAB, **fields)).eval()


def _llama() -> torch.nn.Module:
    layers = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    return _built(LlamaForCausalLM, LlamaConfig, hidden_size=32, attention_dropout=0.5, **layers)


def _gpt2() -> torch.nn.Module:
    return _built(GPT2LMHeadModel, GPT2Config, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


def _opt() -> torch.nn.Module:
    layers = dict(num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32)
    return _built(
        OPTForCausalLM, OPTConfig, hidden_size=32, dropout=0.3, attention_dropout=0.3, layerdrop=0.2, **layers
    )


def _two_forwards_in_train_mode(model) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    ids = torch.arange(4, 20).view(2, 8)
    with torch.no_grad():
        return model(ids).logits, model(ids).logits


@pytest.mark.parametrize(("build", "rates"), [(_gpt2, 7), (_opt, 6), (_llama, 2)])
def test_every_dropout_is_off_in_train_mode_and_the_config_is_kept(build, rates):
    a, b = _two_forwards_in_train_mode(build())
    assert not torch.equal(a, b)  # the control: the model as built is stochastic in train mode
    model = build()
    before = model.config.to_dict()
    assert (
        disable_dropout(model) == rates
    )  # GPT-2: the embeddings' + 3 per layer; OPT: the decoder's, LayerDrop, 2 per layer
    a, b = _two_forwards_in_train_mode(model)
    assert torch.equal(a, b)
    assert model.config.to_dict() == before  # a checkpoint or an export keeps the model's own dropout
    assert disable_dropout(model) == 0


def _mismatch(keep_dropout: bool) -> float:
    model = _llama()
    groups = [_with_behaviour(model, _group(s), 0.0) for s in (1, 2)]  # behaviour: the model's eval-mode log-probs
    trainer = PolicyTrainer(model, copy.deepcopy(model), lr=1e-3, keep_dropout=keep_dropout)
    trainer.micro_step(groups)
    return trainer.optimizer_step()["mismatch/logp_abs"]


def test_an_on_policy_batch_trains_on_the_log_probs_it_was_sampled_with():
    assert _mismatch(keep_dropout=False) < 1e-6
    assert _mismatch(keep_dropout=True) > 1e-2  # with dropout kept, the same batch's log-ratios are noise


def replica_spec(model: torch.nn.Module, **fields) -> RankSpec:
    """What a data-parallel rank builds its replica of `model` from (with a reference), on CPU; `fields` override."""
    base = dict(
        model_class=type(model),
        model_config=model.config,
        attn_implementation="sdpa",
        dtypes={},
        trainable={},
        device_type="cpu",
        threads=1,
        has_ref=True,
        loss=LossSettings(),
        pad_token_id=0,
        shared_prompt=False,
        lr=1e-3,
        keep_dropout=False,
    )
    return RankSpec(**{**base, **fields})


def test_the_reference_and_the_ranks_replicas_have_none_either():
    model, ref = _llama(), _llama()
    PolicyTrainer(model, ref, lr=1e-3)
    assert disable_dropout(ref) == 0
    spec = replica_spec(model)
    replica = _build_replica(spec, torch.device("cpu"))
    assert disable_dropout(replica.model) == 0 and disable_dropout(replica.ref_model) == 0
    kept = _build_replica(replica_spec(model, keep_dropout=True), torch.device("cpu"))
    assert disable_dropout(kept.model) == 2


def test_the_setting_its_default_and_a_run_frozen_before_it():
    """The session's trainer follows `trainer.disable_dropout`; a run frozen before the field kept its model's
    dropout."""
    tokenizer = SimpleNamespace(pad_token_id=0)
    for value, rates_left in (("true", 0), ("false", 2)):
        cfg = load_config(None, [f"trainer.disable_dropout={value}", "algorithm.kl_coef=0.1"])
        trainer = build_trainer(cfg, _llama(), tokenizer, torch.device("cpu"))
        assert disable_dropout(trainer.model) == rates_left and disable_dropout(trainer.ref_model) == rates_left
    assert Config().trainer.disable_dropout is True
    old = json.loads(resolved_json(Config()))
    del old["trainer"]["disable_dropout"]
    assert frozen_config(old).trainer.disable_dropout is False  # it trained with the model's dropout
