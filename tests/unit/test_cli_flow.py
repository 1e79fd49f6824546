"""The train flow's bookkeeping and the CLI's commands, fast: the flow is driven through `train_flow.fn` with its
session, tasks and tracker replaced by recorders (no Prefect run, no model); the commands with their flows or stores
replaced where the real ones take minutes. (From a mutation audit of `flows/cli.py` and `flows/train.py`, 2026-12-05:
each test was checked to fail on the mutant it was written for.)"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import flows.train as train_mod
from configs.schema import load_config, resolved_json
from flows import cli
from storage import ledger
from storage.lake import Lake
from tests.cli_output import cli_stderr, squash
from tests.unit.test_cli_commands import (  # noqa: F401 (fixture)
    ARITH,
    REPO,
    _resumed_config,
    lake_with_run,
    replace_flow,
)

# ------------------------------------------------------------------------------------------------ the train flow


class _Tracker:
    def __init__(self, calls: list):
        self.calls = calls
        self.seconds = 0.0
        self.client = None  # no MLflow: _log_artifacts returns at once

    def log_metrics(self, metrics: dict, step: int) -> None:
        if "eval/accuracy" in metrics:
            self.calls.append(("eval", metrics["eval/accuracy"], step))

    def flush(self) -> None:
        self.calls.append(("flush",))

    def finish(self, status: str) -> None:
        self.calls.append(("finish", status))


class _Run:
    """A fake session for `train_flow.fn`: records what the flow does; iteration k returns FIGURES[k]."""

    def __init__(self, tmp_path: Path, monkeypatch, overrides=(), version=0, accuracies=(0.25, 0.75), fail_at=None):
        self.calls: list = []
        self.events: list = []
        self.iterations: list[int] = []
        given = {o.split("=", 1)[0] for o in overrides}
        defaults = [
            d for d in ("pipeline.catalog=false", "tracking.prefect_artifacts=false") if d.split("=")[0] not in given
        ]
        self.overrides = ["run.run_id=r1", f"lake.uri={tmp_path / 'lake'}", *defaults, *overrides]
        self.cfg = load_config(None, self.overrides)
        self.lake = Lake(str(tmp_path / "lake"))
        acc = list(accuracies)
        s = SimpleNamespace(
            run_id="r1",
            cfg=self.cfg,
            lake=self.lake,
            version=version,
            tracker=_Tracker(self.calls),
            lease=None,
            pool=SimpleNamespace(stop_serving=lambda: self.calls.append(("stop_serving",))),
            held=[],
        )
        s.hold = s.held.append

        def release():
            held, s.held[:] = list(s.held), []
            for fn in held:
                fn()

        s.release = release
        s.wait_saved = lambda: self.calls.append(("wait_saved",))
        s.close = lambda: self.calls.append(("close",))
        self.s = s

        def open_session(cfg, on_progress=None, resume=False, on_run_id=None):
            self.calls.append(("open", resume))
            on_run_id(s.run_id)  # as the real one does once the run's lease is held
            return s

        def iteration(s_, k):
            s_.release()  # as the real one does, once its rollouts are dispatched
            self.iterations.append(k)
            if fail_at is not None and k == fail_at[0]:
                raise fail_at[1]
            s_.version = k + 1
            return dict(FIGURES[k % len(FIGURES)])

        monkeypatch.setattr(train_mod, "open_session", open_session)
        monkeypatch.setattr(train_mod, "_iteration", iteration)
        monkeypatch.setattr(train_mod, "evaluate_task", lambda run_id: acc.pop(0))
        monkeypatch.setattr(train_mod, "unregister", lambda run_id: self.calls.append(("unregister", run_id)))
        monkeypatch.setattr(train_mod, "mark_failed", lambda s_, k, why: self.calls.append(("mark_failed", k, why)))
        monkeypatch.setattr(train_mod, "progress_hook", self.events.append)

    def __call__(self, resume=False):
        return train_mod.train_flow.fn(config_path=None, overrides=self.overrides, resume=resume)

    @property
    def summary_file(self) -> Path:
        return Path(self.lake.root) / "runs" / "r1" / "summary.json"


# three iterations of different lengths, samples and overheads: each summary figure comes out differently for a
# mean, a median, a count of iterations or the wall time
FIGURES = [
    {"reward/mean": 0.1, "train/samples": 32, "time/iteration_s": 1.0, "perf/overhead_fraction": 0.1},
    {"reward/mean": 0.2, "train/samples": 16, "time/iteration_s": 2.0, "perf/overhead_fraction": 0.2},
    {"reward/mean": 0.3, "train/samples": 32, "time/iteration_s": 7.0, "perf/overhead_fraction": 0.9},
]


def test_summary_figures_of_a_run(tmp_path, monkeypatch):
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"])
    summary = run()
    assert run.iterations == [0, 1, 2] and run.calls[0] == ("open", False)  # a fresh run is not a resume
    assert summary["eval_accuracy_initial"] == 0.25 and summary["eval_accuracy_final"] == 0.75
    assert summary["samples_per_s"] == pytest.approx(80 / 10.0)  # samples trained / time in iterations
    assert summary["promoted_version"] == 3 and summary["iterations"] == 3 and summary["mode"] == "periodic"
    assert summary["median_iteration_s"] == 2.0 and summary["median_overhead_fraction"] == 0.2
    assert summary["summary_path"] == str(run.summary_file) and len(summary["history"]) == 3
    on_disk = json.loads(run.summary_file.read_text())  # what `lockstep runs` and a later resume read
    assert on_disk == {k: v for k, v in summary.items() if k not in ("summary_path", "history")}
    # held-out accuracy of v0 at step 0, of the last version at step `iterations`; all of it in MLflow, then the
    # run marked finished, then the session closed and unregistered
    assert [c for c in run.calls if c[0] in ("eval", "flush", "finish", "close", "unregister")] == [
        ("eval", 0.25, 0),
        ("eval", 0.75, 3),
        ("flush",),
        ("finish", "FINISHED"),
        ("close",),
        ("unregister", "r1"),
    ]
    assert [e["event"] for e in run.events] == ["setup", "start", "iteration", "iteration", "iteration", "done"]
    assert run.events[1]["start"] == 0 and run.events[1]["accuracy"] == 0.25


def test_a_resumed_run_trains_from_its_promoted_version(tmp_path, monkeypatch):
    """Resumed at v2 of 5: iterations 2-4 only, its accuracy at v2 logged at step 2, the progress starting at 2."""
    run = _Run(tmp_path, monkeypatch, ["run.iterations=5"], version=2)
    summary = run(resume=True)
    assert run.calls[0] == ("open", True)
    assert run.iterations == [2, 3, 4] and summary["promoted_version"] == 5
    assert [c for c in run.calls if c[0] == "eval"] == [("eval", 0.25, 2), ("eval", 0.75, 5)]
    assert run.events[1]["event"] == "start" and run.events[1]["start"] == 2 and run.events[1]["iterations"] == 5
    assert [e["iteration"] for e in run.events if e["event"] == "iteration"] == [2, 3, 4]
    assert summary["samples_per_s"] == pytest.approx(80 / 10.0)  # the iterations this process trained


def test_a_finished_run_resumed_is_left_as_it_was(tmp_path, monkeypatch):
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"], version=3, accuracies=())  # evaluation would fail
    run.summary_file.parent.mkdir(parents=True)
    written = json.dumps({"run_id": "r1", "promoted_version": 3, "eval_accuracy_final": 0.5}).encode()
    run.summary_file.write_bytes(written)
    summary = run(resume=True)
    assert run.iterations == [] and run.summary_file.read_bytes() == written
    assert summary == {
        "run_id": "r1",
        "promoted_version": 3,
        "eval_accuracy_final": 0.5,
        "summary_path": str(run.summary_file),  # `lockstep resume` prints it
        "history": [],
    }
    assert ("finish", "FINISHED") in run.calls and ("close",) in run.calls


def test_a_stopped_run_ends_killed_and_a_failed_one_marks_its_iteration(tmp_path, monkeypatch):
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"], fail_at=(1, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        run()
    assert [c for c in run.calls if c[0] in ("mark_failed", "finish", "close", "unregister")] == [
        ("finish", "KILLED"),  # stopped, not failed: the iteration is not marked failed either
        ("close",),
        ("unregister", "r1"),
    ]
    assert not run.summary_file.exists()
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"], fail_at=(1, RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        run()
    assert [c for c in run.calls if c[0] in ("mark_failed", "finish")] == [
        ("mark_failed", 1, "RuntimeError: boom"),
        ("finish", "FAILED"),
    ]


@pytest.fixture
def prefects_sigterm_handler():
    """SIGTERM raises TerminationSignal, as while Prefect runs a flow."""
    from prefect.exceptions import TerminationSignal

    def raise_termination(signum, frame):
        raise TerminationSignal(signal=signum)

    previous = signal.signal(signal.SIGTERM, raise_termination)
    yield raise_termination
    signal.signal(signal.SIGTERM, previous)


def _signalled_finish(run: _Run) -> None:
    """The run's MLflow `finish` gets a SIGTERM to the process first, as the Prefect runner's own would land."""

    def finish(status: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler has run (at the latest at this call's return)
        run.calls.append(("finish", status))

    run.s.tracker.finish = finish


def test_a_second_sigterm_in_a_stops_cleanup_waits_until_the_cleanup_is_done(
    tmp_path, monkeypatch, prefects_sigterm_handler
):
    """A supervisor stopping `lockstep serve` (systemd, `timeout`: SIGTERM to the whole group) signals the served
    flow's process twice, the group's SIGTERM and the Prefect runner's own as it shuts down: the second, raised
    inside the first one's cleanup, left the MLflow run RUNNING (3 of 3 tries). It is held until the cleanup is
    done, then dropped (the run is stopping already), and the handler is Prefect's again."""
    from prefect.exceptions import TerminationSignal

    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"], fail_at=(1, TerminationSignal(signal=signal.SIGTERM)))
    _signalled_finish(run)
    with pytest.raises(TerminationSignal) as stopped:
        run()
    assert stopped.value.__context__ is None  # the first stop's, not one raised inside its cleanup
    assert [c for c in run.calls if c[0] in ("finish", "close", "unregister")] == [
        ("finish", "KILLED"),
        ("close",),
        ("unregister", "r1"),
    ]
    assert signal.getsignal(signal.SIGTERM) is prefects_sigterm_handler


