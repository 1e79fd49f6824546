"""Cost of A-3PO's proximal log-probs (loglinear interpolation) vs the forward pass it replaces.

Prints one JSON line: `loglinear_s` (proximal log-probs by loglinear on one micro-batch), `recompute_forward_s`
(one no-grad forward of the demo model on the same packed micro-batch), and their ratio. Medians of repeats.
Target: loglinear < 1% of the forward.

    .venv/bin/python -m benchmarks.objectives
"""

from __future__ import annotations

from benchmarks.common import demo_model_and_groups, emit, median_time, parser


def main() -> None:
    parser("benchmarks.objectives", __doc__).parse_args()
    import torch  # after parsing: --help and a bad flag answer without seconds of imports

    from models import objectives
    from models.packing import Group, pack, packed_logits, token_logprobs

    torch.set_num_threads(1)
    model, tok, ids, groups = demo_model_and_groups(n_groups=8, group_size=8)
    packed = pack([Group(p, [s.response_ids for s in g]) for p, g in zip(ids, groups)], tok.pad_token_id, True)
    mask = packed.mask  # (S, T)
    S, T = mask.shape
    behavior = torch.zeros((S, T))
    for i, s in enumerate(x for g in groups for x in g):
        behavior[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    with torch.no_grad():
        current = token_logprobs(packed_logits(model, packed), packed.targets)  # (S, T)
    versions = torch.randint(0, 8, (S, 1)).expand(S, T)  # staleness 0..8 behind trainer version 8

    def loglinear():
        return objectives.proximal_logprobs(behavior, current, versions, 8, mask, "loglinear")

    def forward():
        with torch.no_grad():
            return token_logprobs(packed_logits(model, packed), packed.targets)

    loglinear_s = median_time(loglinear, repeats=51, warmup=5)
    forward_s = median_time(forward, repeats=11, warmup=2)
    emit(
        benchmark="objectives",
        samples=S,
        tokens_packed=packed.num_tokens,
        loglinear_s=loglinear_s,
        recompute_forward_s=forward_s,
        loglinear_over_forward=loglinear_s / forward_s,
        target_met=loglinear_s < 0.01 * forward_s,
    )


if __name__ == "__main__":
    main()
