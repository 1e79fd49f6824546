"""Long-lived rollout worker processes and the pool the rollout tasks talk to.

Each worker keeps its engine and weights loaded across iterations, with its own torch thread budget, and
loads a new policy version only when told to. The iteration's prompts are cut into chunks of
`shard_groups` groups by the plan and put on one shared queue: a worker that finishes early takes the next
chunk, so a long-tailed chunk does not stall the batch. Each chunk becomes one shard. A chunk's content and
every sample's seed are fixed by the plan, so which worker makes it never changes a token.

Sync / periodic: a worker drains one iteration's chunks on that iteration's version (`iterate`). Async: a worker
serves for the whole run (`serve`): it takes chunks of later batches as they are planned, starts a chunk of
batch j only on a version >= j - max_staleness (admission control), and loads each promoted version as it is
announced - between chunks, or between decoding steps with `interrupt_on_update`.

A worker generates a chunk, then scores its responses (`task.reward`) and writes its shard; with
`pipeline.overlap_scoring` the scoring and writing run on one thread beside the generation of its next chunk
(`_Publisher`), so that a slow reward hides behind generation; the shards are the same.

A new version reaches the workers either from its checkpoint in the lake, or (sync / periodic, builtin engine,
`pipeline.push_weights`) pushed through one shared-memory file (`SharedWeights`) the trainer writes after the
optimizer step and every worker maps; the checkpoint is then written off the critical path.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import queue
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone

from storage import scratch

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
    # (prompt_id, text, answer, token ids, extra fields for the reward)
    prompts: list[tuple[int, str, str, list[int], dict]] = field(repr=False)
    engine: str = "builtin"  # builtin | vllm
    stop_at_newline: bool = True  # a response also ends at a newline token (`task.stop_at_newline`)
    vllm: dict = field(default_factory=dict)  # VLLMEngine keyword arguments
    reward_fields: tuple[str, ...] = ()  # `task.dataset.extra_fields`, which the reward function receives
    reward_timeout_s: float | None = None  # `task.reward_timeout_s`: the limit of one call of a user's function
    reward_batch: bool = False  # `task.reward_batch`: a user's function scores a shard's responses in one call
    overlap_scoring: bool = False  # `pipeline.overlap_scoring`: score a shard while generating the next


_MAPPED: dict[str, object] = {}  # SharedWeights file -> this process's mapping of it (a uint8 tensor)


@dataclass(frozen=True)
class SharedWeights:
    """A model's parameters in one file in shared memory (`/dev/shm` where there is one), mapped by the trainer and
    by every colocated rollout worker: a new version reaches the workers with one copy each way, without a
    checkpoint written or read on the critical path. Picklable (a path and a layout); each process maps it once.

    Only the trainer writes, and only while no worker reads: in sync / periodic mode the workers load at the
    start of an iteration, and the trainer writes after the iteration's last rollout has returned."""

    path: str
    layout: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (parameter name, byte offset, shape, dtype)
    nbytes: int

    @classmethod
    def create(cls, model, directory: str | None = None) -> SharedWeights:
        layout, offset = [], 0
        for name, p in model.named_parameters():  # tied parameters appear once
            layout.append((name, offset, tuple(p.shape), str(p.dtype).removeprefix("torch.")))
            offset += -(-p.numel() * p.element_size() // 64) * 64  # 64-byte aligned views
        if directory is None:
            directory = (
                "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
            )
        scratch.remove_orphans(directory)  # a SIGKILLed run's file holds shared memory until someone removes it
        fd, path = tempfile.mkstemp(prefix=scratch.prefix("weights"), suffix=".bin", dir=directory)
        try:
            os.ftruncate(fd, max(offset, 1))
        finally:
            os.close(fd)
        return cls(path, tuple(layout), max(offset, 1))

    def _views(self) -> dict:
        import torch

        buf = _MAPPED.get(self.path)
        if buf is None:
            buf = _MAPPED[self.path] = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        views = {}
        for name, offset, shape, dtype in self.layout:
            dt = getattr(torch, dtype)
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            views[name] = buf[offset : offset + n].view(dt).view(shape)
        return views

    def _pairs(self, model) -> list:
        params = dict(model.named_parameters())
        views = self._views()
        if set(params) != set(views) or any(params[k].shape != views[k].shape for k in views):
            raise RuntimeError(
                f"shared weights {self.path}: the model's parameters ({len(params)}) do not match "
                f"the layout ({len(views)}): the worker and the trainer built different models"
            )
        return [(params[k], views[k]) for k in views]

    def write(self, model) -> None:
        """Trainer side: copy the model's parameters in."""
        import torch

        with torch.no_grad():
            for p, v in self._pairs(model):
                v.copy_(p.detach())

    def read_into(self, model) -> None:
        """Worker side: copy the parameters out into the live model."""
        import torch

        with torch.no_grad():
            for p, v in self._pairs(model):
                p.copy_(v)

    def unlink(self) -> None:
        _MAPPED.pop(self.path, None)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class Chunk:
    iteration: int
    version: int
    index: int  # shard sequence number within the iteration
    prompt_ids: tuple[int, ...]  # the plan's prompt ids; group ids are f"{iteration}-{prompt_id}"


# Modules the fork server imports once (`child_context`): a child forked from it starts with torch, transformers and
# lockstep's worker code in place, instead of importing them for seconds of CPU time in every run. Not pyarrow
# (`storage.shards`): its allocator runs a background thread, which a fork could catch holding a lock the child then
# waits on forever; numpy's OpenBLAS threads, which torch brings, stop themselves before a fork.
_PRELOAD = (
    "tasks.forkserver",  # first: the server leaves the run's process group
    "tasks.workers",
    "tasks.train_ranks",
    "models.engine",
    "models.rewards",
    "models.tiny",
    "models.trainer",
)


def child_context(modeling: str | None = None, fork_server: bool = True):
    """The multiprocessing context that starts worker processes (rollout workers, trainer ranks): a fork server's
    where the platform has one (POSIX), spawn elsewhere or with `fork_server` false (vLLM's workers: its engine starts
    processes of its own, on a GPU). The server is started by the first call of a process, as a fresh interpreter
    (not a fork of this process: nothing of its GPU context, files or threads), runs for the process's life and
    imports `_PRELOAD` and `modeling` (the transformers modeling module of the first policy) once, so that a child it
    forks starts with them imported, not seconds later. A child takes on its parent's environment and process group
    as they are when the child starts (`ParentState`, `enter_child`), as a spawned one does. Where the server cannot
    start (its socket's path, in a temporary folder longer than AF_UNIX allows), spawn."""
    if not fork_server or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *([modeling] if modeling else [])])  # kept by a server already running
    try:
        forkserver.ensure_running()  # returns at once: the server imports while this process goes on
    except OSError:
        return mp.get_context("spawn")
    return ctx


