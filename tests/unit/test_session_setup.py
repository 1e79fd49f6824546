"""What `tasks.session` builds a run from: the task's prompts and their token ids, the dataset's held-out split, the
bootstrap cache key, the trainer's settings, a resumed trainer's state, and the session's end."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
from types import SimpleNamespace

import pytest
import torch

from configs.schema import load_config
from models.tiny import build_char_tokenizer, build_tiny_model
from models.trainer import LossSettings, PolicyTrainer
from storage import scratch
from storage.checkpoints import save_checkpoint, verify_checkpoint
from storage.lake import Lake
from tasks import session as session_module
from tasks.preflight import InputError
from tests.unit.test_lease import dead_pid

torch.set_num_threads(1)

SMALL = ["task.max_operand=5", "task.n_eval=5", "task.n_shots=2", "rollout.prompts_per_iteration=4"]
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


def _dataset(tmp_path, questions: list[str]):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))
    return ["task.kind=dataset", "task.n_shots=0", f"task.dataset={{uri: {path}}}", "rollout.prompts_per_iteration=2"]


def test_a_prompt_of_exactly_max_prompt_tokens_is_kept():
    """`task.max_prompt_tokens` is inclusive: a limit equal to the longest prompt keeps every prompt; one less
    refuses."""
    tok = build_char_tokenizer()
    cfg = load_config(None, SMALL)
    prompts, ids, _, _ = session_module.task_prompts(cfg, tok)
    longest = max(len(i) for i in ids)
    cfg.task.max_prompt_tokens = longest  # the limit is inclusive
    again, again_ids, _, _ = session_module.task_prompts(cfg, tok)
    assert len(again) == len(prompts) and again_ids == ids
    cfg.task.max_prompt_tokens = longest - 1
    with pytest.raises(ValueError, match=f"training prompts exceed task.max_prompt_tokens={longest - 1}"):
        session_module.task_prompts(cfg, tok)


def test_dataset_prompts_skipped_for_length_keep_ids_aligned_and_indexed(tmp_path):
    """`data.on_bad_row: skip` drops a dataset prompt over `task.max_prompt_tokens`: every remaining prompt keeps its
    own token ids (train and held-out), and training prompts are numbered 0..n-1 (the index the workers and the plan
    use), whatever rows the held-out split took."""
    questions = [f"{i}+{i}?" for i in range(12)]
    questions[1] = "what is " + "1+" * 12 + "1?"  # ~46 tokens with the template: over the limit of 40
    cfg = load_config(None, [*_dataset(tmp_path, questions), "task.n_eval=3", "task.max_prompt_tokens=40"])
    tok = build_char_tokenizer()
    train, train_ids, held, held_ids = session_module.task_prompts(cfg, tok)
    assert len(train) + len(held) == 11  # the long row is gone from whichever split it fell in
    for prompts, ids in ((train, train_ids), (held, held_ids)):
        assert len(ids) == len(prompts)
        assert all(i == tok(p.text, add_special_tokens=False)["input_ids"] for p, i in zip(prompts, ids))
        assert all(len(i) <= 40 for i in ids)
    assert [p.prompt_id for p in train] == list(range(len(train)))


def test_a_dataset_with_only_n_eval_rows_is_refused_by_name(tmp_path):
    """Holding out n_eval rows of n_eval would leave no training prompt: refused before the run, naming the file."""
    cfg = load_config(None, [*_dataset(tmp_path, ["1+1?", "2+2?", "3+3?"]), "task.n_eval=3"])
    with pytest.raises(InputError, match=r"rows.jsonl has 3 usable rows: too few to hold out task.n_eval=3"):
        session_module.check_task(cfg)
    cfg = load_config(None, [*_dataset(tmp_path, ["1+1?", "2+2?", "3+3?", "4+4?"]), "task.n_eval=3"])
    cfg.task.dataset.max_rows = 3  # the file has 4 rows: the limit, not the file, is what is short
    with pytest.raises(InputError, match=r"rows.jsonl has 3 usable rows \(task.dataset.max_rows=3 read no more\): too"):
        session_module.check_task(cfg)


def test_the_bootstrap_cache_key_depends_on_the_run_seed():
    """v0 is SFT from a model initialised with the run seed: another seed must not reuse a cached v0."""
    a, b = load_config(None, ["run.seed=1"]), load_config(None, ["run.seed=2"])
    assert session_module.bootstrap_key(a) == session_module.bootstrap_key(load_config(None, ["run.seed=1"]))
    assert session_module.bootstrap_key(a) != session_module.bootstrap_key(b)


@pytest.mark.parametrize("mode,decoupled", [("sync", False), ("periodic", False), ("async", True)])
def test_build_trainer_passes_the_configured_settings(mode, decoupled):
    """AdamW gets the configured betas, weight decay and rate; the loss the rollout temperature and clip range; the
    decoupled (off-policy) loss is used in async mode only (sync and periodic are exactly on-policy)."""
    cfg = load_config(
        None,
        [
            f"pipeline.mode={mode}",
            "trainer.beta1=0.8",
            "trainer.beta2=0.95",
            "trainer.weight_decay=0.1",
            "trainer.lr=0.002",
            "rollout.temperature=0.7",
            "algorithm.clip_high=0.28",
            f"train.skip_zero_advantage={mode != 'sync'}",
        ],
    )
    tok = build_char_tokenizer()
    trainer = session_module.build_trainer(cfg, build_tiny_model(len(tok), seed=0, **TINY), tok, torch.device("cpu"))
    group = trainer.optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["lr"]) == ((0.8, 0.95), 0.1, 0.002)
    assert (trainer.loss.temperature, trainer.loss.clip_low, trainer.loss.clip_high) == (0.7, 0.2, 0.28)
    assert trainer.loss.decoupled is decoupled
    assert trainer.loss.skip_zero_advantage is (mode != "sync")


def test_the_trainer_defaults_are_the_config_defaults_and_the_async_settings_arrive():
    """A trainer built without loss settings (`LossSettings()`: tests, benchmarks) trains the configured default
    loss, and an async run's proximal-policy and importance-weight settings reach the trainer as configured."""
    a = load_config(None, []).algorithm
    keys = ["advantage", "loss_agg", "clip_low", "clip_high", "dual_clip", "kl_coef", "kl_kind"]
    keys += ["prox_logp", "is_cap", "is_mode", "is_level"]
    assert {k: getattr(LossSettings(), k) for k in keys} == {k: getattr(a, k) for k in keys}
    overrides = ["algorithm.prox_logp=linear", "algorithm.is_cap=2.5", "algorithm.is_mode=mask"]
    overrides += ["algorithm.is_level=geometric", "algorithm.dual_clip=3.0"]
    cfg = load_config(None, ["pipeline.mode=async", *overrides])
    tok = build_char_tokenizer()
    trainer = session_module.build_trainer(cfg, build_tiny_model(len(tok), seed=0, **TINY), tok, torch.device("cpu"))
    s = trainer.loss
    configured = (True, "linear", 2.5, "mask", "geometric", 3.0)
    assert (s.decoupled, s.prox_logp, s.is_cap, s.is_mode, s.is_level, s.dual_clip) == configured


