"""storage/lake.py's URL handling and preflight, found unpinned by a mutation audit: a chained URL's store is the one
behind its cache, a multi-protocol store is named by its first protocol, `check_reachable` tells an unusable store, a
missing bucket and a prefix-only credential apart without writing anything, and object-store moves and JSON writes
leave exactly the objects and bytes they claim."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import known_implementations

from storage import faults
from storage import lake as lake_module
from storage.lake import Lake, LakeURLError, atomic_write_bytes, atomic_write_json, move_folder, read_json

RUN = "url-run"


class FakeStore(MemoryFileSystem):
    """An object store in memory whose paths are `bucket/key` (no leading '/', as s3fs's) and whose listing and
    bucket lookup fail as a test says: `ls_error` / `info_error` are raised for any listing / the bucket."""

    protocol = "lockstepfake"
    root_marker = ""
    ls_error: BaseException | None = None
    info_error: BaseException | None = None
    calls: list = []

    @classmethod
    def _strip_protocol(cls, path):
        return path.split("://", 1)[-1].rstrip("/")

    def ls(self, path, detail=True, **kwargs):
        type(self).calls.append(("ls", path))
        if path in self.dircache:  # as s3fs: a listing this process made before, not asked again
            return self.dircache[path] if detail else [e["name"] for e in self.dircache[path]]
        if type(self).ls_error is not None:
            raise type(self).ls_error
        return super().ls(path, detail=detail, **kwargs)

    def invalidate_cache(self, path=None):  # as s3fs: forget the listings of `path` (all, for None)
        if path is None:
            self.dircache.clear()
        else:
            self.dircache.pop(self._strip_protocol(path), None)

    def info(self, path, **kwargs):
        if "/" in path:  # an object or prefix: the memory store's own answer
            return super().info(path, **kwargs)
        type(self).calls.append(("info", path))  # a bucket: there, unless the test says otherwise
        if type(self).info_error is not None:
            raise type(self).info_error
        return {"name": path, "size": 0, "type": "directory"}


@pytest.fixture
def fake_store(monkeypatch):
    fsspec.register_implementation(FakeStore.protocol, FakeStore, clobber=True)
    monkeypatch.setattr(lake_module, "OBJECT_STORES", lake_module.OBJECT_STORES | {FakeStore.protocol})
    monkeypatch.setattr(FakeStore, "calls", [])
    monkeypatch.setattr(FakeStore, "ls_error", None)
    monkeypatch.setattr(FakeStore, "info_error", None)
    lake = Lake(f"{FakeStore.protocol}://bucket-{uuid.uuid4().hex[:8]}/lake")
    assert lake.is_object_store
    return lake


# ------------------------------------------------------------------------------------------------ stores and URLs


def test_a_chained_url_names_the_store_behind_its_cache(memory_lake):
    """`simplecache::memory://...` caches reads, but paths handed to other processes and LanceDB must name the store
    itself: its protocol, not the cache's."""
    cached = Lake(f"simplecache::{memory_lake.uri}")
    assert isinstance(cached.store, MemoryFileSystem)
    assert cached.protocol == "memory"
    assert cached.url(cached.run_dir(RUN)) == f"{memory_lake.uri}/runs/{RUN}"


@pytest.mark.parametrize("store", ["file", "memory"])
def test_a_cache_in_front_of_a_disk_or_memory_never_serves_a_rewritten_file_stale(tmp_path, memory_lake, store):
    """The lake publishes by renaming (`atomic_write_bytes`), which a read cache does not see: in front of a local
    disk or memory the cache is dropped, so the ledger's and PROMOTED's rewrites are read back as written (they were
    read back stale, and the flow's next ledger transition refused), and a local disk is still treated as one."""
    from storage import checkpoints, ledger

    base = f"file://{tmp_path / 'lake'}" if store == "file" else memory_lake.uri
    lake = Lake(f"simplecache::{base}")
    assert lake.is_local == (store == "file") and not lake.is_object_store
    ledger.write_record(lake, RUN, 0, ("planned", "rolling_out"), prompt_ids=[1, 2])
    assert ledger.read_record(lake, RUN, 0)["state"] == "rolling_out"  # read once: in a cache, were there one
    ledger.write_record(lake, RUN, 0, "trained", shards=[])
    assert ledger.read_record(lake, RUN, 0)["state"] == "trained"
    ledger.write_record(lake, RUN, 0, "promoted", promoted_version=1)
    for version in (0, 1):
        atomic_write_json(lake, RUN, lake.promoted_file(RUN), {"version": version})
        assert checkpoints.promoted_version(lake, RUN) == version
    assert read_json(Lake(base), lake.ledger_file(RUN, 0))["state"] == "promoted"  # the store holds it


def test_a_store_with_several_protocols_is_named_by_its_first():
    """s3fs answers to ('s3', 's3a'): URLs are s3://, the name every reader accepts. Nothing is contacted."""
    pytest.importorskip("s3fs")
    lake = Lake("s3://bucket/lake")
    assert lake.protocol == "s3" and lake.is_object_store
    assert lake.url(lake.ledger_file(RUN, 3)) == f"s3://bucket/lake/runs/{RUN}/ledger/iter-000003.json"


def test_a_local_lake_is_its_paths_and_not_an_object_store(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    assert lake.protocol == "file" and lake.is_local and not lake.is_object_store
    assert lake.url(lake.run_dir(RUN)) == f"{tmp_path}/lake/runs/{RUN}"


# ------------------------------------------------------------------------------------------------ check_reachable


def test_a_store_that_refuses_its_listing_is_one_error_naming_the_lake(fake_store):
    FakeStore.ls_error = PermissionError("Access Denied\n  for this key")
    with pytest.raises(LakeURLError, match=r"its store cannot be used \(PermissionError: Access Denied for this key\)"):
        fake_store.check_reachable()
    assert FakeStore.calls == [("ls", fake_store.root)]


def test_the_probe_asks_the_store_not_a_listing_cached_before(fake_store):
    """A listing cached earlier in this process (s3fs keeps them) would hide credentials refused since."""
    fake_store.fs.dircache[fake_store.root] = [{"name": f"{fake_store.root}/runs", "size": 0, "type": "directory"}]
    FakeStore.ls_error = PermissionError("ExpiredToken")
    with pytest.raises(LakeURLError, match=r"\(PermissionError: ExpiredToken\)"):
        fake_store.check_reachable()


def test_every_object_store_protocol_fsspec_knows_is_taken_for_one():
    """A gs:// or az:// lake taken for a disk would be renamed into (a copy of every object) and its folders
    created (s3fs/gcsfs create a missing bucket): every protocol fsspec maps to S3, GCS or Azure Blob is listed."""
    classes = ("s3fs.S3FileSystem", "gcsfs.GCSFileSystem", "adlfs.AzureBlobFileSystem")
    stores = {p for p, impl in known_implementations.items() if impl["class"] in classes}
    assert {"s3", "s3a", "gs", "gcs", "az", "abfs"} <= stores
    assert stores <= lake_module.OBJECT_STORES


def test_a_new_lake_in_an_existing_bucket_is_reachable(fake_store):
    """An empty prefix lists as missing: the bucket is then looked up (by its name, not the lake's prefix), and
    being there, the lake is usable. Nothing is written."""
    fake_store.check_reachable()
    bucket = fake_store.root.split("/")[0]
    assert FakeStore.calls == [("ls", fake_store.root), ("info", bucket)]
    assert fake_store.fs.find(bucket) == []


def test_a_missing_bucket_is_named(fake_store):
    FakeStore.info_error = FileNotFoundError(fake_store.root)
    bucket = fake_store.root.split("/")[0]
    with pytest.raises(LakeURLError, match=f"bucket '{bucket}' does not exist"):
        fake_store.check_reachable()


def test_a_bucket_lookup_refused_to_prefix_credentials_is_usable(fake_store):
    """Credentials limited to the lake's prefix may not look the bucket up: that refusal is not an error."""
    FakeStore.info_error = PermissionError("Forbidden")
    fake_store.check_reachable()
    assert [c for c, _ in FakeStore.calls] == ["ls", "info"]


def test_a_listed_prefix_needs_no_bucket_lookup(fake_store):
    fake_store.fs.pipe_file(f"{fake_store.root}/runs/r/x", b"x")
    fake_store.check_reachable()
    assert FakeStore.calls == [("ls", fake_store.root)]


def test_a_local_lake_is_not_listed(tmp_path, monkeypatch):
    """Only object stores are probed: a local lake that does not exist yet is fine."""
    lake = Lake(str(tmp_path / "new"))
    monkeypatch.setattr(type(lake.fs), "ls", lambda *a, **k: pytest.fail("listed a local lake"))
    lake.check_reachable()


def test_a_local_lake_must_be_a_folder_or_makeable(tmp_path, monkeypatch):
    """A file in the lake's place or above it, or a missing folder under one where no folder can be made, is refused
    with the path at fault; nothing is left by the check (a probe folder of its own name is made and removed there:
    not the lake's first folder, which a run making its lake, or another check, may be using)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    Lake(str(tmp_path)).check_reachable()  # an existing folder
    Lake(str(tmp_path / "a" / "b")).check_reachable()  # made later, under a writable folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    with pytest.raises(LakeURLError, match=f"^lake '{afile}': {afile} is not a folder; give a folder for the lake$"):
        Lake(str(afile)).check_reachable()
    below = afile / "x" / "lake"
    with pytest.raises(LakeURLError, match=f"^lake '{below}': {afile} \\(above the lake's folder {below}\\) is not a"):
        Lake(str(below)).check_reachable()
    made, removed = [], []
    real_mkdir, real_rmdir = os.mkdir, os.rmdir
    monkeypatch.setattr(lake_module.os, "mkdir", lambda path, *a: made.append(path) or real_mkdir(path, *a))
    monkeypatch.setattr(lake_module.os, "rmdir", lambda path: removed.append(path) or real_rmdir(path))
    Lake(str(tmp_path / "new" / "lake")).check_reachable()
    assert made == removed and len(made) == 1  # one probe, removed
    assert os.path.dirname(made[0]) == str(tmp_path) and os.path.basename(made[0]).startswith(".lockstep-probe-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]

    def refused(path, *a):
        made.append(path)
        raise PermissionError(13, "Permission denied")

    made.clear()
    monkeypatch.setattr(lake_module.os, "mkdir", refused)
    Lake(str(tmp_path)).check_reachable()  # an existing lake is read by audit, runs, report: not asked to be writable
    assert made == []
    with pytest.raises(
        LakeURLError,
        match=f"{tmp_path / 'new' / 'lake'} does not exist and cannot be made \\(in {tmp_path}: Permission denied\\)",
    ):
        Lake(str(tmp_path / "new" / "lake")).check_reachable()
    assert len(made) == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_lake_under_a_folder_no_one_can_make_folders_in_is_refused():
    """Permission bits do not tell: root may write anywhere by them, and /proc's are 0555 with mkdir refused to
    everyone (os.access said yes as root, and `lockstep train` failed in the flow with a bare FileNotFoundError)."""
    with pytest.raises(LakeURLError, match=r"^lake '/proc/lockstep-lake': /proc/lockstep-lake does not exist and "):
        Lake("/proc/lockstep-lake").check_reachable()


def test_another_remote_store_is_asked_once_and_its_failure_named(fake_store, monkeypatch):
    """A store that is neither a disk nor an object store (sftp://, hf://) is listed as an object store is, and
    its error is the lake's (hf:// offline was a huggingface_hub traceback from the flow); no bucket is asked."""
    monkeypatch.setattr(lake_module, "OBJECT_STORES", lake_module.OBJECT_STORES - {FakeStore.protocol})
    assert not fake_store.is_object_store and not fake_store.is_local
    fake_store.check_reachable()  # a new lake on a store that answers
    assert FakeStore.calls == [("ls", fake_store.root)]
    FakeStore.ls_error = ConnectionError("Name or service not known")
    with pytest.raises(
        LakeURLError,
        match=r"its store cannot be used \(ConnectionError: Name or service not known\); check the URL, the endpoint "
        r"and the credentials$",
    ):
        fake_store.check_reachable()


# ------------------------------------------------------------------------------------------------ object-store writes


def test_an_object_store_move_puts_every_object_under_the_new_prefix_and_none_left(fake_store):
    fs, root = fake_store.fs, fake_store.root
    for name in ("a.bin", "sub/b.bin", "sub/deeper/c.bin"):
        fs.pipe_file(f"{root}/src/{name}", name.encode())
    move_folder(fake_store, f"{root}/src/", f"{root}/dst")
    assert sorted(fs.find(root)) == [f"{root}/dst/{n}" for n in ("a.bin", "sub/b.bin", "sub/deeper/c.bin")]
    assert fs.cat_file(f"{root}/dst/sub/deeper/c.bin") == b"sub/deeper/c.bin"


def test_a_local_folder_is_moved_by_one_rename(tmp_path, monkeypatch):
    """On a disk a folder moves whole with one rename (a checkpoint appears complete or not at all): its files keep
    their inodes, nothing is copied."""
    lake = Lake(str(tmp_path / "lake"))
    src, dst = tmp_path / "lake/src", tmp_path / "lake/dst"
    (src / "sub").mkdir(parents=True)
    (src / "sub/b.bin").write_bytes(b"b")
    inode = (src / "sub/b.bin").stat().st_ino
    monkeypatch.setattr(type(lake.fs), "copy", lambda *a, **k: pytest.fail("copied on a local lake"))
    move_folder(lake, str(src), str(dst))
    assert not src.exists() and (dst / "sub/b.bin").read_bytes() == b"b"
    assert (dst / "sub/b.bin").stat().st_ino == inode


def test_an_object_store_json_write_is_one_put_in_place(fake_store, monkeypatch):
    """No _tmp/ object and no rename on an object store: the object appears whole with its one PUT."""
    path = fake_store.ledger_file(RUN, 0)
    monkeypatch.setattr(FakeStore, "mv", lambda *a, **k: pytest.fail("renamed on an object store"))
    atomic_write_json(fake_store, RUN, path, {"b": 1, "a": [2]})
    assert fake_store.fs.find(fake_store.root) == [path]
    assert read_json(fake_store, path) == {"a": [2], "b": 1}


class Killed(BaseException):
    """What the failpoint's signal does to the process: nothing after it runs."""


@pytest.mark.parametrize(("armed", "fires_on"), [("shard-write", "shard.arrow"), ("file-write", "iter-000000.json")])
def test_an_object_store_write_passes_its_failpoint_before_its_put(fake_store, monkeypatch, armed, fires_on):
    """On an object store too, a shard's write passes `shard-write` and any other file's `file-write`, before the one
    PUT: a kill there leaves no object."""

    def kill(pid, sig):
        raise Killed(sig)

    monkeypatch.setattr(faults, "_passes", Counter())
    monkeypatch.setattr(faults.os, "kill", kill)
    monkeypatch.setenv("LOCKSTEP_FAULT", armed)
    paths = [f"{fake_store.run_dir(RUN)}/{name}" for name in ("shard.arrow", "iter-000000.json")]
    for path in paths:
        if path.endswith(fires_on):
            with pytest.raises(Killed):
                atomic_write_bytes(fake_store, RUN, path, b"bytes")
        else:
            atomic_write_bytes(fake_store, RUN, path, b"bytes")
    assert fake_store.fs.find(fake_store.root) == [p for p in paths if not p.endswith(fires_on)]


def test_a_json_file_is_written_with_sorted_keys(tmp_path):
    """Ledger records and manifests are byte-stable: the same object always gives the same file."""
    lake = Lake(str(tmp_path / "lake"))
    path = lake.ledger_file(RUN, 0)
    atomic_write_json(lake, RUN, path, {"state": "planned", "iteration": 0, "history": []})
    assert (tmp_path / f"lake/runs/{RUN}/ledger/iter-000000.json").read_text() == json.dumps(
        {"history": [], "iteration": 0, "state": "planned"}, indent=2
    )


# ------------------------------------------------------------------------------------------------ layout


def test_ledger_files_sort_by_iteration_past_nine(tmp_path):
    """Ledger file names are zero-padded, so the listing's order is the iterations' order (10 after 2), which
    `ledger.read_all` and resume rely on."""
    from storage import ledger

    lake = Lake(str(tmp_path / "lake"))
    for k in (10, 2, 1):
        ledger.write_record(lake, RUN, k, "planned")
    assert lake.ledger_file(RUN, 10) == f"{tmp_path}/lake/runs/{RUN}/ledger/iter-000010.json"
    assert [r["iteration"] for r in ledger.read_all(lake, RUN)] == [1, 2, 10]


def test_a_run_lays_out_its_files_as_the_readme_says(tmp_path):
    """README's "What a run writes": readers of an existing lake (resume, audit, the catalog) find files by these
    names, so the version and the iteration must each land in their own place."""
    lake = Lake(str(tmp_path / "lake"))
    run = f"{tmp_path}/lake/runs/{RUN}"
    assert lake.iteration_rollouts(RUN, 3, 12) == f"{run}/rollouts/policy_version=3/iter-000012"
    assert lake.checkpoint_dir(RUN, 7) == f"{run}/checkpoints/v000007"
    assert lake.promoted_file(RUN) == f"{run}/checkpoints/PROMOTED"
    assert lake.ledger_file(RUN, 12) == f"{run}/ledger/iter-000012.json"


@pytest.mark.parametrize("data", [b'{"state": "planned"', b'{"state": "\xff"}'], ids=["cut", "not-utf8"])
def test_a_damaged_json_file_is_named(tmp_path, data):
    """A file cut short or with bytes that are not UTF-8 is a ValueError naming the file, so that `lockstep runs`
    and resume can say which one is damaged."""
    lake = Lake(str(tmp_path / "lake"))
    path = tmp_path / "lake/x.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"^{path} is not valid JSON"):
        read_json(lake, str(path))
