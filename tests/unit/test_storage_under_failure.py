"""storage/lake.py, storage/ledger.py and storage/checkpoints.py under failure and misuse: each test pins a claim that a
plausible bug would break while the rest of the suite stays green (found by mutation testing; the prune left
unfinished by a crash after its manifest was a real leak it turned up). Concurrent writers of
one file name, failpoints, writes cut short (a save, PROMOTED, a prune, an upload), damaged or foreign inputs refused,
local copies reused and shared between processes."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from transformers import AutoModelForCausalLM

from storage import checkpoints, faults, ledger
from storage import lake as lake_module
from storage.checkpoints import (
    CheckpointError,
    export_hf,
    load_into,
    load_trainer_state,
    local_copy,
    promote,
    promoted_version,
    prune_optimizer_state,
    retain_optimizer_state,
    save_checkpoint,
    verify_checkpoint,
)
from storage.lake import Lake, atomic_write_bytes
from tests.half_writes import fail_writes_half_way

RUN = "mutant-run"


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def trained_optimizer(model) -> torch.optim.AdamW:
    """One AdamW step, so the optimizer has moments to save, prune and restore."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(4, 20).repeat(2, 1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


class FailingTokenizer:
    """Saves the real tokenizer's files, then fails: the checkpoint folder then holds weights, config and tokenizer but
    no trainer state and no manifest."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def save_pretrained(self, path):
        self.tokenizer.save_pretrained(path)
        raise OSError(28, "No space left on device", str(path))


# ------------------------------------------------------------------------------------------------ lake


def test_writers_of_files_with_one_name_use_their_own_temporary_files(lake, monkeypatch):
    """Two writes in flight at once whose targets share a file name (the MANIFEST.json of two checkpoints) each
    publish their own bytes: their temporary files under _tmp/ are distinct."""
    fs = lake.fs
    real_mv = type(fs).mv
    first, second = (f"{lake.checkpoint_dir(RUN, v)}/MANIFEST.json" for v in (1, 2))
    interleaved = []

    def mv(self, src, dst, *args, **kwargs):
        if not interleaved:  # the first writer is about to publish: the second writes and publishes meanwhile
            interleaved.append(dst)
            atomic_write_bytes(lake, RUN, second, b"second")
        return real_mv(self, src, dst, *args, **kwargs)

    monkeypatch.setattr(type(fs), "mv", mv)
    atomic_write_bytes(lake, RUN, first, b"first")
    monkeypatch.undo()
    assert interleaved == [first]
    assert Path(first).read_bytes() == b"first" and Path(second).read_bytes() == b"second"


@pytest.fixture
def durability_log(monkeypatch):
    """(event, path) in order: each os.fsync (the path behind the descriptor) and each rename, of the lake or of
    os.replace."""
    events = []
    real_fsync, real_replace, real_mv = os.fsync, os.replace, LocalFileSystem.mv

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("rename", str(dst)))
        real_replace(src, dst, *args, **kwargs)

    def mv(self, src, dst, *args, **kwargs):
        events.append(("rename", str(dst)))
        return real_mv(self, src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(LocalFileSystem, "mv", mv)
    return events


def test_a_local_write_is_on_disk_before_and_after_its_rename(lake, durability_log):
    """A power cut must leave the old file or the new one: the bytes are synced before the rename publishes them,
    and the folder (the rename itself) before the write returns."""
    path = lake.ledger_file(RUN, 0)
    atomic_write_bytes(lake, RUN, path, b"{}")
    (sync_file, tmp), rename, sync_dir = durability_log
    assert sync_file == "fsync" and tmp.startswith(f"{lake.run_dir(RUN)}/_tmp/") and tmp.endswith("iter-000000.json")
    assert rename == ("rename", path)
    assert sync_dir == ("fsync", os.path.dirname(path))


def test_a_local_checkpoint_is_on_disk_before_its_rename(tiny_hf, lake, durability_log):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    published = durability_log.index(("rename", path))
    synced = {p for event, p in durability_log[:published] if event == "fsync"}
    tmp = {os.path.dirname(p) for p in synced if p.endswith("MANIFEST.json")}
    assert len(tmp) == 1  # the folder under _tmp/ that became the checkpoint
    (tmp,) = tmp
    files = {str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file()}
    assert {"MANIFEST.json", "model.safetensors", "trainer_state/rng.safetensors"} <= files
    assert {f"{tmp}/{f}" for f in files} <= synced
    assert {tmp, f"{tmp}/trainer_state"} <= synced  # the folders' entries too
    assert durability_log[published + 1] == ("fsync", os.path.dirname(path))


class Killed(BaseException):
    """What the failpoint's signal does to the process: nothing after it runs."""


