"""The benchmarks' arithmetic: the figures the issues and README quote (ratios, bounds, medians, gaps, quartiles) are
computed from the measured times as their docstrings say. Each case is worked by hand, with values chosen so that a
plausible slip (warm-up iterations kept, a mean of ratios for a ratio of means, runs pooled instead of averaged, the
wrong busy time in the bound, a strict comparison at a target's edge) gives another number."""

from __future__ import annotations

import pytest

from benchmarks.a3po import accuracy_figures, accuracy_gap, approximation_errors, speedup_figures
from benchmarks.common import abba
from benchmarks.pipeline import comparison, summarise
from benchmarks.resume import resume_figures
from benchmarks.shared_prompt import point_figures, targets
from benchmarks.startup import REPLAY_FIGURES, iteration_seconds, startup_figures


def test_abba_alternates_which_configuration_goes_first():
    assert abba("sync", "periodic", 1) == ["sync", "periodic"]
    assert abba("sync", "periodic", 2) == ["sync", "periodic", "periodic", "sync"]
    assert abba("a", "b", 3) == ["a", "b", "b", "a", "a", "b"]


def _iteration(i: float) -> dict:
    keys = (
        "time/iteration_s",
        "time/rollout_busy_s",
        "time/train_busy_s",
        "time/first_shard_s",
        "time/sync_s",
        "perf/overhead_fraction",
        "perf/overlap_fraction",
        "perf/samples_per_s",
    )
    return {k: i * (n + 1) for n, k in enumerate(keys)}  # each figure its own multiple of i


def test_summarise_takes_medians_after_the_warmup():
    history = [_iteration(100.0), _iteration(3.0), _iteration(1.0), _iteration(2.0)]
    s = summarise("periodic", history, 1, repeats=2)
    # medians of 3, 1, 2 (times each figure's multiple); with the warm-up kept they would be of 100, 3, 1, 2: 2.5
    assert s == {
        "mode": "periodic",
        "iterations_measured": 3,
        "iteration_s": 2.0,
        "rollout_busy_s": 4.0,
        "train_busy_s": 6.0,
        "first_shard_s": 8.0,
        "sync_s": 10.0,
        "overhead_fraction": 12.0,
        "overlap_fraction": 14.0,
        "samples_per_s": 16.0,
        "repeats": 2,
    }
    assert summarise("sync", history, 0)["iteration_s"] == 2.5


@pytest.mark.parametrize(("rollout", "train"), [(4.0, 6.0), (6.0, 4.0)])
def test_comparison_bounds_by_the_longer_phase(rollout, train):
    per = {
        "iteration_s": 8.25,
        "rollout_busy_s": rollout,
        "train_busy_s": train,
        "first_shard_s": 1.0,
        "sync_s": 0.5,
        "overhead_fraction": 0.05,
    }
    c = comparison({"iteration_s": 11.0}, per)
    assert c["bound_s"] == 7.5  # max(4, 6) + 1 + 0.5
    assert c["periodic_over_bound"] == pytest.approx(1.1)
    assert c["periodic_over_sync"] == pytest.approx(0.75)
    assert c["targets"] == {
        "periodic_over_sync<=0.7": False,
        "periodic_over_bound<=1.15": True,
        "overhead_fraction<=0.05": True,
    }  # at the overhead target's edge: met


def test_comparison_targets_at_and_past_their_edges():
    per = {
        "iteration_s": 7.0,
        "rollout_busy_s": 5.0,
        "train_busy_s": 5.0,
        "first_shard_s": 1.0,
        "sync_s": 0.0,
        "overhead_fraction": 0.051,
    }
    c = comparison({"iteration_s": 10.0}, per)
    assert c["periodic_over_sync"] == 0.7 and c["targets"]["periodic_over_sync<=0.7"]
    assert c["periodic_over_bound"] == pytest.approx(7 / 6) and not c["targets"]["periodic_over_bound<=1.15"]
    assert not c["targets"]["overhead_fraction<=0.05"]
    at_bound = comparison({"iteration_s": 20.0}, {**per, "iteration_s": 11.5, "rollout_busy_s": 9.0})  # bound 10
    assert at_bound["periodic_over_bound"] == 1.15 and at_bound["targets"]["periodic_over_bound<=1.15"]


