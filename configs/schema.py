"""Experiment configuration: pydantic v2 models, one per section; every field documented and bounded.

A bad config fails at load, before any work, with the file, the field's dotted path and the reason
(`ConfigError`); the CLI turns that into exit code 2 without a traceback. Unknown keys are refused.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import typing
from collections.abc import Callable
from pathlib import Path
from types import NoneType
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


def _flat_types(annotation: Any) -> set:
    """The types an annotation admits, unions and Optional flattened (`float | None` -> {float, NoneType})."""
    args = typing.get_args(annotation)
    if not args or typing.get_origin(annotation) in (Literal, list, dict, tuple):
        return {typing.get_origin(annotation) or annotation}
    return set().union(*(_flat_types(a) for a in args))


class _Section(BaseModel):
    # allow_inf_nan: an infinite lr, clip or KL coefficient is never meant (NaN fails the bounds anyway)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers_and_empty_sections(cls, value: Any, info: ValidationInfo) -> Any:
        types = _flat_types(cls.model_fields[info.field_name].annotation)
        # pydantic reads true as 1 for int and float fields: `-o trainer.lr=true` would train at lr 1.0
        if isinstance(value, bool) and bool not in types and types & {int, float}:
            raise ValueError("Input should be a number, not a boolean")
        # YAML 1.1 reads 1e-5 and 1e3 as strings; a number field takes the number a user means, a string
        # field (run.run_id=1e3) keeps the string
        if isinstance(value, str) and str not in types and types & {int, float}:
            for number in (int, float) if int in types else (float,):  # "12345678901234567" stays exact
                try:
                    return number(value)
                except ValueError:
                    pass
            return value
        # a section whose every field is commented out reads as null in YAML: it means the defaults
        if (
            value is None
            and NoneType not in types
            and any(isinstance(t, type) and issubclass(t, _Section) for t in types)
        ):
            return {}
        return value


_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # storage.lake.RUN_ID_RE's


class RunSection(_Section):
    name: str = Field(
        "lockstep",
        min_length=1,
        max_length=64,
        pattern=_NAME_PATTERN,
        description="Experiment name: the MLflow experiment and the prefix of generated run ids.",
    )
    run_id: str | None = Field(
        None,
        pattern=_RUN_ID_PATTERN,
        description="Run id; default `{name}-{UTC timestamp}`. Letters, digits, . _ - only.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,
        description="Run seed: model init, shots, and every sample's seed "
        "derive from it (at most 2**32 - 1: numpy's seed range, which vLLM seeds).",
    )
    iterations: int = Field(40, ge=1, le=100_000, description="RL iterations (optimizer steps) to run.")

    @field_validator("run_id")
    @classmethod
    def _no_parent_step(cls, v: str | None) -> str | None:
        if v is not None and ".." in v:  # storage.lake.validate_run_id's rule, which the pattern cannot say
            raise ValueError("'..' is not allowed in run ids, which name folders of the lake")
        return v


class LakeSection(_Section):
    uri: str = Field("./lake", min_length=1, description="fsspec URL of the lake: a path, file://, s3://, memory://…")
    compression: Literal["zstd", "lz4"] | None = Field(None, description="Arrow IPC compression of shards.")
    keep_optimizer_state: int = Field(
        2,
        ge=0,
        description="Keep the optimizer state (2/3 of a checkpoint with "
        "AdamW) of the newest N versions only; older versions keep weights, tokenizer and RNG state, enough for "
        "export, replay and audit (0: keep every version's).",
    )


class TinyModelSection(_Section):
    arch: Literal["qwen2", "llama"] = Field("qwen2", description="Architecture of the locally built tiny model.")
    hidden_size: int = Field(128, ge=8, le=8192, description="Hidden size.")
    num_layers: int = Field(4, ge=1, le=64, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, le=128, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, le=128, description="Key/value heads (GQA); must divide num_heads.")
    intermediate_size: int = Field(384, ge=8, le=65536, description="MLP width.")

    @model_validator(mode="after")
    def _heads(self):
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads}), and "
                f"num_heads must divide hidden_size ({self.hidden_size})"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim % 2:  # rotary embeddings rotate pairs of dimensions
            raise ValueError(
                f"head_dim = hidden_size / num_heads = {self.hidden_size} / {self.num_heads} = "
                f"{head_dim} must be even (rotary embeddings); change hidden_size or num_heads"
            )
        return self


class ModelSection(_Section):
    path: str | None = Field(
        None,
        min_length=1,
        description="A local Hugging Face directory or hub id loaded with "
        "from_pretrained; null builds the tiny model below with a character tokenizer.",
    )
    tiny: TinyModelSection = Field(default_factory=TinyModelSection, description="The locally built model.")


class DatasetSection(_Section):
    uri: str = Field(..., min_length=1, description="JSONL or Parquet at any fsspec URL, or a Hugging Face dataset id.")
    format: Literal["auto", "jsonl", "parquet", "hf"] = Field("auto", description="auto: by file extension.")
    split: str = Field("train", min_length=1, description="Split, for Hugging Face datasets.")
    eval_uri: str | None = Field(None, description="Held-out prompts; default: task.n_eval rows held out of `uri`.")
    eval_split: str = Field("test", min_length=1, description="Split of eval_uri, for Hugging Face datasets.")
    question_field: str = Field("question", min_length=1, description="Field holding the question.")
    answer_field: str = Field(
        "answer", min_length=1, description="Field holding the answer (GSM8K `... #### n` accepted)."
    )
    template: str = Field("Question: {question}\nAnswer: ", description="Prompt text; `{question}` is replaced.")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many usable rows.")
    extra_fields: list[str] = Field(
        default_factory=list,
        description="More fields of each row that your own task.reward receives as keyword arguments of the same "
        "names, as read (e.g. a list of test cases, a problem's metadata); a row without one is a bad row "
        "(data.on_bad_row).",
    )

    @field_validator("extra_fields")
    @classmethod
    def _extra_fields(cls, names: list[str]) -> list[str]:
        from models.rewards import RESERVED

        for name in names:
            if not name:
                raise ValueError("an empty field name: give each field's name as the rows spell it")
            if name in RESERVED:
                raise ValueError(
                    f"{name!r} is the name of an argument task.reward already receives ({', '.join(RESERVED)}): "
                    "rename the field in the data"
                )
        if len(set(names)) < len(names):
            raise ValueError(f"{names} lists a field twice: give each once")
        return names

    @field_validator("template")
    @classmethod
    def _template(cls, template: str) -> str:
        try:
            ok = template.format(question="\0") != template.format(question="")
        except KeyError as e:  # {answer}: a field the template may not name
            raise ValueError(
                f"names {{{e.args[0]}}}, but only {{question}} is filled in; write literal braces as {{{{ }}}}"
            ) from None
        except (IndexError, ValueError, AttributeError, TypeError):  # {0}, {:q}, {question.a}
            ok = False
        if not ok:
            raise ValueError("must contain {question}; write literal braces as {{ }}")
        return template


class TaskSection(_Section):
    kind: Literal["arithmetic", "dataset"] = Field("arithmetic", description="Synthetic arithmetic, or a dataset.")
    dataset: DatasetSection | None = Field(None, description="The prompt dataset, for kind: dataset.")
    reward: str = Field(
        "arithmetic",
        description="arithmetic: exact match plus partial credit; math_verify: symbolic equality (math-verify); or "
        "your own function, FILE.py:FUNCTION or MODULE:FUNCTION, called as f(response, answer) (and prompt= if it "
        "takes it, and dataset.extra_fields by name) for a float; held-out accuracy counts a reward >= 1.0 as "
        "correct. A relative FILE is read from the working directory (the run keeps its absolute path).",
    )
    reward_timeout_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="Seconds one call of your own task.reward may take: a call still running then fails the run, "
        "naming the response it was scoring (a batch's first) (null: no limit). The function then runs on a thread of "
        "its own: it may not set signal handlers (math-verify's time limits do: pass parsing_timeout=None, "
        "timeout_seconds=None).",
    )
    reward_batch: bool = Field(
        False,
        description="Call your own task.reward once for a list of responses (a shard's in rollouts, all held-out "
        "answers in evaluation, a bootstrap accuracy check's), as f(responses, answers) (and prompts= if it takes it, "
        "and dataset.extra_fields by name, each a list), returning one float per response: for a reward model or a "
        "remote judge.",
    )
    max_operand: int = Field(30, ge=1, le=10_000, description="Operands are drawn from [0, max_operand].")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1, description="Operators.")
    n_shots: int = Field(8, ge=0, le=64, description="Solved examples in each prompt (makes prompts long).")
    shot_sets: int = Field(
        1,
        ge=1,
        le=64,
        description="Few-shot contexts per training problem: each is a training "
        "prompt of its own, its shots drawn independently (held-out prompts keep one).",
    )
    n_eval: int = Field(200, ge=1, description="Held-out problems for eval/accuracy (greedy exact match).")
    partial_credit: float = Field(0.5, ge=0.0, lt=1.0, description="Reward weight of per-digit credit (0: exact only).")
    split_seed: int = Field(1234, ge=0, description="Seed of the train / held-out split (fixed across runs).")
    max_prompt_tokens: int = Field(1024, ge=8, description="Prompts longer than this are refused.")
    stop_at_newline: bool | None = Field(
        None,
        description="End each response (rollouts and evaluation) at a newline token, as well as at EOS: for one-line "
        "answers. null: on for kind arithmetic, off for dataset (answers that reason over several lines, as GSM8K's do "
        "before '#### n').",
    )

    @field_validator("reward")
    @classmethod
    def _reward(cls, reward: str) -> str:
        from models.rewards import absolute_spec

        return absolute_spec(reward)  # ValueError (the forms to give) for anything else

    def reward_settings(self) -> dict:
        """`models.rewards.reward_function`'s arguments for this task's reward."""
        return {
            "kind": self.reward,
            "partial_credit": self.partial_credit,
            "fields": self.reward_fields(),
            "timeout_s": self.reward_timeout_s,
            "batch": self.reward_batch,
        }

    def reward_fields(self) -> tuple[str, ...]:
        """The names of the dataset fields `reward` receives as keyword arguments (`dataset.extra_fields`)."""
        return tuple(self.dataset.extra_fields) if self.dataset is not None else ()

    def newline_stop(self) -> bool:
        """Whether responses end at a newline token (`stop_at_newline`, resolved by the task's kind)."""
        return self.kind == "arithmetic" if self.stop_at_newline is None else self.stop_at_newline


class DataSection(_Section):
    on_bad_row: Literal["skip", "fail"] = Field(
        "skip",
        description="A malformed dataset row (missing field, empty "
        "prompt, invalid UTF-8, too long) is skipped and counted, or fails.",
    )


class BootstrapSection(_Section):
    steps: int = Field(250, ge=0, le=1_000_000, description="SFT steps that make v0 (0: start from the model as is).")
    batch_size: int = Field(32, ge=1, description="SFT sequences per step.")
    lr: float = Field(3e-3, gt=0, le=1.0, description="SFT learning rate (peak).")
    target_accuracy: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Stop SFT early once greedy accuracy on `check_prompts` training "
        "prompts reaches this (null: run all steps).",
    )
    check_prompts: int = Field(100, ge=1, description="Training prompts used for the target-accuracy check.")
    check_every: int = Field(25, ge=1, description="SFT steps between target-accuracy checks.")


