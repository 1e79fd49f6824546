"""tasks/preflight.py and models.tiny.check_model_dir: a model or dataset the run could not use, a Prefect API or
an MLflow tracking store that does not answer, fails before any work, with the field, the value and what to do;
`lockstep train` turns that into exit 2 without a traceback."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from configs.schema import ConfigError, load_config, resolved_json
from flows import cli
from models.rewards import error_line
from models.tiny import (
    DEFAULT_ALPHABET,
    ModelDirError,
    _check_tokenizer,
    build_char_tokenizer,
    build_tiny_model,
    check_model_dir,
    load_hf,
    save_hf,
)
from tasks.preflight import InputError, check_backend, check_inputs, check_prefect_api, check_tracking
from tests.cli_output import cli_stderr, squash
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
ARITH = str(REPO / "configs" / "arith-tiny.yaml")
TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A complete tiny Hugging Face directory, made by the project's own builders (tests copy it to break it)."""
    tok = build_char_tokenizer()
    return save_hf(build_tiny_model(len(tok), **TINY), tok, tmp_path_factory.mktemp("models") / "good")


def broken(model_dir: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    for name in drop:
        (out / name).unlink()
    return out


def model_error(path) -> str:
    with pytest.raises(ModelDirError) as e:
        check_model_dir(path)
    return str(e.value)


def input_error(cfg) -> str:
    with pytest.raises(InputError) as e:
        check_inputs(cfg)
    assert isinstance(e.value, ConfigError)  # the CLI's exit-2 path
    return str(e.value)


# ------------------------------------------------------------------------------------------------ model directories


def test_good_model_dir_passes(model_dir):
    check_model_dir(model_dir)
    check_inputs(load_config(ARITH, [f"model.path={model_dir}"]))


def test_missing_config(model_dir, tmp_path):
    d = broken(model_dir, tmp_path, ("config.json",))
    assert model_error(d).startswith(f"{d} has no config.json: not a Hugging Face model directory")


def test_config_not_json_or_without_model_type(model_dir, tmp_path):
    d = broken(model_dir, tmp_path)
    (d / "config.json").write_text("{not json")
    assert model_error(d).startswith(f"{d}/config.json is not valid JSON (Expecting property name")
    (d / "config.json").write_text(json.dumps({"vocab_size": 10}))
    assert model_error(d).startswith(f"{d}/config.json has no `model_type`")


def test_missing_or_unreadable_weights(model_dir, tmp_path):
    d = broken(model_dir, tmp_path, ("model.safetensors",))
    assert model_error(d) == (
        f"{d} has no weights (*.safetensors or pytorch_model*.bin); save the model with save_pretrained"
    )
    (d / "model.safetensors").write_bytes(b"garbage")
    assert model_error(d).startswith(f"{d}/model.safetensors is not a readable safetensors file (")


def test_missing_tokenizer(model_dir, tmp_path):
    # without these, AutoTokenizer built a tokenizer from config.json alone that encodes "\n" as nothing: the run
    # failed at its first evaluation
    d = broken(model_dir, tmp_path, ("tokenizer.json", "tokenizer_config.json"))
    assert model_error(d).startswith(f"{d} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def test_tokenizer_larger_than_the_embedding(tmp_path):
    tok = build_char_tokenizer()  # 4 specials + 49 characters = 53 tokens
    big = build_char_tokenizer("0123456789+-*=?:. \nQAabcdefghijklmnopqrstuvwxyzBCDEFGHIJKLMNOPRSTUVWXYZ,#")
    d = save_hf(build_tiny_model(len(tok), **TINY), big, tmp_path / "mismatch")
    expected = f"{d}: tokenizer has {len(big)} tokens but config.json vocab_size={len(tok)}"
    assert (len(tok), len(big)) == (53, 77)
    assert model_error(d).startswith(expected)
    # every load path gets it, not an IndexError in the first forward pass
    with pytest.raises(ModelDirError, match=expected):
        load_hf(d)


def _edit_config(d: Path, **fields) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **fields}))


