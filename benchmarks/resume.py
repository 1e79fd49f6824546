"""Resume overhead: how long `lockstep resume` takes to get back to work after a SIGKILL, against the
iteration time of the same run.

Runs the demo config for a few iterations in a subprocess, SIGKILLs it mid-rollout of iteration 2 (failpoint
`after-plan@3`), then times `lockstep resume` until the run finishes. Prints one JSON line with
`iteration_s` (median of the uninterrupted iterations), `resume_s` (wall time of the resume command),
`resume_setup_s` = resume_s - (iterations left x iteration_s), and their ratio.

    .venv/bin/python -m benchmarks.resume
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import emit

REPO = Path(__file__).resolve().parents[1]
ITERS = 6


def _cli(args, env):
    p = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    code = p.wait()
    try:
        os.killpg(p.pid, signal.SIGKILL)  # what a SIGKILLed run leaves (its Prefect API server)
    except ProcessLookupError:
        pass
    return code


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = yaml.safe_load((REPO / "configs" / "arith-tiny.yaml").read_text())
        cfg["run"].update({"run_id": "resume-bench", "iterations": ITERS})
        cfg["lake"]["uri"] = f"{tmp}/lake"
        cfg["tracking"] = {"uri": f"sqlite:///{tmp}/mlflow.db"}
        cfg["eval"] = {"every": 0}
        path = Path(tmp, "c.yaml")
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(REPO), "LOCKSTEP_FAULT": "after-plan@3"}
        assert _cli(["train", str(path)], env) == -signal.SIGKILL
        env.pop("LOCKSTEP_FAULT")
        t0 = time.perf_counter()
        assert _cli(["resume", "resume-bench", "--lake", f"{tmp}/lake"], env) == 0
        resume_s = time.perf_counter() - t0
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name(cfg["run"]["name"]).experiment_id])
        iteration_s = statistics.median(m.value for m in client.get_metric_history(run.info.run_id,
                                                                                    "time/iteration_s"))
        left = ITERS - 2
        setup = resume_s - left * iteration_s
        emit(benchmark="resume", iteration_s=iteration_s, resume_s=resume_s, iterations_after_resume=left,
             resume_setup_s=setup, resume_setup_over_iteration=setup / iteration_s)


if __name__ == "__main__":
    main()