def test_the_shard_failpoint_stops_a_shard_write_before_publication(lake, monkeypatch):
    """`LOCKSTEP_FAULT=shard-write` (the resilience tests' rollout-worker crash) fires between a shard's bytes landing
    under _tmp/ and their publication, and only for shards."""

    def kill(pid, sig):
        raise Killed(sig)

    monkeypatch.setattr(faults, "_passes", Counter())
    monkeypatch.setattr(faults.os, "kill", kill)
    monkeypatch.setenv("LOCKSTEP_FAULT", "shard-write")
    record = lake.ledger_file(RUN, 0)
    atomic_write_bytes(lake, RUN, record, b"{}")  # not a shard: its failpoint is file-write
    assert Path(record).read_bytes() == b"{}"
    shard = f"{lake.iteration_rollouts(RUN, 0, 0)}/shard-0-00000.arrow"
    with pytest.raises(Killed):
        atomic_write_bytes(lake, RUN, shard, b"shard bytes")
    assert not Path(shard).exists()
    assert [p.read_bytes() for p in Path(lake.run_dir(RUN), "_tmp").iterdir()] == [b"shard bytes"]


# ------------------------------------------------------------------------------------------------ ledger


LEGAL = {
    "planned": {"rolling_out", "failed"},
    "rolling_out": {"trained", "failed"},
    "trained": {"promoted", "failed"},
    "promoted": set(),
    "failed": {"planned", "rolling_out"},  # a resume restarts a failed iteration, replanned or not
}
REACH = {
    "planned": ("planned",),
    "rolling_out": ("planned", "rolling_out"),
    "trained": ("planned", "rolling_out", "trained"),
    "promoted": ("planned", "rolling_out", "trained", "promoted"),
    "failed": ("planned", "failed"),
}


@pytest.mark.parametrize("prev", sorted(REACH))
def test_the_ledger_allows_exactly_its_state_machine(lake, prev):
    """Every transition out of every state, legal or not: the whole table, so that a transition added (a promoted
    iteration marked failed and redone) or dropped (a failed one that cannot restart) is caught."""
    allowed = set()
    for k, nxt in enumerate(sorted(REACH)):
        ledger.write_record(lake, RUN, k, REACH[prev])
        try:
            assert ledger.write_record(lake, RUN, k, nxt)["state"] == nxt
            allowed.add(nxt)
        except ValueError as e:
            assert f"illegal transition {prev} -> {nxt}" in str(e)
            assert ledger.read_record(lake, RUN, k)["state"] == prev
    assert allowed == LEGAL[prev]


def test_annotate_adds_fields_and_keeps_the_state(lake):
    ledger.write_record(lake, RUN, 2, ("planned", "rolling_out", "trained", "promoted"), promoted_version=3)
    returned = ledger.annotate(lake, RUN, 2, cataloged=True)
    stored = ledger.read_record(lake, RUN, 2)
    assert stored == returned
    assert stored["cataloged"] is True and stored["state"] == "promoted" and stored["promoted_version"] == 3
    assert [h["state"] for h in stored["history"]] == ["planned", "rolling_out", "trained", "promoted"]


def test_a_json_object_without_a_state_is_not_a_ledger_record(lake):
    path = Path(lake.ledger_file(RUN, 0))
    path.parent.mkdir(parents=True)
    path.write_text('{"iteration": 0, "history": []}')
    for read in (lambda: ledger.read_record(lake, RUN, 0), lambda: ledger.read_all(lake, RUN)):
        with pytest.raises(ValueError, match=f"{path} is not a ledger record"):
            read()


def test_read_all_reads_only_the_json_records(lake):
    ledger.write_record(lake, RUN, 0, "planned")
    Path(lake.run_dir(RUN), "ledger", "notes.txt").write_text("an operator's notes, not a record")
    assert [r["iteration"] for r in ledger.read_all(lake, RUN)] == [0]


# ------------------------------------------------------------------------------------------------ save / promote


