"""The `lockstep` command line.

    lockstep train CONFIG [-o key=value ...]

A bad config exits with code 2 and a message naming the file, the field and the reason, before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Callable

from tasks.workers import PoolClosed


def _quiet_environment() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("LANCEDB_LOG", "error")  # not "WARN No existing dataset" when the catalog is created
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # not "INFO ... Creating initial MLflow database tables"


class _DropReported(logging.Filter):
    """Drops Prefect's "Encountered exception" record (with its traceback) for the input errors the CLI reports
    itself in one line, and its ERROR lines for a Ctrl-C or SIGTERM ("Crash detected! Execution was aborted by an
    interrupt signal.", "Finished in state Crashed(...)" per task and flow run), which the CLI reports as a stop with
    the command to resume; the runs still end Failed or Crashed, with the message, in Prefect's own records."""

    STOPPED = (
        "Execution was aborted by an interrupt signal.",
        "Execution was aborted by a termination signal.",
        PoolClosed.WORDS,  # a rollout task cancelled by the stop's cleanup
    )

    def __init__(self, errors: tuple[type[BaseException], ...], logged: list[BaseException] | None = None):
        super().__init__()
        self.errors = errors
        self.logged = logged if logged is not None else []  # the exceptions logged with their traceback

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.errors):
            return False
        message = record.getMessage()
        if any(stop in message for stop in self.STOPPED):
            return False
        if record.exc_info and record.exc_info[1] is not None:
            self.logged.append(record.exc_info[1])
        return True


@contextlib.contextmanager
def _reported_by_cli(*errors: type[BaseException], logged: list[BaseException] | None = None):
    """While a flow runs, Prefect's run loggers leave `errors` to the CLI's message; `logged` hears each exception
    they print with its traceback."""
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    drop = _DropReported(errors, logged)
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