def _saved(tmp_path, version: int):
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0, **TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(4, 20).repeat(2, 1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    lake = Lake(str(tmp_path / "lake"))
    save_checkpoint(lake, "r", version, model, tok, optimizer=opt)
    return lake, tok, opt


def test_a_recomputing_trainer_resumed_at_v0_has_no_proximal_weights(tmp_path):
    """v0 has no version before it: resuming an async `prox_logp: recompute` run at v0 loads v0 and no proximal
    policy (the first batch's tokens are at most one version behind, which needs none)."""
    lake, tok, _ = _saved(tmp_path, 0)
    trainer = PolicyTrainer(
        build_tiny_model(len(tok), seed=5, **TINY),
        None,
        lr=1e-2,
        loss=LossSettings(decoupled=True, prox_logp="recompute"),
    )
    session_module.restore_trainer(trainer, lake, "r", 0)
    assert trainer.prox_version is None


def test_a_resumed_trainer_continues_with_the_saved_optimizer_moments(tmp_path):
    """Resume restores AdamW's moments and step count of the checkpoint, not a fresh optimizer state."""
    lake, tok, opt = _saved(tmp_path, 1)
    trainer = PolicyTrainer(build_tiny_model(len(tok), seed=5, **TINY), None, lr=1e-2)
    session_module.restore_trainer(trainer, lake, "r", 1)
    saved, restored = opt.state_dict()["state"], trainer.optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys() and len(saved) > 0
    for i in saved:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(saved[i][name]), torch.as_tensor(restored[i][name])), (i, name)


