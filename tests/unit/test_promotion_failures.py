"""An error around promotion marks the iteration failed only if its version was not promoted: once PROMOTED names
the version, the record stays 'trained' (resume settles it as promoted). Marked failed, it could never become
promoted (the ledger forbids failed -> promoted), the catalog would never index it, and the run would go on from a
version whose iteration the ledger calls failed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from storage import checkpoints, ledger
from storage.lake import Lake
from tasks import iteration
from tests.half_writes import fail_writes_half_way

RUN = "promo"


def _session(tmp_path, tiny_hf, keep: int = 2) -> SimpleNamespace:
    """What _save_and_promote and mark_failed read of a run's session, with a real lake and model."""
    model = tiny_hf.model
    return SimpleNamespace(
        lake=Lake(str(tmp_path / "lake")),
        run_id=RUN,
        tokenizer=tiny_hf.tokenizer,
        trainer=SimpleNamespace(model=model, optimizer=None),
        cfg=SimpleNamespace(lake=SimpleNamespace(keep_optimizer_state=keep), pipeline=SimpleNamespace(mode="periodic")),
    )


def _trained(s, k: int) -> None:
    ledger.write_record(s.lake, RUN, k, ("planned", "rolling_out", "trained"))


def _save(s, k: int) -> None:
    iteration._save_and_promote(s, k, k + 1, checkpoints.snapshot(s.trainer.model, None))


def test_an_error_after_promoted_is_written_leaves_the_record_for_resume(tmp_path, tiny_hf, monkeypatch):
    s = _session(tmp_path, tiny_hf)
    _trained(s, 2)

    def disk_error(*args, **kwargs):
        raise OSError("disk error while pruning")

    monkeypatch.setattr(checkpoints, "retain_optimizer_state", disk_error)
    with pytest.raises(OSError, match="pruning") as error:
        _save(s, 2)
    assert checkpoints.promoted_version(s.lake, RUN) == 3
    from flows.train import _fail_iteration  # the flow's handler of the iteration's error

    s.version = 2  # promote_task raised before it moved the session to v3
    _fail_iteration(s, 2, error.value)
    assert ledger.read_record(s.lake, RUN, 2)["state"] == "trained"  # resume's _settle_ledger promotes it


def test_an_error_before_promoted_is_written_marks_the_iteration_failed(tmp_path, tiny_hf, monkeypatch):
    s = _session(tmp_path, tiny_hf)
    _trained(s, 0)
    _save(s, 0)
    _trained(s, 1)
    real_promote = checkpoints.promote

    def promote_on_a_failing_disk(lake, run_id, version):  # only PROMOTED's write fails, not the ledger's after it
        with monkeypatch.context() as m:
            fail_writes_half_way(m, lake.fs)
            real_promote(lake, run_id, version)

    monkeypatch.setattr(checkpoints, "promote", promote_on_a_failing_disk)
    with pytest.raises(OSError, match="mid-write"):
        _save(s, 1)
    monkeypatch.undo()
    assert checkpoints.promoted_version(s.lake, RUN) == 1
    rec = ledger.read_record(s.lake, RUN, 1)
    assert rec["state"] == "failed" and rec["reason"].startswith("checkpoint v2: OSError: injected failure")
    assert ledger.read_record(s.lake, RUN, 0)["state"] == "promoted"


def test_mark_failed_by_ledger_state_and_promoted_version(tmp_path, tiny_hf):
    s = _session(tmp_path, tiny_hf)
    mark_failed = iteration.mark_failed
    mark_failed(s, 0, "no record: nothing to mark")
    assert ledger.read_record(s.lake, RUN, 0) is None

    _trained(s, 0)
    _save(s, 0)  # promoted: PROMOTED = 1, record 'promoted'
    mark_failed(s, 0, "too late")
    assert ledger.read_record(s.lake, RUN, 0)["state"] == "promoted"

    _trained(s, 1)
    checkpoints.save_checkpoint(s.lake, RUN, 2, s.trainer.model, s.tokenizer)
    checkpoints.promote(s.lake, RUN, 2)  # PROMOTED written, the ledger not yet updated
    mark_failed(s, 1, "after PROMOTED")
    assert ledger.read_record(s.lake, RUN, 1)["state"] == "trained"

    ledger.write_record(s.lake, RUN, 2, "planned")
    mark_failed(s, 2, "rollout worker died")
    rec = ledger.read_record(s.lake, RUN, 2)
    assert rec["state"] == "failed" and rec["reason"] == "rollout worker died"
    mark_failed(s, 2, "again")  # failed already: the first reason stays
    assert ledger.read_record(s.lake, RUN, 2)["reason"] == "rollout worker died"

    _trained(s, 3)
    with open(s.lake.promoted_file(RUN), "w") as f:
        f.write("not json")  # damaged: it cannot show v4 promoted, so the iteration is marked failed
    mark_failed(s, 3, "x" * 3000)
    rec = ledger.read_record(s.lake, RUN, 3)
    assert rec["state"] == "failed" and rec["reason"] == "x" * 2000
