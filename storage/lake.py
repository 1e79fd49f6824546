"""The lake: one fsspec URL holding every run (layout in DESIGN.md), and atomic publication on any filesystem.

On local disks (and memory://) writers put bytes under `{run}/_tmp/` and then rename them into place; object stores
publish an object whole when its upload completes (one PUT, or a multipart upload's completion), so there a file is
written in place: a "move" there is a copy and a delete. Either way a reader listing a prefix never sees a partial
file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.local import LocalFileSystem

from storage import faults

# Protocols whose files appear whole when their upload completes, and which LanceDB can write to.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run_id(run_id: str) -> str:
    """Run ids become path components: letters, digits, '.', '_' and '-', not starting with '.', no '..'."""
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or ".." in run_id:
        raise ValueError(
            f"invalid run id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run_id


def hf_offline() -> bool:
    """HF_HUB_OFFLINE is on (the CLI's default): nothing is asked of the Hugging Face hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


class LakeURLError(ValueError):
    """A lake URL whose filesystem fsspec cannot provide: an unknown protocol, or its package is not installed."""


def _check_local_folder(uri: str, root: str) -> None:
    """A local lake's folder `root` exists as a folder, or its nearest existing path is a folder it can be made in:
    tried by making (and removing at once) a probe folder of a name of its own there, since permission bits do not
    tell (root may write anywhere by them, yet not under /proc or on a read-only mount). Not the lake's own first
    folder: a run making its lake, or another check, may be using that one."""
    path = root
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        where = "" if path == root else f" (above the lake's folder {root})"
        raise LakeURLError(f"lake {uri!r}: {path}{where} is not a folder; give a folder for the lake")
    if path == root:  # an existing lake is read by audit, runs, report: not asked to be writable
        return
    try:
        probe = tempfile.mkdtemp(prefix=".lockstep-probe-", dir=path)
    except OSError as e:
        raise LakeURLError(
            f"lake {uri!r}: {root} does not exist and cannot be made (in {path}: {e.strerror or e}); create it, or "
            "give a folder you can write"
        ) from None
    os.rmdir(probe)


def check_lake_url(uri: str) -> None:
    """Every protocol of `uri` (chained URLs too, `simplecache::s3://...`) has an importable fsspec filesystem;
    nothing is opened or contacted. An empty one is refused: it would name the working directory."""
    if not uri.strip():
        raise LakeURLError("the lake is an empty string: give a local directory (e.g. ./lake) or an fsspec URL")
    for part in uri.split("::"):
        protocol, _ = fsspec.core.split_protocol(part)
        try:
            fsspec.get_filesystem_class(protocol or "file")
        except (ImportError, ValueError) as e:  # "Install s3fs to access S3", "Protocol not known: foo"
            raise LakeURLError(
                f"lake {uri!r}: {e}; give a local directory or an fsspec URL whose filesystem is "
                "installed (s3:// needs s3fs, gs:// gcsfs, az:// adlfs)"
            ) from None


def _behind_caches(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    while isinstance(fs, CachingFileSystem):
        fs = fs.fs
    return fs


def _first(protocol: str | tuple[str, ...]) -> str:
    """A filesystem's protocol, by its first name where it has several (s3fs: ("s3", "s3a"))."""
    return protocol if isinstance(protocol, str) else protocol[0]


@dataclass(frozen=True)
class Lake:
    """Paths of one lake URL plus its fsspec filesystem."""

    uri: str

    def __post_init__(self):
        check_lake_url(self.uri)  # here, not at the first path or file access deep inside a command

    # Parsed once per Lake: `url_to_fs` took ~25 us a call, and the watcher and every path helper ask for these.
    @functools.cached_property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem the lake is read and written through. A chained URL's read cache is kept in front of an
        object store only: on any other store (a local disk, memory://, sftp...) the files the lake rewrites (the
        ledger, PROMOTED) are published by a rename, which bypasses the cache, so it would serve their old copies."""
        fs, _ = fsspec.core.url_to_fs(self.uri)
        store = _behind_caches(fs)
        return fs if _first(store.protocol) in OBJECT_STORES else store

    @functools.cached_property
    def root(self) -> str:
        _, root = fsspec.core.url_to_fs(self.uri)
        return root.rstrip("/")

    @functools.cached_property
    def store(self) -> fsspec.AbstractFileSystem:
        """The filesystem behind any cache a chained URL (`simplecache::s3://...`) puts in front of it."""
        return _behind_caches(self.fs)

    @property
    def protocol(self) -> str:
        """The store's protocol: "file", "memory", "s3"..."""
        return _first(self.store.protocol)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def is_object_store(self) -> bool:
        return self.protocol in OBJECT_STORES

    def check_reachable(self) -> None:
        """On an object store, list the lake's prefix once: a store that does not answer (its endpoint, e.g.
        AWS_ENDPOINT_URL for an S3-compatible one), refused credentials, or a bucket that does not exist is a
        LakeURLError naming the lake, before a command's work, not a botocore traceback part-way; another remote
        store (sftp://, hf:// offline) is listed the same way. On a local disk, the lake's folder is a folder or
        can be made (no file in its place or above it; for a missing one, a probe folder is made in its nearest
        existing folder and removed). Nothing is left written."""
        if self.is_local:
            _check_local_folder(self.uri, self.root)
            return
        if self.protocol == "memory":
            return
        fs = self.store
        try:
            fs.invalidate_cache(self.root)  # (hf:// resolves the path here, asking the hub)
            fs.ls(self.root, detail=False)  # the lake's own prefix: all that credentials limited to it may list
            return
        except FileNotFoundError:  # a new lake, or no such bucket
            pass
        except Exception as e:  # botocore's EndpointConnectionError, ParamValidationError; PermissionError; hf://
            # offline (OfflineModeIsEnabled), an sftp host that does not answer
            reason = " ".join(str(e).split())[:400]
            endpoint = " (AWS_ENDPOINT_URL for an S3-compatible store)" if self.is_object_store else ""
            offline = ""
            if self.protocol == "hf" and hf_offline():
                offline = " (HF_HUB_OFFLINE=1, lockstep's commands' default: HF_HUB_OFFLINE=0 lets them reach the hub)"
            raise LakeURLError(
                f"lake {self.uri!r}: its store cannot be used ({type(e).__name__}: {reason}); check the URL, the "
                f"endpoint{endpoint} and the credentials{offline}"
            ) from None
        if not self.is_object_store:  # another fsspec store that answers (sftp://...): a new lake
            return
        bucket = self.root.split("/", 1)[0]
        try:
            fs.info(bucket)
        except FileNotFoundError:
            raise LakeURLError(
                f"lake {self.uri!r}: bucket {bucket!r} does not exist; create it, or fix the lake's URL"
            ) from None
        except Exception:  # a bucket-level request refused to credentials limited to a prefix: usable
            pass

    def makedirs(self, path: str) -> None:
        """A folder for files to come; nothing on object stores, which have none (s3fs would create a missing
        bucket)."""
        if not self.is_object_store:
            self.store.makedirs(path, exist_ok=True)

    def run_dir(self, run_id: str) -> str:
        return f"{self.root}/runs/{validate_run_id(run_id)}"

    def iteration_rollouts(self, run_id: str, version: int, iteration: int) -> str:
        return f"{self.run_dir(run_id)}/rollouts/policy_version={version}/iter-{iteration:06d}"

    def checkpoint_dir(self, run_id: str, version: int) -> str:
        return f"{self.run_dir(run_id)}/checkpoints/v{version:06d}"

    def config_file(self, run_id: str) -> str:
        """The run's frozen config, written as the run starts: a run of the lake is a folder that has one."""
        return f"{self.run_dir(run_id)}/config.json"

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
        """A full URL for a path of this lake's store (what tasks pass around and LanceDB opens; past any cache)."""
        return path if self.protocol in ("file", "local") else f"{self.protocol}://{path.lstrip('/')}"


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
    if lake.is_object_store:  # one PUT: the object is there whole or not at all
        faults.point("shard-write" if path.endswith(".arrow") else "file-write")  # literals: test_faults reads them
        fs.pipe_file(path, data)
        return
    tmp = lake.tmp_path(run_id, path.rsplit("/", 1)[-1])
    lake.makedirs(tmp.rsplit("/", 1)[0])
    lake.makedirs(path.rsplit("/", 1)[0])
    with fs.open(tmp, "wb") as f:
        f.write(data)
        if lake.is_local:
            f.flush()
            os.fsync(f.fileno())
    faults.point("shard-write" if path.endswith(".arrow") else "file-write")
    fs.mv(tmp, path)
    if lake.is_local:
        fsync_path(path.rsplit("/", 1)[0])


def move_folder(lake: Lake, src: str, dst: str) -> None:
    """Move the folder `src` to `dst`. Object stores have no rename: each object is copied, then the sources are
    deleted, so a stop part-way leaves every object in one place or in both, never lost."""
    fs = lake.fs
    if not lake.is_object_store:
        fs.mv(src, dst, recursive=True)
        return
    src = src.rstrip("/")
    files = fs.find(src)
    for path in files:
        fs.copy(path, f"{dst}{path[len(src) :]}")
    fs.rm(files)


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
