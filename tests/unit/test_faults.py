"""Failpoints (storage/faults.py): which pass fires, with which signal, and a clear error for a bad spec."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from storage import faults


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
