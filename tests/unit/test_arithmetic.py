"""models/arithmetic.py (split, few-shot prompts, reward) and the character tokenizer of models/tiny.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from configs.schema import load_config
from models.arithmetic import (
    OPS,
    Problem,
    build_splits,
    extract_answer,
    make_prompts,
    make_train_prompts,
    reward,
)
from models.tiny import DEFAULT_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer, single_token_id

REPO = Path(__file__).resolve().parents[2]

SHOT = re.compile(r"Q: (\d+)([+*-])(\d+)=\?\nA: (-?\d+)\n")


def parse(text: str) -> tuple[list[tuple[Problem, str]], str]:
    """(shots as (problem, answer) pairs, final question) of a prompt; asserts the format on the way."""
    shots, pos = [], 0
    for m in SHOT.finditer(text):
        assert m.start() == pos, f"unexpected text at {pos}: {text[pos : m.start()]!r}"
        shots.append((Problem(int(m[1]), m[2], int(m[3])), m[4]))
        pos = m.end()
    tail = text[pos:]
    assert tail.startswith("Q: ") and tail.endswith("=?\nA: "), tail
    return shots, tail[len("Q: ") : -len("\nA: ")]


# ------------------------------------------------------------------------------------------------ split


def test_split_is_deterministic_disjoint_and_complete():
    train, held = build_splits(max_operand=30, ops=("+",), n_eval=200, split_seed=1234)
    train2, held2 = build_splits(max_operand=30, ops=("+",), n_eval=200, split_seed=1234)
    assert train == train2 and held == held2
    assert len(held) == 200 and len(train) == 31 * 31 - 200  # 961 problems a+b, a, b in [0, 30]
    assert not set(train) & set(held)
    assert set(train) | set(held) == {Problem(a, "+", b) for a in range(31) for b in range(31)}
    assert len(set(held)) == 200  # no duplicates


def test_split_depends_on_its_seed_only():
    _, held_a = build_splits(30, ("+",), 200, split_seed=1)
    _, held_b = build_splits(30, ("+",), 200, split_seed=2)
    assert set(held_a) != set(held_b)


def test_split_with_several_ops():
    train, held = build_splits(max_operand=5, ops=("+", "-", "*"), n_eval=20, split_seed=0)
    assert len(train) + len(held) == 3 * 36
    assert {p.op for p in train} == {"+", "-", "*"}
    assert Problem(2, "-", 5).answer == "-3" and Problem(4, "*", 5).answer == "20" and Problem(7, "+", 8).answer == "15"
    assert Problem(12, "+", 7).question == "12+7=?"


def test_split_errors():
    with pytest.raises(ValueError, match="unknown operator '/'"):
        build_splits(5, ("+", "/"), 5)
    with pytest.raises(ValueError, match="n_eval=36 leaves no training problems out of 36"):
        build_splits(5, ("+",), 36)


# ------------------------------------------------------------------------------------------------ prompts


@pytest.fixture(scope="module", params=["defaults", "arith-tiny.yaml"])
def default_prompts(request):
    """The prompts of the default config and of the demo's, built exactly as tasks/session.py builds them."""
    t = load_config(None if request.param == "defaults" else REPO / "configs" / request.param).task
    train, held = build_splits(t.max_operand, tuple(t.ops), t.n_eval, t.split_seed)
    return (
        train,
        held,
        make_train_prompts(train, t.n_shots, t.split_seed, t.shot_sets),
        make_prompts(held, train, t.n_shots, t.split_seed + 1),
        t.n_shots,
    )


def test_prompt_length_in_tokens_is_100_to_200(default_prompts):
    # shots of "Q: a+b=?\nA: c\n" (14-17 characters) plus "Q: a+b=?\nA: " (12-14): 8 shots (the default) make
    # 124 to 150 characters, the demo's 6 at least 96 (102 in fact); the tokenizer is one token per character
    tok = build_char_tokenizer()
    _, _, train_prompts, eval_prompts, _ = default_prompts
    for p in train_prompts + eval_prompts:
        ids = tok(p.text, add_special_tokens=False)["input_ids"]
        assert 100 <= len(ids) <= 200, (p.prompt_id, len(ids))
        assert len(ids) == len(p.text) and tok.unk_token_id not in ids


