"""storage/checkpoints.py and storage/ledger.py: a saved checkpoint is a Hugging Face directory that loads as it is,
trainer state restores exactly, verification catches damage, promotion refuses incomplete checkpoints, and the
ledger's state machine refuses illegal transitions."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.tiny import build_tiny_model
from storage import ledger
from storage.checkpoints import (
    CheckpointError,
    export_hf,
    load_into,
    load_trainer_state,
    load_weights,
    local_copy,
    promote,
    promoted_version,
    prune_optimizer_state,
    save_checkpoint,
    snapshot,
    verify_checkpoint,
)
from storage.lake import Lake, validate_run_id

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
RUN = "ckpt-run"
TEXT = "Q: 12+7=?\nA: 19\nQ: 3*4=?\nA: "


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def fixed_input(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer(TEXT)["input_ids"]])  # (1, 28)


def train_steps(model, steps: int = 2, lr: float = 1e-2) -> torch.optim.AdamW:
    """A few AdamW steps of next-token loss on a fixed batch, so the optimizer has non-trivial state."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ids = torch.arange(4, 20).repeat(2, 1)  # (2, 16)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return opt


# ------------------------------------------------------------------------------------------------ HF round trip


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_checkpoint_loads_with_from_pretrained(tiny_hf, lake, arch):
    tok = tiny_hf.tokenizer
    model = tiny_hf.model if arch == "qwen2" else build_tiny_model(len(tok), arch="llama", seed=3, **TINY)
    train_steps(model)  # weights differ from any fresh init, so equality below cannot be a coincidence
    path = save_checkpoint(lake, RUN, 1, model, tok)
    promote(lake, RUN, 1)
    assert promoted_version(lake, RUN) == 1

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    ids = fixed_input(tok)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, expected)
    # and through the lake's own reader (what rollout workers use to pick up a promoted version)
    fresh = build_tiny_model(len(tok), arch=arch, seed=99, **TINY)
    load_into(fresh, load_weights(lake, path))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, expected)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_round_trips(tiny_hf, lake, arch):
    tok = tiny_hf.tokenizer
    model = tiny_hf.model if arch == "qwen2" else build_tiny_model(len(tok), arch="llama", **TINY)
    path = save_checkpoint(lake, RUN, 0, model, tok)
    loaded = AutoTokenizer.from_pretrained(path)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
    expected = tok(TEXT)["input_ids"]
    assert len(expected) == len(TEXT)  # one token per character
    assert loaded.decode(expected) == TEXT
    ids = loaded(TEXT)["input_ids"]
    assert ids == expected


def test_checkpoint_layout(tiny_hf, lake):
    path = save_checkpoint(lake, RUN, 3, tiny_hf.model, tiny_hf.tokenizer, extra_state={"iteration": 2})
    assert path == f"{lake.root}/runs/{RUN}/checkpoints/v000003"
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "MANIFEST.json", "trainer_state"} <= files
    manifest = json.loads(Path(path, "MANIFEST.json").read_text())
    assert "model.safetensors" in manifest and "trainer_state/state.json" in manifest
    # nothing left in the temporary area, nothing pickled
    assert list(Path(lake.run_dir(RUN)).glob("_tmp/*")) == []
    assert not [p for p in Path(path).rglob("*") if p.suffix in (".bin", ".pt", ".pkl", ".pth")]
    assert promoted_version(lake, RUN) is None  # saving does not promote


# ------------------------------------------------------------------------------------------------ trainer state


