"""Start of a rollout worker: wall seconds from `WorkerPool(...)` to the worker's ready message (engine built from v0,
reward function imported), forked by the fork server (`tasks.workers.child_context`, the default) or spawned.

A spawned worker imports torch, transformers and lockstep's worker code itself, every run; a forked one starts with
them imported by the server, which does so once per process. So `first_fork_server_s` (the first start in this
process: the server's own imports included) is what a command's one run pays, and `fork_server_s` what each later
run of the same process pays (runs in a notebook or script, a `lockstep serve` deployment, the test suite).

The demo's model (untrained) is saved once as v0; the two ways alternate over `--repeats` starts each (ABBA order),
one pool at a time, with nothing else running here. Prints one JSON line: the medians, their ratio `speedup`
(spawned / forked), and the per-start figures.

    PYTHONPATH=. .venv/bin/python -m benchmarks.worker_start [--repeats 7]
"""

from __future__ import annotations

import statistics
import tempfile
import time

from benchmarks.common import abba, check_range, emit, parser


def _spec(lake: str, model_dir: str):
    from configs.schema import Config
    from tasks.workers import WorkerSpec

    cfg = Config()
    return WorkerSpec(
        lake_uri=lake,
        run_id="start",
        model_dir=model_dir,
        threads=cfg.resources.rollout_threads,
        run_seed=0,
        group_size=cfg.rollout.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        partial_credit=cfg.task.partial_credit,
        compression=None,
        reward_kind=cfg.task.reward,
        prompts=[],
    )


def _start(spec, fork_server: bool) -> float:
    from tasks.workers import WorkerPool

    t0 = time.perf_counter()
    pool = WorkerPool(1, spec, fork_server=fork_server)  # waits for the worker's ready message
    seconds = time.perf_counter() - t0
    pool.close()
    way = "forkserver" if fork_server else "spawn"
    if pool.start_method != way:  # a server that could not start (a long TMPDIR) must not pass as its figures
        raise SystemExit(f"the worker was started by {pool.start_method}, not {way}")
    return seconds


def main() -> None:
    ap = parser("benchmarks.worker_start", __doc__)
    ap.add_argument("--repeats", type=int, default=7, help="starts of each way (default 7)")
    args = ap.parse_args()
    check_range(ap, "--repeats", args.repeats, 1, 100)

    from configs.schema import Config
    from models.tiny import build_char_tokenizer, build_tiny_model, save_hf

    with tempfile.TemporaryDirectory(prefix="lockstep-worker-start-") as tmp:
        tok = build_char_tokenizer()
        save_hf(build_tiny_model(len(tok), **Config().model.tiny.model_dump()), tok, f"{tmp}/v0")
        spec = _spec(f"{tmp}/lake", f"{tmp}/v0")
        first = _start(spec, fork_server=True)  # the server starts and imports here
        times: dict[str, list[float]] = {"fork_server": [], "spawn": []}
        for way in abba("fork_server", "spawn", args.repeats):
            times[way].append(_start(spec, fork_server=way == "fork_server"))
    forked, spawned = statistics.median(times["fork_server"]), statistics.median(times["spawn"])
    emit(
        benchmark="worker_start",
        repeats=args.repeats,
        first_fork_server_s=round(first, 3),
        fork_server_s=round(forked, 3),
        spawn_s=round(spawned, 3),
        speedup=round(spawned / forked, 2),
        fork_server_each_s=[round(t, 3) for t in times["fork_server"]],
        spawn_each_s=[round(t, 3) for t in times["spawn"]],
    )


if __name__ == "__main__":
    main()
