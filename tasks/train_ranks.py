"""Data-parallel training (`resources.train_ranks`): the trainer of the flow's process is rank 0, and N - 1 spawned
processes are ranks 1..N-1, each with a whole replica of the policy (and of the reference and proximal models).

Rank 0 cuts each micro-batch, as it is formed, into one part per rank (whole groups, each to the rank with the
fewest packed tokens so far in the batch: `split_groups`), sends the other ranks theirs and runs its own in the
caller's thread while they run theirs. At the optimizer step every rank's gradient and loss denominator are summed
onto rank 0 (`models.data_parallel`), which alone holds optimizer state and steps; the new weights reach the other
ranks by a broadcast at the start of the next batch. So the batch's gradient is the same sum
as in one process (only the order of floating-point additions differs), and everything that reads or writes the
trainer's model or optimizer (checkpoints, shared weights, resume) keeps working on rank 0 alone.

With `shard_optimizer` (`resources.shard_optimizer`, ZeRO stage 1) each rank instead holds AdamW's state for its
1/N slice of the parameters (`models.data_parallel.OptimizerShard`): rank 0 sends every rank the batch's scale and
AdamW's settings, each sums the gradients, steps its slice and gathers the others' into its whole replica, so no
broadcast is needed at the next batch (only when rank 0's weights were written in between: a restore).
Rank 0's `optimizer` is then a `ShardedOptimizer`, whose state dict is gathered from the ranks in the format of one
AdamW over the model: checkpoints and resume work as before, and either way round.

Collectives run over `torch.distributed`: gloo on CPU, NCCL on CUDA (rank r on device r), HCCL on Ascend. Commands
and figures travel over one pipe per rank. A rank that fails a micro-step is named at the optimizer step, which no
rank applies, and training goes on; a rank that dies (rank 0 watches the others while it waits for a collective) or
stops answering, or any other break in the protocol, leaves the trainer refusing every later call.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from models.data_parallel import OptimizerShard, broadcast_weights, sum_gradients
from models.rewards import error_line
from models.trainer import LossSettings, PolicyTrainer, group_tokens
from tasks.workers import ParentState, child_context, ended, enter_child, sigint_ignored

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class TrainRankError(RuntimeError):
    """A training rank other than 0 died, failed, or could not start."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its replica (its weights come from rank 0's first broadcast)."""

    model_class: type
    model_config: object  # the policy's transformers config
    attn_implementation: str
    dtypes: dict[str, torch.dtype]  # per parameter: a model may mix them (fp32 norms beside bf16 weights)
    trainable: dict[str, bool]  # per parameter: requires_grad
    device_type: str
    threads: int
    has_ref: bool
    loss: LossSettings
    pad_token_id: int
    shared_prompt: bool
    lr: float
    keep_dropout: bool
    shard_optimizer: bool = False
    activation_checkpointing: bool = False
    logits_chunk_tokens: int | None = None


def rank_spec(trainer: PolicyTrainer, threads: int, shard_optimizer: bool) -> RankSpec:
    """What the other ranks build their replicas of `trainer` (rank 0's) from."""
    model = trainer.model
    return RankSpec(
        model_class=type(model),
        model_config=model.config,
        attn_implementation=model.config._attn_implementation,
        dtypes={name: p.dtype for name, p in model.named_parameters()},
        trainable={name: p.requires_grad for name, p in model.named_parameters()},
        device_type=next(model.parameters()).device.type,
        threads=threads,
        has_ref=trainer.ref_model is not None,
        loss=trainer.loss,
        pad_token_id=trainer.pad_token_id,
        shared_prompt=trainer.shared_prompt,
        lr=trainer.peak_lr,
        keep_dropout=trainer.keep_dropout,
        shard_optimizer=shard_optimizer,
        activation_checkpointing=trainer.activation_checkpointing,
        logits_chunk_tokens=trainer.logits_chunk_tokens,
    )


def _rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r's device (accelerator r), made the process's current one: NCCL and HCCL build their communicators
    on the current device, which is device 0 in a new process."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers the device type; a spawned rank starts from a bare interpreter)
    device = torch.device(device_type, rank)
    torch.get_device_module(device).set_device(device)
    return device


