"""models/tiny.py: the character tokenizer's alphabet edge cases, what `build_tiny_model` promises (architecture,
seed, tied embeddings, eval mode, the global RNG left alone), `single_token_id`, and the model-directory checks shared
by `check_model_dir` and `load_hf`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from models.tiny import (
    DEFAULT_ALPHABET,
    ModelDirError,
    build_char_tokenizer,
    build_tiny_model,
    check_model_dir,
    load_hf,
    save_hf,
    single_token_id,
)

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n\t"  # every printable ASCII character, '~' (126) last


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = build_char_tokenizer()
    return save_hf(build_tiny_model(len(tok), **TINY), tok, tmp_path_factory.mktemp("tiny") / "good")


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


# ------------------------------------------------------------------------------------------------ tokenizer


def test_every_printable_ascii_character_is_one_token_and_survives_save_and_load(tmp_path):
    """Each of the 97 characters gets its own id, in alphabet order (no <unk>), decodes back, and the saved tokenizer
    encodes the same ids (the byte-level table must cover '~', the last printable byte)."""
    tok = build_char_tokenizer(PRINTABLE)
    ids = tok(PRINTABLE, add_special_tokens=False)["input_ids"]
    assert ids == list(range(4, 4 + len(PRINTABLE)))
    assert tok.decode(ids) == PRINTABLE
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path))(PRINTABLE, add_special_tokens=False)["input_ids"] == ids


def test_non_ascii_alphabet_is_refused():
    """A Latin-1 letter is two bytes under the byte-level pre-tokenizer, so it could never be one token: refused."""
    for alphabet in ("abé", "ab\xff", "a€"):
        with pytest.raises(ValueError, match="the character tokenizer supports ASCII characters only"):
            build_char_tokenizer(alphabet)


def test_a_repeated_character_keeps_its_first_id_and_ids_stay_dense():
    """'abca': 'a' stays id 4 and the ids are exactly 0..len-1, so a model sized len(tokenizer) covers every id."""
    tok = build_char_tokenizer("abca")
    assert len(tok) == 7
    assert tok("abca", add_special_tokens=False)["input_ids"] == [4, 5, 6, 4]
    assert sorted(tok.get_vocab().values()) == list(range(7))


def test_single_token_id_refuses_text_that_is_not_exactly_one_token():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"^'ab' is 2 tokens for this tokenizer, expected exactly one$"):
        single_token_id(tok, "ab")
    with pytest.raises(ValueError, match=r"^'' is 0 tokens"):
        single_token_id(tok, "")


def test_single_token_id_ignores_the_special_tokens_a_tokenizer_adds():
    """Llama-style tokenizers add <bos> by default; the id of '\\n' is still the one token of '\\n' itself."""
    tok = build_char_tokenizer()
    newline = 4 + DEFAULT_ALPHABET.index("\n")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    assert tok("\n")["input_ids"] == [1, newline]  # the tokenizer really adds one
    assert single_token_id(tok, "\n") == newline


# ------------------------------------------------------------------------------------------------ model builder


@pytest.mark.parametrize("arch, cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_build_tiny_model_architecture_and_settings(arch, cls):
    """The asked architecture, fp32, eval mode, SDPA, tied embeddings, and the special ids of the char tokenizer."""
    model = build_tiny_model(40, arch=arch, **TINY)
    assert type(model).__name__ == cls and model.config.model_type == arch
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (model.config.vocab_size, model.config.pad_token_id, model.config.bos_token_id,
            model.config.eos_token_id) == (40, 0, 1, 2)


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match=r"^unknown arch 'gpt2': expected 'qwen2' or 'llama'$"):
        build_tiny_model(40, arch="gpt2", **TINY)


def test_build_tiny_model_is_seeded_and_leaves_the_global_rng_alone():
    """Same seed, same weights; another seed, other weights; and the caller's torch RNG stream is not touched."""
    a, b, c = (build_tiny_model(40, seed=s, **TINY) for s in (1, 1, 2))
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(40, seed=7, **TINY)
    assert torch.equal(torch.rand(4), expected)


# ------------------------------------------------------------------------------------------------ model directories


def test_check_model_dir_refuses_a_file(model_dir):
    path = model_dir / "config.json"
    with pytest.raises(ModelDirError, match="is not a directory") as e:
        check_model_dir(path)
    assert str(e.value) == f"{path} is not a directory: give a Hugging Face model directory"


def test_a_tokenizer_in_the_slow_format_is_accepted(model_dir, tmp_path):
    """vocab.json + merges.txt + tokenizer_config.json, no tokenizer.json (the format of many hub repos): it loads the
    same ids, so the check passes; tokenizer.json is not required when tokenizer_config.json is there."""
    d = copy_of(model_dir, tmp_path)
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
    d = copy_of(model_dir, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["text_config"] = {"vocab_size": config.pop("vocab_size")}
    (d / "config.json").write_text(json.dumps(config))
    check_model_dir(d)


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
    d = copy_of(model_dir, tmp_path)
    (d / "tokenizer.json").unlink()
    for check in (check_model_dir, load_hf):
        with pytest.raises(ModelDirError, match=r"encodes 'Q: 12\+7=\?\\nA: 19\\n' as \[\]: its vocabulary is "
                                                r"missing \(tokenizer.json, or vocab.json"):
            check(d)


def test_a_tokenizer_json_without_its_config_is_refused_with_the_reason(model_dir, tmp_path):
    """tokenizer.json alone: transformers adds its class's default special token (54 tokens for 53 embeddings); the
    error says the config file is what is missing."""
    d = copy_of(model_dir, tmp_path)
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ModelDirError, match=r"tokenizer has 54 tokens but config.json vocab_size=53: .* \(there is "
                                            r"no tokenizer_config.json, so Qwen2Tokenizer added its default special "
                                            r"tokens"):
        check_model_dir(d)
