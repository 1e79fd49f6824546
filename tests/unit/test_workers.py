"""The rollout worker pool starts without waiting; a worker that cannot start fails its first command, clearly."""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from pathlib import Path

import pytest

from tasks.workers import PoolClosed, WorkerError, WorkerPool, WorkerSpec


def _spec(tmp_path, model_dir: str) -> WorkerSpec:
    return WorkerSpec(
        lake_uri=str(tmp_path / "lake"),
        run_id="w",
        model_dir=model_dir,
        threads=1,
        run_seed=0,
        group_size=2,
        max_new_tokens=2,
        temperature=1.0,
        top_p=1.0,
        partial_credit=0.0,
        compression=None,
        reward_kind="arithmetic",
        prompts=[],
    )


def test_unstartable_worker_fails_its_first_command(tmp_path):
    missing = tmp_path / "no-model-here"
    pool = WorkerPool(1, _spec(tmp_path, str(missing)), start_timeout_s=120, wait_ready=False)
    try:
        assert pool.ready == [False]  # returned without waiting for the worker's ready (or error) message
        with pytest.raises(WorkerError, match="rollout worker 0 failed") as err:
            pool.run(0, 0, str(tmp_path / "ckpt"))
        assert str(missing) in str(err.value)  # the worker's traceback names the directory it could not load
        assert not pool.alive()
    finally:
        pool.close()


def test_waiting_pool_raises_at_start(tmp_path):
    with pytest.raises(WorkerError, match="rollout worker 0 failed"):
        WorkerPool(1, _spec(tmp_path, str(tmp_path / "absent")), start_timeout_s=120)


def _v0_checkpoint(tmp_path, tiny_hf) -> Path:
    """v0 as a run's lake holds it (a Hugging Face directory with its MANIFEST.json), in a lake of its own."""
    from storage.checkpoints import save_checkpoint
    from storage.lake import Lake

    return Path(save_checkpoint(Lake(str(tmp_path / "v0-lake")), "w", 0, tiny_hf.model, tiny_hf.tokenizer))


def test_stop_right_after_serve_is_never_lost(tmp_path, tiny_hf):
    """`stop_serving` while the worker is still starting: the stop must reach it after its serve command (a stop
    that overtook it was ignored and the worker served forever; seen in the async kill/resume test)."""
    import threading
    import time

    model_dir = _v0_checkpoint(tmp_path, tiny_hf)  # the worker loads it as a promoted version
    pool = WorkerPool(1, _spec(tmp_path, str(model_dir)), start_timeout_s=120, wait_ready=False)
    try:
        result: dict = {}

        def serve() -> None:
            try:
                result.update(pool.serve(0, 0, str(model_dir), 1, False))
            except BaseException as e:  # e.g. the pool's start timeout: reported below, not lost in the thread
                result["error"] = e

        t = threading.Thread(target=serve)
        t.start()
        pool.stop_serving()  # before the worker has even imported torch
        # starting (spawn, torch import, model load) took 5-16 s here under load; time it apart from the stop, so
        # that a slow start fails as one (the pool's own 120 s limit) and not as "kept serving"
        deadline = time.monotonic() + 150
        while not pool.ready[0] and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.ready[0] or not t.is_alive(), "the worker neither started nor failed within 150 s"
        t.join(timeout=30)
        assert not t.is_alive(), "the worker kept serving after stop_serving"
        if "error" in result:
            raise result["error"]
        assert result["shards"] == 0 and pool.ready == [True]
    finally:
        pool.close()


def test_shared_weights_carry_a_version_between_mappings(tmp_path, tiny_hf):
    """The trainer writes its parameters into the shared file; another mapping of it (a worker's, here a
    pickled copy with the process's mapping cache cleared) reads them into a different model exactly."""
    import pickle

    import torch

    import tasks.workers
    from models.tiny import build_char_tokenizer, build_tiny_model
    from tasks.workers import SharedWeights
    from tests.conftest import TINY

    trainer_model = tiny_hf.model
    shared = SharedWeights.create(trainer_model, str(tmp_path))
    try:
        n_params = len(dict(trainer_model.named_parameters()))
        assert len(shared.layout) == n_params  # tied embeddings: one entry
        worker_model = build_tiny_model(len(build_char_tokenizer()), seed=1, **TINY)
        name = "model.layers.0.mlp.up_proj.weight"
        assert not torch.equal(
            dict(worker_model.named_parameters())[name], dict(trainer_model.named_parameters())[name]
        )
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(0.25)  # a "new version"
        shared.write(trainer_model)
        remote = pickle.loads(pickle.dumps(shared))
        tasks.workers._MAPPED.clear()  # as in another process: map the file afresh
        remote.read_into(worker_model)
        for (n, a), (_, b) in zip(trainer_model.state_dict().items(), worker_model.state_dict().items()):
            assert torch.equal(a, b), n
        other = build_tiny_model(len(build_char_tokenizer()), seed=0, **{**TINY, "num_layers": 1})
        with pytest.raises(RuntimeError, match="do not match the layout"):
            remote.read_into(other)
    finally:
        shared.unlink()
    assert shared.path.startswith(str(tmp_path)) and not os.path.exists(shared.path)


