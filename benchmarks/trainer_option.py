"""A `PolicyTrainer` option off vs on: one micro-step's time, the memory it adds, and the gradients' difference.

The machinery of `benchmarks.checkpointing` and `benchmarks.logits_chunking` (their docstrings say what each figure
is): each point builds one group of G random responses of R tokens after a P-token prompt, packed once (shared
prompt), and runs one micro-step of the real trainer (`PolicyTrainer.micro_step`: the policy's forward with grad,
GRPO's clipped loss, the backward of its numerator; no reference, no optimizer step) with the option off and on.
Every memory figure comes from its own process forked from a fork server that imported torch and transformers once;
the timings from one more per point, where the modes alternate in ABBA order. Linux only (`/proc/self/status`).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.common import check_range, emit, median_time, parser

MAX_POSITIONS = 4096


@dataclass(frozen=True)
class Option:
    """The trainer keyword compared, its value off and on, and the models (`build_tiny_model` overrides of
    model.tiny's defaults; `vocab_size` too, else the char tokenizer's) and points `(model, P, R, G)` it is run at."""

    name: str
    off: object
    on: object
    models: dict
    points: tuple


def _status_mb(field: str) -> float:
    """`VmRSS` or `VmHWM` of this process in MiB (/proc reports KiB as kB; the figures' `_mb` too)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def _setup(option: Option, point: tuple, threads: int, modes: tuple[bool, ...]):
    """A trainer per mode (each its own copy of the same model) and one group of random tokens and rewards."""
    import copy

    import torch

    from configs.schema import Config
    from models.tiny import build_char_tokenizer, build_tiny_model
    from models.trainer import PolicyTrainer, RolloutGroup

    model_name, P, R, G = point
    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    fields = {**Config().model.tiny.model_dump(), **option.models[model_name]}
    vocab = fields.pop("vocab_size", len(tok))
    model = build_tiny_model(vocab, **fields, max_positions=MAX_POSITIONS, seed=0)
    gen = torch.Generator().manual_seed(P * 1_000_003 + R * 1009 + G)
    ids = torch.randint(len(tok.all_special_tokens), vocab, (P + G * R,), generator=gen).tolist()
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
            **{option.name: option.on if on else option.off},
        )
        for on in modes
    }
    return trainers, group


def _step(trainer, group) -> None:
    trainer.micro_step([group])


def _time_point(option: Option, point: tuple, threads: int, repeats: int) -> dict:
    """Both trainers' micro-step times, interleaved after a warm-up step each; and their gradients' difference."""
    trainers, group = _setup(option, point, threads, (False, True))
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


def _added_rss(option: Option, point: tuple, threads: int, on: bool) -> float:
    """MB one micro-step added to the peak RSS of a fresh process holding one trainer (`on`) and the group."""
    from storage.catalog import release_heap

    trainers, group = _setup(option, point, threads, (on,))
    gc.collect()
    release_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the resident memory now
    base = _status_mb("VmRSS")
    _step(trainers[on], group)
    return _status_mb("VmHWM") - base


def main(
    benchmark: str,
    doc: str,
    make_option: Callable[[argparse.Namespace, argparse.ArgumentParser], Option],
    add_args=None,
) -> None:
    """Parse `--threads` / `--repeats` (and what `add_args(parser)` adds), measure every point of
    `make_option(args, parser)` (which checks its own arguments), print a JSON line each and a summary."""
    ap = parser(f"benchmarks.{benchmark}", doc)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each measurement process")
    ap.add_argument("--repeats", type=int, default=5, help="timed micro-steps of each mode per point")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    check_range(ap, "--threads", args.threads, 1)
    check_range(ap, "--repeats", args.repeats, 1, 100)
    option = make_option(args, ap)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "models.tiny", "models.trainer", "configs.schema", "storage.catalog"]
    )
    summary = []
    for point in option.points:
        with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
            timing = pool.apply(_time_point, (option, point, args.threads, args.repeats))
        added = {}
        for on in (False, True):
            with ctx.Pool(1, maxtasksperchild=1) as pool:
                added[on] = pool.apply(_added_rss, (option, point, args.threads, on))
        off_s, on_s = (statistics.median(timing["times"][on]) for on in (False, True))
        model, P, R, G = point
        line = {
            "benchmark": benchmark,
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
        benchmark=benchmark,
        memory_ratio_range=[min(s["memory_ratio"] for s in summary), max(s["memory_ratio"] for s in summary)],
        slowdown_range=[min(s["slowdown"] for s in summary), max(s["slowdown"] for s in summary)],
        grad_max_abs_diff=max(s["grad_max_abs_diff"] for s in summary),
        grad_max_abs_diff_rerun=max(s["grad_max_abs_diff_rerun"] for s in summary),
    )