def test_optimizer_and_rng_state_restore_exactly(tiny_hf, lake):
    model = tiny_hf.model
    opt = train_steps(model, steps=2)
    torch.manual_seed(1234)
    path = save_checkpoint(lake, RUN, 2, model, tiny_hf.tokenizer, optimizer=opt, extra_state={"iteration": 1})
    after_save = torch.rand(5)  # what the RNG gives right after the checkpoint

    # a new process would build the model from the checkpoint and a fresh optimizer
    model2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=123.0)  # wrong lr on purpose: param_groups must come back
    torch.manual_seed(0)
    state = load_trainer_state(lake, path, opt2)
    assert state == {"version": 2, "iteration": 1}
    assert torch.equal(torch.rand(5), after_save)

    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    # JSON turns the betas tuple into a list; equal as values
    assert json.loads(json.dumps(sd2["param_groups"])) == json.loads(json.dumps(sd1["param_groups"]))
    assert sd1["param_groups"][0]["lr"] == 1e-2
    assert sd1["state"].keys() == sd2["state"].keys() and len(sd1["state"]) == len(list(model.parameters()))
    for pid, st in sd1["state"].items():
        assert st.keys() == sd2["state"][pid].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in st.items():
            assert torch.equal(sd2["state"][pid][k], v), (pid, k)
        assert float(st["step"]) == 2.0

    # one more identical step on both keeps them bit-identical (the restored state is really used)
    train_steps_with(model, opt)
    train_steps_with(model2, opt2)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def train_steps_with(model, opt) -> None:
    ids = torch.arange(6, 22).repeat(2, 1)  # (2, 16)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def test_negative_control_fresh_optimizer_diverges(tiny_hf, lake):
    """Without the restored state the next step differs: the exact-equality assertion above is not vacuous."""
    model = tiny_hf.model
    opt = train_steps(model, steps=2)
    path = save_checkpoint(lake, RUN, 2, model, tiny_hf.tokenizer, optimizer=opt)
    model2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.01)  # same settings, no moments
    train_steps_with(model, opt)
    train_steps_with(model2, opt2)
    diffs = [
        float((p1 - p2).detach().abs().max()) for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True)
    ]
    assert max(diffs) > 1e-4


def test_pruned_optimizer_state_leaves_a_valid_checkpoint_that_refuses_resume(tiny_hf, lake, tmp_path):
    model = tiny_hf.model
    opt = train_steps(model, steps=2)
    path = save_checkpoint(lake, RUN, 3, model, tiny_hf.tokenizer, optimizer=opt, extra_state={"iteration": 3})
    before = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    assert prune_optimizer_state(lake, RUN, 3) is True
    assert prune_optimizer_state(lake, RUN, 3) is False  # nothing left to prune
    after = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    assert not Path(path, "trainer_state", "optimizer.safetensors").exists()
    assert after < before / 2  # AdamW's two moments per weight were the bulk of it
    verify_checkpoint(lake, path)  # the manifest was rewritten with the files
    promote(lake, RUN, 3)
    assert promoted_version(lake, RUN) == 3
    reloaded = AutoModelForCausalLM.from_pretrained(export_hf(lake, path, str(tmp_path / "out")), dtype=torch.float32)
    ids = fixed_input(tiny_hf.tokenizer)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert load_trainer_state(lake, path, None) == {"version": 3, "iteration": 3}  # RNG and state still load
    with pytest.raises(CheckpointError, match="no longer has its optimizer state"):
        load_trainer_state(lake, path, torch.optim.AdamW(reloaded.parameters()))


def test_a_checkpoint_saved_without_optimizer_is_not_pruned(tiny_hf, lake):
    path = save_checkpoint(lake, RUN, 0, tiny_hf.model, tiny_hf.tokenizer)
    assert prune_optimizer_state(lake, RUN, 0) is False
    opt = torch.optim.AdamW(tiny_hf.model.parameters())
    load_trainer_state(lake, path, opt)  # fresh optimizer stays fresh: v0 never had moments
    assert opt.state_dict()["state"] == {}


