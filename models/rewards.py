"""Reward functions: the one dispatch from a task's `reward` setting to the function that scores a response.

`reward` is a built-in kind (`arithmetic`, `math_verify`) or the user's own function, named `FILE.py:FUNCTION` or
`MODULE:FUNCTION` (an importable module, e.g. an installed package's). A user's function is called as
`fn(response, answer)`, with `prompt=` added when it declares a `prompt` parameter (or `**kwargs`), and each of a
dataset's `extra_fields` as a keyword argument of its name (a copy per call); it returns a finite real number (a bool
counts as 0 / 1). With `batch` (`task.reward_batch`) it scores a list of responses in one call instead:
`fn(responses, answers)`, with `prompts=` and each extra field as lists of the same length, returning one such number
per response (a list, a tuple, a 1-d NumPy array or tensor), as a reward model or a remote judge would. It runs in
every rollout worker process (spawned: each imports it itself; one call per shard's responses when batched) and in
the trainer's process for held-out accuracy (one call for all the answers when batched), where a greedy answer
counts as correct when its reward is at least 1.0.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import keyword
import math
import numbers
import queue
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from models import arithmetic

BUILTIN_REWARDS = ("arithmetic", "math_verify")
RESERVED = ("response", "answer", "prompt")  # the arguments every reward function may receive: no extra field's name
BATCH_ARGUMENTS = ("responses", "answers", "prompts")  # and those of a batched one (task.reward_batch)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FORMS = "'arithmetic', 'math_verify', FILE.py:FUNCTION or MODULE:FUNCTION"


class RewardError(ValueError):
    """A user's reward function that cannot be loaded, raised, or returned something that is not a reward."""


class Scorer:
    """A task's reward, loaded: `scorer(response, answer, prompt="", **extra)` scores one response,
    `scorer.many(responses, answers, prompts, extras)` a list of them (`extras`: each response's extra fields, a dict
    per response). Made from a function that scores one response (`one`, called in turn) or a list (`many`, called
    once, for a batched user's function); each serves both calls."""

    def __init__(self, one: Callable[..., float] | None = None, many: Callable[..., list[float]] | None = None):
        assert (one is None) != (many is None), "give one form"
        self._one, self._many = one, many

    def __call__(self, response: str, answer: str, prompt: str = "", **extra) -> float:
        if self._one is not None:
            return self._one(response, answer, prompt, **extra)
        return self._many([response], [answer], [prompt], [extra])[0]

    def many(self, responses: list[str], answers: list[str], prompts: list[str], extras: list[dict]) -> list[float]:
        if self._many is not None:
            return self._many(responses, answers, prompts, extras) if responses else []
        return [self._one(r, a, p, **e) for r, a, p, e in zip(responses, answers, prompts, extras, strict=True)]


def function_spec(kind: str) -> tuple[str, str] | None:
    """(source, function name) of a user's reward `FILE.py:FUNCTION` or `MODULE:FUNCTION`; None for a built-in kind.
    ValueError (the form to use) for anything else."""
    if kind in BUILTIN_REWARDS:
        return None
    source, sep, name = kind.rpartition(":")
    if not sep or not source or not _NAME.fullmatch(name):
        raise ValueError(f"{kind!r} is neither a built-in reward nor a function: give {FORMS}")
    if "://" in source:
        raise ValueError(f"{kind!r}: a reward function is read from a local file or an importable module, not a URL")
    if not source.endswith(".py") and not all(_NAME.fullmatch(part) for part in source.split(".")):
        raise ValueError(
            f"{kind!r}: {source!r} is neither a .py file nor a module name (dotted identifiers): give {FORMS}"
        )
    return source, name


def absolute_spec(kind: str) -> str:
    """`kind` with a relative `FILE.py` made absolute (from the working directory), so that a run's frozen config
    names the same file wherever it is resumed from."""
    spec = function_spec(kind)
    if spec is None or not spec[0].endswith(".py"):
        return kind
    return f"{Path(spec[0]).expanduser().absolute()}:{spec[1]}"