def test_a_worker_imports_a_reward_file_itself(tmp_path, tiny_hf):
    """`task.reward: FILE.py:FUNCTION`: a worker (a process of its own, forked by a fork server that does not import the
    file) loads the file as it starts, before it says it is ready; the file's module-level code runs in the worker's
    process."""
    from dataclasses import replace

    (tmp_path / "r.py").write_text(
        "import os\n"
        f"open({str(tmp_path / 'loaded')!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "def score(response, answer):\n    return 1.0\n"
    )
    spec = replace(_spec(tmp_path, str(_v0_checkpoint(tmp_path, tiny_hf))), reward_kind=f"{tmp_path}/r.py:score")
    pool = WorkerPool(1, spec, start_timeout_s=120)
    try:
        assert pool.ready == [True]
        assert (tmp_path / "loaded").read_text().split() == [str(pool.procs[0].pid)]
        assert pool.procs[0].pid != os.getpid()
    finally:
        pool.close()


_ORPHAN_PARENT = """
import sys, threading, time
from transformers import AutoTokenizer
from tasks.workers import Chunk, WorkerPool, WorkerSpec
model_dir, lake = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
prompts = [(i, f"{i}+1=", str(i + 1), tok(f"{i}+1=", add_special_tokens=False)["input_ids"], {}) for i in range(8)]
spec = WorkerSpec(lake_uri=lake, run_id="orphan", model_dir=model_dir, threads=1, run_seed=0, group_size=2,
                  max_new_tokens=8, temperature=1.0, top_p=1.0, partial_credit=0.0, compression=None,
                  reward_kind="arithmetic", prompts=prompts)
pool = WorkerPool(1, spec, start_timeout_s=120)
pool.enqueue([Chunk(0, 0, i, (i % 8,)) for i in range(2000)])  # far more than it can generate before the kill
print(pool.procs[0].pid, flush=True)
threading.Thread(target=pool.run, args=(0, 0, model_dir), daemon=True).start()
time.sleep(600)
"""


def test_worker_ends_when_its_parent_is_killed_mid_generation(tmp_path, tiny_hf):
    """A SIGKILLed flow process cannot stop its workers: each must notice and end while it still has queued chunks,
    or it would go on publishing shards that a resumed run could train beside its own copies of the same groups."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
        except (FileNotFoundError, IndexError):
            return False

    model_dir = _v0_checkpoint(tmp_path, tiny_hf)  # the worker loads it as a promoted version
    lake = tmp_path / "lake"
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT, str(model_dir), str(lake)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        worker = int(parent.stdout.readline())
        # seconds here alone; once, in a clean-clone CI beside other work on 2 cores, only 2 shards in 120 s
        deadline = time.monotonic() + 300
        while len(list(lake.rglob("*.arrow"))) < 3 and time.monotonic() < deadline:  # generating
            time.sleep(0.05)
        shards = len(list(lake.rglob("*.arrow")))
        assert shards >= 3, f"{shards} shards in 300 s; worker alive {alive(worker)}, parent exit {parent.poll()}"
        assert alive(worker)  # so that its end below is the kill's doing
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker), "the orphaned worker kept running"
    published = len(list(lake.rglob("*.arrow")))
    assert published < 2000
    time.sleep(1.0)
    assert len(list(lake.rglob("*.arrow"))) == published  # nothing published after its end


class _DeadWorker:
    exitcode = 1

    def is_alive(self) -> bool:
        return False


class _LateResults:
    """A worker's result queue whose last message lands just after the pool's wait for it ran out."""

    def __init__(self, msg: tuple):
        self.msg, self.waits = msg, 0

    def get(self, timeout: float) -> tuple:
        self.waits += 1
        if self.waits == 1:
            raise queue.Empty
        return self.msg


def test_a_dead_workers_last_message_is_still_read():
    """A worker that fails sends its traceback and exits; the message can land just after the pool's wait for it
    ran out and the pool saw the process gone. The traceback must still be what the error says, not a bare
    'died (exit code 1)'."""
    pool = WorkerPool.__new__(WorkerPool)  # the message protocol alone, without starting a worker
    pool.procs, pool.results, pool.failed = (
        [_DeadWorker()],
        [_LateResults(("error", "Traceback: no model in /x"))],
        None,
    )
    with pytest.raises(WorkerError, match="rollout worker 0 failed:\nTraceback: no model in /x"):
        pool._next(0)
    assert not pool.alive()


def test_close_kills_and_reaps_a_worker_that_does_not_exit():
    """`close` on a worker that ignores its exit command (stuck in a long generation) kills it and reaps it: no
    worker process is left once the pool is closed."""
    ctx = multiprocessing.get_context("spawn")
    stuck = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    stuck.start()
    pool = WorkerPool.__new__(WorkerPool)
    pool.procs, pool.work, pool.commands, pool.results = [stuck], ctx.Queue(), [ctx.Queue()], [ctx.Queue()]
    pool.close(timeout_s=0.5)
    assert stuck.exitcode == -9  # killed and reaped (None while a killed child is not yet waited for)
    assert stuck not in multiprocessing.active_children()


# a stand-in `vllm` for the worker's process: like vLLM's V1 engine, building an `LLM` starts a process of its own
_VLLM_STAND_IN = """
import multiprocessing