def test_a_sigterm_while_a_finished_run_cleans_up_stops_the_process_after_it(
    tmp_path, monkeypatch, prefects_sigterm_handler
):
    from prefect.exceptions import TerminationSignal

    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"])
    _signalled_finish(run)
    with pytest.raises(TerminationSignal):  # asked to stop: it does, once the finished run is recorded and closed
        run()
    assert [c for c in run.calls if c[0] in ("finish", "close", "unregister")] == [
        ("finish", "FINISHED"),
        ("close",),
        ("unregister", "r1"),
    ]
    assert json.loads(run.summary_file.read_text())["promoted_version"] == 3


@pytest.mark.parametrize("stop,word", [(KeyboardInterrupt(), "stopped"), (RuntimeError("boom"), "failed")])
def test_a_run_no_cli_drives_logs_how_to_resume_it(tmp_path, monkeypatch, caplog, stop, word):
    """A served or deployed run (no CLI to print the resume command; its Prefect name is not the lake's run id)
    says in its log how to continue it; a run the CLI drives leaves that to the CLI."""
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"], fail_at=(1, stop))
    monkeypatch.setattr(train_mod, "progress_hook", train_mod._no_progress)
    with caplog.at_level(logging.WARNING, logger="lockstep"), pytest.raises(type(stop)):
        run()
    assert [r.getMessage() for r in caplog.records if r.name == "lockstep"] == [
        f"run r1 {word}; it keeps its promoted versions: continue it with `lockstep resume r1 --lake "
        f"{tmp_path / 'lake'}`"
    ]
    caplog.clear()
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"], fail_at=(1, stop))  # the CLI's progress hook
    with caplog.at_level(logging.WARNING, logger="lockstep"), pytest.raises(type(stop)):
        run()
    assert [r for r in caplog.records if r.name == "lockstep"] == []


