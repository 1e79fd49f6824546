"""The run ledger: one JSON record per iteration with a state machine, written atomically.

planned -> rolling_out -> trained -> promoted, or failed (with the reason). Resume reads it.
"""

from __future__ import annotations

import time
from typing import Literal

from storage.lake import Lake, atomic_write_json, read_json

State = Literal["planned", "rolling_out", "trained", "promoted", "failed"]
_NEXT: dict[str, set[str]] = {
    "planned": {"rolling_out", "failed"},
    "rolling_out": {"trained", "failed"},
    "trained": {"promoted", "failed"},
    "promoted": set(),
    "failed": {"planned", "rolling_out"},  # a resume restarts a failed iteration
}


def write_record(lake: Lake, run_id: str, iteration: int, state: State | tuple[State, ...], **fields) -> dict:
    """Move iteration `iteration` to `state`, merging `fields` into its record; refuses illegal transitions.

    A tuple of states makes those transitions in order with one write (each is checked and kept in the history)."""
    path = lake.ledger_file(run_id, iteration)
    record = read_json(lake, path) if lake.fs.exists(path) else {"iteration": iteration, "history": []}
    now = time.time()
    for next_state in (state,) if isinstance(state, str) else state:
        prev = record.get("state")
        if prev is None and next_state != "planned":
            raise ValueError(
                f"ledger of run {run_id} iteration {iteration}: a new record starts 'planned', not {next_state!r}"
            )
        if prev is not None and next_state not in _NEXT[prev]:
            raise ValueError(f"ledger of run {run_id} iteration {iteration}: illegal transition {prev} -> {next_state}")
        record["state"] = next_state
        record["history"].append({"state": next_state, "at": now})
    record.update(fields)
    atomic_write_json(lake, run_id, path, record)
    return record


def annotate(lake: Lake, run_id: str, iteration: int, **fields) -> dict:
    """Add fields to an existing record without changing its state (e.g. `cataloged` after the catalog write)."""
    path = lake.ledger_file(run_id, iteration)
    record = read_json(lake, path)
    record.update(fields)
    atomic_write_json(lake, run_id, path, record)
    return record


def _read(lake: Lake, run_id: str, path: str) -> dict:
    """A record, its shards' paths in `lake` (`shard_path`)."""
    record = read_json(lake, path)
    if not isinstance(record, dict) or "state" not in record:
        raise ValueError(f"{path} is not a ledger record (a JSON object with a 'state')")
    for shard in record.get("shards") or ():
        if isinstance(shard, dict) and isinstance(shard.get("path"), str):  # else damaged: named where it is read
            shard["path"] = shard_path(lake, run_id, shard["path"])
    return record


def shard_path(lake: Lake, run_id: str, recorded: str) -> str:
    """Where a shard the ledger records lies in `lake`. A record holds the path the shard was written to, in the lake
    as it was named then: re-rooted at the run's folder, a lake that was moved, copied or is named by another URL
    reads its own shards, never those of the place it came from (a copy's replay read the original's). A path
    outside `runs/{run_id}/rollouts/` is returned as it is (its read names it)."""
    marker = f"/runs/{run_id}/rollouts/"
    _, found, rest = recorded.rpartition(marker)
    return f"{lake.run_dir(run_id)}/rollouts/{rest}" if found else recorded


def read_record(lake: Lake, run_id: str, iteration: int) -> dict | None:
    path = lake.ledger_file(run_id, iteration)
    return _read(lake, run_id, path) if lake.fs.exists(path) else None


def read_all(lake: Lake, run_id: str) -> list[dict]:
    d = f"{lake.run_dir(run_id)}/ledger"
    if not lake.fs.exists(d):
        return []
    return [_read(lake, run_id, p) for p in sorted(lake.fs.ls(d, detail=False)) if p.endswith(".json")]
