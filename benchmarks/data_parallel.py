"""Data-parallel trainer ranks (`resources.train_ranks`) against one trainer on the same cores: the time of one batch.

A batch is the demo's: 32 groups of 8 responses (1-6 tokens) after prompts of 102-116 tokens, random tokens and
rewards, arriving in shards of `shard_groups` groups, each shard cut into micro-batches of at most 4096 tokens as the
train task cuts them (shared-prompt packing), on the demo model (0.8M parameters, fp32). One batch = every
micro-step and the optimizer step (with, for the ranks, the weights sent to rank 1 at the batch's start and the
gradients summed onto rank 0 at its end). Three trainers are built side by side in this process, from the same
weights, and fed the same batches in turn (A B C C B A ...):

- `one_rank_2_threads`: one `PolicyTrainer` with 2 torch threads (this machine's cores);
- `two_ranks_1_thread`: a `DataParallelTrainer` of 2 ranks (rank 1 spawned, gloo) with 1 thread each;
- `one_rank_1_thread`: one `PolicyTrainer` with 1 thread: what each rank has.

One JSON line per `shard_groups` (4, the demo's, and 8) with `batch_s` of each (median of `--repeats` batches after
one warm-up batch), `samples_per_s` of each, `speedup` = one_rank_2_threads / two_ranks_1_thread batch time, and
`max_abs_diff`: the largest parameter difference between the one-rank (2 threads) and two-rank trainers after all
those batches (their equality, up to the order of additions, is what the invariant test asserts).

With `--pipeline`, then the demo config through the real flow (tracking and evaluation off, as `benchmarks.pipeline`
runs it), one JSON line per configuration with `iteration_s` and the other medians of `benchmarks.pipeline` over
`--iterations` measured iterations (after 2 warm-up ones) of 2 runs each, the configurations in turn (A B C D D C B A):
sync with the rollout on 2 threads and training on 1 rank x 2 threads or 2 ranks x 1 thread; periodic as the demo
runs it (rollout 1 thread, 1 trainer rank of 1 thread that borrows the rollout's thread once rollouts are in) and with
2 trainer ranks of 1 thread each (no borrowing: both ranks run beside the rollout worker while it generates).

With `--shard-optimizer`, instead: the two-rank trainer with the optimizer replicated (rank 0 holds every AdamW
moment and steps alone) against the same with it sharded (`resources.shard_optimizer`: each rank steps half), on the
demo's batches in shards of 4 groups. One process holds one process group, so the two are built in turn, a fresh
trainer per round (A B B A ...), each round one warm-up batch then one timed batch. One JSON line with `batch_s` and
`optimizer_step_s` of each (medians over `--repeats` rounds), rank 0's AdamW state in elements
(`rank0_state_elements`), and `max_abs_diff` between the two after the same batches from the same weights.

    PYTHONPATH=. .venv/bin/python -m benchmarks.data_parallel [--repeats 7] [--pipeline [--iterations 8] [--dir DIR]]
    PYTHONPATH=. .venv/bin/python -m benchmarks.data_parallel --shard-optimizer [--repeats 7]
"""

from __future__ import annotations

import copy
import statistics

from benchmarks.common import MAX_ITERATIONS, check_dir, check_range, emit, median_time, parser

SHARD_GROUPS = (4, 8)
BUDGET = 4096  # the demo's train.micro_batch_tokens
PROMPTS, GROUP = 32, 8


def _batch(tok_count: int, seed: int):
    import torch

    from models.trainer import RolloutGroup

    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(PROMPTS):
        p = int(torch.randint(102, 117, (1,), generator=gen))
        prompt = torch.randint(4, tok_count, (p,), generator=gen).tolist()
        lens = torch.randint(1, 7, (GROUP,), generator=gen).tolist()
        responses = [torch.randint(4, tok_count, (n,), generator=gen).tolist() for n in lens]
        rewards = torch.randint(0, 3, (GROUP,), generator=gen).div(2).tolist()
        behaviour = [(-1.0 - torch.rand(n, generator=gen)).tolist() for n in lens]
        groups.append(RolloutGroup(prompt, responses, rewards, behaviour, [[0] * n for n in lens]))
    return groups


PIPELINE = {
    "sync_1_rank": {"pipeline.mode": "sync", "resources.rollout_threads": 2, "resources.train_threads": 2},
    "sync_2_ranks": {
        "pipeline.mode": "sync",
        "resources.rollout_threads": 2,
        "resources.train_threads": 1,
        "resources.train_ranks": 2,
    },
    "periodic_1_rank": {"pipeline.mode": "periodic"},  # the demo's resources
    "periodic_2_ranks": {
        "pipeline.mode": "periodic",
        "resources.train_ranks": 2,
        "resources.borrow_rollout_threads": False,
    },
}


def pipeline(iterations: int, directory: str | None) -> None:
    """The demo config through the real flow in each of `PIPELINE`'s configurations (see the module's docstring)."""
    import time

    from benchmarks.common import work_dir
    from benchmarks.pipeline import run, summarise

    warmup, stamp = 2, time.strftime("%Y%m%d%H%M%S")
    names = list(PIPELINE)
    order = names + names[::-1]
    measured: dict[str, list[dict]] = {name: [] for name in names}
    with work_dir(directory) as tmp:
        for i, name in enumerate(order):
            measured[name] += run(tmp, f"dp-{name}-{i}-{stamp}", PIPELINE[name], iterations + warmup)[warmup:]
    for name in names:
        emit(
            benchmark="data_parallel",
            configuration=name,
            **summarise(PIPELINE[name]["pipeline.mode"], measured[name], 0),
        )


