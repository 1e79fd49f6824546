"""`lockstep eval RUN_ID`: the held-out accuracy of any stored version of a run, measured again from its checkpoint.

The run's own evaluation (every `eval.every` iterations, and at its start and end) is repeated for the versions asked:
the same held-out prompts (the frozen config's task and split), the same greedy decoding and reward
(`tasks.session.accuracy`), on the weights of checkpoint v{version} (checksums verified as they are read). So a
version the run evaluated gives the accuracy it logged, and the versions between its evaluations can be compared as
well. Nothing is written: the run may be training meanwhile, and no Prefect server is started.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator

from configs.schema import Config
from storage import checkpoints, scratch
from storage.lake import Lake


def _no_progress(event: dict) -> None:
    pass


def chosen_versions(lake: Lake, run_id: str, versions: list[int], every: int | None) -> list[int]:
    """The versions to evaluate, ascending and each once: `versions` as given, plus with `every` each multiple of it
    up to the promoted version and the promoted version itself; neither: the promoted version. A version past the
    promoted one, or without a checkpoint, is refused (ValueError, FileNotFoundError) before any is evaluated."""
    promoted = checkpoints.promoted_version(lake, run_id)
    if promoted is None:
        raise FileNotFoundError(f"run {run_id} has no promoted version in {lake.uri} yet")
    wanted = set(versions)
    if every is not None:
        if every < 1:
            raise ValueError(f"--every {every}: give a number of versions of at least 1")
        wanted.update(range(0, promoted + 1, every))
        wanted.add(promoted)
    elif not versions:
        wanted.add(promoted)
    for v in sorted(wanted):
        if v < 0 or v > promoted:
            raise ValueError(f"--version {v}: run {run_id} has versions 0 to {promoted} (the newest promoted)")
    missing = sorted(wanted - set(checkpoints.stored_versions(lake, run_id)))
    if missing:
        raise FileNotFoundError(
            f"run {run_id} has no checkpoint of version {', '.join(f'v{v}' for v in missing)} in {lake.uri}"
        )
    return sorted(wanted)


def evaluate_versions(
    cfg: Config,
    lake: Lake,
    run_id: str,
    versions: list[int],
    on_progress: Callable[[dict], None] = _no_progress,
    threads: int | None = None,
) -> Iterator[dict]:
    """Yields per version, in the order given: {"version", "accuracy", "correct", "prompts", "seconds"}. `cfg` is
    the run's frozen config; the model runs on its `trainer.device` with its trainer's attention kernel and, on the
    CPU, `threads` torch threads (default: its `resources.train_threads`, the trainer's; the process's setting is
    given back at the end). `on_progress` hears {"event": "start", "versions", "prompts", "device", "attention",
    "threads"} once the prompts are ready and {"event": "version", ...the row} after each."""
    import torch

    from models.rewards import reward_function
    from models.tiny import load_hf
    from tasks.preflight import attention_kernel, resolve_device
    from tasks.session import accuracy, task_prompts

    device = resolve_device(cfg.trainer.device)
    kernel = attention_kernel(cfg.train.attention, device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or cfg.resources.train_threads)
    try:
        with tempfile.TemporaryDirectory(prefix=scratch.prefix("eval")) as copies:  # an object-store lake's v0
            model, tokenizer = load_hf(checkpoints.local_copy(lake, lake.checkpoint_dir(run_id, 0), copies))
        model.set_attn_implementation(kernel)  # as the run's trainer, whose model the run evaluated
        model.to(device)
        _, _, prompts, token_ids = task_prompts(cfg, tokenizer)
        scorer = reward_function(**cfg.task.reward_settings())  # loaded once for every version
        on_progress(
            {
                "event": "start",
                "versions": len(versions),
                "prompts": len(prompts),
                "device": str(device),
                "attention": kernel,
                "threads": torch.get_num_threads(),
            }
        )
        for version in versions:
            t0 = time.perf_counter()
            checkpoints.load_into(model, checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, version)))
            acc = accuracy(
                model,
                tokenizer,
                token_ids,
                prompts,
                cfg.eval.max_new_tokens,
                scorer,
                cfg.task.newline_stop(),
            )
            row = {
                "version": version,
                "accuracy": acc,
                "correct": round(acc * len(prompts)),
                "prompts": len(prompts),
                "seconds": time.perf_counter() - t0,
            }
            on_progress({"event": "version", **row})
            yield row
    finally:
        torch.set_num_threads(before)
