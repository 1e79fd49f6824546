"""Worker processes started from the fork server (`tasks.workers.child_context`): they take on their parent's state as
a spawned process would, and the server outlives a SIGTERM sent to the whole process group."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tasks.workers import ParentState, child_context, enter_child

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no fork server here (pidfds are Linux's)")


def _state() -> dict:
    return {
        "mark": os.environ.get("LOCKSTEP_TEST_MARK"),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "ppid": os.getppid(),
        "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
        "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    }


def _report(parent: ParentState | None, out) -> None:  # in the child
    preloaded = {m: m in sys.modules for m in ("torch", "models.engine", "pyarrow")}  # what the server imported
    if parent is not None:
        enter_child(parent)
    out.put({**_state(), "preloaded": preloaded})


def _run(ctx, parent: ParentState | None) -> dict:
    out = ctx.Queue()
    p = ctx.Process(target=_report, args=(parent, out))
    p.start()
    try:
        return out.get(timeout=120)
    finally:
        p.join(30)


def test_a_forked_child_takes_on_its_parents_state_as_it_starts(tmp_path, monkeypatch):
    ctx = child_context()
    assert ctx.get_start_method() == "forkserver"
    first = _run(ctx, ParentState.here())  # the server is running from here on, started with this state
    monkeypatch.setenv("LOCKSTEP_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    later = _run(ctx, ParentState.here())
    unadopted = _run(ctx, None)  # the negative control: the server's state, from before the change

    assert first["mark"] is None and unadopted["mark"] is None
    assert later["mark"] == "set after the server started"
    # the working folder and import path multiprocessing sets itself, also without `enter_child`
    assert later["cwd"] == unadopted["cwd"] == str(tmp_path) != first["cwd"]
    assert later["path0"] == unadopted["path0"] == str(tmp_path) != first["path0"]
    # children of the one server, not of this process; with torch imported before they ran a line
    assert first["ppid"] == later["ppid"] == unadopted["ppid"] != os.getpid()
    # pyarrow not: its allocator's background thread could be forked holding a lock
    assert first["preloaded"] == {"torch": True, "models.engine": True, "pyarrow": False}
    assert later["sigint_ignored"] and later["sigterm_default"]
    assert not unadopted["sigterm_default"]  # inherited ignored from the server: `enter_child` resets it


def _wait_for_word(parent: ParentState, conn) -> None:  # in the child
    enter_child(parent)
    conn.recv()


def test_the_fork_server_outlives_a_sigterm_and_its_children_stay_readable():
    """A SIGTERM sent to the whole process group reaches the server: were it to die of it, the pipes through which
    this process reads how its children ended would close, and a live child would read as dead (exit code 255)."""
    ctx = child_context()
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_wait_for_word, args=(ParentState.here(), theirs))
    p.start()
    server = _run(ctx, None)["ppid"]
    os.kill(server, signal.SIGTERM)
    time.sleep(0.5)
    try:
        assert p.is_alive() and p.exitcode is None
        assert os.path.exists(f"/proc/{server}")
        ours.send("end")
        p.join(30)
        assert p.exitcode == 0
        assert _run(ctx, None)["ppid"] == server  # the same server starts the next child
    finally:
        if p.is_alive():
            p.kill()
