"""Pre-flight checks of what a config points at: the model (`model.path`), the prompt dataset, and the servers a run
talks to (the Prefect API, the MLflow tracking store).

`check_inputs` runs after the config has validated and before any work (no weights loaded, no lake, Prefect or
MLflow touched; a lake on an object store is asked for its bucket), so that a wrong path fails at `lockstep train`
with the field, the value and what to do, not minutes later as a transformers or fsspec traceback inside the flow.
Sizes the config alone decides (arithmetic splits against the batch) are checked by `Config` itself.
`check_prefect_api` runs before a flow starts (the CLI), `check_tracking` before the run is written and the
bootstrap's minutes are spent (`open_session`): an MLflow server that is down was found only after the bootstrap,
then retried for minutes. `check_replayable` reads the lake only: `lockstep replay` refuses a run it cannot replay
before it imports the flow (transformers, Prefect's flow engine) or starts a server.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from configs.schema import Config, ConfigError
from models.rewards import error_line

if TYPE_CHECKING:  # a type only: each check imports what it uses as it runs
    from storage.lake import Lake


class InputError(ConfigError):
    """A config whose model or dataset cannot be used; the message names the field, the value and what to do."""


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
        raise InputError(
            f"model.path {path!r} is not a directory{hint}: give a local Hugging Face model directory "
            "(config.json, weights, tokenizer) or a hub id such as Qwen/Qwen2.5-0.5B"
        )
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(path, "config.json", cache_dir=constants.HF_HUB_CACHE)
    except HFValidationError as e:
        raise InputError(
            f"model.path {path!r} is neither a local directory nor a hub id ({e}); give a local "
            "Hugging Face model directory or a hub id such as Qwen/Qwen2.5-0.5B"
        ) from None
    from storage.lake import hf_offline

    if not hf_offline():
        return  # from_pretrained downloads what the cache lacks (a partial cache: a cut download, a config read)
    if not isinstance(cached, str):  # None, or the cache's marker of a file known not to exist
        raise InputError(
            f"model.path {path!r} is not a local directory, and as a hub id it is not in the Hugging "
            f"Face cache ({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1 forbids downloading: "
            f"download it first (`hf download {path}` where there is network) or give a local directory"
        )
    try:
        check_model_dir(os.path.dirname(cached))  # the cached snapshot: the same files from_pretrained will read
    except ModelDirError as e:
        raise InputError(f"model.path {path!r} (Hugging Face cache): {e}") from None


def check_model_options(cfg: Config) -> None:
    """`model.path`'s class must support what the train section asks of it, judged before the run's config is
    frozen (the trainer refused it only after, so the run could never resume): `train.activation_checkpointing`
    (read from its config.json; no weights read) and `train.logits_chunk_tokens` (its logits must be its output layer
    applied to its decoder's output: probed on a small randomly initialised model of its config, `_probe_logits_split`;
    what that cannot judge is left to the trainer, which probes the real model). The built-in tiny models
    (qwen2, llama) support both. A hub id is judged offline only (HF_HUB_OFFLINE=1, as the CLI sets it: from its
    cached config), as `check_model_path` judges it; online the trainer judges it."""
    from storage.lake import hf_offline

    path = cfg.model.path
    wanted = cfg.train.activation_checkpointing or cfg.train.logits_chunk_tokens is not None
    if not wanted or path is None or (not os.path.isdir(path) and not hf_offline()):
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from models.trainer import check_checkpointing

    try:  # check_model_path has read this config already: it is there and builds a causal LM
        config = AutoConfig.from_pretrained(path)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (OSError, ValueError, KeyError):  # not a causal LM's config: check_model_path names what is wrong
        return
    try:
        if cfg.train.activation_checkpointing:
            check_checkpointing(model_class)
        if cfg.train.logits_chunk_tokens is not None:
            _probe_logits_split(model_class, config)
    except ValueError as e:
        raise InputError(f"model.path {path!r}: {e}") from None


PROBE_MAX_PARAMS = 256_000_000  # 1 GB in fp32: a larger one-layer model is left to the trainer's probe


def _probe_logits_split(model_class, config) -> None:
    """`check_logits_split` on a randomly initialised `model_class` of `config` shrunk to one layer and a vocabulary
    of at most 64 tokens (the architecture, not the weights or the sizes, decides what it judges). Left to the
    trainer, which probes the real model: a config that cannot be built so, one whose shrunk model still has more than
    `PROBE_MAX_PARAMS` parameters (counted on the meta device first), and a probe that fails otherwise than by
    refusing."""
    import torch

    from models.packing import LogitsSplitError, check_logits_split

    try:
        configs = list({id(c): c for c in (config, config.get_text_config(decoder=True))}.values())
        vocab = min([64, *(c.vocab_size for c in configs if getattr(c, "vocab_size", None))])
        for c in configs:
            c.num_hidden_layers = 1
            if getattr(c, "vocab_size", None):
                c.vocab_size = vocab
            for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids the smaller vocabulary lacks
                ids = getattr(c, key, None)
                if isinstance(ids, int) and ids >= vocab or isinstance(ids, list) and any(i >= vocab for i in ids):
                    setattr(c, key, None)
        with torch.device("meta"):
            size = sum(p.numel() for p in model_class._from_config(config).parameters())
        if size > PROBE_MAX_PARAMS:
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            probe = model_class._from_config(config, dtype=torch.float32)
    except Exception:  # noqa: BLE001  (a per-layer list of the config's own length, ...): the trainer probes the model
        return
    try:
        check_logits_split(probe)
    except LogitsSplitError:
        raise
    except Exception:  # noqa: BLE001  (a forward pass a one-layer model breaks): the trainer probes the real one
        return


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


def resolve_device(kind: str):
    """The one device resolver: auto picks CUDA, then an Ascend NPU, then the CPU (which always works). Returns a
    `torch.device`; a device that is not there raises `InputError`."""
    import torch

    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu")
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError("trainer.device is 'cuda' but no CUDA device is visible; use trainer.device=cpu (or auto)")
    if kind == "npu":
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:
            raise InputError(
                "trainer.device is 'npu' but torch_npu is missing: pip install 'lockstep-rl[npu]'; or "
                "use trainer.device=cpu (or auto)"
            )
        import torch_npu  # noqa: F401
    return torch.device(kind)


def check_reward(cfg: Config, resumed: bool = False):
    """`task.reward` loads: math-verify is installed for `math_verify`; a user's function is imported here and its
    signature checked (each rollout worker imports it again in its own process). Returns the scorer
    (`models.rewards.reward_function`). `resumed`: the setting is a run's frozen one, whose file may have moved."""
    import importlib.util

    from models.rewards import RewardError, function_spec, reward_function

    kind = cfg.task.reward
    if kind == "math_verify" and importlib.util.find_spec("math_verify") is None:
        from models.verifier import INSTALL

        raise InputError(f"task.reward is 'math_verify' but math-verify is not installed: {INSTALL}")
    spec = function_spec(kind)
    if resumed and spec is not None and spec[0].endswith(".py") and not Path(spec[0]).is_file():
        raise InputError(
            f"task.reward {kind!r}: no file {spec[0]}; this is the run's frozen setting: put the file (or a link to "
            "it) back at that path"
        )
    try:
        return reward_function(**cfg.task.reward_settings())
    except RewardError as e:
        raise InputError(str(e)) from None


