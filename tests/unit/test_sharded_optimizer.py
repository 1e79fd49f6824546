"""A sharded optimizer across data-parallel ranks (`resources.shard_optimizer`, ZeRO stage 1): each rank holds and
steps AdamW for its slice of the parameters, and the result is the replicated trainer's (rank 0 stepping every
parameter) bit for bit on two ranks over gloo, one process's within fp32 rounding (three ranks too); its state
gathers into the checkpoint format of one AdamW over the whole model and loads back from it, either way."""

from __future__ import annotations

import copy

import pytest
import torch

import tasks.train_ranks
from models.data_parallel import state_numel
from models.tiny import build_tiny_model
from models.trainer import LossSettings, PolicyTrainer
from storage import checkpoints
from tasks.train_ranks import DataParallelTrainer, ShardedOptimizer
from tests.unit.test_data_parallel import TINY, VOCAB, _flat, _group, _max_diff
from tests.unit.test_train_ranks import _deadline, _probe_model

torch.set_num_threads(1)


def _batches(n: int, start: int = 0):
    """`n` batches of three micro-batches of two groups (all ranks get a part of each)."""
    return [[[_group(start + 10 * b + 2 * j), _group(start + 10 * b + 2 * j + 1)] for j in range(3)] for b in range(n)]


def _train(trainers, batches, version: int = 0) -> list[list[dict]]:
    figures = []
    for batch in batches:
        for mb in batch:
            for t in trainers:
                t.micro_step(mb, version)
        figures.append([t.optimizer_step() for t in trainers])
    return figures


def _state(optimizer) -> dict:
    return checkpoints.snapshot(torch.nn.Linear(1, 1), optimizer).optimizer  # (tensors, meta) as a checkpoint has them


def _assert_same_state(a: dict, b: dict, rel: float) -> None:
    (ta, ma), (tb, mb) = a, b
    assert ta.keys() == tb.keys() and ma == mb
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and ta[key].shape == tb[key].shape, key
        scale = float(ta[key].abs().max())  # gradients summed in another order: differences of rounding's size
        diff = float((ta[key].double() - tb[key].double()).abs().max())
        assert diff <= rel * scale, f"{key}: {diff} apart (largest magnitude {scale})"


@pytest.fixture
def broadcasts(monkeypatch) -> list[int]:
    """Counts the weights' broadcasts rank 0 takes part in."""
    calls: list[int] = []
    real = tasks.train_ranks.broadcast_weights

    def spy(modules, **kwargs):
        calls.append(len(modules))
        return real(modules, **kwargs)

    monkeypatch.setattr(tasks.train_ranks, "broadcast_weights", spy)
    return calls


def _run_two_ranks(model, batches, **kw):
    """Train a two-rank trainer (one at a time: one process group per process) on `batches`; its weights, figures,
    optimizer state (as a checkpoint holds it) and rank 0's share of AdamW's state."""
    t = DataParallelTrainer(copy.deepcopy(model), None, ranks=2, threads=1, **kw)
    try:
        with _deadline(120):
            figures = [f[0] for f in _train([t], batches)]
            held = state_numel(t.shard.optimizer) if t.shard is not None else None
            return t.model, figures, _state(t.optimizer), held, type(t.optimizer)
    finally:
        t.close()


