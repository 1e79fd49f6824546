"""The audit catalog over a long run: `storage.catalog.write_iteration` for `--iterations` synthetic iterations of
`--samples` samples and 8 shards each, with the demo's row sizes (a 6-shot prompt's text, a short response, its token
ids and versions), in a temporary folder; nothing else runs. Each iteration is written as a run writes it the first
time (appended where the checkout's `write_iteration` takes `append`, merged before), tagged, and compacted from
`--compact-every` on as each checkout schedules it. The writes' time and the catalog's bytes as the run grows show how
they scale.

With `--against DIR` (another checkout of lockstep, e.g. `git worktree add DIR COMMIT`), the same series is written by
that checkout's `storage` package too, one checkout after the other (this one first), each in a process of its own
that runs this checkout's interpreter and libraries (LanceDB's version is this environment's for both).

Prints one JSON line per `--window` iterations and checkout (`tree`: this one or DIR): `iteration`, `ms_per_iteration`
(mean write time over the window), `slowest_ms`, `catalog_mb` (bytes on disk at its end) and `query_ms` (one query of
one version's rows, `policy_version = iteration // 2`, as `lockstep audit --version` makes: a single call that
connects and opens the table as the command does, so it varies by tens of percent from one window to the next) and
`rss_mb` (the writing process's resident memory at the window's end, as the flow's process would hold it).

    .venv/bin/python -m benchmarks.catalog [--iterations 1500] [--window 300] [--samples 256] [--against DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tables(iteration: int, samples: int):
    import pyarrow as pa

    n = samples
    prompt = "Q: 17+25=?\nA: 42\n" * 6 + "Q: 31+48=?\nA:"
    samples_table = pa.table(
        {
            "sample_id": [f"bench/{iteration}/{i // 8}/{i % 8}" for i in range(n)],
            "run_id": ["bench"] * n,
            "iteration": [iteration] * n,
            "policy_version": [iteration] * n,
            "group_id": [i // 8 for i in range(n)],
            "sample_index": [i % 8 for i in range(n)],
            "response_ids": [[5, 9, 3, 2]] * n,
            "token_versions": [[iteration] * 4] * n,
            "reward": [float(i % 3 == 0) for i in range(n)],
            "advantage": [0.5 - (i % 3 == 0) for i in range(n)],
            "finish_reason": ["stop"] * n,
            "prompt_text": [prompt] * n,
            "response_text": [" 79\n"] * n,
            "worker": [i % 2 for i in range(n)],
            "seed": list(range(iteration * n, (iteration + 1) * n)),
            "shard": [f"bench/rollouts/it{iteration}/shard-{i * 8 // n}.arrow" for i in range(n)],
        }
    )
    shards = pa.table(
        {
            "path": [f"bench/rollouts/it{iteration}/shard-{j}.arrow" for j in range(8)],
            "iteration": [iteration] * 8,
            "rows": [n // 8] * 8,
        }
    )
    return samples_table, shards


def _bytes(folder: str) -> int:
    return sum(os.path.getsize(f"{d}/{f}") for d, _, files in os.walk(folder) for f in files)


def _rss_mb() -> float | None:
    """This process's resident memory now (Linux's /proc; None elsewhere). Not `tasks.workers.resident_mb`: the series
    runs on another checkout's packages too, which may not have it, and importing it would load torch into the very
    process whose memory is measured."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except OSError:
        return None


def series(uri: str, iterations: int, window: int, samples: int, compact_every: int) -> None:
    """Write the series with the `storage.catalog` on sys.path; one JSON line (without `tree`) per window."""
    import inspect

    import lancedb  # noqa: F401  (imported here: not in the first write's time)

    from storage import catalog

    # each iteration written as a run writes it the first time: appended where the checkout can (its flow does)
    new = {"append": True} if "append" in inspect.signature(catalog.write_iteration).parameters else {}
    total = slowest = 0.0
    for k in range(iterations):
        samples_table, shards = _tables(k, samples)
        t0 = time.perf_counter()
        catalog.write_iteration(uri, samples_table, shards, version=k + 1, compact_every=compact_every, **new)
        dt = time.perf_counter() - t0
        total, slowest = total + dt, max(slowest, dt)
        if (k + 1) % window == 0 or k + 1 == iterations:
            t0 = time.perf_counter()
            rows = catalog.query(uri, where=f"policy_version = {(k + 1) // 2}").num_rows
            query_s = time.perf_counter() - t0
            done = (k % window) + 1
            print(
                json.dumps(
                    {
                        "iteration": k + 1,
                        "ms_per_iteration": round(1000 * total / done, 1),
                        "slowest_ms": round(1000 * slowest, 1),
                        "catalog_mb": round(_bytes(uri) / 2**20, 1),
                        "query_ms": round(1000 * query_s, 1),
                        "query_rows": rows,
                        "rss_mb": _rss_mb(),
                    }
                ),
                flush=True,
            )
            total = slowest = 0.0


def _run(tree: Path, args, work: str) -> None:
    """The series with `tree`'s code, in a process of its own (its `storage` package first on the path)."""
    from benchmarks.common import emit

    code = (  # this file by its path: `benchmarks` on the path is `tree`'s, which may not have it
        "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); "
        "spec = importlib.util.spec_from_file_location('catalog_bench', sys.argv[2]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "m.series(sys.argv[3], *map(int, sys.argv[4:]))"
    )
    uri = f"{work}/{'this' if tree == REPO else 'against'}/catalog"
    cmd = [sys.executable, "-c", code, str(tree), __file__, uri]
    cmd += [str(v) for v in (args.iterations, args.window, args.samples, args.compact_every)]
    env = {**os.environ, "LANCEDB_LOG": "error"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as p:
        for line in p.stdout:
            emit(tree=str(tree) if tree != REPO else "this", **json.loads(line))
    if p.returncode:
        raise SystemExit(f"the series of {tree} failed (exit {p.returncode})")


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common import MAX_ITERATIONS, check_checkout, check_range, parser

    ap = parser("benchmarks.catalog", __doc__)
    ap.add_argument("--iterations", type=int, default=1500)
    ap.add_argument("--window", type=int, default=300, help="iterations per printed line")
    ap.add_argument("--samples", type=int, default=256, help="samples per iteration")
    ap.add_argument("--compact-every", type=int, default=10, help="pipeline.catalog_compact_every")
    ap.add_argument("--against", help="another checkout of lockstep to write the same series with, after this one")
    args = ap.parse_args(argv)
    check_range(ap, "--iterations", args.iterations, 1, MAX_ITERATIONS)
    check_range(ap, "--window", args.window, 1, args.iterations)
    check_range(ap, "--samples", args.samples, 8)
    check_range(ap, "--compact-every", args.compact_every, 0)
    trees = [REPO]
    if args.against is not None:
        other = check_checkout(ap, args.against, "storage/catalog.py")
        if other == REPO:
            ap.error(f"--against {args.against}: this checkout itself; give another one")
        trees.append(other)
    with tempfile.TemporaryDirectory(prefix="lockstep-catalog-bench-") as work:
        for tree in trees:
            _run(tree, args, work)


if __name__ == "__main__":
    main()