# ------------------------------------------------------------------------------------------------ verify / promote


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "trainer_state/state.json"])
def test_verify_detects_a_modified_file(tiny_hf, lake, victim):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    verify_checkpoint(lake, path)  # intact: no error
    f = Path(path, victim)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint file {path}/{victim} does not match its manifest"):
        verify_checkpoint(lake, path)
    with pytest.raises(CheckpointError):
        promote(lake, RUN, 1)
    assert promoted_version(lake, RUN) is None


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_every_load_of_a_damaged_checkpoint_names_the_file(tiny_hf, lake, tmp_path, victim):
    """Loads past promotion check what they load: `load_weights` (a resume's proximal weights one version back) and
    `local_copy` of a local lake (replay's v0, served as it lies) name a model file damaged since the checkpoint was
    written; the optimizer state, which neither loads, is left to its reader. `checked=False` (a worker's load of a
    version verified at its promotion, replay's comparison) reads the files as they are."""
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    assert set(load_weights(lake, path)) == set(tiny_hf.model.state_dict()) - {"lm_head.weight"}  # intact (tied)
    assert local_copy(lake, path, str(tmp_path)) == path
    f = Path(path, victim)
    data = bytearray(f.read_bytes())
    data[-2] ^= 0x01  # a tensor's byte, or the config's closing brace: only the digest is compared
    f.write_bytes(bytes(data))
    match = f"checkpoint file {path}/{victim} does not match its manifest"
    with pytest.raises(CheckpointError, match=match):
        local_copy(lake, path, str(tmp_path))
    assert local_copy(lake, path, str(tmp_path), checked=False) == path
    if victim == "model.safetensors":
        with pytest.raises(CheckpointError, match=match):
            load_weights(lake, path)
        damaged = load_weights(lake, path, checked=False)  # as it lies: one value changed
        state = tiny_hf.model.state_dict()
        assert sum(not torch.equal(t, state[k]) for k, t in damaged.items()) == 1
    else:
        load_weights(lake, path)  # the weights themselves are intact
    Path(path, "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="has no MANIFEST.json"):
        load_weights(lake, path)


def test_promote_refuses_incomplete_checkpoint_and_keeps_previous(tiny_hf, lake):
    save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    promote(lake, RUN, 1)
    path2 = save_checkpoint(lake, RUN, 2, tiny_hf.model, tiny_hf.tokenizer)
    Path(path2, "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint {path2} has no MANIFEST.json"):
        promote(lake, RUN, 2)
    assert promoted_version(lake, RUN) == 1
    assert json.loads(Path(lake.promoted_file(RUN)).read_text()) == {"version": 1}


@pytest.mark.parametrize("content", ['{"v": 1}', "{bad", '{"version": "2"}', "[1]"])
def test_a_damaged_promoted_file_is_named(tiny_hf, lake, content):
    save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    promote(lake, RUN, 1)
    Path(lake.promoted_file(RUN)).write_text(content)  # damage from outside: PROMOTED is written atomically
    with pytest.raises(CheckpointError, match=f"{lake.promoted_file(RUN)} is damaged"):
        promoted_version(lake, RUN)


def test_a_failed_export_leaves_no_directory(tiny_hf, lake, tmp_path, monkeypatch):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    written = []
    real = Path.write_bytes

    def disk_full_at_the_second_file(self, data):
        if written:
            raise OSError(28, "No space left on device", str(self))
        written.append(self.name)
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", disk_full_at_the_second_file)
    for target in (tmp_path / "out", tmp_path / "empty"):  # a new directory, and an existing empty one
        if target.name == "empty":
            target.mkdir()
        with pytest.raises(OSError, match="No space left"):
            export_hf(lake, path, str(target))
        # before: the target held the files written so far, a model directory that looked complete
        assert written and (not target.exists() or not any(target.iterdir()))
        written.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "lake"]  # no partial folder left beside
    monkeypatch.undo()
    out = Path(export_hf(lake, path, str(tmp_path / "empty")))
    assert (out / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["empty", "lake"]
    with pytest.raises(FileExistsError, match="is a file"):
        export_hf(lake, path, str(out / "model.safetensors"))


def test_export_into_an_empty_directory_that_cannot_be_replaced(tiny_hf, lake, tmp_path, monkeypatch):
    # a symlink to an empty directory, and the working directory: a rename onto them fails (NotADirectoryError,
    # EBUSY) or swaps the directory out from under the process, so the files are moved into them instead
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    files = sorted(p.name for p in Path(path).iterdir() if p.name not in ("trainer_state", "MANIFEST.json"))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    export_hf(lake, path, str(tmp_path / "link"))
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in (tmp_path / "real").iterdir()) == files
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    export_hf(lake, path, ".")
    assert sorted(os.listdir(".")) == files  # the process's directory, not one renamed over it
    assert AutoModelForCausalLM.from_pretrained(str(cwd)) is not None