def signature(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """Name, shape, dtype and trainability of every parameter, in `parameters()` order: what the collectives assume
    alike on every rank."""
    return [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]


def _replica(spec: RankSpec, device: torch.device) -> torch.nn.Module:
    model = spec.model_class(spec.model_config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # one rank 0 lacks is left as built: the signatures then differ
            p.data = p.data.to(spec.dtypes.get(name, p.dtype))
            p.requires_grad_(spec.trainable.get(name, p.requires_grad))
    model.set_attn_implementation(spec.attn_implementation)
    return model.to(device)


def _build_replica(spec: RankSpec, device: torch.device) -> PolicyTrainer:
    model = _replica(spec, device)
    ref = _replica(spec, device).requires_grad_(False) if spec.has_ref else None
    return PolicyTrainer(
        model,
        ref,
        lr=spec.lr,
        grad_clip=None,
        loss=spec.loss,
        pad_token_id=spec.pad_token_id,
        shared_prompt=spec.shared_prompt,
        keep_dropout=spec.keep_dropout,
        activation_checkpointing=spec.activation_checkpointing,
        logits_chunk_tokens=spec.logits_chunk_tokens,
    )


def _rank_main(rank: int, world: int, port: int, spec: RankSpec, conn, parent: ParentState) -> None:  # in the child
    enter_child(parent)  # Ctrl-C reaches the whole process group: rank 0 stops the ranks
    torch.set_num_threads(spec.threads)
    try:
        device = _rank_device(spec.device_type, rank)
        trainer = _build_replica(spec, device)
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        conn.send(("built", signature(trainer.model)))  # connected to rank 0's store: what is left is the rendezvous
        dist.init_process_group(
            BACKENDS[spec.device_type], store=store, rank=rank, world_size=world, timeout=timedelta(minutes=10)
        )
        shard = OptimizerShard(trainer.model, lr=spec.lr) if spec.shard_optimizer else None
        conn.send(("joined", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve(trainer, conn, shard)
    except EOFError:  # rank 0's process is gone (killed): nothing left to train for
        return


def _serve(trainer: PolicyTrainer, conn, shard: OptimizerShard | None = None) -> None:
    """A rank's command loop, until `close`. `shard`: this rank's part of the optimizer, when the ranks shard it."""
    error = None  # a failed micro-step: reported at the next collect; the rank skips micro-steps until then
    while True:
        cmd = conn.recv()
        if cmd[0] == "close":
            dist.destroy_process_group()
            return
        if cmd[0] == "micro":
            if error is None:
                try:
                    trainer.micro_step(cmd[1], cmd[2], behavior_old=cmd[3])
                except Exception:
                    error = traceback.format_exc()
        elif cmd[0] == "sync":  # (sync, include the reference, prox version or None)
            modules = [trainer.model]
            if cmd[2] is not None:
                modules.append(trainer.prox_model)
                trainer.prox_version = cmd[2]
            if cmd[1]:
                modules.append(trainer.ref_model)
            broadcast_weights(modules)
            if shard is not None:
                shard.refresh()
        elif cmd[0] == "optimizer_state":  # gathered onto rank 0 (a checkpoint)
            shard.gather_state()
        elif cmd[0] == "load_optimizer_state":  # scattered from rank 0 (a resume)
            shard.load_state(None)
        elif cmd[0] == "collect":
            conn.send(("collected", error, trainer.accumulators()))
            verdict = conn.recv()
            if verdict[0] == "reduce":
                sum_gradients(trainer.model)
            elif verdict[0] == "shard_step":  # (shard_step, scale, max norm, AdamW settings, forced, prox version)
                _, scale, max_norm, settings, forced, prox_version = verdict
                if math.isfinite(shard.reduce(scale, max_norm, forced)):
                    trainer._batch_version = prox_version
                    trainer._keep_prox()
                    shard.apply(settings)
            else:  # discard: the batch failed somewhere (or close: rank 0 stops after a failure)
                trainer.optimizer.zero_grad(set_to_none=True)
            trainer._reset_accumulators()
            error = None
            if verdict[0] == "close":
                dist.destroy_process_group()
                return


def split_groups(groups: list, loads: list[int], shared: bool) -> list[list]:
    """One part of `groups` per rank: each group, in order, to the rank with the fewest packed tokens so far in the
    batch (`loads`, updated in place; ties to rank 1, 2, ... before rank 0, which sends the others their parts before
    it trains its own). Over a batch the ranks' tokens stay within one group of each other, also when every
    micro-batch is a single group; and the parts are a function of the batch's micro-batches alone, so a replay of
    the same shards adds up the same sums."""
    order = [*range(1, len(loads)), 0]
    out: list[list] = [[] for _ in loads]
    for g in groups:
        rank = min(order, key=lambda r: loads[r])
        out[rank].append(g)
        loads[rank] += group_tokens(g, shared)
    return out


class DataParallelTrainer(PolicyTrainer):
    """Rank 0 of `ranks` data-parallel trainer ranks (see the module's docstring); its model and optimizer are the
    run's, as a `PolicyTrainer`'s are."""

    def __init__(
        self,
        model,
        ref_model,
        *,
        ranks: int,
        threads: int,
        shard_optimizer: bool = False,
        start_timeout_s: float = 300.0,
        reply_timeout_s: float = 1800.0,
        **kwargs,
    ):
        """`shard_optimizer`: each rank holds and steps AdamW for its slice of the parameters (`OptimizerShard`)
        instead of rank 0 for all of them; `optimizer` is then a `ShardedOptimizer`. `start_timeout_s`: for each
        rank to build its replica and join; `reply_timeout_s`: for a rank to finish its queued micro-steps and answer
        the optimizer step's `collect` (a rank alive but stuck is named after it)."""
        super().__init__(model, ref_model, **kwargs)
        if ranks < 2:
            raise ValueError(f"a data-parallel trainer needs at least 2 ranks, got {ranks}")
        if dist.is_initialized():
            raise TrainRankError(
                "this process already belongs to a torch.distributed process group; a data-parallel trainer makes "
                "its own: close the other trainer (or use resources.train_ranks=1)"
            )
        param = next(model.parameters())
        device_type = param.device.type
        if device_type not in BACKENDS:
            raise ValueError(f"data-parallel training on {device_type} is not supported (cpu, cuda or npu)")
        if device_type != "cpu" and (param.device.index or 0) != 0:
            raise ValueError(f"rank 0 of data-parallel training runs on {device_type}:0, not {param.device}")
        self.world = ranks
        self.start_timeout_s = start_timeout_s
        self.reply_timeout_s = reply_timeout_s
        spec = rank_spec(self, threads, shard_optimizer)
        self._store = dist.TCPStore("127.0.0.1", 0, ranks, True, wait_for_workers=False, timeout=timedelta(seconds=60))
        ctx = child_context(spec.model_class.__module__)
        self._conns, self._procs = [], []
        self._closed = False
        self._broken: str | None = None
        with sigint_ignored():  # a Ctrl-C during a rank's start-up is rank 0's to handle (`sigint_ignored`)
            for rank in range(1, ranks):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_rank_main,
                    args=(rank, ranks, self._store.port, spec, child_end, ParentState.here()),
                    name=f"lockstep-train-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
        try:
            own = signature(model)
            for rank in range(1, ranks):
                theirs = self._receive(rank, "built", start_timeout_s)[1]
                if theirs != own:
                    diff = next(((a, b) for a, b in zip(own, theirs, strict=False) if a != b), None)
                    counts = f"{len(theirs)} parameters, not {len(own)}; " if len(theirs) != len(own) else ""
                    raise TrainRankError(
                        f"trainer rank {rank} built a replica unlike rank 0's model ({counts}first difference, rank "
                        f"0's then rank {rank}'s: {diff}): its class or config does not rebuild the model"
                    )
            self._rendezvous(BACKENDS[device_type])
            self.shard = OptimizerShard(model, lr=self.peak_lr) if shard_optimizer else None
        except BaseException:
            self._stop_ranks(wait_s=0.0)  # building or in the rendezvous, a rank reads no `close`: killed at once
            if dist.is_initialized():  # joined, then failed: a later trainer in this process makes its own group
                dist.destroy_process_group()
            raise
        if self.shard is not None:
            self.optimizer = ShardedOptimizer(self, self.optimizer)
        self._synced_ref = False
        # rank 0's weights may change between batches (restore, bootstrap): replicas are sent them per batch; with a
        # sharded optimizer every rank steps the same weights, so they are sent only when rank 0's have changed since
        self._synced_print: list | None = None  # `_print()` when the ranks last had rank 0's weights; None: unsent
        self._batch_start = True
        self._verdict: tuple = ("discard",)  # the last optimizer step's, as sent to the ranks
        self._refusal: RuntimeError | None = None  # why a sharded step was refused before any rank took part
        self.rank_micro_batches = [0] * ranks  # the last batch's micro-steps per rank
        self.rank_tokens = [0] * ranks  # and its packed tokens per rank (`split_groups` balances them)

    def _rendezvous(self, backend: str) -> None:
        """Join the process group, in a thread, while the other ranks are watched: each reports "joined" once it is
        in, and one that dies or fails first is named at once (rank 0 alone would wait out the store's timeout)."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(
                    backend, store=self._store, rank=0, world_size=self.world, timeout=timedelta(minutes=10)
                )
            except BaseException as e:  # handed to the caller's thread
                failure.append(e)

        thread = threading.Thread(target=join, name="lockstep-train-rendezvous", daemon=True)
        thread.start()
        for rank in range(1, self.world):
            self._receive(rank, "joined", self.start_timeout_s)
        thread.join(timeout=self.start_timeout_s)
        if failure or thread.is_alive():
            raise TrainRankError(f"rank 0 could not join the trainer ranks' process group: {failure or 'timed out'}")

    def _died(self, rank: int, detail: str = "") -> TrainRankError:
        """The error of rank `rank` gone; the trainer refuses every later call with it (a collective needs all)."""
        proc = self._procs[rank - 1]
        self._broken = f"trainer rank {rank} (pid {proc.pid}) died ({ended(proc.exitcode)}){detail}"
        return TrainRankError(self._broken)

    def _fail(self, e: BaseException) -> None:
        """Mark the trainer unusable after `e` broke the protocol midway (a timeout, an unexpected message, a failed
        collective, an interrupt): the ranks may now wait for different things, and the next collective would hang."""
        if self._broken is None:
            self._broken = error_line(e)

    def _wait_for(self, what: str, work) -> None:
        """Wait for a collective while watching the other ranks: one that dies is named (gloo would raise on its own;
        NCCL would wait out its timeout and have the watchdog end this process)."""
        pause = 0.0001
        while not work.is_completed():
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():
                    raise self._died(rank, f" during {what}")
            time.sleep(pause)
            pause = min(0.002, pause * 2)
        work.wait()  # raises what the collective failed with

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TrainRankError(f"the data-parallel trainer cannot go on: {self._broken}")

    def _receive(self, rank: int, kind: str, timeout_s: float):
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise self._died(rank)
            if time.monotonic() > deadline:
                raise TrainRankError(f"trainer rank {rank} (pid {proc.pid}) sent no {kind!r} within {timeout_s:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            proc.join(timeout=5)
            raise self._died(rank) from None
        if msg[0] == "error":
            raise TrainRankError(f"trainer rank {rank} failed:\n{msg[1]}")
        if msg[0] != kind:
            raise TrainRankError(f"trainer rank {rank} sent {msg[0]!r} where {kind!r} was expected")
        return msg

    def _send(self, rank: int, msg) -> None:
        proc = self._procs[rank - 1]
        if not proc.is_alive():
            raise self._died(rank)
        try:
            self._conns[rank - 1].send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self._died(rank) from None

    def _sync(self) -> None:
        """Rank 0's weights (and the proximal model's, and once the reference's) to every rank."""
        prox = self.prox_version if self.prox_model is not None else None
        send_ref = not self._synced_ref and self.ref_model is not None
        modules = [self.model] + ([self.prox_model] if prox is not None else []) + ([self.ref_model] * send_ref)
        try:
            for rank in range(1, self.world):
                self._send(rank, ("sync", send_ref, prox))
            self._collective("the weights' broadcast", broadcast_weights, modules)
        except BaseException as e:
            self._fail(e)
            raise
        if self.shard is not None:
            self.shard.refresh()
        self._synced_ref = True
        self._synced_print = self._print()

    def _print(self) -> list[tuple[int, int]]:
        """Where the policy's and proximal model's weights live and how often they were changed in place: differs
        once anything (a restore, a bootstrap: `load_state_dict`, `copy_`) has written them since the last sync or
        sharded step; looked at as a batch starts. Writes that bypass autograd's version counter (`p.data.copy_`, numpy
        views) are not seen."""
        if self.shard is not None and any(
            a is not b for a, b in zip(self.shard.params, self.model.parameters(), strict=True)
        ):
            raise TrainRankError(
                "the policy's parameters were replaced (e.g. load_state_dict(assign=True)) after its sharded "
                "optimizer was built: load weights into the parameters in place"
            )
        modules = [self.model] + ([self.prox_model] if self.prox_model is not None else [])
        return [(p.data_ptr(), p._version) for m in modules for p in m.parameters()]

    def micro_step(self, groups, version: int = 0, behavior_old: bool = False) -> dict[str, float]:
        """The micro-batch cut into one part per rank (`split_groups`): the other ranks' parts sent, rank 0's run
        here while they run theirs. Returns the response tokens and samples run (not the skipped groups')."""
        if not groups:
            raise ValueError("micro_step needs at least one group")
        self._check_usable()
        # a write of rank 0's weights (a restore) is looked for once a batch, where the replicated trainer sends them
        if self._synced_print is None or (
            self._batch_start and self.shard is not None and self._synced_print != self._print()
        ):
            self._sync()
        if self._batch_start:
            self._batch_start = False
            self.rank_micro_batches = [0] * self.world
            self.rank_tokens = [0] * self.world
        self._batch_version = version
        run, idle = self.partition(groups)  # zero advantage: only counted, so rank 0 keeps them at no load
        parts = split_groups(run, self.rank_tokens, self.shared_prompt)
        for rank in range(1, self.world):
            if parts[rank]:
                self._send(rank, ("micro", parts[rank], version, behavior_old))
                self.rank_micro_batches[rank] += 1
        if parts[0] or idle:
            super().micro_step(parts[0] + idle, version, behavior_old)
            self.rank_micro_batches[0] += bool(parts[0])
        return {  # as `PolicyTrainer.micro_step`: what was run, over every rank
            "tokens": float(sum(len(r) for g in run for r in g.responses)),
            "samples": sum(len(g.responses) for g in run),
        }

    def optimizer_step(self) -> dict[str, float]:
        """Every rank's accumulators summed onto rank 0; then either every gradient summed onto rank 0 and
        `PolicyTrainer.optimizer_step`, or (sharded optimizer) every rank told the batch's scale and settings and
        `_step` run by all of them."""
        self._check_usable()
        if self.shard is None:  # rank 0 alone steps: its new weights go out with the next batch
            self._synced_print = None
        self._batch_start = True
        try:
            replies = []
            for rank in range(1, self.world):
                self._send(rank, ("collect",))
            for rank in range(1, self.world):
                replies.append(self._receive(rank, "collected", self.reply_timeout_s))
            failed = [(rank, msg[1]) for rank, msg in enumerate(replies, start=1) if msg[1] is not None]
            if not failed:
                for msg in replies:
                    self.merge_accumulators(msg[2])
            verdict = ("discard",) if failed else ("reduce",) if self.shard is None else self._shard_verdict()
            self._verdict = verdict
            for rank in range(1, self.world):
                self._send(rank, verdict)
            if verdict[0] == "reduce":
                self._collective("the gradient sum", sum_gradients, self.model)
        except BaseException as e:
            self._fail(e)
            raise
        if verdict[0] == "discard":  # every rank dropped its gradient: the trainer goes on with the next batch
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_accumulators()
            if not failed:
                raise self._refusal  # a sharded step refused for no samples or tokens: what one process raises
            rank, error = failed[0]
            raise TrainRankError(f"trainer rank {rank} failed a micro-step; the step was not applied:\n{error}")
        figures = super().optimizer_step()
        figures["train/ranks"] = float(self.world)
        return figures

    def _shard_verdict(self) -> tuple:
        """What every rank needs for its part of a sharded step: the batch's scale, the clip norm, AdamW's settings,
        the parameters to step on a zero gradient, the version the proximal weights will hold; ("discard",) when
        the batch cannot be stepped (no samples or tokens)."""
        try:
            scale = self._batch_scale()
        except RuntimeError as e:
            self._refusal = e
            return ("discard",)
        forced = None  # with skipped groups: stepped on a zero gradient if no rank has any (`PolicyTrainer._step`)
        if self._sums["train/skipped_groups"]:
            trainable = [i for i, p in enumerate(self.shard.params) if p.requires_grad]
            forced = sorted(self.shard.stepped) or trainable
        settings = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        max_norm = self.grad_clip if self.grad_clip else math.inf
        return ("shard_step", scale, max_norm, settings, forced, self._batch_version)

    def _step(self, scale: float) -> float:
        if self.shard is None:
            return super()._step(scale)
        _, _, max_norm, settings, forced, _ = self._verdict
        try:
            norm = self._collective("the sharded gradient sum", self.shard.reduce, scale, max_norm, forced)
            if not math.isfinite(norm):
                return norm
            self._keep_prox()
            self._collective("the sharded step", self.shard.apply, settings)
        except BaseException as e:
            self._fail(e)
            raise
        self._synced_print = self._print()
        return norm

    def _optimizer_collective(self, command: str, what: str, method: str, *args):
        """`self.shard.<method>(*args)` on rank 0 while the other ranks run theirs (`command`)."""
        self._check_usable()
        try:
            for rank in range(1, self.world):
                self._send(rank, (command,))
            return self._collective(what, getattr(self.shard, method), *args)
        except BaseException as e:
            self._fail(e)
            raise

    def _collective(self, what: str, fn, *args):
        """`fn(*args)`, a collective every rank has been told to join, waited for by `_wait_for`; a rank gone
        meanwhile is named (gloo also raises at once when a peer's connection closes)."""
        try:
            return fn(*args, wait=partial(self._wait_for, what))
        except TrainRankError:  # `_wait_for` named the rank already
            raise
        except RuntimeError as e:
            for rank, proc in enumerate(self._procs, start=1):
                proc.join(timeout=1.0)
                if not proc.is_alive():
                    raise self._died(rank, f" during {what}: {error_line(e)}") from e
            raise

    def _stop_ranks(self, wait_s: float = 10.0) -> None:
        """Ask every rank to close, give them `wait_s` in all to leave the process group, then kill what is left."""
        for conn in self._conns:
            try:
                conn.send(("close",))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass
        deadline = time.monotonic() + wait_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_ranks()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class ShardedOptimizer:
    """Rank 0's `optimizer` when the ranks shard AdamW: the param groups (learning rate, betas, weight decay) are
    here and sent with each step; the state lives on the ranks. `state_dict` gathers it as one AdamW over the whole
    model holds it and `load_state_dict` sends each rank its part, so checkpoints are the same files with or without
    sharding, and a run resumes with either."""

    def __init__(self, trainer: DataParallelTrainer, template: torch.optim.Optimizer):
        self._trainer = trainer
        self._template = template  # an AdamW over the model's parameters that never steps: its groups, its format
        self.param_groups = template.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._template.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state = self._trainer._optimizer_collective("optimizer_state", "the optimizer state's gather", "gather_state")
        return {"state": state, "param_groups": self._template.state_dict()["param_groups"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Checked here first, as torch's `load_state_dict` checks it, so that a bad state is refused before any rank
        is asked to take its part (the trainer stays usable)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(o["params"]) for g, o in zip(groups, self.param_groups, strict=False)
        ):
            raise ValueError("the optimizer state does not match the model's parameters")
        params = self._trainer.shard.params
        state = {int(i): st for i, st in state_dict["state"].items()}
        for i, st in state.items():
            if not 0 <= i < len(params) or not params[i].requires_grad:
                raise ValueError(f"optimizer state for parameter {i}, which the model has no trainable one for")
            missing = [k for k in ("step", *OptimizerShard.STATE_KEYS) if k not in st]
            if missing:
                raise ValueError(f"the optimizer state of parameter {i} lacks {missing}")
            for key in OptimizerShard.STATE_KEYS:
                if st[key].numel() != params[i].numel():
                    raise ValueError(
                        f"the optimizer state {key} of parameter {i} has {st[key].numel()} elements, the parameter "
                        f"{params[i].numel()}"
                    )
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._trainer._optimizer_collective(
            "load_optimizer_state", "the optimizer state's scatter", "load_state", state
        )
