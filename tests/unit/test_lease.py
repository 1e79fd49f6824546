"""The run lease (storage/lease.py): one process at a time writes a run, a dead holder frees it at once (local) or
after its TTL (object stores), and the refusal names the holder and what to do."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from flows import cli
from storage import lease
from storage.lake import Lake
from tests.cli_output import cli_stderr, squash

REPO = Path(__file__).resolve().parents[2]


def test_a_held_local_run_refuses_a_second_lease_naming_the_holder(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    held = lease.acquire(lake, "r1", "train")
    now = lease.holder(lake, "r1")
    assert {k: now[k] for k in ("host", "pid", "command")} == {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": "train",
    }
    with pytest.raises(lease.RunInUseError) as e:  # another open file of the same process: flock refuses it too
        lease.acquire(lake, "r1", "resume")
    assert str(e.value) == (
        f"run r1 in {lake.uri} is in use by `lockstep train` (pid {os.getpid()} on host {socket.gethostname()}, "
        f"since {now['since']}): one process at a time writes a run; wait for it to end, or stop it (kill "
        f"{os.getpid()} on its host, or Ctrl-C where it runs) and then `lockstep resume r1 --lake {lake.uri}`"
    )
    # a train or replay --to that meets a live run is told to choose another id, never to kill it
    with pytest.raises(lease.RunInUseError) as e:
        lease.acquire(lake, "r1", "train")
    assert str(e.value).endswith(
        "writes a run; choose another run.run_id, or wait for it to end and then `lockstep resume`"
    ) and "kill" not in str(e.value)
    with pytest.raises(lease.RunInUseError, match="writes a run; choose another --to$"):
        lease.acquire(lake, "r1", "replay")
    assert lease.holder(lake, "r2") is None  # other runs are free
    lease.acquire(lake, "r2", "train").release()
    held.release()
    held.release()  # idempotent
    assert lease.holder(lake, "r1") is None
    assert (tmp_path / "lake/runs/r1/LOCK").read_bytes() == b""  # kept (see acquire), naming nobody
    with lease.acquire(lake, "r1", "resume"):
        assert lease.holder(lake, "r1")["command"] == "resume"
    assert lease.holder(lake, "r1") is None


def test_a_killed_holder_frees_a_local_run_at_once(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    code = (
        "import sys, time; from storage import lease; from storage.lake import Lake; "
        f"lease.acquire(Lake({lake.uri!r}), 'r1', 'train'); print('held', flush=True); time.sleep(120)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(lease.RunInUseError, match=f"`lockstep train` \\(pid {proc.pid} on host "):
            lease.acquire(lake, "r1", "resume")
        assert lease.holder(lake, "r1")["pid"] == proc.pid
        proc.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock with the process
        proc.wait(timeout=30)
        lease.acquire(lake, "r1", "resume").release()
    finally:
        proc.kill()
        proc.wait()


def memory_lake() -> Lake:
    return Lake(f"memory://lease-{uuid.uuid4().hex}")


def write_lease(lake: Lake, run_id: str, **fields) -> None:
    holder = {
        "host": "elsewhere",
        "pid": 7,
        "command": "train",
        "since": "2026-12-04T00:00:00Z",
        "token": "t0",
        "renewed": time.time(),
        **fields,
    }
    lake.fs.makedirs(lake.run_dir(run_id), exist_ok=True)
    lake.fs.pipe_file(f"{lake.run_dir(run_id)}/LEASE.json", json.dumps(holder).encode())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_remote_lease_is_refused_while_renewed_and_taken_over_when_not(monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    lake = memory_lake()
    write_lease(lake, "live", renewed=time.time() - 20)  # another host renewed it 20 s ago
    with pytest.raises(
        lease.RunInUseError,
        match=r"`lockstep train` \(pid 7 on host elsewhere, since .*\); its "
        r"lease was renewed 20 s ago and lapses 60 s after its last renewal",
    ):
        lease.acquire(lake, "live", "resume")
    assert lease.holder(lake, "live")["host"] == "elsewhere"
    # a dead pid of this host name but another pid namespace (a container with --network host) or boot: its own
    # process table is not this one, so only the TTL frees it
    for other in ({"pidns": -1}, {"boot": "another-boot"}):
        write_lease(lake, "other", host=socket.gethostname(), pid=dead_pid(), **{**lease._machine(), **other})
        with pytest.raises(lease.RunInUseError):
            lease.acquire(lake, "other", "resume")
    write_lease(lake, "ahead", renewed=time.time() + lease.TTL_S + 5)  # a clock far ahead is not believed
    assert lease.holder(lake, "ahead") is None
    # renewed 61 s ago (TTL 60 s); a process of this host that is gone; damaged; a renewal time that is no number
    write_lease(lake, "stale", renewed=time.time() - lease.TTL_S - 1)
    write_lease(lake, "dead", host=socket.gethostname(), pid=dead_pid(), **lease._machine())
    write_lease(lake, "text", renewed="soon")
    lake.fs.pipe_file(f"{lake.run_dir('damaged')}/LEASE.json", b"{cut sh")
    for run_id in ("stale", "dead", "text", "damaged"):
        assert lease.holder(lake, run_id) is None, run_id
        with lease.acquire(lake, run_id, "resume"):
            assert lease.holder(lake, run_id)["pid"] == os.getpid()
            with pytest.raises(lease.RunInUseError):  # this process holds it now
                lease.acquire(lake, run_id, "train")
        assert not lake.fs.exists(f"{lake.run_dir(run_id)}/LEASE.json")  # released: removed
        assert lease.holder(lake, run_id) is None


def test_a_look_at_a_lease_refuses_as_acquire_does_and_leaves_an_unnamed_holder_to_it(tmp_path):
    """`check_free`, the CLI's look before it starts a flow: a live remote lease is refused in `acquire`'s own words,
    a lapsed one is free; a local lock held by a process that has not written its name yet is left to `acquire`,
    which waits a moment for the name."""
    lake = memory_lake()
    write_lease(lake, "live", renewed=time.time() - 20)
    with pytest.raises(lease.RunInUseError) as looked:
        lease.check_free(lake, "live", "resume")
    with pytest.raises(lease.RunInUseError) as acquired:
        lease.acquire(lake, "live", "resume")
    assert str(looked.value) == str(acquired.value)
    assert "its lease was renewed 20 s ago" in str(looked.value)
    write_lease(lake, "stale", renewed=time.time() - lease.TTL_S - 1)
    lease.check_free(lake, "stale", "resume")
    local = Lake(str(tmp_path / "lake"))
    local.makedirs(local.run_dir("r1"))
    fd = os.open(f"{local.run_dir('r1')}/LOCK", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked, no holder written yet
        assert lease.holder(local, "r1") == {}
        lease.check_free(local, "r1", "train")
        os.pwrite(fd, json.dumps({"host": "h1", "pid": 42, "command": "train"}).encode(), 0)
        with pytest.raises(lease.RunInUseError, match=r"is in use by `lockstep train` \(pid 42 on host h1"):
            lease.check_free(local, "r1", "train")
    finally:
        os.close(fd)


def test_a_remote_lease_is_renewed_and_its_renewer_stops_when_taken_over(monkeypatch, caplog):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    monkeypatch.setattr(lease, "RENEW_S", 0.05)
    lake = memory_lake()
    held = lease.acquire(lake, "r1", "train")
    path = f"{lake.run_dir('r1')}/LEASE.json"
    first = json.loads(lake.fs.cat_file(path))["renewed"]
    deadline = time.monotonic() + 10
    while json.loads(lake.fs.cat_file(path))["renewed"] == first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(lake.fs.cat_file(path))["renewed"] > first
    with caplog.at_level(logging.ERROR, logger="lockstep"):
        write_lease(lake, "r1", token="rival")  # what a process that found it expired writes
        deadline = time.monotonic() + 10
        while held._renewer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not held._renewer.is_alive()
    assert "run r1: its lease is now held by `lockstep train` (pid 7 on host elsewhere" in caplog.text
    assert held.lost is not None  # marked lost
    with pytest.raises(
        lease.RunInUseError,
        match="this process lost the run's lease to `lockstep train` "
        r"\(pid 7 on host elsewhere",
    ):
        held.check()  # what the flow asks before each iteration
    held.release()
    assert json.loads(lake.fs.cat_file(path))["token"] == "rival"  # the rival's lease is not removed


def test_a_remote_lease_whose_write_was_overtaken_is_refused(monkeypatch):
    lake = memory_lake()

    def rival_writes(_s):  # another process writes its lease between this one's write and its read-back
        write_lease(lake, "r1", token="rival", pid=99)

    monkeypatch.setattr(lease.time, "sleep", rival_writes)
    with pytest.raises(lease.RunInUseError, match=r"pid 99 on host elsewhere"):
        lease.acquire(lake, "r1", "train")
    assert json.loads(lake.fs.cat_file(f"{lake.run_dir('r1')}/LEASE.json"))["token"] == "rival"


def test_release_stops_the_renewer_before_removing_the_lease(monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    monkeypatch.setattr(lease, "RENEW_S", 0.01)
    lake = memory_lake()
    held = lease.acquire(lake, "r1", "train")
    time.sleep(0.05)
    held.release()
    assert not held._renewer.is_alive()
    time.sleep(0.05)  # a renewer left running would write the lease again
    assert not lake.fs.exists(f"{lake.run_dir('r1')}/LEASE.json")


def test_a_lease_behind_a_cache_is_read_from_the_store(tmp_path):
    # simplecache:: would show each process its own cached copy of LEASE.json; a local store under it gets flock
    cached = Lake(f"simplecache::file://{tmp_path / 'lake'}")
    plain = Lake(str(tmp_path / "lake"))
    with lease.acquire(cached, "r1", "train"):
        assert (tmp_path / "lake/runs/r1/LOCK").exists()
        with pytest.raises(lease.RunInUseError):
            lease.acquire(plain, "r1", "resume")
    lease.acquire(plain, "r1", "resume").release()


def test_a_probe_by_lockstep_runs_does_not_refuse_a_start(tmp_path, monkeypatch):
    # `holder()` takes a shared lock for an instant; an acquire meeting it waits it out instead of refusing
    import fcntl

    lake = Lake(str(tmp_path / "lake"))
    lease.acquire(lake, "r1", "train").release()
    fd = os.open(tmp_path / "lake/runs/r1/LOCK", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the probe, caught holding it
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 3:
            os.close(fd)  # the probe ends

    monkeypatch.setattr(lease.time, "sleep", sleep)
    lease.acquire(lake, "r1", "resume").release()
    assert sleeps == [lease.PROBE_WAIT_S] * 3


# ------------------------------------------------------------------------------------------------ the commands


@pytest.fixture
def held_run(tmp_path):
    """A lake with run r1, whose lease this test process holds as `lockstep train` would."""
    from configs.schema import load_config, resolved_json

    run = tmp_path / "lake" / "runs" / "r1"
    (run / "_tmp").mkdir(parents=True)
    (run / "_tmp" / "in-flight.arrow").write_bytes(b"a shard being written")
    (run / "config.json").write_text(resolved_json(load_config(None, ["run.run_id=r1", "tracking.enabled=false"])))
    lake = Lake(str(tmp_path / "lake"))
    with lease.acquire(lake, "r1", "train"):
        yield tmp_path / "lake"


def test_resume_of_a_run_in_use_exits_2_and_touches_nothing(held_run, capfd, monkeypatch):
    # the real flow: open_session takes the lease before it clears _tmp/ (where the running one writes); the CLI's
    # look (tasks.preflight.check_run_free, tested in test_cli_commands) finds it free, as when the other process
    # takes the run just after it
    from tasks import preflight

    monkeypatch.setattr(preflight, "check_run_free", lambda cfg, resume: None)
    code = cli.main(["resume", "r1", "--lake", str(held_run)])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "Encountered exception" not in err
    assert squash(f"error: run r1 in {held_run} is in use by `lockstep train` (pid {os.getpid()} on host") in (
        squash(err)
    )
    assert (held_run / "runs/r1/_tmp/in-flight.arrow").read_bytes() == b"a shard being written"


def test_runs_shows_a_run_in_use_as_running_with_its_holder(held_run, capsys):
    assert cli.main(["runs", "--lake", str(held_run)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == ["r1", "running"]
    assert f"(`lockstep train` (pid {os.getpid()} on host {socket.gethostname()}, since " in line


@pytest.mark.parametrize("look", [True, False], ids=["the-cli-looks", "the-flow-acquires"])
def test_replay_into_a_run_in_use_exits_2(held_run, capsys, monkeypatch, look):
    """Refused by the CLI's look at the lease (tasks.preflight.check_replayable), or, where the target is taken after
    it, by the flow's own `acquire`: the same words either way."""
    import flows.replay

    if look:
        monkeypatch.setattr(flows.replay, "replay_flow", lambda **kw: pytest.fail("the replay flow must not start"))
    else:
        monkeypatch.setattr(lease, "check_free", lambda lake, run_id, command: None)
    (held_run / "runs/r1/checkpoints/v000000").mkdir(parents=True)
    (held_run / "runs/r1/checkpoints/v000000/MANIFEST.json").write_text("{}")
    (held_run / "runs/r1/checkpoints/PROMOTED").write_text('{"version": 0}')
    lake = Lake(str(held_run))
    with lease.acquire(lake, "r2", "train"):  # r2: a `train` that holds the lease and has not written its config
        assert cli.main(["replay", "r1", "--lake", str(held_run), "--to", "r2"]) == 2
    err = cli_stderr(capsys)
    assert squash(f"error: cannot replay 'r1': run r2 in {held_run} is in use by `lockstep train`") in err
    assert err.endswith(squash("one process at a time writes a run; choose another --to\n"))
    assert sorted(p.name for p in (held_run / "runs/r2").iterdir()) == ["LOCK"]


