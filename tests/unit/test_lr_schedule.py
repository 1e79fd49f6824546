"""Learning-rate schedules (`trainer.lr_schedule`, `warmup_steps`, `min_lr_ratio`): the rate of a batch is a
function of its index alone, and the trainer's optimizer step actually uses it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from configs.schema import load_config
from models.tiny import build_tiny_model
from models.trainer import PolicyTrainer, RolloutGroup, lr_factor
from tasks.iteration import BatchSteps

torch.set_num_threads(1)


def test_constant_is_one_after_warmup():
    assert [lr_factor(s, 10) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    assert [lr_factor(s, 10, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_runs_from_peak_to_min_ratio(kind):
    total, warmup, floor = 12, 2, 0.1
    f = [lr_factor(s, total, kind=kind, warmup=warmup, min_ratio=floor) for s in range(total)]
    assert f[:3] == [0.5, 1.0, 1.0]  # warm-up reaches the peak; the decay starts from it at batch `warmup`
    assert f[-1] == pytest.approx(floor, abs=1e-12)  # the last batch trains at the floor
    assert all(a > b for a, b in zip(f[2:], f[3:]))  # strictly decreasing after the peak
    # a quarter of the decay: total 11, warm-up 2, decay over batches 2..10 (8 intervals), batch 4 is 2/8 of it
    q = lr_factor(4, 11, kind=kind, warmup=2, min_ratio=floor)
    expected = 0.75 if kind == "linear" else 0.5 * (1 + math.cos(math.pi / 4))
    assert q == pytest.approx(floor + (1 - floor) * expected, abs=1e-12)


def test_the_rate_is_a_factor_of_the_peak_not_of_the_last_rate():
    trainer = PolicyTrainer(
        build_tiny_model(40, seed=0, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32),
        None,
        lr=1e-2,
    )
    trainer.set_lr_factor(0.5)
    trainer.set_lr_factor(0.5)  # the same batch index twice (a resumed step): 0.5 x peak, not 0.25
    assert trainer.optimizer.param_groups[0]["lr"] == 0.5e-2


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        lr_factor(0, 10, kind="step")


def test_a_run_shorter_than_its_warmup_stays_in_warmup():
    cfg = load_config(None, ["run.iterations=4", "trainer.warmup_steps=10", "trainer.lr_schedule=cosine"])
    t = cfg.trainer
    factors = [lr_factor(s, 4, kind=t.lr_schedule, warmup=t.warmup_steps, min_ratio=t.min_lr_ratio) for s in range(4)]
    assert factors == pytest.approx([0.1, 0.2, 0.3, 0.4])


def _group() -> RolloutGroup:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 40, (10,), generator=gen).tolist()
    responses = [torch.randint(4, 40, (3,), generator=gen).tolist() for _ in range(4)]
    return RolloutGroup(prompt, responses, [0.0, 1.0, 0.5, 0.25], [[-1.0] * 3] * 4, [[0] * 3] * 4, prompt_id=0)


@pytest.mark.parametrize("version", [0, 3, 7])
def test_the_batch_step_uses_the_scheduled_rate(version):
    """Adam's first step moves each weight by ~lr (|m_hat / sqrt(v_hat)| = 1): the largest change is the rate."""
    peak = 1e-2
    cfg = load_config(
        None,
        [
            "run.iterations=8",
            "trainer.lr_schedule=linear",
            "trainer.warmup_steps=2",
            "trainer.min_lr_ratio=0.2",
            f"trainer.lr={peak}",
            "rollout.prompts_per_iteration=1",
        ],
    )
    model = build_tiny_model(
        40, seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    before = copy.deepcopy(model)
    trainer = PolicyTrainer(model, None, lr=peak, grad_clip=None)
    steps = BatchSteps(trainer, cfg, [0], version)
    steps.add([_group()])
    figures = steps.finish()
    rate = peak * {0: 0.5, 3: 1.0 - 0.8 * (1 / 5), 7: 0.2}[version]  # decay over batches 2..7 (5 intervals)
    assert figures["train/lr"] == pytest.approx(rate, rel=1e-9)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), before.parameters()))
    assert moved == pytest.approx(rate, rel=1e-3)
