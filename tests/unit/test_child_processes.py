"""Worker processes started from the fork server (`tasks.workers.child_context`): they take on their parent's
environment and process group as a spawned process would, and a signal sent to the whole group leaves the server,
and so the run's view of its workers, alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks.workers import ParentState, child_context, enter_child

REPO = Path(__file__).resolve().parents[2]


def _state() -> dict:
    return {
        "mark": os.environ.get("LOCKSTEP_TEST_MARK"),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "ppid": os.getppid(),
        "pgid": os.getpgid(0),
        "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
        "sigterm_blocked": signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []),
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
    # children of the one server, not of this process; with torch imported before they ran a line, pyarrow not (its
    # allocator's background thread could be forked holding a lock)
    assert first["ppid"] == later["ppid"] == unadopted["ppid"] != os.getpid()
    assert first["preloaded"] == {"torch": True, "models.engine": True, "pyarrow": False}
    # in this process's group once entered; the server's own group before
    assert later["pgid"] == os.getpgid(0) != unadopted["pgid"]
    assert unadopted["pgid"] == os.getpgid(later["ppid"])
    assert later["sigint_ignored"] and later["sigterm_blocked"]  # SIGTERM: taken by `watch_parent`, the parent's only
    assert not unadopted["sigint_ignored"] and not unadopted["sigterm_blocked"]


def _wait_for_word(parent: ParentState, conn) -> None:  # in the child
    enter_child(parent)
    conn.send("entered")
    conn.recv()


_GROUP_SIGNALS = """
import json, os, signal, subprocess, sys, time
from tasks.workers import ParentState, child_context
from tests.unit.test_child_processes import _run, _wait_for_word

if __name__ == "__main__":
    got = []
    signal.signal(signal.SIGINT, lambda *_: got.append("INT"))
    signal.signal(signal.SIGTERM, lambda *_: got.append("TERM"))
    ctx = child_context()
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_wait_for_word, args=(ParentState.here(), theirs))
    p.start()
    assert ours.recv() == "entered"
    server = _run(ctx, None)["ppid"]
    for sig in ("SIGINT", "SIGTERM"):  # a terminal's Ctrl-C, a job scheduler's stop: sent from outside the group
        send = f"import os, signal; os.killpg({os.getpgid(0)}, signal.{sig})"
        subprocess.run([sys.executable, "-c", send], check=True, start_new_session=True)
    time.sleep(1.0)
    group = os.getpgid(0)
    seen = {"got": got, "alive": p.is_alive(), "exitcode": p.exitcode, "child_in_group": os.getpgid(p.pid) == group,
            "server_in_group": os.getpgid(server) == group}
    ours.send("end")
    p.join(30)
    print(json.dumps({**seen, "ended": p.exitcode}), flush=True)
"""


def test_a_signal_to_the_whole_group_reaches_the_workers_and_leaves_the_fork_server_alone():
    """A run's own process in a session of its own, one worker: Ctrl-C and SIGTERM sent to the whole process group.
    The worker, in the group, ignores the one and takes the other from its parent only; the server, outside it, is
    untouched. Were it in the group, the SIGTERM would kill it, closing the pipes through which the run reads how its
    workers ended: the live worker would read as dead, exit code 255."""
    r = subprocess.run(
        [sys.executable, "-c", _GROUP_SIGNALS],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == {
        "got": ["INT", "TERM"],
        "alive": True,
        "exitcode": None,
        "child_in_group": True,
        "server_in_group": False,
        "ended": 0,
    }, r.stderr[-3000:]


_START = """
import json
from tasks.workers import ParentState, child_context
from tests.unit.test_child_processes import _run

if __name__ == "__main__":
    ctx = child_context()
    child = _run(ctx, ParentState.here())
    print(json.dumps({"method": ctx.get_start_method(), "mark": child["mark"], "torch": child["preloaded"]["torch"]}))
"""


def _start_with_tmpdir(tmpdir: Path) -> dict:
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "LOCKSTEP_TEST_MARK": "the parent's"}
    r = subprocess.run([sys.executable, "-c", _START], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_where_the_fork_server_cannot_start_children_are_spawned(tmp_path):
    """The server's socket is made in the temporary folder; under one longer than AF_UNIX allows (108 bytes) the
    server cannot start, and children are spawned instead: they start without the server's imports, and take on
    their parent's environment all the same. Under a short folder (the control: one in /tmp, as a test's own folder
    may leave too few of the 108 bytes), the same process forks them."""
    assert _start_with_tmpdir(tmp_path / ("long" * 25)) == {"method": "spawn", "mark": "the parent's", "torch": False}
    short = Path(tempfile.mkdtemp(prefix="lt-", dir="/tmp"))
    try:
        assert _start_with_tmpdir(short) == {"method": "forkserver", "mark": "the parent's", "torch": True}
    finally:
        shutil.rmtree(short, ignore_errors=True)