def test_replay_of_a_run_without_a_promoted_version_exits_2(held_run, capsys):
    # a run still in its bootstrap has no v0: replay failed with the model loader's OSError traceback
    assert cli.main(["replay", "r1", "--lake", str(held_run)]) == 2
    assert squash(
        f"error: cannot replay 'r1': run r1 has no promoted version in {held_run} yet (v0 is promoted "
        "once its bootstrap ends)"
    ) in cli_stderr(capsys)
    (held_run / "runs/r1/checkpoints").mkdir()  # PROMOTED names v0, whose folder was removed since
    (held_run / "runs/r1/checkpoints/PROMOTED").write_text('{"version": 0}')
    assert cli.main(["replay", "r1", "--lake", str(held_run)]) == 2
    assert squash(
        f"error: cannot replay 'r1': run r1's checkpoint v0 ({held_run}/runs/r1/checkpoints/v000000) has "
        "no MANIFEST.json"
    ) in cli_stderr(capsys)


@pytest.mark.parametrize("error", [OSError("no space left on device"), KeyboardInterrupt()], ids=["oserror", "ctrl-c"])
def test_a_session_that_fails_to_open_gives_the_lease_back(tmp_path, monkeypatch, error):
    from configs.schema import load_config, resolved_json
    from tasks import session

    lake = Lake(str(tmp_path / "lake"))
    seen = []

    def fail(cfg, lake, run_id, device, resume, on_progress):
        seen.append(lease.holder(lake, run_id)["command"])
        raise error

    monkeypatch.setattr(session, "_open_held", fail)
    cfg = load_config(None, ["run.run_id=r1", f"lake.uri={lake.uri}", "tracking.enabled=false"])
    with pytest.raises(type(error)):
        session.open_session(cfg)
    (tmp_path / "lake/runs/r1/config.json").write_text(resolved_json(cfg))
    with pytest.raises(type(error)):
        session.open_session(cfg, resume=True)
    assert seen == ["train", "resume"]
    assert lease.holder(lake, "r1") is None


