"""`models/vllm_engine.py`'s side of vLLM, on CPU: vLLM needs a GPU, so `vllm` is a stand-in module here that keeps
the parts of vLLM's interface the engine uses and the rules they follow (the arguments of `LLM`, the V1 engine's
refusal to send a function to its worker processes, a worker class extended by `worker_extension_cls`, outputs as
token ids with a dict of log-probs per position). What these tests check is the engine's own code: the settings it
asks for, the requests it builds, how it reads the outputs, and that a checkpoint reaches every worker's model. Whether
real vLLM keeps these rules is checked only on a GPU (not run yet: no GPU was lent to the sessions so far)."""

from __future__ import annotations

import importlib
import json
import random
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from models.engine import SamplingParams
from models.tiny import build_tiny_model, save_hf
from tests.conftest import TINY


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    outputs: list[Completion]


class ModelRunner:
    def __init__(self, model: torch.nn.Module):
        self.model = _VLLMModel(model)


class _VLLMModel:
    """vLLM's model classes take `load_weights(weights=iterable of (name, tensor))`."""

    def __init__(self, model: torch.nn.Module):
        self.hf = model

    def load_weights(self, weights):
        missing, unexpected = self.hf.load_state_dict(dict(weights), strict=False)
        assert not unexpected, unexpected


class WorkerBase:
    def __init__(self, model: torch.nn.Module):
        self.model_runner = ModelRunner(model)


