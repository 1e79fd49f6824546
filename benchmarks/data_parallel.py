"""Data-parallel trainer ranks (`resources.train_ranks`) against one trainer on the same cores: the time of one batch.

A batch is the demo's: 32 groups of 8 responses (1-6 tokens) after prompts of 102-116 tokens, random tokens and
rewards, cut into micro-batches of `--micro-batch-tokens` as the train task cuts them (shared-prompt packing), on the
demo model (0.8M parameters, fp32). One batch = every micro-step and the optimizer step (with, for the ranks, the
weights sent to rank 1 at the batch's start and the gradients summed onto rank 0 at its end). Three trainers are
built side by side in this process, from the same weights, and fed the same batches in turn (A B C C B A ...):

- `one_rank_2_threads`: one `PolicyTrainer` with 2 torch threads (this machine's cores);
- `two_ranks_1_thread`: a `DataParallelTrainer` of 2 ranks (rank 1 spawned, gloo) with 1 thread each;
- `one_rank_1_thread`: one `PolicyTrainer` with 1 thread: what each rank has.

One JSON line per micro-batch budget with `batch_s` of each (median of `--repeats` batches after one warm-up batch),
`samples_per_s` of each, `speedup` = one_rank_2_threads / two_ranks_1_thread batch time, and `max_abs_diff`: the
largest parameter difference between the one-rank (2 threads) and two-rank trainers after all those batches
(their equality, up to the order of additions, is what the invariant test asserts).

    PYTHONPATH=. .venv/bin/python -m benchmarks.data_parallel [--repeats 7]
"""

from __future__ import annotations

import copy
import statistics

from benchmarks.common import check_range, emit, median_time, parser

BUDGETS = (4096, 1024)
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


def main(argv: list[str] | None = None) -> None:
    ap = parser("benchmarks.data_parallel", __doc__)
    ap.add_argument("--repeats", type=int, default=7, help="timed batches per trainer and budget (default 7)")
    args = ap.parse_args(argv)
    check_range(ap, "--repeats", args.repeats, 1, 1000)

    import torch

    from configs.schema import Config
    from models.tiny import build_char_tokenizer, build_tiny_model
    from models.trainer import PolicyTrainer
    from tasks.iteration import micro_batches
    from tasks.train_ranks import DataParallelTrainer

    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), **Config().model.tiny.model_dump(), seed=0)
    kw = dict(lr=2e-4, grad_clip=1.0, pad_token_id=tok.pad_token_id, shared_prompt=True)
    trainers = {
        "one_rank_2_threads": (PolicyTrainer(copy.deepcopy(model), None, **kw), 2),
        "two_ranks_1_thread": (DataParallelTrainer(copy.deepcopy(model), None, ranks=2, threads=1, **kw), 1),
        "one_rank_1_thread": (PolicyTrainer(copy.deepcopy(model), None, **kw), 1),
    }
    try:
        for budget in BUDGETS:
            times: dict[str, list[float]] = {name: [] for name in trainers}
            order = list(trainers)
            for r in range(args.repeats + 1):  # the first round warms up
                mbs = micro_batches(_batch(len(tok), seed=budget + r), budget, shared=True)
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
                micro_batch_tokens=budget,
                micro_batches=len(mbs),
                repeats=args.repeats,
                batch_s=batch_s,
                samples_per_s={name: PROMPTS * GROUP / s for name, s in batch_s.items()},
                speedup=batch_s["one_rank_2_threads"] / batch_s["two_ranks_1_thread"],
                max_abs_diff=diff,
            )
    finally:
        trainers["two_ranks_1_thread"][0].close()


if __name__ == "__main__":
    main()
