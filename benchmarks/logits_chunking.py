"""Chunked log-probs (`train.logits_chunk_tokens`) off vs on: the trainer's micro-step time and peak memory.

Off, the trainer takes the policy's log-probs from the micro-batch's whole logits: (rows, L, V) from the model,
gathered to (S, T, V) and log-softmaxed in float32, kept for the backward. On, the decoder's hidden states of the
response tokens go through the output layer `--chunk-tokens` tokens at a time under `torch.utils.checkpoint`
(`models.packing.chunked_logprobs`): a chunk's logits live only while it is computed, in the forward and again in
the backward. What that saves grows with the vocabulary, so the models here are the demo's widths with larger ones:
`demo-32k` (model.tiny's 128 wide, 4 layers, vocabulary 32,000: a Llama-2-sized one) and `wide-152k` (512 wide,
8 layers, MLP 1536, vocabulary 151,936: Qwen2.5's). One JSON line per model and micro-batch: one group of G
responses of R tokens after a P-token prompt, packed once (shared prompt), and one micro-step of the real trainer
(`PolicyTrainer.micro_step`: the policy's forward with grad, GRPO's clipped loss, the backward of its numerator; no
reference, no optimizer step). Figures:

- `step_s_off`, `step_s_on`: median micro-step time, the two trainers' steps interleaved in ABBA order (off, on, on,
  off, ...) in one process after a warm-up step each (off a second one: the control below); `slowdown` = on / off;
- `added_mb_off`, `added_mb_on`: what one micro-step added to the resident memory of a fresh process that built
  the model, its trainer and the group: the peak during the step (`VmHWM`, reset through `/proc/self/clear_refs`
  just before it) minus the resident memory then (`VmRSS`, after `malloc_trim`); `memory_ratio` = on / off;
- `grad_max_abs_diff`: the largest difference between the two trainers' gradients of the same micro-batch, beside
  its control `grad_max_abs_diff_rerun` (the trainer without chunks, twice). The chunks' matrix products sum in
  another order than the whole one's, so the two differ by float32 rounding, not 0.

Every memory figure comes from its own process forked from a fork server; the timings from one more per line
(`benchmarks.trainer_option`). Each with `--threads` torch threads (default 2: this machine's cores). Prints one JSON
line per point, then a summary line. Linux only (`/proc/self/status`).

    PYTHONPATH=. .venv/bin/python -m benchmarks.logits_chunking [--threads 2] [--repeats 5] [--chunk-tokens 1024]
"""

from __future__ import annotations

from benchmarks.common import check_range
from benchmarks.trainer_option import Option, main

WIDE = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536}
MODELS = {"demo-32k": {"vocab_size": 32_000}, "wide-152k": {**WIDE, "vocab_size": 151_936}}
POINTS = (  # (model, P, R, G)
    ("demo-32k", 256, 32, 16),
    ("demo-32k", 512, 128, 16),
    ("wide-152k", 256, 32, 16),
    ("wide-152k", 512, 128, 16),
)


def _add_args(ap) -> None:
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="train.logits_chunk_tokens of the 'on' trainer")


def _option(args, ap) -> Option:
    check_range(ap, "--chunk-tokens", args.chunk_tokens, 1)
    return Option("logits_chunk_tokens", None, args.chunk_tokens, MODELS, POINTS)


if __name__ == "__main__":
    main("logits_chunking", __doc__, _option, _add_args)
