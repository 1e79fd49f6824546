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


def test_unarmed_point_does_nothing(monkeypatch, sent):
    monkeypatch.delenv("LOCKSTEP_FAULT", raising=False)
    for _ in range(3):
        faults.point("mid-train")
    assert sent == []


def test_unknown_signal_names_the_spec(monkeypatch, sent):
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-train@2:HUP")
    with pytest.raises(ValueError, match=r"LOCKSTEP_FAULT='mid-train@2:HUP': signal 'HUP' of 'mid-train' is not one of"):
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


@pytest.mark.parametrize(("spec", "message"), [
    ("mid-trian@2", r"'mid-trian' is not a failpoint: one of shard-write, file-write, after-plan, mid-train"),
    ("mid-train[x]@2", r"'mid-train\[x\]' is not a failpoint"),
    ("after-plan@0", r"pass '0' of 'after-plan' is not a positive integer"),
    ("after-plan@two:TERM", r"pass 'two' of 'after-plan' is not a positive integer"),
    ("after-plan@-1", r"pass '-1' of 'after-plan' is not a positive integer"),
])
def test_bad_spec_is_refused_not_silently_unarmed(spec, message, monkeypatch, sent):
    """A misspelt point would never fire: the resilience test would then see a run that was not killed."""
    monkeypatch.setenv("LOCKSTEP_FAULT", f"shard-write@9, {spec}")
    with pytest.raises(ValueError, match=rf"LOCKSTEP_FAULT='shard-write@9, {re.escape(spec)}': {message}"):
        faults.point("shard-write")  # any point passed reads the whole spec
    assert sent == []


def test_points_are_the_ones_the_code_passes():
    """POINTS, which a spec is checked against, names every failpoint the project's code passes and no other."""
    passed = set()
    for path in REPO.glob("*/*.py"):
        if path.parts[-2] in ("tests", ".venv"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "faults.point":
                arg = node.args[0]
                # a literal, or a choice between literals (lake.py: shard-write or file-write)
                passed |= {c.value for c in ast.walk(arg) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                           and not c.value.startswith(".")}
    assert passed == set(faults.POINTS)