class RolloutSection(_Section):
    prompts_per_iteration: int = Field(32, ge=1, description="Groups per iteration (the batch).")
    group_size: int = Field(8, ge=1, le=1024, description="Samples per prompt (G).")
    max_new_tokens: int = Field(6, ge=1, le=32768, description="Response length limit.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature (the loss uses the same).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    engine: Literal["builtin", "vllm"] = Field(
        "builtin", description="Generation engine: builtin (torch, any device) or vllm (CUDA; Ascend with vllm-ascend)."
    )
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="vllm: weight dtype.")
    vllm_gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=0.95,
        description="vllm: fraction of device memory vLLM may take (the trainer shares the device when colocated).",
    )
    vllm_max_model_len: int | None = Field(None, ge=16, description="vllm: context length (null: the model's).")
    interrupt_on_update: bool = Field(
        False,
        description="async: a weight update interrupts in-flight samples, "
        "which continue on the new weights (per-token versions recorded); false: "
        "in-flight samples finish on the weights they started with.",
    )


class AlgorithmSection(_Section):
    advantage: Literal["grpo", "drgrpo", "rloo"] = Field("grpo", description="Group advantage estimator.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses are reduced (see models/OBJECTIVES.md)."
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO ε below 1.")
    clip_high: float = Field(0.2, ge=0.0, le=10.0, description="PPO ε above 1 (DAPO clip-higher when > clip_low).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip constant c for negative advantages.")
    ppo_mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per batch (PPO mini-batches): the batch's "
        "groups, in plan order, are cut into this many equal parts, one step each. The "
        "first part is trained exactly on-policy; later parts are clipped against the "
        "rollout's behaviour log-probs. Weights still reach the workers once per batch.",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL-to-reference coefficient in the loss (0: no reference pass).")
    kl_kind: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    prox_logp: Literal["recompute", "loglinear", "linear", "metrics"] = Field(
        "loglinear",
        description="async (decoupled PPO): proximal log-probs (the policy one version behind the "
        "trainer, never older than a token's own) by an extra forward pass of those weights (recompute), "
        "A-3PO interpolation (loglinear), probability-space interpolation (linear), or recompute while logging "
        "both approximations' errors (metrics).",
    )
    is_cap: float | None = Field(
        5.0, gt=0.0, description="async: cap of the importance weight pi_prox/pi_b (null: no cap)."
    )
    is_mode: Literal["cap", "mask"] = Field(
        "cap", description="async: truncate weights above is_cap, or mask those tokens out."
    )
    is_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="async: importance weight per token, per sequence, or geometric mean."
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO's soft overlong punishment: over the last N tokens before rollout.max_new_tokens a "
        "response's reward is lowered linearly, by overlong_penalty at max_new_tokens (a response cut there, or "
        "whose stop token is its last allowed one). The trainer shapes the rewards it takes advantages of; the "
        "stored rewards stay the task's. null: off.",
    )
    overlong_penalty: float = Field(
        1.0, gt=0.0, le=1000.0, description="What the overlong punishment takes off a reward at max_new_tokens."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (modes sync and periodic): a group whose task rewards are all equal "
        "(within dynamic_sampling_atol) has no advantage signal and is not trained; further rounds of prompts not "
        "yet in the batch (the groups still missing over the share kept so far, in whole pipeline.shard_groups "
        "chunks, at most rollout.prompts_per_iteration) are generated until prompts_per_iteration groups are kept, "
        "dynamic_sampling_rounds rounds have run, or the training prompts run out. The batch is "
        "the first prompts_per_iteration kept groups in plan order, round after round (fewer if the rounds ran "
        "out; the first round's groups, as without dynamic sampling, if none was kept).",
    )
    dynamic_sampling_rounds: int = Field(
        3,
        ge=1,
        le=1000,
        description="dynamic_sampling: at most this many rounds of prompts per batch, the first included.",
    )
    dynamic_sampling_atol: float = Field(
        0.0, ge=0.0, description="dynamic_sampling: a group is kept when its rewards' max - min exceeds this."
    )


