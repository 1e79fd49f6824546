"""`tasks.session.bootstrap_v0`: v0 is built once per cache key under `bootstrap/{key}` and reused (verified) by
later runs; on an object store each builder writes a folder of its own and the first complete one by name serves;
a folder another run completed meanwhile is kept; the SFT stage trains on each training prompt with its answer and
newline, and stops once the accuracy on `bootstrap.check_prompts` training prompts reaches the target."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from models.tiny import build_char_tokenizer, build_tiny_model
from storage import checkpoints
from storage import lake as lake_module
from storage.lake import Lake, read_json
from tasks import session as session_module

torch.set_num_threads(1)

SMALL = ["task.max_operand=5", "task.n_eval=5", "task.n_shots=2", "rollout.prompts_per_iteration=4"]


def _cfg(uri, *extra):
    return load_config(None, [f"lake.uri={uri}", "bootstrap.steps=0", "run.seed=3", *SMALL, *extra])


def test_v0_is_built_once_from_the_run_seed_then_reused_and_verified(tmp_path):
    """The first call builds `bootstrap/{key}` (not cached) from a model initialised with the run seed; the next one
    returns the same folder as cached; a cached folder whose files no longer match their digests is refused, not
    trained on."""
    cfg = _cfg(tmp_path / "lake")
    lake = Lake(cfg.lake.uri)
    folder, cached = session_module.bootstrap_v0(cfg, lake)
    assert (folder, cached) == (f"{lake.root}/bootstrap/{session_module.bootstrap_key(cfg)}", False)
    assert session_module.bootstrap_v0(cfg, lake) == (folder, True)
    tok = build_char_tokenizer()
    expected = build_tiny_model(
        len(tok),
        **cfg.model.tiny.model_dump(),
        seed=3,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    ).state_dict()
    built = checkpoints.load_weights(lake, folder)
    assert all(torch.equal(built[k], expected[k]) for k in built)  # steps=0: v0 is the seeded initialisation
    weights = f"{folder}/model.safetensors"
    lake.fs.pipe(weights, lake.fs.cat(weights) + b"x")
    with pytest.raises(checkpoints.CheckpointError):
        session_module.bootstrap_v0(cfg, lake)


def test_a_v0_completed_by_another_run_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two runs with the same key may both build v0; the second to finish keeps the first one's folder (which that
    run may already be loading) instead of replacing it."""
    cfg = _cfg(tmp_path / "lake")
    lake = Lake(cfg.lake.uri)
    folder, _ = session_module.bootstrap_v0(cfg, lake)
    weights = tmp_path / "lake" / "bootstrap" / session_module.bootstrap_key(cfg) / "model.safetensors"
    before = weights.stat().st_ino
    monkeypatch.setattr(session_module, "_built_bootstrap", lambda lake, folder: None)  # not there when it looked
    assert session_module.bootstrap_v0(cfg, lake) == (folder, False)
    assert weights.stat().st_ino == before


def test_on_an_object_store_each_builder_writes_its_own_folder_and_the_first_by_name_serves(monkeypatch):
    """No rename settles two uploads of one folder: each builder writes `bootstrap/{key}/{writer}/`, and every later
    run takes the complete one that sorts first, whichever finished first."""
    monkeypatch.setattr(lake_module, "OBJECT_STORES", lake_module.OBJECT_STORES | {"memory"})
    cfg = _cfg(f"memory://lockstep-boot-{uuid.uuid4().hex}")
    lake = Lake(cfg.lake.uri)
    key_dir = f"{lake.root}/bootstrap/{session_module.bootstrap_key(cfg)}"
    try:
        first, cached = session_module.bootstrap_v0(cfg, lake)
        assert not cached and first.rsplit("/", 1)[0] == key_dir
        writers = iter(["f" * 32, "0" * 32])
        with monkeypatch.context() as m:  # two more builders that started before any had finished
            m.setattr(session_module.uuid, "uuid4", lambda: SimpleNamespace(hex=next(writers)))
            m.setattr(session_module, "_built_bootstrap", lambda lake, folder: None)
            session_module.bootstrap_v0(cfg, lake)
            session_module.bootstrap_v0(cfg, lake)
        assert session_module.bootstrap_v0(cfg, lake) == (f"{key_dir}/{'0' * 32}", True)
    finally:
        lake.fs.rm(lake.root, recursive=True)