def test_a_config_that_builds_no_model_or_another_one_than_the_weights_is_refused(model_dir, tmp_path):
    """What from_pretrained failed on after the run's config was frozen (a traceback, the run never resumable):
    named before any work. Tensors under names the model does not have are not judged (transformers renames many at
    load): `test_weights_under_names_transformers_renames_are_not_refused`."""
    d = broken(model_dir, tmp_path)
    _edit_config(d, model_type="foo")
    assert model_error(d).startswith(f"{d}/config.json does not build a causal language model (ValueError: ")
    d = broken(model_dir, tmp_path / "dtype")
    _edit_config(d, dtype="float99")
    assert model_error(d).startswith(f"{d}/config.json does not build a causal language model (AttributeError: ")
    d = broken(model_dir, tmp_path / "size")
    _edit_config(d, hidden_size=32)
    assert model_error(d) == (
        f"{d}/model.safetensors: tensor model.embed_tokens.weight has shape [53, 16] where {d}/config.json makes it "
        "[53, 32]: the weights and the config are of different models; save both with save_pretrained"
    )


def test_weights_under_names_transformers_renames_are_not_refused(tmp_path):
    """A GPT-2 saved without its head's prefix (`h.0...` where the model has `transformer.h.0...`, the layout of the
    published gpt2 files) loads with from_pretrained: the check must let it through, as it does a tied head."""
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_char_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=16, n_layer=1, n_head=2))
    d = save_hf(model, tok, tmp_path / "gpt2")
    weights = load_file(str(d / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, str(d / "model.safetensors"))
    assert not any(k.startswith("transformer.") for k in load_file(str(d / "model.safetensors")))
    check_model_dir(d)
    loaded, _ = load_hf(d)
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)  # renamed at load, not lost


def test_a_tokenizer_file_that_does_not_load_is_named_not_a_traceback(model_dir, tmp_path):
    d = broken(model_dir, tmp_path)
    (d / "tokenizer.json").write_text("{}")
    assert model_error(d) == f"{d}: the tokenizer does not load (KeyError: 'added_tokens')"