class TrainerSection(_Section):
    lr: float = Field(1e-4, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW β1.")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW β2.")
    grad_clip: float | None = Field(1.0, gt=0.0, description="Max gradient norm (null: no clipping).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate over the "
        "run's batches: constant, or a decay from `lr` to `lr x min_lr_ratio` at the last iteration.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Batches of linear warm-up from ~0 to `lr` (before any decay; a "
        "run shorter than this stays in warm-up, so a shortened demo config still runs).",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final learning rate / `lr` of a decay schedule.")
    device: Literal["auto", "cpu", "cuda", "npu"] = Field("auto", description="Training device.")
    disable_dropout: bool = Field(
        True,
        description="Train the policy and reference without the model's dropout (the engine samples without it, so "
        "an on-policy batch's first log-ratio is 0, not noise); false: as the model's config has it.",
    )


class TrainSection(_Section):
    micro_batch_tokens: int = Field(8192, ge=16, description="Token budget of one packed micro-batch.")
    shared_prompt: bool = Field(True, description="Pack [prompt, r1..rG] once per group (False: one row per sample).")
    attention: Literal["auto", "sdpa", "eager", "flex_attention"] = Field(
        "auto",
        description="Trainer attention kernel. auto: FlexAttention block masks on CUDA where torch has them "
        "(responses' blocks that see no other response are skipped), SDPA with a dense boolean mask otherwise.",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Count a group whose rewards are all equal (zero advantage) in the loss normaliser but skip its "
        "forward and backward passes: the same gradient, less compute. Ignored with algorithm.kl_coef > 0 (the KL "
        "term has a gradient there). Token-averaged figures (entropy/mean, clip/fraction...) are then over the "
        "groups trained.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Gradient checkpointing: the policy's decoder layers keep only their inputs in the forward pass "
        "and recompute their activations in the backward, for one more forward pass of the layers per micro-step. "
        "The same gradient; less memory where activations, not weights, fill it (long packed micro-batches).",
    )
    logits_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Response tokens per chunk of the output layer: the trainer's log-probs (policy, reference, "
        "proximal) come from the decoder's hidden states through the output layer this many tokens at a time, each "
        "chunk's logits recomputed in the backward instead of kept, so a micro-batch never holds its whole "
        "(tokens x vocabulary) logits; the prompt's positions and padding are not computed. The same log-probs up "
        "to the rounding of the model's dtype (float32 on CPU). Needs a model whose logits are its output layer "
        "applied to its decoder's output (Llama, Qwen, Mistral...; not one that soft-caps them). null: the whole "
        "logits at once.",
    )


