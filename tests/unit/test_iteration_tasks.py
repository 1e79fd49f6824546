"""The iteration's tasks on a real lake with a stand-in session (no workers, no Prefect run): the plan and its
chunks, a resumed plan reusing valid shards, the watcher's listing, micro-batch packing, promotion without shared
weights, and the audit's wait for the checkpoint it annotates."""

from __future__ import annotations

import concurrent.futures
import re
import threading
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from models.trainer import RolloutGroup
from storage import checkpoints, ledger
from storage.lake import Lake
from storage.shards import SampleRecord, write_shard
from tasks import iteration
from tasks import session as session_module
from tasks.session import iteration_prompt_ids, refill_prompt_ids

RUN = "plan"
N_TRAIN = 20


class _Pool:
    def __init__(self):
        self.enqueued: list = []
        self.last: list[bool] = []

    def enqueue(self, chunks, last: bool = True) -> None:
        self.enqueued.append(list(chunks))
        self.last.append(last)


def _session(tmp_path, monkeypatch, overrides=(), version: int = 0) -> SimpleNamespace:
    cfg = load_config(
        None, ["rollout.prompts_per_iteration=8", "pipeline.shard_groups=3", "rollout.group_size=2", *overrides]
    )
    s = SimpleNamespace(
        run_id=RUN,
        cfg=cfg,
        lake=Lake(str(tmp_path / "lake")),
        pool=_Pool(),
        version=version,
        train_prompts=list(range(N_TRAIN)),
        storage_s=0.0,
    )
    monkeypatch.setitem(session_module.SESSIONS, RUN, s)
    return s


def _publish(s, chunk, version: int, reward=lambda prompt, sample: 0.5) -> str:
    """A complete shard of `chunk` (every group whole), where a worker publishes it; `reward(prompt, sample)`."""
    now = datetime.now(timezone.utc)
    records = [
        SampleRecord(
            RUN,
            chunk.iteration,
            version,
            f"{chunk.iteration}-{p}",
            p,
            j,
            [1, 2],
            [3, 4],
            [-0.5, -0.5],
            [version, version],
            reward(p, j),
            "stop",
            "q",
            "a",
            0,
            7,
            now,
        )
        for p in chunk.prompt_ids
        for j in range(s.cfg.rollout.group_size)
    ]
    path = f"{s.lake.iteration_rollouts(RUN, version, chunk.iteration)}/shard-0-{chunk.index:05d}.arrow"
    write_shard(s.lake, RUN, path, records)
    return path


def test_plan_cuts_the_batch_into_numbered_chunks_and_records_it(tmp_path, monkeypatch):
    """8 prompts in chunks of 3: chunks 0, 1, 2 (the shard sequence numbers) of 3, 3 and 2 prompts, together the
    iteration's plan in order, at the session's version; the ledger holds the plan before any chunk is enqueued."""
    s = _session(tmp_path, monkeypatch, version=2)
    out = iteration.plan_task.fn(RUN, 2)
    plan = iteration_prompt_ids(s.cfg, N_TRAIN, 2)
    (chunks,) = s.pool.enqueued
    assert [c.index for c in chunks] == [0, 1, 2]
    assert [len(c.prompt_ids) for c in chunks] == [3, 3, 2]
    assert [p for c in chunks for p in c.prompt_ids] == plan
    assert {(c.iteration, c.version) for c in chunks} == {(2, 2)}
    rec = ledger.read_record(s.lake, RUN, 2)
    assert rec["state"] == "rolling_out" and [h["state"] for h in rec["history"]] == ["planned", "rolling_out"]
    assert (rec["policy_version"], rec["planned_at_version"], rec["prompt_ids"], rec["chunks"]) == (2, 2, plan, 3)
    assert rec["reused_chunks"] == [] and rec["quarantined"] == [] and rec["group_size"] == 2
    assert (out["groups"], out["chunks"], out["version"]) == (8, 3, 2)


