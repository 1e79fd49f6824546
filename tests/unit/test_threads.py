"""The trainer borrows the idle rollout workers' threads once an iteration's rollouts are in (sync / periodic)."""

from __future__ import annotations

import pytest

from configs.schema import Config
from tasks import iteration


def _cfg(**resources) -> Config:
    cfg = Config()
    for key, value in resources.items():
        setattr(cfg.resources, key, value)
    return cfg


@pytest.mark.parametrize(
    ("cores", "resources", "expected"),
    [
        (2, {"borrow_rollout_threads": True}, 2),  # the demo: 1 trainer thread + 1 worker x 1 thread
        (16, {"borrow_rollout_threads": True, "rollout_workers": 2, "rollout_threads": 3, "train_threads": 2}, 8),
        (4, {"borrow_rollout_threads": True, "rollout_workers": 2, "rollout_threads": 3, "train_threads": 2}, 4),
        (2, {"borrow_rollout_threads": True, "train_threads": 3}, 3),  # never fewer than its own
        (16, {"rollout_threads": 4}, 1),  # off by default: other runs may share the machine
        (2, {"borrow_rollout_threads": True, "train_ranks": 2}, 1),  # the demo on 2 ranks: rank 1 holds the 2nd core
        (8, {"borrow_rollout_threads": True, "train_ranks": 2, "rollout_threads": 4, "train_threads": 2}, 6),
        (6, {"borrow_rollout_threads": True, "train_ranks": 3, "rollout_threads": 4, "train_threads": 1}, 4),
    ],
)
def test_idle_rollout_threads(monkeypatch, cores, resources, expected):
    monkeypatch.setattr(iteration.os, "cpu_count", lambda: cores)
    assert iteration.idle_rollout_threads(_cfg(**resources)) == expected


def test_async_workers_never_idle(monkeypatch):
    monkeypatch.setattr(iteration.os, "cpu_count", lambda: 16)
    cfg = _cfg(borrow_rollout_threads=True, rollout_threads=4, train_threads=2)
    cfg.pipeline.mode = "async"
    assert iteration.idle_rollout_threads(cfg) == 2
    cfg.pipeline.mode = "periodic"
    assert iteration.idle_rollout_threads(cfg) == 6