def check_backend(cfg: Config):
    """`trainer.device` is there and `rollout.engine: vllm` is installed (an optional extra); returns the device."""
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from models.vllm_engine import INSTALL

            raise InputError(
                f"rollout.engine is 'vllm' but vLLM is not installed: {INSTALL}; or set rollout.engine=builtin"
            )
    device = resolve_device(cfg.trainer.device)
    attention_kernel(cfg.train.attention, device)  # flex_attention on a CPU: refused here, not after the bootstrap
    ranks = cfg.resources.train_ranks
    if ranks > 1 and device.type != "cpu":
        import torch

        count = torch.cuda.device_count() if device.type == "cuda" else torch.npu.device_count()  # type: ignore
        if ranks > count:
            raise InputError(
                f"resources.train_ranks is {ranks} but {count} {device.type} device(s) are visible (rank r trains on "
                f"device r): set resources.train_ranks to at most {count}"
            )
    return device


def thread_budget_note(cfg: Config, device) -> str | None:
    """A warning, or None: on a CPU, the torch threads of the processes that run at once (rollout workers beside the
    trainer's ranks; in sync mode one side at a time) outnumber this machine's cores. Torch's thread pool spins:
    two processes of 2 threads each on this 2-core machine ran ~5x slower (DESIGN.md, compute roles). A warning, not
    an error: the cores a run may use are the user's to know (a container's limit, a shared host)."""
    if device.type != "cpu":
        return None
    r = cfg.resources
    rollout, train = r.rollout_workers * r.rollout_threads, r.train_ranks * r.train_threads
    busy = max(rollout, train) if cfg.pipeline.mode == "sync" else rollout + train
    cores = os.cpu_count() or 1
    if busy <= cores:
        return None
    at_once = "one side at a time (sync)" if cfg.pipeline.mode == "sync" else "at once"
    return (
        f"resources run {busy} torch threads {at_once} ({r.rollout_workers} rollout worker(s) x {r.rollout_threads} "
        f"rollout_threads, {r.train_ranks} trainer rank(s) x {r.train_threads} train_threads) on {cores} CPU cores: "
        "threads beyond the cores slow every process down (two 2-thread processes on 2 cores ran ~5x slower); "
        f"lower them to add up to {cores}"
    )