class PipelineSection(_Section):
    mode: Literal["sync", "periodic", "async"] = Field("periodic", description="sync | periodic | async (DESIGN.md).")
    shard_groups: int = Field(4, ge=1, description="Groups per published shard (and per generation batch).")
    max_staleness: int = Field(0, ge=0, description="async: max versions a trained token may lag the trainer.")
    push_weights: bool = Field(
        True,
        description="sync / periodic with the builtin engine: each new version reaches "
        "the rollout workers through shared memory and its checkpoint is written and "
        "promoted beside the next iteration, off the critical path (false: workers load "
        "every version from its promoted checkpoint, written first).",
    )
    overlap_scoring: bool = Field(
        False,
        description="A rollout worker scores a shard's responses (task.reward) and writes the shard on a thread "
        "beside it while it generates its next chunk, instead of generating, scoring and writing in turn: a slow "
        "reward (a remote judge, a reward model) hides behind generation. The same shards, in the same order "
        "(README: 'Scoring beside generation'). Off by default because, when on, the reward runs off the worker's "
        "main thread, where a user's function that sets signal handlers fails (math-verify called with its default "
        "time limits does; the built-in math_verify runs there without them).",
    )
    catalog: bool = Field(True, description="Index every trained sample and shard in the run's LanceDB catalog.")
    catalog_compact_every: int = Field(
        10,
        ge=0,
        description="Compact the catalog at versions N, 2N, 4N, 8N, ... (0: never): each compaction rewrites the whole "
        "table, and the per-version tags keep what it replaced, so compacting at a fixed interval grew the catalog "
        "with the square of the run's length (README: 'The audit catalog over a long run').",
    )


class ResourcesSection(_Section):
    rollout_workers: int = Field(1, ge=1, le=256, description="Long-lived rollout worker processes.")
    rollout_threads: int = Field(1, ge=1, le=512, description="Torch threads per rollout worker.")
    train_threads: int = Field(1, ge=1, le=512, description="Torch threads of the trainer (of each rank).")
    train_ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="Data-parallel trainer processes: the flow's own is rank 0, the others are spawned; each holds "
        "a whole replica and trains its share of the batch's micro-batches, and their gradients are summed onto "
        "rank 0 before its optimizer step (the same batch gradient as one process, up to the order of additions). "
        "CPU: gloo, train_threads each; CUDA: NCCL, rank r on device r (needs that many devices).",
    )
    shard_optimizer: bool = Field(
        False,
        description="With train_ranks >= 2: each rank holds and steps AdamW for its 1/train_ranks slice of the "
        "parameters (ZeRO stage 1), instead of rank 0 holding every moment and stepping alone; each rank takes its "
        "slice of the gradient sum, and the stepped slices are gathered back into every replica. The same update "
        "(on gloo, two ranks: bit for bit the replicated one's); checkpoints hold the same optimizer files either "
        "way.",
    )
    borrow_rollout_threads: bool = Field(
        False,
        description="sync / periodic: once every rollout of the iteration "
        "is published, the workers idle until the next promotion, so the trainer finishes the batch (and the "
        "checkpoint save, and evaluation) with train_threads + rollout_workers x rollout_threads torch threads, at "
        "most the CPU count; back to train_threads when the next iteration's training starts. Never in async mode, "
        "whose workers do not idle. Only for a run that has the machine to itself: beside other runs the borrowed "
        "threads oversubscribe the cores (three demo runs at once went from ~3 s to 7-10 s per iteration).",
    )
    api_server_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness given to the ephemeral Prefect API server "
        "this run starts, so that rollout and training threads come first on a machine with few cores (its event "
        "recording lags instead); 0: leave it. A server you run yourself (PREFECT_API_URL) is never touched.",
    )