def model_type(model_dir: str) -> str | None:
    """The `model_type` of HF directory `model_dir`'s config.json; None where it has none to read."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            kind = json.load(f)["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kind if isinstance(kind, str) else None


def modeling_module(kind: str | None) -> str | None:
    """The transformers module that defines models of type `kind` (as config.json's `model_type` names it)."""
    if kind is None:
        return None
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(kind)
    return f"transformers.models.{name}.modeling_{name}"


@dataclass(frozen=True)
class ParentState:
    """What a child process takes on from the process that starts it: that process's process group (which the child
    joins) and environment as they are at the start, and its pid (the child ends with it). A fork server's child would
    otherwise have the server's environment, from when the server started, and the server's own process group; its
    working folder and import path multiprocessing sets itself, as for a spawned one."""

    pid: int
    pgid: int
    environ: dict = field(repr=False)

    @classmethod
    def here(cls) -> ParentState:
        return cls(os.getpid(), os.getpgid(0), dict(os.environ))


def enter_child(parent: ParentState, sigterm_from_parent_only: bool = True) -> None:
    """First thing in a worker process's main thread: its parent's environment; SIGINT ignored (Ctrl-C reaches the
    whole process group: the parent stops its children); an end within 0.2 s of the parent's, and a SIGTERM taken from
    the parent only (`_exit_with_parent`); then the parent's process group joined (a fork server's child starts in the
    server's), so that a signal or kill sent to the group reaches it as it reaches a spawned child. On another thread
    (the unit tests run a worker on one) only the end with the parent."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        if os.environ != parent.environ:
            os.environ.clear()
            os.environ.update(parent.environ)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent.pid, sigterm_from_parent_only=sigterm_from_parent_only)
    if main and os.getpgid(0) != parent.pgid:
        try:
            os.setpgid(0, parent.pgid)
        except OSError:  # the group is gone, and with it the parent
            os._exit(0)


def _orphaned(parent: int) -> bool:
    """Whether the process that started this one (pid `parent`) has died: a SIGKILLed parent cannot stop its children.
    A multiprocessing child (spawned, or forked by the fork server, whose child it is) asks its pipe from the parent,
    which closes as the parent dies; another process (a server the command started) asks whether it was orphaned."""
    started_by = mp.parent_process()
    if started_by is not None:
        return not started_by.is_alive()
    return os.getppid() != parent


def watch_parent(parent: int, stop, period_s: float = 0.2, sigterm_from_parent_only: bool = True) -> None:
    """Call `stop()` from a daemon thread once this process's parent (pid `parent`) has died or, when this is called
    on the main thread of a child process, has sent it SIGTERM (`Process.terminate`, Prefect's server stop).

    Only the parent's SIGTERM counts: one sent to the whole process group (`kill -TERM -- -PGID`, a job scheduler,
    systemd, `timeout`) reached the parent too, which stops its children as it unwinds; a child that stopped first
    would fail what the parent is still waiting on (a rollout task's results, the Prefect API recording the run's
    end). SIGTERM is blocked in the calling thread and in every thread started after it, so that `sigtimedwait`
    here takes it; call this before the process starts other threads. A signal mask survives exec: the processes
    this one starts have SIGTERM blocked too (not wanted where a library stops its own processes with SIGTERM:
    `sigterm_from_parent_only=False` leaves SIGTERM alone). On another thread (the unit tests run a worker in one),
    or with it False, only the parent's death is watched."""
    main = sigterm_from_parent_only and threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        while not _orphaned(parent):
            if not main:
                time.sleep(period_s)
                continue
            sent = signal.sigtimedwait({signal.SIGTERM}, period_s)
            if sent is not None and sent.si_pid == parent:
                break
        stop()

    threading.Thread(target=watch, name="lockstep-parent-watch", daemon=True).start()


def _exit_with_parent(parent: int, period_s: float = 0.2, sigterm_from_parent_only: bool = True) -> None:
    """End this worker within `period_s` of its parent's death, whatever it is doing: an orphan that went on
    generating would publish shards that a resumed run could train on beside its own copies of the same groups.
    A SIGTERM ends it only when the parent sent it (`watch_parent`)."""
    watch_parent(parent, lambda: os._exit(0), period_s, sigterm_from_parent_only)


@contextlib.contextmanager
def signal_handled(signum: int, handler):
    """`handler` for `signum` inside the block, the previous one restored after; from the main thread only, where
    Python sets and runs handlers (elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def sigint_ignored():
    """SIGINT ignored while processes are started: a spawned child inherits it through exec (a fork server's child
    starts outside the run's process group, which it joins once it ignores SIGINT itself: `enter_child`), so a
    terminal's Ctrl-C, which reaches the whole process group, never interrupts a child's start-up; the parent
    handles it and stops its children."""
    return signal_handled(signal.SIGINT, signal.SIG_IGN)


def _generation_config(model_dir: str):
    """The model directory's generation config (None without one), as `from_pretrained` would read it."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        return None


class _Worker:
    """The state of one worker process: engine, weights, and the version it holds."""

    def __init__(self, worker_id: int, spec: WorkerSpec, commands, parent: int):
        import torch

        torch.set_num_threads(spec.threads)
        from models.engine import SamplingParams
        from models.rewards import reward_function
        from models.tiny import load_hf, other_eos_ids, single_token_id
        from storage.lake import Lake

        self.id, self.spec, self.commands, self.parent = worker_id, spec, commands, parent
        self.lake = Lake(spec.lake_uri)
        self.reward = reward_function(  # a user's: imported in this process
            spec.reward_kind, spec.partial_credit, spec.reward_fields, spec.reward_timeout_s, spec.reward_batch
        )
        self.vllm = None
        if spec.engine == "vllm":
            from transformers import AutoTokenizer

            from models.vllm_engine import VLLMEngine

            self.vllm = VLLMEngine(spec.model_dir, seed=spec.run_seed, **spec.vllm)
            self.model, self.tokenizer = None, AutoTokenizer.from_pretrained(spec.model_dir)
            generation_config = _generation_config(spec.model_dir)
        else:
            self.model, self.tokenizer = load_hf(spec.model_dir)
            self.model.requires_grad_(False)
            generation_config = self.model.generation_config
        self.version: int | None = None
        stop_id = single_token_id(self.tokenizer, "\n") if spec.stop_at_newline else None
        self.params = SamplingParams(
            spec.max_new_tokens,
            spec.temperature,
            spec.top_p,
            stop_on_newline_id=stop_id,
            other_eos_ids=other_eos_ids(generation_config, self.tokenizer),
        )
        self.prompts = {p[0]: p for p in spec.prompts}
        self.pending: tuple[int, str] | None = None  # the newest (version, checkpoint) announced, not yet loaded
        self.load_s = 0.0
        self.serving = False  # async: until told to stop (a stop seen mid-chunk is kept here, never lost)
        self.exiting = False  # told to exit while serving

    def load(self, version: int, source: str | SharedWeights) -> None:
        """Hold `version`: from its checkpoint's path in the lake, or from the trainer's shared weights."""
        from storage import checkpoints

        if version != self.version:
            t0 = time.perf_counter()
            if isinstance(source, SharedWeights):
                if self.vllm is not None:
                    raise RuntimeError("shared-memory weights are for the builtin engine; vLLM loads checkpoints")
                source.read_into(self.model)
            elif self.vllm is not None:  # vLLM reads a local directory inside its own worker processes; a copy of an
                # object-store checkpoint lasts only for the load (kept, one would pile up per promoted version)
                with tempfile.TemporaryDirectory(prefix=scratch.prefix("load")) as copies:
                    self.vllm.load_checkpoint(checkpoints.local_copy(self.lake, source, copies, checked=False))
            else:  # a promoted version, verified as it was promoted: not hashed again on every load
                checkpoints.load_into(self.model, checkpoints.load_weights(self.lake, source, checked=False))
            self.version = version
            self.load_s += time.perf_counter() - t0
        if self.pending is not None and self.pending[0] <= version:
            self.pending = None

    def generate_chunk(self, chunk: Chunk, poll_update=None) -> dict:
        """Generate the chunk's groups on the weights held now, score them, publish them as one shard."""
        return self.publish(self.generate(chunk, poll_update))[0]

    def generate(self, chunk: Chunk, poll_update=None) -> _Generated:
        """The chunk's groups on the weights held now, decoded, not yet scored."""
        from models.engine import generate_groups, sample_seed

        spec, tok = self.spec, self.tokenizer
        started_version = self.version
        t0 = time.perf_counter()
        ids = [self.prompts[p][3] for p in chunk.prompt_ids]
        seeds = [
            [sample_seed(spec.run_seed, chunk.iteration, p, j) for j in range(spec.group_size)]
            for p in chunk.prompt_ids
        ]
        if self.vllm is not None:
            groups = self.vllm.generate_groups(
                ids, spec.group_size, self.params, seeds, tok.eos_token_id, tok.pad_token_id, version=started_version
            )
        else:
            groups = generate_groups(
                self.model,
                ids,
                spec.group_size,
                self.params,
                seeds,
                tok.eos_token_id,
                tok.pad_token_id,
                version=started_version,
                poll_update=poll_update,
            )
        now = datetime.now(timezone.utc)
        samples = [(pid, j, s) for pid, group in zip(chunk.prompt_ids, groups) for j, s in enumerate(group)]
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for _, _, s in samples]
        return _Generated(chunk, started_version, len(groups), samples, texts, now, t0)

    def publish(self, g: _Generated, busy_from: float | None = None) -> tuple[dict, float]:
        """Score a generated chunk and write its shard: the shard's info and the `perf_counter` time it was written.
        Its `gen_s` is counted from `busy_from` where that is later than the chunk's start (with overlapped scoring,
        the previous shard's end: the time both were busy is counted once)."""
        from storage.shards import SampleRecord, write_shard

        spec, chunk = self.spec, g.chunk
        rows = [self.prompts[pid] for pid, _, _ in g.samples]  # (prompt_id, text, answer, token ids, extra)
        # one call of a batched function for the shard's responses, else one per response
        t_reward = time.perf_counter()
        rewards = self.reward.many(g.texts, [r[2] for r in rows], [r[1] for r in rows], [r[4] for r in rows])
        reward_s = time.perf_counter() - t_reward
        records = [
            SampleRecord(
                run_id=spec.run_id,
                iteration=chunk.iteration,
                policy_version=g.version,
                group_id=f"{chunk.iteration}-{pid}",
                prompt_id=pid,
                sample_index=j,
                prompt_ids=row[3],
                response_ids=s.response_ids,
                behavior_logprobs=s.logprobs,
                token_versions=s.token_versions,
                reward=reward,
                finish_reason=s.finish_reason,
                prompt_text=row[1],
                response_text=text,
                worker=self.id,
                seed=s.seed,
                created_at=g.created_at,
            )
            for (pid, j, s), text, row, reward in zip(g.samples, g.texts, rows, rewards, strict=True)
        ]
        gen_tokens = sum(len(s.response_ids) for _, _, s in g.samples)
        t1 = time.perf_counter()
        path = (
            f"{self.lake.iteration_rollouts(spec.run_id, g.version, chunk.iteration)}/"
            f"shard-{self.id}-{chunk.index:05d}.arrow"
        )
        if _orphaned(self.parent):  # the watch thread's period is a window: never publish for a dead run
            os._exit(0)
        checksum = write_shard(self.lake, spec.run_id, path, records, compression=spec.compression)
        t2 = time.perf_counter()
        info = {
            "path": path,
            "checksum": checksum,
            "groups": g.n_groups,
            "worker": self.id,
            "iteration": chunk.iteration,
            "gen_tokens": gen_tokens,
            # generation and scoring; with overlap, from the previous shard's write where that came later (the time
            # this chunk generated beside that shard's scoring is counted there)
            "gen_s": t1 - max(g.started, busy_from or g.started),
            "reward_s": reward_s,  # of which scoring
            "storage_s": t2 - t1,
            "published_at": time.time(),
        }
        return info, t2

    def iterate(self, version: int, source: str | SharedWeights, work) -> dict:
        """Sync / periodic: load `version`, drain the iteration's chunks up to a stop marker."""
        self.load_s = 0.0
        self.load(version, source)
        with _Publisher(self) as publisher:
            while True:
                publisher.check()  # a shard that failed beside the last generation: before taking another chunk
                chunk = None
                while chunk is None:
                    try:
                        chunk = work.get(timeout=0.5)
                    except queue.Empty:  # nothing queued (dynamic sampling: maybe for long, till the next round is
                        publisher.check()  # planned, which waits for the shard in flight): its failure raised now
                if chunk == _STOP:
                    break
                if chunk.version != self.version:
                    raise RuntimeError(f"chunk of version {chunk.version} sent to a worker holding {self.version}")
                publisher.put(self.generate(chunk))
        return {"shards": publisher.shards, **publisher.totals(), "load_s": self.load_s}

    def _drain_commands(self, block: bool = False, timeout: float | None = None) -> None:
        """Take commands off the queue: the newest announced version wins (`pending`); "stop" / "exit" end serving.
        With `block`, wait for at least one command (up to `timeout` seconds, if given)."""
        while True:
            try:
                cmd = self.commands.get(timeout=timeout) if block else self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "version":
                if self.pending is None or cmd[1] > self.pending[0]:
                    self.pending = (cmd[1], cmd[2])
            elif cmd[0] in ("stop", "exit"):
                self.serving = False
                self.exiting = self.exiting or cmd[0] == "exit"
            block = False  # got something: take the rest without waiting

    def _load_pending(self) -> bool:
        """Load the newest announced version, if any; whether the weights changed."""
        if self.pending is None:
            return False
        self.load(*self.pending)
        return True

    def serve(self, version: int, ckpt_path: str, max_staleness: int, interrupt: bool, work, results) -> dict:
        """Async: generate chunks continuously. Admission control: a chunk of iteration j starts only on a version
        >= j - max_staleness (it is trained at version j), waiting for that version's announcement if needed.
        New versions are loaded between chunks, or between decoding steps when `interrupt` is on."""
        self.load_s = 0.0
        self.load(version, ckpt_path)
        self.serving = True
        abandoned = {}

        def poll_update() -> int | None:
            self._drain_commands()
            return self.version if self._load_pending() else None

        with _Publisher(self, on_published=lambda info: results.put(("shard", info))) as publisher:
            while True:
                self._drain_commands()
                if not self.serving:
                    break
                publisher.check()  # a shard that failed beside generation ends serving with its error at once
                try:
                    chunk = work.get(timeout=0.05)
                except queue.Empty:
                    continue
                if chunk == _STOP:
                    continue
                self._drain_commands()  # an announcement that came while waiting for the chunk
                self._load_pending()
                while self.version < chunk.iteration - max_staleness:  # admission control
                    # waiting for a version whose batch needs the shard in flight: a failure of that shard is raised
                    # here (the version would never come), so the wait wakes up to look
                    self._drain_commands(block=True, timeout=0.1 if self.spec.overlap_scoring else None)
                    if not self.serving:
                        abandoned = {"abandoned_chunk": chunk.index}
                        break
                    publisher.check()
                    self._load_pending()
                if abandoned:
                    break
                publisher.put(self.generate(chunk, poll_update if interrupt else None))
        return {"shards": len(publisher.shards), **publisher.totals(), "load_s": self.load_s, **abandoned}


@dataclass
class _Generated:
    """A chunk generated and decoded, to be scored and published."""

    chunk: Chunk
    version: int  # the weights it started on
    n_groups: int
    samples: list  # (prompt_id, sample index, engine sample)
    texts: list[str]  # the responses decoded
    created_at: datetime
    started: float  # perf_counter at the chunk's start


class _Publisher:
    """Scores and publishes a worker's generated chunks as shards, in the order generated. With the spec's
    `overlap_scoring`, on one thread beside the worker's generation: the worker generates chunk k + 1 while chunk k
    is scored and written; at most one chunk waits to be scored (`put` waits for the one before). An error of a
    shard in flight is raised by the next `put`, `check` or on leaving; a worker leaving on its own error first waits
    for the shard in flight, so that nothing is written after the worker reported its failure."""

    def __init__(self, worker: _Worker, on_published=None):
        self.worker, self.on_published = worker, on_published
        self.shards: list[dict] = []
        self._written: float | None = None  # perf_counter at which the last shard was written
        self._thread = None
        if worker.spec.overlap_scoring:
            from concurrent.futures import ThreadPoolExecutor

            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"scoring-{worker.id}")
        self._pending = None

    def put(self, generated: _Generated) -> None:
        if self._thread is None:
            self._publish(generated)
            return
        self.wait()
        self._pending = self._thread.submit(self._publish, generated)

    def _publish(self, generated: _Generated) -> None:
        info, self._written = self.worker.publish(generated, self._written)
        self.shards.append(info)
        if self.on_published is not None:
            self.on_published(info)

    def wait(self) -> None:
        """Until the shard in flight is written; its error, if it failed."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if pending.done():  # settled, its error raised once; an interrupted wait leaves it for the next
                self._pending = None

    def check(self) -> None:
        """The error of the shard in flight if it has failed already; nothing while it runs."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def totals(self) -> dict:
        return {"busy_s": sum(i["gen_s"] for i in self.shards), "storage_s": sum(i["storage_s"] for i in self.shards)}

    def __enter__(self) -> _Publisher:
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            if error is None:
                self.wait()
            else:
                try:
                    self.wait()
                except Exception as second:  # a note on the error being raised (tracebacks print notes from 3.11)
                    error.__notes__ = [
                        *getattr(error, "__notes__", []),
                        f"the shard scored beside it failed too: {second!r}",
                    ]
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)


