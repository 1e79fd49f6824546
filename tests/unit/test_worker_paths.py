"""Rollout workers and shards, the paths a mutation audit of `tasks/workers.py` and `storage/shards.py` (2026-12-05)
found untested, each test checked to fail on its mutant: what a chunk's shard records (the
version held, each token's version, reward, finish reason, worker, token count), a chunk of an older version refused,
figures per iteration, serving (stop markers skipped, a stop while admission control holds a chunk, shards reported,
interruption only when asked), the worker's command loop (an error reported with its traceback, exit while serving),
the pool's message protocol (timeouts, a live worker's error, unexpected messages), `close` letting a worker exit,
shared-memory weights (alignment, shapes, orphans, release) and the rollout schema's column types."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace

import pytest
import torch

import tasks.workers
from models.engine import Sample, sample_seed
from models.rewards import reward_function
from storage import checkpoints
from storage.lake import Lake
from storage.shards import ROLLOUT_SCHEMA, read_shard, table_to_records
from tasks.workers import (
    _STOP,
    Chunk,
    ParentState,
    SharedWeights,
    WorkerError,
    WorkerPool,
    _Worker,
    _worker_main,
    ended,
)
from tests.unit.test_worker_protocol import RUN_SEED, Served, worker  # noqa: F401 - the fixture

# ------------------------------------------------------------------------------------------------ a chunk's shard


def _fake_engine(monkeypatch, tok, calls: list):
    """`generate_groups` replaced: sample j of a group answers correctly when j is even ("stop"), "x" when odd
    ("length"); log-probs -0.5, -1.0, ...; token versions 1 then 2 (as an interrupted sample records them)."""
    import models.engine

    answers = {}

    def generate_groups(model, prompts, group_size, params, seeds, eos, pad, version=0, poll_update=None):
        calls.append({"version": version, "seeds": seeds, "poll_update": poll_update, "prompts": prompts})
        groups = []
        for row, ids in zip(seeds, prompts):
            answer = answers[tuple(ids)]
            group = []
            for j, seed in enumerate(row):
                resp = (answer if j % 2 == 0 else "x") + "\n"
                rids = tok(resp, add_special_tokens=False)["input_ids"]
                n = len(rids)
                group.append(
                    Sample(
                        rids,
                        [-0.5 * (t + 1) for t in range(n)],
                        "length" if j % 2 else "stop",
                        seed,
                        [1] + [2] * (n - 1),
                    )
                )
            groups.append(group)
        return groups

    monkeypatch.setattr(models.engine, "generate_groups", generate_groups)
    return answers


def test_a_shard_records_the_samples_under_the_version_held(worker, monkeypatch):  # noqa: F811
    """Async: a chunk planned at v1 runs on v2: its shard goes under policy_version=2 with every sample's policy
    version 2, and each field is the engine's sample (token versions as given, the reward scored on the answer)."""
    calls: list = []
    answers = _fake_engine(monkeypatch, worker.tokenizer, calls)
    for _, _, answer, ids, _ in worker.spec.prompts:
        answers[tuple(ids)] = answer
    worker.id, worker.version = 3, 2
    info = worker.generate_chunk(Chunk(iteration=4, version=1, index=5, prompt_ids=(2, 0)))
    assert calls[0]["version"] == 2 and calls[0]["poll_update"] is None
    assert calls[0]["seeds"] == [[sample_seed(RUN_SEED, 4, p, j) for j in range(4)] for p in (2, 0)]
    assert info["path"].endswith("runs/w/rollouts/policy_version=2/iter-000004/shard-3-00005.arrow")
    assert (info["groups"], info["worker"], info["iteration"]) == (2, 3, 4)
    rows = table_to_records(read_shard(worker.lake, info["path"], info["checksum"]))
    assert len(rows) == 8
    assert info["gen_tokens"] == sum(len(r.response_ids) for r in rows) == 4 * 2 + 4 * 2  # "3\n"/"1\n" and "x\n"
    for r in rows:
        _, text, answer, pids, _ = worker.spec.prompts[r.prompt_id]
        correct = r.sample_index % 2 == 0
        assert r.policy_version == 2 and r.worker == 3 and r.iteration == 4
        assert r.response_text == (answer if correct else "x") + "\n"
        assert r.reward == reward_function("arithmetic")(r.response_text, answer) == (1.0 if correct else 0.0)
        assert r.finish_reason == ("stop" if correct else "length")
        assert r.behavior_logprobs == [-0.5, -1.0] and r.token_versions == [1, 2]
        assert r.prompt_ids == pids and r.prompt_text == text


def _scoring_worker(spec, monkeypatch) -> _Worker:
    """A worker of `spec` on the fake engine, which knows every prompt's answer, holding version 0."""
    w = _Worker(3, spec, queue.Queue(), os.getppid())
    answers = _fake_engine(monkeypatch, w.tokenizer, [])
    for _, _, answer, ids, _ in spec.prompts:
        answers[tuple(ids)] = answer
    w.version = 0
    return w


