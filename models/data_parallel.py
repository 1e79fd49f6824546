"""The collectives of data-parallel training: every rank's gradient summed onto rank 0, weights broadcast from it.

Every rank holds the whole model (replicas, not FSDP shards) and accumulates the loss numerator's gradient of the
micro-batches it was given; only rank 0 holds optimizer state and steps. Summing the gradients and the loss
denominators over ranks at the end of the batch gives the gradient of the whole batch, because it is a sum over
samples (DESIGN.md, Propositions 1-2): the split across ranks, like the split into micro-batches, changes only the
order of floating-point additions. Needs an initialised default process group (`torch.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _wait(work) -> None:
    work.wait()


def _trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def sum_gradients(module: torch.nn.Module, dst: int = 0, wait: Callable = _wait) -> None:
    """Sum the accumulated `.grad` of `module`'s trainable parameters over all ranks onto rank `dst`, in fp32, in one
    collective. On `dst` a parameter's gradient stays None only where no rank had one (AdamW skips such a
    parameter, as it would in one process); on the other ranks every gradient is dropped. `wait(work)` waits for
    the collective (a caller may watch the other ranks meanwhile)."""
    params = _trainable(module)
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    flat = torch.zeros(total + len(params), dtype=torch.float32, device=params[0].device)
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            flat[offset : offset + sizes[i]] = p.grad.reshape(-1)
            flat[total + i] = 1.0  # this rank has a gradient for parameter i
        offset += sizes[i]
    wait(dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, async_op=True))
    if dist.get_rank() != dst:
        for p in params:
            p.grad = None
        return
    has_grad = flat[total:].cpu().tolist()  # one device-to-host copy, not one per parameter
    offset = 0
    for i, p in enumerate(params):
        if has_grad[i] > 0:
            p.grad = flat[offset : offset + sizes[i]].view_as(p).to(p.dtype).clone()
        offset += sizes[i]


def broadcast_weights(modules: list[torch.nn.Module], src: int = 0, wait: Callable = _wait) -> None:
    """Copy the parameters of `modules` on rank `src` into the same modules on every other rank: one collective
    per dtype. The modules must have the same architecture on every rank (the order of `parameters()` is used)."""
    params = [p for m in modules for p in m.parameters()]
    for dtype in sorted({p.dtype for p in params}, key=str):
        group = [p for p in params if p.dtype == dtype]
        flat = torch.cat([p.detach().reshape(-1) for p in group])
        wait(dist.broadcast(flat, src=src, async_op=True))
        if dist.get_rank() == src:
            continue
        offset = 0
        with torch.no_grad():
            for p in group:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