def _worker_main(  # in the child
    worker_id: int, spec: WorkerSpec, commands, work, results, parent: ParentState
) -> None:
    # vLLM's engine runs in processes it starts from this one and stops with SIGTERM: they must not inherit it
    # blocked (unrun here: no GPU), so a vLLM worker still dies of a SIGTERM sent to the whole group
    enter_child(parent, sigterm_from_parent_only=spec.engine != "vllm")
    try:
        w = _Worker(worker_id, spec, commands, parent.pid)
        results.put(("ready", worker_id))
    except BaseException:
        results.put(("error", traceback.format_exc()))
        return
    while True:
        cmd = commands.get()
        try:
            if cmd[0] == "exit":
                return
            if cmd[0] == "iterate":
                results.put(("done", w.iterate(cmd[1], cmd[2], work)))
            elif cmd[0] == "serve":
                results.put(("done", w.serve(cmd[1], cmd[2], cmd[3], cmd[4], work, results)))
                if w.exiting:
                    return
            # "version" / "stop" outside serve: nothing to do (the next command names the version)
        except BaseException:
            results.put(("error", traceback.format_exc()))


class WorkerError(RuntimeError):
    pass


class PoolClosed(WorkerError):
    """The pool was closed while a task still waited for a worker's answer: the run is ending (a stop, or a failure
    elsewhere), not a failure of that task."""

    WORDS = "was stopped as the run ended while this task waited for it"


