"""storage/shards.py on storage/lake.py: schema round trip, the length invariant, atomic publication (a failed
write leaves nothing; a concurrent reader never sees a partial shard), and detection of damaged shards."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from storage.lake import Lake
from storage.shards import (
    ROLLOUT_SCHEMA,
    SCHEMA_VERSION,
    SampleRecord,
    ShardError,
    _content_checksum,
    read_shard,
    record_dict,
    records_to_table,
    table_to_records,
    write_shard,
)
from tests.half_writes import fail_writes_half_way

REPO = Path(__file__).resolve().parents[2]
RUN = "run-a"
T0 = datetime(2025, 3, 4, 5, 6, 7, 890000, tzinfo=timezone.utc)  # whole milliseconds: the column is ms
MARKER = -1.2345678806304932  # float32(-1.2345679) exactly, so it round-trips; its bytes locate the data buffer


def make_records(n_groups: int = 2, group_size: int = 3, resp_len: int = 4, prompt_len: int = 5) -> list[SampleRecord]:
    """Whole groups with every field set; values exactly representable in their Arrow types."""
    out = []
    for g in range(n_groups):
        for j in range(group_size):
            n = resp_len + j  # responses of different lengths, including the per-token lists
            out.append(
                SampleRecord(
                    run_id=RUN,
                    iteration=7,
                    policy_version=7,
                    group_id=f"7-{g}",
                    prompt_id=100 + g,
                    sample_index=j,
                    prompt_ids=[(g * 13 + t) % 50 for t in range(prompt_len)],
                    response_ids=[(j * 7 + t) % 50 for t in range(n)],
                    behavior_logprobs=[-0.5 * (t + 1) for t in range(n)],  # -0.5, -1.0, ... exact in float32
                    token_versions=[7] * n,
                    reward=0.25 * j + 1e-12,  # float64 keeps the 1e-12
                    finish_reason="stop" if j % 2 else "length",
                    prompt_text=f"Q: {g}+{j}=?\nA: ",
                    response_text=f"{g + j}\n",
                    worker=g % 2,
                    seed=2**62 + g * 10 + j,  # needs int64
                    created_at=T0 + timedelta(milliseconds=g * 1000 + j),
                )
            )
    return out


@pytest.fixture
def local_lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def shard_path(lake: Lake, name: str = "shard-0-00000.arrow") -> str:
    return f"{lake.iteration_rollouts(RUN, 7, 7)}/{name}"


# ------------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_round_trip_all_fields(local_lake, compression):
    records = make_records()
    records[1] = replace(records[1], prompt_text=None, response_text=None, worker=None, seed=None, created_at=None)
    records[2] = replace(records[2], response_ids=[], behavior_logprobs=[], token_versions=[])  # empty response
    records[3] = replace(records[3], behavior_logprobs=[MARKER] * len(records[3].response_ids))
    path = shard_path(local_lake)
    checksum = write_shard(local_lake, RUN, path, records, compression=compression)
    table = read_shard(local_lake, path, expected_checksum=checksum)
    assert table.schema.remove_metadata() == ROLLOUT_SCHEMA
    meta = table.schema.metadata
    assert meta[b"lockstep.schema_version"] == SCHEMA_VERSION.encode()
    assert meta[b"lockstep.sha256"] == checksum.encode() and len(checksum) == 64
    back = table_to_records(table)
    assert back == records
    # spot checks of values the dataclass equality would also cover, for a readable failure
    assert back[0].created_at == T0 and back[0].created_at.utcoffset() == timedelta(0)
    assert back[3].behavior_logprobs[0] == MARKER
    assert back[0].reward == 1e-12 and back[5].seed == 2**62 + 12
    assert record_dict(back[0])["group_id"] == "7-0"


def test_compression_is_applied(local_lake):
    # 40 samples x 300 repeated tokens: highly compressible, so zstd must give a much smaller file
    records = make_records(n_groups=10, group_size=4, resp_len=300)
    records = [replace(r, response_ids=[5] * len(r.response_ids)) for r in records]
    plain, packed = shard_path(local_lake, "plain.arrow"), shard_path(local_lake, "zstd.arrow")
    c1 = write_shard(local_lake, RUN, plain, records)
    c2 = write_shard(local_lake, RUN, packed, records, compression="zstd")
    assert c1 == c2  # the checksum is of the content, not of the bytes on disk
    fs = local_lake.fs
    assert fs.size(packed) < fs.size(plain) / 2
    with fs.open(packed, "rb") as f:
        assert ipc.open_file(pa.BufferReader(f.read())).get_batch(0).num_rows == 40


def test_checksum_is_deterministic_and_content_sensitive(local_lake):
    records = make_records()
    a = write_shard(local_lake, RUN, shard_path(local_lake, "a.arrow"), records)
    b = write_shard(local_lake, RUN, shard_path(local_lake, "b.arrow"), records)
    changed = [replace(records[0], reward=0.5), *records[1:]]
    c = write_shard(local_lake, RUN, shard_path(local_lake, "c.arrow"), changed)
    assert a == b != c


def test_expected_checksum_mismatch(local_lake):
    path = shard_path(local_lake)
    write_shard(local_lake, RUN, path, make_records())
    with pytest.raises(ShardError, match=f"shard {path} failed its checksum.*expected 0000"):
        read_shard(local_lake, path, expected_checksum="0" * 64)


@pytest.mark.parametrize("field", ["behavior_logprobs", "token_versions"])
def test_length_invariant_violation_raises(local_lake, field):
    records = make_records()
    bad = replace(records[4], **{field: getattr(records[4], field)[:-1]})  # one short
    path = shard_path(local_lake)
    with pytest.raises(ValueError, match=r"sample 7-1/1: .*must have the length of response_ids \(5\)"):
        write_shard(local_lake, RUN, path, [*records[:4], bad, *records[5:]])
    assert not local_lake.fs.exists(path)


def test_the_schema_pins_which_fields_a_sample_must_have():
    required = [
        "run_id",
        "iteration",
        "policy_version",
        "group_id",
        "prompt_id",
        "sample_index",
        "prompt_ids",
        "response_ids",
        "behavior_logprobs",
        "token_versions",
        "reward",
        "finish_reason",
    ]
    assert [f.name for f in ROLLOUT_SCHEMA if not f.nullable] == required
    assert [f.name for f in ROLLOUT_SCHEMA if f.nullable] == [
        "prompt_text",
        "response_text",
        "worker",
        "seed",
        "created_at",
    ]


@pytest.mark.parametrize("field", ["reward", "finish_reason", "policy_version"])
def test_a_required_field_left_none_is_refused(local_lake, field):
    # pyarrow writes None into a non-nullable column without complaint: the trainer would read a reward of None
    records = make_records()
    bad = replace(records[2], **{field: None})
    path = shard_path(local_lake)
    with pytest.raises(ValueError, match=rf"^{field} is None in 1 sample\(s\) \(first 7-0/2\); a shard requires it"):
        write_shard(local_lake, RUN, path, [*records[:2], bad, *records[3:]])
    assert not local_lake.fs.exists(path)
    write_shard(local_lake, RUN, path, [*records[:2], replace(records[2], worker=None, seed=None), *records[3:]])


# ------------------------------------------------------------------------------------------------ atomic publish


def _listing(lake: Lake, prefix: str) -> list[str]:
    return lake.fs.ls(prefix, detail=False) if lake.fs.exists(prefix) else []


@pytest.mark.parametrize("lake_kind", ["local", "memory"])
def test_failed_rename_leaves_nothing_published(request, monkeypatch, lake_kind):
    lake = request.getfixturevalue(f"{lake_kind}_lake")
    fs = lake.fs

    def boom(*args, **kwargs):
        raise OSError("injected failure during publish")

    monkeypatch.setattr(type(fs), "mv", boom)
    path = shard_path(lake)
    with pytest.raises(OSError, match="injected failure"):
        write_shard(lake, RUN, path, make_records())
    monkeypatch.undo()
    assert not fs.exists(path)
    assert _listing(lake, path.rsplit("/", 1)[0]) == []


@pytest.mark.parametrize("lake_kind", ["local", "memory"])
def test_writer_dying_mid_write_leaves_nothing_published(request, monkeypatch, lake_kind):
    lake = request.getfixturevalue(f"{lake_kind}_lake")
    fs = lake.fs
    partial = fail_writes_half_way(monkeypatch, fs)
    path = shard_path(lake)
    with pytest.raises(OSError, match="mid-write"):
        write_shard(lake, RUN, path, make_records())
    monkeypatch.undo()
    assert partial and partial[0] > 0  # the injected failure really happened after bytes were written
    assert not fs.exists(path)
    assert _listing(lake, path.rsplit("/", 1)[0]) == []


def test_published_shard_is_the_only_file_under_its_prefix(memory_lake):
    path = shard_path(memory_lake)
    write_shard(memory_lake, RUN, path, make_records())
    listed = _listing(memory_lake, path.rsplit("/", 1)[0])
    assert [p.rsplit("/", 1)[-1] for p in listed] == ["shard-0-00000.arrow"]
    assert memory_lake.url(path).startswith("memory://")


def _reader_loop(lake: Lake, prefix: str, stop: threading.Event, seen: dict, errors: list, passes: list) -> None:
    """List the prefix and read every file, again and again, as the streaming trainer does."""
    while True:
        done = stop.is_set()  # one full pass after the writer finished
        listed = _listing(lake, prefix)
        passes.append(len(listed))
        for p in listed:
            try:
                seen[p] = read_shard(lake, p).num_rows
            except Exception as e:  # noqa: BLE001 - any failure to read a listed shard is the finding
                errors.append(f"{type(e).__name__}: {e}"[:300])
        if done:
            return


def _publish_while_reading(lake: Lake, write_one, n_shards: int) -> tuple[dict, list, list]:
    prefix = lake.iteration_rollouts(RUN, 7, 7)
    lake.fs.makedirs(prefix, exist_ok=True)
    stop, seen, errors, passes = threading.Event(), {}, [], []
    reader = threading.Thread(target=_reader_loop, args=(lake, prefix, stop, seen, errors, passes))
    reader.start()
    try:
        for i in range(n_shards):
            write_one(f"{prefix}/shard-0-{i:05d}.arrow")
    finally:
        stop.set()
        reader.join(timeout=60)
    assert not reader.is_alive()
    return seen, errors, passes


def big_records() -> list[SampleRecord]:
    # 64 samples x 4096 tokens: a ~3 MB shard, large enough that a non-atomic write is observable
    return make_records(n_groups=16, group_size=4, resp_len=4096, prompt_len=200)


@pytest.mark.parametrize("lake_kind", ["local", "memory"])
def test_concurrent_reader_never_sees_a_partial_shard(request, lake_kind):
    lake = request.getfixturevalue(f"{lake_kind}_lake")
    records = big_records()
    seen, errors, passes = _publish_while_reading(lake, lambda p: write_shard(lake, RUN, p, records), n_shards=4)
    assert errors == []
    # the reader really ran during publication: some pass listed some but not all of the four shards
    assert any(0 < n < 4 for n in passes) and passes[-1] == 4
    assert sorted(p.rsplit("/", 1)[-1] for p in seen) == [f"shard-0-{i:05d}.arrow" for i in range(4)]
    assert set(seen.values()) == {64}


def test_negative_control_non_atomic_write_is_caught(local_lake):
    """The reader loop above can fail: a writer that publishes in place, in two halves with the reader reading in
    between, is caught as an unreadable shard naming its path."""
    records = big_records()
    # serialise the same bytes write_shard would publish
    scratch = shard_path(local_lake, "scratch.arrow")
    write_shard(local_lake, RUN, scratch, records)
    with local_lake.fs.open(scratch, "rb") as f:
        data = f.read()
    local_lake.fs.rm(scratch)
    prefix = local_lake.iteration_rollouts(RUN, 7, 7)
    path = f"{prefix}/shard-0-00000.arrow"
    half_written, read_done = threading.Event(), threading.Event()
    errors: list[str] = []

    def reader():
        half_written.wait(30)
        for p in _listing(local_lake, prefix):
            try:
                read_shard(local_lake, p)
            except ShardError as e:
                errors.append(str(e))
        read_done.set()

    t = threading.Thread(target=reader)
    t.start()
    with open(path, "wb") as f:  # in place: what atomic publication exists to prevent
        f.write(data[: len(data) // 2])
        f.flush()
        half_written.set()
        read_done.wait(30)
        f.write(data[len(data) // 2 :])
    t.join(30)
    assert len(errors) == 1 and f"shard {path} is unreadable" in errors[0]
    assert read_shard(local_lake, path).num_rows == 64  # once complete, the same bytes are a good shard


# ------------------------------------------------------------------------------------------------ damaged shards


@pytest.mark.parametrize("lake_kind", ["local", "memory"])
@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
def test_truncated_shard_raises_shard_error(request, lake_kind, keep):
    lake = request.getfixturevalue(f"{lake_kind}_lake")
    path = shard_path(lake)
    write_shard(lake, RUN, path, make_records())
    with lake.fs.open(path, "rb") as f:
        data = f.read()
    with lake.fs.open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])
    with pytest.raises(ShardError, match=f"shard {path} is unreadable"):
        read_shard(lake, path)


@pytest.mark.parametrize("lake_kind", ["local", "memory"])
def test_bit_flip_in_data_fails_checksum(request, lake_kind):
    lake = request.getfixturevalue(f"{lake_kind}_lake")
    records = make_records()
    records[0] = replace(records[0], behavior_logprobs=[MARKER] * len(records[0].response_ids))
    path = shard_path(lake)
    write_shard(lake, RUN, path, records)  # uncompressed: the float's bytes are in the file as they are
    with lake.fs.open(path, "rb") as f:
        data = bytearray(f.read())
    pos = data.find(struct.pack("<f", MARKER))
    assert pos > 0
    data[pos] ^= 0x01  # lowest mantissa bit of one log-prob: a well-formed file with different content
    with lake.fs.open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ShardError, match=f"shard {path} failed its checksum"):
        read_shard(lake, path)


def test_foreign_arrow_file_is_refused(local_lake):
    path = shard_path(local_lake)
    local_lake.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    table = pa.table({"x": [1, 2, 3]})
    with local_lake.fs.open(path, "wb") as f, ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ShardError, match=f"shard {path} has schema version None"):
        read_shard(local_lake, path)


def test_missing_shard_raises_shard_error(local_lake):
    path = shard_path(local_lake, "missing.arrow")
    with pytest.raises(ShardError, match=f"shard {path} is unreadable"):
        read_shard(local_lake, path)


_SWEEP = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from tests.unit.test_shards import make_records, shard_path, RUN
    from storage.lake import Lake
    from storage.shards import ShardError, read_shard, write_shard

    lake = Lake(sys.argv[2])
    path = shard_path(lake)
    write_shard(lake, RUN, path, make_records(n_groups=1, group_size=2, resp_len=3, prompt_len=3),
                compression=sys.argv[3] if sys.argv[3] != "none" else None)
    with lake.fs.open(path, "rb") as f:
        original = f.read()
    expected = read_shard(lake, path)
    bad = []
    for pos in range(len(original)):
        data = bytearray(original)
        data[pos] ^= 1 << ((pos * 5) % 8)  # one flip per byte, cycling through the bit positions
        with lake.fs.open(path, "wb") as f:
            f.write(bytes(data))
        try:
            if not read_shard(lake, path).equals(expected, check_metadata=True):
                bad.append((pos, "silently different content"))
        except ShardError:
            pass
        except BaseException as e:
            bad.append((pos, type(e).__name__))
    print(len(bad), bad[:5])
    sys.exit(1 if bad else 0)
    """
)