def test_nested_model_files_are_exported_and_copied(tiny_hf, tmp_path):
    """A tokenizer with named chat templates saves the extra ones under `additional_chat_templates/`: an export and a
    local copy (the files a vLLM worker and `from_pretrained` load) hold them at their place, and the tokenizer
    loaded from either has every template."""
    from storage.checkpoints import local_copy

    tok = tiny_hf.tokenizer
    tok.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "T: {{ messages[0]['content'] }}"}
    for lake in (Lake(str(tmp_path / "lake")), Lake(f"memory://nested-{tmp_path.name}")):
        path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tok)
        assert "additional_chat_templates/tool_use.jinja" in json.loads(lake.fs.cat_file(f"{path}/MANIFEST.json"))
        out = tmp_path / f"export-{lake.protocol}"
        cache = tmp_path / f"cache-{lake.protocol}"
        cache.mkdir()
        for folder in (export_hf(lake, path, str(out)), local_copy(lake, path, str(cache))):
            assert AutoTokenizer.from_pretrained(folder).chat_template == tok.chat_template, folder
        if not lake.is_local:
            lake.fs.rm(lake.root, recursive=True)


def test_export_creates_the_parents_of_a_new_directory(tiny_hf, lake, tmp_path):
    """`lockstep export --out models/run/v3`: the folders above the target are created, and nothing but the model
    directory is left in them."""
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    out = tmp_path / "models" / "run" / "v1"
    assert export_hf(lake, path, str(out)) == str(out)
    assert os.listdir(out.parent) == ["v1"]
    files = sorted(p.name for p in Path(path).iterdir() if p.name not in ("trainer_state", "MANIFEST.json"))
    assert sorted(os.listdir(out)) == files


def test_an_export_into_an_existing_directory_is_staged_inside_it(tiny_hf, lake, tmp_path, monkeypatch):
    """An existing empty target may be a mount point: a folder staged beside it is on another filesystem, where
    moving the files in is a copy (or fails, EXDEV). Its files are written in a hidden folder inside it; a new
    target's in a hidden folder beside it, renamed to it."""
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    real, folders = Path.write_bytes, set()

    def write_bytes(self, data):
        folders.add(self.parent)
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    for target, inside in ((tmp_path / "mounted", True), (tmp_path / "new", False)):
        if inside:
            target.mkdir()
        folders.clear()
        export_hf(lake, path, str(target))
        (stage,) = folders
        assert stage.name.startswith(f".{target.name}.") and stage.name.endswith(".partial")
        assert stage.parent == (target if inside else tmp_path), target


def test_promote_of_missing_version_fails(tiny_hf, lake):
    with pytest.raises(CheckpointError, match="has no MANIFEST.json"):
        promote(lake, RUN, 7)
    assert promoted_version(lake, RUN) is None


