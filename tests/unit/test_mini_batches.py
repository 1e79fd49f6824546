"""PPO mini-batches (`algorithm.ppo_mini_batches`): a batch's groups, in plan order, are cut into M equal parts, one
optimizer step each. The first part is exactly on-policy; later parts are clipped against the behaviour log-probs.
`BatchSteps` must give the same steps whatever order the shards land in, and refuse an incomplete batch."""

from __future__ import annotations

import copy

import pytest
import torch

from configs.schema import ConfigError, load_config
from models.packing import Group, pack, packed_logits, token_logprobs
from models.tiny import build_tiny_model
from models.trainer import PolicyTrainer, RolloutGroup
from tasks.iteration import BatchSteps

torch.set_num_threads(1)

VOCAB = 40
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
PLAN = [17, 3, 11, 5, 8, 2, 14, 9]  # prompt ids in plan order: mini-batches {17, 3, 11, 5} and {8, 2, 14, 9}


def _batch(model) -> dict[int, RolloutGroup]:
    """One group per planned prompt, with the behaviour log-probs of `model` (the policy that generated them)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for pid in PLAN:
        prompt = torch.randint(4, VOCAB, (12,), generator=gen).tolist()
        lens = torch.randint(2, 6, (4,), generator=gen).tolist()
        responses = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]
        packed = pack([Group(prompt, responses)], 0, shared=False)
        with torch.no_grad():
            lp = token_logprobs(packed_logits(model, packed), packed.targets)
        behavior = [lp[i, :n].tolist() for i, n in enumerate(lens)]
        rewards = torch.rand(4, generator=gen).tolist()
        out[pid] = RolloutGroup(prompt, responses, rewards, behavior, [[0] * n for n in lens], prompt_id=pid)
    return out


def _cfg(m: int):
    return load_config(
        None, [f"algorithm.ppo_mini_batches={m}", "rollout.prompts_per_iteration=8", "train.micro_batch_tokens=64"]
    )


def _train(model, groups: dict[int, RolloutGroup], m: int, arrivals: list[list[int]], lr: float = 3e-2):
    model = copy.deepcopy(model)
    trainer = PolicyTrainer(model, None, lr=lr, grad_clip=None)
    steps = BatchSteps(trainer, _cfg(m), PLAN, version=0)
    for shard in arrivals:
        steps.add([groups[p] for p in shard])
    return model, steps.finish(), steps.steps


def _diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def setup():
    model = build_tiny_model(VOCAB, seed=0, **TINY)
    return model, _batch(model)


def test_steps_do_not_depend_on_the_order_shards_land_in(setup):
    model, groups = setup
    in_order = [PLAN[i : i + 2] for i in range(0, 8, 2)]
    reverse = [[9, 14], [2, 8], [5, 11], [3, 17]]  # the second mini-batch lands first and waits
    interleaved = [[8, 17], [3, 2], [14, 11], [9, 5]]
    a, fa, sa = _train(model, groups, 2, in_order)
    b, _, _ = _train(model, groups, 2, reverse)
    c, _, _ = _train(model, groups, 2, interleaved)
    assert _diff(a, b) <= 1e-5 and _diff(a, c) <= 1e-5  # fp32 sums in another order (the periodic tolerance)
    assert fa["train/optimizer_steps"] == 2.0 and fa["train/samples"] == 32.0
    assert fa["train/tokens"] == sa[0]["train/tokens"] + sa[1]["train/tokens"]
    assert fa["mismatch/logp_abs"] == sa[0]["mismatch/logp_abs"] < 1e-5  # engine vs trainer, before any step
    t0, t1 = sa[0]["train/tokens"], sa[1]["train/tokens"]
    assert fa["entropy/mean"] == pytest.approx((sa[0]["entropy/mean"] * t0 + sa[1]["entropy/mean"] * t1) / (t0 + t1))
    one, f1, _ = _train(model, groups, 1, in_order)  # negative control: one step is a different update
    assert _diff(a, one) > 1e-4
    assert "train/optimizer_steps" not in f1 and f1["train/samples"] == 32.0


@pytest.mark.parametrize("m", [1, 2])
def test_the_first_step_is_on_policy_whatever_the_behaviour_logprobs(setup, m):
    """The batch's first step uses the current policy as the old one (ratio exactly 1, nothing clipped), even when
    the engine's log-probs differ from the trainer's (a bf16 or vLLM engine): here they are all 0.5 too low."""
    model, groups = setup
    shifted = {p: copy.copy(g) for p, g in groups.items()}
    for g in shifted.values():
        g.behavior_logprobs = [[x - 0.5 for x in row] for row in g.behavior_logprobs]
    _, _, steps = _train(model, shifted, m, [PLAN[i : i + 2] for i in range(0, 8, 2)])
    assert steps[0]["mismatch/logp_abs"] == pytest.approx(0.5, abs=1e-4)  # the engine's error is seen...
    assert steps[0]["clip/fraction"] == 0.0  # ...and not used as the old policy (ratio e^0.5 = 1.65 would clip)


def test_later_mini_batches_are_clipped_against_the_behaviour_policy(setup):
    model, groups = setup
    a, _, steps = _train(model, groups, 2, [PLAN[:4], PLAN[4:]])
    # by hand: a step on the first half (old = current: ratio 1), then the second half against the behaviour
    ref = copy.deepcopy(model)
    trainer = PolicyTrainer(ref, None, lr=3e-2, grad_clip=None, pad_token_id=0)
    trainer.micro_step([groups[p] for p in PLAN[:4]])
    trainer.optimizer_step()
    trainer.micro_step([groups[p] for p in PLAN[4:]], behavior_old=True)
    trainer.optimizer_step()
    assert _diff(a, ref) <= 1e-5
    assert steps[0]["clip/fraction"] == 0.0  # on-policy: nothing to clip
    assert steps[1]["clip/fraction"] > 0.0  # the first step moved the policy past the trust region on some tokens


def test_an_incomplete_batch_a_stranger_or_a_repeated_group_is_refused(setup):
    model, groups = setup
    trainer = PolicyTrainer(copy.deepcopy(model), None, lr=1e-3)
    steps = BatchSteps(trainer, _cfg(2), PLAN, version=0)
    steps.add([groups[p] for p in PLAN[:6]])
    with pytest.raises(RuntimeError, match=r"batch incomplete: mini-batch 1 of 2"):
        steps.finish()
    stranger = copy.copy(groups[17])
    stranger.prompt_id = 99
    with pytest.raises(Exception, match="prompt 99 is not in this batch's plan"):
        BatchSteps(trainer, _cfg(2), PLAN, version=0).add([stranger])
    twice = BatchSteps(trainer, _cfg(2), PLAN, version=0)
    twice.add([groups[8]])  # waits for the first mini-batch
    with pytest.raises(Exception, match="a second group of prompt 8 in one batch"):
        twice.add([groups[8]])


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (["algorithm.ppo_mini_batches=3"], "must divide rollout.prompts_per_iteration=32"),
        (["algorithm.ppo_mini_batches=2", "pipeline.mode=async"], "applies to modes sync and periodic"),
        (["algorithm.ppo_mini_batches=2", "rollout.top_p=0.9"], "set rollout.top_p to 1.0 or ppo_mini_batches to 1"),
        (["pipeline.mode=async", "rollout.top_p=0.9"], "set rollout.top_p to 1.0 or pipeline.mode to periodic"),
    ],
)
def test_bad_mini_batch_configs_are_refused(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(None, overrides)


def test_an_async_run_frozen_with_top_p_below_one_still_resumes_and_replays():
    """The refusal of async mode with nucleus sampling came after such runs could be started: their frozen config
    (resume: load_config(frozen=True); replay: frozen_config) still validates, since a resume cannot change it."""
    import json

    from configs.schema import frozen_config, resolved_json

    given = ["pipeline.mode=async", "rollout.top_p=0.9"]
    assert load_config(None, given, frozen=True).rollout.top_p == 0.9
    frozen = json.loads(resolved_json(load_config(None, ["run.run_id=r1"])))
    frozen["pipeline"]["mode"], frozen["rollout"]["top_p"] = "async", 0.9
    assert frozen_config(frozen).rollout.top_p == 0.9
    with pytest.raises(ConfigError, match="set rollout.top_p to 1.0 or ppo_mini_batches to 1"):  # never startable
        load_config(None, ["algorithm.ppo_mini_batches=2", "rollout.top_p=0.9"], frozen=True)


@pytest.mark.parametrize("m", [1, 2])
def test_before_step_runs_before_every_optimizer_step_and_sees_the_weights_unchanged(setup, m):
    """The train task waits there for the checkpoint being written from the live tensors (zero-copy snapshot):
    the hook must run before each step, while the weights are still those the batch started from."""
    model, groups = setup
    model = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    trainer = PolicyTrainer(model, None, lr=3e-2, grad_clip=None)
    seen: list[float] = []  # max |w - start| each time the hook runs
    steps_before: list[int] = []
    steps = BatchSteps(
        trainer,
        _cfg(m),
        PLAN,
        version=0,
        before_step=lambda: (
            seen.append(max(float((p.detach() - s).abs().max()) for p, s in zip(model.parameters(), start))),
            steps_before.append(len(steps.steps)),
        ),
    )
    for i in range(0, 8, 2):
        steps.add([groups[p] for p in PLAN[i : i + 2]])
    steps.finish()
    assert steps_before == list(range(m))  # once per step, each time before that step was taken
    assert seen[0] == 0.0  # the first hook: nothing has moved the weights yet
    if m == 2:
        assert seen[1] > 0.0  # the second: after the first step (the hook is not called once up front)


def test_a_shard_holding_part_of_a_group_is_refused():
    import pyarrow as pa

    from storage.shards import ShardError
    from tasks.iteration import groups_of

    def rows(gid: str, n: int) -> list[dict]:
        return [
            dict(
                group_id=gid,
                prompt_id=int(gid.split("-")[1]),
                prompt_ids=[1, 2],
                response_ids=[3 + j],
                reward=0.0,
                behavior_logprobs=[-0.1],
                token_versions=[0],
            )
            for j in range(n)
        ]

    whole = groups_of(pa.Table.from_pylist(rows("0-1", 4) + rows("0-2", 4)), 4)
    assert [(g.prompt_id, g.responses) for g in whole] == [(1, [[3], [4], [5], [6]]), (2, [[3], [4], [5], [6]])]
    with pytest.raises(ShardError, match=r"partial groups \(group id: samples, expected 4\): \{'0-2': 3\}"):
        groups_of(pa.Table.from_pylist(rows("0-1", 4) + rows("0-2", 3)), 4)
    with pytest.raises(ShardError, match=r"\{'0-1': 5\}"):  # a sample too many (a group written twice in part)
        groups_of(pa.Table.from_pylist(rows("0-1", 5)), 4)


def test_a_token_beyond_the_staleness_bound_or_ahead_of_the_trainer_is_refused():
    from storage.shards import ShardError
    from tasks.iteration import token_staleness

    def group(versions: list[list[int]]) -> RolloutGroup:
        return RolloutGroup(
            [1], [[2] * len(v) for v in versions], [0.0] * len(versions), [[-0.1] * len(v) for v in versions], versions
        )

    # trainer at version 5, bound 2: versions 3-5 are fine (an interrupted sample carries several)
    assert token_staleness("s", [group([[3, 4], [5]]), group([[4, 4, 5]])], 5, 2) == [2, 1, 0, 1, 1, 0]
    with pytest.raises(ShardError, match=r"^s: tokens 3 versions behind the trainer's 5 \(bound 2\) or 0 ahead"):
        token_staleness("s", [group([[3, 4], [2]])], 5, 2)
    with pytest.raises(ShardError, match=r"^s: tokens 0 versions behind the trainer's 5 \(bound 2\) or 1 ahead"):
        token_staleness("s", [group([[5, 6]])], 5, 2)
    assert token_staleness("s", [group([[5]])], 5, 0) == [0]  # periodic and sync: bound 0


def _with_flat_rewards(model, groups: dict[int, RolloutGroup], flat: list[int]) -> BatchSteps:
    """Two mini-batches of the batch, the groups of `flat` given all-equal rewards (zero advantage: skipped), every
    group added."""
    groups = {pid: copy.copy(g) for pid, g in groups.items()}
    for pid in flat:
        groups[pid].rewards = [1.0] * 4
    steps = BatchSteps(PolicyTrainer(copy.deepcopy(model), None, lr=3e-2, grad_clip=None), _cfg(2), PLAN, version=0)
    steps.add(list(groups.values()))
    return steps


def test_a_first_mini_batch_with_nothing_to_learn_has_no_mismatch_figure(setup):
    """Mini-batch 1 all zero advantage (skipped, `train.skip_zero_advantage`), mini-batch 2 not: the batch's token
    figures are mini-batch 2's alone, and no `mismatch/logp_abs` is reported (after a step the policy has moved, so
    logp - behaviour there is not the engine's mismatch); counts add up over both."""
    model, groups = setup
    steps = _with_flat_rewards(model, groups, PLAN[:4])
    figures = steps.finish()
    assert "mismatch/logp_abs" not in steps.steps[0] and "mismatch/logp_abs" not in figures
    assert figures["entropy/mean"] == steps.steps[1]["entropy/mean"] > 0
    assert figures["train/skipped_groups"] == 4.0 and figures["train/samples"] == 32.0
    assert figures["train/optimizer_steps"] == 2.0 and figures["train/tokens"] == steps.steps[1]["train/tokens"]