def test_dynamic_sampling_records_each_round_before_its_chunks_and_a_resume_cuts_them_again(tmp_path, monkeypatch):
    """Dynamic sampling: the workers get no stop marker with a round (the train task ends the iteration); a later
    round is in the ledger (plan, round sizes, chunk count) before its chunks are enqueued, numbered after the
    earlier rounds'; a resume plans every recorded round, each cut on its own; with the prompts spent, none."""
    s = _session(tmp_path, monkeypatch, ["algorithm.dynamic_sampling=true"], version=1)
    iteration.plan_task.fn(RUN, 1)
    first = iteration_prompt_ids(s.cfg, N_TRAIN, 1)
    enqueued = {}

    def enqueue(chunks, last=True):  # what the ledger held when the chunks reached the queue
        enqueued["rec"] = ledger.read_record(s.lake, RUN, 1)
        _Pool.enqueue(s.pool, chunks, last)

    monkeypatch.setattr(s.pool, "enqueue", enqueue)
    new = iteration.plan_round(s, RUN, 1, 5)
    assert new == refill_prompt_ids(N_TRAIN, s.cfg.run.seed, 1, 1, first, 5) and not set(new) & set(first)
    assert len(new) == 5
    (round0, round1) = s.pool.enqueued
    assert s.pool.last == [False, False]
    assert [c.index for c in round1] == [3, 4] and [p for c in round1 for p in c.prompt_ids] == new
    assert [len(c.prompt_ids) for c in round1] == [3, 2]  # a round's chunks do not straddle rounds
    rec = ledger.read_record(s.lake, RUN, 1)
    assert enqueued["rec"]["rounds"] == rec["rounds"] == [8, 5]  # recorded before the enqueue
    assert rec["prompt_ids"] == first + new and rec["chunks"] == 5 and rec["state"] == "rolling_out"
    s.pool = _Pool()
    iteration.plan_task.fn(RUN, 1)
    (again,) = s.pool.enqueued
    assert [(c.index, c.prompt_ids) for c in again] == [(c.index, c.prompt_ids) for c in round0 + round1]
    assert ledger.read_record(s.lake, RUN, 1)["rounds"] == [8, 5]
    third = iteration.plan_round(s, RUN, 1, 8)
    assert sorted(third) == sorted(set(range(N_TRAIN)) - set(first + new))  # the 7 left
    assert iteration.plan_round(s, RUN, 1, 8) == [] and len(s.pool.enqueued) == 2  # none left: nothing enqueued


def test_async_plans_ahead_under_the_batch_version(tmp_path, monkeypatch):
    """Async mode plans batch k + max_staleness while the trainer holds version k: the record names the version that
    batch will be trained at (its iteration, which replay trains it at), and the version the plan was made at."""
    s = _session(tmp_path, monkeypatch, ["pipeline.mode=async", "pipeline.max_staleness=2"], version=1)
    iteration.plan_task.fn(RUN, 3)
    rec = ledger.read_record(s.lake, RUN, 3)
    assert (rec["policy_version"], rec["planned_at_version"]) == (3, 1)
    assert {c.version for c in s.pool.enqueued[0]} == {1}


def test_a_resumed_plan_reuses_valid_shards_and_regenerates_the_rest(tmp_path, monkeypatch):
    """Resume of an iteration cut short while rolling out: its record is marked failed then planned again with the
    same prompts; chunks 0 and 2 have valid shards (reused), chunk 1's shard is damaged: it is moved to quarantine/
    (out of the watcher's listing) and only chunk 1 is enqueued again; the record still counts all 3 chunks."""
    s = _session(tmp_path, monkeypatch, version=1)
    iteration.plan_task.fn(RUN, 1)
    (first,) = s.pool.enqueued
    _publish(s, first[0], 1)
    damaged = _publish(s, first[1], 1)
    _publish(s, first[2], 1)
    with s.lake.fs.open(damaged, "wb") as f:
        f.write(b"ARROW1 cut short")
    s.pool = _Pool()
    iteration.plan_task.fn(RUN, 1)
    (again,) = s.pool.enqueued
    assert [(c.index, c.prompt_ids) for c in again] == [(first[1].index, first[1].prompt_ids)]
    rec = ledger.read_record(s.lake, RUN, 1)
    assert [h["state"] for h in rec["history"]] == ["planned", "rolling_out", "failed", "planned", "rolling_out"]
    assert rec["reason"] == "interrupted before promotion; resumed"
    assert sorted(rec["reused_chunks"]) == [0, 2] and rec["chunks"] == 3
    assert rec["prompt_ids"] == [p for c in first for p in c.prompt_ids]
    (moved,) = rec["quarantined"]
    assert "/quarantine/" in moved and moved.endswith("shard-0-00001.arrow") and s.lake.fs.exists(moved)
    assert damaged not in iteration.list_shards(s, RUN, 1)
    assert len(iteration.list_shards(s, RUN, 1)) == 2