class EvalSection(_Section):
    every: int = Field(10, ge=0, description="Evaluate every N iterations (0: only at start and end).")
    max_new_tokens: int = Field(6, ge=1, description="Greedy answer length limit.")


class TrackingSection(_Section):
    uri: str = Field("sqlite:///mlflow.db", min_length=1, description="MLflow tracking URI (SQLite file by default).")
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment; default: run.name.")
    enabled: bool = Field(True, description="Log to MLflow.")
    prefect_artifacts: bool = Field(
        True, description="A Prefect markdown artifact per iteration (reward, worst samples)."
    )


class Config(_Section):
    """A lockstep experiment."""

    run: RunSection = Field(default_factory=RunSection)
    lake: LakeSection = Field(default_factory=LakeSection)
    model: ModelSection = Field(default_factory=ModelSection)
    task: TaskSection = Field(default_factory=TaskSection)
    data: DataSection = Field(default_factory=DataSection)
    bootstrap: BootstrapSection = Field(default_factory=BootstrapSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo):
        # a run's frozen config (resume, replay: `load_config(frozen=True)`, `frozen_config`) is not refused by a
        # rule for new runs that came after it: it must still resume, and a resume cannot change it
        new_run = not (info.context or {}).get("frozen")
        if self.run.run_id is None and ".." in self.run.name:  # the name prefixes the run id made up from it
            raise ValueError(
                f"run.name {self.run.name!r} contains '..', which run ids may not (they name folders of the lake), "
                "and a run without run.run_id is named after it: drop the '..' or set run.run_id"
            )
        if self.pipeline.mode != "async" and self.pipeline.max_staleness != 0:
            raise ValueError("pipeline.max_staleness applies to mode 'async' only; set it to 0 or use mode: async")
        if self.rollout.interrupt_on_update and self.pipeline.mode != "async":
            raise ValueError(
                "rollout.interrupt_on_update applies to mode 'async' only (in sync and periodic modes "
                "weights never change during generation); set it to false or use mode: async"
            )
        if self.task.kind == "dataset" and self.task.dataset is None:
            raise ValueError("task.kind 'dataset' needs a task.dataset section with at least `uri`")
        if self.task.kind == "arithmetic" and self.task.dataset is not None:
            raise ValueError(
                "task.dataset is set but task.kind is 'arithmetic', which would ignore it: set "
                "task.kind: dataset, or remove the task.dataset section"
            )
        if self.task.reward_fields() and _builtin_reward(self):
            raise ValueError(
                f"task.dataset.extra_fields {list(self.task.reward_fields())} are passed to your own task.reward "
                f"function, and task.reward is the built-in {self.task.reward!r}, which takes none: set task.reward "
                "to FILE.py:FUNCTION, or remove extra_fields"
            )
        if self.task.reward_batch and _builtin_reward(self):
            raise ValueError(
                f"task.reward_batch calls your own task.reward function with lists, and task.reward is the built-in "
                f"{self.task.reward!r}, which scores one response at a time: set task.reward to FILE.py:FUNCTION, or "
                "remove reward_batch"
            )
        if len(set(self.task.ops)) < len(self.task.ops):  # a problem listed twice could be both trained and held out
            raise ValueError(f"task.ops {self.task.ops} lists an operator twice: give each once")
        if self.rollout.engine == "vllm" and self.trainer.device == "cpu":
            raise ValueError(
                "rollout.engine 'vllm' generates on a GPU (CUDA, or Ascend with vllm-ascend) while "
                "trainer.device is 'cpu': use rollout.engine builtin, or trainer.device auto / cuda / npu"
            )
        t = self.task
        if t.kind == "arithmetic":  # the split of models/arithmetic.build_splits, known before any work
            n_problems = len(t.ops) * (t.max_operand + 1) ** 2
            if t.n_eval >= n_problems:
                raise ValueError(
                    f"task.n_eval={t.n_eval} leaves no training problems out of {n_problems} "
                    f"({len(t.ops)} ops x (max_operand {t.max_operand} + 1)^2): lower n_eval or raise "
                    "max_operand"
                )
            n_train = (n_problems - t.n_eval) * t.shot_sets  # tasks/session.iteration_prompt_ids refuses more
            if self.rollout.prompts_per_iteration > n_train:
                raise ValueError(
                    f"rollout.prompts_per_iteration={self.rollout.prompts_per_iteration} exceeds the "
                    f"{n_train} training prompts ({n_problems} problems - task.n_eval {t.n_eval}, x "
                    f"task.shot_sets {t.shot_sets}): lower it, or raise task.max_operand or shot_sets"
                )
        if self.task.shot_sets > 1 and (self.task.kind != "arithmetic" or self.task.n_shots == 0):
            raise ValueError(
                f"task.shot_sets={self.task.shot_sets} draws other shots for each synthetic arithmetic "
                f"prompt: it needs task.kind 'arithmetic' and task.n_shots > 0 (here "
                f"{self.task.kind!r}, {self.task.n_shots}); set shot_sets to 1"
            )
        if self.rollout.engine == "vllm" and self.rollout.interrupt_on_update:
            raise ValueError(
                "rollout.interrupt_on_update needs rollout.engine 'builtin': vLLM's offline API cannot "
                "pause a request to swap weights; set interrupt_on_update to false"
            )
        buffer = self.algorithm.overlong_buffer
        if buffer is not None and buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer={buffer} is longer than rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}: the punishment ramps over the last overlong_buffer tokens before "
                "the limit; lower it (DAPO: 4,096 of 20,480)"
            )
        a = self.algorithm
        if a.dynamic_sampling:
            if self.pipeline.mode == "async":
                raise ValueError(
                    "algorithm.dynamic_sampling applies to modes sync and periodic (async mode plans its batches "
                    "ahead, before their rewards are known): set dynamic_sampling to false or use mode: periodic"
                )
            if self.rollout.group_size < 2:
                raise ValueError(
                    "algorithm.dynamic_sampling keeps the groups whose rewards differ, and a group of "
                    "rollout.group_size=1 has one reward: raise group_size or set dynamic_sampling to false"
                )
        m = self.algorithm.ppo_mini_batches
        if m > 1:
            if self.rollout.prompts_per_iteration % m:
                raise ValueError(
                    f"algorithm.ppo_mini_batches={m} must divide rollout.prompts_per_iteration="
                    f"{self.rollout.prompts_per_iteration} (equal mini-batches of whole groups)"
                )
            if self.pipeline.mode == "async":
                raise ValueError(
                    "algorithm.ppo_mini_batches > 1 applies to modes sync and periodic; async mode's "
                    "decoupled loss takes its old policy from prox_logp: set ppo_mini_batches to 1"
                )
        if self.rollout.top_p < 1.0 and (m > 1 or (self.pipeline.mode == "async" and new_run)):
            # the engine's log-probs are those of the truncated, renormalised distribution; the trainer's policy is
            # the whole softmax: an on-policy token's ratio pi_theta / pi_b is its nucleus mass, not 1
            user, other = (
                ("algorithm.ppo_mini_batches > 1 clips later mini-batches", "ppo_mini_batches to 1")
                if m > 1
                else (
                    "pipeline.mode async anchors its proximal policy and importance weights",
                    "pipeline.mode to periodic",
                )
            )
            raise ValueError(
                f"{user} on the behaviour log-probs, which are the policy's only without nucleus truncation "
                f"(rollout.top_p={self.rollout.top_p}): set rollout.top_p to 1.0 or {other}"
            )
        return self


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the field and the reason."""


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"key {key!r} appears twice (lines {first_line} and {line}): keep one")


class _Loader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep)


def _merge(into: dict, update: dict) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _set_path(tree: dict, dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"override {source!r}: empty key in {dotted!r}")
    node = tree
    for k in keys[:-1]:
        if node.get(k) is None:  # absent, or a section left empty in the file (null): the defaults
            node[k] = {}
        child = node[k]
        if not isinstance(child, dict):
            raise ConfigError(f"override {source!r}: {k!r} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict):  # `-o "trainer={lr: 1e-5}"` keeps the rest
        _merge(node[keys[-1]], value)
    else:
        node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key.path=value` strings; the value is read as YAML (true -> bool, [a, b] -> list, 0.5 -> float; 1e-5
    stays a string here, YAML 1.1's reading, and becomes a float in a number field when the config validates)."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. -o trainer.lr=1e-5")
        key, raw = item.split("=", 1)
        try:
            value = yaml.load(raw, Loader=_Loader) if raw != "" else ""
        except _DuplicateKey as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
        if raw.count("#") > repr(value).count("#"):  # ` #...` unquoted is a YAML comment: silently cut off
            raise ConfigError(
                f"override {item!r}: YAML reads ' #' and what follows as a comment, so the value would be "
                f"{value!r}: quote it (-o \"{key}='{raw}'\") or drop the comment"
            )
        out.append((key.strip(), value))
    return out


_PATTERN_WORDS = {  # the name patterns above, in words
    _NAME_PATTERN: "letters, digits, '.', '_' and '-' only, the first a letter or digit",
    _RUN_ID_PATTERN: "letters, digits, '.', '_' and '-' only, the first a letter or digit, at most 128 characters",
}


def _section_keys(loc: tuple) -> list[str]:
    """The keys the section at `loc` (a path of field names from the top) takes; [] where `loc` is no section."""
    model: Any = Config
    for name in loc:
        field = model.model_fields.get(name) if isinstance(name, str) else None  # None: a list index, a dict key
        types = _flat_types(field.annotation) if field is not None else set()
        sections = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
        if not sections:
            return []
        model = sections[0]
    return list(model.model_fields)


def _format_errors(err: ValidationError, source: str, overrides: dict[str, str] | None = None) -> str:
    """One line per error: the field's dotted path, the reason, the value given; the `-o` override that set it (not
    the file); for an unknown key, the keys its section takes."""
    overrides = overrides or {}
    lines = [f"invalid config {source}" + (" with its overrides:" if overrides else ":")]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "string_pattern_mismatch":
            msg = _PATTERN_WORDS.get(e.get("ctx", {}).get("pattern"), msg)
        # a cross-field error's input is the whole config or section: the message names the fields instead
        cross_field = e["type"] == "value_error" and isinstance(e.get("input"), dict)
        got = "" if e["type"] == "missing" or not e["loc"] or cross_field else f" (got {e.get('input')!r})"
        if e["type"] == "extra_forbidden" and (keys := _section_keys(e["loc"][:-1])):
            close = difflib.get_close_matches(str(e["loc"][-1]), keys, n=1)
            got += (f"; did you mean {close[0]!r}?" if close else "") + f" (this section takes: {', '.join(keys)})"
        if e["loc"]:  # an override of the field or of a key below it, else of a section above it
            by = next((item for key, item in overrides.items() if f"{key}.".startswith(f"{loc}.")), None)
            by = by or next((item for key, item in overrides.items() if f"{loc}.".startswith(f"{key}.")), None)
        else:  # a cross-field error: the overrides of the fields its message names, or of keys below them
            named = re.findall(r"(?<![\w.])\w+(?:\.\w+)+", msg)
            by = ", -o ".join(
                item
                for key, item in overrides.items()
                if re.search(rf"(?<![\w.]){re.escape(key)}\b", msg) or any(key.startswith(f"{n}.") for n in named)
            )
        lines.append(f"  {loc}: {msg}{got}" + (f" (set by -o {by})" if by else ""))
    return "\n".join(lines)


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, source: str | None = None, *, frozen: bool = False
) -> Config:
    """Read a YAML file (or start from defaults when path is None), apply overrides, validate. Errors name `source`
    (default: the path), e.g. a run's config.json in the lake when `path` is a local copy of it. `frozen`: the file
    is a run's frozen config (a resume), which rules added for new runs since it was frozen do not refuse."""
    source = source or (str(path) if path is not None else "(defaults)")
    data: Any = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(
                f"config file {source} is a directory, not a file (give a YAML file, e.g. configs/arith-tiny.yaml)"
            )
        if not p.is_file():
            raise ConfigError(f"config file {source} does not exist (give a YAML file, e.g. configs/arith-tiny.yaml)")
        try:
            data = yaml.load(p.read_text(encoding="utf-8"), Loader=_Loader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {source} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8 YAML"
            ) from None
        except OSError as e:
            raise ConfigError(f"config file {source} cannot be read: {e.strerror or e}") from None
        except _DuplicateKey as e:
            raise ConfigError(f"config file {source}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {source} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {source}: the top level must be a mapping of sections, got {type(data).__name__}"
            )
    given = {}
    for (key, value), item in zip(parse_overrides(overrides or []), overrides or [], strict=True):
        _set_path(data, key, value, f"{key}={value}")
        given[key] = item
    try:
        return Config.model_validate(data, context={"frozen": frozen})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, given)) from None