def test_a_retried_flow_run_resumes_only_a_run_its_first_try_created(tmp_path):
    """Prefect retrying a flow run whose first try failed before the run was written (an unreadable dataset, an
    unreachable store) starts it afresh: resuming it would fail with "no run ... to resume"."""
    cfg = load_config(None, [f"lake.uri={tmp_path / 'lake'}", "run.run_id=r1"])
    assert train_mod._retry_resumes(cfg, None) is False and cfg.run.run_id == "r1"
    (tmp_path / "lake" / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "lake" / "runs" / "r1" / "config.json").write_text("{}")
    assert train_mod._retry_resumes(cfg, None) is True and cfg.run.run_id == "r1"
    cfg = load_config(None, [f"lake.uri={tmp_path / 'lake'}"])  # a made-up id, and no flow run to read it from
    assert train_mod._retry_resumes(cfg, None) is False and cfg.run.run_id is None


def test_a_lost_lease_stops_the_run_before_the_next_iteration(tmp_path, monkeypatch):
    from storage.lease import RunInUseError

    run = _Run(tmp_path, monkeypatch, ["run.iterations=3"])
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 2:
            raise RunInUseError("run r1 is in use by another process")

    run.s.lease = SimpleNamespace(check=check)
    with pytest.raises(RunInUseError):
        run()
    assert run.iterations == [0] and ("finish", "FAILED") in run.calls


def test_fail_iteration_marks_only_an_iteration_that_did_not_produce_its_version(monkeypatch):
    marked = []
    monkeypatch.setattr(train_mod, "mark_failed", lambda s, k, why: marked.append((k, why)))
    train_mod._fail_iteration(SimpleNamespace(version=2), 2, ValueError("nan loss"))
    assert marked == [(2, "ValueError: nan loss")]
    train_mod._fail_iteration(SimpleNamespace(version=3), 2, ValueError("late"))  # v3 is out: a later step failed
    assert marked == [(2, "ValueError: nan loss")]


class _Future:
    def __init__(self, error=None):
        self.error = error

    def result(self):
        if self.error:
            raise self.error

    def wait(self):
        pass


@pytest.mark.parametrize("halves", [("true", "false"), ("false", "true")], ids=["catalog", "prefect-artifacts"])
def test_the_audit_of_each_iteration_runs_and_a_failure_of_the_last_fails_the_run(tmp_path, monkeypatch, halves):
    run = _Run(
        tmp_path,
        monkeypatch,
        ["run.iterations=2", f"pipeline.catalog={halves[0]}", f"tracking.prefect_artifacts={halves[1]}"],
    )
    audits = []

    def submit(run_id, k, v, fig):
        audits.append((k, v, fig["reward/mean"]))
        return _Future(RuntimeError("catalog write failed") if k == 1 else None)

    monkeypatch.setattr(train_mod, "audit_task", SimpleNamespace(submit=submit))
    monkeypatch.setattr(train_mod, "catalog_iteration", lambda *a: None)
    with pytest.raises(RuntimeError, match="catalog write failed"):
        run()
    assert audits == [(0, 1, 0.1), (1, 2, 0.2)]  # iteration k's audit of version k+1, with its figures
    assert not run.summary_file.exists() and ("finish", "FAILED") in run.calls


def test_a_resume_catalogs_again_only_the_promoted_iterations_not_cataloged(tmp_path, monkeypatch):
    run = _Run(tmp_path, monkeypatch, ["run.iterations=3", "pipeline.catalog=true"], version=2)
    for k in (0, 1):
        ledger.write_record(
            run.lake, "r1", k, ("planned", "rolling_out", "trained", "promoted"), promoted_version=k + 1
        )
    ledger.annotate(run.lake, "r1", 0, cataloged=True)
    again = []
    monkeypatch.setattr(train_mod, "catalog_iteration", lambda run_id, k, v: again.append((k, v)))
    monkeypatch.setattr(train_mod, "audit_task", SimpleNamespace(submit=lambda *a: _Future()))
    run(resume=True)
    assert again == [(1, 2)]


def test_an_async_run_plans_max_staleness_batches_ahead_before_its_first_iteration(tmp_path, monkeypatch):
    run = _Run(
        tmp_path,
        monkeypatch,
        ["run.iterations=4", "pipeline.mode=async", "pipeline.max_staleness=2", "resources.rollout_workers=2"],
        version=1,
    )
    planned, served = [], []
    monkeypatch.setattr(train_mod, "plan_task", lambda run_id, j: planned.append(j))
    monkeypatch.setattr(
        train_mod, "serve_task", SimpleNamespace(submit=lambda run_id, w: served.append(w) or _Future())
    )
    run(resume=True)
    assert planned == [1, 2] and served == [0, 1] and ("stop_serving",) in run.calls


# ------------------------------------------------------------------------------------------------ one iteration


def _one_iteration(monkeypatch, k: int, iterations: int, every: int, workers_mb: float | None = 321.5):
    cfg = load_config(
        None,
        [
            f"run.iterations={iterations}",
            f"eval.every={every}",
            "pipeline.mode=sync",
            "resources.rollout_workers=1",
            "rollout.prompts_per_iteration=8",
            "rollout.group_size=4",
        ],
    )
    logged = []
    tracker = SimpleNamespace(seconds=0.0, log_metrics=lambda m, step: logged.append((dict(m), step)))
    pool = SimpleNamespace(resident_mb=lambda: workers_mb)
    s = SimpleNamespace(
        run_id="r", cfg=cfg, tracker=tracker, storage_s=0.0, release=lambda: None, rollouts=[], pool=pool
    )
    result = {"busy_s": 1.0, "storage_s": 0.0, "load_s": 0.0, "shards": [{"gen_tokens": 100, "reward_s": 0.0}]}
    rollout = SimpleNamespace(wait=lambda: None, result=lambda: result)
    monkeypatch.setattr(train_mod, "plan_task", lambda run_id, k: {"groups": [], "body_s": 0.0})
    monkeypatch.setattr(train_mod, "rollout_task", SimpleNamespace(submit=lambda run_id, k, w: rollout))
    train = {
        "time/train_task_s": 0.0,
        "time/train_busy_s": 1.0,
        "time/train_end_s": 1.5,
        "train/tokens": 50,
        "train/samples": 24,  # not prompts_per_iteration x group_size (32): a batch that trained fewer (dynamic sampling)
        "reward/mean": 0.5,
    }
    monkeypatch.setattr(train_mod, "train_task", lambda run_id, k, groups, t0: dict(train))
    monkeypatch.setattr(train_mod, "promote_task", lambda run_id, k: {"body_s": 0.0})
    monkeypatch.setattr(train_mod, "evaluate_task", lambda run_id: 0.625)
    return train_mod._iteration(s, k), logged