def test_a_resumed_iteration_keeps_the_plan_it_was_started_with(tmp_path, monkeypatch):
    """The plan in the ledger wins over a recomputed one: the published shards were cut from it, so a resume after
    the task's prompt set changed (a dataset file grown, another tokenizer's length filter) must not plan anew."""
    s = _session(tmp_path, monkeypatch, version=1)
    recorded = [19, 0, 7, 3, 12, 5, 16, 9]
    assert recorded != iteration_prompt_ids(s.cfg, N_TRAIN, 1)
    ledger.write_record(s.lake, RUN, 1, ("planned", "rolling_out"), prompt_ids=recorded)
    iteration.plan_task.fn(RUN, 1)
    assert [p for c in s.pool.enqueued[0] for p in c.prompt_ids] == recorded
    assert ledger.read_record(s.lake, RUN, 1)["prompt_ids"] == recorded


def test_the_watcher_lists_every_admissible_version_of_an_iteration(tmp_path, monkeypatch):
    """Async with max_staleness 2: batch 3's shards may have started on versions 1, 2 or 3 and are all listed (not
    version 0's folder of another batch, not another iteration's); periodic lists version k only."""
    s = _session(tmp_path, monkeypatch, ["pipeline.mode=async", "pipeline.max_staleness=2"])
    fs = s.lake.fs
    paths = {}
    for v, k in [(0, 3), (1, 3), (2, 3), (3, 3), (2, 2)]:
        p = f"{s.lake.iteration_rollouts(RUN, v, k)}/shard-0-{v:05d}.arrow"
        fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(p, b"x")
        paths[(v, k)] = p
    assert iteration.list_shards(s, RUN, 3) == sorted(paths[(v, 3)] for v in (1, 2, 3))
    s.cfg = load_config(None, ["pipeline.mode=periodic"])
    assert iteration.list_shards(s, RUN, 3) == [paths[(3, 3)]]


def _g(prompt_len: int, response_lens: list[int]) -> RolloutGroup:
    return RolloutGroup(
        [1] * prompt_len,
        [[2] * n for n in response_lens],
        [0.0] * len(response_lens),
        [[-0.1] * n for n in response_lens],
        [[0] * n for n in response_lens],
    )


def test_micro_batches_pack_up_to_the_budget_by_each_layouts_cost():
    """Cost of a group: unshared G x prompt + responses (each row repeats the prompt), shared prompt + responses.
    A micro-batch is filled up to exactly the budget; a group over the budget goes alone (no empty micro-batch)."""
    a, b, c = _g(4, [2, 2]), _g(4, [2, 2]), _g(4, [2, 2])  # unshared cost 12, shared 8
    sizes = lambda out: [[id(g) for g in mb] for mb in out]  # noqa: E731
    assert sizes(iteration.micro_batches([a, b, c], 16, shared=True)) == [[id(a), id(b)], [id(c)]]  # 8 + 8 = 16
    assert sizes(iteration.micro_batches([a, b, c], 24, shared=False)) == [[id(a), id(b)], [id(c)]]  # 12 + 12
    assert sizes(iteration.micro_batches([a, b, c], 16, shared=False)) == [[id(a)], [id(b)], [id(c)]]
    assert sizes(iteration.micro_batches([a, b], 5, shared=True)) == [[id(a)], [id(b)]]  # over budget: alone


def test_a_failed_checkpoint_write_leaves_the_session_at_the_promoted_version(tmp_path, monkeypatch, tiny_hf):
    """Without shared weights the promote task writes and promotes the checkpoint itself: if that fails, the
    session stays at the promoted version (the flow then marks the iteration failed; resume restarts it)."""
    from flows.train import _fail_iteration

    s = _session(tmp_path, monkeypatch, ["pipeline.push_weights=false"], version=1)
    s.trainer = SimpleNamespace(model=tiny_hf.model, optimizer=None)
    s.tokenizer, s.weights = tiny_hf.tokenizer, None
    ledger.write_record(s.lake, RUN, 1, ("planned", "rolling_out", "trained"))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "save_checkpoint", disk_full)
    with pytest.raises(OSError, match="No space left") as error:
        iteration.promote_task.fn(RUN, 1)
    assert s.version == 1
    _fail_iteration(s, 1, error.value)
    assert ledger.read_record(s.lake, RUN, 1)["state"] == "failed"


