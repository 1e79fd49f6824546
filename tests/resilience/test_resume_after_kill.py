"""SIGKILL the run at distinct points, resume it, and compare with an uninterrupted run.

The killed run is a real `lockstep train` process; a failpoint (storage/faults.py) SIGKILLs it (or, for
`shard-write`, one of its rollout workers) at the chosen place. `lockstep resume` then continues the run: the
command's code in this test's process (`_resume_here`: the same code and lake, ~15 s less CPU each than a new
process's imports and fork server), or its own process after a SIGTERM to the command alone (and on S3,
tests/resilience/test_object_store).
Asserted: final parameters equal the uninterrupted run's (periodic-invariant tolerance, 1e-5), every sample
appears exactly once in the lake, and every iteration trained only samples of its own policy version.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.train import train_flow
from storage import ledger
from storage.lake import Lake
from storage.shards import read_shard, table_to_records
from tests.integration.runs import final_params, mlflow_run, write_config

ITERS = 3
REPO = Path(__file__).resolve().parents[2]


def _lockstep(
    args: list[str], tmp: Path, fault: str | None = None, survivors: list | None = None, api: str | None = None
) -> tuple[int, str]:
    """Run the CLI in its own process group; afterwards kill whatever the run left behind (a SIGKILLed flow
    cannot stop its Prefect API server subprocess), so pipes close and nothing leaks into later tests. With
    `survivors`, first give the group 20 s to empty and put the command lines of what is still alive in it.
    With `api`, the run talks to that Prefect API instead of starting its own ephemeral server."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LOCKSTEP_FAULT", None)
    env.pop("PREFECT_API_URL", None)
    if api:
        env["PREFECT_API_URL"] = api
    if fault:
        env["LOCKSTEP_FAULT"] = fault
    log = tmp / f"{args[0]}-{(fault or 'clean').replace('@', '-')}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # as from a terminal: a background job's children (the suite's, maybe) start with SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            code = proc.wait(timeout=600)
            if survivors is not None:
                deadline = time.monotonic() + 20
                while (alive := [cmd for _, state, cmd in _group(proc.pid) if state != "Z"]) and (
                    time.monotonic() < deadline
                ):
                    time.sleep(0.2)
                survivors.extend(alive)
        finally:
            _kill_group(proc.pid)
    return code, log.read_text()


