"""Resume overhead: how long `lockstep resume` takes to get back to work after a SIGKILL, against the
iteration time of the same run.

Runs the demo config for a few iterations in a subprocess, SIGKILLs it mid-rollout of iteration 2 (failpoint
`after-plan@3`), then times `lockstep resume` until the run finishes. Prints one JSON line with
`iteration_s` (median of the uninterrupted iterations), `resume_s` (wall time of the resume command),
`resume_setup_s` = resume_s - (iterations left x iteration_s), and their ratio.

    .venv/bin/python -m benchmarks.resume [--iterations 6]
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import MAX_ITERATIONS, check_range, emit, parser

REPO = Path(__file__).resolve().parents[1]
KILLED_AT = 2  # the iteration whose rollouts the failpoint below interrupts (its third plan)


def _cli(args, env):
    p = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        return p.wait()
    finally:
        # The group is in its own session, so nothing else ends it: after a SIGKILL, the run's Prefect API server;
        # if this process is interrupted, the whole run.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: the child's group and the temp dir go too


def main() -> None:
    ap = parser("benchmarks.resume", __doc__)
    ap.add_argument(
        "--iterations",
        type=int,
        default=6,
        help=f"iterations of the run (the kill comes in iteration {KILLED_AT}; more give a steadier iteration_s)",
    )
    args = ap.parse_args()
    check_range(ap, "--iterations", args.iterations, KILLED_AT + 1, MAX_ITERATIONS)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = yaml.safe_load((REPO / "configs" / "arith-tiny.yaml").read_text())
        cfg["run"].update({"run_id": "resume-bench", "iterations": args.iterations})
        cfg["lake"]["uri"] = f"{tmp}/lake"
        cfg["tracking"] = {"uri": f"sqlite:///{tmp}/mlflow.db"}
        cfg["eval"] = {"every": 0}
        path = Path(tmp, "c.yaml")
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(REPO), "LOCKSTEP_FAULT": f"after-plan@{KILLED_AT + 1}"}
        code = _cli(["train", str(path)], env)
        if code != -signal.SIGKILL:
            raise RuntimeError(f"the training run exited with {code} instead of being SIGKILLed by its failpoint")
        env.pop("LOCKSTEP_FAULT")
        t0 = time.perf_counter()
        code = _cli(["resume", "resume-bench", "--lake", f"{tmp}/lake"], env)
        if code != 0:
            raise RuntimeError(f"`lockstep resume` exited with {code}")
        resume_s = time.perf_counter() - t0
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name(cfg["run"]["name"]).experiment_id])
        iteration_s = statistics.median(m.value for m in client.get_metric_history(run.info.run_id, "time/iteration_s"))
        emit(benchmark="resume", **resume_figures(resume_s, iteration_s, args.iterations - KILLED_AT))


def resume_figures(resume_s: float, iteration_s: float, left: int) -> dict:
    """What the resume cost beyond the `left` iterations it still had to run: its wall time less that many
    uninterrupted iterations, and that setup time in iterations."""
    setup = resume_s - left * iteration_s
    return {
        "iteration_s": iteration_s,
        "resume_s": resume_s,
        "iterations_after_resume": left,
        "resume_setup_s": setup,
        "resume_setup_over_iteration": setup / iteration_s,
    }


if __name__ == "__main__":
    main()
