"""Scoring beside generation (`pipeline.overlap_scoring`), in process (`tasks.workers._Worker` with the real engine):
a worker generates its next chunk while the previous one is scored and written; the shards are the same, in the same
order; busy time counts the time both ran once; an error of either side fails the iteration with nothing written after
it is reported; serving (async) reports each shard and leaves none in flight when it stops."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import pytest

from models.rewards import Scorer
from storage import checkpoints
from storage.shards import read_shard, table_to_records
from tasks.workers import _STOP, Chunk
from tests.unit.test_worker_protocol import worker  # noqa: F401 - the fixture


def _overlapping(worker, on: bool = True):  # noqa: F811
    worker.spec = replace(worker.spec, overlap_scoring=on)
    worker.version = 0
    return worker


def _work(*chunks) -> queue.Queue:
    work = queue.Queue()
    for item in (*chunks, _STOP):
        work.put(item)
    return work


def _chunks(n: int) -> list[Chunk]:
    """`n` chunks of iteration 2 on version 0, of two prompts each (of the fixture's 6)."""
    return [Chunk(iteration=2, version=0, index=k, prompt_ids=(k % 3, k % 3 + 3)) for k in range(n)]


def _rows(worker, shards: list[dict]) -> list[tuple]:  # noqa: F811
    """Every row of the shards, in order, as (shard path, prompt, sample, response tokens, log-probs, reward)."""
    return [
        (info["path"], r.prompt_id, r.sample_index, tuple(r.response_ids), tuple(r.behavior_logprobs), r.reward)
        for info in shards
        for r in table_to_records(read_shard(worker.lake, info["path"], info["checksum"]))
    ]


def _watch_generation(worker, monkeypatch, started: dict[int, threading.Event]):  # noqa: F811
    """`started[k]` is set when the worker begins generating chunk k."""
    generate = worker.generate

    def watched(chunk, poll_update=None):
        started.setdefault(chunk.index, threading.Event()).set()
        return generate(chunk, poll_update)

    monkeypatch.setattr(worker, "generate", watched)


@pytest.mark.parametrize("on", [True, False], ids=["beside", "in-turn"])
def test_the_next_chunk_generates_while_a_shard_is_scored_only_when_overlapping(worker, monkeypatch, on):  # noqa: F811
    """The judge of chunk 0 waits for chunk 1's generation to start: beside, it starts (the worker did not wait for
    the scoring); in turn, it cannot (the control: the wait runs out). Either way the three shards are written, in
    order."""
    _overlapping(worker, on)
    started: dict[int, threading.Event] = {}
    _watch_generation(worker, monkeypatch, started)
    saw = []

    def judge(responses, answers, prompts, extras):
        if not saw:
            saw.append(started.setdefault(1, threading.Event()).wait(timeout=10 if on else 1))
        return [float(r.strip() == a) for r, a in zip(responses, answers)]

    worker.reward = Scorer(many=judge)
    result = worker.iterate(0, "unused: version 0 is held", _work(*_chunks(3)))
    assert saw == [on]
    assert [info["path"].rsplit("/", 1)[1] for info in result["shards"]] == [f"shard-0-0000{k}.arrow" for k in range(3)]
    rows = _rows(worker, result["shards"])
    assert [(p, j) for _, p, j, *_ in rows] == [(p, j) for k in range(3) for p in (k, k + 3) for j in range(4)]
    assert len(worker.lake.fs.glob(f"{worker.lake.root}/**/*.arrow")) == 3


def test_overlapping_changes_no_shard(worker, monkeypatch):  # noqa: F811
    """The same chunks in turn and beside: every row's tokens, log-probs and reward equal, in the same shards."""
    worker.reward = Scorer(many=lambda rs, answers, prompts, extras: [len(r) / 10 for r in rs])
    made = {}
    for on in (False, True):
        _overlapping(worker, on)
        made[on] = _rows(worker, worker.iterate(0, "unused", _work(*_chunks(3)))["shards"])
    assert made[True] == made[False] and len(made[True]) == 3 * 2 * 4
    assert len({row[5] for row in made[True]}) > 1  # the rewards differ: a swapped row would show


def test_busy_time_counts_the_time_both_ran_once(worker):  # noqa: F811
    """A judge of 0.3 s a shard beside generation: each shard's `gen_s` holds its scoring, and the shards' busy time
    adds up to no more than the iteration's wall time (counting each shard from its own start would count the time
    it generated beside the previous one's scoring twice)."""
    _overlapping(worker)

    def judge(responses, answers, prompts, extras):
        time.sleep(0.3)
        return [0.0] * len(responses)

    worker.reward = Scorer(many=judge)
    t0 = time.perf_counter()
    result = worker.iterate(0, "unused", _work(*_chunks(4)))
    wall = time.perf_counter() - t0
    assert all(0.3 <= info["reward_s"] <= info["gen_s"] for info in result["shards"])
    assert 4 * 0.3 <= result["busy_s"] + result["storage_s"] <= wall
    assert result["busy_s"] == pytest.approx(sum(info["gen_s"] for info in result["shards"]))


def _judge_down_at_the_second_shard(calls: list[int], delay_s: float = 0.0):
    """A batch judge that records each call's size and raises on the second, `delay_s` into it."""

    def judge(responses, answers, prompts, extras):
        calls.append(len(responses))
        if len(calls) == 2:
            time.sleep(delay_s)
            raise ValueError("the judge is down")
        return [0.0] * len(responses)

    return judge


def test_a_scoring_error_fails_the_iteration_and_its_shard_is_never_written(worker):  # noqa: F811
    """The second shard's judge fails beside the third chunk's generation: the iteration raises that error, the first
    shard stays published, the second and third are not."""
    _overlapping(worker)
    calls: list[int] = []
    worker.reward = Scorer(many=_judge_down_at_the_second_shard(calls))
    with pytest.raises(ValueError, match="the judge is down"):
        worker.iterate(0, "unused", _work(*_chunks(3)))
    written = sorted(p.rsplit("/", 1)[1] for p in worker.lake.fs.glob(f"{worker.lake.root}/**/*.arrow"))
    assert written == ["shard-0-00000.arrow"] and calls == [8, 8]


def test_a_scoring_error_is_raised_while_the_queue_waits_for_another_round(worker):  # noqa: F811
    """Dynamic sampling leaves the workers at an empty queue between rounds, with no stop marker: the last shard's
    scoring error is raised there, not held until a chunk that cannot come (the train task waits for that shard). The
    judge fails 1 s into its call, when the worker is already waiting at the queue."""
    _overlapping(worker)
    calls: list[int] = []
    worker.reward = Scorer(many=_judge_down_at_the_second_shard(calls, delay_s=1.0))
    work: queue.Queue = queue.Queue()
    for c in _chunks(2):
        work.put(c)
    raised = []

    def run():
        try:
            worker.iterate(0, "unused", work)
        except ValueError as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    in_time = [str(e) for e in raised]
    work.put(_STOP)  # releases a worker that waited instead (the failure below): it raises the error only now
    thread.join(timeout=60)
    assert in_time == ["the judge is down"] and calls == [8, 8]


def test_the_shard_in_flight_is_written_before_the_workers_own_error_is_raised(worker):  # noqa: F811
    """A chunk refused (another version) while the previous shard's 0.5 s scoring runs: the error is raised only once
    that shard is written, so a worker never writes after reporting its failure. When that scoring fails too, its
    error is a note on the one raised."""
    _overlapping(worker)

    def slow(responses, answers, prompts, extras):
        time.sleep(0.5)
        return [0.0] * len(responses)

    worker.reward = Scorer(many=slow)
    first, _ = _chunks(2)
    with pytest.raises(RuntimeError, match="chunk of version 1 sent to a worker holding 0"):
        worker.iterate(0, "unused", _work(first, Chunk(2, 1, 1, (1,))))
    assert len(worker.lake.fs.glob(f"{worker.lake.root}/**/*.arrow")) == 1  # written already

    work = _work(Chunk(3, 0, 0, (0,)), Chunk(3, 1, 1, (1,)))

    def failing(responses, answers, prompts, extras):
        deadline = time.monotonic() + 10
        while work.qsize() > 1 and time.monotonic() < deadline:  # until the refused chunk is taken
            time.sleep(0.01)
        raise ValueError("the judge is down")

    worker.reward = Scorer(many=failing)
    with pytest.raises(RuntimeError, match="chunk of version 1") as raised:
        worker.iterate(0, "unused", work)
    assert raised.value.__notes__ == ["the shard scored beside it failed too: ValueError('the judge is down')"]
    assert not worker.lake.fs.glob(f"{worker.lake.root}/**/iter-000003/*.arrow")


def test_serving_reports_every_shard_and_stops_with_none_in_flight(worker, monkeypatch):  # noqa: F811
    """Async with overlap: each shard is reported as it is written (from the scoring thread); a stop while the last
    shard is being scored returns only once it is written and reported."""
    _overlapping(worker)
    monkeypatch.setattr(checkpoints, "load_weights", lambda lake, source, checked=True: None)
    monkeypatch.setattr(checkpoints, "load_into", lambda model, state: None)
    scoring = []

    def judge(responses, answers, prompts, extras):
        scoring.append(time.monotonic())
        time.sleep(0.4)
        return [0.0] * len(responses)

    worker.reward = Scorer(many=judge)
    work, results, out = queue.Queue(), queue.Queue(), {}
    thread = threading.Thread(target=lambda: out.update(worker.serve(0, "c0", 4, False, work, results)), daemon=True)
    thread.start()
    for chunk in _chunks(2):
        work.put(chunk)
    deadline = time.monotonic() + 30
    while len(scoring) < 2 and time.monotonic() < deadline:  # the second shard's scoring has begun
        time.sleep(0.01)
    worker.commands.put(("stop",))
    thread.join(30)
    assert not thread.is_alive() and out["shards"] == 2
    posted = [results.get_nowait() for _ in range(2)]  # both there when serve returned
    assert [(kind, info["path"].rsplit("/", 1)[1]) for kind, info in posted] == [
        ("shard", "shard-0-00000.arrow"),
        ("shard", "shard-0-00001.arrow"),
    ]
    assert results.empty() and out["busy_s"] == pytest.approx(sum(info["gen_s"] for _, info in posted))


def test_serving_ends_with_a_scoring_error_while_admission_control_waits(worker, monkeypatch):  # noqa: F811
    """Async with overlap, max_staleness 0: batch 1's chunk waits for version 1, which needs batch 0's shard; that
    shard's scoring fails: serving ends with its error (the version would never come), it does not wait forever."""
    _overlapping(worker)
    monkeypatch.setattr(checkpoints, "load_weights", lambda lake, source, checked=True: None)
    monkeypatch.setattr(checkpoints, "load_into", lambda model, state: None)

    work, results, raised = queue.Queue(), queue.Queue(), []

    def judge(responses, answers, prompts, extras):
        deadline = time.monotonic() + 10
        while not work.empty() and time.monotonic() < deadline:  # until the next chunk is taken, and held
            time.sleep(0.01)
        time.sleep(0.2)
        raise ValueError("the judge is down")

    worker.reward = Scorer(many=judge)

    def serve():
        try:
            worker.serve(0, "c0", 0, False, work, results)
        except ValueError as e:
            raised.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    work.put(Chunk(0, 0, 0, (0, 3)))
    work.put(Chunk(1, 0, 1, (1, 4)))
    thread.join(30)
    if thread.is_alive():
        worker.commands.put(("stop",))
    assert not thread.is_alive() and [str(e) for e in raised] == ["the judge is down"]
    assert results.empty() and work.empty()  # nothing reported; the held chunk was taken
    assert not worker.lake.fs.glob(f"{worker.lake.root}/**/*.arrow")
