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

    def prefects(server):  # what Prefect's would be: this process may have run `install` already (flows.train)
        raise AssertionError("not called")

    monkeypatch.setattr(SubprocessASGIServer, "_run_uvicorn_command", prefects)  # restored after the test
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        api_server.install()
    assert SubprocessASGIServer._run_uvicorn_command is prefects
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        api_server.install()
    assert SubprocessASGIServer._run_uvicorn_command is api_server._server_process


@pytest.mark.parametrize("module", ["flows.train", "flows.replay"])
def test_the_flow_called_as_a_library_starts_this_modules_server(module):
    """A script that imports flows.train and calls `train_flow` (a benchmark, a notebook), or flows.replay and calls
    `replay_flow`, gets the server the CLI starts: before, Prefect's own, which a Ctrl-C to the group shut down first
    (the script then hung ~75 s in Prefect's retries and ended in a ConnectError) and which a SIGTERM to the script
    left running, orphaned."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    probe = (
        f"import sys, {module}; from flows import api_server; "
        "from prefect.server.api.server import SubprocessASGIServer as S; "
        "print(S._run_uvicorn_command is api_server._server_process, 'flows.train' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    # flows.replay does not import flows.train: its own import installs the server
    assert out.stdout.split() == ["True", str(module == "flows.train")], out.stderr[-2000:]


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


def _task_run_event():
    import uuid

    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.types._datetime import now

    run = f"prefect.task-run.{uuid.uuid4()}"
    event = ReceivedEvent(
        occurred=now("UTC"),
        received=now("UTC"),
        event="prefect.task-run.Running",
        resource={"prefect.resource.id": run, "prefect.orchestration": "client"},
        id=uuid.uuid4(),
    )
    return type("Message", (), {"data": event.model_dump_json(), "attributes": {}})(), event.id


@pytest.fixture
def recorder(monkeypatch, caplog):
    """Prefect's task-run recorder (`consumer`) with its database write replaced: the first write waits until it is
    cancelled (a flush in flight when the server shuts down), later ones record the event ids they were given.
    Yields (the ids of each write, the recorder's ERROR records that got through its logger's filters)."""
    import asyncio
    import logging

    from prefect.server.services import task_run_recorder

    writes: list[list] = []

    async def write(events) -> None:
        writes.append([e.id for e in events])
        if len(writes) == 1:
            await asyncio.Event().wait()  # never set: only a cancel ends it

    monkeypatch.setattr(task_run_recorder, "record_bulk_task_run_events", write)
    logger = logging.getLogger(api_server.TASK_RUN_RECORDER)
    with caplog.at_level(logging.ERROR, logger=api_server.TASK_RUN_RECORDER):
        yield writes, lambda: [r for r in caplog.records if r.name == api_server.TASK_RUN_RECORDER]
    for f in [f for f in logger.filters if isinstance(f, api_server.RetriedFlushes)]:
        logger.removeFilter(f)


async def _until(condition) -> None:
    import asyncio

    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.parametrize("filtered", [True, False], ids=["with-the-filter", "without-it"])
def test_a_periodic_flush_cut_by_the_shutdown_is_retried_and_its_error_dropped(recorder, filtered):
    """The periodic flush is writing one event when the shutdown cancels it: Prefect puts the event back and the
    final flush writes it, so the ERROR with its CancelledError traceback (what a Ctrl-C'd command printed) is
    dropped by the filter; without the filter it gets through (the test sees it)."""
    import asyncio
    import logging

    from prefect.server.services.task_run_recorder import consumer

    writes, errors = recorder
    if filtered:
        logging.getLogger(api_server.TASK_RUN_RECORDER).addFilter(api_server.RetriedFlushes())
    message, event_id = _task_run_event()

    async def run() -> None:
        async with consumer(write_batch_size=50, flush_every=1) as handle:
            await handle(message)
            await _until(lambda: writes)  # the periodic flush (after 1 s) is writing

    asyncio.run(run())
    assert writes == [[event_id], [event_id]]  # cut, then written by the final flush
    if filtered:
        assert errors() == []
    else:
        [error] = errors()
        assert error.getMessage() == "Error flushing 1 events (1 to retry, 0 dropped)"
        assert isinstance(error.exc_info[1], asyncio.CancelledError)


def test_a_batch_flush_cut_by_the_shutdown_is_retried_and_its_error_dropped(recorder):
    """A full batch is written by the handler itself (batch size 1 here); the shutdown cancels the consumer while it
    writes: the same retry by the final flush, the same error dropped."""
    import asyncio
    import logging

    from prefect.server.services.task_run_recorder import consumer

    writes, errors = recorder
    logging.getLogger(api_server.TASK_RUN_RECORDER).addFilter(api_server.RetriedFlushes())
    message, event_id = _task_run_event()

    async def run() -> None:
        async with consumer(write_batch_size=1, flush_every=60) as handle:
            consuming = asyncio.create_task(handle(message))  # as the consumer's task runs it
            await _until(lambda: writes)
            consuming.cancel()  # TaskRunRecorder.stop
            with pytest.raises(asyncio.CancelledError):
                await consuming

    asyncio.run(run())
    assert writes == [[event_id], [event_id]]
    assert errors() == []


def test_a_dropped_event_or_a_cut_final_flush_is_still_reported(recorder):
    """What nothing retries stays on the console: the cut flush that drops its event (its retries spent), and the
    final flush when it is itself cancelled."""
    import asyncio
    import logging

    from prefect.server.services.task_run_recorder import consumer

    writes, errors = recorder
    logging.getLogger(api_server.TASK_RUN_RECORDER).addFilter(api_server.RetriedFlushes())
    message, event_id = _task_run_event()

    async def dropping() -> None:
        async with consumer(write_batch_size=50, flush_every=1, max_persist_retries=0) as handle:
            await handle(message)
            await _until(lambda: writes)

    asyncio.run(dropping())
    assert writes == [[event_id]]  # dropped: no final flush
    assert [e.getMessage() for e in errors()] == [
        f"Dropping event {event_id} after 1 failed attempts",
        "Error flushing 1 events (0 to retry, 1 dropped)",
    ]

    writes.clear()
    records = len(errors())

    async def final_flush_cut() -> None:
        async def run() -> None:
            async with consumer(write_batch_size=50, flush_every=60) as handle:
                await handle(message)
            # the final flush writes (first write: waits until cancelled)

        running = asyncio.create_task(run())
        await _until(lambda: writes)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(final_flush_cut())
    assert writes == [[event_id]]
    [error] = errors()[records:]
    assert error.getMessage() == "Error flushing 1 events (1 to retry, 0 dropped)"


def test_the_servers_stop_installs_the_filter_before_the_shutdown_starts(monkeypatch):
    """`main`'s stop (called by `watch_parent` on the command's SIGTERM) adds the filter, then asks uvicorn to shut
    down; before it, the recorder's logger has none."""
    import logging

    import uvicorn

    import tasks.workers

    logger = logging.getLogger(api_server.TASK_RUN_RECORDER)
    pool = logging.getLogger(api_server.POOL_LOGGER)
    ours = lambda: [f for f in logger.filters if isinstance(f, api_server.RetriedFlushes)]  # noqa: E731
    resets = lambda: [f for f in pool.filters if isinstance(f, api_server.CancelledResets)]  # noqa: E731
    stops = []
    seen = {}

    class Server:
        def __init__(self, config):
            self.should_exit, self.started = False, True

        def run(self):
            seen["before"] = (len(ours()), len(resets()), self.should_exit)
            stops[0]()
            seen["after"] = (len(ours()), len(resets()), self.should_exit)

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main ignores SIGINT: not in this test process
    monkeypatch.setattr(tasks.workers, "watch_parent", lambda parent, stop, period_s: stops.append(stop))
    monkeypatch.setattr(uvicorn, "Server", Server)
    try:
        api_server.main(free_port(), os.getpid())
        assert seen == {"before": (0, 0, False), "after": (1, 1, True)}
    finally:
        for f in ours():
            logger.removeFilter(f)
        for f in resets():
            pool.removeFilter(f)


