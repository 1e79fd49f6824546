"""DAPO dynamic sampling (`algorithm.dynamic_sampling`): a group whose rewards are all equal is not trained, later
rounds of prompts refill the batch, and the batch is the first `prompts_per_iteration` kept groups in plan order,
round after round, whatever order their shards land in."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from configs.schema import ConfigError, inert_settings, load_config
from models.tiny import build_tiny_model
from models.trainer import PolicyTrainer, RolloutGroup
from tasks.iteration import BatchSteps, KeptGroups
from tasks.session import iteration_prompt_ids, refill_prompt_ids

torch.set_num_threads(1)

VOCAB = 40
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _group(pid: int, rewards: list[float], gen: torch.Generator | None = None) -> RolloutGroup:
    gen = gen or torch.Generator().manual_seed(pid)
    prompt = torch.randint(4, VOCAB, (10,), generator=gen).tolist()
    lens = torch.randint(2, 5, (len(rewards),), generator=gen).tolist()
    responses = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]
    behavior = [[-1.0] * n for n in lens]  # the first step is on-policy whatever these are
    return RolloutGroup(prompt, responses, list(rewards), behavior, [[0] * n for n in lens], prompt_id=pid)


# round 0 plans 4 prompts, round 1 four more; "same" groups have equal rewards (dropped)
ROUND0, ROUND1 = [7, 3, 9, 1], [12, 5, 20, 8]
SIGNAL = {7: [1, 0], 3: [0, 0], 9: [1, 1], 1: [0.5, 0], 12: [1, 1], 5: [0, 1], 20: [0.2, 0.7], 8: [1, 0]}


def _kept(ordered=False, defer=False, rounds=(ROUND0, ROUND1), size=4, atol=0.0) -> KeptGroups:
    k = KeptGroups(size, atol, ordered=ordered, defer=defer)
    for r in rounds:
        k.add_round(list(r))
    return k


def test_the_batch_is_the_first_kept_groups_in_plan_order_whatever_the_arrival_order():
    plan = ROUND0 + ROUND1
    results = set()
    for seed in range(30):
        order = plan[:]
        random.Random(seed).shuffle(order)
        for ordered in (False, True):
            k = _kept(ordered=ordered)
            released: list[tuple[int, int | None]] = []
            for pid in order:
                groups, positions = k.add([_group(pid, SIGNAL[pid])])
                released += [(g.prompt_id, p) for g, p in zip(groups, positions)]
            assert k.complete and not k.short
            rest, rest_positions = k.close()
            assert rest == [] and rest_positions == []
            # kept in plan order: 7, 1 (round 0), then 5, 20 of round 1; 8 is kept too but past the batch's end
            assert k.kept == [7, 1, 5, 20] and k.dropped == [3, 9, 12] and k.surplus == [8]
            assert sorted(p for p, _ in released) == [1, 5, 7, 20]
            if ordered:  # positions in the batch, released in order
                assert released == [(7, 0), (1, 1), (5, 2), (20, 3)]
            results.add(tuple(k.kept))
            assert k.figures() == {
                "filter/kept_groups": 4.0,
                "filter/dropped_groups": 3.0,
                "filter/surplus_groups": 1.0,
                "filter/rounds": 2.0,
                "filter/fallback": 0.0,
            }
            assert k.decisions() == {"trained": [7, 1, 5, 20], "dropped": [3, 9, 12], "surplus": [8], "fallback": False}
    assert results == {(7, 1, 5, 20)}


def test_a_first_round_group_trains_at_once_a_later_round_group_waits_for_the_groups_before_it():
    k = _kept()
    groups, positions = k.add([_group(1, SIGNAL[1])])  # the last of round 0, first to land: trained at once
    assert [g.prompt_id for g in groups] == [1] and positions == [None]
    assert k.add([_group(20, SIGNAL[20])]) == ([], [])  # round 1: waits for 12 and 5 (and round 0)
    assert k.add([_group(5, SIGNAL[5])]) == ([], [])
    groups, _ = k.add([_group(p, SIGNAL[p]) for p in (7, 3, 9)])
    assert [g.prompt_id for g in groups] == [7]  # 3 and 9 dropped; round 1 still waits for 12
    groups, positions = k.add([_group(12, SIGNAL[12])])
    assert [g.prompt_id for g in groups] == [5, 20] and positions == [2, 3]
    ordered = _kept(ordered=True)  # several mini-batches: a group's place decides its step, so all wait
    assert ordered.add([_group(1, SIGNAL[1])]) == ([], [])


def test_sync_mode_holds_every_group_till_close():
    k = _kept(defer=True)
    for pid in ROUND0 + ROUND1:
        assert k.add([_group(pid, SIGNAL[pid])]) == ([], [])
    groups, _ = k.close()
    assert sorted(g.prompt_id for g in groups) == [1, 5, 7, 20]


def test_a_batch_that_kept_none_trains_its_first_round_and_a_short_batch_what_it_kept():
    k = _kept(rounds=(ROUND0,))
    for pid in ROUND0:
        k.add([_group(pid, [0.5, 0.5])])
    assert k.complete and k.short
    groups, positions = k.close()
    assert [g.prompt_id for g in groups] == ROUND0 and positions == [0, 1, 2, 3]
    assert k.fallback and k.batch_groups == 4 and k.decisions()["trained"] == ROUND0
    short = _kept(rounds=(ROUND0,))
    short.add([_group(pid, SIGNAL[pid]) for pid in ROUND0])
    assert short.close() == ([], []) and short.batch_groups == 2 and not short.fallback


def test_atol_a_stranger_a_repeat_and_an_early_close_are_refused():
    k = _kept(atol=0.5, rounds=(ROUND0,))
    k.add([_group(p, SIGNAL[p]) for p in ROUND0])
    assert k.kept == [7] and k.dropped == [3, 9, 1]  # 1's spread 0.5 is not above 0.5
    k = _kept()
    with pytest.raises(Exception, match="prompt 99 is not in this batch's plan"):
        k.add([_group(99, [1, 0])])
    k.add([_group(1, [1, 0])])
    with pytest.raises(Exception, match="a second group of prompt 1 in one batch"):
        k.add([_group(1, [1, 0])])
    k.add([_group(7, [0, 0])])  # decided (dropped)
    with pytest.raises(Exception, match="a second group of prompt 7 in one batch"):
        k.add([_group(7, [0, 0])])
    with pytest.raises(RuntimeError, match="batch incomplete: 6 planned groups not landed"):
        k.close()
    with pytest.raises(ValueError, match="prompt 7 planned twice"):
        k.add_round([7])


def _cfg(m: int, mode: str = "periodic", rounds: int = 3):
    return load_config(
        None,
        [
            f"algorithm.ppo_mini_batches={m}",
            "rollout.prompts_per_iteration=4",
            "rollout.group_size=2",
            "train.micro_batch_tokens=64",
            "algorithm.dynamic_sampling=true",
            f"algorithm.dynamic_sampling_rounds={rounds}",
            f"pipeline.mode={mode}",
        ],
    )


def _diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(VOCAB, seed=0, **TINY)


ARRIVALS = ([[7, 3], [9, 1], [12, 5], [20, 8]], [[20, 8], [12, 5], [9, 1], [7, 3]])


@pytest.mark.parametrize(
    ("m", "mode", "released"),
    [
        # one step: a kept group of the first round trains as it lands, a later one once those before it are in
        (1, "periodic", ([[7], [1], [5], [20]], [[1], [7, 5, 20]])),
        # mini-batches: in batch order only
        (2, "periodic", ([[7], [1], [5], [20]], [[7, 1, 5, 20]])),
        (2, "sync", ([[7, 1, 5, 20]], [[7, 1, 5, 20]])),  # all at the end
    ],
)
def test_steps_equal_plain_steps_on_the_kept_groups(model, m, mode, released):
    """The optimizer steps of a filtered batch, whatever order its shards land in, are those of a batch planned as
    the kept groups in the first place (no dynamic sampling) whose groups arrive as the filter releases them."""
    groups = {p: _group(p, SIGNAL[p]) for p in ROUND0 + ROUND1}
    cfg = load_config(
        None, [f"algorithm.ppo_mini_batches={m}", "rollout.prompts_per_iteration=4", "train.micro_batch_tokens=64"]
    )
    for arrival, chunks in zip(ARRIVALS, released, strict=True):
        plain = copy.deepcopy(model)
        steps = BatchSteps(PolicyTrainer(plain, None, lr=3e-2, grad_clip=None), cfg, [7, 1, 5, 20], version=0)
        for chunk in chunks:
            steps.add([groups[p] for p in chunk])
        plain_figures = steps.finish()
        filtered = copy.deepcopy(model)
        steps = BatchSteps(PolicyTrainer(filtered, None, lr=3e-2, grad_clip=None), _cfg(m, mode), ROUND0, version=0)
        for shard in arrival:
            if shard[0] in ROUND1 and steps.sampling.rounds == 1:  # planned before its first shard lands
                steps.add_round(ROUND1)
            steps.add([groups[p] for p in shard])
        figures = steps.finish()
        assert _diff(filtered, plain) == 0.0 and _diff(filtered, model) > 1e-3
        assert figures["train/samples"] == plain_figures["train/samples"] == 8.0
        assert figures["loss/policy"] == plain_figures["loss/policy"]
        assert figures.get("train/optimizer_steps", 1.0) == float(m)
        assert figures["filter/kept_groups"] == 4.0 and figures["filter/surplus_groups"] == 1.0


def test_a_short_batch_takes_the_steps_its_groups_fill(model):
    """With 2 mini-batches of 2: 2 kept groups take one step, not a second empty one; 3 kept take two, the second of
    one group; with rounds left a short batch asks for another round."""
    groups = {p: _group(p, SIGNAL[p]) for p in ROUND0 + ROUND1}
    steps = BatchSteps(PolicyTrainer(copy.deepcopy(model), None, lr=3e-2), _cfg(2, rounds=1), ROUND0, version=0)
    steps.add([groups[p] for p in ROUND0])
    assert steps.next_round() == 0  # one round allowed
    figures = steps.finish()
    assert len(steps.steps) == 1 and figures["train/samples"] == 4.0 and figures["filter/kept_groups"] == 2.0
    again = BatchSteps(PolicyTrainer(copy.deepcopy(model), None, lr=3e-2), _cfg(2, rounds=3), ROUND0, version=0)
    again.add([groups[p] for p in ROUND0])
    assert again.next_round() == 4  # 2 missing over 2 of 4 kept, in whole chunks of 4 (pipeline.shard_groups)
    again.add_round([12, 5])
    again.add([groups[12], groups[5]])  # 12 dropped, 5 kept: 3 of 4, a round left
    assert again.next_round() == 4
    again.add_round([20])
    with pytest.raises(RuntimeError, match=r"batch incomplete: 1 planned groups not landed"):
        again.finish()
    three = BatchSteps(PolicyTrainer(copy.deepcopy(model), None, lr=3e-2), _cfg(2, rounds=2), ROUND0, version=0)
    three.add([groups[p] for p in ROUND0])
    three.add_round([12, 5])
    three.add([groups[12], groups[5]])
    assert three.next_round() == 0  # the rounds are spent
    figures = three.finish()
    assert [s["train/samples"] for s in three.steps] == [4.0, 2.0] and figures["train/optimizer_steps"] == 2.0


def test_a_batch_that_kept_none_trains_its_first_round_in_plan_order_with_mini_batches(model):
    """The fallback with 2 mini-batches: round 0's groups at their plan positions, two steps, as without dynamic
    sampling (bitwise)."""
    flat = {p: _group(p, [0.5, 0.5]) for p in ROUND0}
    cfg = load_config(
        None, ["algorithm.ppo_mini_batches=2", "rollout.prompts_per_iteration=4", "train.micro_batch_tokens=64"]
    )
    plain = copy.deepcopy(model)
    steps = BatchSteps(PolicyTrainer(plain, None, lr=3e-2, grad_clip=None), cfg, ROUND0, version=0)
    steps.add([flat[p] for p in ROUND0])
    steps.finish()
    filtered = copy.deepcopy(model)
    steps = BatchSteps(PolicyTrainer(filtered, None, lr=3e-2, grad_clip=None), _cfg(2, rounds=1), ROUND0, version=0)
    steps.add([flat[p] for p in reversed(ROUND0)])
    figures = steps.finish()
    assert figures["filter/fallback"] == 1.0 and figures["train/optimizer_steps"] == 2.0
    assert _diff(filtered, plain) == 0.0


def test_refill_rounds_draw_new_prompts_deterministically():
    cfg = load_config(None, ["rollout.prompts_per_iteration=8", "run.seed=5"])
    first = iteration_prompt_ids(cfg, 50, 3)
    second = refill_prompt_ids(50, 5, 3, 1, first, 8)
    third = refill_prompt_ids(50, 5, 3, 2, first + second, 6)
    assert len(second) == 8 and len(third) == 6
    assert not set(first) & set(second) and not set(third) & set(first + second)
    assert second == refill_prompt_ids(50, 5, 3, 1, first, 8)  # deterministic
    assert second != refill_prompt_ids(50, 5, 4, 1, first, 8)  # another iteration draws others
    assert second != refill_prompt_ids(50, 6, 3, 1, first, 8)  # and another seed
    taken = list(range(46))
    assert sorted(refill_prompt_ids(50, 5, 3, 1, taken, 8)) == [46, 47, 48, 49]  # what is left
    assert refill_prompt_ids(50, 5, 3, 1, list(range(50)), 8) == []


@pytest.mark.parametrize(
    ("planned", "kept", "multiple", "count"),
    [
        (8, 6, 1, 3),  # 2 missing at 6 of 8 kept: 2 x 8 / 6 = 2.7 -> 3
        (8, 6, 4, 4),  # rounded up to whole chunks of 4
        (8, 1, 1, 8),  # 7 x 8 = 56: at most the batch
        (8, 0, 4, 8),  # none kept: the batch
        (16, 7, 2, 4),  # 7 of 16 kept, 1 missing: 16 / 7 = 2.3 -> 3, in chunks of 2: 4
    ],
)
def test_a_refill_round_asks_for_the_missing_groups_over_the_share_kept(planned, kept, multiple, count):
    k = KeptGroups(8, 0.0, ordered=False, defer=False)
    k.add_round(list(range(planned)))
    k.add([_group(p, [1, 0] if p < kept else [1, 1]) for p in range(planned)])
    assert len(k.kept) == kept and k.complete
    assert k.refill(multiple) == count


def test_config_refuses_async_and_a_group_of_one_and_notes_unread_settings():
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling applies to modes sync and periodic"):
        load_config(None, ["algorithm.dynamic_sampling=true", "pipeline.mode=async", "pipeline.max_staleness=1"])
    with pytest.raises(ConfigError, match="a group of rollout.group_size=1 has one reward"):
        load_config(None, ["algorithm.dynamic_sampling=true", "rollout.group_size=1"])
    notes = inert_settings(load_config(None, ["algorithm.dynamic_sampling_rounds=4"]))
    assert any(
        "algorithm.dynamic_sampling_rounds is set but has no effect: algorithm.dynamic_sampling is false" in n
        for n in notes
    )
    assert not any("dynamic_sampling" in n for n in inert_settings(_cfg(1)))