def reward_function(
    kind: str,
    partial_credit: float = 0.0,
    fields: tuple[str, ...] = (),
    timeout_s: float | None = None,
    batch: bool = False,
) -> Scorer:
    """The scorer `kind` names: `arithmetic` (exact match plus `partial_credit` x per-digit credit), `math_verify`
    (symbolic equality of the final answer), or a user's function (loaded and checked here, to take the keyword
    arguments `fields` too, and with `batch` to score lists; RewardError says what is wrong; with `timeout_s`, a call
    that has not returned after that many seconds is one). A response's `extra` holds its prompt's values of `fields`
    (none for a built-in kind, which takes none and scores one response at a time)."""
    if kind in BUILTIN_REWARDS and fields:
        raise RewardError(f"task.reward {kind!r} is built in and takes no extra fields ({', '.join(fields)})")
    if kind in BUILTIN_REWARDS and batch:
        raise RewardError(f"task.reward {kind!r} is built in and scores one response at a time (task.reward_batch)")
    if kind == "arithmetic":
        return Scorer(lambda response, answer, prompt="": arithmetic.reward(response, answer, partial_credit))
    if kind == "math_verify":
        from models.verifier import math_reward

        return Scorer(lambda response, answer, prompt="": math_reward(response, answer))
    try:
        spec = function_spec(kind)
    except ValueError as e:
        raise RewardError(f"unknown reward kind: {e}") from None
    return _user_scorer(kind, *spec, fields, timeout_s, batch)


def source_digest(kind: str) -> str | None:
    """The sha256 of the file a user's reward function is read from (a FILE, or the module's own file), for the
    run's record of which code scored it; None for a built-in kind or a module without a file."""
    spec = function_spec(kind)
    if spec is None:
        return None
    path = getattr(_module(kind, spec[0]), "__file__", None)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


class _Overran(Exception):
    """A reward function's call still running when its time limit ran out."""


class _Limited:
    """`fn`, called on a daemon thread that the caller waits for up to `timeout_s` a call: a call still running then
    raises `_Overran`. Python cannot stop a thread: that call runs on, abandoned (a daemon thread does not keep the
    process from exiting; its thread ends once the call returns), and the next call starts a thread of its own. One
    thread serves the calls in turn, for one calling thread at a time (a rollout worker's, the trainer's scoring): a
    call queued behind a stuck one would run out of time too. The hand-over costs ~60-80 us a call on the 2-core
    machine this was written on (5,000 calls of a one-line function, 3 repeats; a new thread per call: ~116 us; the
    function called directly: 0.1 us), hence no limit unless one is set.

    Limits of a thread: code in C that holds Python's lock (a runaway regular expression, a huge integer power) is
    seen only once it returns, and a function that sets a signal handler (math-verify's own time limits do) fails,
    as only the main thread may."""

    def __init__(self, fn: Callable, timeout_s: float):
        self.fn, self.timeout_s = fn, timeout_s
        self.inbox: queue.SimpleQueue | None = None
        self.lock = threading.Lock()

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (item := inbox.get()) is not None:  # None: a caller stopped waiting for this thread
            args, kwargs, box, done = item
            try:
                box["value"] = self.fn(*args, **kwargs)
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e
            done.set()

    def __call__(self, *args, **kwargs):
        with self.lock:
            if self.inbox is None:
                self.inbox = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self.inbox,), name="lockstep-reward", daemon=True).start()
            inbox = self.inbox
        box: dict = {}
        done = threading.Event()
        inbox.put((args, kwargs, box, done))
        finished = False
        try:
            finished = done.wait(self.timeout_s)
        finally:  # out of time, or interrupted (Ctrl-C) while waiting: that thread is busy with the call
            if not finished:
                inbox.put(None)  # it ends once the call returns (or at once, if it just did)
                with self.lock:
                    if self.inbox is inbox:
                        self.inbox = None
        if not finished:
            raise _Overran
        if "error" in box:
            raise box.pop("error")
        return box["value"]


