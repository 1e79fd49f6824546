"""`train.activation_checkpointing`: the policy's decoder layers recompute their activations in the backward pass.
The gradient is the one without it, bit for bit on CPU (dropout kept too: torch restores the forward's random state);
each layer of the policy runs twice per micro-step, the reference's and the proximal model's once; the data-parallel
ranks' replicas do it too; a model that cannot is refused, naming the setting."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from configs.schema import Config, load_config
from models.trainer import LossSettings, PolicyTrainer
from tasks.session import build_trainer
from tasks.train_ranks import _build_replica, rank_spec
from tests.unit.test_dropout import _llama
from tests.unit.test_trainer_step import _group, _model, _with_behaviour

torch.set_num_threads(1)


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether any decoder layer of `model` checkpoints (transformers' own flag on its layers)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _grads(model, groups, *, on: bool, shared: bool, keep_dropout: bool, **kw) -> tuple[PolicyTrainer, list]:
    kw.update(shared_prompt=shared, keep_dropout=keep_dropout, activation_checkpointing=on)
    trainer = PolicyTrainer(copy.deepcopy(model), None, lr=1e-3, **kw)
    torch.manual_seed(7)  # the same dropout masks both ways (kept dropout draws from the global generator)
    trainer.micro_step(groups)
    return trainer, [p.grad for p in trainer.model.parameters()]


@pytest.mark.parametrize(
    ("build", "shared", "keep_dropout"),
    [(_model, True, False), (_model, False, False), (_llama, True, True)],
    ids=["qwen2-shared-prompt", "qwen2-one-row-per-sample", "llama-dropout-kept"],
)
def test_the_gradient_is_the_same_bit_for_bit(build, shared, keep_dropout):
    model = build()
    groups = [_with_behaviour(model, _group(s), 0.0) for s in (1, 2, 3)]
    plain, off = _grads(model, groups, on=False, shared=shared, keep_dropout=keep_dropout)
    checked, on = _grads(model, groups, on=True, shared=shared, keep_dropout=keep_dropout)
    assert not _checkpointing(plain.model) and _checkpointing(checked.model)
    assert all(g is not None for g in on)
    for (name, _), a, b in zip(model.named_parameters(), off, on, strict=True):
        assert torch.equal(a, b), name
    if keep_dropout:  # the control: the dropout masks differ with another seed, so equal masks were a real test
        torch.manual_seed(8)
        checked.model.zero_grad(set_to_none=True)
        checked.micro_step(groups)
        assert not all(torch.equal(a, p.grad) for a, p in zip(off, checked.model.parameters(), strict=True))


def _layer_calls(model: torch.nn.Module) -> list[int]:
    """A counter of the calls of the MLP of `model`'s first decoder layer: a recomputation runs the layer's forward
    again, and so calls its MLP (transformers checkpoints the layer's `forward`, inside the layer's own hooks; a
    pre-hook, as torch may stop a recomputation once it has what the backward needs)."""
    calls = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("on", [False, True])
def test_only_the_policy_recomputes(on):
    """Per micro-step the policy's layer runs once in the forward and, checkpointed, once more in the backward; the
    reference (KL term) and the proximal model (decoupled PPO's recompute) run once either way."""
    model = _model()
    loss = LossSettings(kl_coef=0.1, decoupled=True, prox_logp="recompute")
    trainer = PolicyTrainer(copy.deepcopy(model), copy.deepcopy(model), lr=1e-3, loss=loss, activation_checkpointing=on)
    trainer.prox_version = 1  # the proximal weights of version 1 (here the policy's own)
    stale = _group(1)
    stale.token_versions = [[0] * len(r) for r in stale.responses]  # two versions behind version 2: a proximal pass
    policy, ref, prox = (_layer_calls(m) for m in (trainer.model, trainer.ref_model, trainer.prox_model))
    trainer.micro_step([stale], version=2)
    assert (policy[0], ref[0], prox[0]) == (2 if on else 1, 1, 1)
    assert _checkpointing(trainer.model) is on
    assert not _checkpointing(trainer.ref_model) and not _checkpointing(trainer.prox_model)


def test_a_model_that_cannot_is_refused_naming_the_setting():
    class Plain(torch.nn.Module):  # no `supports_gradient_checkpointing`: not a transformers model
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"train\.activation_checkpointing: the model \(Plain\) does not support"):
        PolicyTrainer(Plain(), None, lr=1e-3, activation_checkpointing=True)
    PolicyTrainer(Plain(), None, lr=1e-3)  # off, nothing is asked of the model


def test_the_setting_reaches_the_session_trainer_and_the_ranks_replicas():
    assert Config().train.activation_checkpointing is False
    tokenizer = SimpleNamespace(pad_token_id=0)
    for value in (False, True):
        cfg = load_config(None, [f"train.activation_checkpointing={str(value).lower()}"])
        assert _checkpointing(build_trainer(cfg, _model(), tokenizer, torch.device("cpu")).model) is value
    for on in (False, True):  # rank 0's trainer -> the spec the other ranks are spawned with -> their replicas
        trainer = PolicyTrainer(
            _model(), _model(), lr=1e-3, loss=LossSettings(kl_coef=0.1), activation_checkpointing=on
        )
        replica = _build_replica(rank_spec(trainer, threads=1, shard_optimizer=False), torch.device("cpu"))
        assert _checkpointing(replica.model) is on and not _checkpointing(replica.ref_model)


def test_a_checkpoint_saved_from_it_is_the_models_own(tmp_path):
    """Saved weights and config are those of the model without it (a checkpoint or an export carries no setting of
    the trainer's)."""
    model = _model()
    model.save_pretrained(tmp_path / "plain")
    PolicyTrainer(model, None, lr=1e-3, activation_checkpointing=True).model.save_pretrained(tmp_path / "checked")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "checked" / name).read_bytes(), name


def test_a_model_path_that_cannot_is_refused_before_any_work(tmp_path):
    """`check_inputs`, before the run's config is frozen (after it, the trainer's refusal left a run that could never
    resume): a model directory whose class cannot checkpoint is named with the setting; one that can passes."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    from models.tiny import build_char_tokenizer, build_tiny_model, save_hf
    from tasks.preflight import InputError, check_inputs

    tok = build_char_tokenizer()
    gpt_config = OpenAIGPTConfig(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2)
    gpt = save_hf(OpenAIGPTLMHeadModel(gpt_config), tok, tmp_path / "openai-gpt")
    tiny = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
    qwen = save_hf(build_tiny_model(len(tok), **tiny), tok, tmp_path / "qwen2")
    arith = ["task.n_shots=0", f"lake.uri={tmp_path / 'lake'}"]
    check_inputs(load_config(None, [*arith, f"model.path={gpt}"]))  # off: any model
    refusal = r"model.path .*openai-gpt.*: train\.activation_checkpointing: the model \(OpenAIGPTLMHeadModel\) does not"
    with pytest.raises(InputError, match=refusal):
        check_inputs(load_config(None, [*arith, f"model.path={gpt}", "train.activation_checkpointing=true"]))
    check_inputs(load_config(None, [*arith, f"model.path={qwen}", "train.activation_checkpointing=true"]))
