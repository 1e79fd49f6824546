"""flows/api_server.py and tasks.workers.watch_parent: the temporary Prefect API server a command starts survives a
terminal's Ctrl-C and the group's SIGTERM, and stops on its parent's SIGTERM or death; Prefect's server command is
replaced only where Prefect would start a server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows import api_server
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_server_process_ignores_sigint_and_others_sigterm_and_stops_on_its_parents(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.api_server", str(port), str(os.getpid())],  # this test is its parent
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
        subprocess.run(["kill", "-TERM", "--", f"-{proc.pid}"], check=True)  # the group's SIGTERM, sent by another
        time.sleep(1.5)
        assert proc.poll() is None and _healthy(port), "SIGINT, or a SIGTERM not from its parent, stopped the server"
        proc.send_signal(signal.SIGTERM)  # what Prefect's stop at the command's exit sends
        assert proc.wait(timeout=15) == 0  # a graceful shutdown
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


CHILD = """
import os, sys, time
from tasks.workers import watch_parent
only = sys.argv[2:] != ["any-sigterm"]
watch_parent(int(sys.argv[1]), lambda: (print("stopped", flush=True), os._exit(0)), 0.1, sigterm_from_parent_only=only)
print("ready", flush=True)
time.sleep(60)
"""


def _line(proc, timeout_s: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout_s), f"no line in {timeout_s} s"
    return proc.stdout.readline().strip()


@contextlib.contextmanager
def _python(source: str, *args: str):
    """`python -c source args` with this repository on its path and its stdout a text pipe; killed at the end if it
    is still running."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", source, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_parent_stops_on_the_parents_sigterm_only():
    with _python(CHILD, str(os.getpid())) as proc:
        assert _line(proc, 30) == "ready"
        subprocess.run(["kill", "-TERM", str(proc.pid)], check=True)  # not from its parent
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert _line(proc, 10) == "stopped" and proc.wait(timeout=10) == 0


def test_watch_parent_can_leave_sigterm_alone():
    """`sigterm_from_parent_only=False` (a vLLM worker): SIGTERM is not blocked, and anyone's ends the process."""
    with _python(CHILD, str(os.getpid()), "any-sigterm") as proc:
        assert _line(proc, 30) == "ready"
        subprocess.run(["kill", "-TERM", str(proc.pid)], check=True)  # not from its parent
        assert proc.wait(timeout=10) == -signal.SIGTERM


def test_watch_parent_stops_when_the_parent_dies():
    """The parent exits without a word (a SIGKILLed command): its child stops within a few periods."""
    parent = (
        "import os, subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())]); time.sleep(1.5)"
    )
    with _python(parent, CHILD) as proc:
        assert _line(proc, 30) == "ready"
        assert proc.wait(timeout=30) == 0  # the parent is gone; its child still holds the pipe
        assert _line(proc, 10) == "stopped"


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
    assert args == [sys.executable, "-m", "flows.api_server", "8123", str(os.getpid())]
    assert env["PREFECT__SERVER_EPHEMERAL"] == "1" and env["PREFECT_UI_ENABLED"] == "0"


def test_uvicorn_still_installs_its_signal_handlers_through_capture_signals():
    """`main` replaces the server's `capture_signals` so that uvicorn sets no handler of its own: if uvicorn renamed
    it, the replacement would do nothing silently (uvicorn would stop on the group's SIGINT again)."""
    import inspect

    import uvicorn.server

    assert "self.capture_signals()" in inspect.getsource(uvicorn.server.Server.serve)


def _children_running(module: str) -> list[str]:
    """The pids of this process's children whose command line names `module`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == os.getpid() and module.encode() in cmd:
            found.append(pid)
    return found


def test_a_server_started_in_the_background_is_the_one_prefects_client_uses(monkeypatch):
    """`start_in_background`'s `wait` returns with the server answering, and Prefect's client then talks to it rather
    than starting a second one: one server process, a child of the command, running this module."""
    from prefect import get_client
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # this test's own server, stopped after it
    monkeypatch.setattr(SubprocessASGIServer, "_run_uvicorn_command", SubprocessASGIServer._run_uvicorn_command)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    batching = (
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE",
    )
    for key in batching:  # as in a command that has not imported flows.train yet
        monkeypatch.delenv(key, raising=False)
    before = set(_children_running("flows.api_server"))
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        api_server.start_in_background()()
        server = SubprocessASGIServer()
        try:
            assert server.running and _healthy(server.port)
            with get_client(sync_client=True) as client:
                assert client.api_healthcheck() is None  # None: it answered
                assert str(client.api_url).rstrip("/") == server.api_url
            assert len(set(_children_running("flows.api_server")) - before) == 1
            # the server records task runs in batches (flows.train's import set it only after the server started)
            environ = Path(f"/proc/{server.server_process.pid}/environ").read_bytes().split(b"\0")
            assert all(f"{key}=50".encode() in environ for key in batching)
        finally:
            process = server.server_process  # (`stop` forgets it)
            server.stop()
            process.wait(timeout=30)


def test_a_background_start_that_fails_is_raised_by_wait_and_a_configured_server_starts_nothing(monkeypatch):
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # this test's own instance, dropped after it
    monkeypatch.setattr(SubprocessASGIServer, "_run_uvicorn_command", SubprocessASGIServer._run_uvicorn_command)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        api_server.start_in_background()()
    assert SubprocessASGIServer._instances == {}  # nothing started, nothing waited for

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    # a server process that exits at once (code 1: not the port-taken code 3, which Prefect retries on another port)
    monkeypatch.setattr(
        api_server, "_server_process", lambda server: subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    )
    with temporary_settings(
        restore_defaults={PREFECT_API_URL}, updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 2}
    ):
        t0 = time.monotonic()
        wait = api_server.start_in_background()
        with pytest.raises(RuntimeError, match="Timed out while attempting to connect"):
            wait()
    # the start-up ran with this context's settings (2 s), not the environment's (`make test`: 90 s)
    assert time.monotonic() - t0 < 45
    assert not SubprocessASGIServer().running
