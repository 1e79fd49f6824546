"""The live state of a run inside the flow's process: trainer, tokenizer, worker pool, tracker, prompts.

Prefect tasks receive only a run id and small values; they find the heavy objects here. The session is
built from the config once (config objects stop at this layer: models/ and storage/ get plain arguments).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING

import torch

from configs.schema import Config, flatten, resolved_json
from models import arithmetic
from models.bootstrap import greedy_answers, sft
from models.rewards import Scorer, reward_function, source_digest
from models.tiny import (
    DEFAULT_ALPHABET,
    build_char_tokenizer,
    build_tiny_model,
    load_hf,
    other_eos_ids,
    single_token_id,
)
from models.trainer import LossSettings, PolicyTrainer
from storage import catalog, checkpoints, lease, scratch
from storage.datasets import DatasetError
from storage.lake import Lake, atomic_write_bytes, move_folder, validate_run_id
from storage.tracking import Tracker
from tasks import preflight
from tasks.preflight import (
    InputError,
    RunExistsError,
    attention_kernel,
    check_backend,
    check_inputs,
    check_reward,
    check_tracking,
    run_exists_error,
)
from tasks.train_ranks import DataParallelTrainer
from tasks.workers import SharedWeights, WorkerPool, WorkerSpec, child_context, model_type, modeling_module

if TYPE_CHECKING:  # the session does not import Prefect; the flow does
    from prefect.futures import PrefectFuture


@dataclass
class RunSession:
    run_id: str
    cfg: Config
    lake: Lake
    tokenizer: object
    trainer: PolicyTrainer
    pool: WorkerPool
    tracker: Tracker
    train_prompts: list[arithmetic.Prompt]
    train_token_ids: list[list[int]]
    eval_prompts: list[arithmetic.Prompt]
    eval_token_ids: list[list[int]]
    version: int
    device: torch.device
    started_at: float = field(default_factory=time.time)
    storage_s: float = 0.0  # storage time on the critical path of the current iteration
    history: list[dict] = field(default_factory=list)
    shard_info: dict[str, dict] = field(default_factory=dict)  # async: generation figures per published shard
    weights: SharedWeights | None = None  # `pipeline.push_weights`: how new versions reach the workers
    lease: lease.RunLease | None = None  # this process writes the run; given back last, when the session closes
    saving: tuple[int, Future] | None = None  # the version whose checkpoint is being written in the background
    held: list = field(default_factory=list)  # background work held back until `release` (callables)
    local_copies: str | None = None  # this session's local copy of an object-store lake's v0, removed at close
    rollouts: list[PrefectFuture] = field(default_factory=list)  # sync/periodic: the iteration's rollout tasks
    catalog_last: int | None = None  # the catalog's last iteration at this session's first write (None: not read)
    scorer: Scorer | None = None  # `task.reward` as loaded at the session's start (a user's file is not re-read)
    _unstarted_save: tuple | None = field(default=None, repr=False)  # (version, fn): a write not started yet
    _saver: ThreadPoolExecutor | None = field(default=None, repr=False)

    def weights_source(self) -> str | SharedWeights:
        """Where the workers load the current version from."""
        return self.weights if self.weights is not None else self.lake.checkpoint_dir(self.run_id, self.version)

    def save_in_background(self, version: int, fn) -> None:
        """Write (and promote) checkpoint v{version} with `fn` on the session's one writer thread, started at the
        next `release` (or `wait_saved`)."""
        self._unstarted_save = (version, fn)

    def hold(self, fn) -> None:
        """Run `fn` (a submission of background work) at the next `release`."""
        self.held.append(fn)

    def release(self) -> None:
        """Start the background work held since the last release: the checkpoint write, then `hold`'s callables.

        The flow calls it once an iteration's rollouts are dispatched, where its own thread only waits for the
        first shard. Started at once, the Python work of those threads (checkpoint serialisation, catalog,
        markdown report) took the GIL from the plan and the promotion, which run on the critical path: the plan
        task's body took 6.4 ms beside them and 2.6 ms alone (demo config, 2 cores)."""
        self._start_save()
        held, self.held = self.held, []
        for fn in held:
            fn()

    def _start_save(self) -> None:
        if self._unstarted_save is None:
            return
        (version, fn), self._unstarted_save = self._unstarted_save, None
        if self._saver is None:
            self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-checkpoint")
        self.saving = (version, self._saver.submit(fn))

    def wait_saved(self, version: int | None = None) -> None:
        """Block until the background checkpoint (of `version` or older; any if None) is promoted, starting it if
        it was held; raise its error."""
        self._start_save()
        pending = self.saving
        if pending is not None and (version is None or pending[0] <= version):
            try:
                pending[1].result()
            finally:  # cleared only once the write has ended (not when a signal cut the wait short): an audit
                if self.saving is pending and pending[1].done():  # task that looks at `saving` meanwhile must
                    self.saving = None  # see the write in flight and wait for it (its ledger record)

    def close(self) -> None:
        try:
            try:
                self.wait_saved()
            except Exception as e:  # the run is failing already; its own error is the one raised
                logging.getLogger("lockstep").warning("checkpoint written in the background failed: %s", e)
            if self._saver is not None:
                self._saver.shutdown(wait=True)
        finally:
            try:
                with contextlib.ExitStack() as release:  # last in, first out; each runs even if one before fails
                    if self.local_copies is not None:  # once no worker reads it
                        release.callback(shutil.rmtree, self.local_copies, ignore_errors=True)
                    if self.weights is not None:
                        release.callback(self.weights.unlink)
                    release.callback(self.trainer.close)  # a data-parallel trainer's other ranks
                    release.callback(self.pool.close)
            finally:  # after the workers: an orphan's shard must not land in a run another process has taken
                if self.lease is not None:
                    self.lease.release()