def test_prompt_format_and_correct_shots(default_prompts):
    train, held, train_prompts, eval_prompts, n_shots = default_prompts
    sets = len(train_prompts) // len(train)  # the training problems, once per shot set
    for problems, prompts in ((train * sets, train_prompts), (held, eval_prompts)):
        assert [p.prompt_id for p in prompts] == list(range(len(problems)))
        for problem, prompt in zip(problems, prompts, strict=True):
            shots, question = parse(prompt.text)
            assert question == problem.question and prompt.answer == problem.answer
            assert len(shots) == n_shots
            assert all(answer == shot.answer for shot, answer in shots)  # solved correctly
            assert len({shot for shot, _ in shots}) == n_shots  # no repeated shot


def test_shots_never_include_the_question(default_prompts):
    train, held, train_prompts, eval_prompts, _ = default_prompts
    sets = len(train_prompts) // len(train)
    for problem, prompt in zip(train * sets + held, train_prompts + eval_prompts, strict=True):
        shots, _ = parse(prompt.text)
        assert problem not in {s for s, _ in shots}


def test_eval_prompts_never_show_held_out_problems(default_prompts):
    _, held, _, eval_prompts, _ = default_prompts
    held_set = set(held)
    for prompt in eval_prompts:
        assert not {s for s, _ in parse(prompt.text)[0]} & held_set


def test_question_in_its_own_shot_pool_is_removed():
    # pool of 3 problems, 2 shots, the question is in the pool: it must be skipped whatever the draw,
    # leaving exactly the other two
    pool = [Problem(1, "+", 1), Problem(2, "+", 2), Problem(3, "+", 3)]
    for seed in range(20):
        prompts = make_prompts(pool, pool, n_shots=2, seed=seed)
        for problem, prompt in zip(pool, prompts, strict=True):
            shots = {s for s, _ in parse(prompt.text)[0]}
            assert shots == set(pool) - {problem}


def test_prompts_are_deterministic_and_vary_with_seed_and_index(default_prompts):
    train, _, train_prompts, _, n_shots = default_prompts
    assert make_prompts(train[:50], train, n_shots, 1234) == train_prompts[:50]
    other = make_prompts(train[:50], train, n_shots, 99)
    assert sum(a.text != b.text for a, b in zip(other, train_prompts[:50], strict=True)) >= 45
    assert len({tuple(parse(p.text)[0]) for p in train_prompts[:50]}) == 50  # different shots per prompt


def test_shot_sets_give_each_problem_its_own_contexts():
    train, held = build_splits(30, ("+",), 200, 1234)
    one, four = make_train_prompts(train, 6, 1234), make_train_prompts(train, 6, 1234, shot_sets=4)
    assert one == make_prompts(train, train, 6, 1234)  # one set: the prompts as ever
    assert four[: len(train)] == one and len(four) == 4 * len(train) == 3044
    assert [p.prompt_id for p in four] == list(range(3044))
    held_shots = [parse(p.text)[0] for p in make_prompts(held, train, 6, 1235)]
    for i, problem in enumerate(train):
        sets = [four[k * len(train) + i] for k in range(4)]
        assert {parse(p.text)[1] for p in sets} == {problem.question} and {p.answer for p in sets} == {problem.answer}
        shots = [tuple(s for s, _ in parse(p.text)[0]) for p in sets]
        assert all(problem not in sh and set(sh) <= set(train) for sh in shots)
        assert len(set(shots)) == 4, (i, shots)  # four different contexts
        if i < len(held):  # the held-out prompts' seed (split_seed + 1) is not a training set's
            assert all(list(sh) != [s for s, _ in held_shots[i]] for sh in shots[1:])


def test_zero_shots():
    [prompt] = make_prompts([Problem(3, "*", 4)], [Problem(1, "+", 1)], n_shots=0, seed=0)
    assert prompt.text == "Q: 3*4=?\nA: " and prompt.answer == "12"


# ------------------------------------------------------------------------------------------------ reward