def test_a_users_reward_function_scores_each_sample_with_its_prompt(worker, monkeypatch, tmp_path):  # noqa: F811
    """`task.reward: FILE.py:FUNCTION`: the worker imports the function as it starts, and each shard row's reward is
    what it returned for that row's response, answer and prompt; a function that raises fails the chunk naming
    itself and the response, and no shard is published."""
    from models.rewards import RewardError

    path = tmp_path / "user_reward.py"
    path.write_text(
        "def score(response, answer, prompt):\n"
        "    return 0.5 * (response.strip() == answer) + len(prompt) / 100\n"
        "def picky(response, answer):\n"
        "    return {answer + '\\n': 1.0}[response]\n"
    )
    user = _scoring_worker(replace(worker.spec, reward_kind=f"{path}:score"), monkeypatch)
    info = user.generate_chunk(Chunk(iteration=0, version=0, index=0, prompt_ids=(4, 1)))
    rows = table_to_records(read_shard(user.lake, info["path"], info["checksum"]))
    assert len(rows) == 8
    for r in rows:  # even samples answer correctly (fake engine); prompt "4+1=" has 4 characters: +0.04
        expected = 0.5 * (r.sample_index % 2 == 0) + len(r.prompt_text) / 100
        assert r.reward == expected and r.prompt_text == f"{r.prompt_id}+1="  # the same float expression: exact
    assert sorted({round(r.reward, 9) for r in rows}) == [0.04, 0.54]

    picky = _Worker(3, replace(worker.spec, reward_kind=f"{path}:picky"), queue.Queue(), os.getppid())
    picky.version = 0
    with pytest.raises(RewardError) as e:
        picky.generate_chunk(Chunk(iteration=1, version=0, index=0, prompt_ids=(2,)))
    assert str(e.value) == (
        f"task.reward '{path}:picky' raised KeyError: 'x\\n' (scoring the response 'x\\n' against the answer '3')"
    )
    assert not picky.lake.fs.glob(f"{picky.lake.run_dir('w')}/rollouts/*/iter-000001/*")


def test_a_users_reward_function_over_its_time_limit_fails_the_chunk(worker, monkeypatch, tmp_path):  # noqa: F811
    """`task.reward_timeout_s` reaches the worker: a call that has not returned by then fails the chunk at once,
    naming the limit and the response, and no shard is published."""
    from models.rewards import RewardError

    path = tmp_path / "stuck.py"
    path.write_text("import threading\ndef score(response, answer):\n    threading.Event().wait()\n")
    stuck = _scoring_worker(replace(worker.spec, reward_kind=f"{path}:score", reward_timeout_s=0.2), monkeypatch)
    with pytest.raises(RewardError, match=r"gave no value within task.reward_timeout_s=0.2 s \(scoring the response"):
        stuck.generate_chunk(Chunk(iteration=2, version=0, index=0, prompt_ids=(2,)))
    assert not stuck.lake.fs.glob(f"{stuck.lake.run_dir('w')}/rollouts/*/iter-000002/*")


def test_a_users_reward_function_receives_each_prompts_extra_fields(worker, monkeypatch, tmp_path):  # noqa: F811
    """`task.dataset.extra_fields: [weight, tags]`: the function receives each prompt's own values as keyword
    arguments of those names (a value as read: a number, a list), and the shard row's reward is what it returned."""
    path = tmp_path / "weighted.py"
    path.write_text(
        "def score(response, answer, weight, tags):\n"
        "    assert tags == ['t', weight]\n"
        "    return weight * (response.strip() == answer)\n"
    )
    prompts = [(p, t, a, ids, {"weight": p + 1, "tags": ["t", p + 1]}) for p, t, a, ids, _ in worker.spec.prompts]
    spec = replace(worker.spec, reward_kind=f"{path}:score", prompts=prompts, reward_fields=("weight", "tags"))
    user = _scoring_worker(spec, monkeypatch)
    info = user.generate_chunk(Chunk(iteration=0, version=0, index=0, prompt_ids=(4, 1)))
    rows = table_to_records(read_shard(user.lake, info["path"], info["checksum"]))
    # even samples answer correctly (fake engine): prompt 4 scores 5, prompt 1 scores 2, odd samples 0
    assert [(r.prompt_id, r.reward) for r in rows] == [(p, (p + 1.0) * (j % 2 == 0)) for p in (4, 1) for j in range(4)]


