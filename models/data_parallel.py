"""The collectives of data-parallel training: every rank's gradient summed onto rank 0, weights broadcast from it.

Every rank holds the whole model (replicas, not FSDP shards) and accumulates the loss numerator's gradient of the
micro-batches it was given; rank 0 holds the optimizer state and steps (`sum_gradients`, `broadcast_weights`), or
every rank holds and steps its slice of it (`OptimizerShard`, ZeRO stage 1). Summing the gradients and the loss
denominators over ranks at the end of the batch gives the gradient of the whole batch, because it is a sum over
samples (DESIGN.md, Propositions 1-2): the split across ranks, like the split into micro-batches, changes only the
order of floating-point additions. Needs an initialised default process group (`torch.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# the single-tensor collectives' names since torch 2.13, and before
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wait(work) -> None:
    work.wait()


def _trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _stretches(flat: torch.Tensor, params: list[torch.Tensor]):
    """(parameter, its stretch of `flat` shaped as it) for `params` laid end to end in `flat`, in order."""
    offset = 0
    for p in params:
        yield p, flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def state_numel(optimizer: torch.optim.Optimizer | None) -> int:
    """Elements of an optimizer's per-element state (AdamW's moments; the step counts left out)."""
    if optimizer is None:
        return 0
    return sum(t.numel() for st in optimizer.state.values() for t in st.values() if t.dim() > 0)


def sum_gradients(module: torch.nn.Module, dst: int = 0, wait: Callable = _wait) -> None:
    """Sum the accumulated `.grad` of `module`'s trainable parameters over all ranks onto rank `dst`, in fp32, in one
    collective. On `dst` a parameter's gradient stays None only where no rank had one (AdamW skips such a
    parameter, as it would in one process); on the other ranks every gradient is dropped. `wait(work)` waits for
    the collective (a caller may watch the other ranks meanwhile)."""
    params = _trainable(module)
    total = sum(p.numel() for p in params)
    flat = torch.zeros(total + len(params), dtype=torch.float32, device=params[0].device)
    for i, (p, stretch) in enumerate(_stretches(flat, params)):
        if p.grad is not None:
            stretch.copy_(p.grad)
            flat[total + i] = 1.0  # this rank has a gradient for parameter i
    wait(dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, async_op=True))
    if dist.get_rank() != dst:
        for p in params:
            p.grad = None
        return
    has_grad = flat[total:].cpu().tolist()  # one device-to-host copy, not one per parameter
    for i, (p, stretch) in enumerate(_stretches(flat, params)):
        if has_grad[i] > 0:
            p.grad = stretch.to(p.dtype).clone()


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
        with torch.no_grad():
            for p, stretch in _stretches(flat, group):
                p.copy_(stretch)


class OptimizerShard:
    """This rank's part of AdamW when the ranks shard the optimizer (`resources.shard_optimizer`, ZeRO stage 1).

    Per dtype, the trainable parameters (in `parameters()` order) are laid end to end in one flat vector, padded to a
    multiple of the ranks, and rank r owns the r-th contiguous slice of it: for each parameter that slice touches, a
    piece (a view of that part of the parameter, or a copy where it is not contiguous) that this rank's AdamW steps.
    At the optimizer step the gradients are summed over the ranks (`reduce`: reduce-scattered, or on gloo
    all-reduced), scaled and clipped to the global norm, each rank steps its pieces, and the stepped slices are
    gathered back into every rank's whole model (`apply`). AdamW is elementwise, so this is the same update as one
    AdamW over the whole model, with a parameter no rank had a gradient for left unstepped as there; only the order
    of floating-point additions (the sum over ranks; the norm, with `scatter`) can differ. Each rank holds 1/ranks
    of AdamW's two moments instead of rank 0 holding all of them. Every method is a collective all ranks call in the
    same order."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's elementwise state (amsgrad is not used by the trainer)

    def __init__(self, module: torch.nn.Module, **adamw):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = list(module.parameters())  # the indices of an optimizer state dict over the whole model
        self.layout: list[tuple[torch.dtype, list[int], int]] = []  # per dtype: parameter indices, slice size
        self.pieces: list[tuple[int, int, int, int]] = []  # (parameter index, start, end in it, start in the slice)
        for dtype in sorted({p.dtype for p in self.params if p.requires_grad}, key=str):
            indices = [i for i, p in enumerate(self.params) if p.requires_grad and p.dtype == dtype]
            total = sum(self.params[i].numel() for i in indices)
            if total == 0:  # nothing to step (parameters of no elements)
                continue
            size = -(-total // self.world)
            lo, hi = self.rank * size, min((self.rank + 1) * size, total)
            offset = 0
            for i in indices:
                n = self.params[i].numel()
                a, b = max(offset, lo), min(offset + n, hi)
                if a < b:
                    self.pieces.append((i, a - offset, b - offset, a - lo))
                offset += n
            self.layout.append((dtype, indices, size))
        # a piece is a view of its parameter's storage where the parameter is contiguous (AdamW then steps the model's
        # own slice, no copy held), a copy otherwise
        self.copies = [
            torch.nn.Parameter(
                self.params[i].detach().view(-1)[a:b]
                if self.params[i].is_contiguous()
                else self.params[i].detach().reshape(-1)[a:b].clone()
            )
            for i, a, b, _ in self.pieces
        ]
        self.optimizer = torch.optim.AdamW(self.copies, **adamw) if self.copies else None
        self.stepped: set[int] = set()  # parameters with AdamW state (alike on every rank: flags are all-reduced)
        self.device = self.params[0].device
        # gloo's reduce-scatter starts only inside `wait()`, which a caller watching the other ranks by polling never
        # reaches, and took twice its all-reduce's time here: on gloo every rank sums the whole gradient instead
        self.scatter = dist.get_backend() != "gloo"
        self._stepping: set[int] = set()  # the parameters the last `reduce` gave a gradient (summed or zero)

    def refresh(self) -> None:
        """Take the pieces' values from the model (after its weights were written, e.g. broadcast from rank 0): only
        the copies need it, the views see them."""
        with torch.no_grad():
            for (i, a, b, _), c in zip(self.pieces, self.copies, strict=True):
                source = self.params[i].detach().reshape(-1)[a:b]
                if c.data_ptr() != source.data_ptr():
                    c.copy_(source)

    def reduce(self, scale: float, max_norm: float, forced: list[int] | None, wait: Callable = _wait) -> float:
        """Sum every rank's accumulated gradient and keep this rank's slice, times `scale`, clipped to `max_norm`
        (global norm); drops the model's `.grad`. `forced`: parameters given a zero gradient when no rank has any
        (a batch whose every group was skipped steps AdamW on a zero gradient). Returns the global norm (unclipped);
        when it is not finite nothing is kept.

        Without `scatter` (gloo), every rank sums the whole gradient in one all-reduce (the flags with it) and
        computes the norm and clipping as one process does (`clip_grad_norm_`'s functions on the same tensors: the
        same figures to the bit). With it the sum is reduce-scattered and the norm is the root of the ranks' sums of
        squares (with the flags', two all-reduces beside the reduce-scatters; the rounding differs)."""
        sizes = [size * self.world for _, _, size in self.layout]
        flags_here = 0 if self.scatter else len(self.params)  # without `scatter` the flags ride with the sum
        buffer = torch.zeros(sum(sizes) + flags_here, dtype=torch.float32, device=self.device)
        *flats, has = buffer.split([*sizes, flags_here])
        if self.scatter:
            has = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
        for (_, indices, _), flat in zip(self.layout, flats, strict=True):
            for i, (p, stretch) in zip(indices, _stretches(flat, [self.params[i] for i in indices]), strict=True):
                if p.grad is not None:
                    stretch.copy_(p.grad)
                    has[i] = 1.0
        for p in self.params:
            p.grad = None
        if not self.scatter:
            wait(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True))
        else:
            wait(dist.all_reduce(has, op=dist.ReduceOp.SUM, async_op=True))
        flags = [1.0 if f > 0 else 0.0 for f in has.cpu().tolist()]
        if not any(flags):  # as `PolicyTrainer._step`: a batch whose every group was skipped
            for i in forced or []:
                flags[i] = 0.5  # a zero gradient
        grads: dict[int, torch.Tensor] = {}  # without `scatter`: each parameter's whole gradient
        if not self.scatter:
            for (_, indices, _), flat in zip(self.layout, flats, strict=True):
                for i, (p, stretch) in zip(indices, _stretches(flat, [self.params[i] for i in indices]), strict=True):
                    if flags[i] == 1.0:  # as `sum_gradients` then `PolicyTrainer._step` make it
                        grads[i] = stretch.to(p.dtype).mul_(scale)
                    elif flags[i]:
                        grads[i] = torch.zeros_like(p)
            whole = [grads[i] for i in sorted(grads)]
            norm = torch.nn.utils.get_total_norm(whole, 2.0) if whole else torch.zeros((), device=self.device)
            pieces = [grads[i].reshape(-1)[a:b] if i in grads else None for i, a, b, _ in self.pieces]
        else:
            slices = {}
            for k, (dtype, _, size) in enumerate(self.layout):
                slices[dtype] = torch.empty(size, dtype=torch.float32, device=self.device)
                wait(_reduce_scatter_single(slices[dtype], flats[k], op=dist.ReduceOp.SUM, async_op=True))
            del buffer, flats  # the sum is in `slices` now
            pieces = []
            for (i, a, b, at), c in zip(self.pieces, self.copies, strict=True):
                if flags[i] == 1.0:
                    pieces.append(slices[c.dtype][at : at + b - a].to(c.dtype).mul_(scale))
                else:
                    pieces.append(torch.zeros_like(c) if flags[i] else None)
            squares = sum(
                (torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in pieces if g is not None),
                torch.zeros((), dtype=torch.float32, device=self.device),
            )
            wait(dist.all_reduce(squares, op=dist.ReduceOp.SUM, async_op=True))
            norm = squares.sqrt()
        if not torch.isfinite(norm):
            self.zero_grad()
            return float(norm)
        for c, g in zip(self.copies, pieces, strict=True):
            c.grad = None if g is None else g if self.scatter else g.clone()  # not a view keeping the whole sum alive
        held = [c for c in self.copies if c.grad is not None]
        if held:
            torch.nn.utils.clip_grads_with_norm_(held, max_norm, norm)
        self._stepping = {i for i, f in enumerate(flags) if f}
        return float(norm)

    def zero_grad(self) -> None:
        for c in self.copies:
            c.grad = None

    def apply(self, settings: dict, wait: Callable = _wait) -> None:
        """Step this rank's pieces with AdamW under `settings` (lr, betas, weight decay, ...: rank 0's param group),
        then gather every rank's slice into the whole model on every rank."""
        if self.optimizer is not None:
            self.optimizer.param_groups[0].update(settings)
            self.optimizer.step()
            self.zero_grad()
        self.stepped |= self._stepping
        for dtype, indices, size in self.layout:
            mine = torch.zeros(size, dtype=dtype, device=self.device)
            for (_, a, b, at), c in zip(self.pieces, self.copies, strict=True):
                if c.dtype == dtype:
                    mine[at : at + b - a] = c.detach()
            whole = torch.empty(size * self.world, dtype=dtype, device=self.device)
            wait(_all_gather_single(whole, mine, async_op=True))
            with torch.no_grad():
                for p, stretch in _stretches(whole, [self.params[i] for i in indices]):
                    p.copy_(stretch)

    def _piece_state(self, c: torch.nn.Parameter) -> dict:
        return self.optimizer.state.get(c, {}) if self.optimizer is not None else {}

    def _steps(self, wait: Callable) -> list[float]:
        """Each parameter's AdamW step count on every rank (0: no state), from the pieces that hold it (float32:
        exact to 2^24 steps, and a dtype every backend reduces)."""
        steps = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
        for (i, *_), c in zip(self.pieces, self.copies, strict=True):
            if "step" in self._piece_state(c):
                steps[i] = float(self._piece_state(c)["step"])
        wait(dist.all_reduce(steps, op=dist.ReduceOp.MAX, async_op=True))
        return steps.cpu().tolist()

    def _slices(self, dtype: torch.dtype, indices: list[int], size: int):
        """(rank, parameter index, start in the parameter, end in it, start in the rank's slice) for every piece of
        every rank's slice of `dtype`'s flat vector, in order."""
        offset = 0
        for i in indices:
            n = self.params[i].numel()
            for r in range(offset // size, min((offset + n - 1) // size, self.world - 1) + 1):
                lo, hi = max(offset, r * size), min(offset + n, (r + 1) * size)
                yield r, i, lo - offset, hi - offset, lo - r * size
            offset += n

    def gather_state(self, wait: Callable = _wait) -> dict[int, dict[str, torch.Tensor]] | None:
        """AdamW's state gathered onto rank 0 as one AdamW over the whole model holds it (parameter index ->
        step, exp_avg, exp_avg_sq; only parameters with state), on the CPU; None on the other ranks. One rank's
        slice at a time passes through one slice-sized buffer on the device (a broadcast from its rank)."""
        steps = self._steps(wait)
        out = {
            i: {"step": torch.tensor(s, dtype=torch.float32), **{k: None for k in self.STATE_KEYS}}
            for i, s in enumerate(steps)
            if s > 0
        }
        if not out:
            return out if self.rank == 0 else None
        for dtype, indices, size in self.layout:
            if not any(steps[i] > 0 for i in indices):
                continue
            for key in self.STATE_KEYS:
                if self.rank == 0:
                    for i in indices:
                        if i in out:
                            out[i][key] = torch.empty(self.params[i].shape, dtype=dtype)
                buf = torch.zeros(size, dtype=dtype, device=self.device)
                for r in range(self.world):
                    if r == self.rank:
                        buf.zero_()
                        for (_, a, b, at), c in zip(self.pieces, self.copies, strict=True):
                            if c.dtype == dtype and key in self._piece_state(c):
                                buf[at : at + b - a] = self._piece_state(c)[key]
                    wait(dist.broadcast(buf, src=r, async_op=True))
                    if self.rank == 0:
                        host = buf.cpu()
                        for rr, i, a, b, at in self._slices(dtype, indices, size):
                            if rr == r and i in out:
                                out[i][key].view(-1)[a:b] = host[at : at + b - a]
        return out if self.rank == 0 else None

    def load_state(self, state: dict[int, dict[str, torch.Tensor]] | None, wait: Callable = _wait) -> None:
        """Rank 0's `state` (as `gather_state` returns it, checked by the caller; None on the other ranks) cut into
        every rank's pieces, replacing what they held: one rank's slice at a time, broadcast from rank 0."""
        steps = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
        if self.rank == 0:
            for i, st in state.items():
                steps[i] = float(st["step"])
        wait(dist.broadcast(steps, src=0, async_op=True))
        steps_list = steps.cpu().tolist()
        if self.optimizer is not None:
            self.optimizer.state.clear()
        self.stepped = {i for i, s in enumerate(steps_list) if s > 0}
        for dtype, indices, size in self.layout:
            if not any(steps_list[i] > 0 for i in indices):
                continue
            for key in self.STATE_KEYS:
                buf = torch.zeros(size, dtype=dtype, device=self.device)
                for r in range(self.world):
                    if self.rank == 0:
                        host = torch.zeros(size, dtype=dtype)
                        for rr, i, a, b, at in self._slices(dtype, indices, size):
                            if rr == r and i in state:
                                host[at : at + b - a] = state[i][key].reshape(-1)[a:b]
                        buf.copy_(host)
                    wait(dist.broadcast(buf, src=0, async_op=True))
                    if r != self.rank:
                        continue
                    for (i, a, b, at), c in zip(self.pieces, self.copies, strict=True):
                        if c.dtype == dtype and steps_list[i] > 0:
                            st = self.optimizer.state[c]
                            st.setdefault("step", torch.tensor(steps_list[i], dtype=torch.float32))
                            st[key] = buf[at : at + b - a].clone()