def _user_scorer(
    kind: str,
    source: str,
    name: str,
    fields: tuple[str, ...] = (),
    timeout_s: float | None = None,
    batch: bool = False,
) -> Scorer:
    module = _module(kind, source)
    fn = getattr(module, name, None)
    if fn is None:
        where = source if source.endswith(".py") else f"{source} ({getattr(module, '__file__', None)})"
        raise RewardError(f"task.reward {kind!r}: {where} defines no {name!r}")
    if not callable(fn):
        raise RewardError(f"task.reward {kind!r}: {name} is a {type(fn).__name__}, not a function")
    if inspect.isclass(fn):
        raise RewardError(
            f"task.reward {kind!r}: {name} is a class; name a function (or an instance's method) that returns the "
            "reward"
        )
    if inspect.iscoroutinefunction(fn):
        raise RewardError(
            f"task.reward {kind!r}: {name} is async; a reward function returns its value (run a coroutine inside it "
            "with asyncio.run)"
        )
    # a batched function takes lists: of responses, answers, prompts and of each field's values
    prompt_word = "prompts" if batch else "prompt"
    taken = [f for f in fields if batch and f in BATCH_ARGUMENTS]
    if taken:
        raise RewardError(
            f"task.dataset.extra_fields lists {taken[0]!r}, the name of an argument a batched task.reward already "
            f"receives ({', '.join(BATCH_ARGUMENTS)}): rename the field in the data"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable whose signature Python cannot read (some C functions)
        signature = None
    params = signature.parameters if signature is not None else {}
    takes_prompt = any(p.kind is p.VAR_KEYWORD for p in params.values()) or (
        prompt_word in params and params[prompt_word].kind is not inspect.Parameter.POSITIONAL_ONLY
    )
    if signature is not None:
        keywords = ([prompt_word] if takes_prompt else []) + list(fields)
        try:
            signature.bind("response", "answer", **dict.fromkeys(keywords))
        except TypeError as e:
            call = ", ".join(["responses", "answers"] if batch else ["response", "answer"])
            call = ", ".join([call, *(f"{k}=..." for k in keywords)])
            also = ", and one keyword argument per field of task.dataset.extra_fields" if fields else ""
            odd = [f for f in fields if not f.isidentifier() or keyword.iskeyword(f)]
            if odd:
                also += f" ({', '.join(map(repr, odd))}: not a Python name, so only a **kwargs parameter receives it)"
            takes = (
                "a batched reward function (task.reward_batch) takes the list of responses and the list of reference "
                f"answers (and, optionally, prompts=){also}, each a list"
                if batch
                else f"a reward function takes the response and the reference answer (and, optionally, prompt=){also}"
            )
            raise RewardError(
                f"task.reward {kind!r}: {name}{signature} cannot be called as {name}({call}) ({e}); {takes}"
            ) from None

    call = fn if timeout_s is None else _Limited(fn, timeout_s)

    # a function written for one response, given lists, mostly fails on a list's missing method or on a type
    lists_hint = " (under task.reward_batch the function is given lists)" if batch else ""

    def invoke(args: tuple, kwargs: dict, scoring: str):
        """The call; what it raised, or its running out of time, as RewardError naming what it was `scoring`."""
        try:
            return call(*args, **kwargs)
        except _Overran:
            raise RewardError(
                f"task.reward {kind!r} gave no value within task.reward_timeout_s={timeout_s:g} s ({scoring}); the "
                "call runs on in this process, as Python cannot stop it: have the function limit what it runs (a "
                "resume imports the edited file again), or start a new run with a higher limit"
            ) from None
        except Exception as e:
            hint = lists_hint if isinstance(e, (AttributeError, TypeError)) else ""
            raise RewardError(f"task.reward {kind!r} raised {error_line(e)} ({scoring}){hint}") from e

    def one(response: str, answer: str, prompt: str = "", **extra) -> float:
        # a copy per call: a function that changes its argument does not change the next sample's
        kwargs = copy.deepcopy(extra) if extra else {}
        if takes_prompt:
            kwargs["prompt"] = prompt
        scoring = f"scoring the response {_shown(response)} against the answer {_shown(answer)}"
        returned = invoke((response, answer), kwargs, scoring)
        where = f"for the response {_shown(response)}"
        if _as_list(returned) is not None:
            where += " (a function that scores a list of responses is called with lists under task.reward_batch: true)"
        return _reward_value(kind, returned, where)

    def many(responses: list[str], answers: list[str], prompts: list[str], extras: list[dict]) -> list[float]:
        n = len(responses)
        # each response's own copy of its fields, as one at a time gets (a group's responses share a prompt's row)
        kwargs = {f: [copy.deepcopy(e[f]) for e in extras] for f in fields}
        if takes_prompt:
            kwargs["prompts"] = list(prompts)
        scoring = f"scoring {n} responses, from {_shown(responses[0])} against the answer {_shown(answers[0])}"
        returned = invoke((list(responses), list(answers)), kwargs, scoring)
        values = _as_list(returned)
        if values is None:
            raise RewardError(
                f"task.reward {kind!r} returned {_shown(returned)} ({_type_name(returned)}) for {n} responses: a "
                "batched reward function (task.reward_batch) returns one reward per response, as a list, a tuple or "
                "a 1-d array"
            )
        if len(values) != n:
            raise RewardError(
                f"task.reward {kind!r} returned a list of {len(values)} for {n} responses: "
                "a batched reward function (task.reward_batch) returns one reward per response, in their order"
            )
        return [
            _reward_value(kind, v, f"at index {i} of {n}, for the response {_shown(r)}")
            for i, (v, r) in enumerate(zip(values, responses))
        ]

    return Scorer(many=many) if batch else Scorer(one)


def _as_list(returned: object) -> list | None:
    """A batched function's value as a list (a list, a tuple, a 1-d NumPy array or tensor); None for anything else."""
    if isinstance(returned, (list, tuple)):
        return list(returned)
    if getattr(returned, "ndim", None) == 1 and hasattr(returned, "tolist"):  # NumPy, torch
        return returned.tolist()
    return None


def _reward_value(kind: str, returned: object, where: str) -> float:
    """A user's function's value `returned` (for the response `where` says) as a float; RewardError for anything that
    is not a finite real number (a bool, a NumPy scalar or a 0-d tensor counts as its value)."""
    value = returned
    try:
        if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == () and hasattr(value, "item"):
            value = value.item()  # a NumPy scalar (np.bool_ too) or a 0-d tensor
        value = float(value) if isinstance(value, numbers.Real) else None
    except Exception:  # an .item() that raises, an int too large for a float (10**400)
        value = None
    if value is None:
        raise RewardError(
            f"task.reward {kind!r} returned {_shown(returned)} ({_type_name(returned)}) {where}: a reward is a real "
            "number that fits a float (1.0 counts as correct in held-out accuracy)"
        )
    if not math.isfinite(value):
        raise RewardError(f"task.reward {kind!r} returned {value} {where}: a reward must be finite")
    return value


def _type_name(value: object) -> str:
    name = type(value).__qualname__
    return name if type(value).__module__ == "builtins" else f"{type(value).__module__}.{name}"


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _shown(value: object) -> str:
    """`repr(value)`, cut to 200 characters (a response can run to thousands)."""
    return _cut(repr(value))


def error_line(e: BaseException) -> str:
    """An exception as one line for an error message: its type and its message's first line (cut to 200
    characters; " ..." when lines follow)."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {_cut(lines[0])}{' ...' if len(lines) > 1 else ''}"


def _module(kind: str, source: str):
    """The module `source` names: a .py file, loaded under a name of its own (a digest of its absolute path, mtime
    and size), or an importable module."""
    if source.endswith(".py"):
        path = Path(source).expanduser().absolute()
        if not path.is_file():
            raise RewardError(f"task.reward {kind!r}: no file {path}")
        stat = path.stat()  # an edited file is loaded again (a notebook's second run), not taken from the cache
        key = f"{path}\0{stat.st_mtime_ns}\0{stat.st_size}"
        module_name = f"lockstep_reward_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # as an import does: its dataclasses and pickles look it up there
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as e:
            sys.modules.pop(module_name, None)
            if not isinstance(e, Exception):  # a Ctrl-C, or the file calling exit()
                raise
            top = (getattr(e, "name", None) or "").split(".")[0]
            beside = top and ((path.parent / f"{top}.py").is_file() or (path.parent / top).is_dir())
            hint = (
                f" ({top} is beside the file, but a file's folder is not on the import path: add {path.parent} to "
                "PYTHONPATH)"
                if isinstance(e, ModuleNotFoundError) and beside
                else ""
            )
            raise RewardError(f"task.reward {kind!r}: importing {path} raised {error_line(e)}{hint}") from e
        return module
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as e:
        if e.name is not None and (source == e.name or source.startswith(f"{e.name}.")):
            raise RewardError(
                f"task.reward {kind!r}: no module {e.name!r} on this Python's path: install it, add its folder to "
                "PYTHONPATH, or name the file (FILE.py:FUNCTION)"
            ) from None
        raise RewardError(f"task.reward {kind!r}: importing {source} raised {error_line(e)}") from e
    except Exception as e:
        raise RewardError(f"task.reward {kind!r}: importing {source} raised {error_line(e)}") from e
