"""Data-parallel training, the paths `test_data_parallel.py` leaves open: more than two ranks, a refused step leaving
nothing behind, a rank that runs every micro-batch of a batch, replicas of models with frozen, mixed-dtype or unused
parameters, the threads and signals of a spawned rank, and a start-up that fails, hangs or builds the wrong model.

The replicas a spawned rank builds come from `_Probe`, the tiny Qwen2 with what a test asks of it in its config:
the class is rebuilt in the child (by its module's name), so it can behave differently there than in this process."""

from __future__ import annotations

import contextlib
import copy
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2ForCausalLM

from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer
from tasks.train_ranks import DataParallelTrainer, TrainRankError
from tests.unit.test_data_parallel import KILLED, TINY, VOCAB, _flat, _group, _max_diff, _pair

torch.set_num_threads(1)


class _Probe(Qwen2ForCausalLM):
    """`config.probe`: `unused` adds a parameter no forward pass uses, in the middle of `parameters()`; in a spawned
    rank only, `threads_dir` records its torch threads, `fail` raises, `hang` never returns; `extra` gives rank 0's
    model a parameter the spawned ranks' replicas lack, `extra_in_rank` the replicas one rank 0's model lacks."""

    def __init__(self, config):
        super().__init__(config)
        probe = getattr(config, "probe", {})
        if probe.get("unused"):
            self.model.layers[0].unused = torch.nn.Parameter(torch.zeros(5))
        if mp.parent_process() is None:  # rank 0: this process
            if probe.get("extra"):
                self.extra = torch.nn.Parameter(torch.zeros(3))
            return
        if probe.get("extra_in_rank"):
            self.extra = torch.nn.Parameter(torch.zeros(3))
        if "threads_dir" in probe:
            with open(os.path.join(probe["threads_dir"], f"{os.getpid()}.json"), "w") as f:
                json.dump(torch.get_num_threads(), f)
        if probe.get("fail"):
            raise RuntimeError("probe: this replica cannot be built")
        if probe.get("hang"):
            time.sleep(600)


def _probe_model(**probe) -> _Probe:
    config = build_tiny_model(VOCAB, seed=0, **TINY).config
    config.probe = probe
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _Probe(config).eval()


