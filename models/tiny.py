"""Tiny Hugging Face models and a character-level tokenizer, built locally (there is no model hub here).

Everything is saved as a plain Hugging Face directory, so training and generation load it through the
same `from_pretrained` path as any local directory or hub id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
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


def other_eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    """The ids a model's generation config ends a sequence at besides the tokenizer's EOS (Qwen2.5's instruct models:
    `<|endoftext|>` beside `<|im_end|>`). vLLM stops at all of them: the built-in engine, which evaluates, must too,
    or it decodes past the end of an answer."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return tuple(sorted(set(ids) - {tokenizer.eos_token_id}))


def single_token_id(tokenizer, text: str) -> int:
    """The id of a string that encodes to exactly one token (e.g. the newline that ends an answer)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens for this tokenizer, expected exactly one")
    return ids[0]


class ModelDirError(ValueError):
    """A local model directory that `from_pretrained` cannot use; the message names the directory and what is
    missing."""


def _check_model_files(path: Path) -> dict:
    """config.json (valid JSON with `model_type`), weights and tokenizer files present; returns the config."""
    if not path.is_dir():
        raise ModelDirError(f"{path} is not a directory: give a Hugging Face model directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(
            f"{path} has no config.json: not a Hugging Face model directory (save_pretrained writes "
            "config.json, the weights and, with the tokenizer's save_pretrained, its files)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{config_file} is not valid JSON ({e}); re-save the model with save_pretrained") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelDirError(
            f"{config_file} has no `model_type`: transformers cannot tell the architecture; re-save "
            "the model with save_pretrained"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise ModelDirError(
            f"{path} has no weights (*.safetensors or pytorch_model*.bin); save the model with save_pretrained"
        )
    for weights in path.glob("*.safetensors"):
        try:
            with safe_open(str(weights), framework="pt"):  # reads the header only
                pass
        except (SafetensorError, OSError) as e:
            raise ModelDirError(f"{weights} is not a readable safetensors file ({e}); save the model again") from None
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelDirError(
            f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json): save the model's "
            "tokenizer there with tokenizer.save_pretrained"
        )
    return config


_PROBE = "Q: 12+7=?\nA: 19\n"


def _check_tokenizer(path: Path, config: dict, tokenizer) -> None:
    """The tokenizer encodes text (a tokenizer_config.json without its vocabulary loads, and encodes everything as
    nothing) and is no larger than the embedding table."""
    ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    if not ids or all(i == tokenizer.unk_token_id for i in ids):
        raise ModelDirError(
            f"{path}: the tokenizer encodes {_PROBE!r} as {ids}: its vocabulary is missing "
            "(tokenizer.json, or vocab.json + merges.txt / tokenizer.model beside "
            "tokenizer_config.json); save the tokenizer there again with tokenizer.save_pretrained"
        )
    vocab_size = config.get("vocab_size")  # absent at the top level of some multimodal configs: nothing to compare
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        hint = ""
        if not (path / "tokenizer_config.json").is_file():
            hint = (
                f" (there is no tokenizer_config.json, so {type(tokenizer).__name__} added its default special "
                "tokens: save the tokenizer with tokenizer.save_pretrained, which writes both files)"
            )
        raise ModelDirError(
            f"{path}: tokenizer has {len(tokenizer)} tokens but config.json vocab_size={vocab_size}: "
            "ids past the embedding table would fail in the first forward pass; use the tokenizer "
            f"the model was trained with, or resize the embeddings and save again{hint}"
        )


def check_model_dir(path: str | Path) -> None:
    """Cheap pre-flight check of a local Hugging Face directory, without loading weights: config.json valid with
    `model_type`, weights and tokenizer files present, and a tokenizer (loaded) that encodes text and is no
    larger than the embedding."""
    path = Path(path)
    config = _check_model_files(path)
    _check_architecture(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # OSError, ValueError; a tokenizer.json of `{}`: KeyError
        raise ModelDirError(f"{path}: the tokenizer does not load ({type(e).__name__}: {e})") from None
    _check_tokenizer(path, config, tokenizer)


def _check_architecture(path: Path) -> None:
    """config.json builds a causal LM (on the meta device: no memory, no weights read), and a tensor the safetensors
    files hold under one of the model's own names has the shape the config gives it. An unknown `model_type`, a
    setting transformers refuses, or weights of another size are named here; the run failed on them after its
    config was frozen. Tensors under other names are left to from_pretrained, which renames many at load (GPT-2 and
    OPT files without their base prefix, llava-family layouts, fused experts): a missing name is no evidence."""
    from transformers import AutoConfig

    config_file = path / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # ValueError (unknown model_type), AttributeError (a dtype torch lacks), ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelDirError(
            f"{config_file} does not build a causal language model ({type(e).__name__}: {first}); give a "
            "directory saved by save_pretrained from a causal LM"
        ) from None
    expected = {key: list(t.shape) for key, t in model.state_dict().items()}
    for weights in sorted(path.glob("*.safetensors")):  # pytorch_model*.bin is a pickle: not opened before loading
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                shape = list(f.get_slice(key).get_shape())
                if key in expected and shape != expected[key]:
                    raise ModelDirError(
                        f"{weights}: tensor {key} has shape {shape} where {config_file} makes it "
                        f"{expected[key]}: the weights and the config are of different models; save both with "
                        "save_pretrained"
                    )


def load_hf(path: str | Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load (model, tokenizer) from a local Hugging Face directory or hub id via `from_pretrained`; a local
    directory is checked first (`check_model_dir`'s errors, not a transformers traceback)."""
    config = _check_model_files(Path(path)) if Path(path).is_dir() else None
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if config is not None:
        _check_tokenizer(Path(path), config, tokenizer)
    return model.eval(), tokenizer
