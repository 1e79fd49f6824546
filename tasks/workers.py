"""Long-lived rollout worker processes (spawned, never forked) and the pool the rollout tasks talk to.

Each worker keeps its engine and weights loaded across iterations, with its own torch thread budget, and
loads a new policy version only when told to. The iteration's prompts are cut into chunks of
`shard_groups` groups by the plan and put on one shared queue: a worker that finishes early takes the next
chunk, so a long-tailed chunk does not stall the batch. Each chunk becomes one shard. A chunk's content and
every sample's seed are fixed by the plan, so which worker makes it never changes a token.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone

_STOP = "__stop__"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, as plain values (picklable across spawn)."""

    lake_uri: str
    run_id: str
    model_dir: str  # a local HF directory to build the engine from (v0); later versions load weights only
    threads: int
    run_seed: int
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    partial_credit: float
    compression: str | None
    reward_kind: str
    prompts: list[tuple[int, str, str, list[int]]] = field(repr=False)  # (prompt_id, text, answer, token ids)


@dataclass(frozen=True)
class Chunk:
    iteration: int
    version: int
    index: int  # shard sequence number within the iteration
    prompt_ids: tuple[int, ...]  # the plan's prompt ids; group ids are f"{iteration}-{prompt_id}"


def _get(q, parent: int):
    """Block on a queue, but end the worker if its parent (the flow's process) has died: a SIGKILLed parent
    cannot stop its children, and an orphaned worker must not linger."""
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                os._exit(0)


def _worker_main(worker_id: int, spec: WorkerSpec, commands, work, results, parent: int) -> None:  # in the child
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(spec.threads)
    from models.engine import SamplingParams, generate_groups, sample_seed
    from models.rewards import score
    from models.tiny import load_hf, single_token_id
    from storage import checkpoints
    from storage.lake import Lake
    from storage.shards import SampleRecord, write_shard

    try:
        lake = Lake(spec.lake_uri)
        model, tokenizer = load_hf(spec.model_dir)
        model.requires_grad_(False)
        loaded_version: int | None = None
        stop_id = single_token_id(tokenizer, "\n")
        params = SamplingParams(spec.max_new_tokens, spec.temperature, spec.top_p, stop_on_newline_id=stop_id)
        prompts = {p[0]: p for p in spec.prompts}
        results.put(("ready", worker_id))
    except BaseException:
        results.put(("error", traceback.format_exc()))
        return
    while True:
        cmd = _get(commands, parent)
        if cmd[0] == "exit":
            return
        _, version, ckpt_path = cmd
        try:
            t_load = time.perf_counter()
            if version != loaded_version:
                checkpoints.load_into(model, checkpoints.load_weights(lake, ckpt_path))
                loaded_version = version
            load_s = time.perf_counter() - t_load
            busy = storage_s = 0.0
            shards = []
            while True:
                chunk = _get(work, parent)
                if chunk == _STOP:
                    break
                if chunk.version != loaded_version:
                    raise RuntimeError(f"chunk of version {chunk.version} sent to a worker holding {loaded_version}")
                t0 = time.perf_counter()
                ids = [prompts[p][3] for p in chunk.prompt_ids]
                seeds = [[sample_seed(spec.run_seed, chunk.iteration, p, j) for j in range(spec.group_size)]
                         for p in chunk.prompt_ids]
                groups = generate_groups(model, ids, spec.group_size, params, seeds,
                                         tokenizer.eos_token_id, tokenizer.pad_token_id)
                now = datetime.now(timezone.utc)
                records = []
                gen_tokens = 0
                for pid, group in zip(chunk.prompt_ids, groups):
                    _, text, answer, pids = prompts[pid]
                    for j, s in enumerate(group):
                        resp = tokenizer.decode(s.response_ids, skip_special_tokens=True)
                        gen_tokens += len(s.response_ids)
                        records.append(SampleRecord(
                            run_id=spec.run_id, iteration=chunk.iteration, policy_version=chunk.version,
                            group_id=f"{chunk.iteration}-{pid}", prompt_id=pid, sample_index=j, prompt_ids=pids,
                            response_ids=s.response_ids, behavior_logprobs=s.logprobs,
                            token_versions=[chunk.version] * len(s.response_ids),
                            reward=score(spec.reward_kind, resp, answer, spec.partial_credit),
                            finish_reason=s.finish_reason,
                            prompt_text=text, response_text=resp, worker=worker_id, seed=s.seed, created_at=now,
                        ))
                t1 = time.perf_counter()
                path = (f"{lake.iteration_rollouts(spec.run_id, chunk.version, chunk.iteration)}/"
                        f"shard-{worker_id}-{chunk.index:05d}.arrow")
                checksum = write_shard(lake, spec.run_id, path, records, compression=spec.compression)
                t2 = time.perf_counter()
                busy += t1 - t0
                storage_s += t2 - t1
                shards.append({"path": path, "checksum": checksum, "groups": len(groups), "worker": worker_id,
                               "gen_tokens": gen_tokens, "gen_s": t1 - t0, "published_at": time.time()})
            results.put(("done", {"shards": shards, "busy_s": busy, "storage_s": storage_s, "load_s": load_s}))
        except BaseException:
            results.put(("error", traceback.format_exc()))


class WorkerError(RuntimeError):
    pass


class WorkerPool:
    """Spawned rollout workers plus the shared chunk queue. One pool per run, kept across iterations."""

    def __init__(self, n_workers: int, spec: WorkerSpec, start_timeout_s: float = 300.0):
        ctx = mp.get_context("spawn")
        self.n = n_workers
        self.work = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n_workers)]
        self.results = [ctx.Queue() for _ in range(n_workers)]
        self.procs = [
            ctx.Process(target=_worker_main, args=(w, spec, self.commands[w], self.work, self.results[w], os.getpid()),
                        name=f"lockstep-rollout-{w}", daemon=True)
            for w in range(n_workers)
        ]
        self.failed: str | None = None
        for p in self.procs:
            p.start()
        for w in range(n_workers):
            self._expect(w, "ready", start_timeout_s)

    def _expect(self, w: int, kind: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.results[w].get(timeout=0.5)
                break
            except queue.Empty:
                if not self.procs[w].is_alive():
                    self.failed = f"rollout worker {w} died (exit code {self.procs[w].exitcode})"
                    raise WorkerError(self.failed) from None
                if time.monotonic() > deadline:
                    self.failed = f"rollout worker {w} gave no answer within {timeout_s:.0f} s"
                    raise WorkerError(self.failed) from None
        if msg[0] == "error":
            self.failed = f"rollout worker {w} failed:\n{msg[1]}"
            raise WorkerError(self.failed)
        if msg[0] != kind:
            raise WorkerError(f"rollout worker {w}: expected {kind!r}, got {msg[0]!r}")
        return msg[1]

    def enqueue(self, chunks: list[Chunk]) -> None:
        """Put one iteration's chunks on the shared queue, then one stop marker per worker."""
        for c in chunks:
            self.work.put(c)
        for _ in range(self.n):
            self.work.put(_STOP)

    def run(self, worker: int, version: int, checkpoint_path: str, timeout_s: float = 3600.0) -> dict:
        """Have `worker` load `version` (if it holds another) and drain the queue; blocks until it is done."""
        self.commands[worker].put(("iterate", version, checkpoint_path))
        return self._expect(worker, "done", timeout_s)

    def alive(self) -> bool:
        return self.failed is None and all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.commands:
            q.put(("exit",))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for q in [self.work, *self.commands, *self.results]:
            q.close()
            q.cancel_join_thread()