def test_verify_detects_a_missing_file(tiny_hf, lake):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    Path(path, "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        verify_checkpoint(lake, path)


def test_resave_replaces_an_unpromoted_checkpoint(tiny_hf, lake):
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    Path(path, "stray.txt").write_text("left by an earlier attempt")
    train_steps(tiny_hf.model, steps=1)
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    assert not Path(path, "stray.txt").exists()
    verify_checkpoint(lake, path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = fixed_input(tiny_hf.tokenizer)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, tiny_hf.model(input_ids=ids).logits)


# ------------------------------------------------------------------------------------------------ ledger


def test_ledger_legal_path(lake):
    for state in ("planned", "rolling_out", "trained", "promoted"):
        rec = ledger.write_record(lake, RUN, 0, state, note=state)
    assert rec["state"] == "promoted" and rec["note"] == "promoted"
    assert [h["state"] for h in rec["history"]] == ["planned", "rolling_out", "trained", "promoted"]
    assert ledger.read_record(lake, RUN, 0) == rec
    assert Path(lake.ledger_file(RUN, 0)).name == "iter-000000.json"


def test_ledger_several_transitions_in_one_write(lake, monkeypatch):
    import storage.ledger as ledger_module

    writes = []
    real = ledger_module.atomic_write_json
    monkeypatch.setattr(ledger_module, "atomic_write_json", lambda *a: (writes.append(a[2]), real(*a)))
    rec = ledger.write_record(lake, RUN, 4, ("planned", "rolling_out"), prompt_ids=[3, 1])
    assert len(writes) == 1 and rec["state"] == "rolling_out" and rec["prompt_ids"] == [3, 1]
    assert [h["state"] for h in rec["history"]] == ["planned", "rolling_out"]
    assert ledger.read_record(lake, RUN, 4) == rec
    # every transition of the tuple is checked; a refused one writes nothing
    with pytest.raises(ValueError, match="illegal transition trained -> planned"):
        ledger.write_record(lake, RUN, 4, ("trained", "planned"))
    assert ledger.read_record(lake, RUN, 4) == rec and len(writes) == 1


def test_ledger_failed_then_resumed(lake):
    ledger.write_record(lake, RUN, 3, "planned", policy_version=3)
    ledger.write_record(lake, RUN, 3, "rolling_out")
    ledger.write_record(lake, RUN, 3, "failed", reason="worker died")
    rec = ledger.write_record(lake, RUN, 3, "planned")
    assert rec["state"] == "planned" and rec["reason"] == "worker died" and rec["policy_version"] == 3
    assert [h["state"] for h in rec["history"]] == ["planned", "rolling_out", "failed", "planned"]


@pytest.mark.parametrize(
    "prev,bad",
    [
        (["planned", "rolling_out", "trained", "promoted"], "planned"),
        (["planned", "rolling_out", "trained", "promoted"], "failed"),
        (["planned"], "trained"),
        (["planned"], "promoted"),
        (["planned", "rolling_out"], "promoted"),
        (["planned", "failed"], "trained"),
        (["planned", "rolling_out"], "rolling_out"),
    ],
)
def test_ledger_illegal_transitions(lake, prev, bad):
    for s in prev:
        ledger.write_record(lake, RUN, 1, s)
    with pytest.raises(ValueError, match=f"iteration 1: illegal transition {prev[-1]} -> {bad}"):
        ledger.write_record(lake, RUN, 1, bad)
    assert ledger.read_record(lake, RUN, 1)["state"] == prev[-1]  # the record is unchanged


@pytest.mark.parametrize("first", ["rolling_out", "trained", "promoted", "failed"])
def test_ledger_new_record_must_start_planned(lake, first):
    with pytest.raises(ValueError, match="a new record starts 'planned'"):
        ledger.write_record(lake, RUN, 5, first)
    assert ledger.read_record(lake, RUN, 5) is None


def test_ledger_read_all_in_order(lake):
    assert ledger.read_all(lake, RUN) == []
    for k in (2, 0, 1):
        ledger.write_record(lake, RUN, k, "planned")
    assert [r["iteration"] for r in ledger.read_all(lake, RUN)] == [0, 1, 2]
    assert ledger.read_record(lake, RUN, 9) is None


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_lake_copied_or_moved_reads_its_own_shards(tmp_path, how):
    """A record holds the path its shards were written to: read from a copy, a replay of the copy read the original
    lake's shards (a shard damaged in the copy went unseen), and from a moved lake it found none. Paths are re-rooted
    at the reading lake's run folder."""
    import shutil

    from flows.replay import recorded_batch
    from storage.shards import ShardError, write_shard
    from tests.unit.test_shards import make_records

    a = Lake(str(tmp_path / "a"))
    name = "rollouts/policy_version=0/iter-000000/shard-0-00000.arrow"
    checksum = write_shard(a, RUN, f"{a.run_dir(RUN)}/{name}", make_records(n_groups=2, group_size=3))
    shards = [{"path": f"{a.run_dir(RUN)}/{name}", "checksum": checksum, "groups": 2}]
    ledger.write_record(a, RUN, 0, "planned", shards=shards)
    (shutil.copytree if how == "copied" else shutil.move)(tmp_path / "a", tmp_path / "b")
    b = Lake(str(tmp_path / "b"))
    record = ledger.read_record(b, RUN, 0)
    assert record["shards"] == [{**shards[0], "path": f"{b.run_dir(RUN)}/{name}"}]
    assert ledger.read_all(b, RUN) == [record]
    assert [len(groups) for groups in recorded_batch(b, record)] == [2]
    Path(b.run_dir(RUN), name).write_bytes(b"damaged in this lake only")
    with pytest.raises(ShardError, match=f"shard {b.run_dir(RUN)}/{name} is unreadable"):
        recorded_batch(b, record)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "..", "a..b", "x" * 129, "a b", "run\n", None, 5])
