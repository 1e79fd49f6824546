"""`lockstep replay`, `audit`, `serve`, and `train`'s handling of input errors found inside the flow: a missing
run, a bad run id or config, an unreachable Prefect API exit 2 with one `error:` line, never a traceback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from configs.schema import ConfigError, load_config, resolved_json
from flows import api_server, cli
from storage import checkpoints, lease
from storage.checkpoints import CheckpointError
from storage.datasets import DatasetError
from storage.lake import Lake
from tasks import preflight
from tests.cli_output import cli_stderr, squash
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
ARITH = str(REPO / "configs" / "arith-tiny.yaml")


def replace_flow(monkeypatch, flow, name: str = "train_flow", tracking: bool = False) -> list[str]:
    """The CLI's `train_flow` (flows.train) or `replay_flow` (flows.replay) replaced by `flow`; so is the start of the
    temporary Prefect API server (a unit test starts none), and `flow` is called only after that start-up was waited
    for (asserted). The tracking store is not opened unless `tracking` (the config's default is the working
    directory's mlflow.db). Returns what happened to the server: "started", then "waited" as the command did each."""
    import importlib

    import tasks.preflight

    if not tracking:
        monkeypatch.setattr(tasks.preflight, "check_tracking", lambda cfg: None)
    server: list[str] = []

    def start():
        server.append("started")
        return lambda: server.append("waited")

    monkeypatch.setattr(api_server, "start_in_background", start)

    def checked(**kwargs):
        assert "waited" in server, "the flow was called before the temporary API server's start-up was waited for"
        return flow(**kwargs)

    monkeypatch.setattr(importlib.import_module(f"flows.{name.removesuffix('_flow')}"), name, checked)
    return server


@pytest.fixture
def lake_with_run(tmp_path) -> Path:
    """A lake holding run `r1`'s frozen config, as every run has from its start."""
    run = tmp_path / "lake" / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(resolved_json(load_config(None, ["run.run_id=r1"])))
    return tmp_path / "lake"


@pytest.fixture
def no_replay(monkeypatch):
    def fail(**kwargs):
        raise AssertionError("the replay flow must not start")

    return replace_flow(monkeypatch, fail, "replay_flow")


# ------------------------------------------------------------------------------------------------ replay


def test_replay_of_a_missing_run(lake_with_run, capsys, no_replay):
    assert cli.main(["replay", "ghost", "--lake", str(lake_with_run)]) == 2
    assert squash(
        f"error: cannot replay 'ghost': run ghost does not exist in lake {lake_with_run} "
        f"({lake_with_run}/runs/ghost/config.json is missing)"
    ) in cli_stderr(capsys)
    assert not (lake_with_run / "runs" / "ghost").exists()


@pytest.mark.parametrize("argv", [["../r1"], ["r1", "--to", "a/b"]])
def test_replay_with_an_invalid_run_id(lake_with_run, capsys, no_replay, argv):
    assert cli.main(["replay", *argv, "--lake", str(lake_with_run)]) == 2
    bad = argv[-1]
    assert squash(f"invalid run id {bad!r}: use 1-128 letters") in cli_stderr(capsys)


def test_replay_flow_errors_exit_2(lake_with_run, capsys, monkeypatch):
    def exists(run_id, lake_uri, to_run_id):
        raise FileExistsError(f"run {to_run_id} already exists in {lake_uri}: choose another --to")

    replace_flow(monkeypatch, exists, "replay_flow")
    (lake_with_run / "runs" / "r1" / "checkpoints" / "v000000").mkdir(parents=True)
    (lake_with_run / "runs" / "r1" / "checkpoints" / "v000000" / "MANIFEST.json").write_text("{}")
    (lake_with_run / "runs" / "r1" / "checkpoints" / "PROMOTED").write_text('{"version": 0}')
    assert cli.main(["replay", "r1", "--lake", str(lake_with_run), "--to", "r9"]) == 2  # a target made meanwhile
    assert squash(f"error: cannot replay 'r1': run r9 already exists in {lake_with_run}") in cli_stderr(capsys)


@pytest.mark.parametrize("target", ["r1", "r2"])
def test_replay_onto_an_existing_run_is_refused_before_the_flow(lake_with_run, capsys, no_replay, target):
    """The run itself, or another run of the lake: refused before Prefect starts (was ~11 s in, inside the flow), its
    temporary API server included."""
    (lake_with_run / "runs" / "r2").mkdir()
    (lake_with_run / "runs" / "r2" / "config.json").write_text("{}")
    assert cli.main(["replay", "r1", "--lake", str(lake_with_run), "--to", target]) == 2
    assert no_replay == []  # the server was not started
    assert squash(
        f"error: cannot replay 'r1': replay target run {target} already exists in {lake_with_run}: replay writes a "
        "new run and never overwrites one; choose another --to"
    ) in cli_stderr(capsys)


def test_a_replay_refusal_imports_neither_the_flow_nor_prefects_server(lake_with_run):
    """A refused replay checks the lake only: the flow's module (transformers, Prefect's flow engine)
    is imported, and the temporary API server started, after the refusals (a refusal took 6.2 s with them, 2.8 s
    without, on this machine). In a fresh interpreter, since this one may have imported both already."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    heavy = ["flows.replay", "transformers", "prefect.server.api.server"]
    probe = (
        f"import sys; from flows import cli; code = cli.main(['replay', 'r1', '--lake', {str(lake_with_run)!r}, "
        f"'--to', 'r1']); print(code, [m for m in {heavy!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr[-2000:]
    assert "replay target run r1 already exists" in out.stderr


def test_replay_of_an_object_store_run_loads_v0_from_a_copy_it_removes(tiny_hf, tmp_path, monkeypatch):
    """An object-store lake's v0 is copied to a temporary folder of the replay's own (not a fixed /tmp cache that
    nothing cleans), and the copy is gone once the model is loaded."""
    import flows.replay

    lake = Lake(f"memory://lockstep-replay-{uuid.uuid4().hex}")
    lake.fs.pipe(f"{lake.run_dir('r1')}/config.json", resolved_json(load_config(None, ["run.run_id=r1"])).encode())
    checkpoints.save_checkpoint(lake, "r1", 0, tiny_hf.model, tiny_hf.tokenizer)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    real_copy, copies = checkpoints.local_copy, []

    def local_copy(lake, path, cache_dir):
        copies.append(real_copy(lake, path, cache_dir))
        return copies[-1]

    monkeypatch.setattr(checkpoints, "local_copy", local_copy)
    try:
        assert flows.replay._replay("r1", lake) == []  # no iteration in the ledger: v0 only
    finally:
        lake.fs.rm(lake.root, recursive=True)
    [copy] = copies
    assert os.path.dirname(os.path.dirname(copy)) == str(temp)
    assert list(temp.iterdir()) == []


# ------------------------------------------------------------------------------------------------ audit


def test_audit_of_a_missing_run_says_so_and_writes_nothing(lake_with_run, capsys):
    assert cli.main(["audit", "ghost", "--lake", str(lake_with_run)]) == 2
    err = cli_stderr(capsys)
    assert squash(f"error: run ghost does not exist in lake {lake_with_run}") in err
    assert "promoted" not in err
    assert not (lake_with_run / "runs" / "ghost").exists()  # LanceDB used to create runs/ghost/catalog


def test_audit_refuses_a_negative_limit_and_a_run_without_catalog(lake_with_run, capsys):
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run), "--limit", "-1"]) == 2
    assert squash("error: --limit -1: give a number of rows, or 0 for all") in cli_stderr(capsys)
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run)]) == 2
    assert squash("error: run r1 has no catalog yet (no iteration was promoted)") in cli_stderr(capsys)
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run), "--limit", "0"]) == 2  # 0 (all) is a valid limit:
    assert squash("error: run r1 has no catalog yet") in cli_stderr(capsys)  # what stops it is the missing catalog
    assert not (lake_with_run / "runs" / "r1" / "catalog").exists()  # LanceDB created an empty one before
    frozen = lake_with_run / "runs" / "r1" / "config.json"
    frozen.write_text(resolved_json(load_config(None, ["run.run_id=r1", "pipeline.catalog=false"])))
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run)]) == 2
    assert squash("error: run r1 has no catalog (it was trained with pipeline.catalog=false)") in cli_stderr(capsys)


@pytest.mark.parametrize("version", [-1, 3])
def test_audit_of_a_version_the_run_does_not_have_is_refused(lake_with_run, capsys, version):
    """Was an empty table and exit 0."""
    (lake_with_run / "runs" / "r1" / "checkpoints").mkdir()
    (lake_with_run / "runs" / "r1" / "checkpoints" / "PROMOTED").write_text(json.dumps({"version": 2}))
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run), "--version", str(version)]) == 2
    assert squash(f"error: --version {version}: run r1 has versions 0 to 2 (the newest promoted)") in cli_stderr(capsys)


def test_audit_of_a_run_whose_promoted_file_is_damaged_is_not_refused_for_it(lake_with_run, capsys):
    """A damaged PROMOTED says nothing of the catalog, which is what one audits a damaged run with: the version is
    then not checked, and what stops this audit is the missing catalog."""
    (lake_with_run / "runs" / "r1" / "checkpoints").mkdir()
    (lake_with_run / "runs" / "r1" / "checkpoints" / "PROMOTED").write_text("not json")
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run), "--version", "7"]) == 2
    assert squash("error: run r1 has no catalog yet (no iteration was promoted)") in cli_stderr(capsys)


@pytest.mark.parametrize(
    "where, why",
    [
        ("reward >= 0) OR (reward > 5", "the ')' at character 12 closes nothing"),  # escaped the version filter
        ("(reward > 0", "1 '(' not closed"),
        ("finish_reason = 'stop", "a ' string is not closed"),
        # a comment hid a ')' from the count and escaped the version filter
        ("reward > 0 /* ( */ ) OR (reward > 0.4 /* ) */", "comments (/* at character 12) are not accepted"),
        ("reward > 0 -- (", "comments (-- at character 12) are not accepted"),
    ],
)
def test_audit_refuses_a_filter_that_would_escape_the_version_filter(lake_with_run, capsys, where, why):
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run), "--version", "1", "--where", where]) == 2
    assert squash(f"error: --where {where!r}: {why}") in cli_stderr(capsys)


@pytest.mark.parametrize(
    "where", ["reward > 0 AND (finish_reason = ')')", "response_text LIKE '%it''s (%'", '"reward" > 0', "(a) AND ((b))"]
)
def test_parentheses_in_strings_and_names_are_not_counted(where):
    assert cli._unbalanced(where) is None


def _one_sample_catalog(lake, monkeypatch, **values):
    """The audit of run r1 in `lake` reads one sample: the given values over plain ones. Printed as to a pipe."""
    import pyarrow as pa

    from storage import catalog

    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)  # what would make rich take the test's output for a terminal
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    (lake / "runs" / "r1" / "catalog").mkdir()
    row = {
        "sample_id": "r1/0/0-2958/0",
        "policy_version": 1,
        "iteration": 0,
        "prompt_id": "2958",
        "sample_index": 0,
        "reward": 0.5,
        "advantage": -0.25,
        "finish_reason": "stop",
        "response_text": "27",
        "worker": 0,
    } | values
    monkeypatch.setattr(
        catalog, "query", lambda uri, table, where, limit, columns: pa.Table.from_pylist([{c: row[c] for c in columns}])
    )
    return row


def test_audit_table_shows_brackets_as_written(lake_with_run, capsys, monkeypatch):
    """A response or an id with `[b]` in it is text in the table, not rich markup it would vanish into."""
    _one_sample_catalog(lake_with_run, monkeypatch, sample_id="s[i]", prompt_id="p[b]:x:", response_text="[b]19[/b]")
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run)]) == 0
    out = capsys.readouterr().out
    assert "'[b]19[/b]'" in out and "s[i]" in out and "p[b]:x:" in out and "-0.250" in out  # :x: not an emoji


def test_audit_table_in_a_pipe_keeps_one_line_per_sample_at_its_own_width(lake_with_run, capsys, monkeypatch):
    """Piped or written to a file, the table is as wide as its cells: at the 80 columns a pipe gets, its ten columns
    were cut to 'r1/0…' and 'poli…' (unreadable, and no use to grep)."""
    long = "the answer is " + "9" * 90
    row = _one_sample_catalog(lake_with_run, monkeypatch, response_text=long)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "sample_id" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")] == list(row)  # every column named in full
    (sample,) = [line for line in lines if row["sample_id"] in line]  # the sample is one line
    cells = [c.strip() for c in sample.strip("│").split("│")]
    assert cells == ["r1/0/0-2958/0", "1", "0", "2958", "0", "0.500", "-0.250", "stop", repr(long), "0"]
    assert "…" not in "\n".join(lines) and len(sample) > 150


def test_audit_table_on_a_narrow_terminal_wraps_cells_and_cuts_none(lake_with_run, capsys, monkeypatch):
    """On a terminal narrower than the table a cell folds onto more lines; read down its column, it is whole."""
    import re

    row = _one_sample_catalog(lake_with_run, monkeypatch, response_text="x" * 60)
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # what rich reads as a terminal
    assert cli.main(["audit", "r1", "--lake", str(lake_with_run)]) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 60 and "…" not in out
    body = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    assert len(body) > 1  # the one sample took several lines
    column = {name: "".join(cells[i] for cells in body) for i, name in enumerate(row)}
    assert column["sample_id"] == row["sample_id"] and column["response_text"] == repr(row["response_text"])
    assert column["advantage"] == "-0.250" and column["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------------ runs


def test_runs_lists_damaged_runs_and_skips_what_is_not_a_run(lake_with_run, capsys):
    runs = lake_with_run / "runs"
    for name in ("b1", "c1", "my run"):
        (runs / name).mkdir()
        (runs / name / "config.json").write_text("{}")
    (runs / "b1" / "ledger").mkdir()
    (runs / "b1" / "ledger" / "iter-000000.json").write_text("{bad")
    (runs / "c1" / "checkpoints").mkdir()
    (runs / "c1" / "checkpoints" / "PROMOTED").write_text('{"v": 1}')
    (runs / "README.txt").write_text("notes")
    for name, damage in (("d1", "ledger"), ("e1", "promoted")):
        (runs / name / "checkpoints").mkdir(parents=True)
        (runs / name / "config.json").write_text("{}")
        if damage == "ledger":  # JSON, but not a record
            (runs / name / "ledger").mkdir()
            (runs / name / "ledger" / "iter-000000.json").write_text("[1]")
        else:  # a folder where PROMOTED should be
            (runs / name / "checkpoints" / "PROMOTED").mkdir()
    assert cli.main(["runs", "--lake", str(lake_with_run)]) == 0  # one bad entry used to end the listing
    out = capsys.readouterr()
    lines = {line.split()[0]: line for line in out.out.splitlines()}
    assert sorted(lines) == ["b1", "c1", "d1", "e1", "r1"]  # README.txt was listed as a run, "my run" crashed it
    assert "damaged" in lines["d1"] and "iter-000000.json is not a ledger record" in lines["d1"]
    assert "damaged" in lines["e1"] and "Is a directory" in lines["e1"]
    assert "damaged" in lines["b1"] and f"{runs}/b1/ledger/iter-000000.json is not valid JSON" in lines["b1"]
    assert "damaged" in lines["c1"] and "PROMOTED is damaged (KeyError: 'version')" in lines["c1"]
    assert "stopped (created)" in lines["r1"] and "version None" in lines["r1"]
    assert "'my run': not a run (its name is not a run id), skipped" in out.err


def test_runs_shows_each_run_by_its_last_ledger_record(lake_with_run, capsys):
    import json

    ledger_dir = lake_with_run / "runs" / "r1" / "ledger"
    ledger_dir.mkdir()
    for k, state in enumerate(["promoted", "failed"]):
        (ledger_dir / f"iter-{k:06d}.json").write_text(json.dumps({"iteration": k, "state": state, "history": []}))
    assert cli.main(["runs", "--lake", str(lake_with_run)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == ["r1", "failed"]


@pytest.mark.parametrize("what", ["missing", "file"])
def test_runs_of_a_lake_that_is_not_there(tmp_path, capsys, what):
    lake = tmp_path / "lake"
    if what == "file":
        lake.write_text("")
    assert cli.main(["runs", "--lake", str(lake)]) == 2  # was "no runs in ..." and exit 0
    reason = (
        f"'{lake}': {lake} is not a folder; give a folder for the lake" if what == "file" else f"{lake} does not exist"
    )
    assert squash(f"error: lake {reason}") in cli_stderr(capsys)


def test_runs_given_a_runs_folder_or_a_run_points_to_the_lake(lake_with_run, capsys):
    for inside in (lake_with_run / "runs", lake_with_run / "runs" / "r1"):
        assert cli.main(["runs", "--lake", str(inside)]) == 0
        assert capsys.readouterr().out == f"no runs in {inside}: give the lake's own folder, the one holding runs/\n"
    empty = lake_with_run.parent / "empty-lake"
    empty.mkdir()
    assert cli.main(["runs", "--lake", str(empty)]) == 0
    assert capsys.readouterr().out == f"no runs in {empty}\n"


@pytest.mark.parametrize("command", ["resume", "audit", "report"])
def test_a_run_command_on_a_lake_that_is_not_there_says_so(tmp_path, capsys, command):
    """Not "run r1 does not exist in lake ...": the lake itself is missing, or a file."""
    missing, afile = tmp_path / "no-lake", tmp_path / "afile"
    afile.write_text("")
    assert cli.main([command, "r1", "--lake", str(missing)]) == 2
    assert squash(f"lake {missing} does not exist (no folder {missing}); give the lake's folder") in cli_stderr(capsys)
    assert cli.main([command, "r1", "--lake", str(afile)]) == 2
    assert squash(f"error: lake '{afile}': {afile} is not a folder; give a folder for the lake") in cli_stderr(capsys)
    assert not missing.exists()


# ------------------------------------------------------------------------------------------------ --lake URLs


@pytest.mark.parametrize(
    "argv",
    [["runs"], ["resume", "r1"], ["replay", "r1"], ["audit", "r1"], ["report", "r1"], ["export", "r1", "--out", "x"]],
)
@pytest.mark.parametrize("url", ["nosuchfs://lake", "simplecache::nosuchfs://lake"])
def test_a_lake_url_without_a_filesystem_is_one_error_line(argv, url, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*argv, "--lake", url]) == 2  # was a ValueError or ImportError traceback from fsspec
    assert squash(
        f"error: {'cannot replay ' + repr('r1') + ': ' if argv[0] == 'replay' else ''}lake {url!r}: "
        "Protocol not known: nosuchfs; give a local directory or an fsspec URL whose filesystem is "
        "installed (s3:// needs s3fs"
    ) in cli_stderr(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [["runs"], ["resume", "r1"], ["audit", "r1"], ["export", "r1", "--out", "x"]],
)
def test_an_empty_lake_is_one_error_line_not_the_working_directory(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `runs --lake ""` listed this folder's runs: "no runs in ", exit 0
    assert cli.main([*argv, "--lake", ""]) == 2
    assert squash("error: the lake is an empty string: give a local directory") in cli_stderr(capsys)
    assert list(tmp_path.iterdir()) == []


def test_train_with_a_lake_url_without_a_filesystem_exits_2_before_any_work(capsys):
    assert cli.main(["train", ARITH, "-o", "lake.uri=nosuchfs://lake"]) == 2
    assert squash("error: lake.uri: lake 'nosuchfs://lake': Protocol not known: nosuchfs;") in cli_stderr(capsys)


@pytest.mark.parametrize("below", ["", "sub/lake"])
def test_train_on_a_lake_path_that_is_a_file_exits_2_before_any_work(tmp_path, capsys, below):
    """A file where the lake's folder (or a folder above it) would be: was a NotADirectoryError traceback ~14 s in."""
    afile = tmp_path / "afile"
    afile.write_text("not a lake")
    uri = str(afile / below) if below else str(afile)
    assert cli.main(["train", ARITH, "-o", f"lake.uri={uri}", "-o", "tracking.enabled=false"]) == 2
    above = f" (above the lake's folder {uri})" if below else ""
    assert squash(f"error: lake.uri: lake '{uri}': {afile}{above} is not a folder; give a folder") in cli_stderr(capsys)
    assert afile.read_text() == "not a lake"


@pytest.mark.parametrize("argv", [["train", ARITH, "-o", "lake.uri=memory://lk"], ["runs", "--lake", "memory://lk"]])
def test_a_memory_lake_is_refused_by_commands(capsys, argv):
    """A command's process starts with an empty memory://, and a run's rollout workers would each write to their own
    (a run failed ~20 s in with its groups lost)."""
    assert cli.main(argv) == 2
    assert squash("error: lake 'memory://lk' lives in one process's memory (memory:// is for tests)") in cli_stderr(
        capsys
    )


def test_gpu_config_without_vllm_names_the_install_command_first(capsys, tmp_path):
    """README's GPU command on a machine without vLLM: the install command, before the model and dataset checks
    (offline, the hub model and GSM8K would fail them) and before any work."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    gpu = str(Path(ARITH).with_name("qwen2.5-1.5b-gsm8k.yaml"))
    assert cli.main(["train", gpu, "-o", f"lake.uri={tmp_path / 'lake'}"]) == 2
    # the extras in brackets are text, not rich markup (which swallowed them)
    assert squash(
        "error: rollout.engine is 'vllm' but vLLM is not installed: pip install 'lockstep-rl[cuda]' (CUDA) "
        "or 'lockstep-rl[npu]' (Ascend, with vllm-ascend); or set rollout.engine=builtin"
    ) in cli_stderr(capsys)
    assert not (tmp_path / "lake").exists()


def test_error_quotes_a_bad_value_as_written(capsys):
    """The value quoted in an error is the one given: `:x:` is not an emoji code, `[b]` not markup."""
    assert cli.main(["train", ARITH, "-o", "run.name=exp:x:[b]1"]) == 2
    assert squash("(got 'exp:x:[b]1')") in cli_stderr(capsys)


# ------------------------------------------------------------------------------------------------ report


@pytest.mark.parametrize(
    "tracking, expected",
    [
        (
            {"enabled": False},
            "error: run r1 was trained with tracking.enabled=false: it has no MLflow records to report",
        ),
        (
            {"enabled": True, "uri": "sqlite:///mlflow.db"},
            "error: no MLflow database at {cwd}/mlflow.db (tracking.uri "
            "'sqlite:///mlflow.db'; a relative path is read from the directory the command runs in",
        ),
    ],
)
def test_report_without_mlflow_records_says_why_and_writes_nothing(
    lake_with_run, tmp_path, capsys, monkeypatch, tracking, expected
):
    overrides = ["run.run_id=r1"] + [f"tracking.{k}={v}" for k, v in tracking.items()]
    (lake_with_run / "runs" / "r1" / "config.json").write_text(resolved_json(load_config(None, overrides)))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert cli.main(["report", "r1", "--lake", str(lake_with_run), "--out", str(tmp_path / "rep")]) == 2
    assert squash(expected.format(cwd=cwd)) in cli_stderr(capsys)
    assert list(cwd.iterdir()) == []  # MLflow created an empty mlflow.db here before
    assert not (tmp_path / "rep").exists()


def test_report_with_an_unreachable_tracking_server_fails_in_seconds(lake_with_run, capsys, monkeypatch, caplog):
    # urllib3's retry warnings reach the root logger, where an in-process flow of an earlier test left Prefect's
    # console handler writing to that test's closed capture ("--- Logging error ---"); the CLI's own line is checked
    caplog.set_level(logging.ERROR, logger="urllib3")
    port = free_port()
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    config = load_config(None, ["run.run_id=r1", f"tracking.uri=http://127.0.0.1:{port}"])
    (lake_with_run / "runs" / "r1" / "config.json").write_text(resolved_json(config))
    t0 = time.monotonic()
    assert cli.main(["report", "r1", "--lake", str(lake_with_run), "--out", "rep"]) == 2  # a traceback after ~4 min
    assert time.monotonic() - t0 < 60  # 2 retries (~7 s here); MLflow's default 7 took ~4 minutes
    assert squash(f"error: cannot read run r1's metrics from http://127.0.0.1:{port}") in cli_stderr(capsys)


# ------------------------------------------------------------------------------------------------ serve


@pytest.mark.parametrize("api_url", [None, "http://127.0.0.1:9/api"])
def test_serve_with_a_bad_config_exits_2(monkeypatch, capsys, api_url):
    if api_url is None:  # the config is checked first: its errors are the ones to fix whatever the server
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
    else:
        monkeypatch.setenv("PREFECT_API_URL", api_url)
    assert cli.main(["serve", ARITH, "-o", "trainer.lr=-1"]) == 2
    assert squash("trainer.lr: Input should be greater than 0 (got -1)") in cli_stderr(capsys)
    assert cli.main(["serve", ARITH, "-o", "model.path=/nonexistent/model"]) == 2
    assert squash("error: model.path '/nonexistent/model' is not a directory") in cli_stderr(capsys)
    assert cli.main(["serve", ARITH, "-o", "task.reward=lockstep_absent_pkg.rewards:f"]) == 2  # every run would fail
    assert squash("error: task.reward 'lockstep_absent_pkg.rewards:f': no module 'lockstep_absent_pkg'") in (
        cli_stderr(capsys)
    )


def test_serve_without_a_prefect_server_exits_2_before_publishing(monkeypatch, capsys):
    import flows.train

    monkeypatch.delenv("PREFECT_API_URL", raising=False)

    def publish(*args, **kwargs):
        raise AssertionError("the deployment must not be published without a server")

    monkeypatch.setattr(flows.train.train_flow, "serve", publish)
    assert cli.main(["serve", ARITH]) == 2
    assert squash("needs a Prefect server") in cli_stderr(capsys)


def test_serve_with_a_bad_cron_exits_2_before_publishing(monkeypatch, capsys):
    import flows.train

    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # the schedule is checked before the server is asked for

    def publish(*args, **kwargs):
        raise AssertionError("a bad schedule must not reach the deployment")

    monkeypatch.setattr(flows.train.train_flow, "serve", publish)
    assert cli.main(["serve", ARITH, "--cron", "not a cron"]) == 2
    assert squash("error: --cron 'not a cron' is not a cron schedule: give five fields") in cli_stderr(capsys)
    assert cli.main(["serve", ARITH, "--cron", "0 3 * * *"]) == 2  # a good one: on to the missing server
    assert squash("needs a Prefect server") in cli_stderr(capsys)


def test_serve_with_an_unreachable_prefect_api(tmp_path):
    port = free_port()
    env = dict(os.environ, PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "serve", ARITH],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: the Prefect API at PREFECT_API_URL=http://127.0.0.1:{port}/api is unreachable" in proc.stderr


# ------------------------------------------------------------------------------------------------ train


@pytest.mark.parametrize(
    "error",
    [
        DatasetError("train.jsonl, row 40: empty 'question' (set data.on_bad_row: skip to skip such rows)"),
        ConfigError("task.dataset.uri: train.jsonl: no usable rows"),
        CheckpointError("runs/r1/checkpoints/PROMOTED is damaged (KeyError: 'version')"),
        FileNotFoundError("runs/r1/checkpoints/v000003/MANIFEST.json"),
    ],
    ids=["dataset", "config", "checkpoint", "missing-file"],
)
def test_train_input_error_inside_the_flow_exits_2(monkeypatch, capsys, tmp_path, error):
    def flow(**kwargs):
        raise error

    replace_flow(monkeypatch, flow)
    assert cli.main(["train", ARITH, "-o", f"lake.uri={tmp_path / 'lake'}"]) == 2
    assert squash(f"error: {error}") in cli_stderr(capsys)


def test_train_or_resume_of_a_run_taken_is_refused_before_the_flow(lake_with_run, capsys, monkeypatch):
    """A `train` naming a run id the lake has, or a `resume` of a run another process holds: refused from a look at
    the lake, the flow not called and no server started (a `train` of a finished run took 12.8-13.4 s to refuse
    inside the flow, 1.75-1.84 s now, by hand on this machine)."""
    server = replace_flow(monkeypatch, lambda **kwargs: pytest.fail("the flow must not start"))
    argv = ["train", ARITH, "-o", f"lake.uri={lake_with_run}", "-o", "run.run_id=r1", "-o", "tracking.enabled=false"]
    assert cli.main(argv) == 2
    assert cli_stderr(capsys) == squash(
        f"error: run r1 already exists in {lake_with_run}: continue it with `lockstep resume r1 --lake "
        f"{lake_with_run}` or choose another run.run_id\n"
    )
    lake = Lake(str(lake_with_run))
    with lease.acquire(lake, "r1", "train"):  # this process runs r1, as another `lockstep train` would
        assert cli.main(["resume", "r1", "--lake", str(lake_with_run)]) == 2
        err = cli_stderr(capsys)
        assert squash(f"error: run r1 in {lake_with_run} is in use by `lockstep train` (pid {os.getpid()} on host") in (
            err
        )
        assert err.endswith(squash(f"and then `lockstep resume r1 --lake {lake_with_run}`\n"))
        assert cli.main(argv) == 2  # a train of it names the process that runs it
        assert squash(f"error: run r1 already exists in {lake_with_run} and is in use by `lockstep train` (pid") in (
            cli_stderr(capsys)
        )
    assert server == []  # no temporary API server was started


def test_train_of_an_existing_run_prints_one_line_not_prefects_traceback(lake_with_run, capfd, monkeypatch):
    # the real flow (Prefect's engine and loggers): open_session finds runs/r1 and raises RunExistsError, which
    # Prefect logged with its traceback ("Encountered exception during execution") before the CLI's own line. The
    # CLI's look finds nothing here, as when the run is created after it (a second command started beside this one)
    monkeypatch.setattr(preflight, "check_run_free", lambda cfg, resume: None)
    code = cli.main(
        ["train", ARITH, "-o", f"lake.uri={lake_with_run}", "-o", "run.run_id=r1", "-o", "tracking.enabled=false"]
    )
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "Encountered exception" not in err
    assert squash(f"error: run r1 already exists in {lake_with_run}: continue it with `lockstep resume r1") in (
        squash(err)
    )


def test_prefects_crash_line_for_a_stop_is_left_to_the_cli_and_other_crashes_are_kept(caplog):
    # Ctrl-C and SIGTERM: the CLI prints "interrupted: ... lockstep resume ..."; Prefect's ERROR "Crash detected!"
    # line before it read as a failure. A crash of another cause (SystemExit in a task) is still logged.
    stops = [
        "Crash detected! Execution was aborted by an interrupt signal.",
        "Crash detected! Execution was aborted by a termination signal.",
        "Finished in state Crashed('Execution was aborted by a termination signal.')",
        "Finished in state Cancelled('rollout worker 0 was stopped as the run ended while this task waited for it')",
    ]
    other = "Crash detected! Execution was aborted by Python system exit call."
    with caplog.at_level(logging.ERROR), cli._reported_by_cli(ValueError):
        for name in ("prefect.flow_runs", "prefect.task_runs"):
            for message in [*stops, other]:
                logging.getLogger(name).error(message)
    assert [r.getMessage() for r in caplog.records] == [other, other]
    with caplog.at_level(logging.ERROR):  # outside a run the filter is gone
        logging.getLogger("prefect.flow_runs").error(stops[0])
    assert caplog.records[-1].getMessage() == stops[0]


def test_ctrl_c_in_a_command_is_one_line_not_a_traceback(monkeypatch, capsys, lake_with_run):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_runs", interrupted)
    assert cli.main(["runs", "--lake", str(lake_with_run)]) == 130
    assert cli_stderr(capsys) == squash("interrupted\n")


def test_ctrl_c_in_replay_says_what_its_target_keeps(monkeypatch, capsys, lake_with_run):
    def interrupted(**kwargs):
        raise KeyboardInterrupt

    replace_flow(monkeypatch, interrupted, "replay_flow")
    (lake_with_run / "runs" / "r1" / "checkpoints" / "v000000").mkdir(parents=True)
    (lake_with_run / "runs" / "r1" / "checkpoints" / "v000000" / "MANIFEST.json").write_text("{}")
    (lake_with_run / "runs" / "r1" / "checkpoints" / "PROMOTED").write_text('{"version": 0}')
    assert cli.main(["replay", "r1", "--lake", str(lake_with_run), "--to", "r9"]) == 130
    assert squash(
        "interrupted: replay of r1 stopped; r9 keeps the versions replayed so far (replay refuses an "
        "existing target: choose another --to)"
    ) in cli_stderr(capsys)


def test_output_cut_by_a_closed_pipe_ends_quietly(tmp_path):
    # `lockstep audit ... | head`: the reader goes away while the CLI still writes; was a BrokenPipeError traceback
    for i in range(3000):
        (tmp_path / "lake" / "runs" / f"r{i:04d}").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "runs", "--lake", str(tmp_path / "lake")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("r0000 ")
    proc.stdout.close()  # what `head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ------------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(
    "frozen, expected",
    [
        ('{"run": {"run_id": "r1", "iterations": 0}}', "run.iterations: Input should be greater than or equal to 1"),
        ('{"run": ', "is not valid YAML"),
        # JSON but no config: the loader's error, not a traceback of the upgrade of older frozen configs
        ("[1, 2]", "the top level must be a mapping of sections, got list"),
        ('"a config"', "the top level must be a mapping of sections, got str"),
        ('{"run": {"run_id": "r1"}, "train": 5}', "train: Input should be a valid dictionary"),
    ],
    ids=["invalid-field", "not-json", "list", "string", "section-not-a-mapping"],
)
def test_resume_of_a_bad_frozen_config_names_the_file_in_the_lake(lake_with_run, capsys, frozen, expected):
    config = lake_with_run / "runs" / "r1" / "config.json"
    config.write_text(frozen)
    assert cli.main(["resume", "r1", "--lake", str(lake_with_run)]) == 2
    err = cli_stderr(capsys)
    assert "Traceback" not in err
    assert squash(f"{config}") in err and squash(expected) in err  # it named the temporary copy the CLI loads
    assert "/tmp" not in err.replace(str(lake_with_run), "")
    assert (
        "overrides" not in err
    )  # none were given: --lake is set in the copy ("invalid config ... with its overrides")


def test_resume_of_an_invalid_run_id_is_one_error_line(lake_with_run, capsys):
    assert cli.main(["resume", "../r1", "--lake", str(lake_with_run)]) == 2
    err = cli_stderr(capsys)
    assert squash(f"error: cannot resume '../r1' from lake {lake_with_run}") in err and "Traceback" not in err


def _resumed_config(lake: Path, monkeypatch):
    """The config `lockstep resume r1 --lake LAKE` hands the train flow (the flow replaced by a recorder)."""
    seen = {}

    def flow(config_path, overrides, resume):
        seen.update(cfg=load_config(config_path, overrides), resume=resume)
        return {
            "eval_accuracy_initial": 0.5,
            "eval_accuracy_final": 0.6,
            "samples_per_s": 1.0,
            "promoted_version": 3,
            "run_id": "r1",
            "summary_path": "s",
        }

    replace_flow(monkeypatch, flow)
    assert cli.main(["resume", "r1", "--lake", str(lake)]) == 0
    assert seen["resume"]
    return seen["cfg"]


def test_resume_runs_from_the_lake_it_is_given_whatever_its_model_path_now_is(lake_with_run, monkeypatch, capsys):
    """A lake moved (or copied) since the run started: the frozen config names the old place, `--lake` the new one,
    and resume must use the new one. Its v0 is in the lake, so a `model.path` removed since does not stop it."""
    frozen = load_config(None, ["run.run_id=r1", "lake.uri=/old/place", "model.path=/removed/model"])
    (lake_with_run / "runs" / "r1" / "config.json").write_text(resolved_json(frozen))
    cfg = _resumed_config(lake_with_run, monkeypatch)
    assert cfg.lake.uri == str(lake_with_run) and cfg.run.run_id == "r1"
    assert capsys.readouterr().err.startswith(f"resuming run r1 in lake {lake_with_run}\n")


@pytest.mark.parametrize("frozen_value", [None, True, False], ids=["older-than-the-field", "true", "false"])
def test_resume_reads_a_run_frozen_before_a_field_as_it_trained(lake_with_run, monkeypatch, frozen_value):
    """Frozen before `train.skip_zero_advantage` existed (the field absent), the run ran every group and its resume
    does too (false, not today's default true); a frozen value is kept either way, and config.json is left as it is."""
    frozen = json.loads(resolved_json(load_config(None, ["run.run_id=r1"])))
    if frozen_value is None:
        del frozen["train"]["skip_zero_advantage"]
    else:
        frozen["train"]["skip_zero_advantage"] = frozen_value
    path = lake_with_run / "runs" / "r1" / "config.json"
    path.write_text(json.dumps(frozen))
    cfg = _resumed_config(lake_with_run, monkeypatch)
    assert cfg.train.skip_zero_advantage is (False if frozen_value is None else frozen_value)
    assert cfg.train.micro_batch_tokens == frozen["train"]["micro_batch_tokens"]
    assert json.loads(path.read_text()) == frozen


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    # only a closed stdout ends quietly; a BrokenPipeError of a socket or another pipe keeps its traceback
    def runs(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_runs", runs)
    with pytest.raises(BrokenPipeError):
        cli.main(["runs"])
