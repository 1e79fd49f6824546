"""Shared benchmark helpers: timing medians and the demo model on a realistic micro-batch."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


MAX_ITERATIONS = 100_000  # configs.schema RunSection.iterations' bound


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help is the module docstring: what the benchmark measures and prints."""
    return argparse.ArgumentParser(
        prog=f"python -m {prog}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def check_range(ap: argparse.ArgumentParser, flag: str, value: int, lo: int, hi: int | None = None) -> None:
    """A usage error (exit 2) naming `flag` unless lo <= value <= hi, so a bad number stops before any work."""
    if value < lo or (hi is not None and value > hi):
        ap.error(f"{flag} {value}: must be at least {lo}" if hi is None else f"{flag} {value}: must be in [{lo}, {hi}]")


def check_unique(ap: argparse.ArgumentParser, flag: str, values: list[int]) -> None:
    """A usage error unless each value is given once: each names a run, and a repeated run id fails after hours."""
    if len(set(values)) < len(values):
        ap.error(f"{flag} {' '.join(map(str, values))}: give each value once")


def check_dir(ap: argparse.ArgumentParser, path: str | None) -> None:
    """Create `--dir` now, so a path that cannot be a work directory is a usage error before any work."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        ap.error(f"--dir {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        ap.error(f"--dir {path}: cannot create {e.filename or path}: {e.strerror or e}")
    if not os.access(path, os.W_OK | os.X_OK):
        ap.error(f"--dir {path}: not writable")


def check_checkout(ap: argparse.ArgumentParser, against: str, marker: str) -> Path:
    """`--against`'s folder, resolved: a usage error unless it holds `marker` (a file every lockstep checkout the
    benchmark can run has), so a wrong path stops before any work."""
    other = Path(against).resolve()
    if not (other / marker).is_file():
        ap.error(f"--against {against}: not a checkout of lockstep (no {marker} there)")
    return other


@contextlib.contextmanager
def work_dir(path: str | None) -> Iterator[str]:
    """`path` (created if missing; kept, so a rerun reuses its cached bootstrap), or a temporary directory."""
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp


def abba(first: str, second: str, repeats: int) -> list[str]:
    """`repeats` runs of each of two configurations in ABBA order (first, second, second, first, first, ...): a drift
    of the machine's speed over the runs then weighs on both alike, where back-to-back pairs would charge it to one."""
    return [m for r in range(repeats) for m in ((first, second) if r % 2 == 0 else (second, first))]


def emit(**figures) -> None:
    print(json.dumps(figures, sort_keys=False), flush=True)


def demo_model_and_groups(n_groups: int = 4, group_size: int = 8, seed: int = 0):
    """The demo's model architecture (untrained) and n_groups arithmetic groups sampled from it."""
    import torch

    from configs.schema import Config
    from models import arithmetic
    from models.engine import SamplingParams, generate_groups, sample_seed
    from models.tiny import build_char_tokenizer, build_tiny_model

    cfg = Config()
    tok = build_char_tokenizer()
    m = cfg.model.tiny
    model = build_tiny_model(
        len(tok),
        **m.model_dump(),  # the fields of model.tiny are build_tiny_model's own
        seed=seed,
    )
    train, _ = arithmetic.build_splits(cfg.task.max_operand, tuple(cfg.task.ops), cfg.task.n_eval)
    prompts = arithmetic.make_prompts(train[:n_groups], train, cfg.task.n_shots, seed)
    ids = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens)
    seeds = [[sample_seed(seed, 0, i, j) for j in range(group_size)] for i in range(n_groups)]
    with torch.no_grad():
        groups = generate_groups(model, ids, group_size, params, seeds, tok.eos_token_id, tok.pad_token_id)
    return model, tok, ids, groups


def side_by_side_trainers(lake, run_id: str, variants: dict[str, Callable]) -> dict[str, tuple]:
    """A trainer per variant of run `run_id`'s frozen config, for timing train steps side by side in this process:
    `variants[name](cfg)` edits a copy of the config; each gets one rank and the run's v0 weights (a caller loads
    those of the batch it times), and torch gets the train task's thread count. Returns {name: (cfg, trainer)}."""
    import torch

    from configs.schema import frozen_config
    from models.tiny import load_hf
    from storage import checkpoints
    from storage.lake import read_json
    from tasks.preflight import resolve_device
    from tasks.session import build_trainer

    base = frozen_config(read_json(lake, lake.config_file(run_id)))
    torch.set_num_threads(base.resources.train_threads)
    trainers = {}
    with tempfile.TemporaryDirectory() as cache:
        for name, edit in variants.items():
            cfg = base.model_copy(deep=True)
            edit(cfg)
            cfg.resources.train_ranks = 1
            model, tok = load_hf(checkpoints.local_copy(lake, lake.checkpoint_dir(run_id, 0), cache))
            trainers[name] = (cfg, build_trainer(cfg, model, tok, resolve_device(cfg.trainer.device)))
    return trainers
