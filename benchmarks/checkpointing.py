"""Activation checkpointing (`train.activation_checkpointing`) off vs on: the trainer's micro-step time and peak memory.

One JSON line per model (`demo`: the demo's model.tiny, 128 wide and 4 layers; `wide`: 512 wide, 8 layers, MLP
1536) and micro-batch: one group of G responses of R tokens after a P-token prompt, packed once (shared prompt), and
one micro-step of the real trainer (`PolicyTrainer.micro_step`: the policy's forward with grad, GRPO's clipped loss,
the backward of its numerator; no reference, no optimizer step). Figures:

- `step_s_off`, `step_s_on`: median micro-step time, the two trainers' steps interleaved in ABBA order (off, on, on,
  off, ...) in one process after a warm-up step each (off a second one: the control below), so both see the same
  background load; `slowdown` = on / off;
- `added_mb_off`, `added_mb_on`: what one micro-step added to the resident memory of a fresh process that built
  the model, its trainer and the group: the peak during the step (`VmHWM`, reset through `/proc/self/clear_refs`
  just before it) minus the resident memory then (`VmRSS`, once the C heap's free pages were given back with
  `malloc_trim`, so that the step cannot reuse freed memory unseen). That is the activations kept for the backward,
  the gradients, the backward's own buffers and a first step's one-time buffers; `memory_ratio` = on / off;
- `grad_max_abs_diff`: the largest difference between the two trainers' gradients of the same micro-batch (0.0: the
  same gradient), beside its control `grad_max_abs_diff_rerun`: the same between two micro-steps of the trainer
  without checkpointing on that micro-batch. With more than one thread torch's CPU backward is not bit-reproducible
  at the larger points (the control is not 0 there either: the embedding's gradient sums its rows' contributions
  in parallel); with one thread both are 0.0.

Every memory figure comes from its own process forked from a fork server that imported torch and transformers once;
the timings from one more per line, where the modes alternate in ABBA order. One at a time, each with `--threads`
torch threads (default 2: this machine's cores). Prints one JSON line per point, then a summary line. Linux only
(`/proc/self/status`).

    PYTHONPATH=. .venv/bin/python -m benchmarks.checkpointing [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import statistics

from benchmarks.common import check_range, emit, median_time, parser

MODELS = {
    "demo": {},  # model.tiny's defaults
    "wide": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
}
POINTS = (  # (model, P, R, G)
    ("demo", 512, 32, 16),
    ("demo", 1024, 64, 16),
    ("wide", 512, 32, 16),
    ("wide", 1024, 64, 16),
)
MAX_POSITIONS = 4096


def _status_mb(field: str) -> float:
    """`VmRSS` or `VmHWM` of this process in MB (/proc reports kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def _setup(model_name: str, P: int, R: int, G: int, threads: int, modes: tuple[bool, ...]):
    """A trainer per mode (each its own copy of the same model) and one group of random tokens and rewards."""
    import copy

    import torch

    from configs.schema import Config
    from models.tiny import build_char_tokenizer, build_tiny_model
    from models.trainer import PolicyTrainer, RolloutGroup

    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    fields = {**Config().model.tiny.model_dump(), **MODELS[model_name]}
    model = build_tiny_model(len(tok), **fields, max_positions=MAX_POSITIONS, seed=0)
    gen = torch.Generator().manual_seed(P * 1_000_003 + R * 1009 + G)
    ids = torch.randint(len(tok.all_special_tokens), len(tok), (P + G * R,), generator=gen).tolist()
    responses = [ids[P + j * R : P + (j + 1) * R] for j in range(G)]
    rewards = torch.rand(G, generator=gen).tolist()
    group = RolloutGroup(ids[:P], responses, rewards, [[-1.0] * R] * G, [[0] * R] * G)
    trainers = {
        on: PolicyTrainer(
            copy.deepcopy(model) if len(modes) > 1 else model,  # one mode: no freed copy for the step to reuse
            None,
            lr=1e-4,
            pad_token_id=tok.pad_token_id,
            shared_prompt=True,
            activation_checkpointing=on,
        )
        for on in modes
    }
    return trainers, group


def _step(trainer, group) -> None:
    trainer.micro_step([group])


def _time_point(point: tuple, threads: int, repeats: int) -> dict:
    """Both trainers' micro-step times, interleaved after a warm-up step each; and their gradients' difference."""
    trainers, group = _setup(*point, threads, (False, True))
    grads = []
    for mode in (False, True, False):  # warm-up steps; their gradients are compared: on vs off, and off twice
        trainers[mode].optimizer.zero_grad(set_to_none=True)
        _step(trainers[mode], group)
        grads.append([p.grad.clone() for p in trainers[mode].model.parameters()])
    diff, rerun = (max(float((a - b).abs().max()) for a, b in zip(grads[0], other, strict=True)) for other in grads[1:])
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats):
        for mode in (False, True) if i % 2 == 0 else (True, False):  # ABBA: neither always steps first
            trainer = trainers[mode]
            trainer.optimizer.zero_grad(set_to_none=True)
            times[mode].append(median_time(lambda t=trainer: _step(t, group), repeats=1, warmup=0))
    return {"times": times, "diff": diff, "rerun": rerun}


def _added_rss(point: tuple, threads: int, on: bool) -> float:
    """MB one micro-step added to the peak RSS of a fresh process holding one trainer (`on`) and the group."""
    from storage.catalog import release_heap

    trainers, group = _setup(*point, threads, (on,))
    gc.collect()
    release_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the resident memory now
    base = _status_mb("VmRSS")
    _step(trainers[on], group)
    return _status_mb("VmHWM") - base


def main() -> None:
    ap = parser("benchmarks.checkpointing", __doc__)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each measurement process")
    ap.add_argument("--repeats", type=int, default=5, help="timed micro-steps of each mode per point")
    args = ap.parse_args()
    check_range(ap, "--threads", args.threads, 1)
    check_range(ap, "--repeats", args.repeats, 1, 100)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "models.tiny", "models.trainer", "configs.schema", "storage.catalog"]
    )
    summary = []
    for point in POINTS:
        with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
            timing = pool.apply(_time_point, (point, args.threads, args.repeats))
        added = {}
        for on in (False, True):
            with ctx.Pool(1, maxtasksperchild=1) as pool:
                added[on] = pool.apply(_added_rss, (point, args.threads, on))
        off_s, on_s = (statistics.median(timing["times"][on]) for on in (False, True))
        model, P, R, G = point
        line = {
            "benchmark": "checkpointing",
            "model": model,
            "P": P,
            "R": R,
            "G": G,
            "packed_tokens": P + G * R,
            "step_s_off": round(off_s, 4),
            "step_s_on": round(on_s, 4),
            "slowdown": round(on_s / off_s, 3),
            "added_mb_off": round(added[False], 1),
            "added_mb_on": round(added[True], 1),
            "memory_ratio": round(added[True] / added[False], 3),
            "grad_max_abs_diff": timing["diff"],
            "grad_max_abs_diff_rerun": timing["rerun"],
            "repeats": args.repeats,
            "threads": args.threads,
        }
        emit(**line)
        summary.append(line)
    emit(
        benchmark="checkpointing",
        memory_ratio_range=[min(s["memory_ratio"] for s in summary), max(s["memory_ratio"] for s in summary)],
        slowdown_range=[min(s["slowdown"] for s in summary), max(s["slowdown"] for s in summary)],
        grad_max_abs_diff=max(s["grad_max_abs_diff"] for s in summary),
        grad_max_abs_diff_rerun=max(s["grad_max_abs_diff_rerun"] for s in summary),
    )


if __name__ == "__main__":
    main()