# Fields added after runs were frozen without them, each with the value that reproduces how such a run trained. A
# frozen config.json holds every field of its day, so one that lacks a field is older than the field; its new default
# would change a resumed or replayed run.
FIELDS_ADDED: dict[tuple[str, str], Any] = {
    ("train", "skip_zero_advantage"): False,
    ("task", "stop_at_newline"): True,  # every response ended at a newline before the field
    ("trainer", "disable_dropout"): False,  # runs trained with the model's dropout
}


def upgrade_frozen(data: dict) -> dict:
    """A run's frozen config (its `config.json`) as this version reads it: each field of `FIELDS_ADDED` that it lacks
    set to the value its run trained with, not today's default. A copy; `data` is left as it is."""
    out = copy.deepcopy(data)
    for (section, key), value in FIELDS_ADDED.items():
        if isinstance(out.get(section), dict):
            out[section].setdefault(key, value)
    return out


def frozen_config(data: dict) -> Config:
    """The validated config of a run from its frozen `config.json` (`upgrade_frozen`)."""
    return Config.model_validate(upgrade_frozen(data), context={"frozen": True})


# Settings the run never reads while another setting holds: (section, fields, why not, or None when they are read;
# `{it}` stands for the fields set). A field is reported under the first rule that applies to it.
_INERT_RULES: tuple[tuple[str, tuple[str, ...], Callable[[Config], str | None]], ...] = (
    (
        "algorithm",
        ("prox_logp", "is_cap", "is_mode", "is_level"),
        lambda c: (
            None
            if c.pipeline.mode == "async"
            else f"pipeline.mode is {c.pipeline.mode!r}, and only async mode's decoupled loss reads {{it}}"
        ),
    ),
    ("algorithm", ("is_mode",), lambda c: None if c.algorithm.is_cap is not None else "algorithm.is_cap is null"),
    ("algorithm", ("kl_kind",), lambda c: None if c.algorithm.kl_coef > 0 else "algorithm.kl_coef is 0 (no KL term)"),
    (
        "algorithm",
        ("dynamic_sampling_rounds", "dynamic_sampling_atol"),
        lambda c: None if c.algorithm.dynamic_sampling else "algorithm.dynamic_sampling is false",
    ),
    (
        "algorithm",
        ("overlong_penalty",),
        lambda c: (
            None if c.algorithm.overlong_buffer is not None else "algorithm.overlong_buffer is null (no punishment)"
        ),
    ),
    (
        "bootstrap",
        ("batch_size", "lr", "target_accuracy", "check_prompts", "check_every"),
        lambda c: None if c.bootstrap.steps > 0 else "bootstrap.steps is 0 (v0 is the model as it is)",
    ),
    (
        "bootstrap",
        ("check_prompts", "check_every"),
        lambda c: None if c.bootstrap.target_accuracy is not None else "bootstrap.target_accuracy is null",
    ),
    (
        "rollout",
        ("vllm_dtype", "vllm_gpu_memory_utilization", "vllm_max_model_len"),
        lambda c: None if c.rollout.engine == "vllm" else f"rollout.engine is {c.rollout.engine!r}",
    ),
    (
        "pipeline",
        ("push_weights",),  # tasks.session.pushes_weights
        lambda c: (
            "pipeline.mode is 'async'"
            if c.pipeline.mode == "async"
            else "rollout.engine is 'vllm', which loads each version from its checkpoint"
            if c.rollout.engine == "vllm"
            else None
        ),
    ),
    ("pipeline", ("catalog_compact_every",), lambda c: None if c.pipeline.catalog else "pipeline.catalog is false"),
    (
        "resources",
        ("shard_optimizer",),
        lambda c: (
            "resources.train_ranks is 1: one process holds the whole optimizer"
            if c.resources.train_ranks == 1
            else None
        ),
    ),
    (
        "resources",
        ("borrow_rollout_threads",),  # tasks.iteration.idle_rollout_threads
        lambda c: "pipeline.mode is 'async', whose workers never idle" if c.pipeline.mode == "async" else None,
    ),
    (
        "trainer",
        ("min_lr_ratio",),
        lambda c: "trainer.lr_schedule is 'constant'" if c.trainer.lr_schedule == "constant" else None,
    ),
    ("tracking", ("uri", "experiment"), lambda c: None if c.tracking.enabled else "tracking.enabled is false"),
    (
        "model",
        ("tiny",),
        lambda c: None if c.model.path is None else "model.path is set: the model is loaded, not built",
    ),
    (
        "task",
        ("max_operand", "ops", "n_shots"),
        lambda c: (
            "task.kind is 'dataset', and only the synthetic arithmetic prompts read {it}"
            if c.task.kind == "dataset"
            else None
        ),
    ),
    (
        "data",
        ("on_bad_row",),
        lambda c: (
            "task.kind is 'arithmetic', whose prompts are built, not read" if c.task.kind == "arithmetic" else None
        ),
    ),
    (
        "task",
        ("partial_credit",),
        lambda c: f"task.reward is {c.task.reward!r}" if c.task.reward != "arithmetic" else None,
    ),
    (
        "task",
        ("reward_timeout_s",),  # models.rewards: only a user's function is called under the limit
        lambda c: (
            f"task.reward is the built-in {c.task.reward!r}, which is not called under a time limit"
            if _builtin_reward(c)
            else None
        ),
    ),
    (
        "task",
        ("split_seed",),  # tasks.session._dataset_prompts
        lambda c: (
            "task.dataset.eval_uri is set: the held-out prompts are its rows, not a split of task.dataset.uri"
            if c.task.kind == "dataset" and c.task.dataset is not None and c.task.dataset.eval_uri
            else None
        ),
    ),
    (
        "train",
        ("skip_zero_advantage",),  # models.trainer: a group is skipped only without a KL term
        lambda c: (
            f"algorithm.kl_coef is {c.algorithm.kl_coef}: the KL term has a gradient in every group, so none is skipped"
            if c.algorithm.kl_coef > 0
            else None
        ),
    ),
)