def _resume_here(run_id: str, lake_uri: str) -> int:
    """`lockstep resume RUN_ID --lake LAKE_URI` in this process: what the command's process runs (`flows.cli.main`),
    talking to this process's Prefect API (the `api` fixture's) and starting workers from its fork server. Nothing of
    the run is in this process before (it was trained by a process now killed): everything is read from the lake, as
    a new process reads it. What the command prints is in the test's captured output. As a command's process would
    be, it is stopped after 600 s (the test then fails, not hangs); the SIGTERM handler and environment variables the
    command sets for its process are put back after it."""
    from flows import cli
    from tests.unit.test_train_ranks import _deadline

    handler, environ = signal.getsignal(signal.SIGTERM), dict(os.environ)
    try:
        with _deadline(600):
            return cli.main(["resume", run_id, "--lake", lake_uri])
    finally:
        signal.signal(signal.SIGTERM, handler)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group, multiprocessing's resource trackers last: once every other member is gone a tracker
    unlinks the semaphores its killed clients registered and exits. Killed with the rest, it left 9 POSIX semaphores
    in /dev/shm per kill-and-resume test (counted here)."""
    trackers = []
    for pid, _, cmd in _group(pgid):
        if "resource_tracker" in cmd:
            trackers.append(pid)
            continue
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while trackers and time.monotonic() < deadline:
        trackers = [p for p in trackers if (_stat(p) or ["Z"])[0] != "Z"]  # gone or a zombie: done
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group(pgid: int) -> list[tuple[str, str, str]]:
    """(pid, state, command line) of each process of process group `pgid` ("Z" is a zombie's state)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        stat = _stat(entry)
        if stat is None or int(stat[2]) != pgid:  # field 5 of /proc/PID/stat: the process group
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out.append((entry, stat[0], f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:
            continue
    return out


def _stat(pid: str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None if there is no such process."""
    if not pid.isdigit():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    train_flow(config_path=write_config(tmp, "ref", {"run.iterations": ITERS}))
    return tmp, final_params(str(tmp / "lake"), "ref", ITERS)


@pytest.fixture(scope="module")
def api(reference) -> str:
    """The Prefect API the CLI runs of these tests share: the ephemeral server this test process started for the
    reference run (Prefect keeps one per process). A run's own ephemeral server costs ~8 s of a ~30-s tiny run;
    killed and resumed runs behave the same on either. The SIGTERM test still starts its own, to see it stopped."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's client started; start() returns at once if running
    server.start()
    return server.api_url


# (failpoint, expected exit of the killed run): -9 when the flow's own process is killed, 1 when a rollout
# worker dies mid-write and the flow fails cleanly (ledger marks the iteration failed).
POINTS = [
    ("after-plan@2", -9),  # mid-rollout of iteration 1
    ("shard-write@3", 1),  # a rollout worker killed between writing a shard's bytes and publishing it
    ("mid-train[1]@2", -9),  # iteration 1, after two of its micro-steps
    ("mid-checkpoint@2", -9),  # checkpoint v2 written under _tmp, not moved into place
    ("before-promote@2", -9),  # checkpoint v2 complete, PROMOTED still says v1
    ("after-promote@1", -9),  # PROMOTED says v1, the ledger still says iteration 0 'trained'
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,exit_code", POINTS, ids=[p[0] for p in POINTS])
def test_kill_and_resume_equals_uninterrupted(reference, fault, exit_code, api):
    tmp, ref_params = reference
    run_id = "k-" + fault.replace("@", "-").replace("[", "-").replace("]", "")
    cfg = write_config(tmp, run_id, {"run.iterations": ITERS})
    code, log = _lockstep(["train", cfg], tmp, fault=fault, api=api)
    assert code == exit_code, log[-3000:]
    if exit_code == 1:  # the flow failed: its last line says what failed and how to continue the run
        assert log.rstrip().endswith(f"`lockstep resume {run_id} --lake {tmp / 'lake'}`"), log[-3000:]
        # which worker, and how it ended: the failpoint SIGKILLs it, as the kernel's out-of-memory killer would
        line = rf"error: run {run_id} failed: WorkerError: rollout worker \d \(pid \d+\) died \(exit code -9, SIGKILL: "
        assert re.search(line + r"killed by the kernel's out-of-memory killer \(see `dmesg`\)", log), log[-3000:]
    lake_uri = str(tmp / "lake")
    lake = Lake(lake_uri)
    assert ledger.read_record(lake, run_id, ITERS - 1) is None or ledger.read_all(lake, run_id)[-1]["state"] != (
        "promoted"
    ), "the killed run should not have finished"

    assert _resume_here(run_id, lake_uri) == 0

    params = final_params(lake_uri, run_id, ITERS)
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    assert diff <= 1e-5, f"resumed run differs from the uninterrupted one by {diff}"

    records = ledger.read_all(lake, run_id)
    assert [r["state"] for r in records] == ["promoted"] * ITERS
    seen = set()
    for k, rec in enumerate(records):
        groups = 0
        for sh in rec["shards"]:  # what the trainer consumed in iteration k
            assert f"/policy_version={k}/iter-{k:06d}/" in sh["path"]
            rows = table_to_records(read_shard(lake, sh["path"]))
            assert {r.policy_version for r in rows} == {k}
            for r in rows:
                key = (r.iteration, r.group_id, r.sample_index)
                assert key not in seen, f"sample {key} trained twice"
                seen.add(key)
            groups += sh["groups"]
        assert groups == 8
    # the catalog indexes every trained sample exactly once, also those of iterations cut short
    from storage import catalog

    rows = catalog.query(catalog.catalog_uri(lake, run_id), catalog.ROLLOUTS).to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)) == ITERS * 8 * 4
    assert all(rec.get("cataloged") for rec in records)
    # nothing stray is left in the rollouts folders either (a duplicate chunk would show here)
    on_disk = lake.fs.glob(f"{lake.run_dir(run_id)}/rollouts/*/*/*.arrow")
    assert len(on_disk) == ITERS * 4


@pytest.mark.slow
def test_two_trainer_ranks_killed_mid_train_leave_nothing_running_and_resume(reference, api):
    """`resources.train_ranks: 2` sharding the optimizer, the flow's process SIGKILLed mid-train: its spawned trainer
    rank ends with it (no process of the run is left), `lockstep resume` (two ranks again) equals the uninterrupted
    one-rank run, and a replay of the resumed run is bitwise equal to it. The checkpoints' optimizer state was
    gathered from both ranks, and the resume hands each rank its half back. (Replicated ranks resume through the
    same path but for the optimizer's state, which rank 0 then holds alone, as one rank does.)"""
    tmp, ref_params = reference
    settings = {"run.iterations": ITERS, "resources.train_ranks": 2, "resources.shard_optimizer": True}
    cfg = write_config(tmp, "k-ranks", settings)
    survivors: list[str] = []
    code, log = _lockstep(["train", cfg], tmp, fault="mid-train[1]@2", survivors=survivors, api=api)
    assert code == -9, log[-3000:]
    assert not [cmd for cmd in survivors if "resource_tracker" not in cmd], survivors
    lake_uri = str(tmp / "lake")
    assert _resume_here("k-ranks", lake_uri) == 0
    params = final_params(lake_uri, "k-ranks", ITERS)
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    assert diff <= 1e-5, f"the resumed two-rank run differs from the uninterrupted one-rank run by {diff}"
    assert [r["figures"]["train/ranks"] for r in ledger.read_all(Lake(lake_uri), "k-ranks")] == [2.0] * ITERS
    # a replay of it (two ranks again) takes the same micro-batches, hence the same split and sums: bitwise equal
    from flows.replay import _replay

    assert [r["max_abs_diff"] for r in _replay("k-ranks", Lake(lake_uri))] == [0.0] * ITERS


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop", ["TERM", "INT", "GROUPTERM"], ids=["sigterm", "ctrl-c-to-the-group", "sigterm-to-the-group"]
)
def test_a_stop_ends_the_run_cleanly_and_resume_completes_it(reference, api, stop):
    """SIGTERM (`kill`) mid-train, a terminal's Ctrl-C (SIGINT to the whole process group: the command, its rollout
    workers and its temporary Prefect API server) or SIGTERM to the whole group (a job scheduler, systemd,
    `timeout`) unwinds the run: exit 130 and the resume command on the console, no traceback, the MLflow run ended
    KILLED, nothing of the run left alive (rollout workers, the ephemeral Prefect API server); `lockstep resume`
    then finishes it equal to the uninterrupted run. (Before flows/api_server.py, a signal to the group shut the API
    server down first, and the command ended ~75 s later in a ConnectError traceback, exit 1; a rollout worker
    killed by the group's SIGTERM failed its rollout task with a traceback.)"""
    tmp, ref_params = reference
    run_id = f"k-{stop.lower()}"
    cfg = write_config(tmp, run_id, {"run.iterations": ITERS})
    left: list[str] = []
    code, log = _lockstep(["train", cfg], tmp, fault=f"mid-train[1]@2:{stop}", survivors=left)
    assert code == 130, log[-3000:]
    lake_uri = str(tmp / "lake")
    assert f"lockstep resume {run_id} --lake {lake_uri}" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "Crash detected" not in log and "Crashed" not in log, log[-3000:]  # Prefect's ERROR lines for a stop
    # the CLI reports itself
    assert left == [], f"still running 20 s after the run stopped: {left}"
    assert mlflow_run(tmp, run_id)[1].info.status == "KILLED"
    lake = Lake(lake_uri)
    states = [r["state"] for r in ledger.read_all(lake, run_id)]
    assert states[0] == "promoted" and states[-1] != "promoted"

    if stop == "TERM":  # a new process, as from the terminal the run was stopped in
        code, log = _lockstep(["resume", run_id, "--lake", lake_uri], tmp, api=api)
        assert code == 0, log[-3000:]
    else:
        assert _resume_here(run_id, lake_uri) == 0
    assert [r["state"] for r in ledger.read_all(lake, run_id)] == ["promoted"] * ITERS
    params = final_params(lake_uri, run_id, ITERS)
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    assert diff <= 1e-5, f"resumed run differs from the uninterrupted one by {diff}"
    assert mlflow_run(tmp, run_id)[1].info.status == "FINISHED"


@pytest.mark.slow
def test_damaged_shards_are_quarantined_and_regenerated(reference, api):
    """Kill mid-rollout, then truncate one shard of the interrupted iteration and flip a bit in another:
    resume must detect both, move them to quarantine/, regenerate them, and still equal the reference.

    Checkpoints are written before the workers get a version (`push_weights: false`): written in the background,
    v1's could still be in flight at the kill, and resume would then rightly set every v1 shard aside as never
    durable (the test above) before looking at their bytes. The final weights do not depend on the setting
    (tests/invariants/test_periodic_equals_sync.py)."""
    tmp, ref_params = reference
    run_id = "k-damaged"
    cfg = write_config(tmp, run_id, {"run.iterations": ITERS, "pipeline.push_weights": False})
    code, log = _lockstep(["train", cfg], tmp, fault="mid-train[1]@2", api=api)
    assert code == -9, log[-3000:]
    lake_uri = str(tmp / "lake")
    lake = Lake(lake_uri)
    shards = sorted(lake.fs.glob(f"{lake.run_dir(run_id)}/rollouts/policy_version=1/iter-000001/*.arrow"))
    assert len(shards) >= 2, shards
    data = Path(shards[0]).read_bytes()
    Path(shards[0]).write_bytes(data[: len(data) // 2])  # truncated
    data = bytearray(Path(shards[1]).read_bytes())
    data[data.index(b"Q: ")] ^= 0x01  # one flipped bit inside the prompt text ('Q' -> 'P')
    Path(shards[1]).write_bytes(bytes(data))

    assert _resume_here(run_id, lake_uri) == 0
    rec = ledger.read_record(lake, run_id, 1)
    assert len(rec["quarantined"]) == 2, rec.get("quarantined")
    assert all(lake.fs.exists(q) for q in rec["quarantined"])
    params = final_params(lake_uri, run_id, ITERS)
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    assert diff <= 1e-5, f"resumed run differs from the uninterrupted one by {diff}"
    for sh in rec["shards"]:  # the regenerated shards read cleanly
        read_shard(lake, sh["path"], sh["checksum"])


@pytest.mark.slow
def test_async_run_killed_mid_train_resumes_within_the_staleness_bound(reference, api):
    """An async run (max_staleness 2, interruption on) SIGKILLed mid-train resumes: later batches' shards already in
    the lake are reused, the run completes, every sample appears once, and no trained token is more than 2 versions
    behind (async runs are not reproducible to the bit: which version made a token depends on timing). It recomputes
    its proximal policy, so the resumed trainer needs the weights one version back (a trainer without them refuses
    a token 2 versions behind)."""
    tmp, _ = reference
    run_id = "k-async"
    iters = 5
    cfg = write_config(
        tmp,
        run_id,
        {
            "run.iterations": iters,
            "pipeline.mode": "async",
            "pipeline.max_staleness": 2,
            "rollout.interrupt_on_update": True,
            "algorithm.prox_logp": "recompute",
        },
    )
    code, log = _lockstep(
        ["train", cfg], tmp, fault="mid-train[2]@2", api=api
    )  # iteration 2, after 2 of its micro-steps
    assert code == -9, log[-3000:]
    lake = Lake(str(tmp / "lake"))
    assert [r["state"] for r in ledger.read_all(lake, run_id)][:2] == ["promoted", "promoted"]
    assert _resume_here(run_id, str(tmp / "lake")) == 0
    records = ledger.read_all(lake, run_id)
    assert [r["state"] for r in records] == ["promoted"] * iters
    assert records[2].get("reused_chunks"), "the interrupted batch's published shards were not reused"
    seen = set()
    for k, rec in enumerate(records):
        for sh in rec["shards"]:
            for r in table_to_records(read_shard(lake, sh["path"], sh["checksum"])):
                key = (r.iteration, r.group_id, r.sample_index)
                assert key not in seen
                seen.add(key)
                assert r.iteration == k and 0 <= k - min(r.token_versions) <= 2
    assert len(seen) == iters * 8 * 4


@pytest.mark.slow
def test_rollouts_of_a_version_that_never_became_durable_are_set_aside(reference, api):
    """With `pipeline.push_weights` the workers get version k+1 from memory while its checkpoint is still being
    written. A crash in that window leaves shards of version k+1 but PROMOTED at k. Resume must retrain iteration
    k and regenerate iteration k+1's samples rather than reuse samples of a version that was never durable.

    The window is a few tens of milliseconds, too short to hit with a failpoint reliably, so the state is made
    from a real kill: the run is killed in iteration 2 (its shards, of version 2, are in the lake), then v2's
    promotion is undone as a crash before it would have left it (PROMOTED back at 1, v2's folder gone,
    iteration 1 'trained')."""
    tmp, ref_params = reference
    run_id = "k-undurable"
    cfg = write_config(tmp, run_id, {"run.iterations": ITERS})
    code, log = _lockstep(
        ["train", cfg], tmp, fault="mid-train[2]@2", api=api
    )  # iteration 2, after 2 of its micro-steps
    assert code == -9, log[-3000:]
    lake_uri = str(tmp / "lake")
    lake = Lake(lake_uri)
    v2_shards = lake.fs.glob(f"{lake.run_dir(run_id)}/rollouts/policy_version=2/iter-000002/*.arrow")
    assert v2_shards, "the killed run should have published shards of iteration 2"
    import json
    import shutil

    path = Path(lake.ledger_file(run_id, 1))
    rec = json.loads(path.read_text())
    promoted = json.loads(Path(lake.promoted_file(run_id)).read_text())["version"]
    if promoted == 2:  # v2 was durable by the kill (the usual case): undo its promotion
        # the record is 'promoted', or still 'trained' when the kill fell between PROMOTED and the ledger's update
        assert rec["state"] in ("promoted", "trained"), rec
        Path(lake.promoted_file(run_id)).write_text(json.dumps({"version": 1}))
        shutil.rmtree(lake.checkpoint_dir(run_id, 2))
        if rec["state"] == "promoted":
            rec.update(state="trained", history=rec["history"][:-1])
        rec.pop("promoted_version", None)
        rec.pop("cataloged", None)
        path.write_text(json.dumps(rec))
    else:  # the kill itself fell in the window, before PROMOTED was written
        assert promoted == 1 and rec["state"] == "trained", (promoted, rec)

    assert _resume_here(run_id, lake_uri) == 0
    moved = lake.fs.glob(f"{lake.run_dir(run_id)}/quarantine/unpromoted-*/policy_version=2/iter-000002/*.arrow")
    assert sorted(p.rsplit("/", 1)[-1] for p in moved) == sorted(p.rsplit("/", 1)[-1] for p in v2_shards)
    records = ledger.read_all(lake, run_id)
    assert [r["state"] for r in records] == ["promoted"] * ITERS
    assert records[2]["reused_chunks"] == [] and records[1]["reused_chunks"]  # v2's samples made anew
    params = final_params(lake_uri, run_id, ITERS)
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    assert diff <= 1e-5, f"resumed run differs from the uninterrupted one by {diff}"
    assert len(lake.fs.glob(f"{lake.run_dir(run_id)}/rollouts/*/*/*.arrow")) == ITERS * 4
    # each sample indexed once; iteration 1 trained again (where the kill fell after its audit, its rows are merged:
    # the choice itself is tested in test_iteration_tasks, since here the kill came before that audit in a probe run)
    from storage import catalog

    ids = [r["sample_id"] for r in catalog.query(catalog.catalog_uri(lake, run_id), catalog.ROLLOUTS).to_pylist()]
    assert len(ids) == len(set(ids)) == ITERS * 8 * 4