def test_an_iteration_evaluates_its_version_every_few_iterations_but_not_the_last(monkeypatch):
    fig, logged = _one_iteration(monkeypatch, k=1, iterations=4, every=2)
    assert fig["eval/accuracy"] == 0.625 and ({"eval/accuracy": 0.625}, 2) in logged  # the version it produced
    assert fig["perf/samples_per_s"] == pytest.approx(24 / fig["time/iteration_s"])  # the samples trained
    fig, logged = _one_iteration(monkeypatch, k=3, iterations=4, every=2)  # the flow's final evaluation does it
    assert "eval/accuracy" not in fig and not any("eval/accuracy" in m for m, _ in logged)


def test_an_iteration_logs_the_memory_of_the_flows_process_and_of_the_rollout_workers(monkeypatch):
    monkeypatch.setattr(train_mod, "resident_mb", lambda: 1234.5)
    fig, logged = _one_iteration(monkeypatch, k=0, iterations=4, every=2)
    assert fig["mem/rss_mb"] == 1234.5 and fig["mem/rollout_workers_rss_mb"] == 321.5
    assert any(m.get("mem/rss_mb") == 1234.5 and m.get("mem/rollout_workers_rss_mb") == 321.5 for m, _ in logged)
    # where /proc is not there: left out, not logged as 0
    monkeypatch.setattr(train_mod, "resident_mb", lambda: None)
    fig, logged = _one_iteration(monkeypatch, k=0, iterations=4, every=2, workers_mb=None)
    assert not any(key.startswith("mem/") for key in fig) and not any(
        k.startswith("mem/") for m, _ in logged for k in m
    )


# ------------------------------------------------------------------------------------------------ train / resume


def _flow_returning(monkeypatch, summary=None, before=None, error=None):
    def flow(config_path, overrides, resume):
        for event in before or []:
            train_mod.progress_hook(event)
        if error is not None:
            raise error
        return summary

    replace_flow(monkeypatch, flow)


def test_resume_of_a_finished_run_says_so_without_starting_the_flow(lake_with_run, capsys, monkeypatch):  # noqa: F811
    """It reopened the run, started its workers and its MLflow run (moving that run's end time) to train nothing."""
    _flow_returning(monkeypatch, error=AssertionError("the flow must not start"))
    (lake_with_run / "runs" / "r1" / "summary.json").write_text(json.dumps({"run_id": "r1", "promoted_version": 7}))
    assert cli.main(["resume", "r1", "--lake", str(lake_with_run)]) == 0
    assert squash(cli_stderr(capsys)) == squash("run r1 has finished (version 7): nothing to resume")
    (lake_with_run / "runs" / "r1" / "summary.json").write_text("{")  # damaged: left to the flow, which rewrites it
    _flow_returning(monkeypatch, summary={**SUMMARY, "run_id": "r1", "summary_path": "s.json"})
    assert cli.main(["resume", "r1", "--lake", str(lake_with_run)]) == 0


SUMMARY = {
    "eval_accuracy_initial": 0.25,
    "eval_accuracy_final": 0.625,
    "samples_per_s": 12.34,
    "promoted_version": 7,
    "run_id": "r1",
    "summary_path": "/lake/runs/r1/summary.json",
}


def test_train_reports_the_summary_and_prints_the_run_and_its_summary_path(monkeypatch, capsys, tmp_path):
    _flow_returning(monkeypatch, SUMMARY)
    assert cli.main(["train", ARITH, "-o", f"lake.uri={tmp_path / 'lake'}"]) == 0
    out = capsys.readouterr()
    assert out.out == "r1 /lake/runs/r1/summary.json\n"  # stdout: what a script reads
    # the first line, before Prefect's API server and the imports: something on the screen at once
    assert out.err.startswith(f"starting a run of arith-tiny in lake {tmp_path / 'lake'}\n")
    assert "held-out accuracy 0.250 -> 0.625, 12.3 samples/s, version 7" in out.err
    assert train_mod.progress_hook is train_mod._no_progress  # the display is not left to a later run of this process
    assert cli.main(["train", ARITH, "-o", f"lake.uri={tmp_path / 'lake'}", "-o", "run.run_id=r2"]) == 0
    assert capsys.readouterr().err.startswith(f"starting run r2 in lake {tmp_path / 'lake'}\n")


def _warned(monkeypatch, capsys, tmp_path, *overrides: str) -> str:
    """The stderr of a `lockstep train` of the demo config with `overrides` (the flow replaced, its summary
    returned), which must still run (exit 0)."""
    _flow_returning(monkeypatch, SUMMARY)
    given = [a for o in overrides for a in ("-o", o)]
    assert cli.main(["train", ARITH, "-o", f"lake.uri={tmp_path / 'lake'}", *given]) == 0
    return cli_stderr(capsys)


def test_train_warns_of_a_setting_its_run_will_not_read_and_still_runs(monkeypatch, capsys, tmp_path):
    err = _warned(monkeypatch, capsys, tmp_path, "algorithm.is_cap=3")
    assert err.startswith(
        squash(
            "warning: algorithm.is_cap is set but has no effect: pipeline.mode is 'periodic', and only async mode's "
            "decoupled loss reads it"
        )
    )
    assert err.count("warning:") == 1


