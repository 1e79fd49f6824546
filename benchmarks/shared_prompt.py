"""Shared-prompt vs unshared packing: train-step time and peak memory of one group, on the demo model.

One JSON line per grid point P (prompt tokens) in {128, 512, 1024}, R (tokens per response) in {16, 64}, G
(responses) in {4, 16}, then one line with the targets:

- `ideal_ratio` = G(P+R) / (P+GR): tokens processed unshared over shared (DESIGN.md, shared-prompt attention);
- `speedup` = unshared train-step time / shared train-step time (ratio of the two medians). A train step is one
  forward with grad and the backward of a token-mean loss (the mean response-token log-prob) on one group, same
  model and same tokens; no optimizer. Medians of 3 timed repeats (5 on the small points) after one warm-up step
  per layout; the two layouts' repeats are interleaved in one process so both see the same background load.
  `speedup_pair_range` is the min and max of the per-repeat ratios: how much that load moved the figure, and
  `speedup_best` = fastest unshared / fastest shared step, the figure least moved by other processes' load;
- `peak_rss_mb_shared`, `peak_rss_mb_unshared`: `getrusage(RUSAGE_SELF).ru_maxrss` of a fresh process that built the
  model, packed the group both ways and ran one train step of that layout only. It is the peak of the whole
  process: the Python interpreter, torch and transformers (imported once by the fork server every measurement is
  forked from, so the same for both layouts), the model's weights and gradients, both packs (the shared one holds an
  (L, L) bool mask), and the step's activations and attention scores. `base_rss_mb_*` is the same figure read
  before the step, so `peak - base` is what the layout's train step added.

Every measurement (the timing of a point, and each layout's memory) runs in its own process forked from a fork server
that imported torch and transformers once, and never from this process, which never runs a model: the processes are
fresh, without paying ~5 s of imports 36 times. One at a time, each with `--threads` torch threads (default 2: this
machine's cores).

    PYTHONPATH=. .venv/bin/python -m benchmarks.shared_prompt [--threads 2]
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics

from benchmarks.common import check_range, emit, median_time, parser

GRID_P = (128, 512, 1024)
GRID_R = (16, 64)
GRID_G = (4, 16)
MAX_POSITIONS = 2048  # P + R reaches 1088 > the demo model's default 1024


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports kilobytes


def _setup(P: int, R: int, G: int, threads: int):
    """The demo model (train mode) and one random group of G responses of R tokens after a P-token prompt, packed
    both ways, with the train step of each layout."""
    import torch

    from configs.schema import Config
    from models.packing import Group, pack, packed_logits, token_logprobs
    from models.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    m = Config().model.tiny
    model = build_tiny_model(
        len(tok),
        **m.model_dump(),  # the fields of model.tiny are build_tiny_model's own
        max_positions=MAX_POSITIONS,
        seed=0,
    )
    model.train()
    gen = torch.Generator().manual_seed(P * 1_000_003 + R * 1009 + G)
    ids = torch.randint(len(tok.all_special_tokens), len(tok), (P + G * R,), generator=gen).tolist()
    group = Group(ids[:P], [ids[P + j * R : P + (j + 1) * R] for j in range(G)])

    def train_step(packed):
        def step() -> None:
            logp = token_logprobs(packed_logits(model, packed), packed.targets)  # (G, R)
            loss = -(logp * packed.mask).sum() / packed.mask.sum()  # token-mean
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    packs = {shared: pack([group], tok.pad_token_id, shared) for shared in (False, True)}
    return {shared: (train_step(p), p.num_tokens) for shared, p in packs.items()}


def _time_point(P: int, R: int, G: int, threads: int, repeats: int) -> dict:
    """Train-step times of both layouts, interleaved (u, s, u, s, ...) in one process after one warm-up step each.

    Interleaving, rather than `median_time` on one layout then the other, makes both layouts see the same background
    load: this machine is shared, and its load moved single medians by 2x between runs. Each timed call still goes
    through `median_time` (one repeat, no warm-up) so the clock is the same as every other benchmark's.
    """
    steps = _setup(P, R, G, threads)
    for step, _ in steps.values():
        median_time(step, repeats=1, warmup=0)  # warm-up: allocator, first-call paths
    times = {False: [], True: []}
    for _ in range(repeats):
        for shared in (False, True):
            times[shared].append(median_time(steps[shared][0], repeats=1, warmup=0))
    return {"times": times, "tokens": {k: n for k, (_, n) in steps.items()}}


def _peak_rss(P: int, R: int, G: int, threads: int, shared: bool) -> tuple[float, float]:
    """(base, peak) RSS in MB of a fresh process: after building and packing, and after one train step of `shared`."""
    steps = _setup(P, R, G, threads)
    base = _rss_mb()
    steps[shared][0]()
    return base, _rss_mb()


def _repeats(P: int, R: int, G: int) -> int:
    return 3 if G * (P + R) >= 8192 else 5  # the big unshared points take seconds per step (4-min budget)


def main() -> None:
    ap = parser("benchmarks.shared_prompt", __doc__)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each measurement process")
    args = ap.parse_args()
    check_range(ap, "--threads", args.threads, 1)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "transformers",
            "models.tiny",
            "models.packing",
            "configs.schema",
            "benchmarks.common",
            "transformers.models.qwen2.modeling_qwen2",
        ]
    )
    results = {}
    for P in GRID_P:
        for R in GRID_R:
            for G in GRID_G:
                n = _repeats(P, R, G)
                with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
                    timing = pool.apply(_time_point, (P, R, G, args.threads, n))
                rss = {}
                for shared in (False, True):
                    with ctx.Pool(1, maxtasksperchild=1) as pool:
                        rss[shared] = pool.apply(_peak_rss, (P, R, G, args.threads, shared))
                fig = point_figures(P, R, G, timing["times"][False], timing["times"][True])
                results[(P, R, G)] = (fig["ideal_ratio"], fig["speedup"])
                emit(
                    benchmark="shared_prompt",
                    P=P,
                    R=R,
                    G=G,
                    ideal_ratio=round(fig["ideal_ratio"], 3),
                    speedup=round(fig["speedup"], 3),
                    speedup_pair_range=[round(x, 3) for x in fig["speedup_pair_range"]],
                    speedup_best=round(fig["speedup_best"], 3),
                    step_s_unshared=round(fig["step_s_unshared"], 4),
                    step_s_shared=round(fig["step_s_shared"], 4),
                    tokens_unshared=timing["tokens"][False],
                    tokens_shared=timing["tokens"][True],
                    peak_rss_mb_shared=round(rss[True][1], 1),
                    peak_rss_mb_unshared=round(rss[False][1], 1),
                    base_rss_mb_shared=round(rss[True][0], 1),
                    base_rss_mb_unshared=round(rss[False][0], 1),
                    repeats=n,
                    threads=args.threads,
                )
    emit(benchmark="shared_prompt", **targets(results))


def point_figures(P: int, R: int, G: int, unshared: list[float], shared: list[float]) -> dict:
    """A grid point's figures from its interleaved step times (seconds, repeat i of each layout side by side):
    the ideal ratio G(P+R) / (P+GR), the ratio of the medians, the range of the per-repeat ratios, and the ratio
    of the fastest steps."""
    t_u, t_s = statistics.median(unshared), statistics.median(shared)
    pairs = [u / s for u, s in zip(unshared, shared, strict=True)]
    return {
        "ideal_ratio": G * (P + R) / (P + G * R),
        "speedup": t_u / t_s,
        "speedup_pair_range": [min(pairs), max(pairs)],
        "speedup_best": min(unshared) / min(shared),
        "step_s_unshared": t_u,
        "step_s_shared": t_s,
    }


def targets(results: dict[tuple[int, int, int], tuple[float, float]]) -> dict:
    """The last line from every point's (ideal ratio, speedup): at least 0.6 of the ideal at P=1024, R=16, G=16, and
    no slowdown anywhere."""
    ideal, speedup = results[(1024, 16, 16)]
    return {
        "targets": {
            "speedup >= 0.6*ideal at P=1024,R=16,G=16": speedup >= 0.6 * ideal,
            "speedup >= 1.0 everywhere": all(sp >= 1.0 for _, sp in results.values()),
        },
        "speedup_at_1024_16_16": round(speedup, 3),
        "ideal_at_1024_16_16": round(ideal, 3),
    }


if __name__ == "__main__":
    main()