def test_a_batched_reward_function_scores_the_whole_shard_in_one_call(worker, monkeypatch, tmp_path):  # noqa: F811
    """`task.reward_batch`: the worker calls the function once per chunk, with the shard's responses, answers,
    prompts and each field as lists in the shard's row order, and each row's reward is the value at its place; a list
    of the wrong length fails the chunk and publishes nothing."""
    path = tmp_path / "judge.py"
    path.write_text(
        "import json, os, time\n"
        "def judge(responses, answers, prompts, weight):\n"
        "    time.sleep(0.2)\n"
        "    with open(os.environ['JUDGE_LOG'], 'a') as f:\n"
        "        f.write(json.dumps([responses, answers, prompts, weight]) + '\\n')\n"
        "    return [w * (r.strip() == a) + len(p) / 100 for r, a, p, w in zip(responses, answers, prompts, weight)]\n"
        "def short(responses, answers, weight):\n"
        "    return [1.0]\n"
    )
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("JUDGE_LOG", str(log))
    prompts = [(p, t, a, ids, {"weight": p + 1}) for p, t, a, ids, _ in worker.spec.prompts]
    spec = replace(
        worker.spec, reward_kind=f"{path}:judge", prompts=prompts, reward_fields=("weight",), reward_batch=True
    )
    user = _scoring_worker(spec, monkeypatch)
    info = user.generate_chunk(Chunk(iteration=0, version=0, index=0, prompt_ids=(4, 1)))
    rows = table_to_records(read_shard(user.lake, info["path"], info["checksum"]))
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]  # one call for the shard's 8 responses
    assert 0.2 <= info["reward_s"] <= info["gen_s"]  # the call's 0.2 s, reported as the scoring part of the shard's
    assert call == [
        [r.response_text for r in rows],
        [prompts[r.prompt_id][2] for r in rows],
        [r.prompt_text for r in rows],
        [r.prompt_id + 1 for r in rows],
    ]
    # even samples answer correctly (fake engine): prompt 4 scores 5, prompt 1 scores 2, odd samples 0; + len/100
    assert [(r.prompt_id, r.reward) for r in rows] == [
        (p, (p + 1.0) * (j % 2 == 0) + len(f"{p}+1=") / 100) for p in (4, 1) for j in range(4)
    ]
    short = _Worker(3, replace(spec, reward_kind=f"{path}:short"), queue.Queue(), os.getppid())
    short.version = 0
    from models.rewards import RewardError

    with pytest.raises(RewardError, match=r"returned a list of 1 for 4 responses: a batched reward function"):
        short.generate_chunk(Chunk(iteration=1, version=0, index=0, prompt_ids=(2,)))
    assert not short.lake.fs.glob(f"{short.lake.run_dir('w')}/rollouts/*/iter-000001/*")


def test_an_interrupted_chunk_records_each_tokens_version(worker):  # noqa: F811
    """Real engine: new weights arriving after the first token: the samples started on v0 (policy_version 0) and
    every token after the switch records v1."""
    worker.version = 0
    polls = []

    def poll_update():
        polls.append(1)
        return 1

    info = worker.generate_chunk(Chunk(iteration=0, version=0, index=0, prompt_ids=(0, 1)), poll_update)
    assert polls, "the engine was never asked for new weights"
    rows = table_to_records(read_shard(worker.lake, info["path"], info["checksum"]))
    assert all(r.policy_version == 0 for r in rows)
    assert all(r.token_versions == [0] + [1] * (len(r.response_ids) - 1) for r in rows)
    assert any(len(r.response_ids) > 1 for r in rows)


def test_a_worker_whose_parent_died_publishes_nothing(worker, monkeypatch):  # noqa: F811
    """The last check before publishing: a worker that finds its parent gone exits instead of writing the shard."""

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    worker.version, worker.parent = 0, -7  # never this process's parent
    monkeypatch.setattr(tasks.workers.os, "_exit", exit_)
    with pytest.raises(Exited):
        worker.generate_chunk(Chunk(0, 0, 0, (0,)))
    assert worker.lake.fs.glob(f"{worker.lake.root}/**/*.arrow") == []


# ------------------------------------------------------------------------------------------------ iterate


def test_a_chunk_of_an_older_version_is_refused(worker):  # noqa: F811
    worker.version = 1
    work = queue.Queue()
    work.put(Chunk(0, 0, 0, (0,)))
    work.put(_STOP)
    with pytest.raises(RuntimeError, match="chunk of version 0 sent to a worker holding 1"):
        worker.iterate(1, "unused: version 1 is held", work)


