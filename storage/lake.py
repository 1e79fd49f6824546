"""The lake: one fsspec URL holding every run (layout in DESIGN.md), and atomic publication on any filesystem.

Writers put bytes under `{run}/_tmp/` and then rename into place (a rename on local disks, a single move on
memory:// and object stores), so a reader listing a prefix never sees a partial file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage import faults

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run_id(run_id: str) -> str:
    """Run ids become path components: letters, digits, '.', '_' and '-', not starting with '.', no '..'."""
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or ".." in run_id:
        raise ValueError(
            f"invalid run id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run_id


class LakeURLError(ValueError):
    """A lake URL whose filesystem fsspec cannot provide: an unknown protocol, or its package is not installed."""


def check_lake_url(uri: str) -> None:
    """Every protocol of `uri` (chained URLs too, `simplecache::s3://...`) has an importable fsspec filesystem;
    nothing is opened or contacted."""
    for part in uri.split("::"):
        protocol, _ = fsspec.core.split_protocol(part)
        try:
            fsspec.get_filesystem_class(protocol or "file")
        except (ImportError, ValueError) as e:  # "Install s3fs to access S3", "Protocol not known: foo"
            raise LakeURLError(
                f"lake {uri!r}: {e}; give a local directory or an fsspec URL whose filesystem is "
                "installed (s3:// needs s3fs, gs:// gcsfs, az:// adlfs)"
            ) from None


@dataclass(frozen=True)
class Lake:
    """Paths of one lake URL plus its fsspec filesystem."""

    uri: str

    def __post_init__(self):
        check_lake_url(self.uri)  # here, not at the first path or file access deep inside a command

    # Parsed once per Lake: `url_to_fs` took ~25 us a call, and the watcher and every path helper ask for these.
    @functools.cached_property
    def fs(self) -> fsspec.AbstractFileSystem:
        fs, _ = fsspec.core.url_to_fs(self.uri)
        return fs

    @functools.cached_property
    def root(self) -> str:
        _, root = fsspec.core.url_to_fs(self.uri)
        return root.rstrip("/")

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def run_dir(self, run_id: str) -> str:
        return f"{self.root}/runs/{validate_run_id(run_id)}"

    def iteration_rollouts(self, run_id: str, version: int, iteration: int) -> str:
        return f"{self.run_dir(run_id)}/rollouts/policy_version={version}/iter-{iteration:06d}"

    def checkpoint_dir(self, run_id: str, version: int) -> str:
        return f"{self.run_dir(run_id)}/checkpoints/v{version:06d}"

    def promoted_file(self, run_id: str) -> str:
        return f"{self.run_dir(run_id)}/checkpoints/PROMOTED"

    def ledger_file(self, run_id: str, iteration: int) -> str:
        return f"{self.run_dir(run_id)}/ledger/iter-{iteration:06d}.json"

    def quarantine_dir(self, run_id: str, label: str) -> str:
        """A new folder under `quarantine/` for what one resume sets aside, named by `label` and the time: evidence
        set aside by an earlier resume (the same shard damaged again, two resumes in one second) is never
        overwritten."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        return f"{self.run_dir(run_id)}/quarantine/{label}-{stamp}-{uuid.uuid4().hex[:8]}"

    def tmp_path(self, run_id: str, name: str) -> str:
        return f"{self.run_dir(run_id)}/_tmp/{uuid.uuid4().hex}-{name}"

    def url(self, path: str) -> str:
        """A full URL for a path of this lake's filesystem (what tasks pass around)."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if protocol in ("file", "local") else f"{protocol}://{path.lstrip('/')}"


def fsync_path(path: str) -> None:
    """Put a local file's bytes, or a local folder's entries (a rename into it), on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(lake: Lake, run_id: str, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see either nothing or the whole file. On a local lake the bytes
    reach the disk before the rename publishes them, and the rename before this returns: after a power cut the
    file is the old one or the new one, never a new name over missing data (object stores publish whole objects)."""
    fs = lake.fs
    tmp = lake.tmp_path(run_id, path.rsplit("/", 1)[-1])
    fs.makedirs(tmp.rsplit("/", 1)[0], exist_ok=True)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(tmp, "wb") as f:
        f.write(data)
        if lake.is_local:
            f.flush()
            os.fsync(f.fileno())
    faults.point("shard-write" if path.endswith(".arrow") else "file-write")
    fs.mv(tmp, path)
    if lake.is_local:
        fsync_path(path.rsplit("/", 1)[0])


def atomic_write_json(lake: Lake, run_id: str, path: str, obj: Any) -> None:
    atomic_write_bytes(lake, run_id, path, json.dumps(obj, indent=2, sort_keys=True).encode())


def read_json(lake: Lake, path: str) -> Any:
    """A JSON file of the lake; ValueError naming the file if it is not JSON (the lake writes each atomically, so
    damage came from outside)."""
    with lake.fs.open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e})") from None
