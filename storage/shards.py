"""Rollout shards: Arrow IPC files of whole groups, one row per sample, published atomically.

The schema below is the one place the rollout record is defined. Invariants of every row:
- `behavior_logprobs` and `token_versions` have the length of `response_ids`;
- a shard holds whole groups only: every `group_id` present has all of its `group_size` samples;
- `policy_version` is the version that started the sample; `token_versions[t]` the one that made token t.
The schema version and a content checksum (sha256 of the table's canonical IPC stream) live in the file's
metadata, so a reader detects a truncated or bit-flipped shard on read.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.ipc as ipc

from storage.lake import Lake, atomic_write_bytes

SCHEMA_VERSION = "1"

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int64(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("token_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("prompt_text", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field("worker", pa.int32()),
        pa.field("seed", pa.int64()),
        pa.field("created_at", pa.timestamp("ms", tz="UTC")),
    ]
)


class ShardError(ValueError):
    """A shard that is unreadable, truncated, or whose content does not match its checksum."""


@dataclass
class SampleRecord:
    run_id: str
    iteration: int
    policy_version: int
    group_id: str
    prompt_id: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    reward: float
    finish_reason: str
    prompt_text: str
    response_text: str
    worker: int
    seed: int
    created_at: object  # datetime (UTC)


def _content_checksum(table: pa.Table) -> str:
    sink = io.BytesIO()
    with ipc.new_stream(sink, table.schema.remove_metadata()) as w:
        w.write_table(table.replace_schema_metadata(None))
    return hashlib.sha256(sink.getvalue()).hexdigest()


def records_to_table(records: list[SampleRecord]) -> pa.Table:
    for r in records:
        n = len(r.response_ids)
        if len(r.behavior_logprobs) != n or len(r.token_versions) != n:
            raise ValueError(
                f"sample {r.group_id}/{r.sample_index}: behavior_logprobs ({len(r.behavior_logprobs)}) and "
                f"token_versions ({len(r.token_versions)}) must have the length of response_ids ({n})"
            )
    cols = {f.name: [getattr(r, f.name) for r in records] for f in ROLLOUT_SCHEMA}
    table = pa.Table.from_pydict(cols, schema=ROLLOUT_SCHEMA)
    for f in ROLLOUT_SCHEMA:  # pyarrow takes None in a non-nullable field: a shard would be written without it
        if not f.nullable and (nulls := table.column(f.name).null_count):
            first = next(r for r in records if getattr(r, f.name) is None)
            raise ValueError(
                f"{f.name} is None in {nulls} sample(s) (first {first.group_id}/{first.sample_index}); "
                "a shard requires it"
            )
    return table


def write_shard(lake: Lake, run_id: str, path: str, records: list[SampleRecord], compression: str | None = None) -> str:
    """Publish `records` as one Arrow IPC file at `path` (atomic); returns the content checksum."""
    table = records_to_table(records)
    checksum = _content_checksum(table)
    table = table.replace_schema_metadata({"lockstep.schema_version": SCHEMA_VERSION, "lockstep.sha256": checksum})
    sink = io.BytesIO()
    options = ipc.IpcWriteOptions(compression=compression)
    with ipc.new_file(sink, table.schema, options=options) as w:
        w.write_table(table)
    atomic_write_bytes(lake, run_id, path, sink.getvalue())
    return checksum


def read_shard(lake: Lake, path: str, expected_checksum: str | None = None) -> pa.Table:
    """Read and verify a shard; raises ShardError naming the file if it is truncated, corrupted or foreign.

    The table is validated before its buffers are touched: unvalidated, a flipped bit in an offset buffer aborts the
    reading process instead of raising. Basic validation (first and last offsets) and the checksum after it refuse
    every single-bit flip (all 8 bits of every byte of a test shard, each compression); full validation (every
    offset) also refuses a file whose checksum matches broken content (a writer's bug, a crafted file).
    """
    try:
        with lake.fs.open(path, "rb") as f:
            data = f.read()
        table = ipc.open_file(pa.BufferReader(data)).read_all()
        table.validate(full=True)
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        actual = _content_checksum(table)
    except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
        raise ShardError(f"shard {path} is unreadable (truncated, corrupted or not an Arrow file): {e}") from e
    if meta.get("lockstep.schema_version") != SCHEMA_VERSION:
        raise ShardError(
            f"shard {path} has schema version {meta.get('lockstep.schema_version')!r}, expected {SCHEMA_VERSION!r}"
        )
    stored = meta.get("lockstep.sha256")
    if actual != stored or (expected_checksum is not None and actual != expected_checksum):
        raise ShardError(
            f"shard {path} failed its checksum (stored {stored}, content {actual}"
            + (f", expected {expected_checksum})" if expected_checksum else ")")
        )
    return table


def table_to_records(table: pa.Table) -> list[SampleRecord]:
    return [SampleRecord(**row) for row in table.to_pylist()]


def record_dict(r: SampleRecord) -> dict:
    return asdict(r)