def _metrics_iteration(reference: float, grad_abs: float, grad_abs_err: float) -> dict:
    it = {
        "staleness/mean": reference * 10,
        "clip/fraction": reference / 10,
        "prox/loglinear/reference_zeroed_fraction": reference,
    }
    for approx, shared, zeroed, err in (
        ("loglinear", 0.05, 0.1, 0.01),
        ("linear", 0.1, 0.4, 0.02),
        ("no_clip", 0.0, 0.0, None),
    ):
        p = f"prox/{approx}/"
        it |= {
            p + "zeroed_shared_fraction": shared,
            p + "zeroed_fraction": zeroed,
            p + "grad_abs": grad_abs,
            p + "grad_abs_err": grad_abs_err,
        }
        if err is not None:
            it |= {p + "abs_err": err, p + "gap_ratio": err * 30}
    return it


def test_approximation_errors_pool_the_runs_iterations_and_take_ratios_of_means():
    # two runs of 1 and 2 iterations: pooled means are over 3 iterations, not a mean of the runs' means
    runs = [[_metrics_iteration(0.1, 8.0, 1.0)], [_metrics_iteration(0.2, 2.0, 2.0), _metrics_iteration(0.6, 2.0, 3.0)]]
    e = approximation_errors(runs)
    assert e["reference_zeroed"] == pytest.approx(0.3)  # (0.1 + 0.2 + 0.6) / 3; the runs' means averaged: 0.25
    assert e["staleness_mean"] == pytest.approx(3.0) and e["clip_fraction"] == pytest.approx(0.03)
    # grad_rel_err: mean error 2 over mean |coefficient| 4 = 0.5 (the mean of per-iteration ratios would be 0.875)
    assert e["loglinear"] == pytest.approx(
        {"grad_rel_err": 0.5, "zeroed": 0.1, "recall": 0.05 / 0.3, "precision": 0.5, "abs_err": 0.01, "gap_ratio": 0.3}
    )
    assert e["linear"] == pytest.approx(
        {"grad_rel_err": 0.5, "zeroed": 0.4, "recall": 0.1 / 0.3, "precision": 0.25, "abs_err": 0.02, "gap_ratio": 0.6}
    )
    # no trust region zeroes nothing: its precision is undefined (null), and it has no proximal error of its own
    assert e["no_clip"] == {"grad_rel_err": 0.5, "zeroed": 0.0, "recall": 0.0, "precision": None}


def test_accuracy_figures_average_each_runs_staleness_then_the_runs():
    runs = [
        {
            "eval_accuracy_final": 0.5,
            "eval_accuracy_initial": 0.1,
            "history": [{"staleness/mean": 1.0}, {"staleness/mean": 3.0}],
        },
        {"eval_accuracy_final": 0.6, "eval_accuracy_initial": 0.2, "history": [{"staleness/mean": 4.0}]},
    ]
    f = accuracy_figures(runs)
    assert f.pop("accuracies") == [0.5, 0.6]
    assert f == pytest.approx(
        {"accuracy_mean": 0.55, "accuracy_initial_mean": 0.15, "staleness_mean": 3.0}
    )  # (2 + 4) / 2; the iterations pooled would give 8/3


@pytest.mark.parametrize(
    ("loglinear", "recompute", "met"),
    [(0.50, 0.53, False), (0.53, 0.50, False), (0.50, 0.515, True), (0.52, 0.51, True)],
)
def test_accuracy_gap_either_way(loglinear, recompute, met):
    gap = accuracy_gap({"accuracy_mean": loglinear}, {"accuracy_mean": recompute})
    assert gap["accuracy_gap"] == pytest.approx(abs(loglinear - recompute))  # loglinear below recompute: positive
    assert gap["targets"] == {"accuracy_gap<=0.02": met}


