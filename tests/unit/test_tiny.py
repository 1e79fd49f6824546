"""models/tiny.py: the character tokenizer's alphabet edge cases, what `build_tiny_model` promises (architecture,
seed, tied embeddings, eval mode, the global RNG left alone) and `single_token_id`. The model-directory checks of
`check_model_dir` and `load_hf` are in test_preflight.py."""

from __future__ import annotations

import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from models.tiny import DEFAULT_ALPHABET, build_char_tokenizer, build_tiny_model, other_eos_ids, single_token_id

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n\t"  # every printable ASCII character, '~' (126) last


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
    assert (
        model.config.vocab_size,
        model.config.pad_token_id,
        model.config.bos_token_id,
        model.config.eos_token_id,
    ) == (40, 0, 1, 2)


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match=r"^unknown arch 'gpt2': expected 'qwen2' or 'llama'$"):
        build_tiny_model(40, arch="gpt2", **TINY)


def test_build_tiny_model_is_seeded_and_leaves_the_global_rng_alone():
    """Same seed, same weights; another seed, other weights; and the caller's torch RNG stream is not touched."""
    a, b, c = (build_tiny_model(40, seed=s, **TINY) for s in (1, 1, 2))
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    with torch.random.fork_rng():  # the test leaves the global RNG as it found it, too
        torch.manual_seed(123)
        expected = torch.rand(4)
        torch.manual_seed(123)
        build_tiny_model(40, seed=7, **TINY)
        assert torch.equal(torch.rand(4), expected)


def test_other_eos_ids_are_the_generation_configs_ends_beside_the_tokenizers():
    """Qwen2.5's instruct models end at <|im_end|> (the tokenizer's EOS) and at <|endoftext|> (its generation
    config's list has both); vLLM stops at both, so the built-in engine must too."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    tok = SimpleNamespace(eos_token_id=151645)
    assert other_eos_ids(GenerationConfig(eos_token_id=[151645, 151643]), tok) == (151643,)
    assert other_eos_ids(GenerationConfig(eos_token_id=[151643, 7, 151643]), tok) == (7, 151643)
    assert other_eos_ids(GenerationConfig(eos_token_id=151645), tok) == ()
    assert other_eos_ids(GenerationConfig(eos_token_id=151643), tok) == (151643,)
    assert other_eos_ids(GenerationConfig(), tok) == () and other_eos_ids(None, tok) == ()
    tiny = build_char_tokenizer()
    assert other_eos_ids(build_tiny_model(len(tiny), seed=0).generation_config, tiny) == ()  # the demo's: one end