SESSIONS: dict[str, RunSession] = {}


def session(run_id: str) -> RunSession:
    """The live session of a run. Looked up through `sys.modules` at call time, never through a captured global:
    Prefect's runner (`lockstep serve`) may ship flow and task functions by value (cloudpickle), and each such copy
    would otherwise hold a registry of its own."""
    import importlib

    return importlib.import_module("tasks.session").SESSIONS[run_id]


def register(s: RunSession) -> None:
    import importlib

    importlib.import_module("tasks.session").SESSIONS[s.run_id] = s


def unregister(run_id: str) -> None:
    import importlib

    importlib.import_module("tasks.session").SESSIONS.pop(run_id, None)


def default_run_id(cfg: Config) -> str:
    return cfg.run.run_id or f"{cfg.run.name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"


def task_prompts(cfg: Config, tokenizer, warn: bool = False) -> tuple[list, list, list, list]:
    """(train prompts, their token ids, held-out prompts, their token ids) of the configured task. `warn` logs what
    `data.on_bad_row: skip` dropped and the text the policy cannot read or write (`unwritable_text`): once per start
    of a run, by `check_task` for a new run (before its bootstrap), by the session for a resume."""
    t = cfg.task
    if t.kind == "arithmetic":
        train, held_out = arithmetic.build_splits(t.max_operand, tuple(t.ops), t.n_eval, t.split_seed)
        train_prompts = arithmetic.make_train_prompts(train, t.n_shots, t.split_seed, t.shot_sets)
        eval_prompts = arithmetic.make_prompts(held_out, train, t.n_shots, t.split_seed + 1)
    else:
        train_prompts, eval_prompts = _dataset_prompts(cfg, warn)

    def encode(prompts, name):
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        keep = [len(i) <= t.max_prompt_tokens for i in ids]
        if not all(keep):
            first = prompts[keep.index(False)].prompt_id
            if t.kind == "arithmetic" or cfg.data.on_bad_row == "fail":
                raise ValueError(
                    f"{keep.count(False)} {name} prompts exceed task.max_prompt_tokens="
                    f"{t.max_prompt_tokens} (e.g. prompt {first}); shorten them or raise the limit"
                )
            if not any(keep):
                raise ValueError(
                    f"all {len(keep)} {name} prompts exceed task.max_prompt_tokens={t.max_prompt_tokens} "
                    f"(e.g. prompt {first}); shorten them or raise the limit"
                )
            if warn:
                logging.getLogger("lockstep").warning(
                    "%d of %d %s prompts skipped: longer than task.max_prompt_tokens=%d (e.g. prompt %s)",
                    keep.count(False),
                    len(keep),
                    name,
                    t.max_prompt_tokens,
                    first,
                )
            prompts = [p for p, k in zip(prompts, keep) if k]
            ids = [i for i, k in zip(ids, keep) if k]
        return prompts, ids

    train_prompts, train_ids = encode(train_prompts, "training")
    eval_prompts, eval_ids = encode(eval_prompts, "held-out")
    if warn:
        for note in unwritable_text(cfg, tokenizer, train_prompts, train_ids, eval_prompts, eval_ids):
            logging.getLogger("lockstep").warning(note)
    # worker-side prompt ids index the training list
    train_prompts = [arithmetic.Prompt(i, p.text, p.answer, p.extra) for i, p in enumerate(train_prompts)]
    return train_prompts, train_ids, eval_prompts, eval_ids