def test_speedup_figures_median_and_quartiles_of_per_batch_ratios():
    times = {"loglinear": [1.0, 3.0, 2.0, 9.0], "recompute": [4.0, 1.0, 2.0]}
    prox = {"loglinear": [0.001, 0.003, 0.002], "recompute": [0.5, 0.1, 0.4, 0.2]}
    f = speedup_figures([1.5, 1.0, 2.0, 1.2, 1.1], times, prox)
    # sorted 1.0 1.1 1.2 1.5 2.0: quartiles at positions 1.5 and 4.5 of 5 (statistics.quantiles' exclusive method)
    assert f == pytest.approx(
        {
            "train_step_speedup": 1.2,
            "batches": 5,
            "speedup_q1": 1.05,
            "speedup_q3": 1.75,
            "train_step_s_loglinear": 2.5,
            "train_step_s_recompute": 2.0,
            "prox_s_loglinear": 0.002,
            "prox_s_recompute": 0.3,
        }
    )
    one = speedup_figures([1.3], {"loglinear": [1.0], "recompute": [1.3]}, {"loglinear": [0.0], "recompute": [0.2]})
    assert (one["train_step_speedup"], one["speedup_q1"], one["speedup_q3"], one["batches"]) == (1.3, 1.3, 1.3, 1)


def test_shared_prompt_point_figures():
    f = point_figures(128, 16, 4, unshared=[3.0, 2.0, 4.5], shared=[1.0, 1.0, 2.0])
    assert f == {
        "ideal_ratio": 3.0,  # 4 * 144 / (128 + 64)
        "speedup": 3.0,  # median 3 over median 1; the mean of the pairs' ratios would be 7.25/3
        "speedup_pair_range": [2.0, 3.0],
        "speedup_best": 2.0,
        "step_s_unshared": 3.0,
        "step_s_shared": 1.0,
    }
    with pytest.raises(ValueError):  # repeats that do not pair up are a bug, not a figure
        point_figures(128, 16, 4, unshared=[1.0, 2.0], shared=[1.0])


def test_shared_prompt_targets():
    ideal = 16 * 1040 / (1024 + 256)  # 13.0 at P=1024, R=16, G=16: the speedup target is 0.6 * 13 = 7.8
    met = targets({(1024, 16, 16): (ideal, 7.9), (128, 16, 4): (3.0, 1.0)})
    assert met == {
        "targets": {"speedup >= 0.6*ideal at P=1024,R=16,G=16": True, "speedup >= 1.0 everywhere": True},
        "speedup_at_1024_16_16": 7.9,
        "ideal_at_1024_16_16": 13.0,
    }
    edge = targets({(1024, 16, 16): (ideal, 7.8), (128, 16, 4): (3.0, 1.0)})["targets"]  # 0.6 * 13 is 7.8 exactly
    assert edge == {"speedup >= 0.6*ideal at P=1024,R=16,G=16": True, "speedup >= 1.0 everywhere": True}
    missed = targets({(1024, 16, 16): (ideal, 7.7), (128, 16, 4): (3.0, 0.99)})["targets"]
    assert missed == {"speedup >= 0.6*ideal at P=1024,R=16,G=16": False, "speedup >= 1.0 everywhere": False}


def test_resume_figures_charge_only_what_the_left_iterations_do_not_explain():
    assert resume_figures(resume_s=50.0, iteration_s=10.0, left=4) == {
        "iteration_s": 10.0,
        "resume_s": 50.0,
        "iterations_after_resume": 4,
        "resume_setup_s": 10.0,
        "resume_setup_over_iteration": 1.0,
    }


def test_flattened_reaches_the_share_with_evenly_spread_groups():
    """`benchmarks.zero_advantage.flattened`: 10 groups in shards of 4, 4, 2, one already all equal; a share of 0.5
    makes 4 more all equal (every other group with signal, in batch order), keeps the shards and leaves the rest and
    the input untouched; a share below what the batch already has changes nothing."""
    from benchmarks.zero_advantage import flattened
    from models.trainer import RolloutGroup

    def group(i: int, rewards) -> RolloutGroup:
        return RolloutGroup([i], [[1], [2], [3]], list(rewards), [[0.0]] * 3, [[0]] * 3, prompt_id=i)

    groups = [group(i, (1.0, 1.0, 1.0) if i == 3 else (0.0, 0.5, float(i))) for i in range(10)]
    batch = [groups[:4], groups[4:8], groups[8:]]
    out = flattened(batch, 0.5)
    assert [len(shard) for shard in out] == [4, 4, 2]
    flat = [g.prompt_ids[0] for shard in out for g in shard if len(set(g.rewards)) == 1]
    assert flat == [0, 2, 3, 5, 7]  # 3 already was; of the 9 with signal, those at positions 0, 2, 4 and 6
    assert [g.rewards for shard in out for g in shard if g.prompt_ids[0] == 2] == [[0.0, 0.0, 0.0]]
    assert groups[2].rewards == [0.0, 0.5, 2.0]  # the recorded groups are not modified
    assert flattened(batch, 0.05) == batch