def test_iterate_reports_its_own_iterations_figures(worker, monkeypatch):  # noqa: F811
    """busy_s / storage_s are the sums of its chunks' figures; load_s is this iteration's load only."""

    def slow_load(lake, source, checked=True):
        time.sleep(0.2)

    monkeypatch.setattr(checkpoints, "load_weights", slow_load)
    monkeypatch.setattr(checkpoints, "load_into", lambda model, state: None)
    figures = iter([(1.0, 0.25), (2.0, 0.5)])

    def generate(chunk, poll_update=None):
        gen_s, storage_s = next(figures)
        return {"gen_s": gen_s, "storage_s": storage_s, "path": f"p{chunk.index}"}

    monkeypatch.setattr(worker, "generate", generate)  # its info stands for the generated chunk, published as it is
    monkeypatch.setattr(worker, "publish", lambda info, busy_from=None: (info, 0.0))
    work = queue.Queue()
    for item in (Chunk(0, 1, 0, (0,)), Chunk(0, 1, 1, (1,)), _STOP):
        work.put(item)
    first = worker.iterate(1, "c1", work)
    assert [s["path"] for s in first["shards"]] == ["p0", "p1"]
    assert (first["busy_s"], first["storage_s"]) == (3.0, 0.75) and first["load_s"] >= 0.2
    work.put(_STOP)
    assert worker.iterate(1, "c1", work)["load_s"] == 0.0  # held already
    work.put(_STOP)
    assert 0.2 <= worker.iterate(2, "c2", work)["load_s"] < 0.35


def test_a_worker_uses_its_thread_budget(worker):  # noqa: F811
    try:
        w = _Worker(1, replace(worker.spec, threads=2), queue.Queue(), os.getppid())
        assert torch.get_num_threads() == 2 and w.id == 1
    finally:
        torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ serve


class Serving(Served):
    """`Served`, its log also saying whether the engine was given a poll, each shard named by its chunk."""

    def __init__(self, worker, monkeypatch, max_staleness: int, interrupt: bool = False, generate=None):  # noqa: F811
        def logged(chunk, poll_update=None):
            self.log.append((chunk.iteration, worker.version, poll_update is not None))
            return {"gen_s": 0.0, "storage_s": 0.0, "path": f"p{chunk.index}"}

        super().__init__(worker, monkeypatch, max_staleness, interrupt, generate or logged)


def test_serving_skips_stop_markers_and_reports_each_shard(worker, monkeypatch):  # noqa: F811
    """Async plans still put one stop marker per worker after each batch: a serving worker passes over them."""
    served = Serving(worker, monkeypatch, max_staleness=4)
    try:
        for item in (Chunk(0, 0, 0, (0,)), _STOP, Chunk(1, 0, 1, (1,)), _STOP, Chunk(2, 0, 2, (2,))):
            served.work.put(item)
        assert served.settle(3) == [(0, 0, False), (1, 0, False), (2, 0, False)]
    finally:
        result = served.stop()
    assert result["shards"] == 3 and "abandoned_chunk" not in result
    posted = [served.results.get_nowait() for _ in range(3)]
    assert [(kind, info["path"]) for kind, info in posted] == [("shard", "p0"), ("shard", "p1"), ("shard", "p2")]
    assert served.results.empty()


def test_a_stop_while_admission_control_holds_a_chunk_ends_serving(worker, monkeypatch):  # noqa: F811
    served = Serving(worker, monkeypatch, max_staleness=0)
    served.work.put(Chunk(0, 0, 0, (0,)))
    served.work.put(Chunk(1, 0, 6, (1,)))  # batch 1 on v0 with max_staleness 0: held
    assert served.settle(1) == [(0, 0, False)]
    result = served.stop()
    assert result["shards"] == 1 and result["abandoned_chunk"] == 6
    assert served.log == [(0, 0, False)]


def test_interruption_only_when_asked_and_it_loads_the_announced_version(worker, monkeypatch):  # noqa: F811
    announced, polled = threading.Event(), []

    def generate(chunk, poll_update=None):
        assert poll_update is not None, "interrupt_on_update is on: the engine must get poll_update"
        assert poll_update() is None  # nothing announced yet
        announced.wait(10)
        polled.append((poll_update(), worker.version))
        return {"gen_s": 0.0, "storage_s": 0.0, "path": "p"}

    served = Serving(worker, monkeypatch, max_staleness=4, interrupt=True, generate=generate)
    try:
        served.work.put(Chunk(0, 0, 0, (0,)))
        time.sleep(0.3)
        worker.commands.put(("version", 1, "c1"))
        announced.set()
        deadline = time.monotonic() + 10
        while not polled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert polled == [(1, 1)]
    finally:
        served.stop()


def test_without_interruption_the_engine_never_polls(worker, monkeypatch):  # noqa: F811
    served = Serving(worker, monkeypatch, max_staleness=4, interrupt=False)
    try:
        served.work.put(Chunk(0, 0, 0, (0,)))
        assert served.settle(1) == [(0, 0, False)]
    finally:
        served.stop()


# ------------------------------------------------------------------------------------------------ the command loop


class _WorkerThread:
    """`_worker_main` on a thread with in-process queues (checkpoint loads as no-ops)."""

    def __init__(self, worker, monkeypatch):  # noqa: F811
        monkeypatch.setattr(checkpoints, "load_weights", lambda lake, source, checked=True: None)
        monkeypatch.setattr(checkpoints, "load_into", lambda model, state: None)
        self.commands, self.work, self.results = queue.Queue(), queue.Queue(), queue.Queue()
        self.thread = threading.Thread(
            target=_worker_main,
            args=(0, worker.spec, self.commands, self.work, self.results, ParentState(os.getppid(), os.getpgid(0), {})),
            daemon=True,
        )
        self.thread.start()
        assert self.results.get(timeout=60) == ("ready", 0)

    def end(self) -> None:
        self.commands.put(("exit",))
        self.thread.join(10)


