"""A rollout worker's protocol, in process (`tasks.workers._Worker`, no child process): the shard a chunk becomes,
admission control in async mode (a chunk of batch j starts only on a version >= j - max_staleness), the newest
announced version loaded between chunks, and a sync/periodic chunk refused on weights of another version."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import torch

from models.engine import sample_seed
from models.tiny import build_char_tokenizer, build_tiny_model, save_hf
from storage import checkpoints
from storage.shards import read_shard, table_to_records
from tasks.workers import _STOP, Chunk, WorkerSpec, _Worker

torch.set_num_threads(1)

RUN_SEED = 5


@pytest.fixture
def worker(tmp_path) -> _Worker:
    tok = build_char_tokenizer()
    model = build_tiny_model(
        len(tok), seed=0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    model_dir = save_hf(model, tok, tmp_path / "v0")
    prompts = [(i, f"{i}+1=", str(i + 1), tok(f"{i}+1=", add_special_tokens=False)["input_ids"], {}) for i in range(6)]
    spec = WorkerSpec(
        lake_uri=str(tmp_path / "lake"),
        run_id="w",
        model_dir=str(model_dir),
        threads=1,
        run_seed=RUN_SEED,
        group_size=4,
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        partial_credit=0.0,
        compression=None,
        reward_kind="arithmetic",
        prompts=prompts,
    )
    return _Worker(0, spec, queue.Queue(), os.getppid())


def test_a_chunk_becomes_one_shard_of_whole_seeded_groups_in_plan_order(worker):
    worker.version = 0  # the weights it was built from
    info = worker.generate_chunk(Chunk(iteration=3, version=0, index=7, prompt_ids=(4, 1)))
    assert info["path"].endswith("runs/w/rollouts/policy_version=0/iter-000003/shard-0-00007.arrow")
    assert info["groups"] == 2
    rows = table_to_records(read_shard(worker.lake, info["path"], info["checksum"]))
    assert [(r.group_id, r.prompt_id, r.sample_index) for r in rows] == [
        (f"3-{p}", p, j) for p in (4, 1) for j in range(4)
    ]
    assert [r.seed for r in rows] == [sample_seed(RUN_SEED, 3, p, j) for p in (4, 1) for j in range(4)]
    assert len({tuple(r.response_ids) for r in rows[:4]}) > 1  # the samples of a group differ
    assert all(r.policy_version == 0 and r.iteration == 3 and set(r.token_versions) <= {0} for r in rows)


def test_a_chunk_of_another_version_is_refused_and_publishes_nothing(worker):
    worker.version = 0
    work = queue.Queue()
    work.put(Chunk(0, 1, 0, (0,)))
    work.put(_STOP)  # a worker that took the chunk would publish its shard and return
    with pytest.raises(RuntimeError, match="chunk of version 1 sent to a worker holding 0"):
        worker.iterate(0, "unused: version 0 is held", work)
    assert worker.lake.fs.glob(f"{worker.lake.root}/**/*.arrow") == []


class Served:
    """`serve` on a thread with chunk generation recorded as (batch, version held when it started) (or by
    `generate`), publishing as a no-op and checkpoint loads as no-ops; the test drives it through the work and
    command queues, and `stop` returns what `serve` returned."""

    def __init__(self, worker: _Worker, monkeypatch, max_staleness: int, interrupt: bool = False, generate=None):
        self.worker, self.log, self.work, self.results, self.result = worker, [], queue.Queue(), queue.Queue(), {}

        def logged(chunk, poll_update=None):
            self.log.append((chunk.iteration, worker.version))
            return {"gen_s": 0.0, "storage_s": 0.0, "path": "unused"}

        monkeypatch.setattr(worker, "generate", generate or logged)  # its info stands for the generated chunk,
        monkeypatch.setattr(worker, "publish", lambda info, busy_from=None: (info, 0.0))  # "published" as it is
        monkeypatch.setattr(checkpoints, "load_weights", lambda lake, source, checked=True: None)
        monkeypatch.setattr(checkpoints, "load_into", lambda model, state: None)

        def run():
            self.result.update(worker.serve(0, "c0", max_staleness, interrupt, self.work, self.results))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def announce(self, version: int) -> None:
        self.worker.commands.put(("version", version, f"c{version}"))

    def settle(self, n: int) -> list:
        """The log once it holds `n` chunks and nothing more has started for 0.5 s."""
        deadline = time.monotonic() + 30
        while len(self.log) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        return list(self.log)

    def stop(self) -> dict:
        self.worker.commands.put(("stop",))
        self.thread.join(30)
        assert not self.thread.is_alive(), "serve did not stop"
        return self.result


def test_admission_control_holds_a_chunk_until_its_version_is_announced(worker, monkeypatch):
    served = Served(worker, monkeypatch, max_staleness=1)
    try:
        for k in range(4):
            served.work.put(Chunk(k, 0, k, (k,)))
        assert served.settle(2) == [(0, 0), (1, 0)]  # batch 2 on v0 would be 2 versions behind when trained
        served.announce(1)
        assert served.settle(3) == [(0, 0), (1, 0), (2, 1)]
        served.announce(2)
        assert served.settle(4) == [(0, 0), (1, 0), (2, 1), (3, 2)]
    finally:
        served.stop()


def test_the_newest_announced_version_is_loaded_before_the_next_chunk(worker, monkeypatch):
    served = Served(worker, monkeypatch, max_staleness=8)
    try:
        served.work.put(Chunk(0, 0, 0, (0,)))
        assert served.settle(1) == [(0, 0)]
        served.announce(2)
        served.announce(1)  # announcements can overtake each other: the newest wins
        # queued right behind them, no pause: the worker must read its commands after taking the chunk (it read
        # them only before waiting for one, and a chunk put within that wait ran on v0)
        served.work.put(Chunk(1, 0, 1, (1,)))  # admissible on v0, but v2 is there to be used
        assert served.settle(2) == [(0, 0), (1, 2)]
    finally:
        served.stop()