def unwritable_text(
    cfg: Config, tokenizer, train_prompts: list, train_ids: list, eval_prompts: list, eval_ids: list
) -> list[str]:
    """Warnings, one line each, of text the policy cannot read or write: characters the tokenizer encodes as its
    unknown token (the built-in character tokenizer knows a few letters: a dataset's capitals were <unk>), in the
    prompts or in the reference answers (which no response can then write out), and answers longer in tokens than a
    response may be (`ops: ["*"]` with max_operand 1000 has 7-digit answers, max_new_tokens 6). Either way a
    reward of 1.0 is out of reach for those prompts under the built-in rewards, and nothing said so (a user's
    function may take another form: the notes say what cannot be written, not how it scores). An answer's tokens
    are counted after its prompt (prompt + answer less the prompt's ids, `*_ids`): alone, a SentencePiece tokenizer
    gives it a word-start token more."""
    notes = []
    everything = [*train_prompts, *eval_prompts]
    unk = tokenizer.unk_token_id
    if unk is not None:
        chars = {c for p in everything for c in p.text + p.answer}
        unknown = {c for c in chars if unk in tokenizer(c, add_special_tokens=False)["input_ids"]}
        hint = (
            f"the built-in tiny model's character tokenizer knows only {DEFAULT_ALPHABET!r}: give model.path for "
            "other text"
            if not cfg.model.path
            else "use a model whose tokenizer covers the dataset's text"
        )
        for what, field, effect in (
            ("prompts", "text", "the model reads them as <unk>"),
            ("reference answers", "answer", "no response can write them out"),
        ):
            found = [unknown & set(getattr(p, field)) for p in everything]
            if any(found):
                seen = sorted(set().union(*found))
                shown = ", ".join(repr(c) for c in seen[:8]) + (", ..." if len(seen) > 8 else "")
                notes.append(
                    f"{sum(map(bool, found))} of {len(everything)} {what} hold characters the tokenizer encodes as "
                    f"its unknown token ({shown}): {effect}; {hint}"
                )
    too_long = {
        "arithmetic": "no response can hold them, so their reward stays below 1.0",
        "math_verify": "a response cannot write them out as given (math_verify also takes an equivalent form, which "
        "may be shorter)",
    }.get(cfg.task.reward, "a response cannot write them out as given (task.reward's function may take another form)")
    for prompts, alone, name, field, limit in (
        (train_prompts, train_ids, "training", "rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        (eval_prompts, eval_ids, "held-out", "eval.max_new_tokens", cfg.eval.max_new_tokens),
    ):
        after = tokenizer([p.text + p.answer for p in prompts], add_special_tokens=False)["input_ids"]
        over = [(len(b) - len(a), p) for a, b, p in zip(alone, after, prompts, strict=True) if len(b) - len(a) > limit]
        if over:
            n, p = max(over, key=lambda x: x[0])
            notes.append(
                f"{len(over)} of {len(prompts)} {name} answers are longer than {field}={limit} tokens (prompt "
                f"{p.prompt_id}'s {p.answer!r}: {n} tokens): {too_long}; raise {field}"
            )
    return notes


def check_task(cfg: Config) -> None:
    """The task's prompts build, fit `task.max_prompt_tokens` and fill a batch; raises `InputError`. Run before the
    run exists: a dataset's usable rows are known only once read, and this is where a too-large batch used to fail,
    after the bootstrap's SFT. The tokenizer is v0's (the bootstrap trains weights only), built or read cheaply.
    Logs `task_prompts`'s warnings: a new run's, before its bootstrap's minutes."""
    if cfg.model.path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    else:
        tokenizer = build_char_tokenizer()
    try:
        train_prompts, train_ids, _, eval_ids = task_prompts(cfg, tokenizer, warn=True)
        iteration_prompt_ids(cfg, len(train_prompts), 0)
    except DatasetError:  # already names the file, the row and what to do
        raise
    except ValueError as e:
        raise InputError(str(e)) from None
    if cfg.model.path:
        _check_positions(cfg, max(len(i) for i in [*train_ids, *eval_ids]))


def _check_positions(cfg: Config, longest: int) -> None:
    """The longest prompt and its response fit a table of learned positions (GPT-2's n_positions, OPT's
    max_position_embeddings): past it the first evaluation failed with an IndexError, after the run was written.
    A rotary model (its config has rope parameters) runs past max_position_embeddings, scaled by rope_scaling or
    not: that is a choice of the model's, not checked here."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model.path)
    if any(getattr(config, name, None) for name in ("rope_parameters", "rope_scaling", "rope_theta")):
        return
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    new = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if isinstance(positions, int) and longest + new > positions:
        raise InputError(
            f"model.path {cfg.model.path!r} takes {positions} positions, but the longest prompt has {longest} "
            f"tokens and a response up to {new} (rollout / eval max_new_tokens): shorten the prompts (task.n_shots, "
            "task.max_prompt_tokens) or the responses, or use a model with more positions"
        )


def _dataset_prompts(cfg: Config, warn: bool) -> tuple[list, list]:
    import random

    from storage.datasets import load_prompts

    d = cfg.task.dataset
    common = dict(
        question_field=d.question_field,
        answer_field=d.answer_field,
        template=d.template,
        on_bad_row=cfg.data.on_bad_row,
        max_prompt_chars=cfg.task.max_prompt_tokens * 8,
        extra_fields=tuple(d.extra_fields),
    )  # a cheap pre-filter; tokens are checked after
    rows, report = load_prompts(d.uri, fmt=d.format, split=d.split, limit=d.max_rows, **common)
    if report.skipped and warn:
        logging.getLogger("lockstep").warning("%s (e.g. %s)", report.summary(), "; ".join(report.examples[:3]))
    if d.eval_uri:
        held, _ = load_prompts(d.eval_uri, fmt=d.format, split=d.eval_split, limit=cfg.task.n_eval, **common)
    else:
        if len(rows) <= cfg.task.n_eval:
            cut = f" (task.dataset.max_rows={d.max_rows} read no more)" if len(rows) == d.max_rows else ""
            raise ValueError(
                f"{d.uri} has {len(rows)} usable rows{cut}: too few to hold out task.n_eval="
                f"{cfg.task.n_eval}; lower it or give task.dataset.eval_uri"
            )
        order = list(range(len(rows)))
        random.Random(cfg.task.split_seed).shuffle(order)
        held = [rows[i] for i in order[: cfg.task.n_eval]]
        rows = [rows[i] for i in sorted(order[cfg.task.n_eval :])]
    to_prompt = lambda r: arithmetic.Prompt(r.prompt_id, r.text, r.answer, r.extra)  # noqa: E731
    return [to_prompt(r) for r in rows], [to_prompt(r) for r in held]


def bootstrap_key(cfg: Config) -> str:
    # fields added after v0s were cached are left out where v0 does not depend on them, so that a run from before them
    # finds its v0 on resume: a reward's time limit or batched form (the same scores, called otherwise) never changes
    # v0; extra fields do once listed (the rows kept, the target-accuracy check's scores)
    task = cfg.task.model_dump(mode="json", exclude={"reward_timeout_s", "reward_batch"})
    if task["dataset"] is not None and not task["dataset"]["extra_fields"]:
        del task["dataset"]["extra_fields"]
    key = {
        "model": cfg.model.model_dump(mode="json"),
        "task": task,
        "bootstrap": cfg.bootstrap.model_dump(mode="json"),
        "seed": cfg.run.seed,
        "alphabet": DEFAULT_ALPHABET,
        "format": 2,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def bootstrap_v0(cfg: Config, lake: Lake, on_progress=None) -> tuple[str, bool]:
    """The initial policy v0 as an HF directory in the lake (`bootstrap/{key}`); built once, then reused.

    On an object store each builder writes its own `bootstrap/{key}/{writer}/` (two runs that start together
    would otherwise upload over each other's files, with no rename to settle it) and the first complete one by
    name serves later runs."""
    final = f"{lake.root}/bootstrap/{bootstrap_key(cfg)}"
    built = _built_bootstrap(lake, final)
    if built is not None:
        checkpoints.verify_checkpoint(lake, built)
        return built, True
    if cfg.model.path:
        model, tokenizer = load_hf(cfg.model.path)
    else:
        tokenizer = build_char_tokenizer()
        m = cfg.model.tiny
        model = build_tiny_model(
            len(tokenizer),
            **m.model_dump(),  # the fields of model.tiny are build_tiny_model's own
            seed=cfg.run.seed,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    train_prompts, train_ids, _, _ = task_prompts(cfg, tokenizer)
    # each answer ends as the task's responses do: at a newline (one-line answers), else at EOS
    end, stop = ("\n", []) if cfg.task.newline_stop() else ("", [tokenizer.eos_token_id])
    seqs = [tokenizer(p.text + p.answer + end, add_special_tokens=False)["input_ids"] + stop for p in train_prompts]
    b = cfg.bootstrap
    stop_when = None
    if b.target_accuracy is not None:  # checked on training prompts: the held-out split stays unseen
        check = list(range(min(b.check_prompts, len(train_prompts))))
        # loaded once: an edit of a user's file mid-bootstrap is not seen
        scorer = reward_function(**cfg.task.reward_settings())

        def stop_when(step: int) -> bool:
            acc = accuracy(
                model,
                tokenizer,
                [train_ids[i] for i in check],
                [train_prompts[i] for i in check],
                cfg.eval.max_new_tokens,
                scorer,
                cfg.task.newline_stop(),
            )
            return acc >= b.target_accuracy

    with torch.random.fork_rng():
        torch.manual_seed(cfg.run.seed)
        stats = sft(
            model,
            seqs,
            steps=b.steps,
            batch_size=b.batch_size,
            lr=b.lr,
            seed=cfg.run.seed,
            pad_token_id=tokenizer.pad_token_id,
            on_progress=on_progress,
            stop_when=stop_when,
            check_every=b.check_every,
        )
    if lake.is_object_store:
        final = f"{final}/{uuid.uuid4().hex}"
    # another run with the same key may have built it meanwhile and be loading it: keep that one
    checkpoints.save_model_dir(
        lake,
        final,
        f"{lake.root}/_tmp/bootstrap-{bootstrap_key(cfg)}-{time.time_ns()}",
        model,
        tokenizer,
        extra_state={"bootstrap": stats},
        keep_existing=True,
    )
    return final, False


def _built_bootstrap(lake: Lake, folder: str) -> str | None:
    """The complete bootstrap of `folder` if there is one: the folder itself, or on an object store its first
    writer's folder (by name) that has its MANIFEST.json."""
    if not lake.is_object_store:
        return folder if lake.fs.exists(f"{folder}/MANIFEST.json") else None
    lake.fs.invalidate_cache(folder)
    done = sorted(p.rsplit("/", 1)[0] for p in lake.fs.glob(f"{folder}/*/MANIFEST.json"))
    return done[0] if done else None


def accuracy(
    model,
    tok,
    token_ids: list[list[int]],
    prompts: list[arithmetic.Prompt],
    max_new_tokens: int,
    reward: Scorer | None = None,
    stop_at_newline: bool = True,
) -> float:
    """Fraction of greedy answers the task's reward (its scorer, loaded once by the caller with the task's reward
    settings; None: arithmetic) scores as correct, a reward of at least 1.0 (exact match for arithmetic); an answer
    ends at EOS, and at a newline token with `stop_at_newline`."""
    was_training = model.training
    outs = greedy_answers(
        model,
        token_ids,
        max_new_tokens=max_new_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        stop_token_id=single_token_id(tok, "\n") if stop_at_newline else None,
        other_eos_ids=other_eos_ids(getattr(model, "generation_config", None), tok),
    )
    model.train(was_training)
    score = reward or reward_function("arithmetic")
    rewards = score.many(  # one call of a batched function for all the answers
        [tok.decode(o, skip_special_tokens=True) for o in outs],
        [p.answer for p in prompts],
        [p.text for p in prompts],
        [p.extra for p in prompts],
    )
    return sum(r >= 1.0 for r in rewards) / len(prompts)


def evaluate(session: RunSession) -> float:
    """Held-out accuracy: the fraction of greedy answers with full reward (exact match for arithmetic)."""
    return accuracy(
        session.trainer.model,
        session.tokenizer,
        session.eval_token_ids,
        session.eval_prompts,
        session.cfg.eval.max_new_tokens,
        session.scorer or reward_function(**session.cfg.task.reward_settings()),
        session.cfg.task.newline_stop(),
    )


def loss_settings(cfg: Config) -> LossSettings:
    """The trainer's loss settings of a config, as plain values (models/ never sees a Config)."""
    a = cfg.algorithm
    overlong = (
        None if a.overlong_buffer is None else (cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    )
    return LossSettings(
        advantage=a.advantage,
        loss_agg=a.loss_agg,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_kind,
        temperature=cfg.rollout.temperature,
        norm_len=cfg.rollout.max_new_tokens,
        decoupled=cfg.pipeline.mode == "async",
        prox_logp=a.prox_logp,
        is_cap=a.is_cap,
        is_mode=a.is_mode,
        is_level=a.is_level,
        skip_zero_advantage=cfg.train.skip_zero_advantage,
        overlong=overlong,
    )


def build_trainer(cfg: Config, model, tokenizer, device: torch.device) -> PolicyTrainer:
    """The trainer of a config: the loss settings unpacked into plain arguments (models/ never sees a Config)."""
    model.set_attn_implementation(attention_kernel(cfg.train.attention, device))
    ref_model = copy.deepcopy(model).requires_grad_(False).to(device) if cfg.algorithm.kl_coef > 0 else None
    ranks = cfg.resources.train_ranks
    make = (
        partial(
            DataParallelTrainer,
            ranks=ranks,
            threads=cfg.resources.train_threads,
            shard_optimizer=cfg.resources.shard_optimizer,
        )
        if ranks > 1
        else PolicyTrainer
    )
    return make(
        model.to(device),
        ref_model,
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        betas=(cfg.trainer.beta1, cfg.trainer.beta2),
        grad_clip=cfg.trainer.grad_clip,
        loss=loss_settings(cfg),
        pad_token_id=tokenizer.pad_token_id,
        shared_prompt=cfg.train.shared_prompt,
        keep_dropout=not cfg.trainer.disable_dropout,
        activation_checkpointing=cfg.train.activation_checkpointing,
        logits_chunk_tokens=cfg.train.logits_chunk_tokens,
    )


MAX_DEFAULT_ID_TRIES = 100


def open_session(cfg: Config, on_progress=None, resume: bool = False, on_run_id=None) -> RunSession:
    """Create the run (or reopen it with `resume`): frozen config, v0, trainer, rollout workers, MLflow run.

    Without `run.run_id` the run is named `{run.name}-{UTC time to the second}`, with `-2`, `-3`, ... added where a
    run of that name exists or is being created (two runs started in the same second: a cron and a click, two
    clicks); `on_run_id` hears the run's id once it is the run's own (its lease held), before the bootstrap."""
    auto_id = cfg.run.run_id is None and not resume
    base_id = validate_run_id(default_run_id(cfg))
    device = check_backend(cfg)  # before any work: the device exists, the optional extras are installed
    scorer = check_reward(cfg, resumed=resume)  # a user's reward function imports and takes (response, answer)
    cfg = cfg.model_copy(deep=True)
    lake = Lake(cfg.lake.uri)
    torch.set_num_threads(cfg.resources.train_threads)
    check_tracking(cfg)  # before the run is written and the bootstrap's minutes are spent
    if resume and not lake.fs.exists(lake.config_file(base_id)):
        raise FileNotFoundError(
            f"no run {base_id} in {cfg.lake.uri} to resume ({lake.config_file(base_id)} is missing)"
        )
    if not resume:
        # a run.run_id the lake has: refused as the CLI refuses it (looked up when called: a test that patches the
        # CLI's look to reach the decision under the lease may be the one that first imports this module)
        preflight.check_run_free(cfg, resume)
        check_inputs(cfg)  # a model or dataset that cannot be read fails here, before the run exists
        check_task(cfg)
    candidates = (base_id if n == 1 else f"{base_id}-{n}" for n in range(1, MAX_DEFAULT_ID_TRIES + 1))
    for run_id in map(validate_run_id, candidates) if auto_id else [base_id]:
        if auto_id and lake.fs.exists(lake.config_file(run_id)):
            continue
        try:
            held = lease.acquire(lake, run_id, "resume" if resume else "train")  # before anything of it is touched
        except lease.RunInUseError:
            if auto_id:  # another run of the same second is being created under this name
                continue
            raise
        if resume or not lake.fs.exists(lake.config_file(run_id)):
            break
        held.release()  # a `lockstep train` of the same run id ended while this one checked
        if not auto_id:
            raise run_exists_error(cfg, run_id, lake, ask_holder=False)
    else:
        raise RunExistsError(
            f"runs {base_id} to {run_id} all exist in {cfg.lake.uri}: set run.run_id, or another run.name"
        )
    cfg.run.run_id = run_id
    try:
        if on_run_id is not None:
            on_run_id(run_id)
        session = _open_held(cfg, lake, run_id, device, resume, on_progress)
    except BaseException:
        held.release()
        raise
    session.lease = held
    session.scorer = scorer
    register(session)
    return session


def _open_held(cfg: Config, lake: Lake, run_id: str, device: torch.device, resume: bool, on_progress) -> RunSession:
    """`open_session` once the run's lease is held: nobody else writes the run from here."""
    # the fork server that starts the rollout workers (and trainer ranks) imports torch and the model's code meanwhile
    policy_type = cfg.model.tiny.arch if cfg.model.path is None else model_type(cfg.model.path)
    child_context(modeling_module(policy_type), fork_server=cfg.rollout.engine != "vllm")
    if resume:
        tmp_dir = f"{lake.run_dir(run_id)}/_tmp"
        if lake.fs.exists(tmp_dir):  # leftovers of writes cut short by the crash; never read by anyone
            lake.fs.rm(tmp_dir, recursive=True)
    else:
        atomic_write_bytes(lake, run_id, lake.config_file(run_id), resolved_json(cfg).encode())
    run_key = hashlib.sha256(lake.fs.cat_file(lake.config_file(run_id))).hexdigest()  # of the config frozen at start

    torch.set_num_threads(os.cpu_count() or 1)  # no rollout worker runs yet: the bootstrap may use every core
    v0_dir, cached = bootstrap_v0(cfg, lake, on_progress)
    torch.set_num_threads(cfg.resources.train_threads)
    # an object-store lake's v0 is copied into a folder of this session's own (the workers build their engines
    # from it), removed when the session closes: a shared cache would keep one copy per run forever
    scratch.remove_orphans()  # killed runs' copies
    with contextlib.ExitStack() as undo:  # a failure from here gives back what was made, last first
        copies = None if lake.is_local else tempfile.mkdtemp(prefix=scratch.prefix("v0"))
        if copies:
            undo.callback(shutil.rmtree, copies, ignore_errors=True)
        local_v0 = checkpoints.local_copy(lake, v0_dir, copies) if copies else v0_dir
        model, tokenizer = load_hf(local_v0)
        torch.manual_seed(cfg.run.seed)
        version = checkpoints.promoted_version(lake, run_id)
        trainer = build_trainer(cfg, model, tokenizer, device)
        undo.callback(trainer.close)  # a data-parallel trainer's other ranks
        session = _open_with_trainer(
            cfg, lake, run_id, device, version, trainer, tokenizer, local_v0, cached, resume=resume, run_key=run_key
        )
        undo.pop_all()  # opened: the session closes them
    session.local_copies = copies
    return session


def _open_with_trainer(
    cfg, lake, run_id, device, version, trainer, tokenizer, local_v0, cached, *, resume: bool, run_key: str
) -> RunSession:
    """The session of a run whose v0 is loaded into `trainer`; `run_key` tells its MLflow run from another of the
    same name (`Tracker.start`)."""
    if version is None:
        checkpoints.save_checkpoint(
            lake, run_id, 0, trainer.model, tokenizer, trainer.optimizer, {"bootstrap_cached": cached}
        )
        checkpoints.promote(lake, run_id, 0)
        version = 0
    else:  # reopen: continue from the promoted checkpoint with its optimizer and RNG state
        checkpoints.verify_checkpoint(lake, lake.checkpoint_dir(run_id, version))  # a file damaged since its
        # promotion (a disk fault, a hand edit) is named here instead of being trained on
        restore_trainer(trainer, lake, run_id, version)
        set_aside_unpromoted_rollouts(lake, run_id, version)

    # a new run's were said by `check_task`, before the bootstrap; a resume's are said here
    train_prompts, train_ids, eval_prompts, eval_ids = task_prompts(cfg, tokenizer, warn=resume)
    iteration_prompt_ids(cfg, len(train_prompts), 0)  # refuses a batch larger than the training set
    spec = WorkerSpec(
        lake_uri=cfg.lake.uri,
        run_id=run_id,
        model_dir=local_v0,
        threads=cfg.resources.rollout_threads,
        run_seed=cfg.run.seed,
        group_size=cfg.rollout.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        partial_credit=cfg.task.partial_credit,
        reward_kind=cfg.task.reward,
        compression=cfg.lake.compression,
        engine=cfg.rollout.engine,
        stop_at_newline=cfg.task.newline_stop(),
        vllm={
            "dtype": cfg.rollout.vllm_dtype,
            "gpu_memory_utilization": cfg.rollout.vllm_gpu_memory_utilization,
            "max_model_len": cfg.rollout.vllm_max_model_len,
        },
        prompts=[(p.prompt_id, p.text, p.answer, i, p.extra) for p, i in zip(train_prompts, train_ids)],
        reward_fields=cfg.task.reward_fields(),
        reward_timeout_s=cfg.task.reward_timeout_s,
        reward_batch=cfg.task.reward_batch,
        overlap_scoring=cfg.pipeline.overlap_scoring,
    )
    with contextlib.ExitStack() as undo:  # a failure from here (MLflow unreachable, no shared memory) must not leave
        # the workers, an MLflow run marked running or a shared-memory file behind
        pool = WorkerPool(cfg.resources.rollout_workers, spec, wait_ready=False)  # starts while MLflow and v0's eval do
        undo.callback(pool.close)
        if cfg.tracking.enabled:
            tracker = Tracker.start(
                cfg.tracking.uri,
                cfg.tracking.experiment or cfg.run.name,
                run_id,
                tags={"lockstep.mode": cfg.pipeline.mode},
                resume=resume,
                run_key=run_key,
            )
            undo.callback(tracker.finish, "FAILED")
            # which code scored the run: a resume whose reward file changed keeps the first start's digest as the
            # param and the new one as the tag lockstep.resumed.task.reward_sha256 (`log_params`)
            digest = source_digest(cfg.task.reward)
            tracker.log_params({**flatten(cfg), **({"task.reward_sha256": digest} if digest else {})})
        else:
            tracker = Tracker.disabled()
        session = RunSession(
            run_id,
            cfg,
            lake,
            tokenizer,
            trainer,
            pool,
            tracker,
            train_prompts,
            train_ids,
            eval_prompts,
            eval_ids,
            version,
            device,
        )
        if cfg.pipeline.catalog and catalog.catalog_uri(lake, run_id) is not None:
            session.hold(catalog.import_in_background)  # at the first iteration's release, as its rollouts start
        if pushes_weights(cfg):
            session.weights = SharedWeights.create(trainer.model)
            undo.callback(session.weights.unlink)
            session.weights.write(trainer.model)  # the version the run starts from
        undo.pop_all()  # opened: from here the flow's `finally` closes the session
    return session


def restore_trainer(trainer: PolicyTrainer, lake: Lake, run_id: str, version: int) -> None:
    """Continue from checkpoint v{version}: its weights, optimizer and RNG state; and where the decoupled loss
    recomputes its proximal policy (async, `prox_logp: recompute | metrics`), the weights of v{version - 1} as that
    policy (the trainer keeps them itself from one optimizer step to the next)."""
    path = lake.checkpoint_dir(run_id, version)
    checkpoints.load_into(trainer.model, checkpoints.load_weights(lake, path))
    checkpoints.load_trainer_state(lake, path, trainer.optimizer)
    if trainer.prox_model is not None and version > 0:
        previous = checkpoints.load_weights(lake, lake.checkpoint_dir(run_id, version - 1))
        checkpoints.load_into(trainer.prox_model, previous)
        trainer.prox_version = version - 1


def pushes_weights(cfg: Config) -> bool:
    """Whether new versions reach the workers through shared memory (checkpoints then written off the critical
    path): sync / periodic only (async workers load mid-generation) and the builtin engine only (vLLM loads
    checkpoints)."""
    return cfg.pipeline.push_weights and cfg.pipeline.mode != "async" and cfg.rollout.engine == "builtin"


def set_aside_unpromoted_rollouts(lake: Lake, run_id: str, promoted: int) -> list[str]:
    """Move rollouts generated by versions newer than the promoted one to `quarantine/`: such a version was pushed
    to the workers but its checkpoint never became durable (a crash while it was written in the background),
    so resume retrains it and its samples would no longer be exactly on-policy. Returns the moved folders."""
    fs = lake.fs
    root = f"{lake.run_dir(run_id)}/rollouts"
    fs.invalidate_cache(root)
    moved = []
    if not fs.exists(root):
        return moved
    aside = None
    for folder in fs.ls(root, detail=False):
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("policy_version=") and int(name.split("=", 1)[1]) > promoted:
            aside = aside or lake.quarantine_dir(run_id, "unpromoted")
            dest = f"{aside}/{name}"
            lake.makedirs(aside)
            move_folder(lake, folder, dest)
            moved.append(dest)
    return moved


def iteration_prompt_ids(cfg: Config, n_train: int, iteration: int) -> list[int]:
    """The batch of iteration k: slot k mod E of epoch k // E, where an epoch is a permutation of the train prompts
    seeded by (run seed, epoch) cut into E = n_train // B whole batches (the n_train mod B prompts left over are
    skipped in that epoch, different ones each epoch). So a batch never holds a prompt twice: a group is
    identified by (iteration, prompt), and two copies would have the same seeds, hence the same samples."""
    import random

    B = cfg.rollout.prompts_per_iteration
    if B > n_train:
        raise ValueError(
            f"rollout.prompts_per_iteration={B} exceeds the {n_train} training prompts: lower it or add prompts"
        )
    epoch, slot = divmod(iteration, n_train // B)
    perm = list(range(n_train))
    random.Random(cfg.run.seed * 7919 + epoch).shuffle(perm)
    return perm[slot * B : (slot + 1) * B]


def refill_prompt_ids(n_train: int, seed: int, iteration: int, round_: int, taken: list[int], count: int) -> list[int]:
    """Round `round_` (1, 2, ...) of iteration k's dynamic sampling (`algorithm.dynamic_sampling`): `count` training
    prompts not in `taken` (the iteration's earlier rounds: a batch never holds a prompt twice), drawn at random,
    seeded by (run seed, k, round); fewer where fewer are left. Round 0 is `iteration_prompt_ids`, as without
    dynamic sampling, so the epochs' batches stay what they were."""
    import random

    left = sorted(set(range(n_train)).difference(taken))
    rng = random.Random(f"refill-{seed}-{iteration}-{round_}")
    return rng.sample(left, min(count, len(left)))
