"""Checkpoints: Hugging Face directories in the lake, trainer state beside them, atomic promotion.

`checkpoints/v{v:06d}/` is loadable by `AutoModelForCausalLM.from_pretrained` (and vLLM) as it is.
`trainer_state/` holds the optimizer's tensors as safetensors plus JSON: no pickle anywhere.
`PROMOTED` is written last, atomically, and only after the checkpoint's files are complete and checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from storage import faults, scratch
from storage.lake import Lake, atomic_write_bytes, atomic_write_json, fsync_path, read_json

WEIGHTS = "model.safetensors"
PRUNED_MARK = "trainer_state/OPTIMIZER_PRUNED"  # listed in the manifest once the optimizer state is pruned


class CheckpointError(RuntimeError):
    pass


def _optimizer_tensors(optimizer: torch.optim.Optimizer, copy: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                t = v.detach().contiguous().cpu()
                tensors[f"{pid}.{k}"] = t.clone() if copy and t.data_ptr() == v.data_ptr() else t
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


@dataclass(frozen=True)
class TrainerSnapshot:
    """What a checkpoint holds, taken at one instant: weights, optimizer state, torch RNG state. With copies,
    it can be written while training goes on (the checkpoint of version v written beside iteration v)."""

    weights: dict[str, torch.Tensor]  # a state dict; tied entries share one tensor, as in the model
    optimizer: tuple[dict[str, torch.Tensor], dict] | None
    rng: torch.Tensor


def snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, copy: bool = False
) -> TrainerSnapshot:
    """The model's and optimizer's state now; with `copy`, detached from later updates (~3 copies of the
    weights' bytes: weights plus AdamW's two moments)."""
    weights: dict[str, torch.Tensor] = {}
    copies: dict[tuple, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if copy:  # one copy per storage, so tied weights stay tied and are saved once
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key not in copies:
                copies[key] = t.to("cpu", copy=True)
            t = copies[key]
        weights[name] = t
    opt = _optimizer_tensors(optimizer, copy=copy) if optimizer is not None else None
    return TrainerSnapshot(weights, opt, torch.get_rng_state())


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _write_model_dir(local: str, model, tokenizer, snap: TrainerSnapshot, extra_state: dict | None) -> None:
    """Weights, tokenizer, trainer state and a MANIFEST of sha256 digests into the local folder `local`. The
    tensors come from `snap`; the model gives only its config (and the HF saving logic)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(local, safe_serialization=True, state_dict=snap.weights)
    tokenizer.save_pretrained(local)
    state_dir = Path(local, "trainer_state")
    state_dir.mkdir(exist_ok=True)
    if snap.optimizer is not None:
        tensors, meta = snap.optimizer
        Path(state_dir, "optimizer.safetensors").write_bytes(st_save(tensors))
        Path(state_dir, "optimizer.json").write_text(json.dumps(meta))
    Path(state_dir, "rng.safetensors").write_bytes(st_save({"torch": snap.rng}))
    Path(state_dir, "state.json").write_text(json.dumps(extra_state or {}))
    manifest = {
        str(p.relative_to(local)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(local).rglob("*"))
        if p.is_file()
    }
    Path(local, "MANIFEST.json").write_bytes(_manifest_bytes(manifest))