def test_the_sft_trains_on_answers_with_their_newline_and_stops_at_the_target_on_training_prompts(
    tmp_path, monkeypatch
):
    """Each SFT sequence is a training prompt, its answer and the newline that ends an answer (greedy decoding stops
    there); the early stop checks the first `bootstrap.check_prompts` training prompts (never held-out ones) and
    stops once their accuracy reaches `bootstrap.target_accuracy` (reaching it is enough)."""
    cfg = _cfg(
        tmp_path / "lake",
        "bootstrap.steps=3",
        "bootstrap.check_every=1",
        "bootstrap.check_prompts=3",
        "bootstrap.target_accuracy=0.5",
    )
    checked = []

    def accuracy(model, tok, token_ids, prompts, max_new_tokens, reward_kind, stop_at_newline):
        assert stop_at_newline  # arithmetic: one-line answers
        checked.append([p.prompt_id for p in prompts])
        return 0.5

    monkeypatch.setattr(session_module, "accuracy", accuracy)
    real_sft, seqs = session_module.sft, []

    def sft(model, sequences, **kw):
        seqs.extend(sequences)
        return real_sft(model, sequences, **kw)

    monkeypatch.setattr(session_module, "sft", sft)
    lake = Lake(cfg.lake.uri)
    folder, _ = session_module.bootstrap_v0(cfg, lake)
    assert checked == [[0, 1, 2]]  # stopped at the first check
    assert read_json(lake, f"{folder}/trainer_state/state.json")["bootstrap"]["sft/steps"] == 1.0
    tok = build_char_tokenizer()
    train, _, _, _ = session_module.task_prompts(cfg, tok)
    assert seqs == [tok(p.text + p.answer + "\n", add_special_tokens=False)["input_ids"] for p in train]


def test_without_a_newline_stop_the_sft_answers_end_at_eos_and_the_check_does_not_stop_at_newlines(
    tmp_path, monkeypatch
):
    """Where responses end at EOS only (`task.stop_at_newline: false`, a dataset's default), the SFT must teach EOS
    after the answer: ending it with a newline would teach no end the decoding stops at."""
    cfg = _cfg(
        tmp_path / "lake",
        "task.stop_at_newline=false",
        "bootstrap.steps=1",
        "bootstrap.check_every=1",
        "bootstrap.target_accuracy=0.5",
    )
    stops, seqs, real_sft = [], [], session_module.sft

    def accuracy(model, tok, token_ids, prompts, max_new_tokens, reward_kind, stop_at_newline):
        stops.append(stop_at_newline)
        return 0.0

    def sft(model, sequences, **kw):
        seqs.extend(sequences)
        return real_sft(model, sequences, **kw)

    monkeypatch.setattr(session_module, "accuracy", accuracy)
    monkeypatch.setattr(session_module, "sft", sft)
    session_module.bootstrap_v0(cfg, Lake(cfg.lake.uri))
    assert stops == [False]
    tok = build_char_tokenizer()
    train, _, _, _ = session_module.task_prompts(cfg, tok)
    assert seqs == [tok(p.text + p.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for p in train]


@pytest.mark.parametrize(
    "override", ["model.tiny.hidden_size=48", "task.max_operand=6", "bootstrap.steps=5", "bootstrap.lr=0.01"]
)
def test_the_bootstrap_cache_key_depends_on_the_model_task_and_bootstrap_settings(override):
    """v0 is SFT of that model on that task's prompts with those settings: a change to any of them must build a v0
    of its own, not reuse one trained for something else."""
    base = load_config(None, SMALL)
    assert session_module.bootstrap_key(base) == session_module.bootstrap_key(load_config(None, SMALL))
    assert session_module.bootstrap_key(base) != session_module.bootstrap_key(load_config(None, [*SMALL, override]))


def test_a_runs_key_is_unchanged_by_the_reward_settings_added_after_v0s_were_cached():
    """`task.dataset.extra_fields`, `task.reward_timeout_s` and `task.reward_batch` came after runs had cached their
    v0: a config keys as it did before them (the keys below are those the code before them gave, 38c84e9), so such a
    run's resume and a new run of the same settings find that v0, whatever time limit is set and however the
    function is called; listed extra fields change the reward's arguments (the bootstrap's target-accuracy check
    scores with them) and the rows kept, and so the key."""
    dataset = ["task.kind=dataset", "task.dataset.uri=/data/x.jsonl", "task.reward=math_verify"]
    assert session_module.bootstrap_key(load_config(None, dataset)) == "13d770231432c314"
    assert session_module.bootstrap_key(load_config(None, [])) == "5ed5aab7bd1d324b"  # arithmetic: no dataset
    for setting in ("task.reward_timeout_s=5", "task.reward_batch=true"):
        assert session_module.bootstrap_key(load_config(None, ["task.reward=mod:f", setting])) == (
            session_module.bootstrap_key(load_config(None, ["task.reward=mod:f"]))
        )
    listed = [*dataset[:2], "task.reward=mod:f", "task.dataset.extra_fields=[tests]"]
    assert session_module.bootstrap_key(load_config(None, listed)) != session_module.bootstrap_key(
        load_config(None, listed[:3])
    )
