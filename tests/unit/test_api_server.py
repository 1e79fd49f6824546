"""flows/api_server.py: the temporary Prefect API server a command starts survives a terminal's Ctrl-C (SIGINT to the
whole process group) and still stops on SIGTERM; it replaces Prefect's server command only where Prefect would
start a server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flows import api_server
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_server_process_ignores_sigint_and_stops_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.api_server", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    try:
        deadline = time.monotonic() + 90
        while not _healthy(port):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        time.sleep(1.5)
        assert proc.poll() is None and _healthy(port), "SIGINT stopped the server"
        proc.send_signal(signal.SIGTERM)  # what Prefect's stop at the command's exit sends
        assert proc.wait(timeout=15) == -signal.SIGTERM  # uvicorn shuts down, then raises the signal it caught
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_install_replaces_the_server_command_only_where_prefect_would_start_a_server(monkeypatch):
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    prefects = SubprocessASGIServer._run_uvicorn_command
    monkeypatch.setattr(SubprocessASGIServer, "_run_uvicorn_command", prefects)  # restored after the test
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        api_server.install()
    assert SubprocessASGIServer._run_uvicorn_command is prefects
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        api_server.install()
    assert SubprocessASGIServer._run_uvicorn_command is api_server._server_process


def test_the_server_command_runs_this_module_on_the_servers_port(monkeypatch):
    started = []
    monkeypatch.setattr(api_server.subprocess, "Popen", lambda args, env: started.append((args, env)))
    api_server._server_process(type("Server", (), {"port": 8123})())
    [(args, env)] = started
    assert args == [sys.executable, "-m", "flows.api_server", "8123"]
    assert env["PREFECT__SERVER_EPHEMERAL"] == "1" and env["PREFECT_UI_ENABLED"] == "0"


def test_uvicorn_still_lists_the_signals_main_takes_sigint_out_of():
    """`main` edits uvicorn's HANDLED_SIGNALS: if uvicorn renamed or dropped it, the edit would do nothing silently."""
    import uvicorn.server

    assert {signal.SIGINT, signal.SIGTERM} <= set(uvicorn.server.HANDLED_SIGNALS)
