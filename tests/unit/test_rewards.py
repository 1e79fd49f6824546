"""`task.reward` to its scoring function: the built-ins (partial credit passed through, the response scored against
the reference), a user's function named by file or module (its signature checked, prompt= given when it takes it,
what it returns checked), and every way a spec or a function can be wrong named with what to do."""

from __future__ import annotations

import os
import sys
import time

import pytest

from configs.schema import ConfigError, inert_settings, load_config
from models.rewards import RewardError, absolute_spec, function_spec, reward_function
from tasks.preflight import InputError, check_reward


def test_arithmetic_passes_partial_credit_through():
    assert reward_function("arithmetic", 0.5)("19", "19") == 1.0
    assert reward_function("arithmetic", 0.5)("18", "19") == pytest.approx(0.25)  # 0.5 x 1 of 2 positions
    assert reward_function("arithmetic")("18", "19") == 0.0  # default: exact match only


def test_math_verify_reads_the_response_not_the_reference():
    score = reward_function("math_verify")
    # the response's final answer is after its last ####; a \boxed{} before it is working, not the answer
    assert score("\\boxed{5} then #### 7", "7") == 1.0
    assert score("0.5", "1/2") == 1.0
    assert score("8", "7", prompt="what is 3 + 4?") == 0.0


def test_math_verify_scores_on_a_thread_too():
    """A rollout worker's scoring thread (`pipeline.overlap_scoring`): math-verify's signal-based limits work on the
    main thread only, and a thread gets the same scores without them instead of math-verify's ValueError."""
    from concurrent.futures import ThreadPoolExecutor

    score = reward_function("math_verify")
    cases = [("\\boxed{5} then #### 7", "7"), ("0.5", "1/2"), ("8", "7"), ("x = 2", "\\frac{4}{2}")]
    with ThreadPoolExecutor(1) as thread:
        on_thread = list(thread.map(lambda c: score(*c), cases))
    assert on_thread == [score(*c) for c in cases] == [1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("kind", ["Arithmetic", "math-verify", "exact", "", "rewards.py", "mod:", ":fn", "a b:fn"])
def test_a_kind_that_is_neither_built_in_nor_a_function_is_named_with_the_forms(kind):
    with pytest.raises(RewardError) as e:
        reward_function(kind)
    assert str(e.value).startswith(f"unknown reward kind: {kind!r}")
    assert "'arithmetic', 'math_verify', FILE.py:FUNCTION or MODULE:FUNCTION" in str(e.value)


def test_function_specs_split_at_the_last_colon():
    assert function_spec("arithmetic") is None
    assert function_spec("my_pkg.rewards:exact") == ("my_pkg.rewards", "exact")
    assert function_spec("/data/x:y/r.py:score") == ("/data/x:y/r.py", "score")  # a colon in the folder's name
    with pytest.raises(ValueError, match="is neither a .py file nor a module name"):
        function_spec("my-pkg.rewards:exact")
    with pytest.raises(ValueError, match="neither a built-in reward nor a function"):
        function_spec("r.py:1st")


def _write(tmp_path, body: str, name: str = "my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_a_file_reward_is_called_with_the_prompt_only_when_it_takes_it(tmp_path):
    path = _write(
        tmp_path,
        "def plain(response, answer):\n    return float(response.strip() == answer)\n"
        "def with_prompt(response, answer, prompt):\n    return len(prompt) + (response == answer)\n"
        "def with_kwargs(response, answer, **kw):\n    return len(kw['prompt'])\n"
        "def as_bool(response, answer):\n    return response == answer\n",
    )
    assert reward_function(f"{path}:plain")(" 7\n", "7", "Q: 3+4=") == 1.0
    assert reward_function(f"{path}:with_prompt")("7", "7", "Q: 3+4=") == 8.0  # len("Q: 3+4=") = 7, plus 1
    assert reward_function(f"{path}:with_kwargs")("7", "7", "abc") == 3.0
    assert reward_function(f"{path}:as_bool")("7", "7") == 1.0 and reward_function(f"{path}:as_bool")("8", "7") == 0.0
    assert isinstance(reward_function(f"{path}:as_bool")("7", "7"), float)


def test_a_module_reward_is_imported_from_the_path(tmp_path, monkeypatch):
    _write(tmp_path, "def score(response, answer):\n    return 0.25\n", name="lockstep_test_rewards_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert reward_function("lockstep_test_rewards_mod:score")("x", "y") == 0.25
    finally:
        sys.modules.pop("lockstep_test_rewards_mod", None)


def test_a_relative_file_is_made_absolute_for_the_frozen_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "def f(response, answer):\n    return 1.0\n")
    assert absolute_spec("my_reward.py:f") == f"{tmp_path}/my_reward.py:f"
    assert absolute_spec("pkg.mod:f") == "pkg.mod:f" and absolute_spec("math_verify") == "math_verify"
    cfg = load_config(None, ["task.reward=my_reward.py:f"])
    assert cfg.task.reward == f"{tmp_path}/my_reward.py:f"
    os.chdir("/")  # elsewhere, the run's config still names the file
    assert reward_function(cfg.task.reward)("a", "b") == 1.0


def test_a_bad_spec_fails_the_config_at_load_with_its_field():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.reward=exact_match"])
    assert "task.reward" in str(e.value)
    assert "'exact_match' is neither a built-in reward nor a function" in str(e.value)


def test_partial_credit_is_named_inert_for_any_reward_but_arithmetic(tmp_path):
    path = _write(tmp_path, "def f(response, answer):\n    return 1.0\n")
    cfg = load_config(None, [f"task.reward={path}:f", "task.partial_credit=0.2"])
    assert f"task.partial_credit is set but has no effect: task.reward is '{path}:f'" in inert_settings(cfg)
    assert not inert_settings(load_config(None, ["task.reward=arithmetic", "task.partial_credit=0.2"]))


@pytest.mark.parametrize(
    "body, spec_name, expected",
    [
        ("def f(response, answer):\n    return 1\n", "g", "defines no 'g'"),
        ("f = 3\n", "f", "f is a int, not a function"),
        ("def f(response):\n    return 1\n", "f", "f(response) cannot be called as f(response, answer)"),
        ("def f(a, b, c):\n    return 1\n", "f", "f(a, b, c) cannot be called as f(response, answer)"),
        (
            "def f(response, answer, prompt, extra):\n    return 1\n",
            "f",
            "cannot be called as f(response, answer, prompt=...)",
        ),
        (
            "import lockstep_no_such_module\n",
            "f",
            "raised ModuleNotFoundError: No module named 'lockstep_no_such_module'",
        ),
        ("def f(:\n", "f", "raised SyntaxError"),
    ],
)
def test_a_function_that_cannot_serve_is_refused_before_any_work(tmp_path, body, spec_name, expected):
    path = _write(tmp_path, body)
    cfg = load_config(None, [f"task.reward={path}:{spec_name}"])
    with pytest.raises(InputError) as e:
        check_reward(cfg)
    assert str(e.value).startswith(f"task.reward '{path}:{spec_name}': ")
    assert expected in str(e.value)


def test_a_missing_file_or_module_says_where_it_looked_and_what_to_do(tmp_path):
    with pytest.raises(InputError, match=f"no file {tmp_path}/gone.py$"):
        check_reward(load_config(None, [f"task.reward={tmp_path}/gone.py:f"]))
    with pytest.raises(InputError) as e:
        check_reward(load_config(None, ["task.reward=lockstep_absent_pkg.rewards:f"]))
    assert "no module 'lockstep_absent_pkg' on this Python's path: install it, add its folder to PYTHONPATH" in str(
        e.value
    )


def test_a_failed_import_leaves_no_half_module_behind(tmp_path):
    path = _write(tmp_path, "raise RuntimeError('needs a GPU')\n")
    for _ in range(2):  # the second try runs the file again instead of finding a half-made module
        with pytest.raises(RewardError, match="raised RuntimeError: needs a GPU"):
            reward_function(f"{path}:f")


@pytest.mark.parametrize(
    "returned, expected",
    [
        ("'1.0'", "returned '1.0' (str) for the response 'r': a reward is a real number"),
        ("None", "returned None (NoneType) for the response 'r'"),
        ("[1.0]", "returned [1.0] (list)"),
        ("float('nan')", "returned nan for the response 'r': a reward must be finite"),
        ("-math.inf", "returned -inf for the response 'r': a reward must be finite"),
    ],
)
def test_what_is_not_a_finite_number_is_refused_naming_the_value_and_the_response(tmp_path, returned, expected):
    path = _write(tmp_path, f"import math\ndef f(response, answer):\n    return {returned}\n")
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:f")("r", "a")
    assert str(e.value).startswith(f"task.reward '{path}:f' {expected}")


def test_a_raising_function_is_named_with_the_response_it_scored(tmp_path):
    path = _write(tmp_path, "def f(response, answer):\n    return float(response) / float(answer)\n")
    score = reward_function(f"{path}:f")
    assert score("6", "3") == 2.0
    with pytest.raises(RewardError) as e:
        score("six", "3")
    assert str(e.value) == (
        f"task.reward '{path}:f' raised ValueError: could not convert string to float: 'six' (scoring the response "
        "'six' against the answer '3')"
    )
    assert isinstance(e.value.__cause__, ValueError)  # the user's traceback is kept


def test_numpy_and_integer_rewards_are_plain_floats(tmp_path):
    path = _write(
        tmp_path,
        "import numpy as np\ndef f(response, answer):\n    return np.float32(0.5)\ndef g(r, a):\n    return 2\n",
    )
    assert reward_function(f"{path}:f")("r", "a") == 0.5 and type(reward_function(f"{path}:f")("r", "a")) is float
    assert reward_function(f"{path}:g")("r", "a") == 2.0 and type(reward_function(f"{path}:g")("r", "a")) is float


def test_numpy_bools_and_zero_dim_tensors_are_rewards_and_async_functions_are_refused(tmp_path):
    path = _write(
        tmp_path,
        "import numpy as np, torch\n"
        "def nb(response, answer):\n    return np.bool_(response == answer)\n"
        "def t0(response, answer):\n    return torch.tensor(0.75)\n"
        "def t1(response, answer):\n    return torch.tensor([0.75])\n"
        "async def later(response, answer):\n    return 1.0\n",
    )
    assert reward_function(f"{path}:nb")("7", "7") == 1.0 and reward_function(f"{path}:nb")("8", "7") == 0.0
    assert reward_function(f"{path}:t0")("r", "a") == 0.75
    with pytest.raises(RewardError, match=r"returned tensor\(\[0.7500\]\) \(torch.Tensor\) for the response 'r'"):
        reward_function(f"{path}:t1")("r", "a")  # one element, but not a scalar
    with pytest.raises(RewardError, match="later is async; a reward function returns its value"):
        reward_function(f"{path}:later")


def test_an_edited_file_is_loaded_again_in_the_same_process(tmp_path):
    path = _write(tmp_path, "def f(response, answer):\n    return 0.0\n")
    assert reward_function(f"{path}:f")("r", "a") == 0.0
    path.write_text("def f(response, answer):\n    return 1.0\ndef g(response, answer):\n    return 2.0\n")
    assert reward_function(f"{path}:f")("r", "a") == 1.0  # size changed (a notebook's second run)
    assert reward_function(f"{path}:g")("r", "a") == 2.0


def test_errors_stay_one_readable_line(tmp_path):
    path = _write(
        tmp_path,
        "def f(response, answer):\n    raise ValueError('bad\\nthing')\ndef g(response, answer):\n    return None\n",
    )
    long = "9" * 5000
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:f")(long, "7")
    message = str(e.value)
    assert "\n" not in message and len(message) < 600
    assert message.startswith(f"task.reward '{path}:f' raised ValueError: bad ... (scoring the response '999")
    assert f"{'9' * 190}... against the answer '7')" in message  # the response cut to 200 characters of its repr
    with pytest.raises(RewardError, match=r"returned None \(NoneType\) for the response '9{196}\.\.\.: a reward is"):
        reward_function(f"{path}:g")(long, "7")


def test_a_file_that_imports_its_neighbour_is_told_about_the_path_and_a_url_is_refused(tmp_path):
    (tmp_path / "helpers_beside_it.py").write_text("X = 1\n")
    path = _write(tmp_path, "import helpers_beside_it\ndef f(response, answer):\n    return 1.0\n")
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:f")
    assert str(e.value) == (
        f"task.reward '{path}:f': importing {path} raised ModuleNotFoundError: No module named 'helpers_beside_it' "
        f"(helpers_beside_it is beside the file, but a file's folder is not on the import path: add {tmp_path} to "
        "PYTHONPATH)"
    )
    other = _write(tmp_path, "import lockstep_not_installed_pkg\n", name="other.py")  # nothing of that name beside
    with pytest.raises(RewardError) as e:
        reward_function(f"{other}:f")
    assert str(e.value).endswith("raised ModuleNotFoundError: No module named 'lockstep_not_installed_pkg'")
    with pytest.raises(ConfigError, match="a reward function is read from a local file or an importable module"):
        load_config(None, ["task.reward=s3://bucket/r.py:f"])


def test_a_module_named_like_one_of_locksteps_says_which_file_it_imported():
    with pytest.raises(RewardError) as e:
        reward_function("tasks:score")
    import tasks

    assert str(e.value) == f"task.reward 'tasks:score': tasks ({tasks.__file__}) defines no 'score'"


def test_a_resumed_runs_missing_file_says_it_is_frozen_and_math_verify_is_checked_installed(tmp_path, monkeypatch):
    gone = tmp_path / "gone.py"
    cfg = load_config(None, [f"task.reward={gone}:f"])
    with pytest.raises(InputError, match=f"^task.reward '{gone}:f': no file {gone}$"):
        check_reward(cfg)
    with pytest.raises(InputError) as e:
        check_reward(cfg, resumed=True)
    assert str(e.value) == (
        f"task.reward '{gone}:f': no file {gone}; this is the run's frozen setting: put the file (or a link to it) "
        "back at that path"
    )
    import importlib.util

    check_reward(load_config(None, ["task.reward=math_verify"]))  # installed here (a dependency)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(
        InputError, match=r"^task.reward is 'math_verify' but math-verify is not installed: pip install"
    ):
        check_reward(load_config(None, ["task.reward=math_verify"]))


def test_a_class_an_empty_message_and_a_value_too_large_for_a_float_are_named(tmp_path):
    path = _write(
        tmp_path,
        "class Scorer:\n    def __init__(self, response, answer):\n        pass\n"
        "def quiet(response, answer):\n    raise ValueError()\n"
        "def huge(response, answer):\n    return 10 ** 400\n",
    )
    with pytest.raises(RewardError, match="Scorer is a class; name a function"):
        reward_function(f"{path}:Scorer")
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:quiet")("r", "a")
    assert (
        str(e.value)
        == f"task.reward '{path}:quiet' raised ValueError (scoring the response 'r' against the answer 'a')"
    )
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:huge")("r", "a")
    assert str(e.value).startswith(f"task.reward '{path}:huge' returned 1000000000") and str(e.value).endswith(
        "(int) for the response 'r': a reward is a real number that fits a float (1.0 counts as correct in held-out "
        "accuracy)"
    )


def test_the_source_digest_is_of_the_file_the_function_comes_from(tmp_path, monkeypatch):
    import hashlib

    from models.rewards import source_digest

    path = _write(tmp_path, "def f(response, answer):\n    return 1.0\n")
    assert source_digest(f"{path}:f") == hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_text("def f(response, answer):\n    return 0.5\n")  # edited: another digest
    assert source_digest(f"{path}:f") == hashlib.sha256(b"def f(response, answer):\n    return 0.5\n").hexdigest()
    import models.arithmetic

    expected = hashlib.sha256(open(models.arithmetic.__file__, "rb").read()).hexdigest()
    assert source_digest("models.arithmetic:reward") == expected  # a module: its own file
    assert source_digest("arithmetic") is None and source_digest("math_verify") is None


def test_a_datasets_extra_fields_reach_the_function_as_keyword_arguments(tmp_path):
    """`task.dataset.extra_fields`: the scorer passes a prompt's values by name, with prompt= where the function takes
    it; a function without a parameter (or **kwargs) for one of them is refused at load, naming the call it must
    take."""
    path = _write(
        tmp_path,
        "def tests_pass(response, answer, tests):\n    return sum(t == response for t in tests) / len(tests)\n"
        "def with_prompt(response, answer, prompt, level):\n    return level + len(prompt)\n"
        "def with_kwargs(response, answer, **kw):\n    return kw['level'] * 2 + len(kw['prompt'])\n"
        "def too_few(response, answer, level):\n    return level\n",
    )
    score = reward_function(f"{path}:tests_pass", fields=("tests",))
    assert score("a", "x", "p", tests=["a", "b", "a", "c"]) == 0.5
    assert reward_function(f"{path}:with_prompt", fields=("level",))("r", "a", "pp", level=3) == 5.0
    assert reward_function(f"{path}:with_kwargs", fields=("level", "tests"))("r", "a", "p", level=2, tests=[]) == 5.0
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:too_few", fields=("level", "tests"))
    assert str(e.value) == (
        f"task.reward '{path}:too_few': too_few(response, answer, level) cannot be called as "
        "too_few(response, answer, level=..., tests=...) (got an unexpected keyword argument 'tests'); a reward "
        "function takes the response and the reference answer (and, optionally, prompt=), and one keyword argument "
        "per field of task.dataset.extra_fields"
    )
    # through the config: the fields a dataset's config lists are those checked before any work
    cfg = load_config(
        None,
        [
            "task.kind=dataset",
            "task.dataset.uri=x.jsonl",
            f"task.reward={path}:too_few",
            "task.dataset.extra_fields=[level, tests]",
        ],
    )
    with pytest.raises(InputError, match="cannot be called as too_few"):
        check_reward(cfg)
    cfg = load_config(None, ["task.kind=dataset", "task.dataset.uri=x.jsonl", f"task.reward={path}:too_few"])
    with pytest.raises(InputError, match=r"cannot be called as too_few\(response, answer\)"):
        check_reward(cfg)  # without extra_fields, a parameter `level` is never given


def test_each_call_gets_its_own_copy_of_the_extra_fields_and_a_builtin_takes_none(tmp_path):
    """A function that changes its argument (pops a test case) does not change what the next sample of the prompt
    is scored with; a field that is not a Python name is said to reach **kwargs only; a built-in reward given
    fields is refused."""
    path = _write(
        tmp_path,
        "def pops(response, answer, tests):\n    return len(tests.pop())\n"
        "def named(response, answer, level):\n    return level\n",
    )
    score, tests = reward_function(f"{path}:pops", fields=("tests",)), [["a"], ["b", "c"]]
    assert [score("r", "a", tests=tests) for _ in range(3)] == [2.0, 2.0, 2.0]
    assert tests == [["a"], ["b", "c"]]
    with pytest.raises(RewardError, match=r"\('test-cases', 'class': not a Python name, so only a \*\*kwargs"):
        reward_function(f"{path}:named", fields=("level", "test-cases", "class"))
    with pytest.raises(
        RewardError, match=r"^task.reward 'math_verify' is built in and takes no extra fields \(tests\)$"
    ):
        reward_function("math_verify", fields=("tests",))


def test_a_call_over_the_time_limit_fails_naming_the_limit_and_the_response_and_the_next_call_runs(tmp_path):
    """`task.reward_timeout_s`: a call still running when the limit runs out is a RewardError at once (not when the
    call ends), with the limit and the response; a later call runs on a thread of its own (the stuck one is left);
    within the limit the function's value and its own errors come through as without one."""
    path = _write(
        tmp_path,
        "import time\n"
        "def slow(response, answer):\n    time.sleep(float(response))\n    return 1.0\n"
        "def picky(response, answer):\n    return {'a': 0.5}[response]\n",
    )
    score = reward_function(f"{path}:slow", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RewardError) as e:
        score("30", "x")
    assert time.monotonic() - started < 10.0  # the wait ends at the limit, not with the call 30 s later
    assert str(e.value) == (
        f"task.reward '{path}:slow' gave no value within task.reward_timeout_s=1 s (scoring the response '30' "
        "against the answer 'x'); the call runs on in this process, as Python cannot stop it: have the function "
        "limit what it runs (a resume imports the edited file again), or start a new run with a higher limit"
    )
    assert score("0.01", "x") == 1.0  # a fresh thread: not queued behind the stuck call
    picky = reward_function(f"{path}:picky", timeout_s=5)
    assert picky("a", "x") == 0.5
    with pytest.raises(RewardError, match=r"raised KeyError: 'b' \(scoring the response 'b'") as e:
        picky("b", "x")
    assert isinstance(e.value.__cause__, KeyError)  # the function's own exception, chained as without a limit


def test_a_call_abandoned_at_its_limit_ends_its_thread_once_it_returns_and_signals_are_the_main_threads():
    """The thread of a call that ran out of time exits once that call returns (it waited for more work, for the
    life of the process, before); a function under a limit runs off the main thread, where Python refuses to set a
    signal handler (as math-verify's own time limit does): said as that function's error."""
    import threading

    from models.rewards import _Limited, _Overran

    def ours() -> list:
        return [t for t in threading.enumerate() if t.name == "lockstep-reward"]

    before = len(ours())
    slow = _Limited(lambda: time.sleep(1.0), 0.1)
    with pytest.raises(_Overran):
        slow()
    assert len(ours()) == before + 1
    deadline = time.monotonic() + 10
    while len(ours()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ours()) == before
    assert _Limited(lambda x: x + 1, 5)(1) == 2  # and a fresh thread serves the next call

    import signal

    sets_handler = _Limited(lambda: signal.signal(signal.SIGALRM, signal.SIG_DFL), 5)
    with pytest.raises(ValueError, match="main thread"):
        sets_handler()


BATCHED = """
import numpy as np
calls = []
def judge(responses, answers, prompts, level):
    calls.append(len(responses))
    return [float(r == a) + lv + len(p) / 100 for r, a, p, lv in zip(responses, answers, prompts, level)]
def as_array(responses, answers):
    return np.array([r == a for r, a in zip(responses, answers)])
def pops(responses, answers, tests):
    return [len(t.pop()) for t in tests]
def one_short(responses, answers):
    return [1.0] * (len(responses) - 1)
def a_dict(responses, answers):
    return {r: 1.0 for r in responses}
def a_matrix(responses, answers):
    return np.ones((len(responses), 1))
def a_nan(responses, answers):
    return [0.0, float("nan"), 0.0][: len(responses)]
def raises(responses, answers):
    raise KeyError(responses[1])
def slow(responses, answers):
    import time
    time.sleep(30)
def per_sample(response, answer):
    return 1.0
def kw(response, answer, **kw):
    return len(kw["prompts"])
def strips(response, answer):
    return float(response.strip() == answer)
def as_tensor(responses, answers):
    import torch
    return torch.tensor([1.0, 0.5, float("nan")])
"""


def test_a_batched_function_scores_a_list_in_one_call_and_each_response_gets_its_fields(tmp_path):
    """`task.reward_batch`: one call for the list, prompts= and each field as lists in the responses' order, and its
    values in that order (a NumPy array too, bools as 0 / 1); one response scored alone is a list of one; each
    response gets its own copy of its row's fields, as one at a time does."""
    path = _write(tmp_path, BATCHED)
    score = reward_function(f"{path}:judge", fields=("level",), batch=True)
    extras = [{"level": 1}, {"level": 1}, {"level": 2}]
    assert score.many(["5", "6", "7"], ["5", "5", "7"], ["ab", "ab", "abcd"], extras) == [2.02, 1.02, 3.04]
    assert score("5", "5", "abc", level=0) == 1.03
    module = sys.modules[next(k for k, m in sys.modules.items() if getattr(m, "__file__", None) == str(path))]
    assert module.calls == [3, 1]  # one call per list
    assert score.many([], [], [], []) == []  # nothing to score: no call
    assert module.calls == [3, 1]
    assert reward_function(f"{path}:as_array", batch=True).many(["1", "2"], ["1", "1"], ["", ""], [{}, {}]) == [1, 0]
    tensor = reward_function(f"{path}:as_tensor", batch=True)  # a 1-d tensor's values (the nan is refused below)
    with pytest.raises(RewardError, match="returned nan at index 2 of 3"):
        tensor.many(["a", "b", "c"], ["a"] * 3, [""] * 3, [{}] * 3)
    row = {"tests": [["a"], ["b", "c"]]}  # a group's responses share their prompt's row
    assert reward_function(f"{path}:pops", fields=("tests",), batch=True).many(
        ["r"] * 3, ["a"] * 3, ["p"] * 3, [row] * 3
    ) == [2.0, 2.0, 2.0]
    assert row == {"tests": [["a"], ["b", "c"]]}
    # the per-sample form serves a list too, one call a response
    assert reward_function(f"{path}:per_sample").many(["x", "y"], ["a", "b"], ["", ""], [{}, {}]) == [1.0, 1.0]


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "one_short",
            "returned a list of 2 for 3 responses: a batched reward function (task.reward_batch) returns one "
            "reward per response, in their order",
        ),
        (
            "a_dict",
            "returned {'x': 1.0, 'y': 1.0, 'z': 1.0} (dict) for 3 responses: a batched reward function "
            "(task.reward_batch) returns one reward per response, as a list, a tuple or a 1-d array",
        ),
        (
            "a_matrix",
            "(numpy.ndarray) for 3 responses: a batched reward function (task.reward_batch) returns one "
            "reward per response, as a list, a tuple or a 1-d array",
        ),
        ("a_nan", "returned nan at index 1 of 3, for the response 'y': a reward must be finite"),
        ("raises", "raised KeyError: 'y' (scoring 3 responses, from 'x' against the answer 'a')"),
        ("as_tensor", "returned nan at index 2 of 3, for the response 'z': a reward must be finite"),
    ],
)
def test_what_a_batched_function_gets_wrong_is_named_with_the_list_it_scored(tmp_path, name, expected):
    path = _write(tmp_path, BATCHED)
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:{name}", batch=True).many(["x", "y", "z"], ["a", "b", "c"], [""] * 3, [{}] * 3)
    assert str(e.value).startswith(f"task.reward '{path}:{name}' ") and expected in str(e.value), str(e.value)