def test_a_save_that_fails_midway_leaves_no_directory_under_its_final_name(tiny_hf, lake):
    """The checkpoint is built under _tmp/ and moved into place whole: a failure after some of its files are written
    leaves neither a half-written v{version} (which a later listing or an operator would take for a checkpoint) nor
    its temporary folder."""
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(lake, RUN, 2, tiny_hf.model, FailingTokenizer(tiny_hf.tokenizer))
    assert not Path(lake.checkpoint_dir(RUN, 2)).exists()
    assert list(Path(lake.run_dir(RUN), "_tmp").iterdir()) == []


def test_promote_cut_mid_write_keeps_the_previous_version(tiny_hf, lake, monkeypatch):
    """PROMOTED is replaced atomically: a write that fails half way leaves the previous promotion readable."""
    for v in (1, 2):
        save_checkpoint(lake, RUN, v, tiny_hf.model, tiny_hf.tokenizer)
    promote(lake, RUN, 1)
    fail_writes_half_way(monkeypatch, lake.fs)
    with pytest.raises(OSError, match="mid-write"):
        promote(lake, RUN, 2)
    monkeypatch.undo()
    assert promoted_version(lake, RUN) == 1


@pytest.mark.parametrize("content", ['{"version": -1}', '{"version": true}'])
def test_promoted_version_must_be_a_version_number(lake, content):
    """`true` would read as version 1 and -1 as a checkpoint that cannot exist: both are damage, named as such."""
    path = Path(lake.promoted_file(RUN))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(CheckpointError, match=f"{path} is damaged"):
        promoted_version(lake, RUN)


def test_a_remote_save_cut_mid_upload_leaves_no_directory_under_its_final_name(tiny_hf, memory_lake, monkeypatch):
    """On a remote lake the folder is uploaded under _tmp/ and then moved: an upload cut short (a reset connection)
    leaves nothing under the checkpoint's name."""
    real_put_file = MemoryFileSystem.put_file
    uploaded = []

    def cut_at_weights(self, lpath, rpath, *args, **kwargs):
        if str(lpath).endswith("model.safetensors"):
            raise ConnectionResetError("cut mid-upload")
        uploaded.append(rpath)
        return real_put_file(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "put_file", cut_at_weights)
    with pytest.raises(ConnectionResetError):
        save_checkpoint(memory_lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    monkeypatch.undo()
    assert uploaded  # files had been uploaded before the cut
    assert not memory_lake.fs.exists(memory_lake.checkpoint_dir(RUN, 1))


@pytest.fixture
def object_store_lake(memory_lake, monkeypatch):
    """`memory_lake` taken for an object store (as s3:// is): no rename, each object written in place."""
    monkeypatch.setattr(lake_module, "OBJECT_STORES", lake_module.OBJECT_STORES | {"memory"})
    assert memory_lake.is_object_store
    return memory_lake


def test_an_object_store_checkpoint_has_its_manifest_uploaded_last(tiny_hf, object_store_lake, monkeypatch):
    """An object store has no rename: a checkpoint's objects are written under its final name, MANIFEST.json last,
    so a save cut part-way leaves a folder that every reader refuses (no manifest), which the next save replaces.
    Nothing goes through _tmp/."""
    lake, model = object_store_lake, tiny_hf.model
    real_put_file = MemoryFileSystem.put_file
    uploaded, cuts = [], ["cut before the manifest"]

    def put_file(self, lpath, rpath, *args, **kwargs):
        if rpath.endswith("/MANIFEST.json") and cuts:
            raise ConnectionResetError(cuts.pop())
        uploaded.append(rpath)
        return real_put_file(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "put_file", put_file)
    with pytest.raises(ConnectionResetError):
        save_checkpoint(lake, RUN, 1, model, tiny_hf.tokenizer)
    path = lake.checkpoint_dir(RUN, 1)
    with pytest.raises(CheckpointError, match="has no MANIFEST.json"):
        verify_checkpoint(lake, path)

    trained_optimizer(model)  # other weights
    uploaded.clear()
    assert save_checkpoint(lake, RUN, 1, model, tiny_hf.tokenizer) == path
    manifest = json.loads(lake.fs.cat_file(f"{path}/MANIFEST.json"))
    assert uploaded == [*(f"{path}/{rel}" for rel in sorted(manifest)), f"{path}/MANIFEST.json"]
    verify_checkpoint(lake, path)
    saved = checkpoints.load_weights(lake, path)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)
    assert not lake.fs.exists(f"{lake.run_dir(RUN)}/_tmp")


