"""Shared test setup: one torch thread (the suite shares a 2-core machine), quiet services, a tiny HF model."""

from __future__ import annotations

import importlib
import os

# Before Prefect, MLflow or tokenizers are imported anywhere in the session.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # its shutdown INFO lines hit pytest's closed streams
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers: a Prefect home (SQLite database) each
    home = os.environ.get("PREFECT_HOME", os.path.expanduser("~/.prefect"))
    os.environ["PREFECT_HOME"] = os.path.join(home, os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect creates only the last level of its home

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# torch makes its compile cache folder in the temporary folder as torch._dynamo is first imported (transformers imports
# it when it builds a model): imported here, before a test moves the temporary folder to see what the code leaves
# there, so that such a test run alone does not find torch's folder among its own
importlib.import_module("torch._dynamo")
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """The fork server that starts the runs' worker processes (`tasks.workers.child_context`), started before the
    first test of each process that runs tests (not pytest-xdist's controller, which runs none) and before any test
    moves the temporary folder: its socket is made in multiprocessing's temporary folder, which a process makes once,
    and one under a test's long temporary path would pass AF_UNIX's length (the runs would fall back to spawn)."""
    from tasks.workers import child_context, modeling_module

    child_context(modeling_module("qwen2"))


TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@dataclass
class TinyHF:
    tokenizer: object  # PreTrainedTokenizerFast (character level)
    model: torch.nn.Module  # Qwen2ForCausalLM, fp32, eval mode


@pytest.fixture
def tiny_hf() -> TinyHF:
    """A fresh character tokenizer and tiny Qwen2 (seed 0) per test, so tests may train or modify the model."""
    from models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=0, **TINY)
    return TinyHF(tokenizer, model)


@pytest.fixture
def memory_lake():
    """A lake in fsspec's in-process memory store (not a local folder), emptied after the test."""
    import uuid

    import fsspec

    from storage.lake import Lake

    lake = Lake(f"memory://lockstep-test-{uuid.uuid4().hex}")
    yield lake
    fs = fsspec.filesystem("memory")
    if fs.exists(lake.root):
        fs.rm(lake.root, recursive=True)