def test_a_batched_function_is_checked_at_load_and_limited_per_call(tmp_path):
    """Its signature is checked against the batched call (prompts=, each field by name) before any work; a field
    named like one of its arguments (`responses`, `answers`, `prompts`) is refused in a batch; a built-in reward is
    never batched; the time limit is one call's, the list's."""
    path = _write(tmp_path, BATCHED)
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:judge", fields=("tests",), batch=True)
    assert str(e.value) == (
        f"task.reward '{path}:judge': judge(responses, answers, prompts, level) cannot be called as "
        "judge(responses, answers, prompts=..., tests=...) (missing a required argument: 'level'); a batched "
        "reward function (task.reward_batch) takes the list of responses and the list of reference answers (and, "
        "optionally, prompts=), and one keyword argument per field of task.dataset.extra_fields, each a list"
    )
    for name in ("responses", "answers", "prompts"):
        with pytest.raises(RewardError) as e:
            reward_function(f"{path}:as_array", fields=("level", name), batch=True)
        assert str(e.value) == (
            f"task.dataset.extra_fields lists {name!r}, the name of an argument a batched task.reward already "
            "receives (responses, answers, prompts): rename the field in the data"
        )
    # one at a time, `prompts` is a field like any other (the prompt comes as prompt=)
    assert reward_function(f"{path}:kw", fields=("prompts",))("r", "a", "p", prompts=[1, 2]) == 2.0
    with pytest.raises(RewardError, match=r"^task.reward 'arithmetic' is built in and scores one response at a time"):
        reward_function("arithmetic", batch=True)
    score = reward_function(f"{path}:slow", timeout_s=0.5, batch=True)
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"gave no value within task.reward_timeout_s=0.5 s \(scoring 2 responses, "):
        score.many(["x", "y"], ["a", "b"], ["", ""], [{}, {}])
    assert time.monotonic() - started < 10.0