def _audit_session(monkeypatch, saving) -> tuple[SimpleNamespace, list]:
    s = SimpleNamespace(
        saving=saving,
        cfg=SimpleNamespace(pipeline=SimpleNamespace(catalog=True), tracking=SimpleNamespace(prefect_artifacts=False)),
    )
    monkeypatch.setitem(session_module.SESSIONS, RUN, s)
    cataloged: list = []
    monkeypatch.setattr(iteration, "catalog_iteration", lambda run_id, k, v: cataloged.append((k, v, saving[1].done())))
    return s, cataloged


def test_the_audit_waits_for_the_checkpoint_of_its_own_version(monkeypatch):
    """The audit annotates the iteration's ledger record, which the background write of its version finalises: it
    waits for that write (here completed only once waited for) before cataloging."""
    write: concurrent.futures.Future = concurrent.futures.Future()
    _, cataloged = _audit_session(monkeypatch, (3, write))
    real_wait = concurrent.futures.wait

    def wait_and_finish(fs, *args, **kwargs):
        if write in fs and not write.done():
            write.set_result(None)
        return real_wait(fs, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "wait", wait_and_finish)
    safety = threading.Timer(10, lambda: write.done() or write.set_result(None))  # never hang the suite
    safety.start()
    try:
        iteration.audit_task.fn(RUN, 2, 3, {})
    finally:
        safety.cancel()
    assert cataloged == [(2, 3, True)]


def test_the_audit_skips_an_iteration_whose_checkpoint_failed(monkeypatch):
    """A failed background write means the version was not promoted: its iteration is not cataloged (the flow raises
    the write's error; resume retrains the iteration)."""
    write: concurrent.futures.Future = concurrent.futures.Future()
    write.set_exception(OSError("disk full"))
    _, cataloged = _audit_session(monkeypatch, (3, write))
    iteration.audit_task.fn(RUN, 2, 3, {})
    assert cataloged == []


def _promoted_with_shards(s, k: int) -> None:
    """Iteration `k` of run RUN promoted, with two published shards of two groups each in its ledger record."""
    import pyarrow.ipc as ipc

    shards = []
    for index in (0, 1):
        chunk = SimpleNamespace(iteration=k, index=index, prompt_ids=[2 * index, 2 * index + 1])
        path = _publish(s, chunk, k)
        with s.lake.fs.open(path, "rb") as f:
            checksum = ipc.open_file(f).schema.metadata[b"lockstep.sha256"].decode()
        shards.append({"path": path, "checksum": checksum, "groups": 2})
    ledger.write_record(
        s.lake, RUN, k, ("planned", "rolling_out", "trained", "promoted"), shards=shards, promoted_version=k + 1
    )


def test_a_new_iteration_is_appended_to_the_catalog_and_one_it_may_hold_is_merged(tmp_path, monkeypatch):
    """The first write of a session reads the catalog's last iteration; later iterations are appended (no row of
    theirs can be there), the others merged on their ids. A session that trains again an iteration the catalog
    holds (its promotion undone by hand, then resumed) leaves each sample once; appended, it would hold it twice."""
    from storage import catalog

    s = _session(tmp_path, monkeypatch)
    s.catalog_last = None
    appends = []
    write = catalog.write_iteration
    monkeypatch.setattr(
        catalog, "write_iteration", lambda *a, append, **kw: appends.append(append) or write(*a, append=append, **kw)
    )
    for k in (0, 1):
        _promoted_with_shards(s, k)
        assert iteration.catalog_iteration(RUN, k, k + 1) == 8
    s.catalog_last = None  # the resumed session: iteration 1 trained again, then iteration 2
    for k in (1, 2):
        if k == 2:
            _promoted_with_shards(s, k)
        iteration.catalog_iteration(RUN, k, k + 1)
    uri = catalog.catalog_uri(s.lake, RUN)
    ids = [r["sample_id"] for r in catalog.query(uri).to_pylist()]
    assert len(ids) == len(set(ids)) == 3 * 8
    assert appends == [True, True, False, True] and s.catalog_last == 1
    assert len(catalog.query(uri, catalog.SHARDS)) == 3 * 2
    assert [ledger.read_record(s.lake, RUN, k).get("cataloged") for k in range(3)] == [True] * 3


