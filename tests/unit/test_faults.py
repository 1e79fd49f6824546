"""Failpoints (storage/faults.py): which pass fires, with which signal, and a clear error for a bad spec."""

from __future__ import annotations

import ast
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

from storage import faults

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sent(monkeypatch):
    calls = []
    monkeypatch.setattr(faults, "_passes", Counter())
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: calls.append((pid, sig)))
    monkeypatch.setattr(faults, "_signal_group", lambda sig: calls.append(("group", sig)))
    return calls


def test_point_fires_on_its_pass_with_its_signal(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train@2:TERM, after-plan")
    faults.point("mid-train")
    faults.point("shard-write")  # not armed
    assert sent == []
    faults.point("mid-train")
    assert [sig for _, sig in sent] == [signal.SIGTERM]
    faults.point("mid-train")  # only the second pass
    faults.point("after-plan")  # no count: the first pass, SIGKILL
    assert [sig for _, sig in sent] == [signal.SIGTERM, signal.SIGKILL]
    assert all(pid == faults.os.getpid() for pid, _ in sent)


def test_an_interrupt_goes_to_the_whole_process_group_as_a_terminals_ctrl_c(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train[1]@2:INT")
    faults.point("mid-train", iteration=1)
    assert sent == []
    faults.point("mid-train", iteration=1)
    assert sent == [("group", signal.SIGINT)]


def test_a_group_sigterm_goes_to_the_whole_process_group(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "after-plan@1:GROUPTERM")
    faults.point("after-plan")
    assert sent == [("group", signal.SIGTERM)]


def test_the_group_is_signalled_by_another_process():
    """Signal 0 checks that the group can be signalled: the command runs, in a process of its own."""
    faults._signal_group(0)


def test_unarmed_point_does_nothing(monkeypatch, sent):
    monkeypatch.delenv("LOCKSTEP_FAULT", raising=False)
    for _ in range(3):
        faults.point("mid-train")
    assert sent == []


def test_unknown_signal_names_the_spec(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train@2:HUP")
    message = r"LOCKSTEP_FAULT='mid-train@2:HUP': signal 'HUP' of 'mid-train' is not one of \['GROUPTERM', 'INT', 'KILL', 'TERM'\]"
    with pytest.raises(ValueError, match=message):
        faults.point("mid-train")
    assert sent == []


def test_iteration_point_counts_that_iteration_only(monkeypatch, sent):
    """`mid-train[1]@2` fires on the second pass in iteration 1, whatever the passes of iteration 0; the plain
    name still counts every pass."""
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train[1]@2")
    for _ in range(5):
        faults.point("mid-train", iteration=0)
    faults.point("mid-train")  # no iteration given: not counted for [1]
    faults.point("mid-train", iteration=1)
    assert sent == []
    faults.point("mid-train", iteration=1)
    assert [sig for _, sig in sent] == [signal.SIGKILL]
    faults.point("mid-train", iteration=1)
    faults.point("mid-train", iteration=2)
    assert len(sent) == 1


def test_plain_and_iteration_points_both_armed(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train@3:TERM,mid-train[0]@1")
    faults.point("mid-train", iteration=0)  # [0]@1 fires; the plain count is 1
    faults.point("mid-train", iteration=1)
    faults.point("mid-train", iteration=1)  # plain count 3
    assert [sig for _, sig in sent] == [signal.SIGKILL, signal.SIGTERM]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mid-trian@2", r"'mid-trian' is not a failpoint: one of shard-write, file-write, after-plan, mid-train"),
        ("mid-train[x]@2", r"'mid-train\[x\]' is not a failpoint"),
        ("mid-train[\u0661]@2", r"'mid-train\[\u0661\]' is not a failpoint"),  # an Arabic-Indic 1: never looked up
        ("shard-write[1]@1", r"'shard-write' is not passed with its iteration: \[iteration\] only on mid-train"),
        ("after-plan@0", r"pass '0' of 'after-plan' is not a positive integer"),
        ("after-plan@two:TERM", r"pass 'two' of 'after-plan' is not a positive integer"),
        ("after-plan@-1", r"pass '-1' of 'after-plan' is not a positive integer"),
        ("after-plan@\u00b2", r"pass '\u00b2' of 'after-plan' is not a positive integer"),  # superscript 2
        ("after-plan@\u0661", r"pass '\u0661' of 'after-plan' is not a positive integer"),  # Arabic-Indic 1
        ("after-plan@", r"pass '' of 'after-plan' is not a positive integer"),
        ("mid-train[1]@:TERM", r"pass '' of 'mid-train\[1\]' is not a positive integer"),
        ("after-plan@1:", r"signal '' of 'after-plan' is not one of \['GROUPTERM', 'INT', 'KILL', 'TERM'\]"),
        ("mid-train[1]@1,mid-train[01]@2", r"'mid-train\[1\]' is armed twice"),
    ],
)
def test_bad_spec_is_refused_not_silently_unarmed(spec, message, monkeypatch, sent):
    """A misspelt point would never fire: the resilience test would then see a run that was not killed."""
    monkeypatch.setenv("LOCKSTEP_FAULT", f"shard-write@9, {spec}")
    with pytest.raises(ValueError, match=rf"LOCKSTEP_FAULT='shard-write@9, {re.escape(spec)}': {message}"):
        faults.point("shard-write")  # any point passed reads the whole spec
    assert sent == []


def test_leading_zero_iteration_fires_as_its_number(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train[01]@1:TERM")
    faults.point("mid-train", iteration=0)
    faults.point("mid-train", iteration=1)
    assert [sig for _, sig in sent] == [signal.SIGTERM]


def test_points_are_the_ones_the_code_passes():
    """POINTS, which a spec is checked against, names every failpoint the project's code passes and no other, and
    ITERATION_POINTS those it passes with an iteration."""
    passed, with_iteration = set(), set()
    for path in REPO.rglob("*.py"):
        if {"tests", ".venv"} & set(path.relative_to(REPO).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "faults.point":
                # a literal, or a choice between literals (lake.py: "shard-write" if the path ends with ".arrow"
                # else "file-write": the suffix is not a point)
                names = {
                    c.value
                    for c in ast.walk(node.args[0])
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and not c.value.startswith(".")
                }
                passed |= names
                if any(k.arg == "iteration" for k in node.keywords) or len(node.args) > 1:
                    with_iteration |= names
    assert passed == set(faults.POINTS)
    assert with_iteration == set(faults.ITERATION_POINTS)