class FakeLLM:
    """Records what the engine asks of vLLM; `workers` stand for the tensor-parallel worker processes."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        module, _, name = kwargs["worker_extension_cls"].rpartition(".")
        extension = getattr(importlib.import_module(module), name)  # vLLM resolves the class by its qualified name
        worker_class = type("Worker", (WorkerBase, extension), {})  # and adds it to its worker class's bases
        self.workers = [worker_class(build_tiny_model(TINY_VOCAB, seed=0, **TINY)) for _ in range(2)]
        self.calls: list[str] = []
        self.requests: list[tuple[dict, object]] = []
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        # the V1 engine sends the call to its worker processes as msgpack: a function (or any object msgpack has no
        # type for) is refused unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 (vllm/v1/serial_utils.py's encoder hook)
        try:
            json.dumps([method, list(args), kwargs or {}])
        except TypeError as e:
            raise TypeError(f"Object of type {type(method)} is not serializable ({e})") from None
        self.calls.append(f"rpc:{method}")
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        """Each request's tokens drawn from its own seed; stops at a stop id (kept in the output, as vLLM keeps a
        stop token id) or after max_tokens. Each position's dict also holds another token, as vLLM's does when the
        sampled token is not the most likely one."""
        assert len(prompts) == len(sampling_params) and use_tqdm is False
        outputs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            self.requests.append((prompt, sp))
            rng = random.Random(sp.seed)
            ids, logprobs = [], []
            while len(ids) < sp.max_tokens:
                tok = rng.choice([3, 4, 5, 6] + sp.stop_token_ids)
                ids.append(tok)
                logprobs.append({tok: Logprob(-0.25 * len(ids) - tok / 100), 99: Logprob(-0.01)})
                if tok in sp.stop_token_ids:
                    break
            outputs.append(RequestOutput([Completion(ids, logprobs)]))
        return outputs


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


TINY_VOCAB = 40
EOS, NEWLINE = 1, 2


@pytest.fixture
def vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    module.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    FakeLLM.instances.clear()
    return module


def test_the_engine_asks_vllm_for_the_contracts_settings(vllm):
    from models.vllm_engine import CheckpointLoading, VLLMEngine

    VLLMEngine("/models/v0", seed=7, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512)
    (llm,) = FakeLLM.instances
    assert llm.kwargs == {
        "model": "/models/v0",
        "dtype": "bfloat16",
        "seed": 7,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 512,
        "enforce_eager": False,
        "enable_prefix_caching": True,  # the G requests of a group share the prompt's KV
        "logprobs_mode": "processed_logprobs",  # log-probs after temperature and top-p: the distribution sampled from
        "worker_extension_cls": "models.vllm_engine.CheckpointLoading",
    }
    assert all(isinstance(w, CheckpointLoading) for w in llm.workers)


def test_a_checkpoint_reaches_every_workers_model_by_method_name_then_the_prefix_cache_is_dropped(
    vllm, tiny_hf, tmp_path
):
    from models.vllm_engine import VLLMEngine

    engine = VLLMEngine("/models/v0", seed=0)
    (llm,) = FakeLLM.instances
    new = build_tiny_model(TINY_VOCAB, seed=1, **TINY)
    save_hf(new, tiny_hf.tokenizer, tmp_path / "v1")
    before = llm.workers[0].model_runner.model.hf.state_dict()["model.embed_tokens.weight"].clone()
    engine.load_checkpoint(str(tmp_path / "v1"))
    assert llm.calls == ["rpc:lockstep_load_checkpoint", "reset_prefix_cache"]  # no KV of older weights reused
    want = new.state_dict()
    for worker in llm.workers:
        got = worker.model_runner.model.hf.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(before, want["model.embed_tokens.weight"])  # the load changed something


def test_groups_are_one_request_per_seed_and_read_back_in_order(vllm):
    from models.vllm_engine import VLLMEngine

    engine = VLLMEngine("/models/v0", seed=0)
    (llm,) = FakeLLM.instances
    prompts, seeds = [[7, 8, 9], [10, 11]], [[101, 111, 103], [201, 202, 203]]
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, stop_on_newline_id=NEWLINE)
    groups = engine.generate_groups(prompts, 3, params, seeds, EOS, pad_token_id=0, version=4)

    assert [r[0]["prompt_token_ids"] for r in llm.requests] == [[7, 8, 9]] * 3 + [[10, 11]] * 3
    for _, sp in llm.requests:
        assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.logprobs) == (1, 0.7, 0.9, 5, 0)
        assert sp.stop_token_ids == [EOS, NEWLINE] and sp.detokenize is False and sp.skip_special_tokens is False
    assert [sp.seed for _, sp in llm.requests] == [101, 111, 103, 201, 202, 203]

    assert [len(g) for g in groups] == [3, 3]
    for g, row in zip(groups, seeds):
        for sample, seed in zip(g, row):
            rng = random.Random(seed)  # what the stand-in drew for this seed
            ids = []
            while len(ids) < 5:
                ids.append(rng.choice([3, 4, 5, 6, EOS, NEWLINE]))
                if ids[-1] in (EOS, NEWLINE):
                    break
            assert sample.seed == seed and sample.response_ids == ids
            assert sample.logprobs == [-0.25 * (t + 1) - tok / 100 for t, tok in enumerate(ids)]  # not token 99's
            assert sample.finish_reason == ("stop" if ids[-1] in (EOS, NEWLINE) else "length")
            assert sample.token_versions == [4] * len(ids)
    reasons = {s.finish_reason for g in groups for s in g}
    assert reasons == {"stop", "length"}  # both kinds of ending were read (seeds chosen for it)


def test_greedy_asks_for_temperature_zero_and_no_newline_stop_when_none_is_given(vllm):
    from models.vllm_engine import VLLMEngine

    engine = VLLMEngine("/models/v0", seed=0)
    (llm,) = FakeLLM.instances
    engine.generate_groups([[7]], 2, SamplingParams(max_new_tokens=3, greedy=True), [[1, 2]], EOS, 0)
    assert [(sp.temperature, sp.stop_token_ids) for _, sp in llm.requests] == [(0.0, [EOS]), (0.0, [EOS])]
    llm.requests.clear()  # the model's other end ids stop it as EOS does (and its finish reason is "stop")
    [[sample]] = engine.generate_groups([[7]], 1, SamplingParams(max_new_tokens=9, other_eos_ids=(6,)), [[3]], EOS, 0)
    assert llm.requests[0][1].stop_token_ids == [EOS, 6]
    assert sample.response_ids[-1] in (EOS, 6) and sample.finish_reason == "stop"


@pytest.mark.parametrize("seeds", [[[1, 2]], [[1, 2], [3]], [[1, 2], [3, 4, 5]]])
def test_seeds_that_do_not_match_the_prompts_and_group_size_are_refused(vllm, seeds):
    from models.vllm_engine import VLLMEngine

    engine = VLLMEngine("/models/v0", seed=0)
    with pytest.raises(ValueError, match="seeds must be 2 lists of 2 seeds"):
        engine.generate_groups([[7], [8]], 2, SamplingParams(), seeds, EOS, 0)
    assert FakeLLM.instances[0].requests == []


def test_without_vllm_the_engine_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    from models.vllm_engine import VLLMEngine

    with pytest.raises(ImportError, match=r"rollout.engine 'vllm' needs vLLM.*pip install 'lockstep-rl\[cuda\]'"):
        VLLMEngine("/models/v0", seed=0)
