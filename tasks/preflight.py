"""Pre-flight checks of what a config points at: the model (`model.path`) and the prompt dataset.

`check_inputs` runs after the config has validated and before any work (no weights loaded, no lake, Prefect or
MLflow touched), so that a wrong path fails at `lockstep train` with the field, the value and what to do, not
minutes later as a transformers or fsspec traceback inside the flow. Sizes the config alone decides (arithmetic
splits against the batch) are checked by `Config` itself.
"""

from __future__ import annotations

import os

from configs.schema import Config, ConfigError


class InputError(ConfigError):
    """A config whose model or dataset cannot be used; the message names the field, the value and what to do."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_model_path(path: str) -> None:
    """A local Hugging Face directory (checked by `models.tiny.check_model_dir`), or a hub id, which offline
    (HF_HUB_OFFLINE=1, as the CLI sets it) must be in the local Hugging Face cache."""
    from models.tiny import ModelDirError, check_model_dir

    if os.path.isdir(path):
        try:
            check_model_dir(path)
        except ModelDirError as e:
            raise InputError(f"model.path: {e}") from None
        return
    # "org/name" is a hub id; anything else path-like is a local path that is not there
    if path.startswith((".", "~")) or os.path.isabs(path) or path.count("/") > 1 or os.path.exists(path):
        hint = " (~ is not expanded: write the full path)" if path.startswith("~") else ""
        raise InputError(f"model.path {path!r} is not a directory{hint}: give a local Hugging Face model directory "
                         "(config.json, weights, tokenizer) or a hub id such as Qwen/Qwen2.5-0.5B")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(path, "config.json", cache_dir=constants.HF_HUB_CACHE)
    except HFValidationError as e:
        raise InputError(f"model.path {path!r} is neither a local directory nor a hub id ({e}); give a local "
                         "Hugging Face model directory or a hub id such as Qwen/Qwen2.5-0.5B") from None
    if not _offline():
        return  # from_pretrained downloads what the cache lacks (a partial cache: a cut download, a config read)
    if not isinstance(cached, str):  # None, or the cache's marker of a file known not to exist
        raise InputError(f"model.path {path!r} is not a local directory, and as a hub id it is not in the Hugging "
                         f"Face cache ({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1 forbids downloading: "
                         f"download it first (`hf download {path}` where there is network) or give a local directory")
    try:
        check_model_dir(os.path.dirname(cached))  # the cached snapshot: the same files from_pretrained will read
    except ModelDirError as e:
        raise InputError(f"model.path {path!r} (Hugging Face cache): {e}") from None


def check_dataset(cfg: Config) -> None:
    """`task.dataset.uri` (and `eval_uri`) open in their format and their first row reads."""
    from storage.datasets import DatasetError, check_readable

    d = cfg.task.dataset
    for field, uri, split in (("uri", d.uri, d.split), ("eval_uri", d.eval_uri, d.eval_split)):
        if uri is None:
            continue
        try:
            check_readable(uri, d.format, split)
        except DatasetError as e:
            raise InputError(f"task.dataset.{field}: {e}") from None


def check_inputs(cfg: Config) -> None:
    """Raise `InputError` (a `ConfigError`) for a model or dataset the run could not use; cheap, no side effects."""
    if cfg.model.path is not None:
        check_model_path(cfg.model.path)
    if cfg.task.kind == "dataset":
        check_dataset(cfg)