@pytest.mark.parametrize(
    "response,answer,pc,expected",
    [
        ("19", "19", 0.5, 1.0),
        ("19\nQ: 3+4=?", "19", 0.5, 1.0),  # the answer is the first line
        (" 19 ", "19", 0.0, 1.0),  # stripped
        ("18", "19", 0.5, 0.25),  # width 2, '1' matches: 0.5 * 1/2
        ("18", "19", 0.0, 0.0),  # exact only
        ("9", "19", 0.5, 0.25),  # right-aligned ' 9' vs '19': units match, 0.5 * 1/2
        ("119", "19", 0.5, 0.5 * 2 / 3),  # '119' vs ' 19': two of three positions
        ("91", "19", 0.5, 0.0),  # digits swapped: no position matches
        ("", "19", 0.5, 0.0),
        ("\n19", "19", 0.5, 0.0),  # empty first line
        ("abc", "19", 0.5, 0.0),
        ("190", "19", 0.9, 0.0),  # '190' vs ' 19': nothing aligned matches
        ("-3", "-3", 0.5, 1.0),
        ("-4", "-3", 0.5, 0.25),  # '-' counts as a position: 0.5 * 1/2
    ],
)
def test_reward_worked_examples(response, answer, pc, expected):
    assert reward(response, answer, pc) == pytest.approx(expected, abs=1e-12)


def test_reward_is_below_one_unless_exact():
    # partial credit < 1 (the config bounds it so), so a wrong answer never scores like a right one
    for got in ("18", "1", "190", "119", "29"):
        assert reward(got, "19", 0.99) < 1.0


def test_extract_answer():
    assert extract_answer(" 42 \nQ: 1+1=?") == "42"
    assert extract_answer("") == ""


def test_ops_table():
    assert OPS["+"](2, 3) == 5 and OPS["-"](2, 3) == -1 and OPS["*"](2, 3) == 6


# ------------------------------------------------------------------------------------------------ tokenizer


def test_char_tokenizer_ids_and_round_trip():
    tok = build_char_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(set(DEFAULT_ALPHABET))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok(DEFAULT_ALPHABET, add_special_tokens=False)["input_ids"]
    assert ids == list(range(4, 4 + len(DEFAULT_ALPHABET)))  # specials first, then characters in order
    assert tok.decode(ids) == DEFAULT_ALPHABET
    text = "Q: 12+7=?\nA: 19\nQ: 30*3=?\nA: 90\n"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok("\n ")["input_ids"]] == ["\n", " "]
    assert single_token_id(tok, "\n") == 4 + DEFAULT_ALPHABET.index("\n")


def test_char_tokenizer_specials_and_unknowns():
    tok = build_char_tokenizer()
    assert tok("Z!")["input_ids"] == [3, 3]  # not in the alphabet -> <unk>
    assert tok.decode([*tok("19")["input_ids"], tok.eos_token_id], skip_special_tokens=True) == "19"
    small = build_char_tokenizer("ab")
    assert small("ba")["input_ids"] == [5, 4] and len(small) == 6


def test_batches_never_repeat_a_prompt_and_cover_each_epoch_once():
    from configs.schema import load_config
    from tasks.session import iteration_prompt_ids

    cfg = load_config("configs/arith-tiny.yaml", ["rollout.prompts_per_iteration=32"])
    n = 761  # the demo's training prompts: 23 batches an epoch, 25 left over
    per_epoch = n // 32
    batches = [iteration_prompt_ids(cfg, n, k) for k in range(3 * per_epoch)]
    assert all(len(b) == len(set(b)) == 32 for b in batches)
    for e in range(3):
        epoch = [p for b in batches[e * per_epoch : (e + 1) * per_epoch] for p in b]
        assert len(set(epoch)) == len(epoch) == per_epoch * 32  # disjoint batches within an epoch
    assert set(batches[0]) != set(batches[per_epoch])  # a new permutation each epoch
    assert iteration_prompt_ids(cfg, n, 40) == batches[40]  # deterministic
    other = load_config("configs/arith-tiny.yaml", ["run.seed=1"])
    assert iteration_prompt_ids(other, n, 0) != batches[0]
    with pytest.raises(ValueError, match="prompts_per_iteration=32 exceeds the 20 training prompts"):
        iteration_prompt_ids(cfg, 20, 0)


def test_reward_spaces_inside_answers_never_count_as_matched_positions():
    # task.reward arithmetic is allowed on a dataset task, whose answers may hold spaces ("10 m"): a space shared
    # by both strings is not a matched digit position, just as alignment padding is not
    assert reward("12 m", "10 m", 0.5) == pytest.approx(0.5 * 2 / 4)  # '1' and 'm' match; ' ' does not count
    assert reward("1 2", "3 4", 0.5) == 0.0
