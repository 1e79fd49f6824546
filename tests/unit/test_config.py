"""configs/schema.py and the CLI's handling of bad configs: every shipped YAML parses, every kind of bad input
fails at load with the file, the dotted field path and the reason, and `lockstep train` exits 2 without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs.schema import (
    Config,
    ConfigError,
    DatasetSection,
    TrainerSection,
    flatten,
    frozen_config,
    load_config,
    parse_overrides,
    resolved_json,
    upgrade_frozen,
)
from flows import cli

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs").glob("*.yml"))


def write(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def load_error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


# ------------------------------------------------------------------------------------------------ good configs


def test_configs_dir_is_not_empty():
    # guards the parametrised test below against silently running zero cases
    assert any(p.name == "arith-tiny.yaml" for p in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_yaml_parses_and_round_trips(path):
    cfg = load_config(path)
    # the resolved JSON saved with a run must load back to the same config
    again = Config.model_validate(json.loads(resolved_json(cfg)))
    assert again == cfg
    # every key written in the file is honoured (a typo would have been refused as an extra key)
    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    flat = flatten(cfg)
    for section, fields in raw.items():
        for key, value in (fields or {}).items():
            if not isinstance(value, dict):
                assert flat[f"{section}.{key}"] == value, f"{path.name}: {section}.{key}"


def test_arith_tiny_values():
    cfg = load_config(REPO / "configs" / "arith-tiny.yaml")
    assert cfg.run.name == "arith-tiny" and cfg.run.iterations == 300
    assert (cfg.trainer.lr, cfg.trainer.lr_schedule, cfg.trainer.warmup_steps, cfg.trainer.min_lr_ratio) == (
        2.0e-4,
        "cosine",
        10,
        0.1,
    )
    assert cfg.model.path is None and cfg.model.tiny.hidden_size == 128 and cfg.model.tiny.num_kv_heads == 2
    assert cfg.bootstrap.lr == 3.0e-3 and isinstance(cfg.bootstrap.lr, float) and cfg.bootstrap.target_accuracy == 0.5
    assert cfg.bootstrap.steps == 800 and cfg.task.n_shots == 6 and cfg.task.shot_sets == 4
    assert cfg.train.micro_batch_tokens == 4096
    assert cfg.pipeline.mode == "periodic"


def test_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.run.name == "lockstep" and cfg.run.run_id is None and cfg.run.seed == 0
    assert cfg.lake.uri == "./lake" and cfg.lake.compression is None
    assert cfg.trainer.lr == 1e-4 and cfg.trainer.grad_clip == 1.0 and cfg.trainer.device == "auto"
    assert cfg.rollout.group_size == 8 and cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0
    assert (
        cfg.task.ops == ["+"] and cfg.task.n_shots == 8 and cfg.task.shot_sets == 1 and cfg.task.partial_credit == 0.5
    )
    assert cfg.pipeline.mode == "periodic" and cfg.pipeline.max_staleness == 0
    assert cfg.algorithm.advantage == "grpo" and cfg.algorithm.loss_agg == "token-mean"


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()


def test_flatten_uses_dotted_paths():
    flat = flatten(load_config(None))
    assert flat["trainer.lr"] == 1e-4
    assert flat["model.tiny.arch"] == "qwen2"
    assert flat["task.ops"] == ["+"]


# ------------------------------------------------------------------------------------------------ overrides


def test_override_scientific_float():
    # YAML 1.1 reads '1e-5' as a string; the loader must give the float a user means
    cfg = load_config(REPO / "configs" / "arith-tiny.yaml", ["trainer.lr=1e-5"])
    assert cfg.trainer.lr == 1e-5 and type(cfg.trainer.lr) is float


def test_exponent_strings_become_numbers_only_in_number_fields(tmp_path):
    # a string field keeps what YAML read: `-o run.run_id=1e3` is the run id "1e3", not 1000.0 (which was refused)
    assert parse_overrides(["run.run_id=1e3"]) == [("run.run_id", "1e3")]
    cfg = load_config(None, ["run.run_id=1e3", "run.name=2.5e1", "run.iterations=1e3", "trainer.grad_clip=2e0"])
    assert cfg.run.run_id == "1e3" and cfg.run.name == "2.5e1"
    assert cfg.run.iterations == 1000 and type(cfg.run.iterations) is int
    assert cfg.trainer.grad_clip == 2.0
    # the same reading for a file's values (YAML 1.1 leaves `lr: 1e-5` a string there too)
    cfg = load_config(write(tmp_path, "run:\n  run_id: 5e2\n  iterations: 2e1\ntrainer:\n  lr: 1e-5\n", "ok.yaml"))
    assert (cfg.run.run_id, cfg.run.iterations, cfg.trainer.lr) == ("5e2", 20, 1e-5)
    assert "run.iterations: Input should be a valid integer, got a number with a fractional part (got 1.5)" in (
        load_error(None, ["run.iterations=1.5e0"])
    )
    assert "run.iterations: Input should be a valid integer, unable to parse string as an integer (got '1x3')" in (
        load_error(None, ["run.iterations=1x3"])
    )


def test_override_literal_int_bool_null():
    cfg = load_config(
        None,
        [
            "pipeline.mode=sync",
            "rollout.group_size=4",
            "train.shared_prompt=false",
            "trainer.grad_clip=null",
            "model.tiny.arch=llama",
        ],
    )
    assert cfg.pipeline.mode == "sync"
    assert cfg.rollout.group_size == 4 and type(cfg.rollout.group_size) is int
    assert cfg.train.shared_prompt is False
    assert cfg.trainer.grad_clip is None
    assert cfg.model.tiny.arch == "llama"


def test_override_list_value():
    cfg = load_config(None, ['task.ops=["+", "*"]'])
    assert cfg.task.ops == ["+", "*"]
    cfg = load_config(None, ["task.ops=[+, -]"])
    assert cfg.task.ops == ["+", "-"]


def test_override_beats_file_and_keeps_siblings(tmp_path):
    p = write(tmp_path, "trainer: {lr: 0.5, weight_decay: 0.1}\n", "ok.yaml")
    cfg = load_config(p, ["trainer.lr=0.25"])
    assert cfg.trainer.lr == 0.25 and cfg.trainer.weight_decay == 0.1


def test_override_value_with_equals_sign():
    # only the first '=' splits key from value
    assert parse_overrides(["tracking.uri=sqlite:///a=b.db"]) == [("tracking.uri", "sqlite:///a=b.db")]


def test_override_string_containing_e_stays_a_string():
    cfg = load_config(None, ["lake.uri=./lake-e.test", "run.name=periodic-e"])
    assert cfg.lake.uri == "./lake-e.test" and cfg.run.name == "periodic-e"


# ------------------------------------------------------------------------------------------------ bad configs


def test_unknown_top_level_key(tmp_path):
    p = write(tmp_path, "trainr:\n  lr: 1.0e-4\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "trainr: Extra inputs are not permitted" in msg


def test_unknown_nested_key(tmp_path):
    p = write(tmp_path, "trainer:\n  lrr: 1.0e-4\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "trainer.lrr: Extra inputs are not permitted" in msg


def test_unknown_deeply_nested_key(tmp_path):
    p = write(tmp_path, "model:\n  tiny:\n    hidden: 64\n")
    msg = load_error(p)
    assert str(p) in msg and "model.tiny.hidden: Extra inputs are not permitted" in msg


def test_wrong_type(tmp_path):
    p = write(tmp_path, "trainer:\n  lr: fast\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "trainer.lr: Input should be a valid number" in msg and "(got 'fast')" in msg


def test_section_given_as_scalar(tmp_path):
    p = write(tmp_path, "trainer: 5\n")
    msg = load_error(p)
    assert str(p) in msg and "trainer: Input should be a valid dictionary" in msg


def test_out_of_range_value(tmp_path):
    p = write(tmp_path, "rollout:\n  group_size: 0\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "rollout.group_size: Input should be greater than or equal to 1 (got 0)" in msg


def test_out_of_range_exclusive_bound(tmp_path):
    p = write(tmp_path, "task:\n  partial_credit: 1.0\n")
    msg = load_error(p)
    assert "task.partial_credit: Input should be less than 1" in msg and "(got 1.0)" in msg


def test_bad_literal_choice(tmp_path):
    p = write(tmp_path, "pipeline:\n  mode: turbo\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "pipeline.mode: Input should be 'sync', 'periodic' or 'async' (got 'turbo')" in msg


def test_bad_literal_inside_list(tmp_path):
    p = write(tmp_path, "task:\n  ops: ['+', '/']\n")
    msg = load_error(p)
    # the list index is part of the path
    assert "task.ops.1: Input should be '+', '-' or '*' (got '/')" in msg


def test_several_errors_are_all_reported(tmp_path):
    p = write(tmp_path, "trainer:\n  lr: -1\nrollout:\n  top_p: 2\n")
    msg = load_error(p)
    assert "trainer.lr: Input should be greater than 0" in msg
    assert "rollout.top_p: Input should be less than or equal to 1" in msg


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    msg = load_error(p)
    assert f"config file {p} does not exist" in msg


def test_directory_is_not_a_config(tmp_path):
    msg = load_error(tmp_path)
    assert f"config file {tmp_path} is a directory, not a file (give a YAML file" in msg


def test_invalid_yaml(tmp_path):
    p = write(tmp_path, "trainer:\n  lr: [1, 2\n")
    msg = load_error(p)
    assert f"config file {p} is not valid YAML" in msg
    assert "line" in msg  # the parser's position, so the user can find it


def test_non_mapping_top_level(tmp_path):
    p = write(tmp_path, "- trainer\n- lr\n")
    msg = load_error(p)
    assert f"config file {p}: the top level must be a mapping of sections, got list" in msg


def test_malformed_override_without_equals():
    msg = load_error(None, ["foo"])
    assert "override 'foo': expected KEY=VALUE" in msg


def test_override_with_empty_key_part():
    msg = load_error(None, ["trainer..lr=1"])
    assert "empty key in 'trainer..lr'" in msg


def test_override_into_a_scalar_field(tmp_path):
    p = write(tmp_path, "trainer:\n  lr: 1.0e-4\n", "ok.yaml")
    msg = load_error(p, ["trainer.lr.x=1"])
    assert "'lr' is not a section" in msg


def test_override_with_invalid_yaml_value():
    msg = load_error(None, ["task.ops=[+"])
    assert "override 'task.ops=[+': value is not valid YAML" in msg


def test_an_override_whose_yaml_comment_would_cut_the_value_is_refused():
    """`-o "run.run_id=exp #2"` started run `exp`: YAML drops ` #2` as a comment. Refused, with the quoting that
    keeps it; a '#' that is part of the value (no space before it, or quoted) is kept."""
    msg = load_error(None, ["run.run_id=exp #2"])
    assert "override 'run.run_id=exp #2': YAML reads ' #' and what follows as a comment" in msg
    assert "the value would be 'exp': quote it (-o \"run.run_id='exp #2'\")" in msg
    assert parse_overrides(["tracking.experiment=exp#2"]) == [("tracking.experiment", "exp#2")]
    assert parse_overrides(["tracking.experiment='exp #2'"]) == [("tracking.experiment", "exp #2")]


def test_override_that_fails_validation_names_the_field(tmp_path):
    p = write(tmp_path, "", "ok.yaml")
    msg = load_error(p, ["rollout.temperature=0"])
    assert str(p) in msg and "rollout.temperature: Input should be greater than 0" in msg


def test_unknown_key_through_override():
    msg = load_error(None, ["trainer.learning_rate=1e-5"])
    assert "(defaults)" in msg and "trainer.learning_rate: Extra inputs are not permitted" in msg


def test_cross_field_staleness_needs_async(tmp_path):
    p = write(tmp_path, "pipeline:\n  mode: periodic\n  max_staleness: 2\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "pipeline.max_staleness applies to mode 'async' only" in msg


def test_cross_field_heads(tmp_path):
    # 4 heads over 3 kv heads: 4 % 3 != 0
    p = write(tmp_path, "model:\n  tiny: {num_heads: 4, num_kv_heads: 3}\n")
    msg = load_error(p)
    assert str(p) in msg
    assert "model.tiny: num_kv_heads (3) must divide num_heads (4), and num_heads must divide hidden_size (128)" in msg
    assert "(got {" not in msg  # the message names the values; the section's other fields are not printed


def test_cross_field_hidden_size_divisible_by_heads(tmp_path):
    # 130 % 4 = 2
    p = write(tmp_path, "model:\n  tiny: {hidden_size: 130, num_heads: 4, num_kv_heads: 2}\n")
    assert "num_heads must divide hidden_size (130)" in load_error(p)


def test_interrupt_needs_async():
    assert "rollout.interrupt_on_update applies to mode 'async' only" in load_error(
        None, ["rollout.interrupt_on_update=true"]
    )
    cfg = load_config(
        None,
        [
            "pipeline.mode=async",
            "pipeline.max_staleness=2",
            "rollout.interrupt_on_update=true",
            "algorithm.prox_logp=metrics",
        ],
    )
    assert (cfg.pipeline.max_staleness, cfg.rollout.interrupt_on_update, cfg.algorithm.prox_logp) == (
        2,
        True,
        "metrics",
    )


def test_shot_sets_need_arithmetic_shots():
    assert "task.shot_sets=4 draws other shots" in load_error(None, ["task.shot_sets=4", "task.n_shots=0"])
    msg = load_error(None, ["task.shot_sets=2", "task.kind=dataset", "task.dataset.uri=x.jsonl"])
    assert "needs task.kind 'arithmetic' and task.n_shots > 0 (here 'dataset', 8)" in msg
    assert load_config(None, ["task.shot_sets=4"]).task.shot_sets == 4


def test_vllm_engine_refuses_interruption():
    assert "rollout.interrupt_on_update needs rollout.engine 'builtin'" in load_error(
        None, ["rollout.engine=vllm", "pipeline.mode=async", "rollout.interrupt_on_update=true"]
    )


def test_validate_assignment_guards_later_edits():
    cfg = load_config(None)
    with pytest.raises(ValueError):
        cfg.trainer.lr = -1.0
    assert cfg.trainer.lr == 1e-4


def test_file_that_is_not_utf8(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))  # é is byte 0xe9 in Latin-1, invalid UTF-8 here
    msg = load_error(p)
    assert f"config file {p} is not UTF-8 text (byte 16: invalid continuation byte); save it as UTF-8 YAML" in msg


def test_duplicate_key_names_the_key_and_lines(tmp_path):
    # PyYAML alone keeps the last value: name would silently be 'b'
    p = write(tmp_path, "run:\n  name: a\n  name: b\n")
    assert load_error(p) == f"config file {p}: key 'name' appears twice (lines 2 and 3): keep one"
    p = write(tmp_path, "run:\n  name: x\ntrainer: {lr: 0.1}\nrun:\n  iterations: 3\n", "dup-section.yaml")
    assert load_error(p) == f"config file {p}: key 'run' appears twice (lines 1 and 4): keep one"
    assert "key 'lr' appears twice" in load_error(None, ["trainer={lr: 1, lr: 2}"])


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    p = write(tmp_path, "base: &b {lr: 0.5, weight_decay: 0.1}\n", "ok.yaml")
    import yaml

    from configs.schema import _Loader

    assert yaml.load(p.read_text() + "t: {<<: *b, lr: 0.25}\n", Loader=_Loader)["t"] == {
        "lr": 0.25,
        "weight_decay": 0.1,
    }


def test_cross_field_error_does_not_print_the_whole_config(tmp_path):
    p = write(tmp_path, "task:\n  kind: dataset\n")
    msg = load_error(p)
    assert msg == (
        f"invalid config {p}:\n  (top level): task.kind 'dataset' needs a task.dataset section with at least `uri`"
    )


def test_template_must_contain_question(tmp_path):
    base = "task:\n  kind: dataset\n  dataset:\n    uri: x.jsonl\n    template: "
    for template, named in [('"{foo}"', "foo"), ('"Q: {question} A: {answer}"', "answer")]:  # another field
        msg = load_error(write(tmp_path, base + template + "\n"))
        expected = f"task.dataset.template: names {{{named}}}, but only {{question}} is filled in; write literal braces"
        assert f"{expected} as {{{{ }}}} (got {template[1:-1]!r})" in msg
    for template in [
        '"hello"',
        '"{0}"',
        '"Q: {question"',
        '"Q: {question.a}"',
        '"Q: {question[0]}"',
    ]:
        msg = load_error(write(tmp_path, base + template + "\n"))
        expected = "task.dataset.template: must contain {question}; write literal braces as {{ }}"
        assert f"{expected} (got {template[1:-1]!r})" in msg
    # literal braces doubled are fine and stay single in the prompt
    cfg = load_config(write(tmp_path, base + '"{{json}} {question}"\n', "ok.yaml"))
    assert cfg.task.dataset.template.format(question="2+2") == "{json} 2+2"


def test_tiny_head_dim_must_be_even():
    # 12 / 4 = 3: rotary embeddings rotate pairs of dimensions
    msg = load_error(None, ["model.tiny.hidden_size=12", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2"])
    assert "model.tiny: head_dim = hidden_size / num_heads = 12 / 4 = 3 must be even (rotary embeddings)" in msg
    assert load_config(None, ["model.tiny.hidden_size=16", "model.tiny.num_heads=4"]).model.tiny.hidden_size == 16


@pytest.mark.parametrize(
    "override,field",
    [
        ("trainer.lr=true", "trainer.lr"),
        ("run.iterations=true", "run.iterations"),
        ("trainer.grad_clip=false", "trainer.grad_clip"),
        ("task.max_operand=yes", "task.max_operand"),
    ],
)
def test_boolean_is_not_a_number(override, field):
    # pydantic alone reads true as 1: trainer.lr=true trained at lr 1.0
    msg = load_error(None, [override])
    assert f"{field}: Input should be a number, not a boolean (got " in msg


def test_booleans_still_set_boolean_fields():
    cfg = load_config(None, ["train.shared_prompt=false", "tracking.enabled=no"])
    assert cfg.train.shared_prompt is False and cfg.tracking.enabled is False


@pytest.mark.parametrize(
    "override",
    [
        "trainer.grad_clip=.inf",
        "algorithm.kl_coef=.inf",
        "algorithm.is_cap=inf",
        "trainer.lr=.nan",
        "algorithm.dual_clip=nan",
    ],
)
def test_infinity_and_nan_are_refused(override):
    field = override.split("=")[0]
    assert f"{field}: Input should be a finite number" in load_error(None, [override])


@pytest.mark.parametrize(
    "field",
    [
        "model.path",
        "tracking.experiment",
        "task.dataset.question_field",
        "task.dataset.answer_field",
        "task.dataset.split",
        "task.dataset.eval_split",
    ],
)
def test_empty_strings_are_refused(field):
    msg = load_error(None, ["task.dataset.uri=x.jsonl", f"{field}="])
    assert f"{field}: String should have at least 1 character (got '')" in msg


def test_seed_upper_bound_is_what_the_rngs_take():
    import numpy as np
    import torch

    top = load_config(None, [f"run.seed={2**32 - 1}"]).run.seed
    torch.manual_seed(top)  # the model init and SFT seed
    np.random.seed(top)  # vLLM seeds numpy with it; random.Random takes any int
    assert f"run.seed: Input should be less than or equal to 4294967295 (got {2**32})" in load_error(
        None, [f"run.seed={2**32}"]
    )
    with pytest.raises(ValueError):  # the negative control: one more is what numpy refuses
        np.random.seed(2**32)


def test_empty_sections_mean_defaults(tmp_path):
    # every field of trainer and model.tiny commented out: YAML reads the sections as null
    text = "run:\n  iterations: 3\ntrainer:\n#  lr: 1.0e-5\nmodel:\n  tiny:\ntask:\n  dataset:\n"
    p = write(tmp_path, text, "ok.yaml")
    cfg = load_config(p)
    assert cfg.run.iterations == 3 and cfg.trainer == Config().trainer and cfg.model == Config().model
    assert cfg.task.dataset is None  # an optional section stays absent


def test_override_into_an_empty_section(tmp_path):
    p = write(tmp_path, "trainer:\ntask:\n  kind: dataset\n  dataset:\n", "ok.yaml")
    cfg = load_config(p, ["trainer.lr=1e-5", "task.dataset.uri=x.jsonl"])
    assert cfg.trainer.lr == 1e-5 and cfg.task.dataset.uri == "x.jsonl"


def test_mapping_override_merges_into_the_section(tmp_path):
    p = write(
        tmp_path, "trainer: {lr: 0.5, weight_decay: 0.1}\nmodel:\n  tiny: {hidden_size: 64, num_layers: 2}\n", "ok.yaml"
    )
    cfg = load_config(p, ["trainer={lr: 1e-5}", "model={tiny: {num_layers: 3}}"])
    assert (cfg.trainer.lr, cfg.trainer.weight_decay) == (1e-5, 0.1)
    assert (cfg.model.tiny.hidden_size, cfg.model.tiny.num_layers) == (64, 3)
    # a scalar still replaces: the section is refused as before
    assert "trainer: Input should be a valid dictionary" in load_error(p, ["trainer=5"])


def test_arithmetic_sizes_are_checked_at_load():
    """The same counts the run makes: models/arithmetic.build_splits and tasks/session.iteration_prompt_ids."""
    from models import arithmetic
    from tasks.session import iteration_prompt_ids

    small = ["task.max_operand=1", "task.shot_sets=2"]  # 1 op x (1 + 1)^2 = 4 problems
    msg = load_error(None, [*small, "task.n_eval=4"])
    assert "(top level): task.n_eval=4 leaves no training problems out of 4" in msg
    with pytest.raises(ValueError, match="n_eval=4 leaves no training problems out of 4"):
        arithmetic.build_splits(1, ("+",), 4, 1234)  # the run-time check it mirrors
    # n_eval 1: 3 training problems x 2 shot sets = 6 training prompts
    cfg = load_config(None, [*small, "task.n_eval=1", "rollout.prompts_per_iteration=6"])
    train, _ = arithmetic.build_splits(1, ("+",), 1, cfg.task.split_seed)
    n_train = len(arithmetic.make_train_prompts(train, cfg.task.n_shots, cfg.task.split_seed, 2))
    assert n_train == 6 and sorted(iteration_prompt_ids(cfg, n_train, 0)) == list(range(6))
    msg = load_error(None, [*small, "task.n_eval=1", "rollout.prompts_per_iteration=7"])
    assert (
        "(top level): rollout.prompts_per_iteration=7 exceeds the 6 training prompts (4 problems - task.n_eval 1, "
        "x task.shot_sets 2)"
    ) in msg
    cfg.rollout.prompts_per_iteration = 7  # a section alone does not see the task: the run would refuse it late
    with pytest.raises(ValueError, match="prompts_per_iteration=7 exceeds the 6 training prompts"):
        iteration_prompt_ids(cfg, n_train, 0)


# ------------------------------------------------------------------------------------------------ the CLI


def cli_stderr(capsys) -> str:
    # rich wraps at the console width (80 under capture): compare with whitespace runs collapsed
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())


def test_cli_bad_config_exits_2_without_traceback(tmp_path, capsys):
    p = write(tmp_path, "rollout:\n  group_size: 0\n")
    assert cli.main(["train", str(p)]) == 2
    err = cli_stderr(capsys)
    assert "rollout.group_size: Input should be greater than or equal to 1" in err
    assert str(p) in err.replace(" ", "")  # a path longer than the console width is folded


def test_cli_bad_override_exits_2(tmp_path, capsys):
    assert cli.main(["train", str(REPO / "configs" / "arith-tiny.yaml"), "-o", "pipeline.mode=turbo"]) == 2
    err = cli_stderr(capsys)
    assert "pipeline.mode: Input should be 'sync', 'periodic' or 'async' (got 'turbo')" in err


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2
    err = cli_stderr(capsys)
    assert "missing.yaml does not exist" in err


def test_cli_subprocess_real_exit_code(tmp_path):
    p = write(tmp_path, "trainer:\n  lrr: 1\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", str(p)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "trainer.lrr" in proc.stderr and "Extra inputs are not permitted" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_lockstep_command_exits_with_mains_code_and_a_frozen_heap(monkeypatch):
    """The `lockstep` console script is `flows.cli:run`: main's exit code, with the heap frozen first so that the
    interpreter's last garbage collection at exit skips it (~2.5 s of a tiny run's exit here)."""
    import gc
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="lockstep")  # as installed (tomllib needs Python 3.11)
    assert script.value == "flows.cli:run"
    monkeypatch.setattr(cli, "main", lambda argv=None: 3)
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.run()
        assert exit_.value.code == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_gpu_config_without_vllm_fails_before_any_work(tmp_path):
    """The documented GPU config validates here; starting it without vLLM names the install command, and nothing
    is written to the lake."""
    import importlib.util

    from tasks.preflight import InputError
    from tasks.session import open_session

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    cfg = load_config(REPO / "configs" / "qwen2.5-1.5b-gsm8k.yaml", [f"lake.uri={tmp_path / 'lake'}"])
    assert (cfg.rollout.engine, cfg.trainer.device, cfg.task.reward) == ("vllm", "cuda", "math_verify")
    with pytest.raises(InputError, match=r"pip install 'lockstep-rl\[cuda\]'"):  # the CLI's exit-2 path
        open_session(cfg)
    assert not (tmp_path / "lake").exists()


def test_attention_kernel_choice():
    import torch

    from tasks.preflight import InputError, attention_kernel

    assert attention_kernel("auto", torch.device("cpu")) == "sdpa"
    assert attention_kernel("auto", torch.device("cuda")) == "flex_attention"  # torch 2.13 has FlexAttention
    assert attention_kernel("eager", torch.device("cpu")) == "eager"
    with pytest.raises(InputError, match="no backward pass on cpu"):
        attention_kernel("flex_attention", torch.device("cpu"))


def test_flex_attention_on_a_cpu_is_refused_before_the_run_exists(tmp_path, capsys):
    """It was refused only as the trainer was built, after the bootstrap had run and the run's config was frozen:
    the run could never be resumed (its frozen setting refused again)."""
    config = str(REPO / "configs" / "arith-tiny.yaml")
    code = cli.main(["train", config, "-o", f"lake.uri={tmp_path / 'lake'}", "-o", "train.attention=flex_attention"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: train.attention 'flex_attention' needs a CUDA device" in " ".join(err.split())
    assert not (tmp_path / "lake").exists()


def test_cli_duplicate_key_and_bool_exit_2(tmp_path, capsys):
    p = write(tmp_path, "rollout:\n  group_size: 4\n  group_size: 8\n")
    assert cli.main(["train", str(p)]) == 2
    assert "key 'group_size' appears twice (lines 2 and 3): keep one" in cli_stderr(capsys)
    assert cli.main(["train", str(REPO / "configs" / "arith-tiny.yaml"), "-o", "trainer.lr=true"]) == 2
    assert "trainer.lr: Input should be a number, not a boolean (got True)" in cli_stderr(capsys)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["task.ops=['+', '*', '+']"], "task.ops ['+', '*', '+'] lists an operator twice: give each once"),
        (["task.dataset={uri: x.jsonl}"], "task.dataset is set but task.kind is 'arithmetic', which would ignore it"),
        (
            ["rollout.engine=vllm", "trainer.device=cpu"],
            "rollout.engine 'vllm' generates on a GPU (CUDA, or Ascend with vllm-ascend) while trainer.device is 'cpu'",
        ),
    ],
)
def test_settings_that_would_be_ignored_or_fail_later(overrides, expected):
    assert f"(top level): {expected}" in load_error(None, overrides)


def test_task_that_cannot_fill_a_batch_fails_before_the_run_exists(tmp_path):
    """A dataset's usable rows are known only once read: too few for a batch, or prompts over the token limit, fail
    in open_session before the run's config.json is written (it used to fail after the bootstrap's SFT, leaving a
    run that `lockstep train` then refused as existing)."""
    import json

    from storage.lake import Lake
    from tasks.preflight import InputError
    from tasks.session import open_session

    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(7)))
    base = [
        f"lake.uri={tmp_path / 'lake'}",
        "tracking.enabled=false",
        "task.kind=dataset",
        "task.n_shots=0",
        f"task.dataset={{uri: {data}}}",
        "task.n_eval=2",
        "run.run_id=small",
        "bootstrap.steps=0",
    ]
    cfg = load_config(None, [*base, "rollout.prompts_per_iteration=6"])
    with pytest.raises(InputError, match="rollout.prompts_per_iteration=6 exceeds the 5 training prompts"):
        open_session(cfg)
    arith = load_config(
        None,
        [
            f"lake.uri={tmp_path / 'lake'}",
            "tracking.enabled=false",
            "run.run_id=long",
            "task.max_prompt_tokens=16",
            "bootstrap.steps=0",
        ],
    )
    with pytest.raises(InputError, match="training prompts exceed task.max_prompt_tokens=16"):
        open_session(arith)
    lake = Lake(str(tmp_path / "lake"))
    assert not lake.fs.exists(lake.run_dir("small")) and not lake.fs.exists(lake.run_dir("long"))


def test_run_name_length_and_run_id_first_character():
    assert load_config(None, ["run.name=" + "a" * 64]).run.name == "a" * 64
    assert f"run.name: String should have at most 64 characters (got {'a' * 65!r})" in load_error(
        None, ["run.name=" + "a" * 65]
    )
    assert load_config(None, ["run.run_id=r" + "x" * 127]).run.run_id == "r" + "x" * 127
    # a run id is a directory name in the lake and a CLI argument: no hidden (.x) or flag-like (-x) ids
    words = "letters, digits, '.', '_' and '-' only, the first a letter or digit"  # not the pattern's regex
    for bad in [".hidden", "-x", "_x", "r" + "x" * 128, "../etc", "my run"]:
        assert f"run.run_id: {words}, at most 128 characters (got {bad!r})" in load_error(None, [f"run.run_id={bad}"])
    assert f"run.name: {words} (got 'my run')" in load_error(None, ["run.name=my run"])
    # the lake's own rule past the pattern: '..' anywhere (a traceback from the CLI's look, or from the flow); in
    # run.name only where it becomes a run id (no run.run_id), as the MLflow experiment it is harmless
    assert "run.run_id: '..' is not allowed in run ids, which name folders of the lake" in load_error(
        None, ["run.run_id=a..b"]
    )
    assert "run.name 'a..b' contains '..', which run ids may not" in load_error(None, ["run.name=a..b"])
    assert load_config(None, ["run.name=a..b", "run.run_id=r1"]).run.name == "a..b"


def test_iterations_must_be_at_least_one():
    assert "run.iterations: Input should be greater than or equal to 1 (got 0)" in load_error(
        None, ["run.iterations=0"]
    )
    assert load_config(None, ["run.iterations=1"]).run.iterations == 1


def test_default_keeps_two_optimizer_states():
    cfg = load_config(None)
    assert cfg.lake.keep_optimizer_state == 2


@pytest.mark.parametrize(
    "override,expected",
    [
        ("bootstrap.lr=0", "bootstrap.lr: Input should be greater than 0 (got 0)"),
        (
            "rollout.vllm_gpu_memory_utilization=0.96",
            "rollout.vllm_gpu_memory_utilization: Input should be less than or equal to 0.95 (got 0.96)",
        ),
        (
            "rollout.vllm_gpu_memory_utilization=1.0",
            "rollout.vllm_gpu_memory_utilization: Input should be less than or equal to 0.95 (got 1.0)",
        ),
        ("algorithm.clip_low=1.0", "algorithm.clip_low: Input should be less than 1 (got 1.0)"),
        ("algorithm.dual_clip=1.0", "algorithm.dual_clip: Input should be greater than 1 (got 1.0)"),
        ("trainer.beta1=1.0", "trainer.beta1: Input should be less than 1 (got 1.0)"),
        ("trainer.beta2=1.0", "trainer.beta2: Input should be less than 1 (got 1.0)"),
    ],
)
def test_exclusive_and_tight_bounds(override, expected):
    assert expected in load_error(None, [override])


def test_bounds_accept_their_edges():
    cfg = load_config(
        None,
        [
            "bootstrap.lr=1.0",
            "rollout.vllm_gpu_memory_utilization=0.95",
            "algorithm.clip_low=0.99",
            "algorithm.dual_clip=1.01",
            "trainer.beta2=0.9999",
        ],
    )
    assert (
        cfg.bootstrap.lr,
        cfg.rollout.vllm_gpu_memory_utilization,
        cfg.algorithm.clip_low,
        cfg.algorithm.dual_clip,
        cfg.trainer.beta2,
    ) == (1.0, 0.95, 0.99, 1.01, 0.9999)


def test_any_staleness_needs_async():
    # one version of staleness is already async behaviour: periodic / sync must refuse it too
    for mode in ("periodic", "sync"):
        msg = load_error(None, [f"pipeline.mode={mode}", "pipeline.max_staleness=1"])
        assert "(top level): pipeline.max_staleness applies to mode 'async' only" in msg
    assert load_config(None, ["pipeline.mode=async", "pipeline.max_staleness=1"]).pipeline.max_staleness == 1


def test_override_key_is_stripped():
    assert parse_overrides(["trainer.lr =0.5"]) == [("trainer.lr", 0.5)]
    assert load_config(None, [" trainer.lr = 0.5"]).trainer.lr == 0.5


def test_missing_required_field_is_named_without_the_section():
    msg = load_error(None, ["task.kind=dataset", "task.dataset={split: train}"])
    assert msg == (
        "invalid config (defaults) with its overrides:\n"
        "  task.dataset.uri: Field required (set by -o task.dataset={split: train})"
    )


def test_an_error_names_the_override_that_set_the_field_not_the_file(tmp_path):
    p = write(tmp_path, "run:\n  iterations: 2\ntrainer:\n  lr: 0.5\n")
    msg = load_error(p, ["run.iterations=abc", "trainer={lr: -1}", "run.seed=1", "rollout.group_size=1"])
    assert msg.splitlines() == [
        f"invalid config {p} with its overrides:",
        "  run.iterations: Input should be a valid integer, unable to parse string as an integer (got 'abc') "
        "(set by -o run.iterations=abc)",
        "  trainer.lr: Input should be greater than 0 (got -1) (set by -o trainer={lr: -1})",
    ]
    assert load_error(p, ["rollout.group_size=-1"]).splitlines() == [
        f"invalid config {p} with its overrides:",
        "  rollout.group_size: Input should be greater than or equal to 1 (got -1) (set by -o rollout.group_size=-1)",
    ]
    p = write(tmp_path, "run:\n  iterations: abc\n")
    assert load_error(p, ["run.seed=1"]).splitlines() == [
        f"invalid config {p} with its overrides:",
        "  run.iterations: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
    ]


def test_a_cross_field_error_names_the_overrides_of_the_fields_it_names():
    msg = load_error(None, ["pipeline.max_staleness=1", "run.seed=3"])
    assert msg.splitlines()[1] == (
        "  (top level): pipeline.max_staleness applies to mode 'async' only; set it to 0 or use mode: async "
        "(set by -o pipeline.max_staleness=1)"
    )
    msg = load_error(None, ["rollout.prompts_per_iteration=5000", "task.n_eval=100", "run.seed=3"])
    assert msg.splitlines()[1].startswith("  (top level): rollout.prompts_per_iteration=5000 exceeds the ")
    assert msg.splitlines()[1].endswith("(set by -o rollout.prompts_per_iteration=5000, -o task.n_eval=100)")
    msg = load_error(None, ["task.dataset.uri=x.jsonl", "task.n_eval=100", "run.seed=3"])  # a key below a named one
    assert msg.splitlines()[1].startswith("  (top level): task.dataset is set but task.kind is 'arithmetic'")
    assert msg.splitlines()[1].endswith("remove the task.dataset section (set by -o task.dataset.uri=x.jsonl)")


def test_an_unknown_key_is_named_with_the_keys_its_section_takes(tmp_path):
    p = write(tmp_path, "trainer:\n  lrr: 1\nrun:\n  iterz: 3\n")
    msg = load_error(p).splitlines()
    trainer_keys = ", ".join(TrainerSection.model_fields)
    assert msg == [
        f"invalid config {p}:",
        "  run.iterz: Extra inputs are not permitted (got 3) (this section takes: name, run_id, seed, iterations)",
        f"  trainer.lrr: Extra inputs are not permitted (got 1); did you mean 'lr'? (this section takes: {trainer_keys})",
    ]
    msg = load_error(None, ["trainr.lr=1e-5", "task.dataset.urix=a"])
    top = ", ".join(Config.model_fields)
    dataset = ", ".join(DatasetSection.model_fields)
    assert (
        f"  trainr: Extra inputs are not permitted (got {{'lr': '1e-5'}}); did you mean 'trainer'? (this section "
        f"takes: {top}) (set by -o trainr.lr=1e-5)"
    ) in msg.splitlines()
    assert (
        "  task.dataset.urix: Extra inputs are not permitted (got 'a'); did you mean 'uri'? (this section takes: "
        f"{dataset}) (set by -o task.dataset.urix=a)"
    ) in msg.splitlines()
    assert "uri, format, split" in dataset and "run, lake, model" in top


def test_later_override_wins():
    assert load_config(None, ["trainer.lr=0.1", "trainer.lr=0.2"]).trainer.lr == 0.2
    cfg = load_config(None, ["trainer={lr: 0.1, weight_decay: 0.3}", "trainer.weight_decay=0.2"])
    assert (cfg.trainer.lr, cfg.trainer.weight_decay) == (0.1, 0.2)


def test_a_quoted_integer_keeps_its_value():
    """A string for a number field is read as the number (YAML 1.1 reads 1e-5 as a string); an integer one must stay
    exact, not pass through a float (12345678901234567 read back as ...568)."""
    assert load_config(None, ['task.split_seed="12345678901234567"']).task.split_seed == 12345678901234567
    assert load_config(None, ['task.split_seed="12345678901234567891"']).task.split_seed == 12345678901234567891
    assert load_config(None, ['task.split_seed="1e3"']).task.split_seed == 1000
    assert load_config(None, ['trainer.lr="3e-4"']).trainer.lr == 3e-4


def test_the_newline_stop_follows_the_tasks_kind_unless_set():
    """Arithmetic answers are one line; a dataset's (GSM8K: steps, then '#### n') are not, and a newline stop cut them
    at their first step. A frozen config from before the field read every response to its first newline."""
    assert load_config(None, []).task.newline_stop() is True
    dataset = ["task.kind=dataset", "task.dataset.uri=x.jsonl", "task.reward=math_verify"]
    assert load_config(None, dataset).task.newline_stop() is False
    assert load_config(None, [*dataset, "task.stop_at_newline=true"]).task.newline_stop() is True
    assert load_config(None, ["task.stop_at_newline=false"]).task.newline_stop() is False
    old = json.loads(resolved_json(load_config(None, dataset)))
    assert old["task"]["stop_at_newline"] is None
    del old["task"]["stop_at_newline"]
    assert frozen_config(old).task.newline_stop() is True


def test_a_frozen_config_older_than_a_field_reads_as_its_run_trained():
    """A run's config.json holds every field of its day: one written before `train.skip_zero_advantage` existed
    trained every group, so it reads as false (not today's default, true), through replay's `frozen_config` and
    resume's copy (`cli._upgraded`); a frozen value is kept either way, and the file's data is not modified."""
    new = json.loads(resolved_json(Config()))
    assert new["train"]["skip_zero_advantage"] is True
    old = json.loads(resolved_json(Config()))
    del old["train"]["skip_zero_advantage"]
    assert frozen_config(old).train.skip_zero_advantage is False
    assert "skip_zero_advantage" not in old["train"]
    assert frozen_config(new).train.skip_zero_advantage is True
    new["train"]["skip_zero_advantage"] = False
    assert upgrade_frozen(new)["train"]["skip_zero_advantage"] is False
    assert json.loads(cli._upgraded(json.dumps(old).encode()))["train"]["skip_zero_advantage"] is False
    assert cli._upgraded(b"not json") == b"not json"  # left to the loader, which names the file
    assert Config.model_validate(old).train.skip_zero_advantage is True  # what reading it plainly would do


# ------------------------------------------------------------------------------------------------ inert settings


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["algorithm.is_cap=3"],
            "algorithm.is_cap is set but has no effect: pipeline.mode is 'periodic', and only async mode's decoupled "
            "loss reads it",
        ),
        (
            ["pipeline.mode=sync", "algorithm.prox_logp=recompute", "algorithm.is_level=sequence"],
            "algorithm.prox_logp, algorithm.is_level are set but have no effect: pipeline.mode is 'sync', and only "
            "async mode's decoupled loss reads them",
        ),
        (
            ["pipeline.mode=async", "algorithm.is_cap=null", "algorithm.is_mode=mask"],
            "algorithm.is_mode is set but has no effect: algorithm.is_cap is null",
        ),
        (["algorithm.kl_kind=k1"], "algorithm.kl_kind is set but has no effect: algorithm.kl_coef is 0 (no KL term)"),
        (
            ["bootstrap.steps=0", "bootstrap.lr=0.01", "bootstrap.check_every=5"],
            "bootstrap.lr, bootstrap.check_every are set but have no effect: bootstrap.steps is 0 (v0 is the model as "
            "it is)",
        ),
        (
            ["bootstrap.check_prompts=10"],
            "bootstrap.check_prompts is set but has no effect: bootstrap.target_accuracy is null",
        ),
        (
            ["rollout.vllm_dtype=bfloat16", "rollout.vllm_max_model_len=512"],
            "rollout.vllm_dtype, rollout.vllm_max_model_len are set but have no effect: rollout.engine is 'builtin'",
        ),
        (
            ["pipeline.mode=async", "pipeline.push_weights=false", "resources.borrow_rollout_threads=true"],
            "pipeline.push_weights is set but has no effect: pipeline.mode is 'async'",
        ),
        (
            ["pipeline.catalog=false", "pipeline.catalog_compact_every=3"],
            "pipeline.catalog_compact_every is set but has no effect: pipeline.catalog is false",
        ),
        (
            ["trainer.min_lr_ratio=0.1"],
            "trainer.min_lr_ratio is set but has no effect: trainer.lr_schedule is 'constant'",
        ),
        (
            ["tracking.enabled=false", "tracking.experiment=x"],
            "tracking.experiment is set but has no effect: tracking.enabled is false",
        ),
        (
            ["model.path=/some/model", "model.tiny.hidden_size=64"],
            "model.tiny is set but has no effect: model.path is set: the model is loaded, not built",
        ),
        (
            ["task.kind=dataset", "task.dataset.uri=x.jsonl", "task.n_shots=2", "task.ops=['+', '-']"],
            "task.ops, task.n_shots are set but have no effect: task.kind is 'dataset', and only the synthetic "
            "arithmetic prompts read them",
        ),
        (
            ["data.on_bad_row=fail"],
            "data.on_bad_row is set but has no effect: task.kind is 'arithmetic', whose prompts are built, not read",
        ),
        (
            ["task.reward=math_verify", "task.partial_credit=0.2"],
            "task.partial_credit is set but has no effect: task.reward is 'math_verify'",
        ),
        (
            ["task.kind=dataset", "task.dataset.uri=x.jsonl", "task.dataset.eval_uri=y.jsonl", "task.split_seed=7"],
            "task.split_seed is set but has no effect: task.dataset.eval_uri is set: the held-out prompts are its "
            "rows, not a split of task.dataset.uri",
        ),
        (
            ["resources.shard_optimizer=true"],
            "resources.shard_optimizer is set but has no effect: resources.train_ranks is 1: one process holds the "
            "whole optimizer",
        ),
        (
            ["algorithm.kl_coef=0.1", "train.skip_zero_advantage=true"],
            "train.skip_zero_advantage is set but has no effect: algorithm.kl_coef is 0.1: the KL term has a "
            "gradient in every group, so none is skipped",
        ),
    ],
)
def test_a_setting_the_run_will_not_read_is_named_with_why(overrides, expected):
    from configs.schema import inert_settings

    notes = inert_settings(load_config(None, overrides))
    assert notes[0] == expected


def test_the_async_settings_inert_outside_async_are_each_named_once():
    """is_mode is inert both outside async and without a cap: named once, under the first reason; and async mode's
    thread borrowing is named with its own reason beside push_weights."""
    from configs.schema import inert_settings

    notes = inert_settings(load_config(None, ["algorithm.is_mode=mask", "algorithm.is_cap=null"]))
    assert notes == [
        "algorithm.is_cap, algorithm.is_mode are set but have no effect: pipeline.mode is 'periodic', and only async "
        "mode's decoupled loss reads them"
    ]
    notes = inert_settings(
        load_config(None, ["pipeline.mode=async", "pipeline.push_weights=false", "resources.borrow_rollout_threads=1"])
    )
    assert notes == [
        "pipeline.push_weights is set but has no effect: pipeline.mode is 'async'",
        "resources.borrow_rollout_threads is set but has no effect: pipeline.mode is 'async', whose workers never idle",
    ]
    notes = inert_settings(load_config(None, ["rollout.engine=vllm", "trainer.device=cuda", "pipeline.push_weights=1"]))
    assert notes == [
        "pipeline.push_weights is set but has no effect: rollout.engine is 'vllm', which loads each version from its "
        "checkpoint"
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        ["pipeline.mode=async", "algorithm.is_cap=3", "algorithm.prox_logp=recompute", "algorithm.is_mode=mask"],
        ["algorithm.kl_coef=0.1", "algorithm.kl_kind=k1"],
        ["bootstrap.target_accuracy=0.5", "bootstrap.check_prompts=10", "bootstrap.lr=0.01"],
        ["rollout.engine=vllm", "trainer.device=cuda", "rollout.vllm_dtype=bfloat16"],
        ["pipeline.push_weights=false", "resources.borrow_rollout_threads=true", "pipeline.catalog_compact_every=3"],
        ["trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.1"],
        ["tracking.experiment=x", "model.tiny.hidden_size=64", "task.n_shots=2", "task.partial_credit=0.2"],
        ["task.kind=dataset", "task.dataset.uri=x.jsonl", "data.on_bad_row=fail", "task.split_seed=7"],
        ["train.skip_zero_advantage=false", "task.split_seed=7"],
        # the defaults that would make a setting inert, given without the setting
        ["pipeline.mode=periodic", "algorithm.kl_coef=0", "bootstrap.steps=0", "tracking.enabled=false"],
    ],
)
def test_a_setting_the_run_reads_or_a_default_is_not_named(overrides):
    from configs.schema import inert_settings

    assert inert_settings(load_config(None, overrides)) == []


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_the_shipped_configs_set_nothing_their_runs_ignore(path):
    from configs.schema import inert_settings

    assert inert_settings(load_config(path)) == []


def test_a_group_of_one_is_named_as_learning_nothing():
    from configs.schema import inert_settings

    assert inert_settings(load_config(None, ["rollout.group_size=1"])) == [
        "rollout.group_size is 1: every advantage estimator compares a response with the rest of its group, so "
        "every advantage is 0 and the policy learns nothing from the rewards; use group_size >= 2"
    ]
    assert inert_settings(load_config(None, ["rollout.group_size=2"])) == []


def test_rollout_workers_beyond_an_iterations_chunks_are_named_in_sync_and_periodic():
    """32 groups in shards of 4 are 8 chunks: a 9th worker of a periodic run never gets one, yet starts and loads the
    model (64 workers on 2 cores: a first iteration of 42 s against 4-7 s, said by nothing). Async workers take the
    next batches' chunks too: not named there."""
    from configs.schema import inert_settings

    eight = ["rollout.prompts_per_iteration=32", "pipeline.shard_groups=4"]
    assert inert_settings(load_config(None, [*eight, "resources.rollout_workers=8"])) == []
    for mode in ("periodic", "sync"):
        assert inert_settings(load_config(None, [*eight, "resources.rollout_workers=9", f"pipeline.mode={mode}"])) == [
            "resources.rollout_workers is 9 but an iteration has 8 chunk(s) of work (rollout.prompts_per_iteration 32 "
            "/ pipeline.shard_groups 4): 1 worker(s) would never get one, yet each starts and loads the model; lower "
            "rollout_workers to 8 or pipeline.shard_groups"
        ]
    assert inert_settings(load_config(None, ["rollout.prompts_per_iteration=30", "resources.rollout_workers=8"])) == []
    assert inert_settings(load_config(None, ["resources.rollout_workers=9", *eight, "pipeline.mode=async"])) == []


def test_extra_fields_name_keyword_arguments_of_a_users_reward_only():
    """`task.dataset.extra_fields` go to the user's reward function as keyword arguments: a built-in reward takes
    none, a name the function already receives, an empty name or one given twice is refused with the field's path."""
    dataset = ["task.kind=dataset", "task.dataset.uri=x.jsonl"]
    cfg = load_config(None, [*dataset, "task.reward=mod:f", "task.dataset.extra_fields=[tests, meta]"])
    assert cfg.task.reward_fields() == ("tests", "meta")
    assert load_config(None, [*dataset, "task.reward=mod:f"]).task.reward_fields() == ()
    assert load_config(None, []).task.reward_fields() == ()  # arithmetic: no dataset
    message = load_error(None, [*dataset, "task.reward=math_verify", "task.dataset.extra_fields=[tests]"])
    assert "task.dataset.extra_fields ['tests'] are passed to your own task.reward function" in message
    assert "the built-in 'math_verify', which takes none" in message
    for given, words in [
        ("[prompt]", "'prompt' is the name of an argument task.reward already receives (response, answer, prompt)"),
        ("[answer]", "'answer' is the name of an argument task.reward already receives"),
        ("['']", "an empty field name"),
        ("[a, b, a]", "['a', 'b', 'a'] lists a field twice"),
    ]:
        message = load_error(None, [*dataset, "task.reward=mod:f", f"task.dataset.extra_fields={given}"])
        assert "task.dataset.extra_fields" in message and words in message, message


def test_a_batched_reward_is_a_users_function_and_reaches_its_loader():
    """task.reward_batch: off by default, passed on to the reward's loader, refused with a built-in reward (which
    scores one response at a time) with what to set instead."""
    assert load_config(None, []).task.reward_batch is False
    cfg = load_config(None, ["task.reward=mod:f", "task.reward_batch=true"])
    assert cfg.task.reward_settings()["batch"] is True
    for builtin in ("arithmetic", "math_verify"):
        message = load_error(None, [f"task.reward={builtin}", "task.reward_batch=true"])
        assert (
            f"task.reward_batch calls your own task.reward function with lists, and task.reward is the built-in "
            f"{builtin!r}, which scores one response at a time: set task.reward to FILE.py:FUNCTION, or remove "
            "reward_batch" in message
        ), message


def test_scoring_beside_generation_is_off_by_default_and_a_bool():
    assert load_config(None, []).pipeline.overlap_scoring is False
    assert load_config(None, ["pipeline.overlap_scoring=true"]).pipeline.overlap_scoring is True
    message = load_error(None, ["pipeline.overlap_scoring=sometimes"])
    assert "pipeline.overlap_scoring" in message and "bool" in message, message


def test_a_reward_time_limit_is_positive_and_named_inert_for_a_builtin_reward():
    from configs.schema import inert_settings

    cfg = load_config(None, ["task.reward=mod:f", "task.reward_timeout_s=2.5"])
    assert cfg.task.reward_settings() == {
        "kind": "mod:f",
        "partial_credit": 0.5,
        "fields": (),
        "timeout_s": 2.5,
        "batch": False,
    }
    assert load_config(None, []).task.reward_settings()["timeout_s"] is None
    assert "task.reward_timeout_s" in load_error(None, ["task.reward=mod:f", "task.reward_timeout_s=0"])
    assert "less than or equal to 86400" in load_error(None, ["task.reward=mod:f", "task.reward_timeout_s=1e10"])
    notes = inert_settings(load_config(None, ["task.reward_timeout_s=1"]))
    assert notes == [
        "task.reward_timeout_s is set but has no effect: task.reward is the built-in 'arithmetic', which is not "
        "called under a time limit"
    ]
    assert inert_settings(cfg) == []  # a user's function: the limit applies