@pytest.mark.slow
def test_every_single_bit_flip_is_detected_or_harmless():
    """Flip one bit of every byte of a small shard: each read must raise ShardError or return the original
    rows. Run in a child process because the failure mode found is a segmentation fault."""
    lake_uri = f"memory://lockstep-sweep-{uuid.uuid4().hex}"  # in the child's memory: no disk I/O per flip
    proc = subprocess.run(
        [sys.executable, "-c", _SWEEP, str(REPO), lake_uri, "none"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


def test_a_shard_whose_checksum_matches_its_broken_offsets_is_refused(local_lake):
    """A file consistent with its own checksum but with an interior list offset past the values (a writer's bug or a
    crafted file; a random flip there fails the checksum, as the sweep above shows) is refused before a row is
    decoded. Only full validation reads interior offsets: the checksum's serialisation reads the first and last."""
    table = records_to_table(make_records(n_groups=1, group_size=3, resp_len=3, prompt_len=3))
    column = table.column("response_ids").chunk(0)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[: len(column) + 1].copy()
    assert offsets.tolist() == [0, 3, 7, 12]
    offsets[1] = 10**6
    broken = pa.Array.from_buffers(
        column.type, len(column), [None, pa.py_buffer(offsets.tobytes())], children=[column.values]
    )
    table = table.set_column(table.schema.get_field_index("response_ids"), table.schema.field("response_ids"), broken)
    stamped = {"lockstep.schema_version": SCHEMA_VERSION, "lockstep.sha256": _content_checksum(table)}
    path = shard_path(local_lake)
    local_lake.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with local_lake.fs.open(path, "wb") as f, ipc.new_file(f, table.schema) as w:
        w.write_table(table.replace_schema_metadata(stamped))
    with pytest.raises(ShardError, match=f"shard {path} is unreadable .* offset for slot 1 out of bounds"):
        read_shard(local_lake, path)


def test_quarantine_folders_are_never_reused(local_lake):
    """Two resumes in the same second (or one shard damaged twice) set their evidence aside in folders of their own."""
    a, b = (local_lake.quarantine_dir("q", "iter-000003") for _ in range(2))
    assert a != b
    assert a.startswith(f"{local_lake.run_dir('q')}/quarantine/iter-000003-")