@pytest.mark.parametrize("kind", ["lake", "memory_lake", "object_store_lake"])
def test_the_checkpoint_failpoint_fires_with_every_file_written_none_published(request, tiny_hf, kind, monkeypatch):
    """`LOCKSTEP_FAULT=mid-checkpoint` (the resilience tests' crash inside a save) fires once the checkpoint's files
    are written and before they are published: under _tmp/ and nothing at the checkpoint's name, or on an object
    store at its name without MANIFEST.json, a folder that every reader refuses."""
    lake = request.getfixturevalue(kind)
    path, staging = lake.checkpoint_dir(RUN, 1), f"{lake.run_dir(RUN)}/_tmp"
    fs, seen = lake.fs, []

    def names(root: str) -> list[str]:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.find(root)) if fs.exists(root) else []

    def kill(pid, sig):  # what a SIGKILL here leaves
        seen.append((names(path), names(staging)))
        raise Killed(sig)

    monkeypatch.setattr(faults, "_passes", Counter())
    monkeypatch.setattr(faults.os, "kill", kill)
    monkeypatch.setenv("LOCKSTEP_FAULT", "mid-checkpoint")
    with pytest.raises(Killed):
        save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    [(at_name, staged)] = seen
    files = {"config.json", "model.safetensors", "rng.safetensors", "state.json"}
    if kind == "object_store_lake":
        assert files <= set(at_name) and "MANIFEST.json" not in at_name and staged == []
        with pytest.raises(CheckpointError, match="has no MANIFEST.json"):
            verify_checkpoint(lake, path)
    else:
        assert at_name == [] and files | {"MANIFEST.json"} <= set(staged)


@pytest.mark.parametrize("lake_kind", ["local", "memory"])
def test_a_shared_folder_already_built_is_kept(request, tiny_hf, lake_kind):
    """`keep_existing` (the bootstrap folder, shared by the runs of one key): a second build does not replace the
    folder another run may be loading; the first build stays, whole."""
    lake = request.getfixturevalue("lake" if lake_kind == "local" else "memory_lake")
    final = f"{lake.root}/bootstrap/key"
    model = tiny_hf.model
    first = {k: v.clone() for k, v in model.state_dict().items()}
    assert (
        checkpoints.save_model_dir(lake, final, lake.tmp_path(RUN, "a"), model, tiny_hf.tokenizer, keep_existing=True)
        == final
    )
    trained_optimizer(model)  # other weights
    assert (
        checkpoints.save_model_dir(lake, final, lake.tmp_path(RUN, "b"), model, tiny_hf.tokenizer, keep_existing=True)
        == final
    )
    verify_checkpoint(lake, final)
    kept = checkpoints.load_weights(lake, final)
    assert all(torch.equal(kept[k], first[k]) for k in kept)
    assert not lake.fs.exists(f"{lake.run_dir(RUN)}/_tmp") or lake.fs.ls(f"{lake.run_dir(RUN)}/_tmp") == []


def test_a_shared_folder_that_lands_during_a_build_is_kept(tiny_hf, lake, monkeypatch):
    """Two runs of one key building it at once: the one whose rename comes second keeps the other's folder."""
    other = f"{lake.root}/other"
    checkpoints.save_model_dir(lake, other, lake.tmp_path(RUN, "o"), tiny_hf.model, tiny_hf.tokenizer)
    final = f"{lake.root}/bootstrap/key"
    real_makedirs = os.makedirs

    def makedirs(path, *args, **kwargs):  # the last step before the rename: the other run's rename comes first
        real_makedirs(path, *args, **kwargs)
        if path == os.path.dirname(final) and not os.path.exists(final):
            shutil.copytree(other, final)

    monkeypatch.setattr(os, "makedirs", makedirs)
    trained_optimizer(tiny_hf.model)
    assert (
        checkpoints.save_model_dir(
            lake, final, lake.tmp_path(RUN, "b"), tiny_hf.model, tiny_hf.tokenizer, keep_existing=True
        )
        == final
    )
    assert Path(final, "MANIFEST.json").read_bytes() == Path(other, "MANIFEST.json").read_bytes()
    assert list(Path(lake.run_dir(RUN), "_tmp").iterdir()) == []


# ------------------------------------------------------------------------------------------------ prune