def test_close_ends_the_workers_and_shared_weights_even_when_the_background_write_failed(caplog):
    """The run is failing already: the write's error is logged, not raised over the run's own error, and the
    workers and the shared-memory weights are still released."""
    s = session_module.RunSession(*(None,) * 11, version=0, device=None)
    released: list[str] = []
    s.pool = SimpleNamespace(close=lambda: released.append("workers"))
    s.weights = SimpleNamespace(unlink=lambda: released.append("weights"))
    s.trainer = SimpleNamespace(close=lambda: released.append("trainer"))

    def fail():
        raise OSError("disk full")

    s.save_in_background(3, fail)
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        s.close()
    assert released == ["workers", "trainer", "weights"]
    assert "checkpoint written in the background failed: disk full" in caplog.text


def test_close_releases_the_trainer_weights_and_lease_when_the_workers_fail_to_close():
    s = session_module.RunSession(*(None,) * 11, version=0, device=None)
    released: list[str] = []

    def stuck():
        raise RuntimeError("worker would not exit")

    s.pool = SimpleNamespace(close=stuck)
    s.weights = SimpleNamespace(unlink=lambda: released.append("weights"))
    s.trainer = SimpleNamespace(close=lambda: released.append("trainer"))
    s.lease = SimpleNamespace(release=lambda: released.append("lease"))
    with pytest.raises(RuntimeError, match="worker would not exit"):
        s.close()
    assert released == ["trainer", "weights", "lease"]


def test_close_removes_the_v0_copy_after_the_workers_have_ended(tmp_path):
    copies = tmp_path / "lockstep-v0-x"
    (copies / "v0").mkdir(parents=True)
    s = session_module.RunSession(*(None,) * 11, version=0, device=None)
    s.local_copies = str(copies)
    seen: list[bool] = []
    s.pool = SimpleNamespace(close=lambda: seen.append(copies.exists()))  # a worker may read it until it ends
    s.trainer = SimpleNamespace(close=lambda: None)
    s.close()
    assert seen == [True]
    assert not copies.exists()


