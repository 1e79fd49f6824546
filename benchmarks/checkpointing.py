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
the timings from one more per line, where the modes alternate in ABBA order (`benchmarks.trainer_option`). One at a
time, each with `--threads` torch threads (default 2: this machine's cores). Prints one JSON line per point, then a
summary line. Linux only (`/proc/self/status`).

    PYTHONPATH=. .venv/bin/python -m benchmarks.checkpointing [--threads 2] [--repeats 5]
"""

from __future__ import annotations

from benchmarks.trainer_option import Option, main

CHECKPOINTING = Option(
    name="activation_checkpointing",
    off=False,
    on=True,
    models={
        "demo": {},  # model.tiny's defaults
        "wide": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
    },
    points=(  # (model, P, R, G)
        ("demo", 512, 32, 16),
        ("demo", 1024, 64, 16),
        ("wide", 512, 32, 16),
        ("wide", 1024, 64, 16),
    ),
)

if __name__ == "__main__":
    main("checkpointing", __doc__, lambda args, ap: CHECKPOINTING)