def _done(result=None, error: Exception | None = None) -> SimpleNamespace:
    """A finished rollout task's future (the two members the train task uses)."""
    wrapped: concurrent.futures.Future = concurrent.futures.Future()
    wrapped.set_result(None)

    def get():
        if error is not None:
            raise error
        return result

    return SimpleNamespace(wrapped_future=wrapped, result=get)


def _waiting_trainer(s, rollouts, monkeypatch) -> list[int]:
    """The session's trainer replaced by one that records the prompts it micro-steps on; live workers; the train
    task's torch thread settings undone after the test."""
    trained: list[int] = []
    s.trainer = SimpleNamespace(
        set_lr_factor=lambda factor: None,
        optimizer_step=lambda: {"train/tokens": 1.0},
        micro_step=lambda mb, version, behavior_old: trained.extend(g.prompt_id for g in mb),
    )
    s.pool.alive = lambda: True
    s.wait_saved = lambda: None
    s.rollouts = rollouts
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    return trained


def test_groups_that_never_land_after_the_rollouts_finished_fail_the_train_task(tmp_path, monkeypatch):
    """Periodic: every rollout task has returned and no shard of the iteration is in the lake: the train task raises
    at once, naming the iteration, the missing groups and where it looked, instead of waiting for good."""
    s = _session(tmp_path, monkeypatch, version=1)
    _waiting_trainer(s, [_done({"shards": []}), _done({"shards": []})], monkeypatch)
    where = re.escape(s.lake.iteration_rollouts(RUN, 1, 1))
    with pytest.raises(
        iteration.RolloutsLostError,
        match=rf"^iteration 1: the rollout workers finished, but 8 of its "
        rf"groups are not in {where} \(0 shards read\)",
    ):
        iteration.train_task.fn(RUN, 1, 8, 0.0)


def test_shards_listed_just_after_the_rollouts_finished_are_still_trained(tmp_path, monkeypatch):
    """The last shards can land between the train task's empty listing and its look at the finished rollout tasks:
    it lists once more before giving up, and trains every group of the plan."""
    s = _session(tmp_path, monkeypatch, version=1)
    iteration.plan_task.fn(RUN, 1)
    for chunk in s.pool.enqueued[0]:
        _publish(s, chunk, 1)
    trained = _waiting_trainer(s, [_done({"shards": []})], monkeypatch)
    real, calls = iteration.list_shards, []

    def late(*args):  # the first listing comes just before the shards land
        calls.append(args)
        return [] if len(calls) == 1 else real(*args)

    monkeypatch.setattr(iteration, "list_shards", late)
    iteration.train_task.fn(RUN, 1, 8, 0.0)
    assert sorted(trained) == sorted(iteration_prompt_ids(s.cfg, N_TRAIN, 1)) and len(calls) >= 2
    assert ledger.read_record(s.lake, RUN, 1)["state"] == "trained"