def attention_kernel(choice: str, device) -> str:
    """The trainer's attention implementation on `device` (a torch.device): FlexAttention block masks on CUDA where
    available, else SDPA; InputError for a choice the device cannot train with."""
    import importlib.util

    has_flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    if choice == "auto":
        return "flex_attention" if device.type == "cuda" and has_flex else "sdpa"
    if choice == "flex_attention" and (device.type == "cpu" or not has_flex):
        raise InputError(
            f"train.attention 'flex_attention' needs a CUDA device and torch with FlexAttention (it has "
            f"no backward pass on {device.type}); use train.attention=auto or sdpa"
        )
    return choice


def check_inputs(cfg: Config) -> None:
    """Raise `InputError` (a `ConfigError`) for a lake, model or dataset the run could not use; cheap, nothing left
    behind (a lake on an object store is asked for its bucket; a new local one's folder is tried with a probe folder
    made and removed)."""
    from storage.lake import Lake, LakeURLError

    try:
        Lake(cfg.lake.uri).check_reachable()
    except LakeURLError as e:
        raise InputError(f"lake.uri: {e}") from None
    if cfg.model.path is not None:
        check_model_path(cfg.model.path)
        check_model_options(cfg)
    if cfg.task.kind == "dataset":
        check_dataset(cfg)