def test_a_function_of_the_other_form_is_told_about_task_reward_batch(tmp_path):
    """A batched function loaded one at a time gets strings and returns a list: the error says how lists are given;
    a one-at-a-time function loaded batched returns one number for the list: the error says one per response."""
    path = _write(tmp_path, BATCHED)
    with pytest.raises(RewardError) as e:
        reward_function(f"{path}:one_short")("ab", "a")
    assert str(e.value) == (
        f"task.reward '{path}:one_short' returned [1.0] (list) for the response 'ab' (a function that scores a list "
        "of responses is called with lists under task.reward_batch: true): a reward is a real number that fits a "
        "float (1.0 counts as correct in held-out accuracy)"
    )
    with pytest.raises(RewardError, match=r"returned 1.0 \(float\) for 2 responses: a batched reward function"):
        reward_function(f"{path}:per_sample", batch=True).many(["x", "y"], ["a", "b"], ["", ""], [{}, {}])
    with pytest.raises(RewardError) as e:  # written for one response, given lists
        reward_function(f"{path}:strips", batch=True).many(["x", "y"], ["a", "b"], ["", ""], [{}, {}])
    assert str(e.value) == (
        f"task.reward '{path}:strips' raised AttributeError: 'list' object has no attribute 'strip' (scoring 2 "
        "responses, from 'x' against the answer 'a') (under task.reward_batch the function is given lists)"
    )
    with pytest.raises(RewardError) as e:  # its own error, one at a time: no word of lists
        reward_function(f"{path}:strips")(None, "a")
    assert str(e.value).endswith("(scoring the response None against the answer 'a')")
