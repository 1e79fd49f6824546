"""A-3PO vs recomputed proximal log-probs in async mode, on the demo model through the real flow.

Per staleness bound S in {2, 8}: two async runs per method in ABBA order, then one JSON line with `prox_s` for
loglinear and for recompute (median seconds per batch spent producing the proximal log-probs) and
`train_step_speedup` = recompute / loglinear train-step time (micro-steps + optimizer step), both measured side by side
on the batches those runs recorded (`replayed_train_steps`: the median over batches of the per-batch ratio, with
quartiles); beside them the in-flow figures (`*_in_flow`, the train task's busy time in each method's own runs) and
`iteration_speedup` (iteration wall time), medians over the measured iterations after warm-up ones; then async vs
periodic samples/s on the same resources (the
demo's: 1 rollout worker with 1 thread, 1 training thread). Then, per accuracy staleness bound, one line per
method with `prox_logp` and `accuracy_mean`, the held-out accuracy after the same number of iterations averaged
over the seeds, and a line with their gap. Then, per `--metrics-staleness` bound (none by default), one line from
async runs in `metrics` mode (trained on recompute, the approximations logged against it): per approximation, its
proximal log-prob error and how far it moves the loss's gradient and trust region (`approximation_errors`).

    .venv/bin/python -m benchmarks.a3po [--iterations 10] [--warmup 2] [--accuracy-iterations 120]
        [--accuracy-staleness 2 8] [--seeds 0 1 2] [--dir DIR] [--skip-timing]
        [--metrics-staleness 2 8] [--metrics-iterations 60] [--metrics-skip 10]

`--accuracy-staleness` takes several bounds (one accuracy line per method and bound; none: no accuracy runs);
`--skip-timing` runs only the accuracy part (e.g. in a second process, since accuracy does not need a quiet
machine).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import (
    MAX_ITERATIONS,
    abba,
    check_dir,
    check_range,
    check_unique,
    emit,
    parser,
    side_by_side_trainers,
    work_dir,
)
from benchmarks.pipeline import run, summarise

METHODS = ("loglinear", "recompute")


def main() -> None:
    ap = parser("benchmarks.a3po", __doc__)
    ap.add_argument(
        "--iterations", type=int, default=10, help="measured iterations per timing run, after the warm-up ones"
    )
    ap.add_argument("--warmup", type=int, default=2, help="iterations run first and left out of the timing figures")
    ap.add_argument("--accuracy-iterations", type=int, default=120, help="iterations of each accuracy run")
    ap.add_argument(
        "--accuracy-staleness",
        type=int,
        nargs="*",
        default=[2, 8],
        help="staleness bounds of the accuracy runs (none: no accuracy runs)",
    )
    ap.add_argument("--skip-timing", action="store_true", help="only the accuracy and metrics runs")
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds of the accuracy and metrics runs"
    )
    ap.add_argument(
        "--metrics-staleness",
        type=int,
        nargs="*",
        default=[],
        help="staleness bounds of the metrics-mode runs (none by default)",
    )
    ap.add_argument("--metrics-iterations", type=int, default=60, help="iterations of each metrics-mode run")
    ap.add_argument(
        "--metrics-skip",
        type=int,
        default=10,
        help="first iterations left out of the metrics averages (staleness still rising)",
    )
    ap.add_argument(
        "--dir",
        default=None,
        help="work directory (default: a temporary one); reusing one reuses the cached bootstrap of each seed",
    )
    args = ap.parse_args()
    check_range(ap, "--warmup", args.warmup, 0, MAX_ITERATIONS - 1)
    check_range(ap, "--iterations", args.iterations, 1, MAX_ITERATIONS - args.warmup)  # a run is both
    if not args.skip_timing and args.iterations + args.warmup < 3:
        # replayed_train_steps needs an iteration after the warm-up ones at trainer version (= iteration) >= 2
        ap.error(
            f"--iterations {args.iterations} with --warmup {args.warmup}: the replayed train steps need an "
            "iteration at trainer version 2 or later after the warm-up ones: --iterations + --warmup must be at "
            "least 3"
        )
    check_range(ap, "--accuracy-iterations", args.accuracy_iterations, 1, MAX_ITERATIONS)
    check_range(ap, "--metrics-iterations", args.metrics_iterations, 1, MAX_ITERATIONS)
    check_range(ap, "--metrics-skip", args.metrics_skip, 0)
    if args.metrics_staleness and args.metrics_skip >= args.metrics_iterations:
        ap.error(f"--metrics-skip {args.metrics_skip} must be in [0, --metrics-iterations {args.metrics_iterations})")
    for flag, values, hi in (
        ("--accuracy-staleness", args.accuracy_staleness, None),
        ("--metrics-staleness", args.metrics_staleness, None),
        ("--seeds", args.seeds, 2**32 - 1),
    ):  # run.seed's bound
        for v in values:
            check_range(ap, flag, v, 0, hi)
        check_unique(ap, flag, values)
    if args.skip_timing and not args.accuracy_staleness and not args.metrics_staleness:
        ap.error("--skip-timing with no --accuracy-staleness and no --metrics-staleness bound: nothing to run")
    check_dir(ap, args.dir)
    total = args.iterations + args.warmup
    stamp = time.strftime("%Y%m%d%H%M%S")  # run ids stay unique in a reused directory
    with work_dir(args.dir) as tmp:
        if not args.skip_timing:
            timing(tmp, stamp, total, args)
        for S in args.accuracy_staleness:
            accuracy = {}
            for prox in METHODS:
                runs = [
                    run(
                        tmp,
                        f"a3po-acc-s{S}-{prox}-{seed}-{stamp}",
                        {
                            "pipeline.mode": "async",
                            "run.seed": seed,
                            "pipeline.max_staleness": S,
                            "algorithm.prox_logp": prox,
                        },
                        args.accuracy_iterations,
                        full=True,
                    )
                    for seed in args.seeds
                ]
                accuracy[prox] = accuracy_figures(runs)
                emit(
                    benchmark="a3po",
                    prox_logp=prox,
                    max_staleness=S,
                    iterations=args.accuracy_iterations,
                    seeds=args.seeds,
                    **accuracy[prox],
                )
            emit(benchmark="a3po", max_staleness=S, **accuracy_gap(accuracy["loglinear"], accuracy["recompute"]))
        for S in args.metrics_staleness:
            overrides = {"pipeline.mode": "async", "pipeline.max_staleness": S, "algorithm.prox_logp": "metrics"}
            histories = [
                run(
                    tmp,
                    f"a3po-metrics-s{S}-{seed}-{stamp}",
                    {**overrides, "run.seed": seed},
                    args.metrics_iterations,
                    full=True,
                )["history"][args.metrics_skip :]
                for seed in args.seeds
            ]
            emit(
                benchmark="a3po",
                prox_logp="metrics",
                max_staleness=S,
                iterations=args.metrics_iterations,
                iterations_averaged=args.metrics_iterations - args.metrics_skip,
                seeds=args.seeds,
                **approximation_errors(histories),
            )


def accuracy_figures(runs: list[dict]) -> dict:
    """One method's accuracy line from its runs (one per seed, the flow's results): the final held-out accuracy
    averaged over the seeds (what the gap compares), the initial one, each seed's, and the mean staleness (each run's
    mean over its iterations, averaged over the runs)."""
    return {
        "accuracy_mean": statistics.mean(r["eval_accuracy_final"] for r in runs),
        "accuracy_initial_mean": statistics.mean(r["eval_accuracy_initial"] for r in runs),
        "accuracies": [r["eval_accuracy_final"] for r in runs],
        "staleness_mean": statistics.mean(statistics.mean(x["staleness/mean"] for x in r["history"]) for r in runs),
    }


def accuracy_gap(loglinear: dict, recompute: dict) -> dict:
    """The gap between the two methods' seed-mean accuracies (`accuracy_figures`), whichever is higher, and its
    target."""
    gap = abs(loglinear["accuracy_mean"] - recompute["accuracy_mean"])
    return {"accuracy_gap": gap, "targets": {"accuracy_gap<=0.02": gap <= 0.02}}


def approximation_errors(histories: list[list[dict]]) -> dict:
    """Means over the iterations of metrics-mode runs of each approximation's figures against the recomputed
    proximal policy: `abs_err` (mean |log pi_prox error| per token), `gap_ratio` (that error over the distance from
    pi_b to pi_prox), `grad_rel_err` (mean |gradient coefficient error| over mean |gradient coefficient|), and of
    the tokens with a nonzero advantage whose gradient the trust region zeroes: `zeroed` (fraction of tokens, the
    approximation), `recall` (the share of the recomputed policy's zeroed tokens it zeroes too) and `precision`
    (the share of its own zeroed tokens the recomputed policy zeroes too). `no_clip` is the baseline without a trust
    region (pi_prox = pi_theta): its `grad_rel_err` is what an approximation's clip has to improve on."""
    h = [x for history in histories for x in history]
    # an iteration that trained no token (every group skipped for zero advantage) has no token figures
    mean = lambda key: statistics.mean(x[key] for x in h if key in x)  # noqa: E731
    ratio = lambda a, b: a / b if b > 0 else None  # noqa: E731  (JSON null: undefined, e.g. no_clip precision)
    out = {
        "staleness_mean": mean("staleness/mean"),
        "clip_fraction": mean("clip/fraction"),
        "reference_zeroed": mean("prox/loglinear/reference_zeroed_fraction"),
    }
    for approx in ("loglinear", "linear", "no_clip"):
        p = f"prox/{approx}/"
        shared, zeroed = mean(p + "zeroed_shared_fraction"), mean(p + "zeroed_fraction")
        out[approx] = {
            "grad_rel_err": ratio(mean(p + "grad_abs_err"), mean(p + "grad_abs")),
            "zeroed": zeroed,
            "recall": ratio(shared, out["reference_zeroed"]),
            "precision": ratio(shared, zeroed),
        }
        if approx != "no_clip":
            out[approx] |= {"abs_err": mean(p + "abs_err"), "gap_ratio": mean(p + "gap_ratio")}
    return out


def timing(tmp: str, stamp: str, total: int, args) -> None:
    """Per staleness bound: two async runs per method in ABBA order (loglinear, recompute, recompute, loglinear: the
    machine's speed drifts over minutes); the train-step figures side by side on their recorded batches
    (`replayed_train_steps`), the in-flow ones (`*_in_flow`) and the iteration times as medians over the measured
    iterations of both runs of a method; then async vs periodic samples/s."""
    async_sps = {}
    for S in (2, 8):
        measured: dict[str, list[dict]] = {prox: [] for prox in METHODS}
        run_ids = []
        for i, prox in enumerate(abba(*METHODS, 2)):
            run_ids.append(f"a3po-s{S}-{prox}-{i}-{stamp}")
            measured[prox] += run(
                tmp,
                run_ids[-1],
                {"pipeline.mode": "async", "pipeline.max_staleness": S, "algorithm.prox_logp": prox},
                total,
            )[args.warmup :]
        med = {
            prox: {
                key: statistics.median(x[key] for x in h if key in x)  # is_weight/mean: only where tokens trained
                for key in (
                    "time/prox_s",
                    "time/train_busy_s",
                    "time/iteration_s",
                    "staleness/mean",
                    "staleness/max",
                    "perf/samples_per_s",
                    "is_weight/mean",
                )
            }
            for prox, h in measured.items()
        }
        async_sps[S] = med["loglinear"]["perf/samples_per_s"]
        side = replayed_train_steps(f"{tmp}/lake", run_ids, args.warmup)
        speedup = side["train_step_speedup"]
        emit(
            benchmark="a3po",
            max_staleness=S,
            iterations_measured=2 * args.iterations,
            prox_s_loglinear=side["prox_s_loglinear"],
            prox_s_recompute=side["prox_s_recompute"],
            train_step_s_loglinear=side["train_step_s_loglinear"],
            train_step_s_recompute=side["train_step_s_recompute"],
            train_step_speedup=speedup,
            batches_side_by_side=side["batches"],
            train_step_speedup_quartiles=[side["speedup_q1"], side["speedup_q3"]],
            train_step_speedup_in_flow=med["recompute"]["time/train_busy_s"] / med["loglinear"]["time/train_busy_s"],
            train_step_s_in_flow_loglinear=med["loglinear"]["time/train_busy_s"],
            train_step_s_in_flow_recompute=med["recompute"]["time/train_busy_s"],
            prox_s_in_flow_loglinear=med["loglinear"]["time/prox_s"],
            prox_s_in_flow_recompute=med["recompute"]["time/prox_s"],
            iteration_speedup=med["recompute"]["time/iteration_s"] / med["loglinear"]["time/iteration_s"],
            staleness_mean=med["loglinear"]["staleness/mean"],
            staleness_max=med["loglinear"]["staleness/max"],
            is_weight_mean=med["loglinear"]["is_weight/mean"],
            targets={"train_step_speedup>=1.25": speedup >= 1.25},
        )
    per = summarise("periodic", run(tmp, f"a3po-periodic-{stamp}", {"pipeline.mode": "periodic"}, total), args.warmup)
    emit(
        benchmark="a3po",
        periodic_samples_per_s=per["samples_per_s"],
        async_samples_per_s_s2=async_sps[2],
        async_samples_per_s_s8=async_sps[8],
        async_over_periodic_s8=async_sps[8] / per["samples_per_s"],
    )


def replayed_train_steps(lake_uri: str, run_ids: list[str], warmup: int) -> dict:
    """Train-step time of both methods on the same recorded async batches, back to back, nothing else running.

    For each iteration after `warmup` of each run at trainer version >= 2 (before that no token is two versions
    behind, so recompute runs no pass): the weights the trainer had then (checkpoint v) go into each
    method's trainer, and into recompute's proximal copy those of v - 1; then each method trains the batch as the
    train task did (its shards in the consumed order: micro-steps and optimizer step, the train task's busy time),
    timed, twice each in ABBA order (which method goes first alternates by batch). The speedup is the median over
    batches of recompute / loglinear on the same batch (the sum of its two timings over the other's): in the flow each
    method's train step is timed in its own runs, minutes apart, beside a rollout worker on the other core, and this
    machine's speed moves run-level medians by 10-30% within minutes."""
    from flows.replay import recorded_batch, train_recorded_batch
    from storage import checkpoints, ledger
    from storage.lake import Lake

    lake = Lake(lake_uri)

    def method(prox: str):
        return lambda cfg: setattr(cfg.algorithm, "prox_logp", prox)

    trainers = side_by_side_trainers(lake, run_ids[0], {prox: method(prox) for prox in METHODS})
    batches = [
        (run_id, record)
        for run_id in run_ids
        for record in ledger.read_all(lake, run_id)[warmup:]
        if record["state"] == "promoted" and record["policy_version"] >= 2
    ]
    if not batches:
        raise ValueError(f"no promoted iteration at version >= 2 after {warmup} warm-up ones in {run_ids}")
    times: dict[str, list[float]] = {prox: [] for prox in METHODS}
    prox_s: dict[str, list[float]] = {prox: [] for prox in METHODS}
    ratios = []
    for n, (run_id, record) in enumerate([batches[0], *batches]):  # the first batch once more, untimed: warm-up
        v = record["policy_version"]
        batch = recorded_batch(lake, record)
        weights = checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, v))
        previous = checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, v - 1))
        took: dict[str, list[float]] = {prox: [] for prox in METHODS}
        took_prox: dict[str, list[float]] = {prox: [] for prox in METHODS}
        # ABBA, the first method alternating by batch: drift within the batch's few seconds cancels too
        for prox in abba(*(METHODS if n % 2 == 0 else reversed(METHODS)), 2):
            cfg, trainer = trainers[prox]
            # restore_trainer would also load optimizer moments, which old versions no longer keep; timing needs none
            checkpoints.load_into(trainer.model, weights)
            if trainer.prox_model is not None:
                checkpoints.load_into(trainer.prox_model, previous)
                trainer.prox_version = v - 1
            t0 = time.perf_counter()
            figures = train_recorded_batch(trainer, cfg, record, batch)
            took[prox].append(time.perf_counter() - t0)
            took_prox[prox].append(figures["time/prox_s"])
        if n == 0:
            continue
        for prox in METHODS:
            times[prox] += took[prox]
            prox_s[prox] += took_prox[prox]
        ratios.append(sum(took["recompute"]) / sum(took["loglinear"]))
    return speedup_figures(ratios, times, prox_s)


def speedup_figures(ratios: list[float], times: dict[str, list[float]], prox_s: dict[str, list[float]]) -> dict:
    """The side-by-side figures: the median over batches of the per-batch recompute / loglinear ratio with its
    quartiles (one batch: the ratio itself), and each method's median train-step and proximal time over its timings."""
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "train_step_speedup": statistics.median(ratios),
        "batches": len(ratios),
        "speedup_q1": q1,
        "speedup_q3": q3,
        **{f"train_step_s_{prox}": statistics.median(times[prox]) for prox in METHODS},
        **{f"prox_s_{prox}": statistics.median(prox_s[prox]) for prox in METHODS},
    }


if __name__ == "__main__":
    main()