def test_train_warns_of_more_threads_than_cores_and_still_runs(monkeypatch, capsys, tmp_path):
    """Processes whose torch threads outnumber the cores slow each other down (DESIGN.md: ~5x here): said at the
    start, on this machine's core count (2 here, set so), and the run goes on."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    err = _warned(monkeypatch, capsys, tmp_path, "resources.train_threads=2")
    assert err.startswith(
        squash(
            "warning: resources run 3 torch threads at once (1 rollout worker(s) x 1 rollout_threads, 1 trainer "
            "rank(s) x 2 train_threads) on 2 CPU cores: threads beyond the cores slow every process down"
        )
    )
    assert err.count("warning:") == 1
    assert "warning:" not in _warned(monkeypatch, capsys, tmp_path)  # the demo's 1 + 1


def test_the_thread_budget_counts_what_runs_at_once_and_only_on_a_cpu(monkeypatch):
    import os

    import torch

    from configs.schema import load_config
    from tasks.preflight import thread_budget_note

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    cpu = torch.device("cpu")
    threads = ["resources.rollout_workers=2", "resources.rollout_threads=2", "resources.train_threads=2"]
    assert thread_budget_note(load_config(ARITH, threads), cpu).startswith("resources run 6 torch threads at once")
    sync = ["pipeline.mode=sync", "resources.borrow_rollout_threads=false"]
    assert thread_budget_note(load_config(ARITH, [*sync, *threads]), cpu) is None  # 4 rollout, then 2 training
    ranks = [*sync, "resources.train_ranks=3", "resources.train_threads=2"]
    assert thread_budget_note(load_config(ARITH, ranks), cpu).startswith(
        "resources run 6 torch threads one side at a time (sync) (1 rollout worker(s) x 1 rollout_threads, 3 trainer"
    )
    assert thread_budget_note(load_config(ARITH, threads), torch.device("meta")) is None  # not a CPU: not counted


def test_resume_does_not_warn_of_its_frozen_configs_settings(lake_with_run, monkeypatch, capsys):  # noqa: F811
    """A frozen config.json sets every field, so in a periodic run the async settings read as given: a resumed
    run's config was the user's choice when it started, and is not judged again."""
    from configs.schema import inert_settings

    cfg = _resumed_config(lake_with_run, monkeypatch)
    assert cfg.pipeline.mode != "async" and inert_settings(cfg)  # what train would have said of it
    assert "warning:" not in capsys.readouterr().err


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), "TerminationSignal"], ids=["ctrl-c", "sigterm"])
def test_a_stopped_train_names_its_run_and_how_to_resume_it(monkeypatch, capsys, tmp_path, stop):
    """The run id comes from the flow (no run.run_id given: it is made up at the start) and the resume command
    names the lake; exit 130."""
    from prefect.exceptions import TerminationSignal

    error = TerminationSignal(signal.SIGTERM) if stop == "TerminationSignal" else stop
    start = {"event": "start", "run_id": "arith-123", "iterations": 3, "start": 0, "accuracy": 0.5}
    _flow_returning(monkeypatch, before=[{"event": "setup", "run_id": None}, start], error=error)
    lake = tmp_path / "lake"
    (lake / "runs" / "arith-123").mkdir(parents=True)
    (lake / "runs" / "arith-123" / "config.json").write_text("{}")  # what the flow writes as it creates the run
    assert cli.main(["train", ARITH, "-o", f"lake.uri={lake}"]) == 130
    assert squash(
        f"interrupted: run arith-123 keeps its promoted versions; continue it with "
        f"`lockstep resume arith-123 --lake {lake}`"
    ) in cli_stderr(capsys)


@pytest.mark.parametrize(
    "error, said",
    [
        (
            "WorkerError",
            "rollout worker 0 failed: models.rewards.RewardError: task.reward 'r.py:f' raised KeyError: '3'",
        ),
        (RuntimeError("rank 1 died\nmore detail"), "RuntimeError: rank 1 died"),
    ],
    ids=["worker", "other"],
)
def test_a_failed_train_ends_with_what_failed_and_how_to_resume_it(monkeypatch, capsys, tmp_path, error, said):
    """Where the flow's log printed the traceback, the command's last line says what failed (for a rollout worker,
    the last line of its traceback: a user's reward function that raised) and how to continue the run; exit 1. A
    failure the log did not print (the API server's start, Prefect's own set-up), or one before the run was written,
    is raised with its traceback as before."""
    import logging

    from tasks.workers import WorkerError

    if error == "WorkerError":
        error = WorkerError(
            'rollout worker 0 failed:\nTraceback (most recent call last):\n  File "r.py", line 2, in f\n'
            "KeyError: '3'\n\nmodels.rewards.RewardError: task.reward 'r.py:f' raised KeyError: '3'\n"
        )
    printed = []

    def flow(config_path, overrides, resume):
        for event in [
            {"event": "setup", "run_id": None},
            {"event": "start", "run_id": "arith-123", "iterations": 3, "start": 0, "accuracy": 0.5},
        ]:
            train_mod.progress_hook(event)
        if printed:  # as Prefect's flow engine logs a failure: "Encountered exception during execution"
            logging.getLogger("prefect.flow_runs").error("Encountered exception", exc_info=printed[0])
        raise error

    replace_flow(monkeypatch, flow)
    lake = tmp_path / "lake"
    # not written yet; written, but nothing logged; written, another exception logged (a task's), this one not
    for written, logged in ((False, error), (True, None), (True, RuntimeError("a task's"))):
        if written and not (lake / "runs" / "arith-123").exists():
            (lake / "runs" / "arith-123").mkdir(parents=True)
            (lake / "runs" / "arith-123" / "config.json").write_text("{}")
        printed[:] = [logged] if logged is not None else []
        with pytest.raises(type(error)):
            cli.main(["train", ARITH, "-o", f"lake.uri={lake}"])
        capsys.readouterr()
    printed[:] = [error]
    assert cli.main(["train", ARITH, "-o", f"lake.uri={lake}"]) == 1
    err = capsys.readouterr().err
    assert "Encountered exception" in err  # the log's record, with the traceback
    assert squash(err).endswith(
        squash(
            f"error: run arith-123 failed: {said}. It keeps its promoted versions: once the cause is fixed, "
            f"continue it with `lockstep resume arith-123 --lake {lake}`\n"
        )
    )


@pytest.mark.parametrize("run_id", [None, "arith-123"], ids=["no-id-yet", "id-but-no-config"])
def test_a_train_stopped_before_its_run_started(monkeypatch, capsys, tmp_path, run_id):
    """Stopped before the run's config.json was written (the flow's setup, the tracking check, the lease): nothing
    to resume, whether or not its id is known."""
    _flow_returning(monkeypatch, before=[{"event": "setup", "run_id": run_id}], error=KeyboardInterrupt())
    assert cli.main(["train", ARITH, "-o", f"lake.uri={tmp_path / 'lake'}"]) == 130
    assert cli_stderr(capsys) == squash(
        f"starting a run of arith-tiny in lake {tmp_path / 'lake'}\ninterrupted before the run started"
    )


def test_a_train_stopped_in_its_bootstrap_names_the_run_it_made_up(monkeypatch, capsys, tmp_path):
    """No run.run_id: the session makes one up and says it as soon as the run's lease is held (`on_run_id`), before
    it writes the run, and the flow passes it on at setup, so a stop in the bootstrap (the run written, its `start`
    event not yet sent) names that run and how to resume it."""
    lake = tmp_path / "lake"
    events, opened = [], []
    run_id = "arith-tiny-20261205-120000-2"  # a name the session may choose (another run took the first)

    def open_session(cfg, on_progress=None, resume=False, on_run_id=None):
        opened.append(cfg.run.run_id)
        on_run_id(run_id)
        (lake / "runs" / run_id).mkdir(parents=True)
        (lake / "runs" / run_id / "config.json").write_text("{}")
        raise KeyboardInterrupt  # Ctrl-C in the bootstrap

    monkeypatch.setattr(train_mod, "open_session", open_session)
    monkeypatch.setattr(train_mod, "progress_hook", events.append)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_flow.fn(config_path=ARITH, overrides=[f"lake.uri={lake}"])
    assert opened == [None] and events == [{"event": "setup", "run_id": run_id}]  # the id is the session's to choose
    _flow_returning(monkeypatch, before=events, error=KeyboardInterrupt())
    assert cli.main(["train", ARITH, "-o", f"lake.uri={lake}"]) == 130
    assert squash(
        f"interrupted: run {run_id} keeps its promoted versions; continue it with `lockstep resume {run_id} --lake "
        f"{lake}`"
    ) in cli_stderr(capsys)


def test_resume_leaves_no_temporary_config_behind(lake_with_run, monkeypatch, tmp_path):  # noqa: F811
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    _resumed_config(lake_with_run, monkeypatch)
    assert list(tmp.iterdir()) == []
    _flow_returning(monkeypatch, error=FileNotFoundError("runs/r1/checkpoints/v000003/MANIFEST.json"))
    assert cli.main(["resume", "r1", "--lake", str(lake_with_run)]) == 2
    assert list(tmp.iterdir()) == []


def test_a_missing_run_says_how_to_list_the_runs(lake_with_run, capsys):  # noqa: F811
    assert cli.main(["resume", "ghost", "--lake", str(lake_with_run)]) == 2
    assert squash(
        f"error: cannot resume 'ghost' from lake {lake_with_run}: run ghost does not exist in lake {lake_with_run} "
        f"({lake_with_run}/runs/ghost/config.json is missing); `lockstep runs --lake {lake_with_run}` lists its runs"
    ) in cli_stderr(capsys)


# ------------------------------------------------------------------------------------------------ progress


class _Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_progress_lines_of_a_resumed_run_in_a_log(monkeypatch):
    """Not a terminal (CI logs, pipes): a line every total/20 iterations and at the last; the time left is the
    mean time of the iterations this process ran (not counting those before the resume) times those still to run."""
    clock = _Clock()
    monkeypatch.setattr(cli, "time", clock)
    out = io.StringIO()
    progress = cli._Progress(cli._console(file=out, width=300))
    assert not progress.live
    progress({"event": "start", "run_id": "r1", "iterations": 45, "start": 40, "accuracy": 0.5})
    figures = {"reward/mean": 0.5, "perf/gen_tokens_per_s": 100.0, "perf/train_tokens_per_s": 50.0}
    for k in range(40, 45):
        clock.now += 20.0 if k == 40 else 5.0  # the first also started the workers and loaded their weights
        progress({"event": "iteration", "iteration": k, "time/iteration_s": 5.0, **figures})
    lines = out.getvalue().splitlines()
    assert lines[0] == "run r1: held-out accuracy 0.500 at v40 (resumed)"
    # every 2 iterations (45 // 20), and iteration 45 as the last
    assert [ln.split()[1] for ln in lines[1:]] == ["42/45", "44/45", "45/45"]
    assert lines[1].endswith("5.00 s/it eta 15 s")  # the iteration after the first took 5 s, 3 to go
    assert lines[2].endswith("eta 5 s")


def test_replay_progress_lines_in_a_log(monkeypatch):
    """Not a terminal: a line every total/20 versions and at the last, with the version's difference and the time
    left (the mean time per version so far times those still to replay)."""
    clock = _Clock()
    monkeypatch.setattr(cli, "time", clock)
    out = io.StringIO()
    progress = cli._replay_progress(cli._console(file=out, width=300))
    progress({"event": "start", "run_id": "r1", "versions": 41})
    for v in range(1, 42):
        clock.now += 4.0 if v == 1 else 2.0
        progress({"event": "version", "version": v, "max_abs_diff": 1e-7 if v < 41 else 0.25})
    progress.stop()
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == [f"{k}/41:" for k in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20)] + [
        f"{k}/41:" for k in (22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 41)
    ]
    assert lines[0] == "replayed 2/41: v2 max_abs_diff 1.000e-07, eta 117 s"  # 6 s for 2: 3 s each, 39 to go
    assert lines[-1] == "replayed 41/41: v41 max_abs_diff 2.500e-01, eta 0 s"


def test_replay_says_what_it_replays_and_shows_each_version_as_it_lands(replayable, capsys, monkeypatch):
    import flows.replay

    def replay(run_id, lake_uri, to_run_id):
        flows.replay.progress_hook({"event": "start", "run_id": run_id, "versions": 2})
        for row in ROWS:
            flows.replay.progress_hook({"event": "version", **row})
        return ROWS

    replace_flow(monkeypatch, replay, "replay_flow")
    assert cli.main(["replay", "r1", "--lake", str(replayable), "--to", "r9"]) == 0
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert lines[0] == f"replaying run r1 in lake {replayable} into run r9"
    assert [ln.split(", eta")[0] for ln in lines[1:]] == [
        "replayed 1/2: v1 max_abs_diff 2.500e-01",
        "replayed 2/2: v2 max_abs_diff 1.000e-07",
    ]
    assert out.out.splitlines()[-1] == "replayed 2 versions of r1; worst max_abs_diff 2.500e-01"  # stdout as before
    assert flows.replay.progress_hook is flows.replay._no_progress  # the display is not left behind


def test_the_first_progress_line_of_a_new_run(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(cli, "time", clock)
    out = io.StringIO()
    progress = cli._Progress(cli._console(file=out, width=300))
    progress({"event": "start", "run_id": "r1", "iterations": 20, "start": 0, "accuracy": 0.25})
    clock.now += 3.0
    progress(
        {
            "event": "iteration",
            "iteration": 0,
            "time/iteration_s": 3.0,
            "reward/mean": 0.5,
            "perf/gen_tokens_per_s": 100.0,
            "perf/train_tokens_per_s": 50.0,
        }
    )
    lines = out.getvalue().splitlines()
    assert lines[0] == "run r1: initial held-out accuracy 0.250"
    assert lines[1].endswith("3.00 s/it eta 57 s")  # one iteration so far: its own time, 19 to go


# ------------------------------------------------------------------------------------------------ replay


@pytest.fixture
def replayable(lake_with_run):  # noqa: F811
    ckpt = lake_with_run / "runs" / "r1" / "checkpoints"
    (ckpt / "v000000").mkdir(parents=True)
    (ckpt / "v000000" / "MANIFEST.json").write_text("{}")
    (ckpt / "PROMOTED").write_text('{"version": 0}')
    return lake_with_run


ROWS = [{"version": 1, "max_abs_diff": 0.25}, {"version": 2, "max_abs_diff": 1e-7}]


def test_replay_prints_each_version_and_the_worst(replayable, capsys, monkeypatch):
    replace_flow(monkeypatch, lambda run_id, lake_uri, to_run_id: ROWS, "replay_flow")
    assert cli.main(["replay", "r1", "--lake", str(replayable)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "v     1  max_abs_diff 2.500e-01",
        "v     2  max_abs_diff 1.000e-07",
        "replayed 2 versions of r1; worst max_abs_diff 2.500e-01",
    ]


def test_ctrl_c_in_a_replay_without_a_target(replayable, capsys, monkeypatch):
    def interrupted(**kwargs):
        raise KeyboardInterrupt

    replace_flow(monkeypatch, interrupted, "replay_flow")
    assert cli.main(["replay", "r1", "--lake", str(replayable)]) == 130
    assert cli_stderr(capsys) == squash(f"replaying run r1 in lake {replayable}\ninterrupted: replay of r1 stopped")


# ------------------------------------------------------------------------------------------------ audit, runs


def test_parentheses_in_backquoted_names_are_not_counted():
    assert cli._unbalanced("`odd)name` > 0") is None
    assert cli._unbalanced("`odd)name` > 0)") == "the ')' at character 15 closes nothing"


@pytest.mark.parametrize(
    "argv, where, limit",
    [
        (["--version", "0"], "policy_version = 0", 20),  # version 0 alone, the default limit
        (["--where", "reward > 0", "--version", "1", "--limit", "0"], "(reward > 0) AND policy_version = 1", 0),
        ([], None, 20),
    ],
    ids=["version-0", "where-and-version", "all"],
)
def test_audit_asks_the_catalog_for_what_it_was_given(
    lake_with_run,  # noqa: F811
    monkeypatch,
    capsys,
    argv,
    where,
    limit,
):
    import pyarrow as pa

    from storage import catalog

    (lake_with_run / "runs" / "r1" / "catalog").mkdir()
    asked = []

    def query(uri, table, where, limit, columns):
        asked.append((where, limit))
        return pa.Table.from_pylist([])

    monkeypatch.setattr(catalog, "query", query)
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run), "--format", "json", *argv]) == 0
    assert asked == [(where, limit)] and json.loads(capsys.readouterr().out) == []


def test_runs_shows_a_run_with_its_summary_as_finished(lake_with_run, capsys):  # noqa: F811
    run = lake_with_run / "runs" / "r1"
    (run / "ledger").mkdir()
    (run / "ledger" / "iter-000000.json").write_text(json.dumps({"iteration": 0, "state": "promoted", "history": []}))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "PROMOTED").write_text('{"version": 1}')
    (run / "summary.json").write_text("{}")
    assert cli.main(["runs", "--lake", str(lake_with_run)]) == 0
    assert capsys.readouterr().out.split() == ["r1", "finished", "version", "1"]


# ------------------------------------------------------------------------------------------------ export, report


@pytest.fixture
def two_versions(lake_with_run, monkeypatch):  # noqa: F811
    """Run r1 with checkpoints v0 and v1, v1 promoted; the export itself recorded, not done."""
    from storage import checkpoints

    ckpt = lake_with_run / "runs" / "r1" / "checkpoints"
    for v in (0, 1):
        (ckpt / f"v{v:06d}").mkdir(parents=True)
    (ckpt / "PROMOTED").write_text('{"version": 1}')
    exported = []
    monkeypatch.setattr(checkpoints, "export_hf", lambda lake, path, out: exported.append(path) or out)
    return lake_with_run, exported


def test_export_of_version_0_exports_v0_not_the_promoted_version(two_versions, capsys, tmp_path):
    lake, exported = two_versions
    assert cli.main(["export", "r1", "--version", "0", "--out", str(tmp_path / "hf"), "--lake", str(lake)]) == 0
    assert exported == [f"{lake}/runs/r1/checkpoints/v000000"]
    assert capsys.readouterr().out == f"exported r1 v0 to {tmp_path / 'hf'}\n"
    assert cli.main(["export", "r1", "--out", str(tmp_path / "hf2"), "--lake", str(lake)]) == 0  # the promoted one
    assert exported[-1] == f"{lake}/runs/r1/checkpoints/v000001"


@pytest.mark.parametrize("out", ["", "  "])
def test_export_to_an_empty_out_is_refused_as_such(two_versions, capsys, out):
    """`--out ""` named the working directory (Path("") is "."): refused with what to give, before anything is read,
    where it said ' exists and is not empty'."""
    lake, exported = two_versions
    assert cli.main(["export", "r1", "--out", out, "--lake", str(lake)]) == 2
    assert capsys.readouterr().err == "error: --out is empty: give the directory to export into (a new or empty one)\n"
    assert exported == []


def test_an_os_error_names_what_the_system_refused_and_where():
    import errno

    assert cli._os_reason(FileExistsError(errno.EEXIST, "File exists", "/out/file")) == "File exists: /out/file"
    assert cli._os_reason(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
    assert cli._os_reason(OSError("/out is a file; choose a new directory")) == "/out is a file; choose a new directory"


def test_report_written_but_not_logged_exits_1(lake_with_run, monkeypatch, capsys, tmp_path):  # noqa: F811
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    import flows.report

    config = load_config(None, ["run.run_id=r1", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    (lake_with_run / "runs" / "r1" / "config.json").write_text(resolved_json(config))
    monkeypatch.setattr(flows.report, "run_metrics", lambda uri, run_id: ("abc123", {"reward/mean": [(0, 0.5)]}))

    def refuse(self, *args, **kwargs):
        raise MlflowException("database is locked")

    monkeypatch.setattr(MlflowClient, "log_artifact", refuse)
    out = tmp_path / "rep"
    assert cli.main(["report", "r1", "--lake", str(lake_with_run), "--out", str(out)]) == 1
    assert squash(
        f"{out}/r1-report.png {out}/r1-report.html error: written, but not logged to MLflow run abc123: "
        "database is locked"
    ) in cli_stderr(capsys)
    assert (out / "r1-report.html").is_file()


# ------------------------------------------------------------------------------------------------ serve


def test_serve_publishes_the_config_it_was_given_with_its_overrides_name_and_schedule(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import tasks.preflight

    monkeypatch.setattr(tasks.preflight, "check_prefect_api", lambda: None)
    monkeypatch.setattr(tasks.preflight, "check_tracking", lambda cfg: None)
    published = []
    monkeypatch.setattr(train_mod.train_flow, "serve", lambda **kwargs: published.append(kwargs))
    monkeypatch.chdir(REPO)
    argv = ["serve", "configs/arith-tiny.yaml", "-o", "trainer.lr=0.001", "--name", "nightly", "--cron", "0 3 * * *"]
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert cli.main(argv) == 0
    assert published == [
        {
            "name": "nightly",
            "parameters": {"config_path": ARITH, "overrides": ["trainer.lr=0.001"]},  # absolute: runs start elsewhere
            "cron": "0 3 * * *",
            "print_starting_message": False,
        }
    ]
    assert f"serving deployment lockstep-train/nightly with {ARITH}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ signals, pipes


def test_sigterm_in_a_command_unwinds_it_as_ctrl_c(monkeypatch, capsys, lake_with_run):  # noqa: F811
    def killed(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in this thread at once
        raise AssertionError("SIGTERM was not turned into KeyboardInterrupt")

    def not_ours(signum, frame):  # the handler main found, not the default that would end pytest
        raise RuntimeError("SIGTERM was left to the handler main found")

    monkeypatch.setattr(cli, "cmd_runs", killed)
    before = signal.signal(signal.SIGTERM, not_ours)
    try:
        assert cli.main(["runs", "--lake", str(lake_with_run)]) == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    assert cli_stderr(capsys) == squash("interrupted")


def test_stdout_counts_as_closed_only_when_its_reader_went_away(monkeypatch):
    r, w = os.pipe()
    stdout = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert cli._stdout_closed() is False  # a reader is there: a BrokenPipeError came from elsewhere
        os.close(r)
        assert cli._stdout_closed() is True
    finally:
        monkeypatch.undo()
        stdout.close()


def test_commands_run_offline_and_quiet_unless_told_otherwise(monkeypatch, lake_with_run):  # noqa: F811
    """A command never waits on the Hugging Face hub (HF_HUB_OFFLINE) and LanceDB / MLflow keep their notices to
    themselves; a variable the user set wins."""
    for name in ("HF_HUB_OFFLINE", "LANCEDB_LOG", "MLFLOW_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    assert cli.main(["runs", "--lake", str(lake_with_run)]) == 0
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["LANCEDB_LOG"] == "error"
    assert os.environ["MLFLOW_LOGGING_LEVEL"] == "WARNING" and os.environ["TRANSFORMERS_VERBOSITY"] == "info"


def test_settle_finishes_the_first_iteration_too(tmp_path):
    """A crash between PROMOTED v1 and iteration 0's ledger update: the run's first version, settled like any."""
    from flows.train import _settle_ledger

    lake = Lake(str(tmp_path / "lake"))
    ledger.write_record(lake, "r", 0, ("planned", "rolling_out", "trained"))
    _settle_ledger(SimpleNamespace(lake=lake, run_id="r", version=1))
    rec = ledger.read_record(lake, "r", 0)
    assert rec["state"] == "promoted" and rec["promoted_version"] == 1