def test_startup_figures_are_medians_per_checkout_and_ratios_of_the_medians():
    def run(first, ready, end, it1, it2):
        return {
            "first_line_s": first,
            "ready_s": ready,
            "end_s": end,
            "first_iteration_s": it1,
            "second_iteration_s": it2,
        }

    this = [run(2, 10, 20, 4, 0.7), run(3, 12, 30, 5, 0.6), run(100, 11, 21, 3, 0.8)]
    old = [run(4, 16, 25, 4, 2.0), run(5, 15, 26, 4, 2.6), run(6, 14, 24, 6, 2.1)]
    lines = startup_figures({"this": this, "/old": old})
    assert lines[0] == {"tree": "this", **run(3, 11, 21, 4, 0.7)}  # medians (means would give 35, 11, 23.7, 4, 0.7)
    assert lines[1] == {"tree": "/old", **run(5, 15, 25, 4, 2.1)}
    # ratios of the medians: the medians of the runs' pairwise ratios would give 1.67, 1.27, 1.14, 1, 3.25
    assert lines[2] == {"ratio": "/old / this", **run(5 / 3, 15 / 11, 25 / 21, 1, 2.1 / 0.7)}
    assert startup_figures({"this": this}) == [lines[0]]  # one checkout: no ratio
    replays = {
        "this": [
            {"replay_refused_s": 3, "replay_s": 14},
            {"replay_refused_s": 2, "replay_s": 15},
            {"replay_refused_s": 9, "replay_s": 13},
        ],
        "/old": [{"replay_refused_s": 6, "replay_s": 18}],
    }
    assert startup_figures(replays, REPLAY_FIGURES) == [  # `--replay`: its own two figures, the same way
        {"tree": "this", "replay_refused_s": 3, "replay_s": 14},
        {"tree": "/old", "replay_refused_s": 6, "replay_s": 18},
        {"ratio": "/old / this", "replay_refused_s": 2.0, "replay_s": 18 / 14},
    ]


def test_an_iterations_seconds_are_read_from_its_progress_line():
    line = "iteration 2/3 reward 0.530 acc 0.420 gen 1611 tok/s train 397 tok/s 2.00 s/it eta 8 s\n"
    assert iteration_seconds(line) == (2, 2.0)
    long = "iteration 12/300 reward 0.1 acc 0.2 gen 1 tok/s train 2 tok/s 0.68 s/it eta 9 s"
    assert iteration_seconds(long) == (12, 0.68)
    for other in ("run r: initial held-out accuracy 0.420", "done in 10 s: held-out accuracy 0.000 -> 0.000"):
        assert iteration_seconds(other) is None


def test_the_clis_progress_lines_of_a_run_up_to_39_iterations_give_every_iterations_seconds(monkeypatch):
    """What `benchmarks.startup` parses is what `lockstep train` prints to a pipe, for every iteration of a run it
    accepts (`--iterations` 2 to 39)."""
    import io

    from flows import cli

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    for total in (2, 3, 39):
        out = io.StringIO()
        progress = cli._Progress(cli._console(file=out, soft_wrap=True))
        progress({"event": "start", "run_id": "r", "accuracy": 0.4, "iterations": total, "start": 0})
        for i in range(total):
            figures = {"reward/mean": 0.5, "perf/gen_tokens_per_s": 2000.0, "perf/train_tokens_per_s": 1000.0}
            progress({"event": "iteration", "iteration": i, "time/iteration_s": 1 + i / 100, **figures})
        parsed = [iteration_seconds(line) for line in out.getvalue().splitlines()]
        assert [p for p in parsed if p is not None] == [(k, round(1 + (k - 1) / 100, 2)) for k in range(1, total + 1)]