def test_a_failing_command_reports_its_traceback_and_the_worker_goes_on(worker, monkeypatch):  # noqa: F811
    w = _WorkerThread(worker, monkeypatch)
    try:
        w.work.put(Chunk(0, 1, 0, (0,)))
        w.commands.put(("iterate", 0, "c0"))
        kind, tb = w.results.get(timeout=30)
        assert kind == "error"
        assert tb.startswith("Traceback") and "in iterate" in tb
        assert "RuntimeError: chunk of version 1 sent to a worker holding 0" in tb
        w.work.put(_STOP)
        w.commands.put(("iterate", 0, "c0"))  # still taking commands
        kind, body = w.results.get(timeout=30)
        assert kind == "done" and body["shards"] == []
    finally:
        w.end()
    assert not w.thread.is_alive()


def test_exit_while_serving_ends_the_worker(worker, monkeypatch):  # noqa: F811
    w = _WorkerThread(worker, monkeypatch)
    try:
        w.commands.put(("serve", 0, "c0", 1, False))
        time.sleep(0.2)
        w.commands.put(("exit",))
        kind, body = w.results.get(timeout=30)
        assert kind == "done" and body["shards"] == 0
        w.thread.join(5)
        assert not w.thread.is_alive(), "the worker took its exit command while serving and went on waiting"
    finally:
        if w.thread.is_alive():
            w.end()


_IDLE_PARENT = """
import sys, time
from tasks.workers import WorkerPool, WorkerSpec
model_dir, lake = sys.argv[1], sys.argv[2]
spec = WorkerSpec(lake_uri=lake, run_id="idle", model_dir=model_dir, threads=1, run_seed=0, group_size=2,
                  max_new_tokens=2, temperature=1.0, top_p=1.0, partial_credit=0.0, compression=None,
                  reward_kind="arithmetic", prompts=[])
pool = WorkerPool(1, spec, start_timeout_s=120)
print(pool.procs[0].pid, flush=True)
time.sleep(600)
"""