def _engine_core():
    pass


class LLM:
    def __init__(self, **kwargs):
        core = multiprocessing.get_context("spawn").Process(target=_engine_core)
        core.start()
        core.join()
"""


def _vllm_worker_spec(tmp_path, tiny_hf):
    from dataclasses import replace

    from models.tiny import save_hf

    (tmp_path / "stand-in" / "vllm").mkdir(parents=True)
    (tmp_path / "stand-in" / "vllm" / "__init__.py").write_text(_VLLM_STAND_IN)
    model_dir = save_hf(tiny_hf.model, tiny_hf.tokenizer, tmp_path / "v0")
    return replace(_spec(tmp_path, str(model_dir)), engine="vllm"), tmp_path / "stand-in"


def test_a_vllm_worker_may_start_the_engines_own_processes(tmp_path, tiny_hf, monkeypatch):
    """A daemonic process may not start processes ('daemonic processes are not allowed to have children'), so a
    rollout worker started as one could never build vLLM's engine."""
    spec, stand_in = _vllm_worker_spec(tmp_path, tiny_hf)
    monkeypatch.syspath_prepend(str(stand_in))  # a spawned worker starts with its parent's sys.path
    pool = WorkerPool(1, spec, start_timeout_s=120)  # WorkerError with the worker's traceback if it failed
    try:
        assert pool.ready == [True] and pool.alive()
    finally:
        pool.close()
    assert not pool.procs[0].is_alive()


_POOL_LEFT_OPEN = """
import sys
sys.path.insert(0, sys.argv[3])
from tasks.workers import WorkerPool, WorkerSpec
spec = WorkerSpec(lake_uri=sys.argv[2], run_id="w", model_dir=sys.argv[1], threads=1, run_seed=0, group_size=2,
                  max_new_tokens=2, temperature=1.0, top_p=1.0, partial_credit=0.0, compression=None,
                  reward_kind="arithmetic", prompts=[], engine="vllm")
pool = WorkerPool(1, spec, start_timeout_s=120)
print(pool.procs[0].pid, flush=True)
"""  # ends without `close`


def test_a_vllm_worker_left_open_neither_outlives_nor_holds_up_the_interpreters_exit(tmp_path, tiny_hf):
    """The vLLM workers are not daemonic, and the interpreter waits at exit for a process that is not; one left
    running (the pool never closed) would wait for a command for good, and the interpreter with it."""
    import subprocess
    import sys

    spec, stand_in = _vllm_worker_spec(tmp_path, tiny_hf)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _POOL_LEFT_OPEN, spec.model_dir, spec.lake_uri, str(stand_in)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), f"the worker {pid} outlived its interpreter"


def stuck_pool() -> WorkerPool:
    """A pool (made without `__init__`) of one spawned worker that never answers, with the real queues."""
    ctx = multiprocessing.get_context("spawn")
    stuck = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    stuck.start()
    pool = WorkerPool.__new__(WorkerPool)
    pool.procs, pool.work, pool.commands, pool.results = [stuck], ctx.Queue(), [ctx.Queue()], [ctx.Queue()]
    pool.failed = None
    return pool


