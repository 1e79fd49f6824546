"""One writer per run: `lockstep train`, `resume` and `replay --to` hold the run's lease while they write it.

Two processes writing one run (a `resume` started while the run still runs, a scheduled deployment overlapping
the previous one) would delete each other's files in flight (`_tmp/`, the unpromoted shards a resume sets aside),
log every figure twice to one MLflow run and promote checkpoints of two histories. The second one is refused
instead, with who holds the run.

On a local lake the lease is an exclusive `flock` on `{run}/LOCK`, which the kernel drops when its process dies
however it dies (a SIGKILLed run can be resumed at once). Object stores have no locks: there `{run}/LEASE.json`
names its holder and the time it was last renewed (every `RENEW_S` by a thread); a lease not renewed for `TTL_S`,
or held by a process of this host that is gone, is taken over. Its limits: two starts within the same moment can
both read a free lease (each checks that its own write is the one that stays, which closes most of that window),
and hosts whose clocks differ by more than `TTL_S - RENEW_S` can misjudge a live lease as expired.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone

from storage.lake import Lake

TTL_S = 60.0
RENEW_S = 15.0
SETTLE_S = 0.2  # between writing a remote lease and reading it back: a rival's write lands in this window


class RunInUseError(RuntimeError):
    """The run's lease is held by another process (or by another lease of this one)."""


def _holder(command: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
            "since": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def describe(holder: dict | None) -> str:
    """'`lockstep resume` (pid 4242 on host h1, since 2026-12-04T12:00:00Z)', or what is known of it."""
    if not holder:
        return "another process (its lease names no holder yet)"
    return (f"`lockstep {holder.get('command', '?')}` (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"since {holder.get('since', '?')})")


def _in_use(lake: Lake, run_id: str, holder: dict | None) -> RunInUseError:
    pid = holder.get("pid") if holder else None
    stop = f"stop it (kill {pid}, or Ctrl-C where it runs) " if pid else "stop it "
    return RunInUseError(f"run {run_id} in {lake.uri} is in use by {describe(holder)}: one process at a time writes "
                         f"a run; wait for it to end, or {stop}and then `lockstep resume {run_id} --lake {lake.uri}`")


def _live(lease: dict) -> bool:
    """Whether a remote lease still holds: renewed within `TTL_S`, and not by a process of this host that is gone."""
    renewed = lease.get("renewed")
    return isinstance(renewed, (int, float)) and time.time() - renewed < TTL_S and _alive_here(lease)


def _alive_here(holder: dict) -> bool:
    """Whether a holder of this host is still running (False for a dead pid; True when it cannot be told)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class RunLease:
    """A held lease; `release()` (idempotent) gives the run back."""

    def __init__(self, lake: Lake, run_id: str, fd: int | None = None, token: str | None = None):
        self.lake, self.run_id, self._fd, self._token = lake, run_id, fd, token
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None or self._token is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no holder named once it is free; the file stays (see `acquire`)
            os.close(fd)  # drops the flock
        if self._token is not None:
            token, self._token = self._token, None
            self._stop.set()
            if self._renewer is not None:
                self._renewer.join()
            path = _lease_path(self.lake, self.run_id)
            with contextlib.suppress(FileNotFoundError):
                if (_read_remote(self.lake, path) or {}).get("token") == token:
                    self.lake.fs.rm(path)

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _renew(self, holder: dict) -> None:
        path = _lease_path(self.lake, self.run_id)
        log = logging.getLogger("lockstep")
        while not self._stop.wait(RENEW_S):
            try:
                current = _read_remote(self.lake, path) or {}
                if current.get("token") != self._token:
                    log.error("the lease of run %s was taken over by %s after %.0f s without renewal: two "
                              "processes may now write this run", self.run_id, describe(current), TTL_S)
                    return
                self.lake.fs.pipe_file(path, json.dumps({**holder, "renewed": time.time()}).encode())
            except Exception as e:  # a store that fails for a while: the next renewal tries again
                log.warning("run %s: lease renewal failed (%s); retrying in %.0f s", self.run_id, e, RENEW_S)


def _lock_path(lake: Lake, run_id: str) -> str:
    return f"{lake.run_dir(run_id)}/LOCK"


def _lease_path(lake: Lake, run_id: str) -> str:
    return f"{lake.run_dir(run_id)}/LEASE.json"


def _read_remote(lake: Lake, path: str) -> dict | None:
    try:
        data = lake.fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        lease = json.loads(data)
    except ValueError:  # cut short or edited: it names no holder, and nothing renews it
        return {}
    return lease if isinstance(lease, dict) else {}


def _read_fd(fd: int) -> dict | None:
    data = os.pread(fd, 4096, 0)
    try:
        holder = json.loads(data) if data else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def acquire(lake: Lake, run_id: str, command: str) -> RunLease:
    """Hold run `run_id`'s lease for `command` ('train', 'resume', 'replay'); RunInUseError naming the holder if
    another process has it. Creates the run's folder if it does not exist yet."""
    lake.fs.makedirs(lake.run_dir(run_id), exist_ok=True)
    holder = _holder(command)
    if lake.is_local:
        # The file is never removed: removing it while another process opens it would give the two of them locks
        # on two different files.
        fd = os.open(_lock_path(lake, run_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = _read_fd(fd)
            os.close(fd)
            raise _in_use(lake, run_id, held_by) from None
        data = json.dumps(holder).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return RunLease(lake, run_id, fd=fd)
    path = _lease_path(lake, run_id)
    current = _read_remote(lake, path)
    if current is not None and _live(current):
        raise _in_use(lake, run_id, current)
    token = uuid.uuid4().hex
    holder = {**holder, "token": token}
    lake.fs.pipe_file(path, json.dumps({**holder, "renewed": time.time()}).encode())
    time.sleep(SETTLE_S)
    current = _read_remote(lake, path)
    if (current or {}).get("token") != token:  # a rival wrote after us: its lease stands
        raise _in_use(lake, run_id, current)
    lease = RunLease(lake, run_id, token=token)
    lease._renewer = threading.Thread(target=lease._renew, args=(holder,), name="lockstep-lease", daemon=True)
    lease._renewer.start()
    return lease


def holder(lake: Lake, run_id: str) -> dict | None:
    """Who holds run `run_id` now (host, pid, command, since), or None if nobody does."""
    if lake.is_local:
        try:
            fd = os.open(_lock_path(lake, run_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_fd(fd) or {}
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)
    current = _read_remote(lake, _lease_path(lake, run_id))
    return current if current is not None and _live(current) else None