def check_prefect_api() -> None:
    """When runs go to a Prefect server (PREFECT_API_URL, from the environment or the Prefect profile), it answers as
    a Prefect API. Without one, each run starts a temporary local server: nothing to check."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        with get_client(sync_client=True) as client:
            client.api_version()  # the call Prefect's own version check makes first; JSON only from a Prefect API
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        raise InputError(
            f"PREFECT_API_URL={url!r} is not an http(s) URL ({error_line(e)}): give the API's URL, "
            "e.g. http://127.0.0.1:4200/api, or unset it to run on a temporary local Prefect server"
        ) from None
    except httpx.TransportError as e:  # refused, timed out, a name that does not resolve
        raise InputError(
            f"the Prefect API at PREFECT_API_URL={url} is unreachable ({error_line(e)}): start it "
            "with `make services`, fix PREFECT_API_URL (e.g. http://127.0.0.1:4200/api), or unset it to "
            "run on a temporary local Prefect server"
        ) from None
    except Exception as e:  # an HTTP error status, or a page that is not JSON
        raise InputError(
            f"PREFECT_API_URL={url} is not a Prefect API ({error_line(e)}): give the API's URL, e.g. "
            "http://127.0.0.1:4200/api, or unset it to run on a temporary local Prefect server"
        ) from None


def check_tracking(cfg: Config) -> None:
    """`tracking.uri` opens as an MLflow tracking store (when tracking is on): a SQLite file is created, a server must
    answer, a plain path or `file:` store (refused by MLflow 3) or a missing database driver is named. One attempt,
    no retries: a server that does not answer now is reported now (the run itself keeps MLflow's retries)."""
    if not cfg.tracking.enabled:
        return
    from mlflow.tracking import MlflowClient

    uri = cfg.tracking.uri
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"})
    try:
        with _one_at_a_time(uri):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as e:  # MlflowException, a missing driver (ModuleNotFoundError), a bad URI (ValueError), ...
        raise InputError(
            f"tracking.uri {uri!r} cannot be used ({error_line(e)}): give sqlite:///PATH (the default "
            "is sqlite:///mlflow.db), the http(s) URL of a running MLflow server (`make services` starts "
            "one at http://127.0.0.1:5000), or set tracking.enabled=false"
        ) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_LOCK_WAIT_S = 60.0  # a new store's tables take ~4 s to create here


@contextlib.contextmanager
def _one_at_a_time(uri: str):
    """For a SQLite tracking store, hold an exclusive lock on its folder (flock: nothing is written) while MLflow
    opens it: MLflow creates and migrates the database's tables as it first opens it, and two processes doing so at
    once (two `lockstep train` started together on a new mlflow.db) failed one of them ("table latest_metrics
    already exists", a migration that found no row to update). Other stores are left alone; where the folder takes
    no lock (a filesystem without flock) or a holder keeps it past `_LOCK_WAIT_S`, MLflow opens it without one."""
    folder = _sqlite_folder(uri)
    if folder is None:
        yield
        return
    try:
        os.makedirs(folder, exist_ok=True)  # as MLflow would: the lock needs the folder first
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a folder that cannot be made or read: MLflow's own error names it
        yield
        return
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process is opening the store: seconds, unless it is stuck
                if time.monotonic() > deadline:
                    break  # go on without the lock, as before it existed
                time.sleep(0.05)
            except OSError:  # a filesystem without flock (Lustre without -o flock, some NFS): as before too
                break
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _sqlite_folder(uri: str) -> str | None:
    """The folder of a `sqlite:///PATH` store's file; None for another store or an in-memory database."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    try:
        database = make_url(uri).database
    except Exception:  # not a URL SQLAlchemy reads: MLflow's own error names it
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.dirname(os.path.abspath(database))


def check_replayable(lake: Lake, run_id: str, to_run_id: str | None = None) -> None:
    """FileNotFoundError if run `run_id` has no promoted version yet (v0 comes out of its bootstrap: a replay started
    before it was a traceback from the model loader), CheckpointError if its v0 is incomplete; FileExistsError if the
    target `to_run_id` is the run itself or exists, RunInUseError if another process holds it (the CLI asks before it
    imports the flow or starts Prefect, the flow again, and once more under the target's lease)."""
    from storage import checkpoints, lease

    if to_run_id is not None:
        if to_run_id == run_id or lease.other_entries(lake, to_run_id):
            raise replay_target_exists(lake, to_run_id)
        lease.check_free(lake, to_run_id, "replay")  # held by a `train` that has not written its config yet
    if checkpoints.promoted_version(lake, run_id) is None:
        raise FileNotFoundError(
            f"run {run_id} has no promoted version in {lake.uri} yet (v0 is promoted once its "
            "bootstrap ends): replay it after that"
        )
    v0 = lake.checkpoint_dir(run_id, 0)
    if not lake.fs.exists(f"{v0}/MANIFEST.json"):  # removed or damaged by hand: the loader's traceback otherwise
        raise checkpoints.CheckpointError(
            f"run {run_id}'s checkpoint v0 ({v0}) has no MANIFEST.json: replay starts from v0 and cannot without it"
        )


def replay_target_exists(lake: Lake, to_run_id: str) -> FileExistsError:
    return FileExistsError(
        f"replay target run {to_run_id} already exists in {lake.uri}: replay writes a new run "
        "and never overwrites one; choose another --to"
    )


class RunExistsError(RuntimeError):
    """A `train` of a run id the lake has already: the one `run.run_id` names, or every name tried for a run named by
    its start time."""


def run_exists_error(cfg: Config, run_id: str, lake: Lake, ask_holder: bool = True) -> RunExistsError:
    """The refusal of a `train` of an existing run: naming the process that runs it now, if one does (asked unless
    this process holds the lease), or saying that it finished (a resume would have nothing to do)."""
    from storage import lease

    held_by = lease.holder(lake, run_id) if ask_holder else None
    if held_by is not None:  # running now: a resume would be refused too
        return RunExistsError(
            f"run {run_id} already exists in {cfg.lake.uri} and is in use by "
            f"{lease.describe(held_by)}: choose another run.run_id"
        )
    if lake.fs.exists(f"{lake.run_dir(run_id)}/summary.json"):
        return RunExistsError(
            f"run {run_id} already exists in {cfg.lake.uri} and has finished: choose another run.run_id, or leave "
            "it unset to name each run by its start time"
        )
    return RunExistsError(
        f"run {run_id} already exists in {cfg.lake.uri}: continue it with "
        f"`lockstep resume {run_id} --lake {cfg.lake.uri}` or choose another run.run_id"
    )


def check_run_free(cfg: Config, resume: bool) -> None:
    """The run a command names is free for it: RunExistsError for a `train` whose `run.run_id` the lake has,
    RunInUseError (as the lease words it) for a `resume` of a run another process holds. A look only, for the CLI to
    refuse before it imports the flow and starts Prefect; `open_session` decides, under the run's lease."""
    from storage import lease
    from storage.lake import Lake

    run_id = cfg.run.run_id
    if run_id is None:  # named by its start time: a name of its own
        return
    lake = Lake(cfg.lake.uri)
    if resume:
        lease.check_free(lake, run_id, "resume")
    elif lake.fs.exists(lake.config_file(run_id)):
        raise run_exists_error(cfg, run_id, lake)