def test_mini_batches_add_up_the_skipped_counts(setup):
    """Zero-advantage groups in both mini-batches, each with tokens trained too: the batch's skipped groups, skipped
    tokens and zero-advantage groups are the sums of its steps' (not token-weighted means), and the skipped tokens
    are those groups' response tokens."""
    model, groups = setup
    flat = [PLAN[0], PLAN[1], PLAN[5]]  # two in mini-batch 1, one in mini-batch 2
    steps = _with_flat_rewards(model, groups, flat)
    figures = steps.finish()
    tokens = {pid: float(sum(len(r) for r in groups[pid].responses)) for pid in PLAN}
    assert [(f["train/skipped_groups"], f["adv/zero_groups"]) for f in steps.steps] == [(2.0, 2.0), (1.0, 1.0)]
    assert [f["train/skipped_tokens"] for f in steps.steps] == [tokens[PLAN[0]] + tokens[PLAN[1]], tokens[PLAN[5]]]
    assert all(f["train/tokens"] > 0 for f in steps.steps)
    assert (figures["train/skipped_groups"], figures["adv/zero_groups"]) == (3.0, 3.0)
    assert figures["train/skipped_tokens"] == sum(tokens[pid] for pid in flat)
    assert figures["train/tokens"] + figures["train/skipped_tokens"] == sum(tokens.values())


def test_a_batch_of_mini_batches_with_nothing_to_learn_reports_its_counts_and_rate(setup):
    """Every group zero advantage: neither step trains a token; the batch still finishes with its counts, no token
    figure that would read as a value (entropy, mismatch), and the averaged figures are the steps' plain mean, not
    weighted by 0 tokens: train/lr is the rate the steps took (it read 0.0)."""
    model, groups = setup
    steps = _with_flat_rewards(model, groups, PLAN)
    figures = steps.finish()
    assert figures["train/tokens"] == 0.0
    assert figures["train/skipped_tokens"] == float(sum(len(r) for g in groups.values() for r in g.responses))
    assert figures["train/skipped_groups"] == 8.0 and figures["train/samples"] == 32.0
    assert figures["train/optimizer_steps"] == 2.0 and figures["loss/policy"] == 0.0 == figures["grad/norm"]
    assert [f["train/lr"] for f in steps.steps] == [3e-2, 3e-2] and figures["train/lr"] == pytest.approx(3e-2)
    assert "entropy/mean" not in figures and "mismatch/logp_abs" not in figures
