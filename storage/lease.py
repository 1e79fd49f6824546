"""One writer per run: `lockstep train`, `resume` and `replay --to` hold the run's lease while they write it.

Two processes writing one run (a `resume` started while the run still runs, a scheduled deployment overlapping
the previous one) would delete each other's files in flight (`_tmp/`, the unpromoted shards a resume sets aside),
log every figure twice to one MLflow run and promote checkpoints of two histories. The second one is refused
instead, with who holds the run.

On a local lake the lease is an exclusive `flock` on `{run}/LOCK`, which the kernel drops when its process dies
however it dies (a SIGKILLed run can be resumed at once). Object stores have no locks: there `{run}/LEASE.json`
names its holder and the time it was last renewed (every `RENEW_S` by a thread); a lease not renewed for `TTL_S`,
or held by a process that is gone from this machine's own process table, is taken over. Its limits: two starts
within the same moment can both read a free lease (each checks that its own write is the one that stays, which
closes most of that window), and clocks that differ between hosts by more than `TTL_S - RENEW_S` can misjudge a
live lease as expired (behind) or keep a dead one for up to another `TTL_S` (ahead). A holder that finds its lease
taken over marks it lost, and the run stops at its next iteration (`check`). Lease files are read and written
past any local cache of a chained URL (`simplecache::s3://...`), which would show each process its own copy.
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

from fsspec.implementations.local import LocalFileSystem

from storage.lake import Lake

TTL_S = 60.0
RENEW_S = 15.0
SETTLE_S = 0.2  # between writing a remote lease and reading it back: a rival's write lands in this window
FILES = ("LOCK", "LEASE.json")
PROBE_RETRIES = 20  # `holder()` (lockstep runs) holds a shared lock for an instant: an acquire that meets it retries
PROBE_WAIT_S = 0.005


class RunInUseError(RuntimeError):
    """The run's lease is held by another process (or by another lease of this one), or was lost to one."""


def _machine() -> dict:
    """What tells this machine's process table apart: the boot and the pid namespace (containers sharing a host
    name, as with `--network host`, number their processes apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: the pid of a holder is never judged
        return {}
    return {"boot": boot, "pidns": pidns}


def _holder(command: str) -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": command,
        "since": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **_machine(),
    }


def describe(holder: dict | None) -> str:
    """'`lockstep resume` (pid 4242 on host h1, since 2026-12-04T12:00:00Z)', or what is known of it."""
    if not holder:
        return "another process (its lease names no holder yet)"
    return (
        f"`lockstep {holder.get('command', '?')}` (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"since {holder.get('since', '?')})"
    )


def _in_use(lake: Lake, run_id: str, holder: dict | None, command: str) -> RunInUseError:
    """The refusal, with what to do for the command refused: a `train` or `replay --to` chooses another run id (the
    holder may be a live run: never advise to kill it), a `resume` waits or stops the holder."""
    if command == "replay":
        todo = "choose another --to"
    elif command == "train":
        todo = "choose another run.run_id, or wait for it to end and then `lockstep resume`"
    else:
        pid = holder.get("pid") if holder else None
        stop = f"stop it (kill {pid} on its host, or Ctrl-C where it runs) " if pid else "stop it "
        todo = f"wait for it to end, or {stop}and then `lockstep resume {run_id} --lake {lake.uri}`"
    expiry = ""
    if holder and isinstance(holder.get("renewed"), (int, float)):  # a remote lease: when it lapses if its holder died
        age = max(0.0, time.time() - holder["renewed"])
        expiry = f"; its lease was renewed {age:.0f} s ago and lapses {TTL_S:.0f} s after its last renewal"
    return RunInUseError(
        f"run {run_id} in {lake.uri} is in use by {describe(holder)}{expiry}: one process at a time "
        f"writes a run; {todo}"
    )


def _live(lease: dict) -> bool:
    """Whether a remote lease still holds: renewed within `TTL_S` (a renewal time more than `TTL_S` ahead of this
    clock is not believed), and not by a process of this machine that is gone."""
    renewed = lease.get("renewed")
    return isinstance(renewed, (int, float)) and abs(time.time() - renewed) < TTL_S and _alive_here(lease)


def _alive_here(holder: dict) -> bool:
    """Whether a holder is still running: False only for a pid that is gone from this machine's own process table
    (same host, boot and pid namespace); True when it cannot be told."""
    here = _machine()
    if (
        holder.get("host") != socket.gethostname()
        or not here
        or any(holder.get(k) != v for k, v in here.items())
        or not isinstance(holder.get("pid"), int)
    ):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class RunLease:
    """A held lease; `release()` (idempotent) gives the run back, `check()` raises if it was lost."""

    def __init__(self, lake: Lake, run_id: str, fd: int | None = None, token: str | None = None):
        self.lake, self.run_id, self._fd, self._token = lake, run_id, fd, token
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost: dict | None = None  # the lease found in place of this one by a renewal

    def check(self) -> None:
        """RunInUseError if a renewal found the lease taken over: another process may now write the run, so this
        one stops before it promotes anything more."""
        if self.lost is not None:
            raise RunInUseError(
                f"run {self.run_id} in {self.lake.uri}: this process lost the run's lease to "
                f"{describe(self.lost)} (not renewed within {TTL_S:.0f} s, or taken in the same "
                "moment); stopping before it writes more; `lockstep runs` shows who holds it now"
            )

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)  # no holder named once it is free; the file stays (see `acquire`)
                fcntl.flock(fd, fcntl.LOCK_UN)  # now, not when the last copy of this descriptor closes
            except OSError:
                pass
            os.close(fd)
        if self._token is not None:
            token, self._token = self._token, None
            self._stop.set()
            if self._renewer is not None:
                self._renewer.join()
            fs, path = self.lake.store, _lease_path(self.lake, self.run_id)
            with contextlib.suppress(FileNotFoundError):
                if (_read_remote(fs, path) or {}).get("token") == token:
                    fs.rm(path)

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _renew(self, holder: dict) -> None:
        fs, path = self.lake.store, _lease_path(self.lake, self.run_id)
        log = logging.getLogger("lockstep")
        while not self._stop.wait(RENEW_S):
            try:
                current = _read_remote(fs, path) or {}
                if current.get("token") != holder["token"]:
                    self.lost = current
                    log.error(
                        "run %s: its lease is now held by %s; this process stops at its next iteration",
                        self.run_id,
                        describe(current),
                    )
                    return
                fs.pipe_file(path, json.dumps({**holder, "renewed": time.time()}).encode())
            except Exception as e:  # a store that fails for a while: the next renewal tries again
                log.warning("run %s: lease renewal failed (%s); retrying in %.0f s", self.run_id, e, RENEW_S)


def _lock_path(lake: Lake, run_id: str) -> str:
    return f"{lake.run_dir(run_id)}/{FILES[0]}"


def _lease_path(lake: Lake, run_id: str) -> str:
    return f"{lake.run_dir(run_id)}/{FILES[1]}"


def other_entries(lake: Lake, run_id: str) -> list[str]:
    """The names in run `run_id`'s folder besides its lease files: none for a folder that a start which gave up before
    writing the run's config left (or an empty or missing one)."""
    run_dir = lake.run_dir(run_id)
    if not lake.fs.exists(run_dir):
        return []
    return [n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in lake.fs.ls(run_dir, detail=False)) if n not in FILES]