def test_a_task_waiting_for_its_worker_when_the_pool_closes_ends_as_pool_closed():
    """A stop (Ctrl-C, SIGTERM) or another task's failure closes the pool while a rollout task still waits for its
    worker's answer. The wait used to end in ValueError('Queue ... is closed'), logged by Prefect with its
    traceback; it is now PoolClosed, which the rollout task turns into a Cancelled state of one line."""
    from prefect.states import Cancelled

    from tasks.iteration import _unless_closed

    pool = stuck_pool()
    ended = []

    def wait():
        try:
            pool._next(0, timeout_s=60)
        except BaseException as e:  # noqa: BLE001 - whatever ended it is what the test checks
            ended.append(e)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(1.0)  # in its wait
    pool.close(timeout_s=0.5)
    waiting.join(30)
    assert [(type(e), str(e)) for e in ended] == [
        (PoolClosed, "rollout worker 0 was stopped as the run ended while this task waited for it")
    ]
    state = _unless_closed(lambda: pool._next(0, timeout_s=60))  # a task that waits after the close
    assert isinstance(state, type(Cancelled())) and state.is_cancelled()
    assert state.message == "rollout worker 0 was stopped as the run ended while this task waited for it"
    assert _unless_closed(lambda: {"shards": []}) == {"shards": []}  # an answer passes through


def test_a_worker_failure_is_not_taken_for_the_pools_close():
    """Only a closed pool turns a wait's error into PoolClosed: a worker that died on its own is still named."""
    pool = WorkerPool.__new__(WorkerPool)
    pool.procs, pool.results, pool.failed = [_DeadWorker()], [_LateResults(("error", "Traceback: boom"))], None
    with pytest.raises(WorkerError) as e:
        pool._next(0)
    assert type(e.value) is WorkerError and str(e.value) == "rollout worker 0 failed:\nTraceback: boom"


_CLOSE_THEN_DIE = """
import os, signal, time
from tests.unit.test_workers import stuck_pool
pool = stuck_pool()
pool.work.put(("chunk", 1))  # a chunk nobody took: its queue's feeder thread runs
semaphores = [
    lock._semlock.name for q in (pool.work, *pool.commands, *pool.results) for lock in (q._rlock, q._wlock, q._sem)
]
pool.close(timeout_s=0.5)
pool.close()  # a second close does nothing
time.sleep(1.0)  # a feeder thread's last flush
print(*(os.path.exists("/dev/shm/sem." + name.lstrip("/")) for name in semaphores), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # as Prefect ends a served flow run's process after a stop
"""


def test_a_closed_pool_leaves_no_semaphore_for_a_death_by_signal_to_leak():
    """A served run's process ends by Prefect's re-raised SIGTERM after the stop's cleanup, never reaching the exit
    handlers that remove a queue's named semaphores: Python's resource tracker then removed them and warned of 9
    'leaked semaphore objects'. `close` lets its queues go, so their semaphores are removed before."""
    import signal
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", _CLOSE_THEN_DIE],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == -signal.SIGTERM, out.stderr[-3000:]
    assert out.stdout.split() == ["False"] * 9, out.stdout  # three queues, three semaphores each: all gone
    assert "leaked semaphore" not in out.stderr, out.stderr[-3000:]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_resident_memory_is_read_per_process_and_summed_over_live_workers_only():
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    from tasks.workers import resident_mb

    def status_mb(pid="self"):  # the kernel's own figure, in kB
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    def child():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    ballast = bytearray(64 * 2**20)  # 64 MB written: resident
    ours = resident_mb()
    assert ours > 64 and abs(ours - status_mb()) < 8
    gone = child()
    gone.kill()
    gone.wait()  # reaped: no /proc entry left
    assert resident_mb(gone.pid) is None
    zombie = child()
    alive = child()
    try:
        time.sleep(0.5)  # the children's interpreters up
        os.kill(zombie.pid, signal.SIGKILL)  # not waited for: a zombie, whose pages read 0
        deadline = time.monotonic() + 10
        while resident_mb(zombie.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident_mb(zombie.pid) is None and os.path.exists(f"/proc/{zombie.pid}")

        def handle(pid, live=True):
            return SimpleNamespace(pid=pid, is_alive=lambda: live)

        pool = SimpleNamespace(closed=False, procs=[handle(os.getpid()), handle(alive.pid)])
        both = WorkerPool.resident_mb(pool)
        assert abs(both - (status_mb() + status_mb(alive.pid))) < 8 and both > ours + 5
        # a worker that died, by its handle (its pid may be another process's by now), or a closed pool: no figure
        assert (
            WorkerPool.resident_mb(SimpleNamespace(closed=False, procs=[*pool.procs, handle(alive.pid, False)])) is None
        )
        assert WorkerPool.resident_mb(SimpleNamespace(closed=True, procs=pool.procs)) is None
        assert WorkerPool.resident_mb(SimpleNamespace(closed=False, procs=[handle(zombie.pid)])) is None
    finally:
        for p in (zombie, alive):
            p.kill()
            p.wait()
    del ballast