def test_an_idle_worker_ends_when_its_parent_is_killed(tmp_path, worker):  # noqa: F811
    """Between iterations a worker waits for its next command; a SIGKILLed parent sends none, so the worker must
    notice the death by itself (the check before publishing never runs while it is idle)."""
    import signal

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen(
        [sys.executable, "-c", _IDLE_PARENT, worker.spec.model_dir, str(tmp_path / "lake2")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
    )
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return f.read().split("State:")[1].split()[0] != "Z"
        except (FileNotFoundError, IndexError):
            return False

    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive(pid), "the idle orphaned worker kept running"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ the pool


class _Alive:
    exitcode = None

    def is_alive(self) -> bool:
        return True


class _Dead:
    exitcode = 3
    pid = 4321

    def is_alive(self) -> bool:
        return False


class _Silent:
    """A result queue that never has anything; fails the test if waited on for more than `limit_s`."""

    def __init__(self, limit_s: float = 10.0):
        self.deadline = time.monotonic() + limit_s

    def get(self, timeout: float):
        assert time.monotonic() < self.deadline, "waited past the timeout it was given"
        time.sleep(min(timeout, 0.05))
        raise queue.Empty


def _pool(procs, results, n=None) -> WorkerPool:
    pool = WorkerPool.__new__(WorkerPool)
    pool.procs, pool.results, pool.failed = procs, results, None
    pool.n = n if n is not None else len(procs)
    pool.commands = [queue.Queue() for _ in procs]
    pool.work = queue.Queue()
    pool.ready = [True] * len(procs)
    pool.serve_sent = [threading.Event() for _ in procs]
    pool.start_timeout_s = 1.0
    return pool


class _Filled(_Silent):
    """`msgs`, then nothing (a test that waits on past them fails instead of hanging)."""

    def __init__(self, *msgs):
        super().__init__()
        self.msgs = list(msgs)

    def get(self, timeout: float):
        return self.msgs.pop(0) if self.msgs else super().get(timeout)


def _filled(*msgs) -> _Filled:
    return _Filled(*msgs)


def test_enqueue_hands_out_chunks_in_plan_order_then_one_stop_per_worker():
    pool = _pool([_Alive()] * 3, [None] * 3)
    chunks = [Chunk(2, 2, i, (i,)) for i in range(4)]
    pool.enqueue(chunks)
    got = [pool.work.get_nowait() for _ in range(pool.work.qsize())]
    assert got == [*chunks, _STOP, _STOP, _STOP]


def test_announce_reaches_every_worker():
    pool = _pool([_Alive()] * 3, [None] * 3)
    pool.announce(4, "ckpt/v4")
    assert [q.get_nowait() for q in pool.commands] == [("version", 4, "ckpt/v4")] * 3
    assert all(q.empty() for q in pool.commands)


def test_a_silent_worker_times_out():
    pool = _pool([_Alive()], [_Silent()])
    with pytest.raises(WorkerError, match="rollout worker 0 gave no answer within 1 s"):
        pool._next(0, timeout_s=1.0)
    assert not pool.alive()


def test_run_waits_only_as_long_as_it_is_told():
    pool = _pool([_Alive()], [_Silent()])
    with pytest.raises(WorkerError, match="gave no answer within 1 s"):
        pool.run(0, 3, "ckpt/v3", timeout_s=1.0)
    assert pool.commands[0].get_nowait() == ("iterate", 3, "ckpt/v3")


def test_a_worker_that_does_not_start_in_time_fails_the_pool():
    pool = _pool([_Alive()], [_Silent()])
    pool.ready = [False]
    with pytest.raises(WorkerError, match="gave no answer within 1 s"):
        pool.run(0, 0, "ckpt/v0")


def test_a_dead_worker_without_a_message_is_reported_with_its_exit_code():
    pool = _pool([_Dead()], [_Silent()])
    with pytest.raises(WorkerError, match=r"^rollout worker 0 \(pid 4321\) died \(exit code 3\)$"):
        pool._next(0, timeout_s=30)
    assert pool.failed == "rollout worker 0 (pid 4321) died (exit code 3)"


def test_the_pools_failure_names_the_dead_worker_or_keeps_the_error_a_worker_sent():
    """The train task, finding the pool not alive before a rollout task has read why, says which worker died and
    how; an error a worker already sent stays the failure."""
    dead = _Dead()
    dead.exitcode = -9
    pool = _pool([_Alive(), dead], [None, None])
    assert pool.failure() == (
        "rollout worker 1 (pid 4321) died (exit code -9, SIGKILL: killed by the kernel's out-of-memory killer "
        "(see `dmesg`) or by another process)"
    )
    assert pool.failed == pool.failure()
    pool = _pool([_Alive()], [_filled(("error", "Traceback: boom"))])
    with pytest.raises(WorkerError):
        pool._next(0, timeout_s=30)
    assert pool.failure() == "rollout worker 0 failed:\nTraceback: boom"


@pytest.mark.parametrize(
    "code,words",
    [
        (0, "exit code 0"),
        (3, "exit code 3"),
        (None, "no exit code yet"),
        (-7, "exit code -7, SIGBUS: a crash in native code (or a shared-memory file cut short)"),
        (-6, "exit code -6, SIGABRT: aborted by native code"),
        (-11, "exit code -11, SIGSEGV: a crash in native code"),
        (-15, "exit code -15, SIGTERM"),
        (-200, "exit code -200"),  # no such signal
    ],
)
def test_how_a_process_ended_is_told_by_its_exit_code_and_signal(code, words):
    assert ended(code) == words


def test_a_live_workers_error_fails_the_pool():
    """A command's error leaves the worker process alive; the pool must still count as failed."""
    pool = _pool([_Alive()], [_filled(("error", "Traceback: boom"))])
    with pytest.raises(WorkerError, match="rollout worker 0 failed:\nTraceback: boom"):
        pool._next(0)
    assert not pool.alive()


def test_the_pool_is_alive_only_while_every_worker_is():
    assert _pool([_Alive(), _Alive()], [None, None]).alive()
    assert not _pool([_Alive(), _Dead()], [None, None]).alive()
    assert not _pool([_Dead(), _Alive()], [None, None]).alive()


def test_an_unexpected_message_is_an_error():
    pool = _pool([_Alive()], [_filled(("ready", 0))])
    with pytest.raises(WorkerError, match="rollout worker 0: expected 'done', got 'ready'"):
        pool.run(0, 0, "ckpt/v0")
    pool = _pool([_Alive()], [_filled(("ready", 0))])
    with pytest.raises(WorkerError, match="rollout worker 0: unexpected message 'ready'"):
        pool.serve(0, 0, "ckpt/v0", 1, False)


def test_serve_passes_each_shard_on_then_returns_the_figures():
    pool = _pool([_Alive()], [_filled(("shard", {"path": "a"}), ("shard", {"path": "b"}), ("done", {"shards": 2}))])
    seen = []
    assert pool.serve(0, 5, "ckpt/v5", 2, True, on_shard=seen.append) == {"shards": 2}
    assert seen == [{"path": "a"}, {"path": "b"}]
    assert pool.commands[0].get_nowait() == ("serve", 5, "ckpt/v5", 2, True)
    assert pool.serve_sent[0].is_set()


def test_close_lets_a_worker_that_obeys_exit_end_cleanly():
    """A worker that takes its exit command ends by itself (exit code 0); close does not kill it."""
    ctx = multiprocessing.get_context("spawn")
    commands = ctx.Queue()
    proc = ctx.Process(target=commands.get, daemon=True)  # ends when it reads one command
    proc.start()
    pool = WorkerPool.__new__(WorkerPool)
    pool.procs, pool.work, pool.commands, pool.results = [proc], ctx.Queue(), [commands], [ctx.Queue()]
    t0 = time.monotonic()
    pool.close(timeout_s=20)
    assert proc.exitcode == 0
    assert time.monotonic() - t0 < 15


# ------------------------------------------------------------------------------------------------ shared weights


class _Odd(torch.nn.Module):
    """Parameters whose byte sizes are not multiples of 64, in two dtypes."""

    def __init__(self, shapes=((3,), (5, 7), (2,))):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(shapes[0]))
        self.b = torch.nn.Parameter(torch.randn(shapes[1]))
        self.c = torch.nn.Parameter(torch.randn(shapes[2], dtype=torch.float16))