def test_a_model_with_fewer_learned_positions_than_a_prompt_and_its_response_is_refused(tmp_path):
    """GPT-2's learned positions failed with an IndexError at the first evaluation, after the run was written; a
    rotary model (the tiny Qwen2) with as few declared positions is left to run (rope scaling extends some)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tasks.session import check_task

    tok = build_char_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2)
    d = save_hf(GPT2LMHeadModel(config), tok, tmp_path / "gpt2")
    cfg = load_config(ARITH, [f"model.path={d}", "rollout.max_new_tokens=10"])
    with pytest.raises(
        InputError,
        match=rf"model.path '{d}' takes 64 positions, but the longest prompt has \d+ tokens and a response up to 10 "
        r"\(rollout / eval max_new_tokens\)",
    ):
        check_task(cfg)
    config.n_positions = 1024
    check_task(load_config(ARITH, [f"model.path={save_hf(GPT2LMHeadModel(config), tok, tmp_path / 'long')}"]))
    rotary = save_hf(build_tiny_model(len(tok), **TINY), tok, tmp_path / "rotary")
    _edit_config(rotary, max_position_embeddings=64)
    check_task(load_config(ARITH, [f"model.path={rotary}", "rollout.max_new_tokens=10"]))


def test_check_model_dir_refuses_a_file(model_dir):
    path = model_dir / "config.json"
    with pytest.raises(ModelDirError, match="is not a directory") as e:
        check_model_dir(path)
    assert str(e.value) == f"{path} is not a directory: give a Hugging Face model directory"


def test_a_tokenizer_in_the_slow_format_is_accepted(model_dir, tmp_path):
    """vocab.json + merges.txt + tokenizer_config.json, no tokenizer.json (the format of many hub repos): it loads the
    same ids, so the check passes; tokenizer.json is not required when tokenizer_config.json is there."""
    d = broken(model_dir, tmp_path)
    tok = build_char_tokenizer()
    (d / "tokenizer.json").unlink()
    (d / "vocab.json").write_text(json.dumps(tok.get_vocab()))
    (d / "merges.txt").write_text("#version: 0.2\n")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    check_model_dir(d)
    _, loaded = load_hf(d)
    text = "Q: 12+7=?\nA: 19\n"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]


def test_a_tokenizer_one_token_larger_than_the_embedding_is_refused(tmp_path):
    """54 tokens against vocab_size 53: the single extra id would already index past the embedding table."""
    tok = build_char_tokenizer()
    d = save_hf(build_tiny_model(len(tok), **TINY), build_char_tokenizer(DEFAULT_ALPHABET + "B"), tmp_path / "m")
    with pytest.raises(ModelDirError, match="tokenizer has 54 tokens but config.json vocab_size=53"):
        check_model_dir(d)
    with pytest.raises(ModelDirError, match="tokenizer has 54 tokens but config.json vocab_size=53"):
        load_hf(d)


def test_a_config_without_a_top_level_vocab_size_has_nothing_to_compare(model_dir, tmp_path):
    """Some multimodal configs keep vocab_size in a sub-config: the check passes instead of raising a TypeError."""
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"] = {"vocab_size": config.pop("vocab_size")}
    _check_tokenizer(model_dir, config, AutoTokenizer.from_pretrained(str(model_dir)))  # no TypeError


def test_load_hf_honours_dtype_and_attention_kernel(model_dir):
    model, tok = load_hf(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    assert not model.training and len(tok) == 53
    model, _ = load_hf(model_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"


def test_a_tokenizer_config_without_its_vocabulary_is_refused(model_dir, tmp_path):
    """tokenizer_config.json alone loads a 5-token tokenizer that encodes every text as []: refused before a run,
    by check_model_dir and by load_hf alike, naming the files that carry the vocabulary."""
    d = broken(model_dir, tmp_path)
    (d / "tokenizer.json").unlink()
    for check in (check_model_dir, load_hf):
        with pytest.raises(
            ModelDirError,
            match=r"encodes 'Q: 12\+7=\?\\nA: 19\\n' as \[\]: its vocabulary is "
            r"missing \(tokenizer.json, or vocab.json",
        ):
            check(d)


def test_a_tokenizer_json_without_its_config_is_refused_with_the_reason(model_dir, tmp_path):
    """tokenizer.json alone: transformers adds its class's default special token (54 tokens for 53 embeddings); the
    error says the config file is what is missing."""
    d = broken(model_dir, tmp_path)
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(
        ModelDirError,
        match=r"tokenizer has 54 tokens but config.json vocab_size=53: .* \(there is "
        r"no tokenizer_config.json, so Qwen2Tokenizer added its default special "
        r"tokens",
    ):
        check_model_dir(d)


def _word_level(words: list[str]):
    """A word-level tokenizer (whitespace-split words, <unk> for the rest), as some non-LLM vocabularies are."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(["<unk>", "<pad>", *words])}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


@pytest.mark.parametrize(
    "tok, refused",
    [
        (build_char_tokenizer("0123456789+= \n"), False),  # the characters it lacks are dropped, the digits encode
        (build_char_tokenizer("xyz"), True),  # every character dropped: no tokens
        (_word_level(["A", "19"]), False),  # some words known
        (_word_level(["hello"]), True),  # every word <unk>
    ],
    ids=["char-digits", "char-none", "words-some", "words-none"],
)
def test_a_tokenizer_that_encodes_none_of_the_probe_is_refused(tok, refused):
    """A tokenizer that turns the probe text into no tokens, or into <unk> only, is refused like one without a
    vocabulary; one that still encodes part of it is accepted. Checked on the tokenizer in memory: transformers
    reloads a saved word-level tokenizer as the model type's own class."""
    if refused:
        with pytest.raises(ModelDirError, match="its vocabulary is missing"):
            _check_tokenizer(Path("m"), {"vocab_size": 64}, tok)
    else:
        _check_tokenizer(Path("m"), {"vocab_size": 64}, tok)


