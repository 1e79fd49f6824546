"""The benchmarks' command lines: --help and bad arguments answer at once (usage, or exit 2 naming the flag) instead of
running a benchmark or failing with a traceback after minutes; an interrupted `benchmarks.resume` leaves no training
run or temporary directory behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = "LOCKSTEP_BENCH_TEST"


def _marked(marker: str, cmdline: bytes = b"") -> list[int]:
    """Processes started with `marker` in their environment (and `cmdline` in their command line)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if f"{MARKER}={marker}".encode() in environ and cmdline in cmd:
            pids.append(int(name))
    return pids


@pytest.fixture
def env(tmp_path):
    """The benchmarks' environment: marked, so that what they start can be found (and, where a benchmark ignores
    its arguments, killed), with its own TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = uuid.uuid4().hex
    yield {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp), MARKER: marker}
    for pid in _marked(marker):  # a benchmark that ran anyway: its children in their own sessions
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def bench(module: str, *args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"benchmarks.{module} {' '.join(args)} still running after {timeout} s: it ignored its arguments")
    with contextlib.suppress(ProcessLookupError):  # what it left in its group
        os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# the benchmarks whose --help and unknown flags are checked below
ARGPARSE_BENCHMARKS = [
    "objectives",
    "shared_prompt",
    "resume",
    "data_parallel",
    "zero_advantage",
    "startup",
    "catalog",
    "rewards",
    "scoring",
    "checkpointing",
    "logits_chunking",
    "worker_start",
]


@pytest.mark.parametrize("module", ARGPARSE_BENCHMARKS)
def test_help_prints_usage_and_runs_nothing(module, env):
    t0 = time.perf_counter()
    r = bench(module, "--help", env=env)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t0 < 30  # usage, not a benchmark
    assert r.stdout.startswith(f"usage: python -m benchmarks.{module}")
    assert "Prints one JSON line" in r.stdout or "One JSON line" in r.stdout  # the docstring: what it prints
    assert not _marked(env[MARKER]) and not os.listdir(env["TMPDIR"])  # no training run, no work directory


@pytest.mark.parametrize("module", ARGPARSE_BENCHMARKS)
def test_unknown_flag_exits_2(module, env):
    r = bench(module, "--iterationz", "3", env=env)
    assert r.returncode == 2
    assert "error: unrecognized arguments: --iterationz 3" in r.stderr
    assert not _marked(env[MARKER])


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("pipeline", ["--repeats", "0"], "--repeats 0: must be at least 1"),
        ("worker_start", ["--repeats", "0"], "--repeats 0: must be in [1, 100]"),
        ("pipeline", ["--iterations", "0", "--warmup", "0"], "--iterations 0: must be in [1, 100000]"),
        ("pipeline", ["--iterations", "-5", "--warmup", "3"], "--iterations -5: must be in [1, 99997]"),
        ("a3po", ["--iterations", "0", "--warmup", "0"], "--iterations 0: must be in [1, 100000]"),
        # iterations 0..1 carry trainer versions 0 and 1, and the replayed train steps need one at version 2
        (
            "a3po",
            ["--iterations", "2", "--warmup", "0"],
            "--iterations 2 with --warmup 0: the replayed train steps need",
        ),
        ("a3po", ["--skip-timing", "--accuracy-iterations", "0"], "--accuracy-iterations 0: must be in [1, 100000]"),
        (
            "a3po",
            ["--skip-timing", "--accuracy-staleness", "2", "--seeds", "1", "1"],
            "--seeds 1 1: give each value once",
        ),
        ("resume", ["--iterations", "2"], "--iterations 2: must be in [3, 100000]"),
        ("shared_prompt", ["--threads", "0"], "--threads 0: must be at least 1"),
        ("data_parallel", ["--repeats", "0"], "--repeats 0: must be in [1, 1000]"),
        ("zero_advantage", ["--iterations", "4", "--warmup", "4"], "--warmup 4: must be in [0, 3]"),
        ("zero_advantage", ["--partial-credit", "1"], "--partial-credit 1.0: must be in [0, 1)"),
        ("zero_advantage", ["--partial-credit", "0", "0.0"], "--partial-credit 0.0 0.0: give each value once"),
        ("startup", ["--repeats", "0"], "--repeats 0: must be in [1, 100]"),
        ("startup", ["--iterations", "1"], "--iterations 1: must be in [2, 39]"),
        ("startup", ["--iterations", "40"], "--iterations 40: must be in [2, 39]"),
        ("startup", ["--against", "/"], "--against /: not a checkout of lockstep (no flows/cli.py there)"),
        ("rewards", ["--groups", "4", "--shard", "33"], "--shard 33: must be in [1, 32]"),
        ("rewards", ["--device", "nowhere"], "--device nowhere: "),
        ("scoring", ["--latency-ms", "-1"], "--latency-ms -1.0: must be in [0, 10000]"),
        ("scoring", ["--latency-ms", "nan"], "--latency-ms nan: must be in [0, 10000]"),
        ("scoring", ["--repeats", "0"], "--repeats 0: must be in [1, 100]"),
        ("scoring", ["--judge", "oracle"], "argument --judge: invalid choice: 'oracle'"),
        ("checkpointing", ["--repeats", "0"], "--repeats 0: must be in [1, 100]"),
        ("checkpointing", ["--threads", "0"], "--threads 0: must be at least 1"),
        ("logits_chunking", ["--chunk-tokens", "0"], "--chunk-tokens 0: must be at least 1"),
        ("logits_chunking", ["--repeats", "101"], "--repeats 101: must be in [1, 100]"),
        ("catalog", ["--window", "0"], "--window 0: must be in [1, 1500]"),
        ("catalog", ["--iterations", "10", "--window", "11"], "--window 11: must be in [1, 10]"),
        ("catalog", ["--samples", "4"], "--samples 4: must be at least 8"),
        ("catalog", ["--against", "/"], "--against /: not a checkout of lockstep (no storage/catalog.py there)"),
        ("catalog", ["--against", "."], "--against .: this checkout itself; give another one"),
        ("catalog", ["--iterations", "0"], "--iterations 0: must be in [1, 100000]"),
        ("catalog", ["--compact-every", "-1"], "--compact-every -1: must be at least 0"),
    ],
)
def test_bad_number_exits_2_naming_the_flag(module, args, message, env, tmp_path):
    work = ["--dir", str(tmp_path / "work")] if module in ("pipeline", "a3po", "zero_advantage", "scoring") else []
    r = bench(module, *args, *work, env=env)
    assert r.returncode == 2, r.stderr
    assert f"error: {message}" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "work").exists()  # stopped before any work: no generated config left in --dir
    assert not _marked(env[MARKER])


@pytest.mark.parametrize("module", ["pipeline", "a3po", "zero_advantage", "scoring"])
@pytest.mark.parametrize(
    ("where", "reason"), [("file", "exists and is not a directory"), ("file/sub", "cannot create {}: Not a directory")]
)
def test_unusable_dir_exits_2(module, where, reason, env, tmp_path):
    (tmp_path / "file").write_text("")
    path = tmp_path / where
    r = bench(module, "--dir", str(path), env=env)
    assert r.returncode == 2, r.stderr
    assert f"error: --dir {path}: {reason.format(path)}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_interrupted_resume_leaves_no_run_behind(sig, env):
    """The training run it starts is in its own session: only the benchmark can end it, and must on the way out."""
    # SIGINT is ignored in a background job's children; the benchmark must see it as a terminal's Ctrl-C
    p = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.resume"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not _marked(env[MARKER], b"flows.cli"):
            assert p.poll() is None and time.monotonic() < deadline, "the training run never started"
            time.sleep(0.1)
        time.sleep(1.0)  # past Popen's return: the benchmark is waiting on its child
        p.send_signal(sig)
        p.communicate(timeout=30)
        assert p.returncode != 0
        deadline = time.monotonic() + 10
        while _marked(env[MARKER]) and time.monotonic() < deadline:  # SIGKILLed, but dying takes a moment
            time.sleep(0.1)
        assert not _marked(env[MARKER]), "the training run outlived the benchmark"
        assert not list(Path(env["TMPDIR"]).glob("*/c.yaml")), "the benchmark's temporary directory is left"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