def test_a_train_that_finds_the_run_created_under_the_lease_is_refused(tmp_path, monkeypatch):
    # two `train`s of one run id: the other wrote config.json and ended while this one checked its inputs
    from configs.schema import load_config
    from tasks import session

    cfg = load_config(None, ["run.run_id=r1", f"lake.uri={tmp_path / 'lake'}", "tracking.enabled=false"])
    acquire = lease.acquire

    def acquire_after_the_other(lake, run_id, command):
        (tmp_path / "lake/runs/r1").mkdir(parents=True, exist_ok=True)
        (tmp_path / "lake/runs/r1/config.json").write_text("{}")
        return acquire(lake, run_id, command)

    monkeypatch.setattr(lease, "acquire", acquire_after_the_other)
    with pytest.raises(session.RunExistsError, match="run r1 already exists in .*: continue it with `lockstep resume"):
        session.open_session(cfg)
    assert (tmp_path / "lake/runs/r1/config.json").read_text() == "{}"  # not overwritten
    assert lease.holder(Lake(str(tmp_path / "lake")), "r1") is None


def test_a_train_of_a_run_in_use_names_its_holder(held_run):
    from configs.schema import load_config
    from tasks import session

    cfg = load_config(None, ["run.run_id=r1", f"lake.uri={held_run}", "tracking.enabled=false"])
    with pytest.raises(session.RunExistsError) as e:
        session.open_session(cfg)
    assert str(e.value).startswith(
        f"run r1 already exists in {held_run} and is in use by `lockstep train` (pid {os.getpid()} on host "
    )
    assert str(e.value).endswith("choose another run.run_id")