def test_validate_run_id_rejects(bad):
    with pytest.raises(ValueError, match="invalid run id"):
        validate_run_id(bad)


def test_validate_run_id_rejects_in_paths(lake):
    with pytest.raises(ValueError, match="invalid run id"):
        lake.run_dir("../escape")
    with pytest.raises(ValueError, match="invalid run id"):
        ledger.write_record(lake, "a/b", 0, "planned")


@pytest.mark.parametrize("good", ["arith-tiny-20250101T000000Z", "a", "A.b_c-1", "x" * 128])
def test_validate_run_id_accepts(good):
    assert validate_run_id(good) == good


# ------------------------------------------------------------------------------------------------ snapshots


def test_copied_snapshot_saves_the_state_of_its_instant(tiny_hf, lake, tmp_path):
    """A checkpoint written in the background from `snapshot(copy=True)` holds the weights, optimizer moments
    and RNG state of the moment the snapshot was taken, byte for byte what a save at that moment writes, however
    the model trains meanwhile."""
    model = tiny_hf.model
    opt = train_steps(model, steps=2)
    torch.manual_seed(7)
    snap = snapshot(model, opt, copy=True)
    direct = save_checkpoint(lake, RUN, 1, model, tiny_hf.tokenizer, optimizer=opt)  # the same instant, live
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps_with(model, opt)  # training goes on
    torch.rand(3)
    assert max(float((model.state_dict()[k] - before[k]).abs().max()) for k in before) > 1e-4
    later = save_checkpoint(lake, RUN, 2, model, tiny_hf.tokenizer, optimizer=opt, snap=snap)
    for rel in ("model.safetensors", "trainer_state/optimizer.safetensors", "trainer_state/rng.safetensors"):
        assert Path(later, rel).read_bytes() == Path(direct, rel).read_bytes(), rel
    loaded = AutoModelForCausalLM.from_pretrained(later)
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)
    # tied embeddings stay tied (saved once), as in a save of the live model
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


def test_uncopied_snapshot_follows_the_model(tiny_hf):
    """Without `copy` a snapshot is a view (the synchronous path saves at once and needs no copy)."""
    model = tiny_hf.model
    opt = train_steps(model, steps=1)
    view, copied = snapshot(model, opt), snapshot(model, opt, copy=True)
    train_steps_with(model, opt)
    name = "model.embed_tokens.weight"
    assert torch.equal(view.weights[name], model.state_dict()[name])
    assert not torch.equal(copied.weights[name], model.state_dict()[name])


def test_a_copied_snapshot_keeps_views_of_one_storage_apart():
    """`copy` makes one copy per storage so that tied entries stay tied (saved once); entries that only start at the
    same address (a transposed view, another shape or dtype of the same bytes) are other tensors: each keeps its own
    values, shape, dtype and layout, detached from the live model."""

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3, bias=False)
            self.b = torch.nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight  # tied
            with torch.no_grad():
                self.a.weight.copy_(torch.arange(9.0).reshape(3, 3))
            w = self.a.weight.data
            self.register_buffer("transposed", w.t())  # same address, shape and dtype; other strides
            self.register_buffer("rows", w[:2])  # other shape, same strides
            self.register_buffer("bits", w.view(torch.int32))  # other dtype

    model = Views()
    live = model.state_dict()
    snap = snapshot(model, copy=True)
    assert snap.weights.keys() == live.keys()
    for name, t in live.items():
        got = snap.weights[name]
        assert (got.dtype, got.shape, got.stride()) == (t.dtype, t.shape, t.stride()), name
        assert torch.equal(got, t) and got.data_ptr() != t.data_ptr(), name
    assert snap.weights["a.weight"] is snap.weights["b.weight"]