def _builtin_reward(config: Config) -> bool:
    from models.rewards import BUILTIN_REWARDS

    return config.task.reward in BUILTIN_REWARDS


def inert_settings(config: Config) -> list[str]:
    """What a user should hear about a new run's config before it starts, one line each: the settings it gives (in
    its file or by -o) that the run will not read, and why, rollout workers that would get no work (sync and
    periodic), and a group size from which nothing is learned.

    Not errors: a run frozen with such a setting must still resume. Only what the config sets is reported (a
    default is no one's choice); a run's frozen config.json sets every field, so this is for a new run's config."""
    notes = []
    reported: set[str] = set()
    for section, fields, why in _INERT_RULES:
        given = [f"{section}.{f}" for f in fields if f in getattr(config, section).model_fields_set]
        given = [name for name in given if name not in reported]
        reason = why(config) if given else None
        if reason:
            one = len(given) == 1
            reason = reason.replace("{it}", "it" if one else "them")
            notes.append(f"{', '.join(given)} {'is set but has' if one else 'are set but have'} no effect: {reason}")
            reported.update(given)
    r, p = config.resources, config.pipeline
    chunks = -(-config.rollout.prompts_per_iteration // p.shard_groups)
    if p.mode != "async" and r.rollout_workers > chunks:  # (async workers take the next batches' chunks too)
        notes.append(
            f"resources.rollout_workers is {r.rollout_workers} but an iteration has {chunks} chunk(s) of work "
            f"(rollout.prompts_per_iteration {config.rollout.prompts_per_iteration} / pipeline.shard_groups "
            f"{p.shard_groups}): {r.rollout_workers - chunks} worker(s) would never get one, yet each starts and "
            f"loads the model; lower rollout_workers to {chunks} or pipeline.shard_groups"
        )
    if config.rollout.group_size == 1:
        notes.append(
            "rollout.group_size is 1: every advantage estimator compares a response with the rest of its group, "
            "so every advantage is 0 and the policy learns nothing from the rewards; use group_size >= 2"
        )
    return notes


def resolved_json(config: Config) -> str:
    return json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True)


def flatten(config: Config) -> dict[str, Any]:
    """`section.field` -> value, for MLflow params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", config.model_dump(mode="json"))
    return out