def test_shared_weights_views_are_aligned_and_carry_odd_sizes(tmp_path):
    torch.manual_seed(0)
    src, dst = _Odd(), _Odd()
    shared = SharedWeights.create(src, str(tmp_path))
    try:
        assert [(name, off) for name, off, _, _ in shared.layout] == [("a", 0), ("b", 64), ("c", 256)]
        assert shared.nbytes == 320 and os.path.getsize(shared.path) == 320
        shared.write(src)
        tasks.workers._MAPPED.clear()
        shared.read_into(dst)
        for (n, x), (_, y) in zip(src.state_dict().items(), dst.state_dict().items()):
            assert x.dtype == y.dtype and torch.equal(x, y), n
    finally:
        shared.unlink()


def test_shared_weights_refuse_a_model_of_other_shapes(tmp_path):
    shared = SharedWeights.create(_Odd(), str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="do not match the layout"):
            shared.read_into(_Odd(((3,), (7, 5), (2,))))  # same names and sizes, other shape
    finally:
        shared.unlink()


def test_unlink_releases_the_mapping_and_the_file(tmp_path):
    model = _Odd()
    shared = SharedWeights.create(model, str(tmp_path))
    shared.write(model)
    assert shared.path in tasks.workers._MAPPED
    shared.unlink()
    assert shared.path not in tasks.workers._MAPPED and not os.path.exists(shared.path)


def test_creating_shared_weights_removes_a_dead_runs_file(tmp_path):
    """A run SIGKILLed with its file in place: the next creation in the same folder removes it."""
    code = (
        "import sys, torch; from tasks.workers import SharedWeights; "
        "print(SharedWeights.create(torch.nn.Linear(3, 2), sys.argv[1]).path)"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    left = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=repo)
    path = left.stdout.strip()
    assert left.returncode == 0 and os.path.exists(path), left.stderr[-2000:]
    shared = SharedWeights.create(_Odd(), str(tmp_path))
    try:
        assert not os.path.exists(path)
        assert os.path.basename(shared.path).startswith(f"lockstep-weights-{os.getpid()}-")
        assert os.listdir(tmp_path) == [os.path.basename(shared.path)]
    finally:
        shared.unlink()


def test_a_worker_loads_a_version_from_shared_weights(worker, tmp_path):  # noqa: F811
    trainer = _Worker(1, worker.spec, queue.Queue(), os.getppid()).model
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.5)
    shared = SharedWeights.create(trainer, str(tmp_path))
    try:
        shared.write(trainer)
        worker.version = 0
        worker.load(1, shared)
        assert worker.version == 1
        for (n, a), (_, b) in zip(trainer.state_dict().items(), worker.model.state_dict().items()):
            assert torch.equal(a, b), n
    finally:
        shared.unlink()


class _VLLMLoads:
    """The vLLM engine's `load_checkpoint` as the worker calls it: what the folder it is given holds at that moment,
    checked against the manifest, and the weights read from it (or the failure of a load)."""

    def __init__(self, fail: bool = False):
        self.fail, self.seen = fail, []

    def load_checkpoint(self, model_dir: str) -> None:
        folder = Lake(os.path.dirname(model_dir))
        checkpoints.verify_checkpoint(folder, model_dir)
        self.seen.append((model_dir, sorted(os.listdir(model_dir)), checkpoints.load_weights(folder, model_dir)))
        if self.fail:
            raise RuntimeError("CUDA out of memory")


@pytest.fixture
def object_store_checkpoint(worker, tmp_path, monkeypatch):  # noqa: F811
    """Checkpoint v1 of the worker's run in a memory:// lake (an object store: not a local folder), with weights
    unlike the v0 the worker holds, and the temporary folder moved to `tmp_path / "temp"`."""
    lake = Lake(f"memory://lockstep-vllm-{uuid.uuid4().hex}")
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(0.25)
    path = checkpoints.save_checkpoint(lake, "w", 1, worker.model, worker.tokenizer)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    yield lake, path, temp
    lake.fs.rm(lake.root, recursive=True)