@pytest.fixture
def object_store_run(tmp_path, monkeypatch):
    """The config of a run on a memory:// lake (an object store), the temporary folder moved to `tmp_path / "temp"`,
    and the `WorkerSpec`s the session hands its pool."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    specs = []
    real_pool = session_module.WorkerPool

    def pool(n, spec, **kw):
        specs.append(spec)
        return real_pool(n, spec, **kw)

    monkeypatch.setattr(session_module, "WorkerPool", pool)
    uri = f"memory://lockstep-session-{uuid.uuid4().hex}"
    cfg = load_config(
        None,
        [f"lake.uri={uri}", "tracking.enabled=false", "run.run_id=obj", "bootstrap.steps=0", *SMALL],
    )
    yield cfg, temp, specs
    lake = Lake(uri)
    if lake.fs.exists(lake.root):
        lake.fs.rm(lake.root, recursive=True)


def test_a_session_on_an_object_store_keeps_its_v0_copy_only_while_it_is_open(object_store_run):
    """The workers build their engines from a local copy of v0: it is the session's own, and goes when it closes
    (in a cache shared by every run, one copy of each run's v0 stayed in the temporary folder forever); a killed
    run's copy is removed as the next session opens."""
    cfg, temp, specs = object_store_run
    killed_runs_copy = temp / f"lockstep-v0-{dead_pid()}-{scratch.prefix('x').split('-')[3]}-x"
    killed_runs_copy.mkdir()
    s = session_module.open_session(cfg)
    try:
        assert not killed_runs_copy.exists()  # swept as the session opened
        [spec] = specs
        assert os.path.dirname(s.local_copies) == str(temp)
        assert os.path.dirname(spec.model_dir) == s.local_copies
        verify_checkpoint(Lake(s.local_copies), spec.model_dir)
        assert "model.safetensors" in os.listdir(spec.model_dir)
        assert spec.stop_at_newline is True  # the arithmetic task's one-line answers
    finally:
        s.close()
        session_module.unregister(s.run_id)
    assert list(temp.iterdir()) == []


def test_a_session_that_fails_to_open_leaves_no_v0_copy(object_store_run, monkeypatch):
    cfg, temp, specs = object_store_run

    def fail(*args, **kwargs):
        raise OSError("no space left for the shared-memory weights")

    monkeypatch.setattr(session_module, "_open_with_trainer", fail)
    with pytest.raises(OSError, match="no space left"):
        session_module.open_session(cfg)
    assert list(temp.iterdir()) == []


def test_resume_of_a_run_that_does_not_exist_is_refused(tmp_path):
    """`resume` of a run id the lake does not hold fails by name and creates nothing (it must not start a new run)."""
    cfg = load_config(
        None,
        [f"lake.uri={tmp_path / 'lake'}", "tracking.enabled=false", "run.run_id=ghost", "bootstrap.steps=0", *SMALL],
    )
    try:
        s = session_module.open_session(cfg, resume=True)
    except FileNotFoundError as e:
        assert "no run ghost in" in str(e) and "to resume" in str(e)
    else:  # it created the run instead: release what it started before failing
        s.close()
        session_module.unregister(s.run_id)
        pytest.fail("resume of a missing run created it")
    lake = Lake(str(tmp_path / "lake"))
    assert not lake.fs.exists(lake.run_dir("ghost"))


@pytest.mark.parametrize(
    "mode,engine,push,expected",
    [
        ("sync", "builtin", True, True),
        ("periodic", "builtin", True, True),
        ("async", "builtin", True, False),  # async workers load each promoted checkpoint mid-generation
        ("periodic", "vllm", True, False),  # vLLM loads checkpoints
        ("periodic", "builtin", False, False),
    ],
)
def test_weights_are_pushed_through_shared_memory_only_where_workers_can_take_them(mode, engine, push, expected):
    """`pipeline.push_weights` applies to sync / periodic with the builtin engine only."""
    cfg = load_config(None, [f"pipeline.mode={mode}", f"pipeline.push_weights={str(push).lower()}"])
    cfg.rollout.engine = engine  # (a vLLM config also needs a GPU device; only the decision is looked at here)
    assert session_module.pushes_weights(cfg) is expected


def test_held_out_prompts_all_over_the_token_limit_are_refused_before_the_run(tmp_path, caplog):
    """`data.on_bad_row: skip` drops prompts over `task.max_prompt_tokens` with a warning that counts them; when it
    would drop every held-out prompt (an eval file of long questions) the run is refused before it starts, instead
    of dividing by zero at its first evaluation after the bootstrap."""
    long_q = "what is " + "1+" * 15 + "1?"  # ~55 tokens with the template: over the limit of 40
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in [long_q, "1+0?"]))
    overrides = _dataset(tmp_path, [f"{i}+1?" for i in range(10)])
    overrides[2] = f"task.dataset={{uri: {tmp_path / 'rows.jsonl'}, eval_uri: {evals}}}"
    cfg = load_config(None, [*overrides, "task.n_eval=2", "task.max_prompt_tokens=40"])
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        session_module.check_task(cfg)  # a new run's warnings, before its bootstrap (its session does not repeat them)
        train, _, held, _ = session_module.task_prompts(cfg, build_char_tokenizer())
    assert len(train) == 10 and len(held) == 1 and "1+0?" in held[0].text
    skipped = "1 of 2 held-out prompts skipped: longer than task.max_prompt_tokens=40 (e.g. prompt "
    assert caplog.text.count(skipped) == 1
    evals.write_text("".join(json.dumps({"question": long_q, "answer": "#### 1"}) + "\n" for _ in range(2)))
    with pytest.raises(InputError, match=r"^all 2 held-out prompts exceed task.max_prompt_tokens=40 \(e.g. prompt "):
        session_module.check_task(cfg)


def test_answers_longer_than_a_response_may_be_are_warned_of_with_their_count(caplog):
    """`ops: ["*"]` makes answers of up to 4 digits (40 x 40): with responses of 3 tokens, reward 1.0 was out of reach
    for every one of them and nothing said so. Counted per split against its own limit (rollout's for training,
    eval's for held-out), before the run's bootstrap (`check_task`)."""
    over = ['task.ops=["*"]', "task.max_operand=40", "rollout.max_new_tokens=3", "eval.max_new_tokens=4"]
    cfg = load_config(None, over)
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        session_module.check_task(cfg)
    train, _, held, _ = session_module.task_prompts(cfg, build_char_tokenizer())
    long = [p for p in train if len(p.answer) > 3]  # one token per character
    assert 0 < len(long) < len(train) and not any(len(p.answer) > 4 for p in held)
    first = next(p for p in long if len(p.answer) == 4)
    assert [r.getMessage() for r in caplog.records] == [
        f"{len(long)} of {len(train)} training answers are longer than rollout.max_new_tokens=3 tokens (prompt "
        f"{first.prompt_id}'s {first.answer!r}: 4 tokens): no response can hold them, so their reward stays below "
        "1.0; raise rollout.max_new_tokens"
    ]
    cfg = load_config(None, [*over, "rollout.max_new_tokens=4"])
    train, train_ids, held, held_ids = session_module.task_prompts(cfg, build_char_tokenizer())
    assert session_module.unwritable_text(cfg, build_char_tokenizer(), train, train_ids, held, held_ids) == []


