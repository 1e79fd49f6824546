"""A-3PO vs recomputed proximal log-probs in async mode, on the demo model through the real flow.

Per staleness bound S in {2, 8}: one JSON line with `prox_s` for loglinear and for recompute (median seconds per
iteration spent producing the proximal log-probs), `train_step_speedup` = recompute / loglinear train-step time
(the train task's busy time: micro-steps + optimizer step) and `iteration_speedup` (iteration wall time), medians
over the measured iterations after warm-up ones of two runs per method in ABBA order; then async vs periodic samples/s on the same resources (the
demo's: 1 rollout worker with 1 thread, 1 training thread). Then, per accuracy staleness bound, one line per
method with `prox_logp` and `accuracy_mean`, the held-out accuracy after the same number of iterations averaged
over the seeds, and a line with their gap.

    .venv/bin/python -m benchmarks.a3po [--iterations 10] [--warmup 2] [--accuracy-iterations 120]
        [--accuracy-staleness 2 8] [--seeds 0 1 2] [--dir DIR] [--skip-timing]

`--accuracy-staleness` takes several bounds (one accuracy line per method and bound; none: no accuracy runs);
`--skip-timing` runs only the accuracy part (e.g. in a second process, since accuracy does not need a quiet
machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import emit, work_dir
from benchmarks.pipeline import run, summarise

METHODS = ("loglinear", "recompute")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accuracy-iterations", type=int, default=120)
    ap.add_argument("--accuracy-staleness", type=int, nargs="*", default=[2, 8])
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one); reusing one reuses the "
                    "cached bootstrap of each seed")
    args = ap.parse_args()
    total = args.iterations + args.warmup
    stamp = time.strftime("%Y%m%d%H%M%S")  # run ids stay unique in a reused directory
    with work_dir(args.dir) as tmp:
        if not args.skip_timing:
            timing(tmp, stamp, total, args)
        for S in args.accuracy_staleness:
            accuracy = {}
            for prox in METHODS:
                runs = [run(tmp, f"a3po-acc-s{S}-{prox}-{seed}-{stamp}", {"pipeline.mode": "async", "run.seed": seed,
                                                                   "pipeline.max_staleness": S,
                                                                   "algorithm.prox_logp": prox},
                            args.accuracy_iterations, full=True) for seed in args.seeds]
                accuracy[prox] = statistics.mean(r["eval_accuracy_final"] for r in runs)
                emit(benchmark="a3po", prox_logp=prox, max_staleness=S, iterations=args.accuracy_iterations,
                     seeds=args.seeds, accuracy_mean=accuracy[prox],
                     accuracy_initial_mean=statistics.mean(r["eval_accuracy_initial"] for r in runs),
                     accuracies=[r["eval_accuracy_final"] for r in runs],
                     staleness_mean=statistics.mean(statistics.mean(x["staleness/mean"] for x in r["history"])
                                                    for r in runs))
            gap = abs(accuracy["loglinear"] - accuracy["recompute"])
            emit(benchmark="a3po", max_staleness=S, accuracy_gap=gap, targets={"accuracy_gap<=0.02": gap <= 0.02})


def timing(tmp: str, stamp: str, total: int, args) -> None:
    """Per staleness bound: prox / train-step / iteration times of both methods, two runs each in ABBA order
    (loglinear, recompute, recompute, loglinear: the machine's speed drifts over minutes), medians over the measured
    iterations of both runs; then async vs periodic samples/s."""
    async_sps = {}
    for S in (2, 8):
        measured: dict[str, list[dict]] = {prox: [] for prox in METHODS}
        for i, prox in enumerate((*METHODS, *reversed(METHODS))):
            measured[prox] += run(tmp, f"a3po-s{S}-{prox}-{i}-{stamp}", {"pipeline.mode": "async",
                                                                        "pipeline.max_staleness": S,
                                                                        "algorithm.prox_logp": prox},
                                  total)[args.warmup:]
        med = {prox: {key: statistics.median(x[key] for x in h) for key in
                      ("time/prox_s", "time/train_busy_s", "time/iteration_s", "staleness/mean",
                       "staleness/max", "perf/samples_per_s", "is_weight/mean")} for prox, h in measured.items()}
        async_sps[S] = med["loglinear"]["perf/samples_per_s"]
        speedup = med["recompute"]["time/train_busy_s"] / med["loglinear"]["time/train_busy_s"]
        emit(benchmark="a3po", max_staleness=S, iterations_measured=2 * args.iterations,
             prox_s_loglinear=med["loglinear"]["time/prox_s"], prox_s_recompute=med["recompute"]["time/prox_s"],
             train_step_s_loglinear=med["loglinear"]["time/train_busy_s"],
             train_step_s_recompute=med["recompute"]["time/train_busy_s"],
             train_step_speedup=speedup,
             iteration_speedup=med["recompute"]["time/iteration_s"] / med["loglinear"]["time/iteration_s"],
             staleness_mean=med["loglinear"]["staleness/mean"], staleness_max=med["loglinear"]["staleness/max"],
             is_weight_mean=med["loglinear"]["is_weight/mean"],
             targets={"train_step_speedup>=1.25": speedup >= 1.25})
    per = summarise("periodic", run(tmp, f"a3po-periodic-{stamp}", {"pipeline.mode": "periodic"}, total), args.warmup)
    emit(benchmark="a3po", periodic_samples_per_s=per["samples_per_s"], async_samples_per_s_s2=async_sps[2],
         async_samples_per_s_s8=async_sps[8], async_over_periodic_s8=async_sps[8] / per["samples_per_s"])


if __name__ == "__main__":
    main()