def _read_remote(fs, path: str) -> dict | None:
    try:
        data = fs.cat_file(path)
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
    """Hold run `run_id`'s lease for `command` ('train', 'resume', 'replay'); RunInUseError naming the holder and
    what to do if another process has it. Creates the run's folder if it does not exist yet. No process may be
    forked while a local lease is held (spawn only, as lockstep's workers are): a forked copy of the descriptor
    would keep the run locked after its holder died."""
    fs = lake.store
    lake.makedirs(lake.run_dir(run_id))
    holder = _holder(command)
    if isinstance(fs, LocalFileSystem):
        # The file is never removed: removing it while another process opens it would give the two of them locks
        # on two different files.
        fd = os.open(_lock_path(lake, run_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        for attempt in range(PROBE_RETRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                held_by = _read_fd(fd)
                if held_by or attempt == PROBE_RETRIES - 1:  # a holder, not a `holder()` probe
                    os.close(fd)
                    raise _in_use(lake, run_id, held_by, command) from None
                time.sleep(PROBE_WAIT_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        return RunLease(lake, run_id, fd=fd)
    path = _lease_path(lake, run_id)
    current = _read_remote(fs, path)
    if current is not None and _live(current):
        raise _in_use(lake, run_id, current, command)
    holder["token"] = uuid.uuid4().hex
    fs.pipe_file(path, json.dumps({**holder, "renewed": time.time()}).encode())
    time.sleep(SETTLE_S)
    current = _read_remote(fs, path)
    if (current or {}).get("token") != holder["token"]:  # a rival wrote after us: its lease stands
        raise _in_use(lake, run_id, current, command)
    lease = RunLease(lake, run_id, token=holder["token"])
    lease._renewer = threading.Thread(target=lease._renew, args=(holder,), name="lockstep-lease", daemon=True)
    lease._renewer.start()
    return lease


def check_free(lake: Lake, run_id: str, command: str) -> None:
    """RunInUseError, worded as `acquire` words it for `command`, if another process holds run `run_id` now. A look
    only: `acquire` decides, and a local lock held by a process that has not written its name yet (or is letting
    go) is left to it, since it waits a moment for the name."""
    if held_by := holder(lake, run_id):
        raise _in_use(lake, run_id, held_by, command)


def holder(lake: Lake, run_id: str) -> dict | None:
    """Who holds run `run_id` now (host, pid, command, since), or None if nobody does."""
    fs = lake.store
    if isinstance(fs, LocalFileSystem):
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
    current = _read_remote(fs, _lease_path(lake, run_id))
    return current if current is not None and _live(current) else None