# ------------------------------------------------------------------------------------------------ model.path


@pytest.mark.parametrize("path", ["/nonexistent/model", "./models/none", "~/model", "a/b/c"])
def test_path_like_model_that_is_not_a_directory(path):
    msg = input_error(load_config(ARITH, [f"model.path={path}"]))
    assert msg.startswith(f"model.path {path!r} is not a directory")
    assert msg.endswith(
        "give a local Hugging Face model directory (config.json, weights, tokenizer) or a hub id "
        "such as Qwen/Qwen2.5-0.5B"
    )


def test_a_file_is_not_a_model_directory(model_dir):
    path = str(model_dir / "config.json")
    assert input_error(load_config(ARITH, [f"model.path={path}"])).startswith(f"model.path {path!r} is not a directory")


def test_broken_model_dir_names_the_field(model_dir, tmp_path):
    d = broken(model_dir, tmp_path, ("model.safetensors",))
    assert input_error(load_config(ARITH, [f"model.path={d}"])).startswith(f"model.path: {d} has no weights")


def test_hub_id_offline_must_be_cached(monkeypatch, tmp_path, model_dir):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    msg = input_error(load_config(ARITH, ["model.path=Org/not-cached"]))
    assert msg.startswith(
        "model.path 'Org/not-cached' is not a local directory, and as a hub id it is not in the "
        f"Hugging Face cache ({tmp_path / 'hub'}) while HF_HUB_OFFLINE=1 forbids downloading"
    )
    assert input_error(load_config(ARITH, ["model.path=not a valid id!!"])).startswith(
        "model.path 'not a valid id!!' is neither a local directory nor a hub id"
    )
    # the cache layout from_pretrained reads: models--Org--tiny/refs/main names the snapshot
    repo = tmp_path / "hub" / "models--Org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    shutil.copytree(model_dir, repo / "snapshots" / "abc123")
    check_inputs(load_config(ARITH, ["model.path=Org/tiny"]))
    (repo / "snapshots" / "abc123" / "tokenizer.json").unlink()
    (repo / "snapshots" / "abc123" / "tokenizer_config.json").unlink()
    assert "model.path 'Org/tiny' (Hugging Face cache): " in input_error(load_config(ARITH, ["model.path=Org/tiny"]))
    # online, an uncached id is from_pretrained's to download, and so is what a partial cache lacks (here the
    # tokenizer files deleted above: a download cut short, or an earlier AutoConfig call)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_inputs(load_config(ARITH, ["model.path=Org/not-cached"]))
    check_inputs(load_config(ARITH, ["model.path=Org/tiny"]))


# ------------------------------------------------------------------------------------------------ datasets


def dataset_config(tmp_path, uri: str, *extra: str):
    return load_config(None, ["task.kind=dataset", f"task.dataset.uri={uri}", f"lake.uri={tmp_path / 'lake'}", *extra])


def test_dataset_csv_and_missing_eval_file(tmp_path):
    good = tmp_path / "train.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    check_inputs(dataset_config(tmp_path, str(good)))
    (tmp_path / "d.csv").write_text("question,answer\n")
    msg = input_error(dataset_config(tmp_path, str(tmp_path / "d.csv")))
    assert msg.startswith(f"task.dataset.uri: {tmp_path / 'd.csv'}: file extension .csv is not supported")
    msg = input_error(dataset_config(tmp_path, str(good), f"task.dataset.eval_uri={tmp_path / 'eval.jsonl'}"))
    assert (
        msg == f"task.dataset.eval_uri: {tmp_path / 'eval.jsonl'} (format jsonl): no such file; check "
        "task.dataset.uri / eval_uri"
    )
    msg = input_error(dataset_config(tmp_path, str(good), "task.dataset.format=parquet"))
    assert msg.startswith(f"task.dataset.uri: {good} (format parquet) is not a Parquet file")


