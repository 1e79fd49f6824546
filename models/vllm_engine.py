"""vLLM generation engine (CUDA; Ascend NPUs through vllm-ascend) with the built-in engine's contract.

Same inputs and outputs as `models.engine.generate_groups`: G samples per prompt, per-token log-probs of the
distribution actually sampled from (vLLM's `processed_logprobs`: after temperature and top-p), per-sample seeds
from `sample_seed`, EOS / newline stopping. The G requests of a group share the prompt's KV through vLLM's
automatic prefix caching. New weights are loaded in place from a checkpoint directory (no engine restart), and
the prefix cache is reset, so no KV computed by older weights is reused.

Not available: interruption mid-request (`rollout.interrupt_on_update`), since the offline `LLM` API cannot
pause a request; the config refuses that combination. vLLM is an optional extra, imported here only.
"""

from __future__ import annotations

from models.engine import Sample, SamplingParams

INSTALL = "pip install 'lockstep-rl[cuda]' (CUDA) or 'lockstep-rl[npu]' (Ascend, with vllm-ascend)"


class CheckpointLoading:
    """Mixed into every vLLM worker (vLLM's `worker_extension_cls`), so that `collective_rpc` names this method and
    sends only its name and a path. vLLM's V1 engine runs its workers in other processes and refuses to serialise a
    function for them (a function travels only by pickle, which it allows only with VLLM_ALLOW_INSECURE_SERIALIZATION).
    """

    def lockstep_load_checkpoint(self, model_dir: str) -> int:
        """Runs in each vLLM worker process: the checkpoint's weights into its model; returns how many tensors."""
        from safetensors.torch import load_file

        weights = load_file(f"{model_dir}/model.safetensors")
        self.model_runner.model.load_weights(weights=iter(weights.items()))
        return len(weights)


class VLLMEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        seed: int,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
    ):
        try:
            import vllm
        except ImportError as e:
            raise ImportError(f"rollout.engine 'vllm' needs vLLM, which is not installed: {INSTALL}") from e
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{CheckpointLoading.__module__}.{CheckpointLoading.__qualname__}",
        )

    def load_checkpoint(self, model_dir: str) -> None:
        """Load a local HF checkpoint directory's weights into every vLLM worker, then drop cached prefixes."""
        self.llm.collective_rpc("lockstep_load_checkpoint", args=(model_dir,))
        self.llm.reset_prefix_cache()

    def generate_groups(
        self,
        prompts: list[list[int]],
        group_size: int,
        params: SamplingParams,
        seeds: list[list[int]],
        eos_token_id: int,
        pad_token_id: int,
        version: int = 0,
    ) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompts) or any(len(s) != group_size for s in seeds):
            raise ValueError(f"seeds must be {len(prompts)} lists of {group_size} seeds")
        stop = params.stop_ids(eos_token_id)
        requests, sampling = [], []
        for p, row in zip(prompts, seeds):
            for seed in row:
                requests.append(TokensPrompt(prompt_token_ids=list(p)))
                sampling.append(
                    VLLMSamplingParams(
                        n=1,
                        temperature=0.0 if params.greedy else params.temperature,
                        top_p=params.top_p,
                        max_tokens=params.max_new_tokens,
                        seed=seed,
                        logprobs=0,
                        stop_token_ids=stop,
                        detokenize=False,
                        skip_special_tokens=False,
                    )
                )
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        flat = []
        for out, sp in zip(outputs, sampling, strict=True):
            c = out.outputs[0]
            ids = list(c.token_ids)
            logps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
            reason = "stop" if ids and ids[-1] in stop else "length"
            flat.append(Sample(ids, logps, reason, sp.seed, [version] * len(ids)))
        return [flat[i * group_size : (i + 1) * group_size] for i in range(len(prompts))]