def test_two_sharded_ranks_equal_replicas_bitwise_with_two_dtypes_and_an_unused_parameter(broadcasts):
    """A model with a trainable bf16 norm (two dtypes: two flat vectors to cut) and a trainable parameter no pass
    uses in the middle of `parameters()` (no gradient: AdamW leaves it without state, as one AdamW does): sharded and
    replicated two-rank trainers give the same weights, figures (the gradient norm too, every step clipped) and
    optimizer state, bit for bit (on gloo both sum the same two gradients and clip with torch's functions), and rank
    0 holds about half of AdamW's state. The replicas are sent rank 0's weights at every batch; the shards only at
    the first (each rank then steps its own replica)."""
    model = _probe_model(unused=True)
    model.model.norm.to(torch.bfloat16)
    unused = model.model.layers[0].unused.clone()
    kw = dict(lr=1e-2, grad_clip=0.05, shared_prompt=True, weight_decay=0.1)
    rep_model, rep_figures, rep_state, _, rep_type = _run_two_ranks(model, _batches(3), **kw)
    assert len(broadcasts) == 3
    shd_model, shd_figures, shd_state, held, shd_type = _run_two_ranks(model, _batches(3), shard_optimizer=True, **kw)
    assert len(broadcasts) == 3 + 1
    assert shd_type is ShardedOptimizer and rep_type is not ShardedOptimizer
    assert shd_figures == rep_figures  # every figure, exactly
    assert all(f["grad/norm"] > 0.05 for f in rep_figures)  # clipped
    assert _max_diff(rep_model, shd_model) == 0.0
    assert _max_diff(rep_model, model) > 1e-3  # training moved them
    assert shd_model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(shd_model.model.layers[0].unused, unused)
    _assert_same_state(rep_state, shd_state, rel=0.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    stepped = sum(p.numel() for p in trainable) - unused.numel()
    assert sum(t.numel() for t in rep_state[0].values()) == 2 * stepped + len(trainable) - 1  # moments, steps
    assert abs(held - stepped) <= unused.numel() + 2, (held, stepped)  # half of the 2 x stepped moments


def test_three_sharded_ranks_equal_one_process_with_kl_clipping_and_mini_batches():
    """Three ranks (the flat vector padded: its length is not a multiple of 3), a KL term, clipping, a batch in two
    PPO mini-batches: weights, figures and the gathered optimizer state within fp32 rounding of one process."""
    base = build_tiny_model(VOCAB, seed=0, **TINY)
    total = sum(p.numel() for p in base.parameters())
    assert total % 3 != 0
    kw = dict(lr=1e-2, grad_clip=0.1, loss=LossSettings(kl_coef=0.1), shared_prompt=True)
    one = PolicyTrainer(base, copy.deepcopy(base).requires_grad_(False), **kw)
    m = copy.deepcopy(base)
    three = DataParallelTrainer(
        m, copy.deepcopy(base).requires_grad_(False), ranks=3, threads=1, shard_optimizer=True, **kw
    )
    try:
        with _deadline(120):
            for batch, mini in enumerate([1, 2, 1]):
                groups = [[_group(30 * batch + 3 * j + k) for k in range(3)] for j in range(4)]
                for step in range(mini):
                    for mb in groups[step * 4 // mini : (step + 1) * 4 // mini]:
                        for t in (one, three):
                            t.micro_step(mb, batch, behavior_old=step > 0)
                    a, b = one.optimizer_step(), three.optimizer_step()
                    assert a["grad/norm"] > 0.1  # clipped
                    for key in ("loss/policy", "kl/mean", "grad/norm", "train/tokens", "train/samples"):
                        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
                    assert _max_diff(one.model, three.model) <= 1e-5
            _assert_same_state(_state(one.optimizer), _state(three.optimizer), rel=1e-5)
    finally:
        three.close()


def test_optimizer_state_moves_between_sharded_and_replicated_trainers(broadcasts):
    """A checkpoint's optimizer state (`storage.checkpoints`' snapshot and restore, in memory) from a one-process
    trainer loads into a sharded one whose ranks had stepped already, and a sharded one's into a one-process trainer:
    each then trains
    as the trainer it came from (a sharded trainer keeping its own moments differs). Rank 0's weights written
    between batches (a resume) reach the other rank, at once and only then. A state that does not fit the model is
    refused before any rank takes part, and the trainer goes on."""
    base = build_tiny_model(VOCAB, seed=0, **TINY)
    kw = dict(lr=1e-2, grad_clip=1.0, shared_prompt=True)
    one = PolicyTrainer(base, None, **kw)
    _train([one], _batches(2))
    weights = {k: v.clone() for k, v in one.model.state_dict().items()}
    tensors, meta = _state(one.optimizer)
    start = copy.deepcopy(one)
    for restore in (True, False):
        shd = DataParallelTrainer(copy.deepcopy(base), None, ranks=2, threads=1, shard_optimizer=True, **kw)
        try:
            with _deadline(120):
                _train([shd], _batches(1, start=500))  # stepped once: rank 1 holds weights and moments
                checkpoints.load_into(shd.model, weights)  # on rank 0 only: sent to rank 1 before the next batch
                synced = len(broadcasts)
                if not restore:
                    kept = copy.deepcopy(start)
                    assert _max_diff(kept.model, shd.model) == 0.0
                    _train([kept, shd], _batches(1, start=100))
                    assert _max_diff(kept.model, shd.model) > 1e-4  # its own moments: a different step
                    continue
                bad = dict(tensors, **{"0.exp_avg": tensors["0.exp_avg"][:-1]})
                with pytest.raises(ValueError, match="exp_avg of parameter 0 has"):
                    checkpoints._restore_optimizer(shd.optimizer, bad, meta)
                checkpoints._restore_optimizer(shd.optimizer, tensors, meta)
                _assert_same_state((tensors, meta), _state(shd.optimizer), rel=0.0)
                _train([one, shd], _batches(2, start=100))
                assert _max_diff(one.model, shd.model) <= 1e-5
                assert len(broadcasts) == synced + 1  # the restored weights, once

                back = PolicyTrainer(copy.deepcopy(shd.model), None, **kw)
                checkpoints._restore_optimizer(back.optimizer, *_state(shd.optimizer))
                _train([one, shd, back], _batches(1, start=200))
                assert _max_diff(one.model, back.model) <= 1e-5 and _max_diff(shd.model, back.model) <= 1e-5
        finally:
            shd.close()


def test_a_batch_of_skipped_groups_and_a_non_finite_gradient_step_as_one_process():
    """A batch whose every group has zero advantage steps AdamW on a zero gradient (its moments move the weights),
    every trainable parameter at the first step, the parameters with state later, as one process; a non-finite
    gradient on rank 0 refuses the step on every rank (weights unchanged everywhere), as does a step with no
    micro-step (one process's error), and the next batch trains as one process's."""
    base = build_tiny_model(VOCAB, seed=0, **TINY)
    kw = dict(lr=1e-2, grad_clip=1.0, shared_prompt=True)
    one = PolicyTrainer(base, None, **kw)
    two = DataParallelTrainer(copy.deepcopy(base), None, ranks=2, threads=1, shard_optimizer=True, **kw)
    try:
        with _deadline(120):
            _train([one, two], [[[_flat(7)]]])  # the first step: every trainable parameter gets state
            _assert_same_state(_state(one.optimizer), _state(two.optimizer), rel=0.0)
            assert len(_state(two.optimizer)[0]) == 3 * len(list(base.parameters()))
            _train([one, two], _batches(1))
            before = copy.deepcopy(two.model)
            a, b = _train([one, two], [[[_flat(1), _flat(2)], [_flat(3)]]])[0]
            assert b["train/skipped_groups"] == a["train/skipped_groups"] == 3.0
            assert _max_diff(before, two.model) > 1e-4  # the moments moved the weights
            assert _max_diff(one.model, two.model) <= 1e-5

            before = copy.deepcopy(two.model)
            two.micro_step([_group(41), _group(42)])
            next(two.model.parameters()).grad.view(-1)[0] = float("inf")
            with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
                two.optimizer_step()
            assert _max_diff(before, two.model) == 0.0
            with pytest.raises(RuntimeError, match="optimizer_step with no accumulated micro-steps"):
                two.optimizer_step()
            _train([one, two], _batches(1, start=300))
            assert _max_diff(one.model, two.model) <= 1e-5  # rank 1 refused it too and kept in step
    finally:
        two.close()


def _model(transposed: bool):
    """The tiny model; `transposed`: its first matrix stored transposed (not contiguous: a piece of it is a copy,
    not a view)."""
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    if transposed:
        p = next(p for p in model.parameters() if p.dim() == 2)
        p.data = p.data.t().contiguous().t()
        assert not p.is_contiguous()
    return model


def _shard_rank(rank: int, port: int, scatter: bool, transposed: bool, out: str) -> None:  # a rank's process
    import os

    import torch.distributed as dist

    from models.data_parallel import OptimizerShard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    model = _model(transposed)
    shard = OptimizerShard(model, lr=1e-2)
    shard.scatter = scatter
    norms = []
    for step in range(3):
        for p, g in zip(model.parameters(), _rank_grads(model, rank, step), strict=True):
            p.grad = g
        norms.append(shard.reduce(0.5, 0.1, None))
        shard.apply({"lr": 1e-2, "weight_decay": 0.01})
    state = shard.gather_state()
    if rank == 0:
        torch.save({"weights": [p.detach() for p in model.parameters()], "state": state, "norms": norms}, out)
    dist.destroy_process_group()


def _rank_grads(model, rank: int, step: int) -> list:
    """Rank `rank`'s gradients at `step`: random, none for the second parameter."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [None if i == 1 else torch.randn(p.shape, generator=gen) for i, p in enumerate(model.parameters())]


@pytest.mark.parametrize(
    "scatter, transposed",
    [(False, False), (True, True)],
    ids=["all-reduce", "reduce-scatter-and-a-matrix-not-contiguous"],
)
def test_three_shards_take_one_adamw_step_over_the_summed_gradient(tmp_path, scatter, transposed):
    """`OptimizerShard` alone on three processes, both ways of summing: the all-reduce that gloo uses and the
    reduce-scatter of NCCL and HCCL (run here over gloo with blocking waits; no accelerator on this machine), each
    rank's gradient random and none for one parameter: three steps give one AdamW's weights, norms and state over the
    summed, scaled, clipped gradient, within fp32 rounding (the sums of three in another order); also where a piece
    is a copy of a matrix stored transposed, not a view of it."""
    import torch.multiprocessing as tmp

    from tasks.workers import child_context
    from tests.ports import free_port

    out = str(tmp_path / "rank0.pt")
    method = child_context().get_start_method()  # as the runs' ranks: forked by the suite's fork server where it runs
    with _deadline(120):
        tmp.start_processes(_shard_rank, args=(free_port(), scatter, transposed, out), nprocs=3, start_method=method)
    got = torch.load(out)
    model = _model(transposed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    norms = []
    for step in range(3):
        per_rank = [_rank_grads(model, r, step) for r in range(3)]
        for i, p in enumerate(model.parameters()):
            p.grad = None if i == 1 else sum(g[i] for g in per_rank) * 0.5
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
        opt.step()
    assert got["norms"] == pytest.approx(norms, rel=1e-5) and norms[0] > 0.1
    for p, q in zip(model.parameters(), got["weights"], strict=True):
        assert float((p.detach() - q).abs().max()) <= 1e-6
    want = opt.state_dict()["state"]
    assert got["state"].keys() == want.keys() and 1 not in want  # the parameter without gradients: no state
    for i, st in want.items():
        assert float(got["state"][i]["step"]) == float(st["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(st[key].abs().max())
            assert float((got["state"][i][key] - st[key]).abs().max()) <= 1e-5 * scale, (i, key)