# ------------------------------------------------------------------------------------------------ the CLI


def test_cli_train_bad_model_path_exits_2_before_any_work(tmp_path, capsys):
    lake = tmp_path / "lake"
    assert cli.main(["train", ARITH, "-o", "model.path=/nonexistent/model", "-o", f"lake.uri={lake}"]) == 2
    assert squash("error: model.path '/nonexistent/model' is not a directory") in cli_stderr(capsys)
    assert not lake.exists()


def test_cli_train_vocab_mismatch_exits_2(tmp_path, capsys):
    tok = build_char_tokenizer("0123456789")
    d = save_hf(build_tiny_model(len(tok), **TINY), build_char_tokenizer(), tmp_path / "mismatch")
    assert cli.main(["train", ARITH, "-o", f"model.path={d}", "-o", f"lake.uri={tmp_path / 'lake'}"]) == 2
    assert squash(f"error: model.path: {d}: tokenizer has 53 tokens but config.json vocab_size=14") in cli_stderr(
        capsys
    )


def test_cli_train_csv_dataset_exits_2(tmp_path, capsys):
    (tmp_path / "d.csv").write_text("question,answer\n")
    assert (
        cli.main(
            [
                "train",
                ARITH,
                "-o",
                "task.kind=dataset",
                "-o",
                "task.shot_sets=1",
                "-o",
                f"task.dataset.uri={tmp_path / 'd.csv'}",
                "-o",
                f"lake.uri={tmp_path / 'lake'}",
            ]
        )
        == 2
    )
    err = cli_stderr(capsys)
    assert squash(f"error: task.dataset.uri: {tmp_path / 'd.csv'}: file extension .csv is not supported") in err
    assert "datasets`package" not in err


# ------------------------------------------------------------------------------------------------ servers


