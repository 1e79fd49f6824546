"""Tiny Hugging Face models and a character-level tokenizer, built locally (there is no model hub here).

Everything is saved as a plain Hugging Face directory, so training and generation load it through the
same `from_pretrained` path as any local directory or hub id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Digits, operators and the few letters the task's few-shot format uses.
DEFAULT_ALPHABET = "0123456789+-*=?:. \nQAabcdefghijklmnopqrstuvwxyz,#"

Arch = Literal["qwen2", "llama"]


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2 / Qwen convention): printable bytes map to themselves, the others
    (space, newline, ...) to code points from 256 up, so every byte is one visible character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    mapping, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, specials first (pad=0, bos=1, eos=2, unk=3).

    Built as a byte-level BPE with no merges, the form Qwen2 and Llama tokenizers take, so that
    `AutoTokenizer.from_pretrained` rebuilds exactly the same ids whichever tokenizer class the model's
    config maps to (a plain WordLevel tokenizer loses spaces and newlines under `Qwen2Tokenizer`).
    """
    to_unicode = _byte_to_unicode()
    chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
    if any(ord(c) > 127 for c in chars):
        raise ValueError("the character tokenizer supports ASCII characters only")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *(to_unicode[ord(c)] for c in chars)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def build_tiny_model(
    vocab_size: int,
    *,
    arch: Arch = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_positions: int = 1024,
    seed: int = 0,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> torch.nn.Module:
    """A small randomly initialised causal LM of the Qwen2 (default) or Llama architecture, fp32, eval mode."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"unknown arch {arch!r}: expected 'qwen2' or 'llama'")
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def save_hf(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    """Save model (safetensors) and tokenizer as one Hugging Face directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def single_token_id(tokenizer, text: str) -> int:
    """The id of a string that encodes to exactly one token (e.g. the newline that ends an answer)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens for this tokenizer, expected exactly one")
    return ids[0]


def load_hf(path: str | Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load (model, tokenizer) from a local Hugging Face directory or hub id via `from_pretrained`."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tokenizer
