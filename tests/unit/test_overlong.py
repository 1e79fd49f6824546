"""DAPO's soft overlong punishment (`algorithm.overlong_buffer`, `overlong_penalty`): the trainer takes each group's
advantages of its rewards plus the punishment of each response's length; the stored rewards stay the task's. The
same gradient as a trainer given the punished rewards by hand; a group made unequal by it is trained, one made equal
is skipped; its figures per sample; the config's bounds."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from configs.schema import Config, ConfigError, inert_settings, load_config
from models.trainer import LossSettings, PolicyTrainer, shaped_rewards
from tasks.session import loss_settings
from tests.unit.test_trainer_step import _group, _model, _with_behaviour

torch.set_num_threads(1)

OVERLONG = (4, 2, 1.0)  # max_len 4, a ramp over the last 2 tokens: lengths 1, 2 -> 0; 3 -> -0.5; 4 -> -1


def test_the_punishment_of_each_length():
    r, penalty = shaped_rewards([0.0, 1.0, 0.5, 0.25], [[5] * n for n in (3, 1, 4, 2)], OVERLONG)
    assert penalty.tolist() == [-0.5, 0.0, -1.0, 0.0]
    assert r.tolist() == [-0.5, 1.0, -0.5, 0.25]
    _, half = shaped_rewards([0.0, 0.0], [[5] * 3, [5] * 4], (4, 2, 0.5))  # the factor scales it
    assert half.tolist() == [-0.25, -0.5]
    plain, none = shaped_rewards([0.0, 1.0], [[5] * 9, [5]], None)
    assert none is None and plain.tolist() == [0.0, 1.0] and plain.dtype == torch.float32


def _trainer(model, **loss) -> PolicyTrainer:
    return PolicyTrainer(copy.deepcopy(model), None, lr=1e-3, loss=LossSettings(**loss))


def _grads(trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize(
    ("loss", "version"),
    [({}, 0), ({"decoupled": True, "prox_logp": "loglinear"}, 2)],
    ids=["on-policy", "async-decoupled-two-versions-behind"],
)
def test_the_gradient_of_the_punished_rewards(loss, version):
    """A trainer with the punishment gives the gradient of one without it whose groups carry the punished rewards;
    the control, the task's rewards unpunished, gives another. Also async mode's decoupled loss, on tokens generated
    two versions before the trainer's."""
    model = _model()
    groups = [_with_behaviour(model, _group(s), 0.0) for s in (1, 2)]  # lengths 3, 1, 4, 2
    shaped = [
        dataclasses.replace(g, rewards=shaped_rewards(g.rewards, g.responses, OVERLONG)[0].tolist()) for g in groups
    ]
    punished, by_hand, unpunished = (
        _trainer(model, overlong=OVERLONG, **loss),
        _trainer(model, **loss),
        _trainer(model, **loss),
    )
    punished.micro_step(groups, version)
    by_hand.micro_step(shaped, version)
    unpunished.micro_step(groups, version)
    for a, b in zip(_grads(punished), _grads(by_hand), strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(_grads(punished), _grads(unpunished), strict=True))
    figures = punished.optimizer_step()
    assert figures["reward/overlong_penalty"] == pytest.approx(-1.5 * 2 / 8)  # -0.5 - 1 per group, 8 samples
    assert figures["reward/overlong_fraction"] == pytest.approx(0.5)
    assert "reward/overlong_penalty" not in unpunished.optimizer_step()


def test_a_group_is_skipped_only_when_its_punished_rewards_are_equal():
    """Equal task rewards with lengths in the ramp differ once punished: trained. Equal task rewards with equally long
    responses stay equal: skipped (counted in the figures as trained ones are)."""
    model = _model()
    uneven = _with_behaviour(model, _group(1, rewards=(1.0,) * 4), 0.0)  # lengths 3, 1, 4, 2
    even = _with_behaviour(model, _group(2, rewards=(1.0,) * 4, lens=(4, 4, 4, 4)), 0.0)
    trainer = _trainer(model, overlong=OVERLONG)
    assert not trainer.skips(uneven) and trainer.skips(even)
    assert _trainer(model).skips(uneven)  # without the punishment: all equal
    trainer.micro_step([uneven, even])
    figures = trainer.optimizer_step()
    assert figures["train/skipped_groups"] == 1.0 and figures["train/samples"] == 8.0
    assert figures["reward/overlong_penalty"] == pytest.approx((-1.5 - 4.0) / 8)
    assert figures["reward/overlong_fraction"] == pytest.approx(6 / 8)


def test_the_config():
    assert Config().algorithm.overlong_buffer is None and loss_settings(Config()).overlong is None
    cfg = load_config(None, ["algorithm.overlong_buffer=2", "algorithm.overlong_penalty=0.5"])
    assert loss_settings(cfg).overlong == (cfg.rollout.max_new_tokens, 2, 0.5)
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer=7 is longer than rollout.max_new_tokens=6"):
        load_config(None, ["algorithm.overlong_buffer=7"])
    for bad in ("algorithm.overlong_buffer=0", "algorithm.overlong_penalty=0", "algorithm.overlong_penalty=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(None, [bad])
    warned = inert_settings(load_config(None, ["algorithm.overlong_penalty=0.5"]))
    assert any("algorithm.overlong_penalty" in w and "overlong_buffer is null" in w for w in warned), warned


def test_the_figures_of_a_batch_of_mini_batches_are_per_sample():
    """With two PPO mini-batches, one of groups cut at the limit with equal rewards (punished alike, so skipped: no
    token trained) and one of short responses: the iteration's figures are over all its samples, the skipped
    mini-batch's included (weighted by tokens they would count for nothing)."""
    from tasks.iteration import BatchSteps

    model = _model()
    plan = [0, 1, 2, 3]
    cut = [_with_behaviour(model, _group(s, rewards=(1.0,) * 4, lens=(4, 4, 4, 4)), 0.0) for s in (1, 2)]
    short = [_with_behaviour(model, _group(s, lens=(1, 2, 1, 2)), 0.0) for s in (3, 4)]
    for pid, g in enumerate(cut + short):
        g.prompt_id = pid
    cfg = load_config(None, ["algorithm.ppo_mini_batches=2", "rollout.prompts_per_iteration=4"])
    trainer = PolicyTrainer(copy.deepcopy(model), None, lr=1e-3, loss=LossSettings(overlong=OVERLONG))
    steps = BatchSteps(trainer, cfg, plan, version=0)
    steps.add(cut + short)
    figures = steps.finish()
    assert [f["train/tokens"] for f in steps.steps] == [0.0, 12.0] and figures["train/skipped_groups"] == 2.0
    assert figures["reward/overlong_penalty"] == pytest.approx(-8 / 16)  # 8 samples at -1 of 16
    assert figures["reward/overlong_fraction"] == pytest.approx(0.5)
