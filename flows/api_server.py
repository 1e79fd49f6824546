"""The temporary Prefect API server a command starts when no `PREFECT_API_URL` is set, deaf to a terminal's Ctrl-C.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the lockstep command, its rollout workers
and the temporary API server, which Prefect starts as `python -m uvicorn` in that group. uvicorn shuts down on
SIGINT, so the server was gone before the interrupted flow could record its end: Prefect's clients then retried the
dead address for about two minutes and the command ended in a `ConnectError` traceback (exit 1) instead of unwinding
(exit 130 and the resume command); a SIGTERM to the whole group (a job scheduler, systemd, `timeout`) did the same.
With `install`, the server's process runs `main` below, which ignores SIGINT and takes SIGTERM only from the command
(`tasks.workers.watch_parent`), which sends it as it exits (Prefect's atexit); it also stops if the command dies,
and SIGKILL or the terminal's SIGHUP to the group still end it.

`install` must run before anything of Prefect starts the server (a command's first flow): the CLI runs it first, and
importing `flows.train` or `flows.replay` runs it for a script that calls `train_flow` or `replay_flow` itself."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

APP = "prefect.server.api.server:create_app"


def install() -> bool:
    """Have the temporary API server Prefect starts on first use (no `PREFECT_API_URL`) run `main` below: Prefect's
    own `SubprocessASGIServer` (its port search, start-up wait and stop at exit), its process command replaced.
    Nothing is started here; with a server configured, nothing is changed (and Prefect's server module, ~3 s of
    imports, is not loaded). Returns whether the command will start a temporary server."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return False
    from prefect.server.api.server import SubprocessASGIServer

    batch_task_run_records()
    SubprocessASGIServer._run_uvicorn_command = _server_process
    return True


def batch_task_run_records() -> None:
    """Have the temporary Prefect API server this process may start record task runs in batches.

    Prefect's task-run recorder writes each task-run event in its own SQLite transaction (batch size 1): ~0.12 CPU-s
    of the server per demo iteration on this 2-core machine, taken from rollout and training. With batches of 50
    (flushed at least every 5 s, and at shutdown) the server used ~0.05 (60 iterations: 10.0 -> 6.1 CPU-s in all,
    start-up included). Set by `install`, before the server starts (its process takes this process's environment);
    an explicit setting wins, and a real server (PREFECT_API_URL) keeps its own settings."""
    for key in (
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE",
    ):
        os.environ.setdefault(key, "50")


def start_in_background() -> Callable[[], None]:
    """`install`, then start the temporary server in a thread, so that its start-up (~4 s: a process that imports
    Prefect's server and sets up its database, waited for by polling) overlaps the command's own imports. Returns
    `wait`, which the command calls before its first flow: it returns once the server answers and raises what its
    start raised. Prefect's client then finds the server running (one instance per process). With a server
    configured, nothing is started and `wait` returns at once."""
    if not install():
        return lambda: None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    failed: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as e:  # handed to the main thread by `wait`
            failed.append(e)

    # in a copy of this thread's context, where Prefect keeps its settings (a thread starts with an empty one);
    # daemonic: a command that fails before `wait` exits without waiting for the start-up (the server, if it got
    # so far, is stopped by Prefect's atexit or, failing that, by `watch_parent` when the command is gone)
    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(start,), name="lockstep-api-server-start", daemon=True
    )
    thread.start()

    def wait() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return wait


def _server_process(server) -> subprocess.Popen:
    """The server's process, as `SubprocessASGIServer` starts it (the same settings), running `main`."""
    from prefect.settings import get_current_settings

    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }
    return subprocess.Popen([sys.executable, "-m", "flows.api_server", str(server.port), str(os.getpid())], env=env)


def main(port: int, parent: int) -> None:
    """The server's process: uvicorn serving Prefect's API on 127.0.0.1:`port` until the command that started it
    (`parent`) sends it SIGTERM or dies. SIGINT is ignored, and so is a SIGTERM from anyone else (one sent to the
    whole group: the command got it too, and stops this server once it has unwound). Exits 3 when it cannot start
    (the port taken), which `SubprocessASGIServer` answers with another port."""
    import uvicorn

    from tasks.workers import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = uvicorn.Server(
        uvicorn.Config(APP, factory=True, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    )
    server.capture_signals = contextlib.nullcontext  # uvicorn's SIGINT / SIGTERM handlers: `watch_parent` instead

    def stop() -> None:
        logging.getLogger(TASK_RUN_RECORDER).addFilter(RetriedFlushes())
        logging.getLogger(POOL_LOGGER).addFilter(CancelledResets())
        server.should_exit = True  # uvicorn's graceful shutdown: Prefect's services flush their records

    watch_parent(parent, stop, period_s=0.5)  # before the server starts any thread
    server.run()
    if not server.started:
        sys.exit(3)


TASK_RUN_RECORDER = "prefect.server.services.task_run_recorder"


class RetriedFlushes(logging.Filter):
    """Drops the task-run recorder's error for a flush that the server's shutdown cancelled and that Prefect retries.

    At shutdown Prefect's task-run recorder cancels its consumer and its periodic flush; a flush in flight then puts
    its events back in the queue, logs "Error flushing N events (N to retry, 0 dropped)" at ERROR with the
    `CancelledError`'s traceback, and the recorder's final flush writes them. Printed on the command's console, that
    traceback read as a failure of a run that had ended cleanly (the project's CI caught it once, after a Ctrl-C to
    the group in a resilience test). Installed by `main`'s stop, so nothing before the shutdown is hidden; kept: a
    dropped event, any other exception, and a failing final flush (which nothing retries), told apart by the
    recorder's own functions on the logging call's stack."""

    RETRIED_BY_THE_FINAL_FLUSH = frozenset({"flush_periodically", "message_handler"})

    def filter(self, record: logging.LogRecord) -> bool:
        cut_and_retried = (
            record.exc_info is not None
            and isinstance(record.exc_info[1], asyncio.CancelledError)
            and record.getMessage().endswith(" 0 dropped)")
            and self._flushing_for_a_retried_caller()
        )
        return not cut_and_retried

    def _flushing_for_a_retried_caller(self) -> bool:
        """Whether the logging call's own stack holds the recorder's `flush_periodically` or `message_handler`."""
        frame = sys._getframe()
        while frame is not None:
            code = frame.f_code
            if code.co_name in self.RETRIED_BY_THE_FINAL_FLUSH and frame.f_globals.get("__name__") == TASK_RUN_RECORDER:
                return True
            frame = frame.f_back
        return False


# SQLAlchemy's pools log as `sqlalchemy.pool.impl.<class>`; Prefect's server uses the async queue pool on SQLite
POOL_LOGGER = "sqlalchemy.pool.impl.AsyncAdaptedQueuePool"


class CancelledResets(logging.Filter):
    """Drops SQLAlchemy's "Exception during reset or similar" when the exception is the shutdown's `CancelledError`.

    A database connection returned to the pool is reset (its transaction rolled back); when the server's shutdown
    cancels the task doing that, the pool logs this at ERROR with the `CancelledError`'s traceback and discards the
    connection. Nothing is lost by the failed reset itself: what the cancelled task had not committed is gone either
    way, and the writes that matter are retried or reported by Prefect's services (`RetriedFlushes`). Printed on the
    console of a run stopped cleanly, it read as a failure (a resilience test's SIGTERM caught it once, on a
    loaded machine). Installed by `main`'s stop, like `RetriedFlushes`; any other exception in a reset still
    prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.getMessage() == "Exception during reset or similar"
            and record.exc_info is not None
            and isinstance(record.exc_info[1], asyncio.CancelledError)
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
