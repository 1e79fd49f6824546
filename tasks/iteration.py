"""The Prefect tasks of one iteration: plan -> rollout x N (concurrent) || train (streaming) -> promote -> audit.

Each task takes the run id and small values, reaches the live objects through `tasks.session.session(run_id)`,
and returns small values (paths, figures), never tensors. Caching is off on purpose: these tasks act on
live in-memory state, and what a resume may skip is decided by the ledger in the lake, not by Prefect's cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from models.objectives import dynamic_sampling_keep
from models.trainer import RolloutGroup, group_tokens, lr_factor, shaped_rewards
from storage import checkpoints, faults, ledger
from storage.shards import ShardError, read_shard
from tasks.session import evaluate, iteration_prompt_ids, loss_settings, refill_prompt_ids, session
from tasks.workers import Chunk, PoolClosed, WorkerError

POLL_S = 0.01


@task(name="plan", cache_policy=NO_CACHE)
def plan_task(run_id: str, iteration: int) -> dict:
    """Choose the iteration's prompts, cut them into chunks, put them on the workers' queue."""
    s = session(run_id)
    t0 = time.perf_counter()
    previous = ledger.read_record(s.lake, run_id, iteration)
    # a resumed iteration keeps the plan it was started with (its published shards were cut from it)
    prompt_ids = (previous or {}).get("prompt_ids") or iteration_prompt_ids(s.cfg, len(s.train_prompts), iteration)
    # dynamic sampling's rounds planned so far (each cut into chunks of its own); one round without it
    rounds = (previous or {}).get("rounds") or [len(prompt_ids)]
    chunks, start = [], 0
    for size in rounds:
        chunks += cut_chunks(s, iteration, prompt_ids[start : start + size], len(chunks))
        start += size
    reused: list[int] = []
    quarantined: list[str] = []
    if previous is not None:  # a resumed iteration: keep every complete, valid shard of its own version
        if previous["state"] != "failed":
            ledger.write_record(s.lake, run_id, iteration, "failed", reason="interrupted before promotion; resumed")
        reused, quarantined = _valid_chunks(s, run_id, iteration)
        chunks = [c for c in chunks if c.index not in reused]
    # planned and rolling out in one write, before any chunk reaches a worker: the plan is durable before a shard of
    # it can be, and a crash before the enqueue leaves an interrupted iteration that resume replans like any other
    ledger.write_record(
        s.lake,
        run_id,
        iteration,
        ("planned", "rolling_out"),
        policy_version=iteration,
        planned_at_version=s.version,
        prompt_ids=prompt_ids,
        rounds=rounds,
        chunks=len(chunks) + len(reused),
        reused_chunks=reused,
        quarantined=quarantined,
        group_size=s.cfg.rollout.group_size,
    )
    s.pool.enqueue(chunks, last=not s.cfg.algorithm.dynamic_sampling)  # dynamic sampling: the train task ends it
    faults.point("after-plan")
    body = time.perf_counter() - t0
    s.storage_s += body
    return {"groups": len(prompt_ids), "chunks": len(chunks), "version": s.version, "body_s": body}


def cut_chunks(s, iteration: int, prompt_ids: list[int], first: int) -> list[Chunk]:
    """The workers' chunks of `prompt_ids` (`pipeline.shard_groups` prompts each), numbered from `first`."""
    k = s.cfg.pipeline.shard_groups
    return [
        Chunk(iteration, s.version, first + i // k, tuple(prompt_ids[i : i + k])) for i in range(0, len(prompt_ids), k)
    ]


def plan_round(s, run_id: str, iteration: int, count: int) -> list[int]:
    """Dynamic sampling: plan the iteration's next round of `count` prompts (`tasks.session.refill_prompt_ids`),
    record it in the ledger, then put its chunks on the workers' queue; returns its prompt ids (none once the prompts
    ran out)."""
    rec = ledger.read_record(s.lake, run_id, iteration)
    taken, rounds = rec["prompt_ids"], rec.get("rounds") or [len(rec["prompt_ids"])]
    new = refill_prompt_ids(len(s.train_prompts), s.cfg.run.seed, iteration, len(rounds), taken, count)
    if new:
        chunks = cut_chunks(s, iteration, new, rec["chunks"])
        # durable before any of its shards can be: a resume plans the rounds the ledger holds
        ledger.annotate(
            s.lake,
            run_id,
            iteration,
            prompt_ids=taken + new,
            rounds=[*rounds, len(new)],
            chunks=rec["chunks"] + len(chunks),
        )
        s.pool.enqueue(chunks, last=False)
    return new


def list_shards(s, run_id: str, iteration: int) -> list[str]:
    """The shard paths of an iteration published so far (the watcher's listing; caches invalidated first).

    Sync / periodic: every shard of iteration k is under policy_version=k. Async: a chunk of batch k starts on a
    version in [k - max_staleness, k] (admission control), so exactly those folders are listed."""
    fs = s.lake.fs
    S = s.cfg.pipeline.max_staleness if s.cfg.pipeline.mode == "async" else 0
    paths = []
    for v in range(max(0, iteration - S), iteration + 1):
        prefix = s.lake.iteration_rollouts(run_id, v, iteration)
        fs.invalidate_cache(prefix)
        try:  # one listing (an exists first cost an object store a request per poll)
            paths.extend(p for p in fs.ls(prefix, detail=False) if p.endswith(".arrow"))
        except FileNotFoundError:  # nothing published under it yet
            pass
    return sorted(paths)


def chunk_index(path: str) -> int:
    """The chunk a shard holds, from its name (`shard-{worker}-{chunk:05d}.arrow`)."""
    return int(path.rsplit("-", 1)[-1].split(".")[0])


def _valid_chunks(s, run_id: str, iteration: int) -> tuple[list[int], list[str]]:
    """Chunk indices whose shard exists and passes its checksum; damaged shards are moved to quarantine/."""
    fs = s.lake.fs
    valid, quarantined = [], []
    folder = None
    for path in list_shards(s, run_id, iteration):
        try:
            read_shard(s.lake, path)
            valid.append(chunk_index(path))
        except ShardError:
            folder = folder or s.lake.quarantine_dir(run_id, f"iter-{iteration:06d}")
            dest = f"{folder}/{path.rsplit('/', 1)[-1]}"
            s.lake.makedirs(folder)
            fs.mv(path, dest)
            quarantined.append(dest)
    return valid, quarantined


@task(name="rollout", cache_policy=NO_CACHE)
def rollout_task(run_id: str, iteration: int, worker: int) -> dict:
    """One rollout worker drains the iteration's chunk queue; returns its shards and busy time."""
    s = session(run_id)
    a = s.cfg.algorithm
    timeout_s = 3600.0 * (a.dynamic_sampling_rounds if a.dynamic_sampling else 1)  # (per round of prompts)
    return _unless_closed(lambda: s.pool.run(worker, s.version, s.weights_source(), timeout_s))


def _unless_closed(wait_for_worker):
    """What `wait_for_worker` returns, or, where the run ended while it waited (the pool closed by a stop or by
    another task's failure), a Cancelled state: one line in the run's log instead of a closed queue's traceback."""
    from prefect.states import Cancelled

    try:
        return wait_for_worker()
    except PoolClosed as e:
        return Cancelled(message=str(e))


@task(name="rollout-serve", cache_policy=NO_CACHE)
def serve_task(run_id: str, worker: int) -> dict:
    """Async mode: one rollout worker generates the planned chunks continuously for the whole run, under
    admission control (`pipeline.max_staleness`), loading each promoted version as it is announced."""
    s = session(run_id)
    c = s.cfg
    return _unless_closed(
        lambda: s.pool.serve(
            worker,
            s.version,
            s.lake.checkpoint_dir(run_id, s.version),
            c.pipeline.max_staleness,
            c.rollout.interrupt_on_update,
            on_shard=lambda info: s.shard_info.__setitem__(info["path"], info),
        )
    )


def groups_of(table, group_size: int | None = None) -> list[RolloutGroup]:
    """The shard's rows as whole groups, in row order; a shard holding part of a group is refused."""
    groups: dict[str, RolloutGroup] = {}
    # column by column: the trainer's columns only, without building a record per row (3x faster per shard)
    cols = [
        table.column(name).to_pylist()
        for name in (
            "group_id",
            "prompt_id",
            "prompt_ids",
            "response_ids",
            "reward",
            "behavior_logprobs",
            "token_versions",
        )
    ]
    for gid, prompt_id, prompt_ids, response_ids, reward, logprobs, versions in zip(*cols):
        g = groups.get(gid)
        if g is None:
            g = groups[gid] = RolloutGroup(prompt_ids, [], [], [], [], prompt_id=prompt_id)
        g.responses.append(response_ids)
        g.rewards.append(reward)
        g.behavior_logprobs.append(logprobs)
        g.token_versions.append(versions)
    if group_size is not None:
        partial = {gid: len(g.responses) for gid, g in groups.items() if len(g.responses) != group_size}
        if partial:
            raise ShardError(f"shard holds partial groups (group id: samples, expected {group_size}): {partial}")
    return list(groups.values())


def token_staleness(path: str, groups: list[RolloutGroup], version: int, max_staleness: int) -> list[int]:
    """How many versions each token of a shard's groups is behind the trainer's `version`. A token more than
    `max_staleness` behind, or ahead of the trainer, raises `ShardError`: admission control (the workers') or the
    version bookkeeping failed, and training on it would break the staleness bound silently."""
    staleness = [version - v for g in groups for tv in g.token_versions for v in tv]
    if staleness and not 0 <= min(staleness) <= max(staleness) <= max_staleness:
        raise ShardError(
            f"{path}: tokens {max(staleness)} versions behind the trainer's {version} (bound "
            f"{max_staleness}) or {max(0, -min(staleness))} ahead of it: admission control or version "
            "bookkeeping failed"
        )
    return staleness


def micro_batches(groups: list[RolloutGroup], budget: int, shared: bool) -> list[list[RolloutGroup]]:
    """Greedy packing of whole groups under a token budget (a group larger than the budget goes alone)."""
    out: list[list[RolloutGroup]] = []
    cur: list[RolloutGroup] = []
    used = 0
    for g in groups:
        cost = group_tokens(g, shared)
        if cur and used + cost > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(g)
        used += cost
    if cur:
        out.append(cur)
    return out


# figures of a batch's optimizer steps that add up; the others are averaged over the steps (is_weight/max: maximum),
# per sample those of `_PER_SAMPLE`, per token the rest
_PER_SAMPLE = ("reward/overlong_penalty", "reward/overlong_fraction")
_SUMMED = (
    "train/tokens",
    "train/samples",
    "train/micro_batches",
    "train/shared_fallbacks",
    "adv/zero_groups",
    "train/skipped_groups",
    "train/skipped_tokens",
    "time/prox_s",
)


class KeptGroups:
    """Dynamic sampling's batch (`algorithm.dynamic_sampling`, DAPO): of the groups planned, round after round and in
    plan order, the first `size` whose rewards are not all equal (`models.objectives.dynamic_sampling_keep`).

    Fed whole groups in any order of arrival, `add` returns those decided into the batch with their positions in it,
    so the batch does not depend on the order in which shards land. A group is decided once every group planned
    before it has landed; a kept group of the first round is returned at once when positions are not needed
    (`ordered` false: one optimizer step), since the first round plans at most `size` groups, all of whose kept ones
    are in the batch. With `defer` (sync mode: nothing trains while rollouts run) nothing is returned before `close`.
    """

    def __init__(self, size: int, atol: float, ordered: bool, defer: bool):
        self.size, self.atol, self.ordered, self.defer = size, atol, ordered, defer
        self.plan: list[int] = []
        self.position: dict[int, int] = {}  # prompt id -> plan position
        self.first_round = 0
        self.rounds = 0
        self.landed: dict[int, tuple[RolloutGroup, bool]] = {}  # landed and not yet decided, with `_signal`'s answer
        self.decided = 0  # plan positions decided
        self.kept: list[int] = []  # the batch's prompt ids, in batch order
        self.dropped: list[int] = []  # rewards all equal
        self.surplus: list[int] = []  # kept, past the batch's end
        self.released: set[int] = set()
        self.held: list[tuple[RolloutGroup, int | None]] = []  # decided, waiting for `close` (defer)
        self.first_dropped: list[RolloutGroup] = []  # the fallback batch of a batch that kept none
        self.fallback = False

    def add_round(self, prompt_ids: list[int]) -> None:
        if not self.plan:
            self.first_round = len(prompt_ids)
        for pid in prompt_ids:
            if pid in self.position:
                raise ValueError(f"prompt {pid} planned twice in one batch")
            self.position[pid] = len(self.plan)
            self.plan.append(pid)
        self.rounds += 1

    def _signal(self, g: RolloutGroup) -> bool:
        keep, _ = dynamic_sampling_keep(torch.tensor([g.rewards], dtype=torch.float64), self.atol)
        return bool(keep[0])

    def add(self, groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], list[int | None]]:
        out: list[tuple[RolloutGroup, int | None]] = []
        for g in groups:
            if g.prompt_id not in self.position:
                raise ShardError(f"a group of prompt {g.prompt_id} is not in this batch's plan")
            if g.prompt_id in self.landed or self.position[g.prompt_id] < self.decided:
                raise ShardError(f"a second group of prompt {g.prompt_id} in one batch")
            signal = self._signal(g)
            self.landed[g.prompt_id] = (g, signal)
            early = not self.ordered and self.position[g.prompt_id] < self.first_round
            if early and signal:
                out.append((g, None))
                self.released.add(g.prompt_id)
        while self.decided < len(self.plan) and self.plan[self.decided] in self.landed:
            pid = self.plan[self.decided]
            g, signal = self.landed.pop(pid)
            if not signal:
                self.dropped.append(pid)
                if self.decided < self.first_round:
                    self.first_dropped.append(g)
            elif len(self.kept) < self.size:
                if pid not in self.released:
                    out.append((g, len(self.kept)))
                self.kept.append(pid)
            else:
                self.surplus.append(pid)
            self.decided += 1
        if self.defer:
            self.held += out
            out = []
        return [g for g, _ in out], [p for _, p in out]

    @property
    def complete(self) -> bool:
        """Every planned group has landed (and is decided)."""
        return self.decided == len(self.plan)

    @property
    def short(self) -> bool:
        return len(self.kept) < self.size

    def refill(self, multiple: int) -> int:
        """The next round's prompt count: the groups still missing over the share kept so far (all planned groups are
        decided), rounded up to a whole number of `multiple` (the workers' chunks), at most the batch; the batch where
        none was kept."""
        missing = self.size - len(self.kept)
        if not self.kept:
            return self.size
        expected = -(-missing * len(self.plan) // len(self.kept))
        return min(self.size, -(-expected // multiple) * multiple)

    def close(self) -> tuple[list[RolloutGroup], list[int | None]]:
        """No more rounds: what is left to train (held groups; the first round's, in plan order, if none was kept)."""
        if not self.complete:
            missing = len(self.plan) - self.decided - len(self.landed)
            raise RuntimeError(f"batch incomplete: {missing} planned groups not landed")
        out, self.held = self.held, []
        if not self.kept:
            self.fallback = True
            out = [(g, i) for i, g in enumerate(self.first_dropped)]
        return [g for g, _ in out], [p for _, p in out]

    @property
    def batch_groups(self) -> int:
        return len(self.first_dropped) if self.fallback else len(self.kept)

    def figures(self) -> dict[str, float]:
        return {
            "filter/kept_groups": float(len(self.kept)),
            "filter/dropped_groups": float(len(self.dropped)),
            "filter/surplus_groups": float(len(self.surplus)),
            "filter/rounds": float(self.rounds),
            "filter/fallback": float(self.fallback),
        }

    def decisions(self) -> dict:
        """For the ledger (the catalog's record of what was trained)."""
        trained = self.plan[: self.first_round] if self.fallback else self.kept
        return {"trained": list(trained), "dropped": self.dropped, "surplus": self.surplus, "fallback": self.fallback}


class BatchSteps:
    """A batch's optimizer steps, fed whole groups in any order of arrival.

    With `algorithm.ppo_mini_batches: M`, mini-batch m is the groups at plan positions [m B/M, (m+1) B/M). The
    groups of the current mini-batch are micro-stepped as they arrive; a group of a later one waits in memory until
    every earlier mini-batch has had its step. So the steps do not depend on the order in which shards land (the
    periodic-equals-sync invariant), and M = 1 is the streaming single step of DESIGN.md (the plan is not read).
    Creating it sets the trainer's learning rate to the schedule's rate for this batch (`version`). `before_step` is
    called before each optimizer step (the train task waits there for a checkpoint written from the live tensors).

    With `algorithm.dynamic_sampling` the groups go through `KeptGroups` first: `plan` holds every round's prompt ids
    and `rounds` their counts (`add_round` plans one more), a group's mini-batch is its place among the kept groups,
    and a batch that kept fewer than `rollout.prompts_per_iteration` groups takes fewer steps."""

    def __init__(self, trainer, cfg, plan: list[int], version: int, before_step=None, rounds: list[int] | None = None):
        self.trainer, self.version = trainer, version
        self.before_step = before_step or (lambda: None)
        t = cfg.trainer
        trainer.set_lr_factor(
            lr_factor(version, cfg.run.iterations, kind=t.lr_schedule, warmup=t.warmup_steps, min_ratio=t.min_lr_ratio)
        )
        self.budget, self.shared = cfg.train.micro_batch_tokens, cfg.train.shared_prompt
        a = cfg.algorithm
        self.m = a.ppo_mini_batches
        self.sampling = None
        self.max_rounds, self.chunk = a.dynamic_sampling_rounds, cfg.pipeline.shard_groups
        if a.dynamic_sampling:
            B = cfg.rollout.prompts_per_iteration
            self.sampling = KeptGroups(
                B, a.dynamic_sampling_atol, ordered=self.m > 1, defer=cfg.pipeline.mode == "sync"
            )
            start = 0
            for size in rounds or [len(plan)]:
                self.sampling.add_round(plan[start : start + size])
                start += size
            plan = []  # positions come from the kept groups' order
        else:
            B = len(plan)
        self.size = B // self.m
        self.position = {pid: i for i, pid in enumerate(plan)} if self.m > 1 else {}
        self.waiting: list[list[RolloutGroup]] = [[] for _ in range(self.m)]
        self.done = [0] * self.m
        self.current = 0
        self.seen: set[int] = set()
        self.steps: list[dict] = []

    def add_round(self, prompt_ids: list[int]) -> None:
        """Dynamic sampling: another round of prompts is planned."""
        self.sampling.add_round(prompt_ids)

    def next_round(self) -> int:
        """Dynamic sampling, once every planned group has landed: the prompts of the round to plan next (`KeptGroups.
        refill`), or 0: the batch is full, or its rounds are spent."""
        k = self.sampling
        if k is None or not (k.complete and k.short and k.rounds < self.max_rounds):
            return 0
        return k.refill(self.chunk)

    def add(self, groups: list[RolloutGroup]) -> None:
        self.train(*self.admit(groups))

    def admit(self, groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], list[int | None]]:
        """The groups to train now, with their places in the batch (None: by the plan): with dynamic sampling those
        `KeptGroups` releases (it decides on every group it is given), all of them otherwise."""
        if self.sampling is None:
            return groups, [None] * len(groups)
        return self.sampling.add(groups)

    def train(self, groups: list[RolloutGroup], positions: list[int | None]) -> None:
        """Micro-step on admitted groups; an optimizer step for each mini-batch they complete."""
        for g, position in zip(groups, positions, strict=True):
            if self.m == 1:
                self.waiting[0].append(g)
                continue
            if position is None:
                if g.prompt_id not in self.position:
                    raise ShardError(f"a group of prompt {g.prompt_id} is not in this batch's plan")
                if g.prompt_id in self.seen:
                    raise ShardError(f"a second group of prompt {g.prompt_id} in one batch")
                self.seen.add(g.prompt_id)
                position = self.position[g.prompt_id]
            self.waiting[position // self.size].append(g)
        while True:
            ready, self.waiting[self.current] = self.waiting[self.current], []
            for mb in micro_batches(ready, self.budget, self.shared):
                self.trainer.micro_step(mb, self.version, behavior_old=self.current > 0)
                faults.point("mid-train", iteration=self.version)  # version k is iteration k's batch
            self.done[self.current] += len(ready)
            if self.current == self.m - 1 or self.done[self.current] < self.size:
                return
            self.before_step()
            self.steps.append(self.trainer.optimizer_step())
            self.current += 1

    def finish(self) -> dict[str, float]:
        """The last step; the batch's figures (summed or averaged over its steps)."""
        total = self.size * self.m
        if self.sampling is not None:
            self.train(*self.sampling.close())
            total = self.sampling.batch_groups
        stepped = False  # a short batch (dynamic sampling) whose last mini-batch was full: stepped already
        if self.m > 1:
            expected = [min(self.size, max(0, total - i * self.size)) for i in range(self.m)]
            last = max(0, -(-total // self.size) - 1)  # the mini-batch of the batch's last group
            stepped = self.current > last
            if self.current != last + stepped or self.done != expected:
                raise RuntimeError(
                    f"batch incomplete: mini-batch {self.current} of {self.m}, groups per mini-batch "
                    f"{self.done} (expected {expected})"
                )
        if not stepped:
            self.before_step()
            self.steps.append(self.trainer.optimizer_step())
        figures = self._figures()
        if self.sampling is not None:
            figures.update(self.sampling.figures())
        return figures

    def _figures(self) -> dict[str, float]:
        if len(self.steps) == 1:
            return dict(self.steps[0])
        out = {}
        for key in dict.fromkeys(k for f in self.steps for k in f):  # a step that trained no token lacks some figures
            steps = [f for f in self.steps if key in f]
            values = [f[key] for f in steps]
            if key in _SUMMED:
                out[key] = sum(values)
            elif key == "is_weight/max":
                out[key] = max(values)
            elif key in _PER_SAMPLE:  # every sample's, skipped groups' too: a step of those alone counts as much
                samples = [f["train/samples"] for f in steps]
                out[key] = sum(v * n for v, n in zip(values, samples)) / sum(samples)
            else:  # token-weighted, like the figures of one step; evenly where no step trained a token (a batch
                # of groups with zero advantage only: its train/lr is the rate it stepped at, not 0)
                tokens = [f["train/tokens"] for f in steps]
                weights = tokens if sum(tokens) > 0 else [1.0] * len(steps)
                out[key] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
        # after the first step the policy has moved: logp - behaviour there is training, not engine mismatch (none
        # when the first step trained no token)
        out.pop("mismatch/logp_abs", None)
        if "mismatch/logp_abs" in self.steps[0]:
            out["mismatch/logp_abs"] = self.steps[0]["mismatch/logp_abs"]
        out["train/optimizer_steps"] = float(len(self.steps))
        return out


def idle_rollout_threads(cfg) -> int:
    """The trainer's torch threads once the iteration's rollouts are all published (`resources.borrow_rollout_threads`):
    its own plus the idle workers', at most the CPU count less the other trainer ranks' threads; its own alone in async
    mode, whose workers never idle."""
    r = cfg.resources
    if not r.borrow_rollout_threads or cfg.pipeline.mode == "async":
        return r.train_threads
    others = (r.train_ranks - 1) * r.train_threads  # ranks 1.. keep their own threads
    total = r.train_ranks * r.train_threads + r.rollout_workers * r.rollout_threads
    return max(r.train_threads, min(os.cpu_count() or 1, total) - others)


class RolloutsLostError(RuntimeError):
    """Every rollout worker finished the iteration, yet some of its groups never landed in the lake."""


def _check_rollouts_finished(s, run_id: str, iteration: int, seen: set[str], missing: int) -> None:
    """Sync/periodic: the rollout tasks have all returned, so every shard of the iteration is published. A task
    that failed raises its error; shards listed since the last look are left to the caller; otherwise the missing
    groups will never come, and waiting for them would hang the run."""
    for f in s.rollouts:
        f.result()  # raises the task's error
    if any(p not in seen for p in list_shards(s, run_id, iteration)):
        return
    where = s.lake.iteration_rollouts(run_id, s.version, iteration)
    raise RolloutsLostError(
        f"iteration {iteration}: the rollout workers finished, but {missing} of its groups are "
        f"not in {where} ({len(seen)} shards read): a shard was removed or written elsewhere; "
        "`lockstep resume` regenerates the missing chunks"
    )


@task(name="train", cache_policy=NO_CACHE)
def train_task(run_id: str, iteration: int, expected_groups: int, started_at: float) -> dict:
    """Stream the iteration's shards as they land, micro-step on each, one optimizer step at the end (one per PPO
    mini-batch with `algorithm.ppo_mini_batches` > 1). With `algorithm.dynamic_sampling`, once every planned group
    has landed it plans the next round (`plan_round`) while the batch is short, or ends the workers' iteration."""
    s = session(run_id)
    t_task = time.perf_counter()
    max_staleness = s.cfg.pipeline.max_staleness if s.cfg.pipeline.mode == "async" else 0
    seen: set[str] = set()
    shards: list[dict] = []
    groups_done = 0
    busy = wait = storage = 0.0
    first_shard_s = None
    rewards: list[float] = []
    staleness: list[int] = []
    plan: list[int] = []
    rounds = None
    rounds_open = s.cfg.algorithm.dynamic_sampling  # the workers wait at their queue for another round, or its end
    try:
        if s.cfg.algorithm.ppo_mini_batches > 1 or rounds_open:  # mini-batches, kept groups: by the recorded plan
            t_plan = time.perf_counter()
            rec = ledger.read_record(s.lake, run_id, iteration)
            plan, rounds = rec["prompt_ids"], rec.get("rounds")
            storage += time.perf_counter() - t_plan
        steps = BatchSteps(s.trainer, s.cfg, plan, s.version, before_step=s.wait_saved, rounds=rounds)
        torch.set_num_threads(s.cfg.resources.train_threads)  # the workers generate this iteration's rollouts
        while groups_done < expected_groups:
            t0 = time.perf_counter()
            new = [p for p in list_shards(s, run_id, iteration) if p not in seen]
            if not new:
                if not s.pool.alive():
                    raise WorkerError(s.pool.failure())
                if s.rollouts and all(f.wrapped_future.done() for f in s.rollouts):
                    _check_rollouts_finished(s, run_id, iteration, seen, expected_groups - groups_done)
                    continue
                time.sleep(POLL_S)
                wait += time.perf_counter() - t0
                continue
            if first_shard_s is None:
                first_shard_s = time.perf_counter() - started_at
            t1 = time.perf_counter()
            landed = []
            for path in new:
                seen.add(path)
                table = read_shard(s.lake, path)
                checksum = table.schema.metadata[b"lockstep.sha256"].decode()
                landed.append((path, checksum, groups_of(table, s.cfg.rollout.group_size)))
            storage += time.perf_counter() - t1
            t2 = time.perf_counter()
            admitted = []  # every landed group decided on before any trains: the next round waits for no training
            for path, checksum, groups in landed:
                staleness.extend(token_staleness(path, groups, s.version, max_staleness))
                for g in groups:
                    rewards.extend(g.rewards)
                admitted.append(steps.admit(groups))
                groups_done += len(groups)
                shards.append({"path": path, "checksum": checksum, "groups": len(groups)})
            busy += time.perf_counter() - t2
            if rounds_open and groups_done >= expected_groups:  # dynamic sampling: every planned group is in
                t_round = time.perf_counter()
                count = steps.next_round()
                new_round = plan_round(s, run_id, iteration, count) if count else []
                if new_round:
                    steps.add_round(new_round)
                    expected_groups += len(new_round)
                else:
                    s.pool.enqueue([])  # the stop markers: the rollout tasks return
                    rounds_open = False
                storage += time.perf_counter() - t_round
            if not rounds_open and groups_done >= expected_groups:  # all in: workers idle till promotion
                torch.set_num_threads(idle_rollout_threads(s.cfg))
            for released in admitted:
                t3 = time.perf_counter()
                steps.train(*released)
                busy += time.perf_counter() - t3
    finally:
        if rounds_open:  # a failure while the workers wait for a round: their rollout tasks end (unless closed)
            with contextlib.suppress(ValueError, OSError):
                s.pool.enqueue([])
    t3 = time.perf_counter()
    figures = steps.finish()
    busy += time.perf_counter() - t3
    s.storage_s += storage
    r = torch.tensor(rewards)
    st = torch.tensor(staleness, dtype=torch.float32) if staleness else torch.zeros(1)
    figures.update(
        {
            "reward/mean": float(r.mean()),
            "reward/std": float(r.std()) if len(rewards) > 1 else 0.0,
            "staleness/mean": float(st.mean()),
            "staleness/max": float(st.max()),
            "time/train_busy_s": busy,
            "time/train_wait_s": wait,
            "time/first_shard_s": first_shard_s or 0.0,
            "time/train_end_s": time.perf_counter() - started_at,
            "train/threads": float(torch.get_num_threads()),  # at the optimizer step: borrowed or not
        }
    )
    t_ledger = time.perf_counter()
    decided = {"dynamic_sampling": steps.sampling.decisions()} if steps.sampling is not None else {}
    ledger.write_record(s.lake, run_id, iteration, "trained", shards=shards, figures=figures, **decided)
    s.storage_s += time.perf_counter() - t_ledger
    figures["time/train_task_s"] = time.perf_counter() - t_task
    return figures


@task(name="promote", cache_policy=NO_CACHE)
def promote_task(run_id: str, iteration: int) -> dict:
    """Make the new version the workers' next one and save its checkpoint with optimizer state, verified and
    promoted. With shared weights (`pipeline.push_weights`) the workers get the version from memory and the
    checkpoint is written beside the next iteration, from the live tensors, before that iteration's first optimizer
    step (the previous one's write is awaited first); otherwise the checkpoint is written and promoted here and the
    workers load it."""
    s = session(run_id)
    t0 = time.perf_counter()
    new_version = s.version + 1
    if s.weights is None:
        _save_and_promote(s, iteration, new_version, checkpoints.snapshot(s.trainer.model, s.trainer.optimizer))
    else:
        s.wait_saved()  # at most one checkpoint in flight: v(k) is durable before v(k+1) is pushed
        # no copy: nothing changes weights or optimizer state before the next optimizer step, and the train task
        # waits for this write before it (BatchSteps' `before_step`)
        snap = checkpoints.snapshot(s.trainer.model, s.trainer.optimizer)
        s.weights.write(s.trainer.model)
        s.save_in_background(new_version, lambda: _save_and_promote(s, iteration, new_version, snap))
    s.version = new_version
    body = time.perf_counter() - t0
    s.storage_s += body
    return {"version": new_version, "body_s": body}


def _save_and_promote(s, iteration: int, version: int, snap: checkpoints.TrainerSnapshot) -> None:
    """Write checkpoint v{version} from `snap`, verify and promote it, prune old optimizer state, record it. A
    failure before PROMOTED is written marks the iteration failed (the previous version stays promoted); after
    it, the record stays 'trained' for resume to settle. Either way the error is raised."""
    run_id = s.run_id
    try:
        checkpoints.save_checkpoint(
            s.lake, run_id, version, s.trainer.model, s.tokenizer, extra_state={"iteration": iteration}, snap=snap
        )
        faults.point("before-promote")
        checkpoints.promote(s.lake, run_id, version)
        faults.point("after-promote")
    except Exception as e:
        mark_failed(s, iteration, f"checkpoint v{version}: {type(e).__name__}: {e}")
        raise
    keep = s.cfg.lake.keep_optimizer_state
    if keep:
        checkpoints.retain_optimizer_state(s.lake, run_id, version, keep)
    if s.cfg.pipeline.mode == "async":  # serving workers load it between chunks (or decoding steps)
        s.pool.announce(version, s.lake.checkpoint_dir(run_id, version))
    ledger.write_record(s.lake, run_id, iteration, "promoted", promoted_version=version)


def mark_failed(s, iteration: int, reason: str) -> None:
    """Mark iteration `iteration` failed (resume restarts it), unless it is past failing: its record promoted or
    failed already, or its version promoted (PROMOTED written and then an error, before the ledger's update: the
    record stays 'trained' and resume settles it as promoted; marked failed, it could never be, and the run would
    go on from a version whose iteration the ledger calls failed and the catalog never indexes)."""
    rec = ledger.read_record(s.lake, s.run_id, iteration)
    if rec is None or rec["state"] in ("promoted", "failed"):
        return
    try:
        promoted = checkpoints.promoted_version(s.lake, s.run_id)
    except checkpoints.CheckpointError:  # PROMOTED unreadable: it cannot show this iteration's version promoted
        promoted = None
    if promoted is not None and promoted > iteration:
        return
    ledger.write_record(s.lake, s.run_id, iteration, "failed", reason=reason[:2000])


@task(name="audit", cache_policy=NO_CACHE, retries=0)  # not PREFECT_TASKS_DEFAULT_RETRIES: see catalog_iteration
def audit_task(run_id: str, iteration: int, version: int, figures: dict) -> None:
    """After promotion, off the critical path: the iteration's catalog rows (`pipeline.catalog`) and its Prefect
    markdown report (`tracking.prefect_artifacts`). One task, not two: every task run costs the Prefect server
    CPU time (recording its state events), which on 2 cores is taken from rollout and training."""
    s = session(run_id)
    saving = s.saving
    if saving is not None and saving[0] <= version:  # the record must be final (promoted) before it is annotated
        concurrent.futures.wait([saving[1]])
        if saving[1].exception() is not None:  # not promoted: the flow raises the error; resume retrains it
            return
    if s.cfg.pipeline.catalog:
        catalog_iteration(run_id, iteration, version)
    if s.cfg.tracking.prefect_artifacts:
        markdown_report(run_id, iteration, figures)


def catalog_iteration(run_id: str, iteration: int, version: int) -> int:
    """Index the iteration's trained samples (with their advantages) and shards in the LanceDB catalog.

    Appended when the iteration is later than every iteration the catalog held at the session's first write (a
    new run's, or those a resumed run trains: none of their rows can be there, since only promoted iterations are
    cataloged and a run resumes after its last promoted one); merged on their ids otherwise (a promoted iteration
    whose write a crash cut short, a run whose promotion was undone by hand). Each iteration is written once per
    session (the audit task is not retried), so an append never repeats one."""
    import pyarrow as pa

    from models.objectives import compute_advantages
    from storage import catalog

    s = session(run_id)
    uri = catalog.catalog_uri(s.lake, run_id)
    if uri is None:
        return 0
    rec = ledger.read_record(s.lake, run_id, iteration)
    overlong = loss_settings(s.cfg).overlong  # the rewards the trainer took advantages of (the stored are the task's)
    tables, shard_rows = [], []
    # dynamic sampling: a group not trained (rewards all equal, or past the batch's end) has no advantage (null)
    decided = rec.get("dynamic_sampling")
    trained = set(decided["trained"]) if decided else None
    for sh in rec["shards"]:
        t = read_shard(s.lake, sh["path"], sh["checksum"])
        adv = torch.zeros(t.num_rows)
        gid = t.column("group_id").to_pylist()
        reward = t.column("reward").to_pylist()
        responses = t.column("response_ids").to_pylist() if overlong else [[]] * t.num_rows  # lengths: only to punish
        for g in dict.fromkeys(gid):  # the trainer's per-group advantages, recomputed by the same functions
            rows = [i for i, x in enumerate(gid) if x == g]
            r, _ = shaped_rewards([reward[i] for i in rows], [responses[i] for i in rows], overlong)
            a, _ = compute_advantages(r.unsqueeze(0), kind=s.cfg.algorithm.advantage)
            adv[torch.tensor(rows)] = a.squeeze(0)
        ids = [
            f"{run_id}/{it}/{g}/{j}"
            for it, g, j in zip(t.column("iteration").to_pylist(), gid, t.column("sample_index").to_pylist())
        ]
        t = t.replace_schema_metadata(None)
        advantages = adv.tolist()
        if trained is not None:
            pids = t.column("prompt_id").to_pylist()
            advantages = [a if p in trained else None for a, p in zip(advantages, pids)]
        t = t.append_column("sample_id", pa.array(ids)).append_column(
            "advantage", pa.array(advantages, type=pa.float64())
        )
        tables.append(t.append_column("shard", pa.array([sh["path"]] * t.num_rows)))
        # the version that generated the shard (its chunk started on it; async: older than the trainer's)
        generated = t.column("policy_version")[0].as_py()
        shard_rows.append(
            {
                "path": sh["path"],
                "checksum": sh["checksum"],
                "groups": sh["groups"],
                "rows": t.num_rows,
                "iteration": iteration,
                "policy_version": generated,
            }
        )
    if s.catalog_last is None:  # after the shards are read: a shard that fails to read leaves no catalog folder
        s.catalog_last = catalog.last_iteration(uri)
    catalog.write_iteration(
        uri,
        pa.concat_tables(tables),
        pa.Table.from_pylist(shard_rows),
        version,
        compact_every=s.cfg.pipeline.catalog_compact_every,
        append=iteration > s.catalog_last,
    )
    ledger.annotate(s.lake, run_id, iteration, cataloged=True)
    return sum(t.num_rows for t in tables)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(run_id: str) -> float:
    return evaluate(session(run_id))


def markdown_report(run_id: str, iteration: int, figures: dict, worst: int = 5) -> None:
    """A Prefect markdown artifact per iteration: version, reward statistics and the worst samples."""
    from prefect.artifacts import create_markdown_artifact

    s = session(run_id)
    rec = ledger.read_record(s.lake, run_id, iteration)
    rows = []
    for sh in rec["shards"]:
        t = read_shard(s.lake, sh["path"], sh["checksum"]).select(
            ["group_id", "sample_index", "reward", "response_text", "finish_reason"]
        )
        rows.extend(t.to_pylist())
    rows.sort(key=lambda r: r["reward"])
    lines = [
        f"# {run_id} iteration {iteration}",
        "",
        f"trained on policy version {iteration}, promoted version {rec.get('promoted_version')}",
        "",
        "| reward mean | reward std | samples | time (s) |",
        "|---|---|---|---|",
        f"| {figures['reward/mean']:.4f} | {figures['reward/std']:.4f} | {len(rows)} | "
        f"{figures['time/iteration_s']:.2f} |",
        "",
        f"## {worst} lowest-reward samples",
        "",
        "| group | sample | reward | finish | response |",
        "|---|---|---|---|---|",
    ]
    for r in rows[:worst]:
        text = r["response_text"].replace("|", "\\|").replace("\n", "\\n")[:80]
        lines.append(f"| {r['group_id']} | {r['sample_index']} | {r['reward']:.3f} | {r['finish_reason']} | `{text}` |")
    create_markdown_artifact(
        key=f"{run_id.lower().replace('_', '-').replace('.', '-')}-iter-{iteration}",
        markdown="\n".join(lines),
        description=f"lockstep {run_id} iteration {iteration}",
    )