def test_a_vllm_worker_loads_an_object_store_version_from_a_copy_removed_after_the_load(
    worker,  # noqa: F811
    object_store_checkpoint,
):
    """vLLM reads a local folder: the checkpoint is copied for the load, checked, and removed once loaded (kept in a
    shared cache, one model copy per promoted version piled up in the temporary folder over a run)."""
    lake, path, temp = object_store_checkpoint
    engine = _VLLMLoads()
    worker.lake, worker.vllm, worker.version = lake, engine, 0
    worker.load(1, path)
    assert worker.version == 1
    [(model_dir, files, weights)] = engine.seen
    assert os.path.dirname(os.path.dirname(model_dir)) == str(temp)
    assert {"MANIFEST.json", "config.json", "model.safetensors"} <= set(files)
    assert "trainer_state" not in files
    state = worker.model.state_dict()  # v1's weights (v0 + 0.25)
    assert weights and all(torch.equal(w, state[name]) for name, w in weights.items())
    assert list(temp.iterdir()) == []
    worker.load(1, path)  # the version held: nothing is copied again
    assert len(engine.seen) == 1


def test_a_failed_vllm_load_leaves_no_copy_and_the_version_unchanged(worker, object_store_checkpoint):  # noqa: F811
    lake, path, temp = object_store_checkpoint
    worker.lake, worker.vllm, worker.version = lake, _VLLMLoads(fail=True), 0
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        worker.load(1, path)
    assert worker.version == 0
    assert list(temp.iterdir()) == []


def test_a_vllm_worker_loads_a_local_lakes_checkpoint_in_place(worker, tmp_path, monkeypatch):  # noqa: F811
    lake = Lake(str(tmp_path / "lake"))
    path = checkpoints.save_checkpoint(lake, "w", 1, worker.model, worker.tokenizer)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    engine = _VLLMLoads()
    worker.lake, worker.vllm, worker.version = lake, engine, 0
    worker.load(1, path)
    assert [d for d, _, _ in engine.seen] == [path]
    assert list(temp.iterdir()) == []


# ------------------------------------------------------------------------------------------------ shard schema


def test_the_rollout_schemas_column_types_are_pinned():
    """Changing a column's type changes what older shards read as: it needs a new SCHEMA_VERSION."""
    assert {f.name: str(f.type) for f in ROLLOUT_SCHEMA} == {
        "run_id": "string",
        "iteration": "int64",
        "policy_version": "int64",
        "group_id": "string",
        "prompt_id": "int64",
        "sample_index": "int32",
        "prompt_ids": "list<item: int32>",
        "response_ids": "list<item: int32>",
        "behavior_logprobs": "list<item: float>",
        "token_versions": "list<item: int64>",
        "reward": "double",
        "finish_reason": "string",
        "prompt_text": "string",
        "response_text": "string",
        "worker": "int32",
        "seed": "int64",
        "created_at": "timestamp[ms, tz=UTC]",
    }


def test_a_worker_ends_responses_at_a_newline_only_when_its_task_asks(worker):  # noqa: F811
    """One-line answers (arithmetic) end at a newline token; a task whose answers reason over several lines (GSM8K's
    steps before '#### n') ends them at EOS only: a newline stop cut them at their first step."""
    newline = worker.tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert worker.params.stop_on_newline_id == newline[0] and len(newline) == 1
    multi_line = _Worker(0, replace(worker.spec, stop_at_newline=False), queue.Queue(), os.getppid())
    assert multi_line.params.stop_on_newline_id is None
    assert (multi_line.params.max_new_tokens, multi_line.params.temperature) == (
        worker.params.max_new_tokens,
        worker.params.temperature,
    )


def test_a_worker_stops_at_its_models_other_end_ids(worker, tmp_path):  # noqa: F811
    """The built-in engine ends a response at every end id of the model's generation config, as vLLM does (read from
    the model directory for a vLLM worker, which loads no Hugging Face model of its own)."""
    from models.tiny import save_hf

    assert worker.params.other_eos_ids == ()  # the tiny model's one end: the tokenizer's EOS
    worker.model.generation_config.eos_token_id = [worker.tokenizer.eos_token_id, 11]
    save_hf(worker.model, worker.tokenizer, tmp_path / "ends")
    assert tasks.workers._generation_config(str(tmp_path / "ends")).eos_token_id == [worker.tokenizer.eos_token_id, 11]
    assert tasks.workers._generation_config(str(tmp_path)) is None  # no generation_config.json
    again = _Worker(0, replace(worker.spec, model_dir=str(tmp_path / "ends")), queue.Queue(), os.getppid())
    assert again.params.other_eos_ids == (11,)