def _demo_micro_batches(tok_count: int, seed: int, shard_groups: int) -> list:
    """A demo-sized batch in shards of `shard_groups` groups, cut into micro-batches as the train task cuts them."""
    from tasks.iteration import micro_batches

    groups = _batch(tok_count, seed)
    shards = [groups[i : i + shard_groups] for i in range(0, len(groups), shard_groups)]
    return [mb for shard in shards for mb in micro_batches(shard, BUDGET, shared=True)]


def shard_optimizer(model, tok_count: int, kw: dict, repeats: int) -> None:
    import time

    import torch

    from models.data_parallel import state_numel
    from tasks.train_ranks import DataParallelTrainer

    torch.set_num_threads(1)
    batch_s: dict[str, list[float]] = {"replicated": [], "sharded": []}
    step_s: dict[str, list[float]] = {"replicated": [], "sharded": []}
    state, final = {}, {}
    for r in range(repeats):
        for name in ("replicated", "sharded") if r % 2 == 0 else ("sharded", "replicated"):
            trainer = DataParallelTrainer(
                copy.deepcopy(model), None, ranks=2, threads=1, shard_optimizer=name == "sharded", **kw
            )
            try:
                for b in range(2):  # a warm-up batch (the first sync, AdamW's state allocated), then the timed one
                    mbs = _demo_micro_batches(tok_count, 1000 * r + b, 4)
                    t0 = time.perf_counter()
                    for mb in mbs:
                        trainer.micro_step(mb)
                    t1 = time.perf_counter()
                    trainer.optimizer_step()
                    t2 = time.perf_counter()
                if r == 0:
                    state[name] = state_numel(trainer.shard.optimizer if trainer.shard else trainer.optimizer)
                    final[name] = [p.detach().clone() for p in trainer.model.parameters()]
            finally:
                trainer.close()
            batch_s[name].append(t2 - t0)
            step_s[name].append(t2 - t1)
    diff = max(float((p - q).abs().max()) for p, q in zip(final["replicated"], final["sharded"], strict=True))
    emit(
        repeats=repeats,
        parameters=sum(p.numel() for p in model.parameters()),
        batch_s={name: statistics.median(ts) for name, ts in batch_s.items()},
        optimizer_step_s={name: statistics.median(ts) for name, ts in step_s.items()},
        rank0_state_elements=state,
        max_abs_diff=diff,
    )


def main(argv: list[str] | None = None) -> None:
    ap = parser("benchmarks.data_parallel", __doc__)
    ap.add_argument("--repeats", type=int, default=7, help="timed batches per trainer and shard size (default 7)")
    ap.add_argument("--pipeline", action="store_true", help="then the demo config through the flow (minutes)")
    ap.add_argument("--iterations", type=int, default=8, help="--pipeline: measured iterations per run (default 8)")
    ap.add_argument("--dir", default=None, help="--pipeline: work directory (reusing one reuses its bootstrap)")
    ap.add_argument("--shard-optimizer", action="store_true", help="replicated vs sharded optimizer on two ranks")
    args = ap.parse_args(argv)
    check_range(ap, "--repeats", args.repeats, 1, 1000)
    check_range(ap, "--iterations", args.iterations, 1, MAX_ITERATIONS - 2)
    check_dir(ap, args.dir)

    import torch

    from configs.schema import Config
    from models.tiny import build_char_tokenizer, build_tiny_model
    from models.trainer import PolicyTrainer
    from tasks.train_ranks import DataParallelTrainer

    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), **Config().model.tiny.model_dump(), seed=0)
    kw = dict(lr=2e-4, grad_clip=1.0, pad_token_id=tok.pad_token_id, shared_prompt=True)
    if args.shard_optimizer:
        shard_optimizer(model, len(tok), kw, args.repeats)
        return
    trainers = {
        "one_rank_2_threads": (PolicyTrainer(copy.deepcopy(model), None, **kw), 2),
        "two_ranks_1_thread": (DataParallelTrainer(copy.deepcopy(model), None, ranks=2, threads=1, **kw), 1),
        "one_rank_1_thread": (PolicyTrainer(copy.deepcopy(model), None, **kw), 1),
    }
    try:
        for shard_groups in SHARD_GROUPS:
            times: dict[str, list[float]] = {name: [] for name in trainers}
            order = list(trainers)
            for r in range(args.repeats + 1):  # the first round warms up
                mbs = _demo_micro_batches(len(tok), 100 * shard_groups + r, shard_groups)
                for name in order if r % 2 == 0 else order[::-1]:
                    trainer, threads = trainers[name]
                    torch.set_num_threads(threads)

                    def batch(trainer=trainer, mbs=mbs) -> None:
                        for mb in mbs:
                            trainer.micro_step(mb)
                        trainer.optimizer_step()

                    t = median_time(batch, repeats=1, warmup=0)
                    if r > 0:
                        times[name].append(t)
            batch_s = {name: statistics.median(ts) for name, ts in times.items()}
            a, b = trainers["one_rank_2_threads"][0].model, trainers["two_ranks_1_thread"][0].model
            diff = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
            emit(
                shard_groups=shard_groups,
                micro_batch_tokens=BUDGET,
                micro_batches=len(mbs),
                repeats=args.repeats,
                batch_s=batch_s,
                samples_per_s={name: PROMPTS * GROUP / s for name, s in batch_s.items()},
                speedup=batch_s["one_rank_2_threads"] / batch_s["two_ranks_1_thread"],
                max_abs_diff=diff,
            )
    finally:
        trainers["two_ranks_1_thread"][0].close()
    if args.pipeline:
        pipeline(args.iterations, args.dir)


if __name__ == "__main__":
    main()