class _ClosedQueue:
    """What a closed pool holds instead of its queues: each use raises as a closed queue's does (ValueError), so a
    task still waiting for a worker ends as `PoolClosed`."""

    def put(self, *args, **kwargs):
        raise ValueError("the rollout worker pool is closed")

    get = put


_CLOSED = _ClosedQueue()


def resident_mb(pid: int | None = None) -> float | None:
    """A process's resident memory in MB (2**20 bytes; this process's by default), from Linux's /proc: None on
    systems without it, or for a process that is gone (reaped, or a zombie: its pages read 0)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20 if pages else None


def ended(exitcode: int | None) -> str:
    """How a child process ended, for an error line: its exit code and, when a signal ended it, which one, with the
    cause to look for when it is SIGKILL (which the kernel's out-of-memory killer sends) or a crash in native code."""
    if exitcode is None:  # asked before the process was reaped
        return "no exit code yet"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"exit code {exitcode}"
    why = {
        signal.SIGKILL: ": killed by the kernel's out-of-memory killer (see `dmesg`) or by another process",
        signal.SIGSEGV: ": a crash in native code",
        signal.SIGBUS: ": a crash in native code (or a shared-memory file cut short)",
        signal.SIGABRT: ": aborted by native code",
    }.get(-exitcode, "")
    return f"exit code {exitcode}, {name}{why}"


def _terminate(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()


class WorkerPool:
    """Spawned rollout workers plus the shared chunk queue. One pool per run, kept across iterations."""

    closed = False  # set first thing by `close`: a task still waiting for a worker then ends as `PoolClosed`

    def __init__(
        self,
        n_workers: int,
        spec: WorkerSpec,
        start_timeout_s: float = 300.0,
        wait_ready: bool = True,
        fork_server: bool = True,
    ):
        """Start the workers (`child_context`; spawned with `fork_server` false); with `wait_ready` false, return at
        once and let each worker's first command wait for it (its model load then overlaps the caller's own
        start-up work)."""
        ctx = child_context(
            modeling_module(model_type(spec.model_dir)), fork_server=fork_server and spec.engine != "vllm"
        )
        self.start_method = ctx.get_start_method()  # forkserver or spawn
        self.n = n_workers
        self.work = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n_workers)]
        self.results = [ctx.Queue() for _ in range(n_workers)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(w, spec, self.commands[w], self.work, self.results[w], ParentState.here()),
                name=f"lockstep-rollout-{w}",
                # a daemonic process may not start processes, and vLLM's engine runs in processes of its own; a
                # worker ends with the pool's `close` or, failing that, with its parent (`_exit_with_parent`)
                daemon=spec.engine != "vllm",
            )
            for w in range(n_workers)
        ]
        self.failed: str | None = None
        self.start_timeout_s = start_timeout_s
        self.ready = [False] * n_workers
        self.serve_sent = [threading.Event() for _ in range(n_workers)]
        with sigint_ignored():  # a Ctrl-C during a worker's start-up is the flow's to handle
            for p in self.procs:
                p.start()
        if spec.engine == "vllm":  # what `daemon` does for the other workers: none is left running (nor waited for
            # without end) when the interpreter exits, or the pool is dropped, without `close`
            mp_util.Finalize(self, _terminate, args=(list(self.procs),), exitpriority=10)
        if wait_ready:
            for w in range(n_workers):
                self._await_ready(w)

    def resident_mb(self) -> float | None:
        """The workers' processes' resident memory in MB, summed (a vLLM engine's own processes are not counted);
        None where /proc is not there, or once the pool is closed or a worker has died (asked through its handle,
        not its pid, which another process may have by then)."""
        if self.closed or not all(p.is_alive() for p in self.procs):
            return None
        sizes = [resident_mb(p.pid) for p in self.procs]
        return None if None in sizes else sum(sizes)

    def _await_ready(self, w: int) -> None:
        if not self.ready[w]:
            self._expect(w, "ready", self.start_timeout_s)
            self.ready[w] = True

    def _expect(self, w: int, kind: str, timeout_s: float):
        msg = self._next(w, timeout_s)
        if msg[0] != kind:
            raise WorkerError(f"rollout worker {w}: expected {kind!r}, got {msg[0]!r}")
        return msg[1]

    def enqueue(self, chunks: list[Chunk], last: bool = True) -> None:
        """Put chunks of an iteration on the shared queue, then, if they are its `last`, one stop marker per worker
        (a worker's `run` ends at it). With `last=False` the workers wait at the queue for more: the iteration's next
        round of dynamic sampling, or `enqueue([])` that ends it."""
        for c in chunks:
            self.work.put(c)
        for _ in range(self.n if last else 0):
            self.work.put(_STOP)

    def run(self, worker: int, version: int, source: str | SharedWeights, timeout_s: float = 3600.0) -> dict:
        """Have `worker` load `version` (if it holds another) from `source` (its checkpoint's path, or the shared
        weights) and drain the queue; blocks until it is done."""
        self._await_ready(worker)
        self.commands[worker].put(("iterate", version, source))
        return self._expect(worker, "done", timeout_s)

    def serve(
        self, worker: int, version: int, checkpoint_path: str, max_staleness: int, interrupt: bool, on_shard=None
    ) -> dict:
        """Async mode: `worker` generates chunks continuously until `stop_serving`; blocks until then.
        Each published shard's figures go to `on_shard` as it lands."""
        # queued before waiting for a starting worker, so that a `stop_serving` can never overtake it
        self.commands[worker].put(("serve", version, checkpoint_path, max_staleness, interrupt))
        self.serve_sent[worker].set()
        self._await_ready(worker)
        while True:
            msg_kind, body = self._next(worker)
            if msg_kind == "shard":
                if on_shard is not None:
                    on_shard(body)
                continue
            if msg_kind == "done":
                return body
            raise WorkerError(f"rollout worker {worker}: unexpected message {msg_kind!r}")

    def announce(self, version: int, checkpoint_path: str) -> None:
        """Tell every serving worker that `version` is promoted (it loads it between chunks or decoding steps)."""
        for q in self.commands:
            q.put(("version", version, checkpoint_path))

    def stop_serving(self, timeout_s: float = 60.0) -> None:
        """End every worker's serving loop. A stop queued before a worker's `serve` command would be ignored and
        the worker would serve forever, so each stop waits (up to `timeout_s`) until that command is queued."""
        for w, q in enumerate(self.commands):
            self.serve_sent[w].wait(timeout_s)
            q.put(("stop",))

    def _next(self, w: int, timeout_s: float = 3600.0):
        try:
            return self._next_message(w, timeout_s)
        except (WorkerError, ValueError, OSError):  # the worker it stopped, or a queue closed under the wait
            if self.closed:
                raise PoolClosed(f"rollout worker {w} {PoolClosed.WORDS}") from None
            raise

    def _next_message(self, w: int, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.results[w].get(timeout=0.5)
            except queue.Empty:
                if not self.procs[w].is_alive():
                    try:  # its last message (an error's traceback) can land after the wait above ran out
                        msg = self.results[w].get(timeout=1.0)
                    except queue.Empty:
                        raise WorkerError(self._died(w)) from None
                    return self._checked(w, msg)
                if time.monotonic() > deadline:
                    self.failed = f"rollout worker {w} gave no answer within {timeout_s:.0f} s"
                    raise WorkerError(self.failed) from None
                continue
            return self._checked(w, msg)

    def _checked(self, w: int, msg: tuple) -> tuple:
        """`msg` from worker `w`, or its error raised."""
        if msg[0] == "error":
            self.failed = f"rollout worker {w} failed:\n{msg[1]}"
            raise WorkerError(self.failed)
        return msg

    def _died(self, w: int) -> str:
        """Record worker `w`, gone without a message, as the pool's failure: which one, its pid, how it ended."""
        self.failed = f"rollout worker {w} (pid {self.procs[w].pid}) died ({ended(self.procs[w].exitcode)})"
        return self.failed

    def alive(self) -> bool:
        return self.failed is None and all(p.is_alive() for p in self.procs)

    def failure(self) -> str:
        """Why the pool is not `alive` (asked only then): the error a worker sent, else which worker died and how."""
        if self.failed is None:
            self._died(next(w for w, p in enumerate(self.procs) if not p.is_alive()))
        return self.failed

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell every worker to exit; one still alive `timeout_s` later is killed, and reaped. The queues are then
        closed and let go: each one's three named semaphores are removed as it goes (at once, or once its feeder
        thread has flushed), not at this process's exit, which a process that ends by a signal never reaches (a
        served run's, which Prefect ends by its own SIGTERM: Python's resource tracker then warned of 9 'leaked
        semaphore objects'). A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        for _ in self.procs:  # a worker waiting at the work queue for a round that will not come (dynamic sampling)
            self.work.put(_STOP)
        for q in self.commands:
            q.put(("exit",))
        for p in self.procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)  # reaped: closed means no worker is left running
        queues = [self.work, *self.commands, *self.results]
        self.work, self.commands, self.results = _CLOSED, [_CLOSED] * len(self.commands), [_CLOSED] * len(self.results)
        for q in queues:
            q.close()
            q.cancel_join_thread()