@pytest.mark.parametrize(
    "raised, filtered, printed",
    [("cancelled", True, False), ("cancelled", False, True), ("os-error", True, True)],
    ids=["cancelled-with-the-filter", "cancelled-without-it", "another-error-with-the-filter"],
)
def test_a_connection_reset_cut_by_the_shutdown_is_not_printed(tmp_path, caplog, raised, filtered, printed):
    """A pooled SQLite connection (the async pool of Prefect's server) whose work is committed and whose reset, as it
    returns to the pool, is cancelled: SQLAlchemy logs "Exception during reset or similar" with the CancelledError
    and discards the connection; the filter drops that record (without it, it gets through), and keeps a reset that
    failed otherwise."""
    import asyncio
    import logging

    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    pool_logger = logging.getLogger(
        type(engine.sync_engine.pool).__module__ + "." + type(engine.sync_engine.pool).__name__
    )
    assert pool_logger.name == api_server.POOL_LOGGER
    error = asyncio.CancelledError() if raised == "cancelled" else OSError("disk I/O error")

    def failing_rollback(dbapi_connection):
        raise error

    async def run() -> None:
        async with engine.begin() as conn:  # committed; then the reset's rollback as it returns to the pool fails
            await conn.execute(text("select 1"))
            engine.sync_engine.dialect.do_rollback = failing_rollback
        await engine.dispose()

    if filtered:
        pool_logger.addFilter(api_server.CancelledResets())
    try:
        with caplog.at_level(logging.ERROR, logger=pool_logger.name):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                asyncio.run(run())
    finally:
        for f in [f for f in pool_logger.filters if isinstance(f, api_server.CancelledResets)]:
            pool_logger.removeFilter(f)
    resets = [r for r in caplog.records if r.getMessage() == "Exception during reset or similar"]
    assert len(resets) == (1 if printed else 0)
    if printed:
        assert resets[0].exc_info[1] is error