def test_dynamic_sampling_plans_the_next_round_before_training_what_landed(tmp_path, monkeypatch):
    """The train task decides on every landed group, plans the next round (the missing groups over the share kept, in
    whole chunks) and only then micro-steps: the workers never wait for that training. The batch is the first 8 kept
    groups in plan order; then the stop markers."""
    s = _session(tmp_path, monkeypatch, ["algorithm.dynamic_sampling=true"], version=1)
    iteration.plan_task.fn(RUN, 1)
    first = iteration_prompt_ids(s.cfg, N_TRAIN, 1)
    signal = lambda p, j: float(j) if p not in first[-2:] else 1.0  # noqa: E731 - the last 2 of round 0 equal
    for chunk in s.pool.enqueued[0]:
        _publish(s, chunk, 1, signal)
    events: list = []
    trained = _waiting_trainer(s, [], monkeypatch)
    step = s.trainer.micro_step
    s.trainer.micro_step = lambda mb, version, behavior_old: events.append("train") or step(mb, version, behavior_old)

    def enqueue(chunks, last=True):  # a worker publishes a round's chunks at once, every group with signal
        events.append(("enqueue", [c.prompt_ids for c in chunks], last))
        for c in chunks:
            _publish(s, c, 1, lambda p, j: float(j))

    monkeypatch.setattr(s.pool, "enqueue", enqueue)
    figures = iteration.train_task.fn(RUN, 1, 8, 0.0)
    rec = ledger.read_record(s.lake, RUN, 1)
    second = rec["prompt_ids"][8:]
    assert rec["rounds"] == [8, 3]  # 2 missing x 8 planned / 6 kept = 2.7 -> 3, one chunk of 3
    assert events[0] == ("enqueue", [tuple(second)], False) and events[1] == "train"  # planned before any training
    stop = events.index(("enqueue", [], True))  # the stop markers once round 1 is in, before it trains
    assert events[stop + 1 :] and set(events[stop + 1 :]) == {"train"} and events.count(("enqueue", [], True)) == 1
    assert trained == first[:6] + second[:2]  # round 0's kept groups as they landed, then round 1's first two
    assert rec["dynamic_sampling"] == {
        "trained": first[:6] + second[:2],
        "dropped": first[6:],
        "surplus": second[2:],
        "fallback": False,
    }
    assert (figures["filter/kept_groups"], figures["filter/rounds"], figures["filter/surplus_groups"]) == (8, 2, 1)


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed-pool"])
def test_a_train_task_failing_before_its_loop_releases_the_workers_waiting_for_a_round(tmp_path, monkeypatch, closed):
    """Dynamic sampling leaves the workers waiting at their queue: a train task failing anywhere (here reading its
    plan) puts their stop markers; a pool closed meanwhile does not hide the task's own error."""
    s = _session(tmp_path, monkeypatch, ["algorithm.dynamic_sampling=true"], version=1)
    iteration.plan_task.fn(RUN, 1)
    _waiting_trainer(s, [], monkeypatch)
    stops = []

    def enqueue(chunks, last=True):
        stops.append((list(chunks), last))
        if closed:
            raise ValueError("the rollout worker pool is closed")

    monkeypatch.setattr(s.pool, "enqueue", enqueue)

    def unreadable(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(iteration.ledger, "read_record", unreadable)
    with pytest.raises(OSError, match="Input/output error"):
        iteration.train_task.fn(RUN, 1, 8, 0.0)
    assert stops == [([], True)]


def test_a_failed_rollout_task_fails_the_train_task_with_its_own_error(tmp_path, monkeypatch):
    """A rollout task that raised while its worker process lives on: its error ends the train task's wait."""
    s = _session(tmp_path, monkeypatch, version=1)
    _waiting_trainer(s, [_done({"shards": []}), _done(error=OSError(28, "No space left on device"))], monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        iteration.train_task.fn(RUN, 1, 8, 0.0)


def test_the_flow_hands_the_rollout_tasks_to_the_train_task(monkeypatch):
    """Periodic: the iteration's rollout futures are in the session while the train task runs (its only way to know
    the workers are done) and gone after it, also when it fails."""
    from flows import train as flow

    cfg = load_config(None, ["pipeline.mode=periodic", "resources.rollout_workers=2"])
    s = SimpleNamespace(
        run_id=RUN, cfg=cfg, storage_s=0.0, tracker=SimpleNamespace(seconds=0.0), rollouts=[], release=lambda: None
    )
    submitted = [object(), object()]
    seen: list = []
    monkeypatch.setattr(flow, "plan_task", lambda run_id, k: {"body_s": 0.0, "groups": 8})
    monkeypatch.setattr(flow, "rollout_task", SimpleNamespace(submit=lambda run_id, k, w: submitted[w]))

    def train(run_id, k, groups, t0):
        seen.append(list(s.rollouts))
        raise RuntimeError("stop here")

    monkeypatch.setattr(flow, "train_task", train)
    with pytest.raises(RuntimeError, match="stop here"):
        flow._iteration(s, 0)
    assert seen == [submitted] and s.rollouts == []
