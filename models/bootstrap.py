"""Bootstrap stage: a short supervised fine-tune on the task's format, so that the initial policy v0 earns
non-zero reward (RL from a random tiny model would see only zero-reward groups), and greedy evaluation."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from models.engine import SamplingParams, generate_groups


def sft(
    model: torch.nn.Module,
    sequences: list[list[int]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_token_id: int,
    on_progress: Callable[[int, float], None] | None = None,
    stop_when: Callable[[int], bool] | None = None,
    check_every: int = 25,
) -> dict[str, float]:
    """Next-token cross-entropy on whole sequences (few-shot prompt + answer), AdamW with linear warm-up/decay.

    `stop_when(step)`, checked every `check_every` steps, ends the stage early (e.g. once a target accuracy on
    training prompts is reached), so that v0 starts from a comparable point whatever the seed.
    """
    if steps <= 0:
        return {"sft/steps": 0.0}
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * max(0.05, 1 - s / steps)
    )
    model.train()
    t0, loss_val = time.perf_counter(), float("nan")
    for step in range(steps):
        batch = rng.sample(sequences, min(batch_size, len(sequences)))
        L = max(len(s) for s in batch)
        ids = torch.full((len(batch), L), pad_token_id, dtype=torch.long)  # (B, L)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(s)] = torch.tensor(s)
        attn = (labels != -100).long()
        out = model(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_val = float(out.loss.detach())
        if on_progress is not None:
            on_progress(step + 1, loss_val)
        if stop_when is not None and (step + 1) % check_every == 0:
            model.eval()
            stop = stop_when(step + 1)
            model.train()
            if stop:
                break
    model.eval()
    return {"sft/steps": float(step + 1), "sft/final_loss": loss_val, "sft/seconds": time.perf_counter() - t0}


@torch.no_grad()
def greedy_answers(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    stop_token_id: int | None = None,
    other_eos_ids: tuple[int, ...] = (),
    batch_size: int = 64,
) -> list[list[int]]:
    """Greedy responses (token ids) for each prompt, in batches; deterministic. The model is left in eval mode (no
    dropout while it answers; a caller that trains restores its mode)."""
    model.train(False)
    params = SamplingParams(
        max_new_tokens=max_new_tokens, greedy=True, stop_on_newline_id=stop_token_id, other_eos_ids=other_eos_ids
    )
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        groups = generate_groups(model, chunk, 1, params, [[0] for _ in chunk], eos_token_id, pad_token_id)
        out.extend(g[0].response_ids for g in groups)
    return out