def test_a_prune_stopped_before_its_manifest_is_replaced_leaves_a_resumable_checkpoint(tiny_hf, lake, monkeypatch):
    """The optimizer files go only after the new manifest is in place: a prune stopped before that point leaves the
    checkpoint verifying and resumable, and a later prune completes it."""
    model = tiny_hf.model
    path = save_checkpoint(lake, RUN, 3, model, tiny_hf.tokenizer, optimizer=trained_optimizer(model))
    fs = lake.fs
    real_mv = type(fs).mv

    def mv(self, src, dst, *args, **kwargs):
        if dst.endswith("/MANIFEST.json"):
            raise OSError("injected failure publishing the manifest")
        return real_mv(self, src, dst, *args, **kwargs)

    monkeypatch.setattr(type(fs), "mv", mv)
    with pytest.raises(OSError, match="publishing the manifest"):
        prune_optimizer_state(lake, RUN, 3)
    monkeypatch.undo()
    verify_checkpoint(lake, path)
    restored = torch.optim.AdamW(model.parameters())
    load_trainer_state(lake, path, restored)
    assert {k for st in restored.state_dict()["state"].values() for k in st} == {"step", "exp_avg", "exp_avg_sq"}
    assert prune_optimizer_state(lake, RUN, 3) is True
    verify_checkpoint(lake, path)
    assert not Path(path, "trainer_state", "optimizer.safetensors").exists()


def test_a_prune_stopped_after_its_manifest_is_finished_by_the_next_promotion(tiny_hf, lake, monkeypatch):
    """A crash after the prune's new manifest is in place, before the optimizer files go, leaves them unlisted; the
    next promotion's retention (which prunes the version after) removes them, so they do not stay for good."""
    model = tiny_hf.model
    opt = trained_optimizer(model)
    paths = [save_checkpoint(lake, RUN, v, model, tiny_hf.tokenizer, optimizer=opt) for v in range(3)]
    leftovers = [Path(paths[0], "trainer_state", n) for n in ("optimizer.safetensors", "optimizer.json")]

    def crash(self, path, *args, **kwargs):
        raise Killed("killed before the files went")

    monkeypatch.setattr(type(lake.fs), "rm", crash)
    with pytest.raises(Killed):
        retain_optimizer_state(lake, RUN, 1, keep=1)  # after promoting v1: v0's state goes
    monkeypatch.undo()
    verify_checkpoint(lake, paths[0])
    assert all(p.exists() for p in leftovers)  # unlisted in the manifest, still on disk

    assert retain_optimizer_state(lake, RUN, 2, keep=1) == [0, 1]  # after promoting v2: v1's, and v0's leftovers
    assert not any(p.exists() for p in leftovers)
    assert not Path(paths[1], "trainer_state", "optimizer.safetensors").exists()
    assert Path(paths[2], "trainer_state", "optimizer.safetensors").exists()
    for p in paths:
        verify_checkpoint(lake, p)
    assert retain_optimizer_state(lake, RUN, 2, keep=1) == []  # nothing left to do


# ------------------------------------------------------------------------------------------------ local copies


def test_a_local_lake_is_loaded_in_place(tiny_hf, lake, tmp_path):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    cache = tmp_path / "cache"
    cache.mkdir()
    assert local_copy(lake, path, str(cache)) == path
    assert list(cache.iterdir()) == []  # no copy of the weights