class _Progress:
    """Live display: bootstrap progress, then reward, accuracy, tokens/s and time left per iteration.

    On a terminal it is a rich progress bar; elsewhere (CI logs, pipes) one plain line every few iterations.
    """

    def __init__(self, console):
        self.console = console
        self.live = console.is_terminal
        self.progress = _progress_bar(console)
        self.boot = self.iters = None
        self.accuracy = float("nan")
        self.total = 0
        self.t_start = time.perf_counter()
        self.done_iters = 0
        self.first_done: float | None = None
        self.run_id: str | None = None  # known once the flow has set the run up

    def _line(self, text: str) -> None:
        if not self.live:
            self.console.print(text)

    def __call__(self, e: dict) -> None:
        kind = e["event"]
        self.run_id = e.get("run_id") or self.run_id
        if kind == "setup":
            self.progress.start()
        elif kind == "bootstrap":
            if self.boot is None:
                self.boot = self.progress.add_task("bootstrap", total=e["steps"], info="")
            self.progress.update(self.boot, completed=e["step"], info=f"loss {e['loss']:.3f}")
            if e["step"] % max(1, e["steps"] // 5) == 0:
                self._line(f"bootstrap SFT step {e['step']}/{e['steps']} loss {e['loss']:.3f}")
        elif kind == "start":
            self.accuracy, self.total = e["accuracy"], e["iterations"]
            self.t_start = time.perf_counter()
            self.first = e["start"]
            self.first_done = None  # when this process's first iteration ended
            self.iters = self.progress.add_task("RL", total=e["iterations"], completed=e["start"], info="")
            if e["start"]:  # a resumed run: its accuracy now is that of the version it resumed from
                self.console.print(
                    f"run {e['run_id']}: held-out accuracy {e['accuracy']:.3f} at v{e['start']} (resumed)"
                )
            else:
                self.console.print(f"run {e['run_id']}: initial held-out accuracy {e['accuracy']:.3f}")
        elif kind == "iteration":
            self.accuracy = e.get("eval/accuracy", self.accuracy)
            k = e["iteration"] + 1
            info = (
                f"reward {e['reward/mean']:.3f} acc {self.accuracy:.3f} gen {e['perf/gen_tokens_per_s']:.0f} tok/s "
                f"train {e['perf/train_tokens_per_s']:.0f} tok/s"
            )
            self.progress.update(self.iters, completed=k, info=info)
            now = time.perf_counter()
            if self.first_done is None:
                self.first_done = now
            if _line_due(k, self.total) or "eval/accuracy" in e:
                # the first iteration this process runs also starts its workers and loads their weights: the time
                # left is taken from the iterations after it, once there are some
                done = k - self.first - 1
                per_iter = (now - self.first_done) / done if done > 0 else now - self.t_start
                self._line(
                    f"iteration {k}/{self.total} {info} {e['time/iteration_s']:.2f} s/it "
                    f"eta {per_iter * (self.total - k):.0f} s"
                )
        elif kind == "done":
            self.progress.stop()

    def stop(self):
        self.progress.stop()


def _line_due(done: int, total: int) -> bool:
    """Whether a plain progress line (no terminal) is printed after `done` of `total`: every ~5%, and the last."""
    return done % max(1, total // 20) == 0 or done == total


def _progress_bar(console):
    """A rich progress bar (description, bar, done/total, time left, a line of figures) on a terminal; elsewhere
    disabled, and the caller prints plain lines."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


class _VersionsProgress:
    """The display of a command that goes over a run's versions (replay, eval), on stderr: the bar on a terminal;
    elsewhere one line every ~5% of the versions and the last. (The versions' figures go to stdout at the end, as a
    script reads them.) `info(event)` is a version's figure as the line shows it."""

    def __init__(self, console, name: str, verb: str, info: Callable[[dict], str]):
        self.console = console
        self.name, self.verb, self.info = name, verb, info
        self.progress = _progress_bar(console)
        self.bar = None
        self.done = self.total = 0
        self.t0 = time.perf_counter()

    def __call__(self, e: dict) -> None:
        if e["event"] == "start":
            self.total, self.t0 = e["versions"], time.perf_counter()
            self.progress.start()
            self.bar = self.progress.add_task(self.name, total=self.total, info="")
        elif e["event"] == "version":
            self.done += 1
            info = f"v{e['version']} {self.info(e)}"
            self.progress.update(self.bar, completed=self.done, info=info)
            if not self.console.is_terminal and _line_due(self.done, self.total):
                per_version = (time.perf_counter() - self.t0) / self.done
                self.console.print(
                    f"{self.verb} {self.done}/{self.total}: {info}, eta {per_version * (self.total - self.done):.0f} s"
                )

    def stop(self) -> None:
        self.progress.stop()


def _replay_progress(console) -> _VersionsProgress:
    return _VersionsProgress(console, "replay", "replayed", lambda e: f"max_abs_diff {e['max_abs_diff']:.3e}")


def _eval_progress(console) -> _VersionsProgress:
    return _VersionsProgress(console, "eval", "evaluated", lambda e: f"accuracy {e['accuracy']:.3f}")


def _console(**kwargs):
    """A rich console that prints text as it is: no markup (a `[cuda]` in a message was dropped as a tag: the vLLM
    install command lost its extras), no emoji codes (`:x:` in a value became an emoji), no highlighting."""
    from rich.console import Console

    return Console(markup=False, emoji=False, highlight=False, **kwargs)


def _error(console, message: str) -> None:
    """One `error:` line, the word in red, `message` as it is."""
    from rich.text import Text

    console.print(Text.assemble(("error:", "red"), " ", message))


def _warning(console, message: str) -> None:
    """One `warning:` line, the word in yellow, `message` as it is."""
    from rich.text import Text

    console.print(Text.assemble(("warning:", "yellow"), " ", message))


def _run_flow(console, config_path: str, overrides: list[str], resume: bool, source: str | None = None) -> int:
    from configs.schema import ConfigError, inert_settings, load_config
    from storage.lake import Lake
    from storage.lease import RunInUseError
    from tasks.preflight import (
        RunExistsError,
        check_backend,
        check_inputs,
        check_prefect_api,
        check_reward,
        check_run_free,
        check_tracking,
        thread_budget_note,
    )

    try:
        cfg = load_config(config_path, overrides, source, frozen=resume)  # fail fast, before Prefect or any work
        device = check_backend(cfg)  # first, as in open_session: a missing extra is the first thing to install
        check_reward(cfg, resumed=resume)  # a resumed run's too: its workers import the function again
        if not resume:  # a resumed run's v0 is in the lake already: its model.path may be gone since
            check_inputs(cfg)  # the model and dataset it names exist and read
            _refuse_memory(Lake(cfg.lake.uri))  # (resume's --lake was refused already)
        check_run_free(cfg, resume)  # a run id taken or in use (the flow looks again, under the run's lease)
        check_prefect_api()
        check_tracking(cfg)  # found in the flow before, after its imports and the server's start (~14 s); MLflow's
        # imports are the flow's too, and the flow's own look then costs nothing
    except (ConfigError, RunExistsError, RunInUseError) as e:
        _error(console, str(e))
        return 2
    if not resume:  # a resumed run's frozen config sets every field: only a new run's file and -o are the user's
        for note in inert_settings(cfg):
            _warning(console, note)
    if (note := thread_budget_note(cfg, device)) is not None:  # this machine's cores: a resume's too
        _warning(console, note)
    run = f"run {cfg.run.run_id}" if cfg.run.run_id else f"a run of {cfg.run.name}"
    console.print(f"{'resuming' if resume else 'starting'} {run} in lake {cfg.lake.uri}")
    from flows import api_server

    # a Ctrl-C must leave the temporary Prefect API server up for the flow to record its end (`install`); its start
    # overlaps the imports below
    server_started = api_server.start_in_background()
    from prefect.exceptions import TerminationSignal

    import flows.train as train_mod
    from models.tiny import ModelDirError
    from storage.checkpoints import CheckpointError
    from storage.datasets import DatasetError

    progress = _Progress(console)
    train_mod.progress_hook = progress
    t0 = time.perf_counter()
    input_errors = (RunExistsError, RunInUseError, ConfigError, DatasetError, ModelDirError)
    logged: list[BaseException] = []  # what the flow's log printed with its traceback
    try:
        server_started()
        with _reported_by_cli(*input_errors, logged=logged):
            summary = train_mod.train_flow(config_path=config_path, overrides=overrides, resume=resume)
    except (*input_errors, FileNotFoundError, CheckpointError) as e:  # input errors the flow finds only as it reads
        # them (a dataset's rows, the run to resume); the last two can also come from a bug or a damaged lake, so
        # Prefect's log keeps their traceback
        _error(console, str(e))
        return 2
    except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C, or SIGTERM (see _interrupt_on_sigterm): the flow has
        # unwound and cleaned up
        progress.stop()
        run_id = progress.run_id or cfg.run.run_id
        if run_id is None or not _run_created(cfg.lake.uri, run_id):  # stopped before its config.json was written
            console.print("interrupted before the run started")
        else:
            console.print(
                f"interrupted: run {run_id} keeps its promoted versions; continue it with "
                f"`lockstep resume {run_id} --lake {cfg.lake.uri}`"
            )
        return 130
    except Exception as e:  # the run failed: where the flow's log printed the traceback above (the user's code's, for a
        # reward function that raised), close with what failed and how to go on
        progress.stop()
        run_id = progress.run_id or cfg.run.run_id
        if not any(e is x for x in logged) or run_id is None or not _run_created(cfg.lake.uri, run_id):
            raise  # not printed (the API server's start, Prefect's own set-up), or before the run existed
        _error(
            console,
            f"run {run_id} failed: {_failure(e)}. It keeps its promoted versions: once the cause is fixed, continue "
            f"it with `lockstep resume {run_id} --lake {cfg.lake.uri}`",
        )
        return 1
    finally:
        progress.stop()
        train_mod.progress_hook = train_mod._no_progress  # a later run of this process (a library's) is not ours
    console.print(
        f"done in {time.perf_counter() - t0:.0f} s: held-out accuracy {summary['eval_accuracy_initial']:.3f} -> "
        f"{summary['eval_accuracy_final']:.3f}, {summary['samples_per_s']:.1f} samples/s, "
        f"version {summary['promoted_version']}"
    )
    print(f"{summary['run_id']} {summary['summary_path']}")
    return 0


def cmd_train(args) -> int:
    return _run_flow(_console(stderr=True, soft_wrap=True), args.config, args.override, resume=False)


def cmd_resume(args) -> int:
    """Continue a failed or killed run from its frozen config and promoted checkpoint."""
    import tempfile

    console = _console(stderr=True, soft_wrap=True)
    lake = _lake(args.lake)
    try:
        path = _run_config_path(lake, args.run_id)
        with lake.fs.open(path, "rb") as f:
            frozen = f.read()
    except (ValueError, FileNotFoundError) as e:
        _error(console, f"cannot resume {args.run_id!r} from lake {args.lake}: {e}")
        return 2
    if (finished := _finished_version(lake, args.run_id)) is not None:  # the flow would open the run, start its
        # workers and reopen its MLflow run only to find nothing to train
        console.print(f"run {args.run_id} has finished (version {finished}): nothing to resume")
        return 0
    frozen = _upgraded(frozen, lake_uri=args.lake)
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(frozen)  # JSON is YAML: the frozen config loads through the same validation
    try:
        return _run_flow(console, f.name, [], resume=True, source=path)
    finally:
        os.unlink(f.name)


def _finished_version(lake, run_id: str) -> int | None:
    """The last version of a run that has finished (its summary written), else None; a summary that does not read
    is left to the flow, which rewrites it."""
    from storage.lake import read_json

    try:
        return int(read_json(lake, f"{lake.run_dir(run_id)}/summary.json")["promoted_version"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _upgraded(frozen: bytes, lake_uri: str | None = None) -> bytes:
    """A frozen config.json with the fields added since its run started set as that run trained
    (`configs.schema.upgrade_frozen`), and `lake.uri` set to `lake_uri` (the lake it is resumed from, which may have
    moved: set in the file, not as an override, so that its errors name the run's config alone); bytes that are not
    a JSON object are left to the config loader's errors."""
    import json

    from configs.schema import upgrade_frozen

    try:
        data = json.loads(frozen)
    except ValueError:
        return frozen
    if not isinstance(data, dict):
        return frozen
    data = upgrade_frozen(data)
    if lake_uri is not None and isinstance(data.setdefault("lake", {}), dict):  # (not a mapping: the loader's error)
        data["lake"]["uri"] = lake_uri
    return json.dumps(data, indent=2).encode()


def _lake(uri: str):
    """The `--lake` of a command, its store asked once (object stores) before the command reads it."""
    from storage.lake import Lake

    lake = Lake(uri)
    _refuse_memory(lake)
    lake.check_reachable()
    return lake


def _refuse_memory(lake) -> None:
    """A memory:// lake (the tests' in-process store) is empty in a command's new process, and a run's rollout
    workers, processes of their own, would each write to one of their own: refused with what to give instead."""
    from storage.lake import LakeURLError

    if lake.protocol == "memory":
        raise LakeURLError(
            f"lake {lake.uri!r} lives in one process's memory (memory:// is for tests): a command would find it "
            "empty and a run's rollout workers could not share it; give a folder or an object store (s3://...)"
        )


def _failure(e: BaseException) -> str:
    """One line for a failed run's exception: its type and first line; for a process's ("rollout worker 0 failed:",
    "trainer rank 1 failed:", then that process's traceback), the first line and the traceback's last (what it
    raised)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 2 and lines[1].startswith("Traceback (most recent call last)"):
        return f"{lines[0]} {lines[-1]}"
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _run_created(lake_uri: str, run_id: str) -> bool:
    """Whether run `run_id` has its config.json in the lake, so that `lockstep resume` can continue it; True when the
    lake cannot be asked (the resume hint is then the better guess)."""
    from storage.lake import Lake

    try:
        lake = Lake(lake_uri)
        return lake.fs.exists(lake.config_file(run_id))
    except Exception:  # an unreachable store, an id the lake refuses: the stop's message must still be printed
        return True


def _frozen_setting(lake, config_path: str, section: str, field: str):
    """One setting of a run's frozen config.json as written (None if absent or unreadable: only for messages)."""
    from storage.lake import read_json

    try:
        return read_json(lake, config_path).get(section, {}).get(field)
    except (OSError, ValueError, AttributeError):
        return None


def _run_config_path(lake, run_id: str) -> str:
    """The frozen config of a run, which every run in a lake has from its start; FileNotFoundError if absent."""
    path = lake.config_file(run_id)  # run_dir validates the id (ValueError)
    if not lake.fs.exists(path):
        if lake.is_local and not lake.fs.isdir(lake.root):  # (a file there was refused by check_reachable)
            raise FileNotFoundError(f"lake {lake.uri} does not exist (no folder {lake.root}); give the lake's folder")
        raise FileNotFoundError(
            f"run {run_id} does not exist in lake {lake.uri} ({path} is missing); "
            f"`lockstep runs --lake {lake.uri}` lists its runs"
        )
    return path


def _run_config(lake, run_id: str):
    """The validated frozen config of a run (`configs.schema.frozen_config`); FileNotFoundError if the run is not
    there, ValueError if its config.json is not JSON or not a config."""
    from pydantic import ValidationError

    from configs.schema import frozen_config
    from storage.lake import read_json

    config_path = _run_config_path(lake, run_id)
    try:
        return frozen_config(read_json(lake, config_path))
    except (ValueError, ValidationError) as e:  # not JSON, or not a config
        raise ValueError(f"{config_path} is not a valid run config: {e}") from None


def cmd_replay(args) -> int:
    """Retrain from stored shards only and print, per version, the max abs parameter difference."""
    from prefect.exceptions import TerminationSignal

    from storage.checkpoints import CheckpointError
    from storage.lake import validate_run_id
    from storage.lease import RunInUseError
    from tasks.preflight import check_prefect_api, check_replayable

    try:
        lake = _lake(args.lake)
        _run_config_path(lake, args.run_id)  # checked before the flow starts Prefect
        if args.to is not None:
            validate_run_id(args.to)
        check_replayable(lake, args.run_id, args.to)  # a refusal imports nothing of the flow and starts no server
        check_prefect_api()
        console = _console(stderr=True, soft_wrap=True)
        target = f" into run {args.to}" if args.to else ""
        console.print(f"replaying run {args.run_id} in lake {args.lake}{target}")
        from flows import api_server

        server_started = api_server.start_in_background()  # its start overlaps the flow's imports
        import flows.replay as replay_mod

        server_started()
        progress = replay_mod.progress_hook = _replay_progress(console)
        # --to names an existing run, or one another process writes; other errors keep their traceback
        try:
            with _reported_by_cli(FileExistsError, RunInUseError):
                rows = replay_mod.replay_flow(run_id=args.run_id, lake_uri=args.lake, to_run_id=args.to)
        finally:
            progress.stop()
            replay_mod.progress_hook = replay_mod._no_progress
    except (ValueError, FileNotFoundError, FileExistsError, RunInUseError, CheckpointError) as e:  # a ConfigError
        # is a ValueError; CheckpointError: a damaged PROMOTED
        print(f"error: cannot replay {args.run_id!r}: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C or SIGTERM (Prefect's handler while the flow runs):
        # the source run is only read
        kept = (
            (f"; {args.to} keeps the versions replayed so far (replay refuses an existing target: choose another --to)")
            if args.to
            else ""
        )
        print(f"interrupted: replay of {args.run_id} stopped{kept}", file=sys.stderr)
        return 130
    for r in rows:
        print(f"v{r['version']:>6}  max_abs_diff {r['max_abs_diff']:.3e}")
    worst = max((r["max_abs_diff"] for r in rows), default=0.0)
    print(f"replayed {len(rows)} versions of {args.run_id}; worst max_abs_diff {worst:.3e}")
    return 0


def _unbalanced(sql: str) -> str | None:
    """Why a SQL filter's parentheses do not pair up outside its quoted strings and names (or it holds a comment,
    which could hide one from this count), or None if they do.

    `--where` is combined with `--version` as `(WHERE) AND policy_version = V`: an unpaired `)` would close the
    wrapper and OR past the version filter."""
    depth, quote = 0, None
    for i, c in enumerate(sql):
        if quote:
            quote = None if c == quote else quote  # a doubled quote ('it''s') closes and reopens: same result
        elif sql.startswith(("--", "/*"), i):  # a comment could hide a parenthesis from this count
            return f"comments ({sql[i : i + 2]} at character {i + 1}) are not accepted"
        elif c in "'\"`":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return f"the ')' at character {i + 1} closes nothing"
    if quote:
        return f"a {quote} string is not closed"
    return f"{depth} '(' not closed" if depth else None


def cmd_audit(args) -> int:
    """Query a run's rollout catalog: by version, with a SQL filter, as a table, JSON or CSV."""
    import json

    from rich.table import Table
    from rich.text import Text

    from storage import catalog, checkpoints

    lake = _lake(args.lake)
    try:
        config_path = _run_config_path(lake, args.run_id)  # before LanceDB, which would create the catalog folder
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.limit < 0:
        print(f"error: --limit {args.limit}: give a number of rows, or 0 for all", file=sys.stderr)
        return 2
    if args.where is not None and (why := _unbalanced(args.where)):
        print(f"error: --where {args.where!r}: {why}", file=sys.stderr)
        return 2
    if args.version is not None:
        try:
            promoted = checkpoints.promoted_version(lake, args.run_id)
        except checkpoints.CheckpointError:  # a damaged PROMOTED: its catalog is still worth auditing
            promoted = None
        if args.version < 0 or (promoted is not None and args.version > promoted):
            print(
                f"error: --version {args.version}: run {args.run_id} has versions 0 to {promoted or 0} (the newest "
                "promoted)",
                file=sys.stderr,
            )
            return 2
    uri = catalog.catalog_uri(lake, args.run_id)
    if uri is None:
        print(f"error: lake {args.lake} has no catalog (LanceDB needs a local or object-store lake)", file=sys.stderr)
        return 2
    if not lake.fs.exists(f"{lake.run_dir(args.run_id)}/catalog"):  # LanceDB would create an empty one
        why = "yet (no iteration was promoted)"
        if _frozen_setting(lake, config_path, "pipeline", "catalog") is False:
            why = "(it was trained with pipeline.catalog=false)"
        print(f"error: run {args.run_id} has no catalog {why}", file=sys.stderr)
        return 2
    where = [f"({args.where})"] if args.where else []
    if args.version is not None:
        where.append(f"policy_version = {int(args.version)}")
    columns = [
        "sample_id",
        "policy_version",
        "iteration",
        "prompt_id",
        "sample_index",
        "reward",
        "advantage",
        "finish_reason",
        "response_text",
        "worker",
    ]
    if args.format != "table":  # the shard's path: wider than the rest of a table's line together
        columns.append("shard")
    try:
        rows = catalog.query(uri, catalog.ROLLOUTS, " AND ".join(where) or None, args.limit, columns).to_pylist()
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # LanceDB's parser says what is wrong with a filter; other failures name the catalog
        about = f"--where {args.where!r}" if args.where else f"the catalog at {uri}"
        print(f"error: query failed for {about}: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(rows, indent=1, default=str))
    elif args.format == "csv":
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    else:
        table = Table(title=f"{args.run_id}: {len(rows)} samples")
        for c in columns:
            table.add_column(c, overflow="fold")  # a terminal narrower than the table wraps a cell, never cuts it
        for r in rows:
            # Text: a response's "[b]" is shown as written, not read as rich markup
            table.add_row(
                *(
                    Text(f"{v:.3f}" if isinstance(v, float) else repr(v) if c == "response_text" else str(v))
                    for c, v in r.items()
                )
            )
        console = _console()
        if not console.is_terminal:  # a pipe or a file: one line per sample, at the table's own width (80 cut it)
            console = _console(width=_console(width=100_000).measure(table).maximum)
        console.print(table)
    return 0


def cmd_runs(args) -> int:
    """Runs in a lake with their state and last promoted version; a damaged run is listed with what is wrong."""
    from storage import checkpoints, lease, ledger
    from storage.lake import validate_run_id

    lake = _lake(args.lake)
    if not lake.fs.isdir(lake.root):
        what = "is not a directory" if lake.fs.exists(lake.root) else "does not exist"
        print(f"error: lake {args.lake} {what}", file=sys.stderr)
        return 2
    root = f"{lake.root}/runs"
    if not lake.fs.exists(root):
        inside = "/runs/" in f"{lake.root}/" or lake.fs.exists(f"{lake.root}/config.json")  # a run's or runs/ folder
        print(f"no runs in {args.lake}" + (": give the lake's own folder, the one holding runs/" if inside else ""))
        return 0
    for path in sorted(lake.fs.ls(root, detail=False)):
        run_id = path.rstrip("/").rsplit("/", 1)[-1]
        if not lake.fs.isdir(path):
            continue  # a stray file is not a run
        try:
            validate_run_id(run_id)
        except ValueError:
            print(f"{run_id!r}: not a run (its name is not a run id), skipped", file=sys.stderr)
            continue
        if (
            not lease.other_entries(lake, run_id)
            and lease.holder(lake, run_id) is None
            and lake.fs.ls(path, detail=False)
        ):
            continue  # the lease files of a start that gave up before writing the run's config: not a run
        try:
            records = ledger.read_all(lake, run_id)
            version = checkpoints.promoted_version(lake, run_id)
        except (ValueError, OSError, checkpoints.CheckpointError) as e:  # a ledger record that is not JSON or not a
            # record: ValueError; a folder where a file should be: OSError
            print(f"{run_id:40s} {'damaged':24s} {e}")
            continue
        done = lake.fs.exists(f"{path}/summary.json")
        last = records[-1]["state"] if records else "created"
        state = "finished" if done else ("failed" if last == "failed" else f"stopped ({last})")
        held_by = lease.holder(lake, run_id)
        if held_by is not None:  # a ledger between two records reads "stopped" while its run goes on
            state = "running"
        line = f"{run_id:40s} {state:24s} version {version}"
        print(line if held_by is None else f"{line}  ({lease.describe(held_by)})")
    return 0


def _os_reason(e: OSError) -> str:
    """What the system refused, and on which path ('File exists: /out/file' when /out/file/sub was asked for)."""
    if not e.strerror:  # raised by lockstep with its own message
        return str(e)
    return f"{e.strerror}: {e.filename}" if e.filename else e.strerror


def cmd_export(args) -> int:
    """Write one version of a run as a standalone Hugging Face directory."""
    from storage import checkpoints

    lake = _lake(args.lake)
    try:
        if not args.out.strip():  # Path("") is the working directory: "exists and is not empty" was the message
            raise ValueError("--out is empty: give the directory to export into (a new or empty one)")
        _run_config_path(lake, args.run_id)
        if args.version is not None and args.version < 0:
            raise ValueError(f"--version {args.version}: versions start at 0")
        version = args.version if args.version is not None else checkpoints.promoted_version(lake, args.run_id)
        if version is None:
            raise FileNotFoundError(f"run {args.run_id} has no promoted version in {args.lake} yet")
        path = lake.checkpoint_dir(args.run_id, version)
        if not lake.fs.exists(path):
            kept = checkpoints.stored_versions(lake, args.run_id)
            raise FileNotFoundError(
                f"run {args.run_id} has no checkpoint v{version}; it has {', '.join(f'v{v}' for v in kept) or 'none'}"
            )
    except (FileNotFoundError, ValueError, checkpoints.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        out = checkpoints.export_hf(lake, path, args.out)
    except checkpoints.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the target: a file, not writable, no space; nothing is left there
        print(f"error: cannot export to --out {args.out}: {_os_reason(e)}", file=sys.stderr)
        return 2
    print(f"exported {args.run_id} v{version} to {out}")
    return 0


def cmd_eval(args) -> int:
    """Held-out accuracy of stored versions of a run, measured again from their checkpoints."""
    from flows import evaluate
    from storage.checkpoints import CheckpointError
    from tasks.preflight import check_reward

    lake = _lake(args.lake)
    try:
        cfg = _run_config(lake, args.run_id)
        check_reward(cfg, resumed=True)  # held-out answers are scored by the run's reward: before any generation
        versions = evaluate.chosen_versions(lake, args.run_id, args.version, args.every)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"error: {_os_reason(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"error: --threads {args.threads}: give at least 1", file=sys.stderr)
        return 2
    console = _console(stderr=True, soft_wrap=True)
    listed = ", ".join(f"v{v}" for v in versions) if len(versions) <= 8 else f"{len(versions)} versions"
    progress = _eval_progress(console)

    def on_progress(e: dict) -> None:
        if e["event"] == "start":  # what the figures depend on besides the weights
            console.print(
                f"evaluating {listed} of run {args.run_id} on its {e['prompts']} held-out prompts ({e['device']}, "
                f"attention {e['attention']}, {e['threads']} thread{'s' if e['threads'] != 1 else ''})"
            )
        progress(e)

    import torch

    rows: list[dict] = []
    stopped: tuple[int, str] | None = None  # (exit code, message) of an evaluation cut short
    try:
        rows.extend(evaluate.evaluate_versions(cfg, lake, args.run_id, versions, on_progress, args.threads))
    except (OSError, ValueError, CheckpointError, torch.OutOfMemoryError) as e:  # a damaged checkpoint, a dataset
        # moved or gone since the run, a device not there (InputError, a ValueError) or full (the training run's GPU)
        reason = _os_reason(e) if isinstance(e, OSError) else str(e)
        if isinstance(e, torch.OutOfMemoryError):
            reason = f"out of device memory ({reason.splitlines()[0]}); wait for the run's end, or free the device"
        stopped = (2, f"error: cannot evaluate {args.run_id!r}: {reason}")
    except KeyboardInterrupt:
        stopped = (130, f"interrupted: evaluation of {args.run_id} stopped after {len(rows)} versions")
    progress.stop()
    _print_rows(rows, args.format)  # those evaluated before a stop too
    if stopped is not None:
        print(stopped[1], file=sys.stderr)
        return stopped[0]
    if len(rows) > 1:  # on stderr: stdout stays the rows alone, for a script
        best = max(rows, key=lambda r: (r["accuracy"], -r["version"]))  # the earliest of equals
        console.print(f"best: v{best['version']} accuracy {best['accuracy']:.3f} of {len(rows)} versions")
    return 0


def _print_rows(rows: list[dict], fmt: str) -> None:
    """`lockstep eval`'s rows on stdout: a line each (table), a JSON list, or CSV with a header; nothing for none."""
    import json

    if not rows:
        return
    if fmt == "json":
        print(json.dumps(rows, indent=1))
    elif fmt == "csv":
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    else:
        for r in rows:
            print(
                f"v{r['version']:>6}  accuracy {r['accuracy']:.3f}  ({r['correct']}/{r['prompts']})  "
                f"{r['seconds']:.1f} s"
            )


def cmd_report(args) -> int:
    """PNG + HTML of a run's figures per iteration, written to --out and logged to its MLflow run."""
    # MLflow's default of 7 retries with backoff waits ~4 minutes for a tracking server that is down; a report
    # the user is waiting for fails within seconds instead (the variable, if set, wins)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from flows.report import render, run_metrics

    lake = _lake(args.lake)
    try:
        cfg = _run_config(lake, args.run_id)
        if not cfg.tracking.enabled:
            raise ValueError(
                f"run {args.run_id} was trained with tracking.enabled=false: it has no MLflow records to report"
            )
        mlflow_id, metrics = run_metrics(cfg.tracking.uri, args.run_id)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MlflowException as e:
        print(f"error: cannot read run {args.run_id}'s metrics from {cfg.tracking.uri}: {e.message}", file=sys.stderr)
        return 2
    try:
        png, page = render(args.run_id, metrics, args.out)
    except OSError as e:
        print(f"error: cannot write the report to --out {args.out}: {_os_reason(e)}", file=sys.stderr)
        return 2
    try:
        client = MlflowClient(tracking_uri=cfg.tracking.uri)
        client.log_artifact(mlflow_id, png, "report")
        client.log_artifact(mlflow_id, page, "report")
    except (MlflowException, OSError) as e:  # the files are written: say so
        print(f"{png}\n{page}\nerror: written, but not logged to MLflow run {mlflow_id}: {e}", file=sys.stderr)
        return 1
    print(f"{png}\n{page}")
    return 0


def cmd_serve(args) -> int:
    """Publish `train_flow` as a deployment on the Prefect server and run what the UI triggers or schedules."""
    from prefect.settings import PREFECT_API_URL

    from configs.schema import ConfigError, inert_settings, load_config
    from storage.lake import Lake
    from tasks.preflight import check_backend, check_inputs, check_prefect_api, check_reward, check_tracking

    try:  # the deployment's default parameters: a bad config would fail every triggered run
        cfg = load_config(args.config, args.override)
        check_backend(cfg)  # first, as in train and open_session: a missing extra is the first thing to install
        check_reward(cfg)
        check_inputs(cfg)
        _refuse_memory(Lake(cfg.lake.uri))
        if args.cron is not None:  # Prefect refused it only once the deployment was being published: a traceback
            from prefect.client.schemas.schedules import CronSchedule

            try:
                CronSchedule(cron=args.cron)
            except ValueError:
                raise ConfigError(
                    f"--cron {args.cron!r} is not a cron schedule: give five fields (minute hour day-of-month "
                    "month day-of-week), e.g. --cron '0 3 * * *' for 03:00 every day"
                ) from None
        if not PREFECT_API_URL.value():
            print(
                "error: lockstep serve needs a Prefect server: run `make services`, then "
                "export PREFECT_API_URL=http://127.0.0.1:4200/api",
                file=sys.stderr,
            )
            return 2
        check_prefect_api()
        check_tracking(cfg)  # last: it creates a SQLite store
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in inert_settings(cfg):  # the deployment's default config, as train says them of its own
        print(f"warning: {note}", file=sys.stderr)
    import httpx

    from flows.train import train_flow

    config = os.path.abspath(args.config)
    print(f"serving deployment lockstep-train/{args.name} with {config}; trigger runs from the Prefect UI", flush=True)
    try:
        train_flow.serve(
            name=args.name,
            parameters={"config_path": config, "overrides": args.override},
            cron=args.cron,
            print_starting_message=False,
        )
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        print(
            f"error: the Prefect API at PREFECT_API_URL={PREFECT_API_URL.value()} is unreachable ({e}); "
            "start it with `make services`, or fix PREFECT_API_URL",
            file=sys.stderr,
        )
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="On-policy periodic-asynchronous RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run an experiment from a YAML config")
    p.add_argument("config", help="YAML config, e.g. configs/arith-tiny.yaml")
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. -o trainer.lr=1e-5 (repeatable)",
    )
    p.set_defaults(func=cmd_train)
    r = sub.add_parser("resume", help="continue a failed or killed run where it stopped")
    r.add_argument("run_id")
    r.add_argument("--lake", default="./lake", help="lake URL holding the run (default ./lake)")
    r.set_defaults(func=cmd_resume)
    p = sub.add_parser("replay", help="retrain a run from its stored rollouts and compare every version")
    p.add_argument("run_id")
    p.add_argument("--lake", default="./lake")
    p.add_argument("--to", default=None, metavar="NEW_RUN_ID", help="write the replayed checkpoints as a new run")
    p.set_defaults(func=cmd_replay)
    p = sub.add_parser("audit", help="query the rollouts of a run (LanceDB catalog)")
    p.add_argument("run_id")
    p.add_argument("--lake", default="./lake")
    p.add_argument("--version", type=int, default=None, help="only samples generated by this policy version")
    p.add_argument("--where", default=None, help="SQL filter, e.g. \"reward < 0.5 AND finish_reason = 'length'\"")
    p.add_argument("--limit", type=int, default=20, help="rows to show (default 20; 0: all)")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")
    p.set_defaults(func=cmd_audit)
    p = sub.add_parser("export", help="write a version of a run as a Hugging Face directory")
    p.add_argument("run_id")
    p.add_argument("--version", type=int, default=None, help="default: the promoted version")
    p.add_argument("--out", required=True, help="a new local directory")
    p.add_argument("--lake", default="./lake")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("eval", help="held-out accuracy of stored versions of a run, from their checkpoints")
    p.add_argument("run_id")
    p.add_argument("--lake", default="./lake")
    p.add_argument(
        "--version",
        type=int,
        action="append",
        default=[],
        help="a version to evaluate (repeatable; default: the promoted one)",
    )
    p.add_argument("--every", type=int, default=None, metavar="N", help="every N-th version, and the promoted one")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the run's resources.train_threads)")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("report", help="PNG + HTML of a run's figures per iteration (also logged to MLflow)")
    p.add_argument("run_id")
    p.add_argument("--lake", default="./lake")
    p.add_argument("--out", default="reports")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("serve", help="publish train_flow as a Prefect deployment and run what the UI triggers")
    p.add_argument("config", help="default config of triggered runs (the UI may override config_path)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--name", default="lockstep-train", help="deployment name")
    p.add_argument("--cron", default=None, help="optional schedule, e.g. '0 3 * * *'")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("runs", help="list the runs of a lake with their state and last version")
    p.add_argument("--lake", default="./lake")
    p.set_defaults(func=cmd_runs)
    return parser


def _interrupt_on_sigterm() -> None:
    """Let SIGTERM (`kill`, a scheduler stopping the job) unwind the run as Ctrl-C does.

    While the flow runs, Prefect's own handler raises TerminationSignal and, once the flow run is marked crashed,
    passes the signal on to the handler it found. That was Python's default, which ends the process at once: no
    `finally`, no atexit, so the ephemeral Prefect API server was left running (~9% of a core, seen here). As
    KeyboardInterrupt the process unwinds: rollout workers stop, the MLflow run ends KILLED, the API server stops.
    Promoted versions are durable either way, and `lockstep resume` continues from the last one."""
    import signal

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, raise_interrupt)


def main(argv: list[str] | None = None) -> int:
    _quiet_environment()
    _interrupt_on_sigterm()
    args = build_parser().parse_args(argv)
    from storage.lake import LakeURLError

    try:
        return args.func(args)
    except LakeURLError as e:  # --lake of any command
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM in a command that does not say more (train, resume, replay do)
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():  # another pipe or socket: a real error
            raise
        # `lockstep audit ... | head` closed the pipe: the rest of the output is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        return 1


def _stdout_closed() -> bool:
    """Whether the reader of stdout went away (a pipe whose read end is closed reports POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout file descriptor (replaced, closed)
        return False


def run() -> None:
    """The `lockstep` command (also `python -m flows.cli`): `main`, then exit with its code.

    The interpreter's last garbage collection at exit walks every object the libraries of a run (torch,
    transformers, Prefect, MLflow) left on the heap: ~2.5 s after a tiny run, a tenth of the command's time.
    `gc.freeze()` first moves them where that collection does not look. Everything else of the exit still happens
    (non-daemon threads joined, atexit handlers, module teardown); nothing of lockstep relies on the collector at
    exit: shards, checkpoints, the ledger and MLflow are written, closed and flushed before `main` returns."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
