"""Periodic asynchrony vs synchronous training on the same machine, through the real flow.

One JSON line per configuration with `mode`, `iteration_s` (median over the measured iterations, after
warm-up ones), `rollout_busy_s`, `train_busy_s`, `first_shard_s`, `sync_s`, `overhead_fraction`, `samples_per_s`;
then a line with `periodic_over_sync` and `periodic_over_bound`, the bound being
max(rollout busy, train busy) + first-shard latency + sync time (what perfect overlap could reach);
then samples/s with 1 and 2 rollout workers at the same total thread count.

Both modes get the whole machine: sync runs its phases one after the other, so each phase gets every core
(`rollout_threads = train_threads = cores`); periodic runs them at once, so the cores are split between them.
The two modes run `--repeats` times each in ABBA order (sync, periodic, periodic, sync, ...) and each figure is
the median over the measured iterations of all repeats: this machine's speed drifts by tens of percent over
minutes, which a single sync-then-periodic pair would read as a difference between the modes.

    .venv/bin/python -m benchmarks.pipeline [--iterations 8] [--warmup 2] [--repeats 2] [--dir DIR] [--skip-extras]
"""

from __future__ import annotations

import os
import statistics
import time

import yaml

from benchmarks.common import MAX_ITERATIONS, abba, check_dir, check_range, emit, parser, work_dir


def run(tmp: str, name: str, overrides: dict, iterations: int, full: bool = False) -> list[dict] | dict:
    """The demo config (+ overrides) through the real flow, tracking and evaluation off; its per-iteration figures
    (or, with `full`, the flow's whole result: summary and history)."""
    from flows.train import train_flow

    cfg = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "arith-tiny.yaml")))
    cfg["run"].update({"run_id": name, "iterations": iterations})
    cfg["lake"]["uri"] = f"{tmp}/lake"
    cfg["tracking"] = {"enabled": False}
    cfg["eval"] = {"every": 0}
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        cfg.setdefault(section, {})[key] = value
    path = f"{tmp}/{name}.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    out = train_flow(config_path=path)
    return out if full else out["history"]


def summarise(mode: str, history: list[dict], warmup: int, **extra) -> dict:
    """Medians over the measured iterations of `history` (a run's, or several runs' concatenated per-run slices
    when `warmup` is 0)."""
    h = history[warmup:]
    med = lambda key: statistics.median(x[key] for x in h)  # noqa: E731
    return {
        "mode": mode,
        "iterations_measured": len(h),
        "iteration_s": med("time/iteration_s"),
        "rollout_busy_s": med("time/rollout_busy_s"),
        "train_busy_s": med("time/train_busy_s"),
        "first_shard_s": med("time/first_shard_s"),
        "sync_s": med("time/sync_s"),
        "overhead_fraction": med("perf/overhead_fraction"),
        "overlap_fraction": med("perf/overlap_fraction"),
        "samples_per_s": med("perf/samples_per_s"),
        **extra,
    }


def comparison(sync: dict, per: dict) -> dict:
    """The final line from the two modes' `summarise` figures: periodic over sync, and periodic over the bound
    max(rollout busy, train busy) + first-shard latency + sync time (perfect overlap of periodic's own phases),
    with the issue's targets."""
    bound = max(per["rollout_busy_s"], per["train_busy_s"]) + per["first_shard_s"] + per["sync_s"]
    over_sync, over_bound = per["iteration_s"] / sync["iteration_s"], per["iteration_s"] / bound
    return {
        "periodic_over_sync": over_sync,
        "periodic_over_bound": over_bound,
        "bound_s": bound,
        "targets": {
            "periodic_over_sync<=0.7": over_sync <= 0.7,
            "periodic_over_bound<=1.15": over_bound <= 1.15,
            "overhead_fraction<=0.05": per["overhead_fraction"] <= 0.05,
        },
    }


def main() -> None:
    ap = parser("benchmarks.pipeline", __doc__)
    ap.add_argument("--iterations", type=int, default=8, help="measured iterations per run, after the warm-up ones")
    ap.add_argument("--warmup", type=int, default=2, help="iterations run first and left out of the figures")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (ABBA order)")
    ap.add_argument(
        "--dir", default=None, help="work directory (default: a temporary one); reusing one reuses the cached bootstrap"
    )
    ap.add_argument(
        "--skip-extras", action="store_true", help="only sync vs periodic: no shared-prompt on/off, no 1 vs 2 workers"
    )
    args = ap.parse_args()
    check_range(ap, "--warmup", args.warmup, 0, MAX_ITERATIONS - 1)
    check_range(ap, "--iterations", args.iterations, 1, MAX_ITERATIONS - args.warmup)  # a run is both
    check_range(ap, "--repeats", args.repeats, 1)
    check_dir(ap, args.dir)
    cores = os.cpu_count() or 2
    total = args.iterations + args.warmup
    stamp = time.strftime("%Y%m%d%H%M%S")  # run ids stay unique in a reused directory
    half = max(1, cores // 2)
    modes = {
        "sync": {"pipeline.mode": "sync", "resources.rollout_threads": cores, "resources.train_threads": cores},
        "periodic": {
            "pipeline.mode": "periodic",
            "resources.rollout_threads": half,
            "resources.train_threads": cores - half,
        },
    }
    order = abba("sync", "periodic", args.repeats)
    with work_dir(args.dir) as tmp:
        measured: dict[str, list[dict]] = {"sync": [], "periodic": []}
        for i, mode in enumerate(order):
            measured[mode] += run(tmp, f"bench-{mode}-{i}-{stamp}", modes[mode], total)[args.warmup :]
        sync = summarise("sync", measured["sync"], 0, rollout_threads=cores, train_threads=cores, repeats=args.repeats)
        emit(benchmark="pipeline", **sync)
        per = summarise(
            "periodic", measured["periodic"], 0, rollout_threads=half, train_threads=cores - half, repeats=args.repeats
        )
        emit(benchmark="pipeline", **per)
        emit(benchmark="pipeline", **comparison(sync, per))
        if args.skip_extras:
            return
        # the demo's train step with and without shared-prompt packing (periodic, demo resources)
        for shared in (False, True):
            h = run(tmp, f"bench-shared-{shared}-{stamp}", {"train.shared_prompt": shared}, total)
            emit(
                benchmark="pipeline",
                **summarise(
                    "periodic",
                    h,
                    args.warmup,
                    shared_prompt=shared,
                    train_tokens_per_s=statistics.median(x["perf/train_tokens_per_s"] for x in h[args.warmup :]),
                ),
            )
        # 1 vs 2 rollout workers at the same total rollout thread count (sync mode isolates generation)
        for workers in (1, 2):
            h = run(
                tmp,
                f"bench-w{workers}-{stamp}",
                {
                    "pipeline.mode": "sync",
                    "resources.rollout_workers": workers,
                    "resources.rollout_threads": max(1, cores // workers),
                    "resources.train_threads": cores,
                },
                total,
            )
            emit(
                benchmark="pipeline",
                **summarise("sync", h, args.warmup, rollout_workers=workers, rollout_threads=max(1, cores // workers)),
            )


if __name__ == "__main__":
    main()