@contextlib.contextmanager
def http_server(status: int, body: bytes):
    """A local HTTP server answering every GET with `status` and `body`: something that answers but is not a
    Prefect API (a wrong port, the UI's address)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def prefect_error(url: str) -> str:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), pytest.raises(InputError) as e:
        check_prefect_api()
    return str(e.value)


def test_prefect_api_that_is_not_an_url():
    assert prefect_error("foo").startswith("PREFECT_API_URL='foo' is not an http(s) URL (UnsupportedProtocol: ")


def test_prefect_api_that_does_not_answer():
    url = f"http://127.0.0.1:{free_port()}/api"
    msg = prefect_error(url)
    assert msg.startswith(f"the Prefect API at PREFECT_API_URL={url} is unreachable (ConnectError: ")
    assert msg.endswith(
        "start it with `make services`, fix PREFECT_API_URL (e.g. http://127.0.0.1:4200/api), or "
        "unset it to run on a temporary local Prefect server"
    )


@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (404, b"not found", "PrefectHTTPStatusError: Client error '404 Not Found'"),
        (200, b"<html>the UI</html>", "JSONDecodeError: "),  # a server that answers every path with a page
    ],
)
def test_prefect_api_url_of_something_else(status, body, why):
    with http_server(status, body) as base:
        msg = prefect_error(f"{base}/api")
    assert msg.startswith(f"PREFECT_API_URL={base}/api is not a Prefect API ({why}")


def test_prefect_api_that_answers_its_version_passes():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with http_server(200, b'"3.9.1"') as base, temporary_settings({PREFECT_API_URL: f"{base}/api"}):
        check_prefect_api()  # GET /api/admin/version answered with a JSON string, as Prefect's server does


def test_cli_train_and_replay_with_an_unreachable_prefect_api_exit_2_before_any_work(tmp_path, capsys, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import flows.replay

    monkeypatch.setattr(flows.replay, "replay_flow", lambda **kw: pytest.fail("the replay flow must not start"))
    url = f"http://127.0.0.1:{free_port()}/api"
    lake = tmp_path / "lake"
    with temporary_settings({PREFECT_API_URL: url}):
        assert cli.main(["train", ARITH, "-o", f"lake.uri={lake}"]) == 2
        assert squash(f"error: the Prefect API at PREFECT_API_URL={url} is unreachable (ConnectError:") in (
            cli_stderr(capsys)
        )
        assert not lake.exists()
        run = lake / "runs" / "r1"
        run.mkdir(parents=True)
        (run / "config.json").write_text(resolved_json(load_config(None, ["run.run_id=r1"])))
        (run / "checkpoints" / "v000000").mkdir(parents=True)  # a promoted v0: replay's own check passes
        (run / "checkpoints" / "v000000" / "MANIFEST.json").write_text("{}")
        (run / "checkpoints" / "PROMOTED").write_text('{"version": 0}')
        assert cli.main(["replay", "r1", "--lake", str(lake)]) == 2
        assert squash(f"error: cannot replay 'r1': the Prefect API at PREFECT_API_URL={url} is unreachable") in (
            cli_stderr(capsys)
        )


def tracking_error(*overrides: str) -> str:
    with pytest.raises(InputError) as e:
        check_tracking(load_config(ARITH, list(overrides)))
    assert str(e.value).endswith(
        "give sqlite:///PATH (the default is sqlite:///mlflow.db), the http(s) URL of a running MLflow server "
        "(`make services` starts one at http://127.0.0.1:5000), or set tracking.enabled=false"
    )
    return str(e.value)


def test_tracking_server_that_does_not_answer_fails_at_once(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")  # MLflow's default: ~4 minutes of retries
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    msg = tracking_error(f"tracking.uri={url}")
    assert time.monotonic() - t0 < 30  # one attempt (0.02 s here), not the run's retries
    assert msg.startswith(
        f"tracking.uri {url!r} cannot be used (MlflowException: API request to {url}/api/2.0/"
        "mlflow/experiments/search failed"
    )
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"  # the run keeps the user's settings
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


@pytest.mark.parametrize("uri", ["mlflow.db", "file:./mlruns"])
def test_tracking_file_store_is_refused_before_the_run(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tracking_error(f"tracking.uri={uri}").startswith(
        f"tracking.uri {uri!r} cannot be used (MlflowException: The filesystem tracking backend"
    )


def test_tracking_sqlite_store_passes_and_disabled_tracking_is_not_opened(tmp_path):
    db = tmp_path / "t" / "mlflow.db"
    check_tracking(load_config(ARITH, [f"tracking.uri=sqlite:///{db}"]))
    assert db.is_file()  # created as the run would (and reused by it)
    check_tracking(load_config(ARITH, [f"tracking.uri=sqlite:///{tmp_path / 'off.db'}", "tracking.enabled=false"]))
    assert not (tmp_path / "off.db").exists()


_CHECK_AT_ONCE = """
import os, sys, time
from configs.schema import load_config
from tasks.preflight import check_tracking
cfg = load_config(sys.argv[1], [f"tracking.uri=sqlite:///{sys.argv[2]}"])
while not os.path.exists(sys.argv[3]):  # imports done: all start the check at the same moment
    time.sleep(0.005)
check_tracking(cfg)
print("ok")
"""


def test_processes_opening_a_new_sqlite_store_at_once_all_pass(tmp_path):
    """MLflow creates a new store's tables as it first opens it; two `lockstep train` started together on a new
    mlflow.db failed one of them ("table latest_metrics already exists", or a migration that found no row to
    update: 3 runs of 3 by hand). The check takes turns on the store's folder."""
    import subprocess
    import sys

    db, go = tmp_path / "store" / "mlflow.db", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHECK_AT_ONCE, ARITH, str(db), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    time.sleep(0.5)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    assert [out for out, _ in results] == ["ok\n"] * 3, [err[-600:] for _, err in results]
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db"]  # the lock leaves no file