@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
def test_restore_trainer_loads_the_proximal_policy_one_version_back(tiny_hf, lake, prox):
    """A resumed async run that recomputes its proximal policy continues with checkpoint v2 as the policy and v1 as
    the proximal policy (what the trainer would have kept from before its last optimizer step); an approximating run
    keeps no proximal weights."""
    import copy

    from models.trainer import LossSettings, PolicyTrainer
    from tasks.session import restore_trainer

    model = tiny_hf.model
    opt = train_steps(model, steps=1)
    save_checkpoint(lake, RUN, 1, model, tiny_hf.tokenizer, optimizer=opt)
    v1 = copy.deepcopy(model.state_dict())
    train_steps_with(model, opt)
    save_checkpoint(lake, RUN, 2, model, tiny_hf.tokenizer, optimizer=opt)

    fresh = build_tiny_model(len(tiny_hf.tokenizer), seed=5, **TINY)
    trainer = PolicyTrainer(fresh, None, lr=1e-3, loss=LossSettings(decoupled=True, prox_logp=prox))
    restore_trainer(trainer, lake, RUN, 2)
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in fresh.state_dict().items())
    if prox == "loglinear":
        assert trainer.prox_model is None and trainer.prox_version is None
        return
    assert trainer.prox_version == 1
    prox_state = trainer.prox_model.state_dict()
    assert all(torch.equal(prox_state[k], t) for k, t in v1.items())
    assert not torch.equal(prox_state["model.embed_tokens.weight"], fresh.state_dict()["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------------------------ local copies


def test_local_copy_of_a_remote_lake_is_never_partial(tiny_hf, tmp_path, monkeypatch):
    """A download cut short (a killed process, a reset connection) leaves nothing that a later call would load; the
    next call downloads again and gets a complete, checked copy; a changed checkpoint gets a copy of its own."""
    from fsspec.implementations.memory import MemoryFileSystem

    from storage.checkpoints import local_copy

    lake = Lake(f"memory://local-copy-{tmp_path.name}")
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    cache = tmp_path / "cache"
    cache.mkdir()
    real_open = MemoryFileSystem.open

    def cut_at_weights(self, rpath, mode="rb", *args, **kwargs):
        if rpath.endswith("model.safetensors"):
            raise ConnectionResetError("cut mid-download")
        return real_open(self, rpath, mode, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "open", cut_at_weights)
    with pytest.raises(ConnectionResetError):
        local_copy(lake, path, str(cache))
    assert os.listdir(cache) == []  # not a folder without weights that the next call would take as complete
    monkeypatch.setattr(MemoryFileSystem, "open", real_open)
    copy = local_copy(lake, path, str(cache))
    assert os.listdir(cache) == [os.path.basename(copy)]
    manifest = json.loads(Path(copy, "MANIFEST.json").read_text())
    assert sorted(str(p.relative_to(copy)) for p in Path(copy).rglob("*") if p.is_file()) == sorted(
        [*manifest, "MANIFEST.json"]
    )
    # the model's files with their digests, not the trainer state (most of a checkpoint with optimizer moments)
    source = json.loads(lake.fs.cat_file(f"{path}/MANIFEST.json"))
    assert manifest == {k: v for k, v in source.items() if not k.startswith("trainer_state/")}
    assert "model.safetensors" in manifest and any(k.startswith("trainer_state/") for k in source)
    assert local_copy(lake, path, str(cache)) == copy  # reused

    train_steps(tiny_hf.model)  # the same run id and version saved again with other weights
    save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    fresh = local_copy(lake, path, str(cache))
    assert fresh != copy
    assert load_weights(lake, path)["model.embed_tokens.weight"].equal(
        load_weights(Lake(str(tmp_path)), fresh)["model.embed_tokens.weight"]
    )


def test_local_copy_refuses_a_download_that_does_not_match_the_manifest(tiny_hf, tmp_path, monkeypatch):
    from fsspec.implementations.memory import MemoryFileSystem

    from storage.checkpoints import local_copy

    lake = Lake(f"memory://local-copy-bad-{tmp_path.name}")
    path = save_checkpoint(lake, RUN, 1, tiny_hf.model, tiny_hf.tokenizer)
    real_open = MemoryFileSystem.open

    def corrupt_config(self, rpath, mode="rb", *args, **kwargs):
        if rpath.endswith("/config.json"):
            return io.BytesIO(b"{}")  # what a damaged transfer would deliver
        return real_open(self, rpath, mode, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "open", corrupt_config)
    with pytest.raises(CheckpointError, match="config.json does not match its manifest"):
        local_copy(lake, path, str(tmp_path))
    assert not [p for p in os.listdir(tmp_path) if p.startswith("lockstep-ckpt-")]