def _rank_processes() -> list:
    return [p for p in mp.active_children() if p.name.startswith("lockstep-train-rank-")]


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail, not hang, where a rank is never told what to do (rank 0 then waits for a collective in a Python loop,
    which the alarm interrupts)."""

    def expired(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_three_ranks_equal_one_and_a_refused_step_names_the_rank_that_failed():
    """Three ranks: each micro-batch of three groups split one group per rank, every rank's gradient and
    accumulators in the sum (weights and figures as one process), every rank told the verdict; a micro-batch rank 2
    cannot compute refuses the step naming rank 2, applied on no rank, and the next batch trains on all three."""
    one = PolicyTrainer(build_tiny_model(VOCAB, seed=0, **TINY), None, lr=1e-2, shared_prompt=True)
    three = DataParallelTrainer(copy.deepcopy(one.model), None, ranks=3, threads=1, lr=1e-2, shared_prompt=True)
    try:
        with _deadline(90):
            for batch in range(2):
                for j in range(3):
                    groups = [_group(100 * batch + 10 * j + k) for k in range(3)]
                    assert [t.micro_step(groups) for t in (one, three)] == [{"tokens": 30.0, "samples": 12}] * 2
                a, b = one.optimizer_step(), three.optimizer_step()
                assert three.rank_micro_batches == [3, 3, 3]
                assert three.rank_tokens == [3 * 18] * 3  # 8 prompt + 10 response tokens per group
                for key in ("train/samples", "train/tokens", "loss/policy", "grad/norm", "entropy/mean"):
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
                assert _max_diff(one.model, three.model) <= 1e-5
                if batch == 0:  # a refused batch between the two
                    before = copy.deepcopy(three.model)
                    bad = _group(7)
                    bad.responses[0][0] = VOCAB + 5
                    three.micro_step([_group(5), bad, _group(6)])  # ties: rank 1, rank 2, then rank 0
                    with pytest.raises(TrainRankError, match=r"^trainer rank 2 failed a micro-step(.|\n)*IndexError"):
                        three.optimizer_step()
                    assert _max_diff(before, three.model) == 0.0
    finally:
        three.close()


def test_a_refused_step_leaves_no_gradient_or_figure_behind():
    """Rank 1 trains a group, then fails on the next micro-batch: the step is refused, and neither rank 1's gradient
    of the group it did train nor rank 0's counts of the refused batch reach the next batch, whose figures and
    weights are one process's. `micro_step` returns what every rank ran, the skipped groups left out."""
    one, two = _pair(LossSettings())
    try:
        bad = _group(3)
        bad.responses[0][0] = VOCAB + 5
        two.micro_step([_group(1), _group(2)])  # rank 1: group 1 (trained), rank 0: group 2
        two.micro_step([bad, _group(4)])  # rank 1: the bad group
        with pytest.raises(TrainRankError, match="trainer rank 1 failed a micro-step"):
            two.optimizer_step()
        for j in range(2):
            mb = [_group(10 + j), _flat(20 + j), _group(30 + j)]
            assert two.micro_step(mb) == one.micro_step(mb) == {"tokens": 20.0, "samples": 8}
        a, b = one.optimizer_step(), two.optimizer_step()
        assert two.rank_micro_batches == [2, 2]
        assert b["train/samples"] == a["train/samples"] == 24.0  # the skipped groups' samples too
        assert b["train/skipped_groups"] == a["train/skipped_groups"] == 2.0
        for key in ("train/tokens", "loss/policy", "grad/norm", "entropy/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        assert _max_diff(one.model, two.model) <= 1e-5
    finally:
        two.close()


def test_decoupled_recompute_when_rank_0_runs_no_part_of_the_batch():
    """One single-group micro-batch per batch goes to rank 1 (ties: the other ranks first): rank 0 runs nothing, yet
    the batch's version is its own, so the proximal weights it keeps and sends are those of one version back, as
    in one process, and rank 1's recompute of tokens two versions behind finds them."""
    one, two = _pair(LossSettings(decoupled=True, prox_logp="recompute", is_cap=None))
    try:
        for version in range(4):
            g = [_group(version, lens=(3, 2), version=max(0, version - 2))]
            for t in (one, two):
                t.micro_step(g, version)
            a, b = one.optimizer_step(), two.optimizer_step()
            assert two.rank_micro_batches == [0, 1]
            assert b["is_weight/mean"] == pytest.approx(a["is_weight/mean"], rel=1e-5)
            assert two.prox_version == one.prox_version == version
            assert _max_diff(one.model, two.model) <= 1e-5
    finally:
        two.close()


def test_replicas_keep_frozen_mixed_dtype_and_unused_parameters():
    """A model whose final norm is frozen and bf16 (two dtypes: two broadcasts) and with a trainable parameter no
    pass uses in the middle of `parameters()` (no rank has a gradient for it: the sum's offsets must still line
    up): rank 1 rebuilds it alike, and two ranks train as one process; the frozen and the unused parameters stay."""
    model = _probe_model(unused=True)
    model.model.norm.to(torch.bfloat16).requires_grad_(False)
    frozen, unused = model.model.norm.weight.clone(), model.model.layers[0].unused.clone()
    kw = dict(lr=1e-2, grad_clip=1.0, shared_prompt=True)
    one = PolicyTrainer(model, None, **kw)
    two = DataParallelTrainer(copy.deepcopy(model), None, ranks=2, threads=1, **kw)
    try:
        for batch in range(2):
            for j in range(2):
                groups = [_group(10 * batch + j), _group(10 * batch + j + 5)]
                for t in (one, two):
                    t.micro_step(groups)
            a, b = one.optimizer_step(), two.optimizer_step()
            assert b["grad/norm"] == pytest.approx(a["grad/norm"], rel=1e-5)
            assert _max_diff(one.model, two.model) <= 1e-5
        assert two.model.model.norm.weight.dtype == torch.bfloat16
        assert torch.equal(two.model.model.norm.weight, frozen)
        assert torch.equal(two.model.model.layers[0].unused, unused) and two.model.model.layers[0].unused.grad is None
    finally:
        two.close()


def test_spawned_ranks_take_the_threads_they_are_given(tmp_path):
    """`threads` per rank: a spawned rank builds its replica with that many torch threads (more than any default,
    which is at most the cores)."""
    threads = (os.cpu_count() or 1) + 1
    two = DataParallelTrainer(_probe_model(threads_dir=str(tmp_path)), None, ranks=3, threads=threads, lr=1e-2)
    two.close()
    assert sorted(json.loads(f.read_text()) for f in tmp_path.iterdir()) == [threads, threads]


def test_ctrl_c_at_a_rank_started_from_another_thread_is_left_to_rank_0():
    """Ctrl-C reaches the whole process group; from a thread other than the main one the ranks start with Python's
    SIGINT handler, which each rank replaces: a SIGINT leaves rank 1 training."""
    made = []
    thread = threading.Thread(target=lambda: made.append(_pair(LossSettings())))
    thread.start()
    thread.join()
    one, two = made[0]
    try:
        proc = two._procs[0]
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert proc.is_alive()
        for t in (one, two):
            t.micro_step([_group(1), _group(2)])
        one.optimizer_step(), two.optimizer_step()
        assert two.rank_micro_batches == [1, 1] and _max_diff(one.model, two.model) <= 1e-5
    finally:
        two.close()


def test_an_optimizer_step_after_a_rank_died_is_refused():
    """Rank 1 killed: the micro-step that needs it names it, and the optimizer step after is refused with that reason
    (not sent on to the dead rank)."""
    _, two = _pair(LossSettings())
    try:
        proc = two._procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        with pytest.raises(TrainRankError, match=r"^trainer rank 1 \(pid \d+\) died " + KILLED + r"$"):
            two.micro_step([_group(1), _group(2)])
        with pytest.raises(TrainRankError, match=r"^the data-parallel trainer cannot go on: trainer rank 1 .* died"):
            two.optimizer_step()
    finally:
        two.close()


@pytest.mark.parametrize(
    ("probe", "start_timeout_s", "error"),
    [
        (
            {"fail": True},
            300,
            r"^trainer rank 1 failed:\nTraceback(.|\n)*RuntimeError: probe: this replica cannot be built",
        ),
        (
            {"extra": True},
            300,
            r"^trainer rank 1 built a replica unlike rank 0's model \(\d+ parameters, not \d+; first",
        ),
        (
            {"extra_in_rank": True},
            300,
            r"^trainer rank 1 built a replica unlike rank 0's model \(\d+ parameters, not \d+; first",
        ),
        ({"hang": True}, 2, r"^trainer rank 1 \(pid \d+\) sent no 'built' within 2 s$"),
    ],
    ids=["fails", "unlike", "unlike-in-rank", "hangs"],
)
def test_a_start_up_that_fails_is_named_and_leaves_nothing_running(probe, start_timeout_s, error):
    """A rank that cannot build its replica (its traceback reported), builds one unlike rank 0's model, or never
    answers within `start_timeout_s`: the trainer is not made, no rank is left running, and no process group."""
    try:
        with _deadline(90), pytest.raises(TrainRankError, match=error):
            DataParallelTrainer(
                _probe_model(**probe), None, ranks=2, threads=1, lr=1e-2, start_timeout_s=start_timeout_s
            )
        assert _rank_processes() == []
        assert not dist.is_initialized()
    finally:
        for proc in _rank_processes():  # a failure above must not leave a rank for the next tests
            proc.kill()
            proc.join()


def test_a_collective_that_failed_raises_what_it_failed_with():
    """A collective gloo ends with an error (a peer's connection closed, a timeout) while every rank still looks
    alive: the wait raises that error, rather than rank 0 going on with the partial sum in its buffer."""

    class FailedWork:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer")

    alive = SimpleNamespace(is_alive=lambda: True)
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        DataParallelTrainer._wait_for(SimpleNamespace(_procs=[alive]), "the gradient sum", FailedWork())


def test_a_rank_that_dies_while_a_collective_is_pending_is_named():
    """NCCL does not end a collective a peer has left (gloo does): rank 0's wait watches the other ranks and names
    the one that died, rather than waiting out the collective's timeout."""
    trainer = DataParallelTrainer.__new__(DataParallelTrainer)
    trainer._procs, trainer._broken = [SimpleNamespace(is_alive=lambda: False, pid=123, exitcode=-9)], None
    pending = SimpleNamespace(is_completed=lambda: False, wait=lambda: None)
    match = r"^trainer rank 1 \(pid 123\) died " + KILLED + r" during the gradient sum$"
    with _deadline(10), pytest.raises(TrainRankError, match=match):
        trainer._wait_for("the gradient sum", pending)


def test_one_rank_is_not_data_parallel():
    with pytest.raises(ValueError, match="a data-parallel trainer needs at least 2 ranks, got 1"):
        DataParallelTrainer(build_tiny_model(VOCAB, seed=0, **TINY), None, ranks=1, threads=1, lr=1e-2)


def test_a_rank_ends_with_a_killed_rank_0_even_while_it_builds(tmp_path):
    """Rank 0's process SIGKILLed (it cannot stop its ranks) while rank 1 is still building its replica: rank 1 ends
    within seconds, not when it would next read from rank 0."""
    script = (
        "import sys; sys.path.insert(0, 'tests/unit')\n"
        "from test_train_ranks import _probe_model\n"
        "from tasks.train_ranks import DataParallelTrainer\n"
        f"model = _probe_model(hang=True, threads_dir={str(tmp_path)!r})\n"
        "DataParallelTrainer(model, None, ranks=2, threads=1, lr=1e-2)\n"
    )
    flow = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.iterdir()) and flow.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        [rank_file] = list(tmp_path.iterdir())  # rank 1 is building (and will not finish)
        flow.kill()
        flow.wait()
        rank = int(rank_file.stem)
        deadline = time.monotonic() + 10
        while _running(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(rank)
    finally:
        flow.kill()
        if list(tmp_path.iterdir()) and _running(int(next(tmp_path.iterdir()).stem)):
            os.kill(int(next(tmp_path.iterdir()).stem), signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_FAKE_NPU = """
import torch

CURRENT = []


class _NPU:  # the part of torch_npu's device module a rank uses
    @staticmethod
    def set_device(device):
        CURRENT.append(str(device))


torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", _NPU)
"""


def test_an_accelerator_rank_makes_its_own_device_current(tmp_path):
    """Rank r trains on accelerator r and makes it current before its collectives start (NCCL and HCCL build their
    communicators there; a new process's current device is 0). For NPU the rank first imports torch_npu, which
    registers the device type in the bare interpreter a spawned rank starts from: here a stand-in torch_npu, in a
    child process, as registering a device type cannot be undone."""
    (tmp_path / "torch_npu.py").write_text(_FAKE_NPU)
    script = (
        "import torch\n"
        "from tasks.train_ranks import _rank_device\n"
        "cpu = _rank_device('cpu', 1)\n"
        "device = _rank_device('npu', 2)\n"
        "import torch_npu\n"
        "print(cpu, device, torch_npu.CURRENT)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).parents[2]}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "cpu npu:2 ['npu:2']"
