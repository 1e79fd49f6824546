"""The session's background work: a checkpoint write and the audit submissions are held until `release` (the flow
releases them once the next iteration's rollouts are dispatched), and `wait_saved` starts a held write itself."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tasks.session import RunSession


def _session() -> RunSession:
    # only the background-work fields are used here; the heavy objects are not needed
    return RunSession(*(None,) * 11, version=0, device=None)


def _shutdown(s: RunSession) -> None:
    if s._saver is not None:
        s._saver.shutdown(wait=True)


def test_held_work_starts_at_release_save_first():
    s = _session()
    started = threading.Event()
    audit_saw: list = []  # what the held callable found: the write already started (an audit waits for it)
    s.save_in_background(1, started.set)
    s.hold(lambda: audit_saw.append(s.saving))
    assert not started.wait(0.2) and audit_saw == [] and s.saving is None  # nothing runs before the release
    s.release()
    assert audit_saw and audit_saw[0] is not None and audit_saw[0][0] == 1
    s.wait_saved()
    assert started.is_set() and s.saving is None and s.held == []
    _shutdown(s)


def test_wait_saved_starts_a_held_write_and_raises_its_error():
    s = _session()

    def fail():
        raise OSError("disk full")

    s.save_in_background(2, fail)
    with pytest.raises(OSError, match="disk full"):
        s.wait_saved()
    assert s.saving is None
    _shutdown(s)


def test_wait_saved_for_an_older_version_does_not_wait_for_a_newer_write():
    s = _session()
    gate = threading.Event()
    s.save_in_background(3, gate.wait)
    s.release()
    s.wait_saved(version=2)  # v3 is still being written: returns at once
    assert s.saving is not None and s.saving[0] == 3
    gate.set()
    s.wait_saved(version=3)
    assert s.saving is None
    _shutdown(s)


def test_a_write_being_awaited_stays_visible_until_it_ends():
    """The audit task waits for the write it finds in `saving` (the ledger record it annotates must be final). The
    flow's own `wait_saved` (at the end of a run, or before an optimizer step) must not hide a write still in
    flight from it: an audit that saw nothing annotated the record while the write was promoting it, and its
    stale copy replaced 'promoted' with 'trained' (seen once in the resilience tests)."""
    s = _session()
    gate = threading.Event()
    s.save_in_background(4, gate.wait)
    waiter = threading.Thread(target=s.wait_saved, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while s.saving is None and time.monotonic() < deadline:  # the waiter started the write (not a fixed pause:
        time.sleep(0.01)  # a loaded machine can run the waiter thread late)
    time.sleep(0.1)  # ... and is waiting on it
    try:
        assert waiter.is_alive()  # the flow is waiting for the write
        found = s.saving  # what an audit finds meanwhile
        assert found is not None and found[0] == 4 and not found[1].done()
    finally:
        gate.set()
    waiter.join(5)
    assert not waiter.is_alive() and s.saving is None
    _shutdown(s)


class _Stopped(Exception):
    pass


def test_a_wait_cut_short_by_a_signal_keeps_the_write_visible():
    """Ctrl-C or SIGTERM can end `wait_saved` while the write goes on; the write must stay in `saving` (the audit
    task the flow waits for on its way out still has to wait for it)."""
    s = _session()
    gate = threading.Event()

    def stop(signum, frame):
        raise _Stopped

    previous = signal.signal(signal.SIGUSR1, stop)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        s.save_in_background(5, gate.wait)
        s.release()  # the write in flight before the signal is armed: it lands in the wait, not in the submission
        with pytest.raises(_Stopped):
            timer.start()
            s.wait_saved()
        found = s.saving
        assert found is not None and found[0] == 5 and not found[1].done()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
        gate.set()
    s.wait_saved()
    assert s.saving is None
    _shutdown(s)