def test_a_local_copy_is_reused_without_downloading_again(tiny_hf, memory_lake, tmp_path, monkeypatch):
    """A worker that loads a version it already copied reads its copy: no second download (of a multi-GB model)."""
    path = save_checkpoint(memory_lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    first = local_copy(memory_lake, path, str(tmp_path))

    real_open = MemoryFileSystem.open

    def offline(self, rpath, *args, **kwargs):  # only the manifest (the copy's key) may be read again
        if not rpath.endswith("MANIFEST.json"):
            raise ConnectionError(f"{rpath} downloaded again")
        return real_open(self, rpath, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "open", offline)
    assert local_copy(memory_lake, path, str(tmp_path)) == first


def test_a_local_copy_of_a_checkpoint_without_manifest_is_refused_by_name(tiny_hf, memory_lake, tmp_path):
    """A checkpoint whose save was cut before its MANIFEST.json (an object store's upload) is named as incomplete,
    with its URL, and nothing is copied."""
    path = save_checkpoint(memory_lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    memory_lake.fs.rm(f"{path}/MANIFEST.json")
    with pytest.raises(CheckpointError, match=f"checkpoint memory://{path.lstrip('/')} has no MANIFEST.json"):
        local_copy(memory_lake, path, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_copy_another_process_finished_first_is_taken(tiny_hf, memory_lake, tmp_path, monkeypatch):
    """Two processes copying one checkpoint at once: the one whose rename loses takes the other's complete copy
    instead of failing."""
    path = save_checkpoint(memory_lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    cache = tmp_path / "cache"
    cache.mkdir()
    real_rename = os.rename
    landed = []

    def rename_after_another_process(src, dst):
        shutil.copytree(src, dst)  # the other process's checked copy, renamed into place first
        landed.append(str(dst))
        real_rename(src, dst)  # fails: the name is taken

    monkeypatch.setattr(os, "rename", rename_after_another_process)
    copy_dir = local_copy(memory_lake, path, str(cache))
    monkeypatch.undo()
    assert landed == [copy_dir]
    assert os.listdir(cache) == [os.path.basename(copy_dir)]  # and no partial folder of its own left
    verify_checkpoint(Lake(str(cache)), copy_dir)


# ------------------------------------------------------------------------------------------------ export / load


def test_export_refuses_a_damaged_checkpoint_and_writes_nothing(tiny_hf, lake, tmp_path):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    weights = Path(path, "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="model.safetensors does not match its manifest"):
        export_hf(lake, path, str(out))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lake"]


@pytest.mark.parametrize("existing", [False, True])
def test_an_export_is_on_disk_before_it_is_moved_into_place(tiny_hf, lake, tmp_path, durability_log, existing):
    """A power cut after an export returns must not leave a model directory with files not yet on disk: each file
    and the staging folder are synced before they are moved into place, and the folder holding them after."""
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    del durability_log[:]  # the export's own
    export_hf(lake, path, str(out))
    files = sorted(os.listdir(out))
    renames = [i for i, (event, _) in enumerate(durability_log) if event == "rename"]
    synced = {p for event, p in durability_log[: renames[0]] if event == "fsync"}
    (stage,) = {os.path.dirname(p) for p in synced if p.endswith("/config.json")}
    assert {stage, *(f"{stage}/{f}" for f in files)} <= synced
    moved = sorted(durability_log[i][1] for i in renames)
    assert moved == ([str(out / f) for f in files] if existing else [str(out)])
    assert durability_log[renames[-1] + 1 :] == [("fsync", str(out if existing else tmp_path))]


def test_an_interrupted_export_leaves_no_partial_folder(tiny_hf, lake, tmp_path, monkeypatch):
    """Ctrl-C part-way through an export (KeyboardInterrupt, not an Exception) removes its hidden folder as a failure
    does: no `.out.*.partial` holding part of a model is left beside the target or inside it."""
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    written = []
    real = Path.write_bytes

    def interrupted_at_the_second_file(self, data):
        if written:
            raise KeyboardInterrupt
        written.append(self.name)
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", interrupted_at_the_second_file)
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (tmp_path / "out", empty):
        with pytest.raises(KeyboardInterrupt):
            export_hf(lake, path, str(target))
        assert written
        written.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "lake"]
    assert list(empty.iterdir()) == []


def test_export_refuses_a_directory_that_is_not_empty(tiny_hf, lake, tmp_path):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's file")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_hf(lake, path, str(out))
    assert os.listdir(out) == ["notes.txt"]


def test_load_into_refuses_a_state_dict_that_does_not_fit(tiny_hf):
    model = tiny_hf.model
    state = dict(model.state_dict())
    without_norm = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\], unexpected \[\]"):
        load_into(model, without_norm)
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['extra.weight'\]"):
        load_into(model, {**state, "extra.weight": torch.zeros(1)})


def test_only_a_tied_model_may_lack_its_output_layer(tiny_hf):
    """A tied model's lm_head is its embedding (saved once); an untied model without lm_head.weight would keep a
    random output layer."""
    tied = tiny_hf.model
    load_into(tied, {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"})
    config = copy.deepcopy(tied.config)
    config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\]"):
        load_into(untied, {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"})


@pytest.mark.parametrize("content", ["42", '"a state"', '["state"]', "null"])
def test_json_that_is_not_an_object_is_not_a_ledger_record(lake, content):
    """A record damaged into another JSON value (a number, a string holding 'state', a list) is refused by name,
    not read as a record or failing with a TypeError."""
    path = Path(lake.ledger_file(RUN, 0))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path} is not a ledger record"):
        ledger.read_record(lake, RUN, 0)
