"""Real services on loopback: Prefect server + MLflow server from infra/, a run triggered through the
`lockstep serve` deployment, checked through Prefect's and MLflow's client APIs, then everything stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.runs import write_config
from tests.ports import free_port, free_ports

REPO = Path(__file__).resolve().parents[2]


def completed(task_run) -> bool:
    return task_run.state is not None and task_run.state.is_completed()


@pytest.mark.slow
def test_run_triggered_through_the_deployment(tmp_path):
    pp, mp = free_ports(2)
    env = {
        **os.environ,
        "LOCKSTEP_SERVICES_STATE": str(tmp_path / "state"),
        "PREFECT_PORT": str(pp),
        "MLFLOW_PORT": str(mp),
        "LOCKSTEP_BIN": str(Path(sys.executable).parent),
        "PYTHONPATH": str(REPO),
    }
    api, mlflow_uri = f"http://127.0.0.1:{pp}/api", f"http://127.0.0.1:{mp}"
    started = subprocess.run(
        ["infra/services.sh", "start"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    serve = None
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"http://127.0.0.1:{pp}" in started.stdout and f"http://127.0.0.1:{mp}" in started.stdout
        cfg = write_config(tmp_path, "served", {"run.iterations": 2})
        serve_env = {**env, "PREFECT_API_URL": api}
        serve = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", cfg, "--name", "it", "-o", f"tracking.uri={mlflow_uri}"],
            cwd=REPO,
            env=serve_env,
            stdout=open(tmp_path / "serve.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):
            with get_client(sync_client=True) as client:
                deadline = time.monotonic() + 120
                while True:  # the deployment appears once `serve` has registered it
                    try:
                        client.read_deployment_by_name("lockstep-train/it")
                        break
                    except Exception:
                        assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                        time.sleep(1)
                run = run_deployment("lockstep-train/it", timeout=0)
                deadline = time.monotonic() + 400
                while True:
                    state = client.read_flow_run(run.id).state
                    if state.is_final():
                        break
                    assert time.monotonic() < deadline, f"flow run still {state.type} after 400 s"
                    time.sleep(2)
                assert state.is_completed(), (
                    f"{state.type}: {state.message}\n" + (tmp_path / "serve.log").read_text()[-3000:]
                )
                # task-run states reach the server as events, recorded in batches (this server inherits the batch size
                # that flows.api_server.install sets in a test process that imported flows.train), so the last ones can
                # land seconds after the flow run's final state, and a task run can be read before any state of it is
                # recorded (its state is then None), or before any task run of it is (none read: wait for them too)
                expected = {"plan", "rollout", "train", "promote", "audit", "evaluate"}
                deadline = time.monotonic() + 60
                while True:
                    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
                    names = {t.name.rsplit("-", 1)[0] for t in tasks}
                    if (expected <= names and all(completed(t) for t in tasks)) or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                assert expected <= names, names
                assert all(completed(t) for t in tasks), [(t.name, t.state and t.state.type) for t in tasks]

        from mlflow.tracking import MlflowClient

        ml = MlflowClient(tracking_uri=mlflow_uri)
        (mrun,) = ml.search_runs(
            [ml.get_experiment_by_name("t").experiment_id], filter_string="tags.`lockstep.run_id` = 'served'"
        )
        assert mrun.info.status == "FINISHED"
        assert sorted(m.step for m in ml.get_metric_history(mrun.info.run_id, "reward/mean")) == [0, 1]
        assert sorted(m.step for m in ml.get_metric_history(mrun.info.run_id, "eval/accuracy")) == [0, 1, 2]
    finally:
        if serve is not None:
            try:
                os.killpg(serve.pid, signal.SIGTERM)
                serve.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(serve.pid, signal.SIGKILL)
        stopped = subprocess.run(
            ["infra/services.sh", "stop"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert stopped.returncode == 0, stopped.stderr


def test_services_refuse_a_port_in_use_and_start_nothing(tmp_path):
    """A port another program listens on is named before anything starts (it was found after 120 s of waiting,
    against whatever answered there, with the other service left running)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            **os.environ,
            "LOCKSTEP_SERVICES_STATE": str(tmp_path / "state"),
            "PREFECT_PORT": str(free_port()),
            "MLFLOW_PORT": str(port),
            "LOCKSTEP_BIN": str(Path(sys.executable).parent),
        }
        proc = subprocess.run(
            ["infra/services.sh", "start"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == (
        f"port {port} (mlflow) is in use by another program: stop it, or choose another port "
        f"(MLFLOW_PORT={port + 1} infra/services.sh start)\n"
    )
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == []  # no pid, no log: nothing was started


def test_services_script_refuses_an_unknown_command(tmp_path):
    env = {**os.environ, "LOCKSTEP_SERVICES_STATE": str(tmp_path / "state")}
    proc = subprocess.run(
        ["infra/services.sh", "restart"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stderr) == (2, "usage: infra/services.sh start|stop|status\n")
