"""Activation checkpointing changes memory and time, not training (`train.activation_checkpointing`): the same periodic
run, 3 iterations, with and without it gives token-identical rollouts and bitwise-equal parameters (the trainer's one
thread: torch's CPU backward is reproducible there, `benchmarks/checkpointing.py`'s control), and the run with it did
recompute its policy's layers in every backward pass."""

from __future__ import annotations

import torch

import models.trainer
from tests.integration.runs import final_params, trained

ITERS = 3


def _run(tmp_path, name, on: bool):
    return trained(tmp_path, name, {"run.iterations": ITERS, "train.activation_checkpointing": on})


def test_a_checkpointed_run_equals_a_plain_one(tmp_path, monkeypatch):
    calls = {"layer": 0, "micro": 0}
    real_enable = models.trainer.enable_activation_checkpointing
    real_micro = models.trainer.PolicyTrainer.micro_step

    def count(*_):  # the trainer's passes (with grad), not the evaluation's greedy decoding on its model (without)
        calls["layer"] += torch.is_grad_enabled()

    def enable(model):  # count the first layer's MLP calls of the checkpointed policy: twice per micro-step
        real_enable(model)
        model.model.layers[0].mlp.register_forward_pre_hook(count)

    def micro_step(self, groups, *args, **kwargs):
        calls["micro"] += bool(self.activation_checkpointing and self.partition(groups)[0])
        return real_micro(self, groups, *args, **kwargs)

    monkeypatch.setattr(models.trainer, "enable_activation_checkpointing", enable)
    monkeypatch.setattr(models.trainer.PolicyTrainer, "micro_step", micro_step)
    plain_params, plain_samples = _run(tmp_path, "plain", False)
    assert calls == {"layer": 0, "micro": 0}
    checked_params, checked_samples = _run(tmp_path, "checked", True)
    assert calls["micro"] >= ITERS and calls["layer"] == 2 * calls["micro"], calls
    assert plain_samples.keys() == checked_samples.keys() and len(plain_samples) == ITERS * 8 * 4
    assert all(a.response_ids == checked_samples[k].response_ids for k, a in plain_samples.items())
    initial = final_params(str(tmp_path / "lake"), "plain", 0)
    moved = max(float((plain_params[k] - initial[k]).abs().max()) for k in plain_params)
    assert moved > 1e-3  # training moved the weights
    unequal = [k for k in plain_params if not (plain_params[k] == checked_params[k]).all()]
    assert not unequal, f"checkpointing changed {unequal}"