@pytest.mark.parametrize("flock_error", [OSError(37, "No locks available"), BlockingIOError(11, "held")])
def test_a_store_whose_folder_takes_no_lock_is_opened_without_one(tmp_path, monkeypatch, flock_error):
    """A filesystem without flock (Lustre without -o flock, some NFS) or a holder that keeps the lock past
    `_LOCK_WAIT_S`: the store is opened as before the lock existed, not refused."""
    import fcntl

    from tasks import preflight

    def flock(fd, op):
        raise flock_error

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(preflight, "_LOCK_WAIT_S", 0.2)
    db = tmp_path / "mlflow.db"
    t0 = time.monotonic()
    check_tracking(load_config(ARITH, [f"tracking.uri=sqlite:///{db}"]))
    assert db.is_file() and (time.monotonic() - t0 < 30)


def test_cli_train_with_an_unreachable_tracking_server_exits_2_before_the_flow(tmp_path, capsys, monkeypatch):
    """Refused by the CLI before the flow's imports and the temporary Prefect server's start (found in the flow
    before: `tracking.uri=bogus://x` took 13.8 s to refuse, 6.0 s now, by hand on this machine)."""
    from tests.unit.test_cli_commands import replace_flow

    server = replace_flow(monkeypatch, lambda **kwargs: pytest.fail("the flow must not start"), tracking=True)
    lake = tmp_path / "lake"
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["train", ARITH, "-o", f"lake.uri={lake}", "-o", f"tracking.uri={url}"]) == 2
    assert squash(f"error: tracking.uri '{url}' cannot be used (MlflowException:") in cli_stderr(capsys)
    assert server == [] and not lake.exists()


def test_a_flow_called_with_an_unreachable_tracking_server_writes_nothing(tmp_path):
    # the real flow, as a script calls it: open_session checks the store before it writes the run and spends
    # minutes on the bootstrap
    from flows.train import train_flow

    lake = tmp_path / "lake"
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(InputError, match=f"^tracking.uri '{url}' cannot be used \\(MlflowException:"):
        train_flow.fn(config_path=ARITH, overrides=[f"lake.uri={lake}", f"tracking.uri={url}"])
    assert not list(lake.rglob("*.json")), "nothing of the run may be written"


def test_cli_train_with_a_reward_function_that_cannot_serve_exits_2_before_the_flow(tmp_path, capsys, monkeypatch):
    from tests.unit.test_cli_commands import replace_flow

    server = replace_flow(monkeypatch, lambda **kwargs: pytest.fail("the flow must not start"))
    (tmp_path / "r.py").write_text("def score(response):\n    return 1.0\n")
    lake = tmp_path / "lake"
    assert cli.main(["train", ARITH, "-o", f"lake.uri={lake}", "-o", f"task.reward={tmp_path}/r.py:score"]) == 2
    assert squash(
        f"error: task.reward '{tmp_path}/r.py:score': score(response) cannot be called as score(response, answer)"
    ) in cli_stderr(capsys)
    assert server == [] and not lake.exists()


def test_a_flow_called_with_a_missing_reward_function_writes_nothing(tmp_path):
    from flows.train import train_flow

    lake = tmp_path / "lake"
    (tmp_path / "r.py").write_text("def score(response, answer):\n    return 1.0\n")
    with pytest.raises(
        InputError, match=f"^task.reward '{tmp_path}/r.py:scores': {tmp_path}/r.py defines no 'scores'$"
    ):
        train_flow.fn(config_path=ARITH, overrides=[f"lake.uri={lake}", f"task.reward={tmp_path}/r.py:scores"])
    assert not lake.exists()


# ------------------------------------------------------------------------------------------------ device, engine


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cli_train_on_cuda_without_a_cuda_device_exits_2_before_any_work(tmp_path, capsys):
    lake = tmp_path / "lake"
    assert cli.main(["train", ARITH, "-o", "trainer.device=cuda", "-o", f"lake.uri={lake}"]) == 2
    assert squash(
        "error: trainer.device is 'cuda' but no CUDA device is visible; use trainer.device=cpu (or auto)"
    ) in cli_stderr(capsys)  # was a RuntimeError traceback from inside the flow
    assert not lake.exists()