def _fsync_tree(root: str) -> None:
    """Every file and folder under the local folder `root` on disk (before the rename that publishes it)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def _manifest_bytes(manifest: dict[str, str]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def save_model_dir(
    lake: Lake,
    final: str,
    tmp: str,
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: dict | None = None,
    snap: TrainerSnapshot | None = None,
    keep_existing: bool = False,
) -> str:
    """Write a complete HF directory (weights, tokenizer, trainer state, MANIFEST) to `final` through `tmp`;
    the tensors of `snap` if given (`model` and `optimizer` as they are now otherwise).

    Files go to the temporary path first and are moved into place as a whole: a crash leaves at most a stray
    temporary folder, never a half-written directory under its final name. On object stores (no rename) they are
    written at `final` with MANIFEST.json last, so a crash leaves a folder without one, which every reader refuses
    and the next write replaces (`tmp` is not used). A complete directory already at `final` is replaced (an
    earlier attempt that was not promoted), or with `keep_existing` kept and this write dropped (a folder shared by
    runs, named by its content's key, which another run may be loading; on object stores such a folder must have a
    single writer: `bootstrap_v0` gives each its own).
    """
    snap = snap or snapshot(model, optimizer)
    fs = lake.fs
    kept = lambda: keep_existing and fs.exists(f"{final}/MANIFEST.json")  # noqa: E731
    if lake.is_local:  # build the folder in the lake's own _tmp/ (same filesystem), then one rename
        os.makedirs(tmp, exist_ok=True)
        try:
            _write_model_dir(tmp, model, tokenizer, snap, extra_state)
            _fsync_tree(tmp)  # a power cut after the rename must not leave v{n} with files not yet on disk
            faults.point("mid-checkpoint")
            if fs.exists(final):
                if kept():
                    return final
                shutil.rmtree(final)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            try:
                os.replace(tmp, final)
            except OSError:  # a directory landed there meanwhile (os.replace never replaces a non-empty one)
                if not kept():
                    raise
                return final
            fsync_path(os.path.dirname(final))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    with tempfile.TemporaryDirectory(prefix=scratch.prefix("ckpt")) as local:
        _write_model_dir(local, model, tokenizer, snap, extra_state)
        if fs.exists(final):
            if kept():
                return final
            fs.rm(final, recursive=True)
        if lake.is_object_store:  # objects in place (a move is a copy there), MANIFEST.json last: until it is
            # there, verify_checkpoint and every reader take the folder as incomplete
            for rel in sorted(json.loads(Path(local, "MANIFEST.json").read_bytes())):
                fs.put_file(f"{local}/{rel}", f"{final}/{rel}")
            faults.point("mid-checkpoint")
            fs.put_file(f"{local}/MANIFEST.json", f"{final}/MANIFEST.json")
        else:
            fs.put(local, tmp, recursive=True)
            faults.point("mid-checkpoint")
            fs.mv(tmp, final, recursive=True)
    return final


def save_checkpoint(
    lake: Lake,
    run_id: str,
    version: int,
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: dict | None = None,
    snap: TrainerSnapshot | None = None,
) -> str:
    """Write checkpoint v{version} of a run completely and return its path (not yet promoted)."""
    return save_model_dir(
        lake,
        lake.checkpoint_dir(run_id, version),
        lake.tmp_path(run_id, f"v{version:06d}"),
        model,
        tokenizer,
        optimizer,
        {"version": version, **(extra_state or {})},
        snap,
    )


def verify_checkpoint(lake: Lake, path: str) -> None:
    """Check every file of a checkpoint against its manifest; raises CheckpointError naming what is wrong."""
    _verify_files(lake.fs, path)


def _read_manifest(fs, path: str) -> dict[str, str]:
    manifest_path = f"{path}/MANIFEST.json"
    if not fs.exists(manifest_path):
        raise CheckpointError(f"checkpoint {path} has no MANIFEST.json (incomplete write)")
    with fs.open(manifest_path, "rb") as f:
        return json.loads(f.read())


def _read_checked(fs, path: str, rel: str, digest: str) -> bytes:
    """A checkpoint file's bytes, checked against its manifest digest."""
    try:
        with fs.open(f"{path}/{rel}", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is missing {rel}, listed in its manifest") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"checkpoint file {path}/{rel} does not match its manifest")
    return data


def _verify_files(fs, path: str) -> None:
    for rel, digest in _read_manifest(fs, path).items():
        _read_checked(fs, path, rel, digest)


def promote(lake: Lake, run_id: str, version: int) -> None:
    """Verify checkpoint v{version} and atomically point PROMOTED at it."""
    verify_checkpoint(lake, lake.checkpoint_dir(run_id, version))
    atomic_write_json(lake, run_id, lake.promoted_file(run_id), {"version": version})


def promoted_version(lake: Lake, run_id: str) -> int | None:
    """The run's promoted version; None before the first promotion, CheckpointError if PROMOTED is damaged."""
    path = lake.promoted_file(run_id)
    if not lake.fs.exists(path):
        return None
    try:
        version = read_json(lake, path)["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version {version!r} is not a version number")
    except (ValueError, KeyError, TypeError) as e:  # not JSON, no "version", not a mapping
        raise CheckpointError(
            f"{path} is damaged ({type(e).__name__}: {e}); it is written atomically, so this is "
            'outside damage: restore it from a backup or rewrite it as {"version": N} with the '
            "newest checkpoint that verifies"
        ) from None
    return version


def stored_versions(lake: Lake, run_id: str) -> list[int]:
    """The versions of a run that have a checkpoint folder (promoted or not), ascending."""
    return sorted(
        int(p.rstrip("/").rsplit("/v", 1)[-1]) for p in lake.fs.glob(f"{lake.run_dir(run_id)}/checkpoints/v[0-9]*")
    )


def load_weights(lake: Lake, path: str, *, checked: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict, read through fsspec (any filesystem), without pickle; its bytes are checked
    against the manifest, so a file damaged since its promotion is named (CheckpointError), not loaded. `checked=False`
    reads the file as it is: for a caller whose comparison of the weights is itself the check (replay), or that loads
    a version verified at its promotion an instant before (a rollout worker)."""
    if not checked:
        with lake.fs.open(f"{path}/{WEIGHTS}", "rb") as f:
            return st_load(f.read())
    manifest = _read_manifest(lake.fs, path)
    if WEIGHTS not in manifest:
        raise CheckpointError(f"checkpoint {path} does not list {WEIGHTS} in its MANIFEST.json")
    return st_load(_read_checked(lake.fs, path, WEIGHTS, manifest[WEIGHTS]))


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a saved state dict into a live model; tied weights may be saved once, so allow their absence."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"state dict mismatch: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")


def load_trainer_state(lake: Lake, path: str, optimizer: torch.optim.Optimizer | None) -> dict:
    """Restore optimizer and torch RNG state saved with a checkpoint; returns state.json's contents."""
    fs = lake.fs
    sdir = f"{path}/trainer_state"
    state = read_json(lake, f"{sdir}/state.json")
    if optimizer is not None and PRUNED_MARK in read_json(lake, f"{path}/MANIFEST.json"):
        raise CheckpointError(
            f"checkpoint {path} no longer has its optimizer state (lake.keep_optimizer_state "
            f"pruned it); resume from the promoted version, whose state is kept"
        )
    if optimizer is not None and fs.exists(f"{sdir}/optimizer.safetensors"):
        with fs.open(f"{sdir}/optimizer.safetensors", "rb") as f:
            tensors = st_load(f.read())
        _restore_optimizer(optimizer, tensors, read_json(lake, f"{sdir}/optimizer.json"))
    with fs.open(f"{sdir}/rng.safetensors", "rb") as f:
        torch.set_rng_state(st_load(f.read())["torch"])
    return state


def prune_optimizer_state(lake: Lake, run_id: str, version: int) -> bool:
    """Drop the optimizer state of checkpoint v{version}, keeping it a valid checkpoint; False if there was none.

    A marker file is written, then the manifest is replaced atomically (the optimizer files out, the marker in:
    the one point where the checkpoint changes), then the files go. A crash anywhere leaves at most unlisted
    files, never a checkpoint that fails its manifest; a crash after the manifest was replaced leaves the files
    unlisted, and the next call for this version removes them (True). Such a version can still be exported,
    replayed against and audited, but not resumed from."""
    fs, path = lake.fs, lake.checkpoint_dir(run_id, version)
    names = ("trainer_state/optimizer.safetensors", "trainer_state/optimizer.json")
    manifest = read_json(lake, f"{path}/MANIFEST.json")
    if names[0] not in manifest:
        if PRUNED_MARK not in manifest:
            return False  # saved without optimizer state
        left = [n for n in names if fs.exists(f"{path}/{n}")]  # unlisted by a prune stopped after its manifest
        for name in left:
            fs.rm(f"{path}/{name}")
        return bool(left)
    marker = b"optimizer state pruned by lake.keep_optimizer_state\n"
    atomic_write_bytes(lake, run_id, f"{path}/{PRUNED_MARK}", marker)
    for name in names:
        manifest.pop(name, None)
    manifest[PRUNED_MARK] = hashlib.sha256(marker).hexdigest()
    atomic_write_bytes(lake, run_id, f"{path}/MANIFEST.json", _manifest_bytes(manifest))
    for name in names:
        if fs.exists(f"{path}/{name}"):
            fs.rm(f"{path}/{name}")
    return True


def retain_optimizer_state(lake: Lake, run_id: str, version: int, keep: int) -> list[int]:
    """After promoting v{version}: the newest `keep` versions (the promoted one among them) keep their optimizer
    state; v{version - keep} loses it, and so does the version before it if a crash cut its prune short after
    the manifest (its files are then unlisted leftovers). Returns the versions whose files were removed."""
    return [v for v in range(max(version - keep - 1, 0), version - keep + 1) if prune_optimizer_state(lake, run_id, v)]


def local_copy(lake: Lake, path: str, cache_dir: str, *, checked: bool = True) -> str:
    """A local directory with the checkpoint's model files (the path itself on a local lake, its model files checked
    against the manifest first unless `checked=False`: a rollout worker loads versions verified at their promotion
    an instant before, where hashing a large model's files again on each load would cost as much as the load), for
    `from_pretrained` and vLLM.

    Only the Hugging Face files are copied, not `trainer_state/` (2/3 of a checkpoint with AdamW's moments, and the
    part a later promotion may prune while a worker copies), each checked against the manifest read first as it
    is written; the copy's own MANIFEST lists what it holds. The copy is named by the checkpoint's URL and
    manifest, so a re-created run or another lake never reuses it, and is written into a private folder and only
    then renamed into place: a download cut short (a killed process) or two processes copying at once never leave
    a partial copy to be loaded."""
    if lake.is_local:  # loaded where it is
        for rel, digest in _model_files(_read_manifest(lake.fs, path)) if checked else ():
            _read_checked(lake.fs, path, rel, digest)
        return path
    try:
        manifest_bytes = lake.fs.cat_file(f"{path}/MANIFEST.json")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {lake.url(path)} has no MANIFEST.json (incomplete write)") from None
    key = hashlib.sha256(lake.url(path).encode() + b"\0" + manifest_bytes).hexdigest()[:16]
    dest = os.path.join(cache_dir, f"lockstep-ckpt-{key}")
    if os.path.isdir(dest):  # only complete, checked copies are ever renamed to this name
        return dest
    part = Path(f"{dest}.part-{os.getpid()}-{time.time_ns()}")
    part.mkdir()
    try:
        copied = _copy_model_files(lake.fs, path, json.loads(manifest_bytes), part)
        (part / "MANIFEST.json").write_bytes(_manifest_bytes(copied))
        try:
            os.rename(part, dest)
        except OSError:
            if not os.path.isdir(dest):  # not another process's copy landing first
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return dest


def _copy_model_files(fs, path: str, manifest: dict[str, str], out: Path) -> dict[str, str]:
    """The checkpoint's Hugging Face files (all but `trainer_state/`) into the local folder `out`, each checked
    against `manifest` as it is copied (the bytes checked are the bytes written: a file changed between a check
    and a copy cannot slip through, and a remote lake is read once); returns their manifest entries."""
    copied = {}
    for rel, digest in _model_files(manifest):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(_read_checked(fs, path, rel, digest))
        copied[rel] = digest
    return copied


def _model_files(manifest: dict[str, str]) -> list[tuple[str, str]]:
    """The manifest's entries of the Hugging Face files: all but `trainer_state/`."""
    return [(rel, digest) for rel, digest in manifest.items() if not rel.startswith("trainer_state/")]


def export_hf(lake: Lake, path: str, out_dir: str) -> str:
    """Copy a checkpoint's Hugging Face files (weights, config, tokenizer) to a local directory, without the
    trainer state; each file is checked against the manifest as it is copied (`_copy_model_files`).

    The files are written to a hidden folder and moved into place when all are written, so a failed export (disk
    full, a quota) leaves no directory that looks like a model: for a new target the folder is beside it and
    renamed to it; an existing empty target (a mount point, a symlink, the working directory: it cannot be
    replaced) holds the folder, whose files are moved up, and stays empty on failure."""
    manifest = _read_manifest(lake.fs, path)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out_dir} is a file; choose a new directory")
    existing = out.exists()
    if existing and any(out.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage_name = f".{out.name}.{os.getpid()}-{time.time_ns()}.partial"
    stage = out / stage_name if existing else out.parent / stage_name
    stage.mkdir()
    try:
        _copy_model_files(lake.fs, path, manifest, stage)
        _fsync_tree(str(stage))
        if existing:
            for entry in stage.iterdir():
                os.replace(entry, out / entry.name)
            stage.rmdir()
            fsync_path(str(out))
        else:
            os.replace(stage, out)
            fsync_path(str(out.parent))
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return str(out)