def test_replay_into_a_target_created_under_the_lease_is_refused(tmp_path, monkeypatch):
    from flows import replay

    lake = Lake(str(tmp_path / "lake"))
    acquire = lease.acquire

    def acquire_after_the_other(lake_, run_id, command):
        (tmp_path / "lake/runs/r2").mkdir(parents=True, exist_ok=True)
        (tmp_path / "lake/runs/r2/config.json").write_text("{}")
        return acquire(lake_, run_id, command)

    monkeypatch.setattr(replay, "check_replayable", lambda lake, run_id, to_run_id=None: None)
    monkeypatch.setattr(lease, "acquire", acquire_after_the_other)
    with pytest.raises(FileExistsError, match="replay target run r2 already exists"):
        replay.replay_flow.fn(run_id="r1", lake_uri=lake.uri, to_run_id="r2")
    assert lease.holder(lake, "r2") is None


def test_runs_skips_the_lease_of_a_start_that_gave_up(tmp_path, capsys):
    lake = Lake(str(tmp_path / "lake"))
    lease.acquire(lake, "gone", "train").release()  # a folder holding only LOCK
    (tmp_path / "lake/runs/empty").mkdir()
    assert cli.main(["runs", "--lake", str(tmp_path / "lake")]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["empty"]
    with lease.acquire(lake, "gone", "train"):  # held: a start between its lease and its config
        assert cli.main(["runs", "--lake", str(tmp_path / "lake")]) == 0
        assert "gone" in capsys.readouterr().out


def test_a_local_lock_held_by_a_holder_not_yet_named_is_refused_after_the_probe_retries(tmp_path, monkeypatch):
    """A start between its flock and its write of LOCK holds the run: after `PROBE_RETRIES` tries (it is not a
    `holder()` probe, which lets go at once) the second start is refused, and `holder()` reports it as held."""
    lake = Lake(str(tmp_path / "lake"))
    lease.acquire(lake, "r1", "train").release()  # LOCK exists, empty
    fd = os.open(tmp_path / "lake/runs/r1/LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held, no holder written yet
    sleeps = []
    monkeypatch.setattr(lease.time, "sleep", sleeps.append)
    try:
        with pytest.raises(lease.RunInUseError, match=r"in use by another process \(its lease names no holder yet\)"):
            lease.acquire(lake, "r1", "resume")
        assert sleeps == [lease.PROBE_WAIT_S] * (lease.PROBE_RETRIES - 1)
        assert os.pread(fd, 4096, 0) == b""  # the refused start wrote nothing
        assert lease.holder(lake, "r1") == {}  # held, by nobody named yet: not free
        # a holder that has named itself is refused at once, without the probe's retries
        os.pwrite(fd, json.dumps({"host": "h1", "pid": 4242, "command": "train", "since": "s"}).encode(), 0)
        sleeps.clear()
        with pytest.raises(lease.RunInUseError, match=r"`lockstep train` \(pid 4242 on host h1"):
            lease.acquire(lake, "r1", "resume")
        assert sleeps == []
    finally:
        os.close(fd)
    lease.acquire(lake, "r1", "resume").release()  # free once that holder is gone


def test_a_lease_taken_over_the_name_of_a_killed_holder_names_the_new_holder(tmp_path):
    """A SIGKILLed holder leaves its name in LOCK (no release ran); the next holder's name, shorter, must not be
    read with the old one's tail: `holder()` and a refusal name the new holder."""
    lake = Lake(str(tmp_path / "lake"))
    (tmp_path / "lake/runs/r1").mkdir(parents=True)
    killed = {"host": "a-much-longer-host-name-than-this-one", "pid": 1234567, "command": "replay", "since": "x" * 400}
    (tmp_path / "lake/runs/r1/LOCK").write_text(json.dumps(killed))
    with lease.acquire(lake, "r1", "resume"):
        now = lease.holder(lake, "r1")
        assert (now["pid"], now["command"], now["host"]) == (os.getpid(), "resume", socket.gethostname())
        with pytest.raises(lease.RunInUseError, match=rf"`lockstep resume` \(pid {os.getpid()} on host "):
            lease.acquire(lake, "r1", "train")


def test_a_remote_lease_taken_over_by_another_lease_is_lost_to_it(monkeypatch):
    """A holder that stalled past the TTL is taken over by a second `acquire` (found expired): the first one's next
    renewal finds the second one's lease, marks itself lost and writes nothing; the second keeps the run."""
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    monkeypatch.setattr(lease, "RENEW_S", 3600.0)  # the first holder's renewer waits: it is run by hand below
    lake = memory_lake()
    path = f"{lake.run_dir('r1')}/LEASE.json"
    first = lease.acquire(lake, "r1", "train")
    first._stop.set()
    first._renewer.join()
    first_holder = json.loads(lake.fs.cat_file(path))
    with monkeypatch.context() as m:
        m.setattr(lease, "_live", lambda current: False)  # the first holder is seen as stalled past the TTL
        second = lease.acquire(lake, "r1", "resume")
    second_holder = json.loads(lake.fs.cat_file(path))
    assert second_holder["command"] == "resume" and second_holder["token"] != first_holder["token"]
    monkeypatch.setattr(lease, "RENEW_S", 0.01)
    first._stop.clear()
    renewer = threading.Thread(target=first._renew, args=(first_holder,), daemon=True)
    renewer.start()
    renewer.join(timeout=10)
    alive = renewer.is_alive()
    first._stop.set()  # stops a renewer that did not notice the takeover
    renewer.join()
    assert not alive
    assert first.lost is not None and first.lost["token"] == second_holder["token"]
    with pytest.raises(lease.RunInUseError, match=r"this process lost the run's lease to `lockstep resume`"):
        first.check()
    second.check()
    assert json.loads(lake.fs.cat_file(path))["token"] == second_holder["token"]  # not overwritten by the first
    first.release()
    assert json.loads(lake.fs.cat_file(path))["token"] == second_holder["token"]  # nor removed
    second.release()
    assert not lake.fs.exists(path)


def test_a_renewal_that_fails_is_tried_again(monkeypatch, caplog):
    """A store that fails for a while (an OSError of the connection) does not end the renewals: the next one
    renews the lease, so it is not left to lapse while the run goes on."""
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    monkeypatch.setattr(lease, "RENEW_S", 0.02)
    lake = memory_lake()
    path = f"{lake.run_dir('r1')}/LEASE.json"
    fs = lake.store
    write = fs.pipe_file
    failures = []
    held_box: list = []  # the lease once acquired: only its renewals fail

    def flaky(p, data, **kw):
        if p.endswith("LEASE.json") and held_box and len(failures) < 2:
            failures.append(p)
            raise OSError("503 Service Unavailable")
        return write(p, data, **kw)

    monkeypatch.setattr(fs, "pipe_file", flaky)
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        held = lease.acquire(lake, "r1", "train")
        held_box.append(held)  # from here on the store fails twice
        first = json.loads(lake.fs.cat_file(path))["renewed"]
        deadline = time.monotonic() + 10
        while json.loads(lake.fs.cat_file(path))["renewed"] == first and time.monotonic() < deadline:
            time.sleep(0.01)
        renewed = json.loads(lake.fs.cat_file(path))["renewed"]
        alive = held._renewer.is_alive()
        held.release()
    assert len(failures) == 2 and alive and renewed > first
    assert "run r1: lease renewal failed (503 Service Unavailable); retrying in 0 s" in caplog.text
    assert held.lost is None


def test_a_holder_of_this_machine_run_by_another_user_is_alive(monkeypatch):
    """A pid of this machine's process table that signal 0 may not reach (EPERM: another user's process) is a live
    holder: its lease is not taken over."""
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    lake = memory_lake()
    write_lease(lake, "r1", host=socket.gethostname(), pid=4242, **lease._machine())
    kill = os.kill

    def kill_other_user(pid, sig):
        if pid == 4242:
            raise PermissionError(1, "Operation not permitted")
        return kill(pid, sig)

    monkeypatch.setattr(lease.os, "kill", kill_other_user)
    assert lease.holder(lake, "r1")["pid"] == 4242
    with pytest.raises(lease.RunInUseError, match=r"`lockstep train` \(pid 4242 on host "):
        lease.acquire(lake, "r1", "resume")


@pytest.mark.parametrize("content", [b"[]", b'"text"', b"42", b"null"])
def test_a_remote_lease_that_is_json_but_no_object_names_no_holder(monkeypatch, content):
    """LEASE.json edited or damaged into JSON that is no object: it names no holder and nothing renews it, like a
    cut-short one; the run is free and can be taken."""
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    lake = memory_lake()
    lake.fs.pipe_file(f"{lake.run_dir('r1')}/LEASE.json", content)
    assert lease.holder(lake, "r1") is None
    with lease.acquire(lake, "r1", "resume"):
        assert lease.holder(lake, "r1")["pid"] == os.getpid()


def test_the_lease_file_of_a_remote_run_is_no_entry_of_it():
    """`other_entries` (what `lockstep runs` and `replay --to` judge a run folder by) leaves out LEASE.json, as it
    does LOCK: a remote folder a start left with only its lease (killed before it wrote the config) is no run."""
    lake = memory_lake()
    write_lease(lake, "gone", renewed=time.time() - lease.TTL_S - 1)  # a holder killed before its config
    assert lease.other_entries(lake, "gone") == []
    lake.fs.pipe_file(f"{lake.run_dir('gone')}/config.json", b"{}")
    assert lease.other_entries(lake, "gone") == ["config.json"]


def test_release_frees_a_local_run_while_a_copy_of_its_descriptor_is_still_open(tmp_path):
    """A copy of the LOCK descriptor (a child forked while the lease was held and not yet exec'd or exited) shares
    its flock: `release()` unlocks it at once rather than when the last copy closes."""
    lake = Lake(str(tmp_path / "lake"))
    held = lease.acquire(lake, "r1", "train")
    copy = os.dup(held._fd)
    try:
        held.release()
        assert lease.holder(lake, "r1") is None
        lease.acquire(lake, "r1", "resume").release()
    finally:
        os.close(copy)