@pytest.mark.skipif(_has("torch_npu"), reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_an_input_error():
    with pytest.raises(InputError, match=r"trainer.device is 'npu' but torch_npu is missing: pip install "):
        check_backend(load_config(ARITH, ["trainer.device=npu"]))


@pytest.mark.skipif(_has("vllm"), reason="vLLM is installed here")
def test_vllm_engine_without_vllm_is_an_input_error_before_the_device():
    with pytest.raises(
        InputError,
        match=r"rollout.engine is 'vllm' but vLLM is not installed: .*; or set "
        r"rollout.engine=builtin",
    ):
        check_backend(load_config(ARITH, ["rollout.engine=vllm", "trainer.device=cuda"]))


def test_more_trainer_ranks_than_cuda_devices_is_an_input_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = load_config(ARITH, ["trainer.device=cuda", "resources.train_ranks=2"])
    with pytest.raises(InputError, match=r"resources.train_ranks is 2 but 1 cuda device\(s\) are visible .*at most 1"):
        check_backend(cfg)
    assert check_backend(load_config(ARITH, ["trainer.device=cuda"])).type == "cuda"  # one rank: one device
    assert check_backend(load_config(ARITH, ["trainer.device=cpu", "resources.train_ranks=2"])).type == "cpu"


def test_cpu_and_auto_pass():
    check_backend(load_config(ARITH, ["trainer.device=cpu"]))
    check_backend(load_config(ARITH, ["trainer.device=auto"]))


@pytest.mark.parametrize("value", ["true", "yes", "On", " 1 "])
def test_offline_spellings_are_all_offline(monkeypatch, tmp_path, value):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert input_error(load_config(ARITH, ["model.path=Org/not-cached"])).startswith(
        "model.path 'Org/not-cached' is not a local directory, and as a hub id it is not in the Hugging Face cache"
    )


def test_tilde_path_says_it_is_not_expanded():
    msg = input_error(load_config(ARITH, ["model.path=~/model"]))
    assert msg.startswith("model.path '~/model' is not a directory (~ is not expanded: write the full path): give")
    assert "~ is not expanded" not in input_error(load_config(ARITH, ["model.path=./model"]))


def test_hub_id_cached_as_missing_offline(monkeypatch, tmp_path):
    """The cache's marker of a file known not to exist (.no_exist/<rev>/config.json) is not a cached model."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--Org--gone"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / ".no_exist" / "abc123").mkdir(parents=True)
    (repo / ".no_exist" / "abc123" / "config.json").touch()
    msg = input_error(load_config(ARITH, ["model.path=Org/gone"]))
    assert msg.startswith(
        "model.path 'Org/gone' is not a local directory, and as a hub id it is not in the Hugging "
        f"Face cache ({tmp_path / 'hub'}) while HF_HUB_OFFLINE=1 forbids downloading"
    )


def test_dataset_and_eval_dataset_are_checked_with_their_own_splits(monkeypatch, tmp_path):
    import storage.datasets

    seen = []
    monkeypatch.setattr(storage.datasets, "check_readable", lambda uri, fmt, split: seen.append((uri, fmt, split)))
    check_inputs(
        load_config(
            None,
            [
                "task.kind=dataset",
                f"lake.uri={tmp_path / 'lake'}",
                "task.dataset={uri: org/train-set, eval_uri: org/eval-set, format: hf, "
                "split: train, eval_split: validation}",
            ],
        )
    )
    assert seen == [("org/train-set", "hf", "train"), ("org/eval-set", "hf", "validation")]


def test_an_error_is_told_in_one_line_cut_at_200_characters():
    assert error_line(ValueError("x" * 400)) == "ValueError: " + "x" * 197 + "..."
    assert error_line(ValueError("x" * 200)) == "ValueError: " + "x" * 200
    assert error_line(RuntimeError("\n first\nsecond")) == "RuntimeError: first ..."
    assert error_line(KeyError()) == "KeyError"