def _sentencepiece_like():
    """A Llama-2-style tokenizer (legacy SentencePiece form): a word-start "▁" prepended to every text, spaces as
    "▁", digits one token each; "43" alone is ['▁', '4', '3'], after a prompt ending in a space ['4', '3']."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    for c in "0123456789+-*=?:.,#QAabcdefghijklmnopqrstuvwxyz\n":
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_an_answers_tokens_are_counted_after_its_prompt_not_alone():
    """Alone, a SentencePiece tokenizer gives an answer a word-start token more than the response needs: every
    2-digit answer of the demo was said to be too long for 2 new tokens, though 2 tokens write it (reward 1.0)."""
    from models.arithmetic import reward

    tok = _sentencepiece_like()
    cfg = load_config(None, ["rollout.max_new_tokens=2", "eval.max_new_tokens=2"])
    train, train_ids, held, held_ids = session_module.task_prompts(cfg, tok)
    two = next(p for p in train if len(p.answer) == 2)
    assert len(tok(two.answer, add_special_tokens=False)["input_ids"]) == 3  # alone: '▁' and two digits
    written = tok.decode([tok.convert_tokens_to_ids(c) for c in two.answer])  # the 2 tokens a response would hold
    assert reward(written, two.answer) == 1.0
    assert session_module.unwritable_text(cfg, tok, train, train_ids, held, held_ids) == []
    cfg = load_config(None, ["rollout.max_new_tokens=1", "eval.max_new_tokens=2"])
    notes = session_module.unwritable_text(cfg, tok, train, train_ids, held, held_ids)
    assert len(notes) == 1 and notes[0].startswith(
        f"{sum(len(p.answer) > 1 for p in train)} of {len(train)} training answers are longer than "
        "rollout.max_new_tokens=1 tokens"
    )


def test_text_the_tokenizer_cannot_encode_is_warned_of_in_prompts_and_in_answers(tmp_path):
    """The built-in character tokenizer knows a few letters: a dataset's capitals were <unk> to the model, and an
    answer holding one could never be written. Each is counted, with the characters at fault and what to do."""
    questions = ["what is 1+1?", "What is 2+2?", "Is 3 > 2?", "name 7"]
    path = tmp_path / "rows.jsonl"
    rows = [
        *({"question": q, "answer": "#### 5"} for q in questions[:3]),
        {"question": questions[3], "answer": "#### X7"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    cfg = load_config(
        None, ["task.kind=dataset", "task.n_shots=0", f"task.dataset={{uri: {path}}}", "task.n_eval=2",
               "rollout.prompts_per_iteration=2", "task.reward=math_verify"]
    )  # fmt: skip
    train, train_ids, held, held_ids = session_module.task_prompts(cfg, build_char_tokenizer())
    assert len(train) + len(held) == 12
    with_caps = sum(1 for p in [*train, *held] if any(c in p.text for c in "WI>"))
    assert with_caps == 6  # "What ...", "Is 3 > 2?" (and ">": not in the alphabet either), three times each
    alphabet = "'0123456789+-*=?:. \\nQAabcdefghijklmnopqrstuvwxyz,#'"
    hint = f"the built-in tiny model's character tokenizer knows only {alphabet}: give model.path for other text"
    assert session_module.unwritable_text(cfg, build_char_tokenizer(), train, train_ids, held, held_ids) == [
        f"6 of 12 prompts hold characters the tokenizer encodes as its unknown token ('>', 'I', 'W'): the model "
        f"reads them as <unk>; {hint}",
        f"3 of 12 reference answers hold characters the tokenizer encodes as its unknown token ('X'): no response "
        f"can write them out; {hint}",
    ]
