"""Skipping the groups whose rewards are all equal (`train.skip_zero_advantage`) against running them: train-step time.

Such a group has zero advantage, so without a KL term its gradient is exactly 0: the trainer counts its tokens in the
loss normaliser and skips its forward and backward passes. What that saves depends on how many groups have all-equal
rewards, which depends on the reward: the demo's (`task.partial_credit: 0.5`, credit per correct digit) and
exact-match only (`0.0`, the usual 0/1 reward of math RL, where a group the model gets all right or all wrong has
nothing to learn from).

Per reward recipe: one run of the demo config (periodic, the real flow; tracking and evaluation off, as
`benchmarks.pipeline` runs it) records `--iterations` batches (32 groups of 8). Then every batch after `--warmup` is
trained by two trainers built side by side in this process, one skipping and one running every group, each loaded
with the weights the run had then (checkpoint v) and fresh AdamW moments, twice each in ABBA order (which goes first
alternates by batch), nothing else running, on the train task's thread count (`resources.train_threads`); each
train step as the train task ran it (its shards in the consumed order, micro-steps and optimizer step).

With `--flatten F ...`, each recipe's batches are measured again with the rewards of some groups made all equal
(their first reward for every sample; groups spread evenly over the batch), so that a share F of each batch's groups
has zero advantage: the same prompts, responses and compute per group, only the share of groups with nothing to
learn from changed (how large it is in a run depends on the task, the reward and the model's accuracy on it).

One JSON line per recipe (and share F): `partial_credit`, `flatten` (F, or null), `zero_group_fraction` (the measured
batches' groups with all rewards equal),
`train_step_s_skip` / `train_step_s_all` (medians over the timings), `train_step_speedup` (the median over batches of
all / skip on the same batch; `speedup_q1` / `speedup_q3` its quartiles) and `max_abs_param_diff` (the largest weight
difference between the two trainers after a batch's step, over the batches: equal up to the order of additions).

    PYTHONPATH=. .venv/bin/python -m benchmarks.zero_advantage [--iterations 16] [--warmup 2]
        [--partial-credit 0.5 0.0] [--flatten 0.25 0.5] [--dir DIR]
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

NAMES = ("skip", "all")


def flattened(batch: list[list], share: float) -> list[list]:
    """`batch` (its shards' groups) with the rewards of evenly spread groups made all equal, so that
    round(share x groups) of them have zero advantage (or as many as already do, if more)."""
    import dataclasses

    groups = [g for shard in batch for g in shard]
    signal = [i for i, g in enumerate(groups) if len(set(g.rewards)) > 1]
    k = min(len(signal), max(0, round(share * len(groups)) - (len(groups) - len(signal))))
    chosen = {signal[j * len(signal) // k] for j in range(k)} if k else set()
    out, i = [], 0
    for shard in batch:
        out.append([])
        for g in shard:
            out[-1].append(dataclasses.replace(g, rewards=[g.rewards[0]] * len(g.rewards)) if i in chosen else g)
            i += 1
    return out


def measure(lake_uri: str, run_id: str, warmup: int, flatten: float | None = None) -> dict:
    """The side-by-side figures of one run's batches after `warmup`, with `flatten` (see the module's docstring)."""
    from flows.replay import recorded_batch, train_recorded_batch
    from storage import checkpoints, ledger
    from storage.lake import Lake

    lake = Lake(lake_uri)

    def skipping(skip: bool):
        return lambda cfg: setattr(cfg.train, "skip_zero_advantage", skip)

    trainers = side_by_side_trainers(lake, run_id, {name: skipping(name == "skip") for name in NAMES})
    records = [r for r in ledger.read_all(lake, run_id)[warmup:] if r["state"] == "promoted"]
    if not records:
        raise ValueError(f"run {run_id} has no promoted iteration after {warmup} warm-up ones")
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    ratios, diffs = [], []
    zero = groups = 0
    for n, record in enumerate([records[0], *records]):  # the first batch once more, untimed: warm-up
        batch = recorded_batch(lake, record)
        if flatten is not None:
            batch = flattened(batch, flatten)
        weights = checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, record["policy_version"]))
        took: dict[str, list[float]] = {name: [] for name in NAMES}
        after: dict[str, list] = {}
        for name in abba(*(NAMES if n % 2 == 0 else reversed(NAMES)), 2):
            cfg, trainer = trainers[name]
            checkpoints.load_into(trainer.model, weights)
            trainer.optimizer.state.clear()  # fresh moments: both trainers take the same step from the same state
            t0 = time.perf_counter()
            figures = train_recorded_batch(trainer, cfg, record, batch)
            took[name].append(time.perf_counter() - t0)
            after.setdefault(name, [p.detach().clone() for p in trainer.model.parameters()])
        if n == 0:
            continue
        for name in NAMES:
            times[name] += took[name]
        ratios.append(sum(took["all"]) / sum(took["skip"]))
        diffs.append(max(float((a - b).abs().max()) for a, b in zip(after["skip"], after["all"], strict=True)))
        zero += int(figures["adv/zero_groups"])
        groups += sum(len(shard) for shard in batch)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "batches": len(ratios),
        "zero_group_fraction": zero / groups,
        "train_step_s_skip": statistics.median(times["skip"]),
        "train_step_s_all": statistics.median(times["all"]),
        "train_step_speedup": statistics.median(ratios),
        "speedup_q1": q1,
        "speedup_q3": q3,
        "max_abs_param_diff": max(diffs),
    }


def main(argv: list[str] | None = None) -> None:
    ap = parser("benchmarks.zero_advantage", __doc__)
    ap.add_argument("--iterations", type=int, default=16, help="iterations of each recipe's run (default 16)")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations not measured (default 2)")
    ap.add_argument(
        "--partial-credit", type=float, nargs="+", default=[0.5, 0.0], help="reward recipes (default 0.5 0.0)"
    )
    ap.add_argument(
        "--flatten",
        type=float,
        nargs="*",
        default=[0.25, 0.5],
        help="shares of zero-advantage groups to measure too (default 0.25 0.5; none: --flatten alone)",
    )
    ap.add_argument("--dir", default=None, help="work directory (reusing one reuses its bootstrap)")
    args = ap.parse_args(argv)
    check_range(ap, "--iterations", args.iterations, 1, MAX_ITERATIONS)
    check_range(ap, "--warmup", args.warmup, 0, args.iterations - 1)
    for credit in args.partial_credit:
        if not 0.0 <= credit < 1.0:
            ap.error(f"--partial-credit {credit}: must be in [0, 1)")
    check_unique(ap, "--partial-credit", args.partial_credit)
    for share in args.flatten:
        if not 0.0 < share < 1.0:
            ap.error(f"--flatten {share}: must be in (0, 1)")
    check_unique(ap, "--flatten", args.flatten)
    check_dir(ap, args.dir)

    from benchmarks.pipeline import run

    with work_dir(args.dir) as tmp:
        for credit in args.partial_credit:
            run_id = f"zero-adv-credit-{credit:g}-{time.strftime('%Y%m%d-%H%M%S')}"
            run(tmp, run_id, {"task.partial_credit": credit}, args.iterations)
            for share in [None, *args.flatten]:
                emit(partial_credit=credit, flatten=share, **measure(f"{tmp}/lake", run_id, args.warmup, share))


if __name__ == "__main__":
    main()
