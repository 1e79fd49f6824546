"""Scoring beside generation (`pipeline.overlap_scoring`) vs in turn, through the real flow.

The demo config (periodic mode, one rollout worker, tracking and evaluation off) runs with each form in ABBA order,
`--repeats` runs each, with the reward `--judge`:
- `remote` (default): a user's file whose function waits `--latency-ms` per response, as a judge called over the
  network does (the worker's process waits, its cores free), then gives the built-in arithmetic reward;
- `model`: the reward model of `benchmarks.rewards` (the demo's architecture, untrained, loaded from an HF
  directory by the user's file) scoring each shard in one batched call, on the worker's cores;
- `builtin`: the built-in arithmetic reward (microseconds a response): what overlapping costs where it gains nothing.
Prints one JSON line per form with medians over the measured iterations (after `--warmup` per run) of
`iteration_s`, `rollout_busy_s` (the worker's busy time, the time both a generation and a scoring ran counted once),
`reward_s` (scoring time) and `samples_per_s`, then a line with `speedup` (iteration time in turn over beside) and
`max_abs_diff` between every run's final parameters and the first's (the same shards in the same order: 0.0
expected).

    .venv/bin/python -m benchmarks.scoring [--judge remote|model|builtin] [--latency-ms 5] [--iterations 4]
        [--warmup 1] [--repeats 2] [--dir DIR]
"""

from __future__ import annotations

import statistics
import textwrap
import time
from pathlib import Path

from benchmarks.common import MAX_ITERATIONS, abba, check_dir, check_range, emit, parser, work_dir

REMOTE_FILE = textwrap.dedent(
    """
    # a judge behind a network call: the worker waits for its answer
    import time

    from models import arithmetic


    def judge(response, answer):
        time.sleep({latency_s!r})
        return arithmetic.reward(response, answer, 0.0)
    """
)


def judge_overrides(judge: str, latency_ms: float, tmp: str) -> dict:
    """The config overrides that make `judge` the run's reward (writing its file, and the model's, under `tmp`)."""
    if judge == "builtin":
        return {}
    if judge == "remote":
        path = Path(tmp) / "remote_judge.py"
        path.write_text(REMOTE_FILE.format(latency_s=latency_ms / 1000))
        return {"task.reward": f"{path}:judge"}
    from benchmarks.rewards import write_reward_model
    from configs.schema import Config
    from models.tiny import build_char_tokenizer

    path = write_reward_model(tmp, build_char_tokenizer(), Config().model.tiny.model_dump(), "cpu")
    return {"task.reward": f"{path}:score_batch", "task.reward_batch": True}


def final_weights(tmp: str, run_id: str, version: int) -> dict:
    from storage import checkpoints
    from storage.lake import Lake

    lake = Lake(f"{tmp}/lake")
    return checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, version))


def main() -> None:
    ap = parser("benchmarks.scoring", __doc__)
    ap.add_argument("--judge", choices=("remote", "model", "builtin"), default="remote", help="the reward (see above)")
    ap.add_argument("--latency-ms", type=float, default=5.0, help="remote: the wait per response (default 5 ms)")
    ap.add_argument("--iterations", type=int, default=4, help="measured iterations per run, after the warm-up ones")
    ap.add_argument("--warmup", type=int, default=1, help="iterations run first and left out of the figures")
    ap.add_argument("--repeats", type=int, default=2, help="runs per form (ABBA order)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    if not 0 <= args.latency_ms <= 10_000:
        ap.error(f"--latency-ms {args.latency_ms}: must be in [0, 10000]")
    check_range(ap, "--warmup", args.warmup, 0, MAX_ITERATIONS - 1)
    check_range(ap, "--iterations", args.iterations, 1, MAX_ITERATIONS - args.warmup)
    check_range(ap, "--repeats", args.repeats, 1, 100)
    check_dir(ap, args.dir)
    from benchmarks.pipeline import run

    total = args.iterations + args.warmup
    stamp = time.strftime("%Y%m%d%H%M%S")  # run ids stay unique in a reused directory
    with work_dir(args.dir) as tmp:
        judge = judge_overrides(args.judge, args.latency_ms, tmp)
        measured: dict[str, list[dict]] = {"in_turn": [], "beside": []}
        weights: list[dict] = []  # every run's final parameters
        for i, form in enumerate(abba("in_turn", "beside", args.repeats)):
            run_id = f"scoring-{form}-{i}-{stamp}"
            overrides = {**judge, "pipeline.overlap_scoring": form == "beside"}
            measured[form] += run(tmp, run_id, overrides, total)[args.warmup :]
            weights.append(final_weights(tmp, run_id, total))
        figures = {}
        for form, history in measured.items():
            figures[form] = {
                name: statistics.median(x[key] for x in history)
                for name, key in (
                    ("iteration_s", "time/iteration_s"),
                    ("rollout_busy_s", "time/rollout_busy_s"),
                    ("reward_s", "time/reward_s"),
                    ("samples_per_s", "perf/samples_per_s"),
                )
            }
            emit(
                benchmark="scoring",
                form=form,
                overlap_scoring=form == "beside",
                judge=args.judge,
                **({"latency_ms": args.latency_ms} if args.judge == "remote" else {}),
                iterations_measured=len(history),
                **figures[form],
            )
        diff = max((w[k] - weights[0][k]).abs().max().item() for w in weights[1:] for k in weights[0])
        emit(
            benchmark="scoring",
            judge=args.judge,
            speedup=figures["in_turn"]["iteration_s"] / figures["beside"]["iteration_s"],
            rollout_busy_ratio=figures["in_turn"]["rollout_busy_s"] / figures["beside"]["rollout_busy_s"],
            max_abs_diff=diff,
        )


if __name__ == "__main__":
    main()
