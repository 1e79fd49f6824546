"""The train flow's bookkeeping helpers on a real lake: settling a ledger record left 'trained' by a crash after
PROMOTED was written, the async per-worker generation figures of an iteration, and the report's table."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from flows.report import render
from flows.train import _async_rollout_figures, _curve_points, _settle_ledger
from storage import ledger
from storage.lake import Lake


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def _to(lake: Lake, k: int, state: str, **fields) -> None:
    path = {
        "trained": ("planned", "rolling_out", "trained"),
        "promoted": ("planned", "rolling_out", "trained", "promoted"),
    }[state]
    ledger.write_record(lake, "r", k, path, **fields)


def test_settle_finishes_the_iteration_whose_version_is_promoted(lake):
    _to(lake, 0, "promoted", promoted_version=1)
    _to(lake, 1, "trained")  # PROMOTED says v2: the crash fell between PROMOTED and this record's update
    ledger.write_record(lake, "r", 2, ("planned", "rolling_out"))  # the iteration the crash cut short
    _settle_ledger(SimpleNamespace(lake=lake, run_id="r", version=2))
    assert [r["state"] for r in ledger.read_all(lake, "r")] == ["promoted", "promoted", "rolling_out"]
    assert ledger.read_record(lake, "r", 1)["promoted_version"] == 2


def test_settle_leaves_a_settled_or_fresh_ledger_alone(lake):
    _settle_ledger(SimpleNamespace(lake=lake, run_id="r", version=0))  # nothing promoted but v0: nothing to settle
    assert ledger.read_all(lake, "r") == []
    _to(lake, 0, "promoted", promoted_version=1)
    before = ledger.read_record(lake, "r", 0)
    _to(lake, 1, "trained")  # trained, its version (v2) never promoted: resume retrains it
    _settle_ledger(SimpleNamespace(lake=lake, run_id="r", version=1))
    assert ledger.read_record(lake, "r", 0) == before and ledger.read_record(lake, "r", 1)["state"] == "trained"


def _shard(i: int) -> str:
    return f"lake/r/rollouts/policy_version=3/iteration=3/shard-{i % 2}-{i:05d}.arrow"


def test_async_figures_sum_each_workers_shards_and_skip_shards_made_before_a_resume(lake):
    shards = [{"path": _shard(i), "checksum": "c", "groups": 2} for i in range(4)]
    _to(lake, 3, "trained", shards=shards, reused_chunks=[3])  # chunk 3 was generated before a resume: no figures
    info = {
        _shard(0): {"worker": 0, "gen_s": 1.0, "storage_s": 0.25},
        _shard(1): {"worker": 1, "gen_s": 4.0, "storage_s": 0.5},
        _shard(2): {"worker": 0, "gen_s": 2.0, "storage_s": 0.5},
    }
    s = SimpleNamespace(
        lake=lake, run_id="r", shard_info={**{k: {**v, "path": k} for k, v in info.items()}, "later": {"worker": 0}}
    )
    t0 = time.monotonic()
    figures = sorted(_async_rollout_figures(s, 3), key=lambda w: w["busy_s"])
    assert time.monotonic() - t0 < 1.0  # the reused chunk is not waited for
    assert [(w["busy_s"], w["storage_s"], [sh["path"] for sh in w["shards"]]) for w in figures] == [
        (3.0, 0.75, [_shard(0), _shard(2)]),
        (4.0, 0.5, [_shard(1)]),
    ]
    assert list(s.shard_info) == ["later"]  # a shard of a later iteration keeps its figures for that one


def test_async_figures_wait_for_a_shard_whose_figures_arrive_after_it_was_trained(lake):
    """The worker publishes the shard, then sends its figures: the trainer can finish first."""
    _to(
        lake,
        3,
        "trained",
        shards=[{"path": _shard(i), "checksum": "c", "groups": 2} for i in range(2)],
        reused_chunks=[],
    )
    s = SimpleNamespace(
        lake=lake, run_id="r", shard_info={_shard(0): {"worker": 0, "gen_s": 1.0, "storage_s": 0.25, "path": _shard(0)}}
    )
    late = threading.Timer(
        0.3,
        lambda: s.shard_info.__setitem__(_shard(1), {"worker": 1, "gen_s": 2.0, "storage_s": 0.5, "path": _shard(1)}),
    )
    late.start()
    figures = sorted(_async_rollout_figures(s, 3), key=lambda w: w["busy_s"])
    late.join()
    assert [(w["busy_s"], [sh["path"] for sh in w["shards"]]) for w in figures] == [
        (1.0, [_shard(0)]),
        (2.0, [_shard(1)]),
    ]
    assert s.shard_info == {}
    # figures that never come (a worker gone) are given up after the wait, not waited for forever
    _to(lake, 4, "trained", shards=[{"path": _shard(5), "checksum": "c", "groups": 2}])
    t0 = time.monotonic()
    assert _async_rollout_figures(s, 4, wait_s=0.2) == [{"busy_s": 0.0, "storage_s": 0.0, "load_s": 0.0, "shards": []}]
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_report_table_gives_count_first_and_last_value_of_each_metric(tmp_path):
    _, page = render(
        "r", {"reward/mean": [(0, 0.125), (1, 0.5), (2, 0.875)], "eval/accuracy": [(0, 0.25)]}, str(tmp_path)
    )
    text = open(page).read()
    assert "<tr><td>reward/mean</td><td>3</td><td>0.125</td><td>0.875</td></tr>" in text
    assert "<tr><td>eval/accuracy</td><td>1</td><td>0.25</td><td>0.25</td></tr>" in text


def test_the_curve_after_a_resume_starts_where_the_resumed_process_did():
    """A run of 5 iterations resumed after 2 promotions trains iterations 2-4; evaluation every 2 iterations."""
    history = [{"reward/mean": 0.25}, {"reward/mean": 0.5, "eval/accuracy": 0.625}, {"reward/mean": 0.75}]
    rewards, accuracy = _curve_points(history, 5, acc0=0.5, acc_final=0.75)
    assert rewards == [(2, 0.25), (3, 0.5), (4, 0.75)]
    assert accuracy == [(2, 0.5), (4, 0.625), (5, 0.75)]  # v2 at the resume, v4 after iteration 3, the final v5
    rewards, accuracy = _curve_points([{"reward/mean": 0.25}], 1, acc0=0.5, acc_final=0.75)  # a fresh 1-iteration run
    assert rewards == [(0, 0.25)] and accuracy == [(0, 0.5), (1, 0.75)]
