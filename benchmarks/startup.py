"""Start-up of `lockstep train`: wall seconds from launching the command to its first output line, to the run being
ready (its line `run R: initial held-out accuracy ...`: Prefect's API server up, the flow run created, the MLflow
run open, v0 loaded and evaluated, the rollout workers starting) and to its end; and the first two iterations' own
seconds from their progress lines (`first_iteration_s` waits for the workers to start; `second_iteration_s` is where
one-off work beside training showed: LanceDB's import by the first audit, until 2026-12-05).

Runs the demo config (`configs/arith-tiny.yaml`) for `--iterations` iterations in a temporary lake whose bootstrap
is built once by a first run that is not measured, so every measured run starts as a second run of the demo does.
With `--against DIR` (another checkout of lockstep, e.g. `git worktree add DIR COMMIT` with its `.venv` linked) the
same runs are made from both checkouts in ABBA order, side by side in one lake.

Prints one JSON line per checkout (`tree`: this one or DIR) with the medians over `--repeats` runs of `first_line_s`,
`ready_s`, `end_s`, `first_iteration_s` and `second_iteration_s`, then, with `--against`, one JSON line of the
ratios DIR / this.

With `--replay` it times `lockstep replay` of the first (unmeasured) run instead: `replay_refused_s`, a replay onto
the run itself, refused with exit 2 (the checks a mistyped command waits for), and `replay_s`, the whole replay.

    .venv/bin/python -m benchmarks.startup [--repeats 5] [--iterations 3] [--against DIR] [--replay]
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import abba, check_checkout, check_range, emit, parser

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("first_line_s", "ready_s", "end_s", "first_iteration_s", "second_iteration_s")
REPLAY_FIGURES = ("replay_refused_s", "replay_s")
_PROGRESS = re.compile(r"iteration (\d+)/\d+ .* ([0-9.]+) s/it")  # the CLI's progress line, as written to a pipe


def iteration_seconds(line: str) -> tuple[int, float] | None:
    """(k, the seconds iteration k took; k from 1 as the line counts) from a progress line; None for other lines."""
    m = _PROGRESS.match(line)
    return (int(m.group(1)), float(m.group(2))) if m else None


def _command_env(tree: Path) -> dict:
    """The environment of a `lockstep` command run from checkout `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PREFECT_API_URL", None)  # each command starts its own temporary server, as a user's does
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # rich would draw its live bar and print no progress lines
        env.pop(name, None)
    return env


def timed_train(tree: Path, config: str, run_id: str) -> dict:
    """Run `lockstep train config -o run.run_id=run_id` from checkout `tree` in its own process group; the seconds from
    its launch to its first line, to its `run R: initial held-out accuracy` line and to its exit, and the seconds of
    its first two iterations."""
    env = _command_env(tree)
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", config, "-o", f"run.run_id={run_id}"],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    first = ready = None
    iterations: dict[int, float] = {}
    tail: collections.deque[str] = collections.deque(maxlen=21)  # for the error message
    try:
        for line in p.stderr:
            now = time.perf_counter() - t0
            first = now if first is None else first
            if ready is None and line.startswith(f"run {run_id}: "):
                ready = now
            if (progress := iteration_seconds(line)) is not None:
                iterations.setdefault(*progress)
            tail.append(line)
        code = p.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):  # what the command left in its group, or all of it if we stop
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    end = time.perf_counter() - t0
    if code != 0 or ready is None or not {1, 2} <= set(iterations):
        what = f"exited with {code}" if code != 0 else "printed no progress line for iteration 1 or 2"
        raise RuntimeError(f"`lockstep train` from {tree} {what}:\n{''.join(tail)}")
    return {
        "first_line_s": first,
        "ready_s": ready,
        "end_s": end,
        "first_iteration_s": iterations[1],
        "second_iteration_s": iterations[2],
    }


def timed_replay(tree: Path, lake: str, run_id: str) -> dict:
    """From checkout `tree`, the wall seconds of `lockstep replay run_id --to run_id` (refused: exit 2) and of
    `lockstep replay run_id` (exit 0)."""
    env = _command_env(tree)
    out = {}
    for name, extra, expected in (("replay_refused_s", ["--to", run_id], 2), ("replay_s", [], 0)):
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "flows.cli", "replay", run_id, "--lake", lake, *extra],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            start_new_session=True,
        )
        out[name] = time.perf_counter() - t0
        if p.returncode != expected:
            raise RuntimeError(f"`lockstep replay` from {tree} exited with {p.returncode}:\n{p.stderr[-3000:]}")
    return out


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: the child's group and the temp dir go too


def main() -> None:
    ap = parser("benchmarks.startup", __doc__)
    ap.add_argument("--repeats", type=int, default=5, help="measured runs per checkout")
    ap.add_argument("--iterations", type=int, default=3, help="iterations of each run")
    ap.add_argument("--against", help="another checkout of lockstep to run the same way, side by side")
    ap.add_argument("--replay", action="store_true", help="time `lockstep replay` of a run instead of `train`")
    args = ap.parse_args()
    check_range(ap, "--repeats", args.repeats, 1, 100)
    # the second iteration is one of the figures, and up to 39 iterations every one prints its line (flows.cli._line_due)
    check_range(ap, "--iterations", args.iterations, 2, 39)
    trees = {"this": REPO}
    if args.against is not None:
        other = check_checkout(ap, args.against, "flows/cli.py")
        trees[str(other)] = other
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = yaml.safe_load((REPO / "configs" / "arith-tiny.yaml").read_text())
        cfg["run"]["iterations"] = args.iterations
        cfg["lake"]["uri"] = f"{tmp}/lake"
        cfg["tracking"] = {"uri": f"sqlite:///{tmp}/mlflow.db"}
        config = Path(tmp, "c.yaml")
        config.write_text(yaml.safe_dump(cfg))
        for k, tree in enumerate(trees.values()):  # builds the lake's bootstrap (each checkout's, if they differ)
            timed_train(tree, str(config), f"warmup-{k}")
        order = abba(*trees, args.repeats) if len(trees) == 2 else ["this"] * args.repeats
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for i, name in enumerate(order):
            if args.replay:
                runs[name].append(timed_replay(trees[name], f"{tmp}/lake", "warmup-0"))
            else:
                runs[name].append(timed_train(trees[name], str(config), f"startup-{i}"))
            print(f"{i + 1}/{len(order)} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    figures = REPLAY_FIGURES if args.replay else FIGURES
    for line in startup_figures(runs, figures):
        emit(benchmark="startup", repeats=args.repeats, iterations=args.iterations, replay=args.replay, **line)


def startup_figures(runs: dict[str, list[dict]], figures: tuple[str, ...] = FIGURES) -> list[dict]:
    """Per checkout (`tree`), the median of each figure over its runs; with two checkouts, then the ratios of the
    medians, the other one's over this one's (a ratio above 1: this checkout starts faster)."""
    medians = {name: {f: statistics.median(r[f] for r in rs) for f in figures} for name, rs in runs.items()}
    lines = [{"tree": name, **m} for name, m in medians.items()]
    if len(runs) == 2:
        other = next(n for n in runs if n != "this")
        lines.append({"ratio": f"{other} / this", **{f: medians[other][f] / medians["this"][f] for f in figures}})
    return lines


if __name__ == "__main__":
    main()
