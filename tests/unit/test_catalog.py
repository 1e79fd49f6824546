"""The LanceDB audit catalog: appends of new iterations, merges on stable ids (a retried write never duplicates), the
last iteration it holds, indexed merge keys, version tags that show the rows of their version, one catalog per run
(none on memory://), filtered queries, compaction at versions `compact_every` x 1, 2, 4, ... (0: never), so that the
catalog's bytes no longer grow with the square of the run's length, and the C heap given back after each compaction."""

from __future__ import annotations

import os

import lancedb
import pyarrow as pa
import pytest

from storage import catalog
from storage.lake import Lake


def _samples(iteration: int, reward: float = 0.5, run: str = "r") -> pa.Table:
    ids = [f"{run}/{iteration}/{g}/{j}" for g in range(4) for j in range(8)]
    return pa.table(
        {
            "sample_id": ids,
            "iteration": [iteration] * len(ids),
            "reward": [reward] * len(ids),
            "prompt_ids": [[1, 2, 3]] * len(ids),
        }
    )


def _shards(iteration: int, run: str = "r") -> pa.Table:
    return pa.table(
        {"path": [f"{run}/s/{iteration}/{i}.arrow" for i in range(2)], "iteration": [iteration] * 2, "rows": [16, 16]}
    )


def _in_fresh_interpreter(source: str, env: dict[str, str] | None = None) -> str:
    """What `source` prints, run by this interpreter in a process of its own from the repository's root."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-c", source]
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_upserts_index_the_merge_key_and_never_duplicate(tmp_path):
    uri = str(tmp_path / "catalog")
    catalog.write_iteration(uri, _samples(0, 0.25), _shards(0), version=1)
    catalog.write_iteration(uri, _samples(1, 0.5), _shards(1), version=2)
    catalog.write_iteration(uri, _samples(0, 0.75), _shards(0), version=1)  # a retried write of iteration 0

    rows = catalog.query(uri, catalog.ROLLOUTS).to_pylist()
    assert len(rows) == 64 == len({r["sample_id"] for r in rows})
    assert {r["reward"] for r in rows if r["iteration"] == 0} == {0.75}  # updated in place
    assert {r["reward"] for r in rows if r["iteration"] == 1} == {0.5}
    assert "prompt_ids" not in rows[0]  # heavy columns stay in the shards
    assert len(catalog.query(uri, catalog.SHARDS).to_pylist()) == 4

    db = lancedb.connect(uri)
    for name, key in ((catalog.ROLLOUTS, "sample_id"), (catalog.SHARDS, "path")):
        table = db.open_table(name)
        assert [(i.index_type, i.columns) for i in table.list_indices()] == [("BTree", [key])]
        assert {"v1", "v2"} <= set(table.tags.list())
    assert catalog.query(uri, catalog.ROLLOUTS, where="iteration = 1", limit=5).num_rows == 5


def test_an_appended_iteration_holds_the_rows_a_merge_writes_and_a_merge_still_updates_it(tmp_path):
    """`append=True` (no row of the iteration in the catalog) adds the rows; the catalog reads as the merged one."""
    merged, appended = str(tmp_path / "merged"), str(tmp_path / "appended")
    for k in range(3):
        catalog.write_iteration(merged, _samples(k, 0.25 * k), _shards(k), version=k + 1)
        catalog.write_iteration(appended, _samples(k, 0.25 * k), _shards(k), version=k + 1, append=True)
    for name, key in ((catalog.ROLLOUTS, "sample_id"), (catalog.SHARDS, "path")):
        a, b = (sorted(catalog.query(uri, name).to_pylist(), key=lambda r: r[key]) for uri in (merged, appended))
        assert a == b and len(a) == (96 if name == catalog.ROLLOUTS else 6)
    catalog.write_iteration(appended, _samples(1, 0.9), _shards(1), version=2)  # a retried write: merged
    rows = catalog.query(appended).to_pylist()
    assert len(rows) == 96 == len({r["sample_id"] for r in rows})
    assert sorted({r["reward"] for r in rows}) == [0.0, 0.5, 0.9]
    # an append reads nothing: of an iteration the catalog holds, it writes the rows twice (the caller's to avoid)
    catalog.write_iteration(appended, _samples(2, 0.5), _shards(2), version=3, append=True)
    assert catalog.query(appended).num_rows == 96 + 32


def test_the_last_iteration_of_a_catalog_is_read_from_either_table(tmp_path):
    uri = str(tmp_path / "catalog")
    assert catalog.last_iteration(uri) == -1  # nothing written yet
    catalog.write_iteration(uri, _samples(3), _shards(3), version=4)
    assert catalog.last_iteration(uri) == 3
    # a write cut short after the samples of iteration 4, before its shards: the samples are there
    catalog._write_table(lancedb.connect(uri), catalog.ROLLOUTS, _samples(4).drop_columns(["prompt_ids"]), "sample_id")
    assert catalog.last_iteration(uri) == 4
    catalog._write_table(lancedb.connect(uri), catalog.SHARDS, _shards(6), "path")  # the shards' column is read too
    assert catalog.last_iteration(uri) == 6


def _fragments(uri: str, name: str) -> int:
    return lancedb.connect(uri).open_table(name).stats()["fragment_stats"]["num_fragments"]


def test_each_run_of_a_lake_has_a_catalog_of_its_own(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    uris = {run: catalog.catalog_uri(lake, run) for run in ("a", "b")}
    assert uris == {run: f"{lake.run_dir(run)}/catalog" for run in ("a", "b")}
    for run, uri in uris.items():
        catalog.write_iteration(uri, _samples(0, run=run), _shards(0, run=run), version=1)
    for run, uri in uris.items():
        rows = catalog.query(uri).to_pylist()
        assert len(rows) == 32 and {r["sample_id"].split("/")[0] for r in rows} == {run}


def test_a_memory_lake_has_no_catalog():
    """LanceDB cannot write memory://: the catalog step is skipped instead of failing the iteration."""
    assert catalog.catalog_uri(Lake("memory://lockstep-no-catalog"), "a") is None


def test_an_object_store_lake_has_its_catalog_at_a_url():
    """LanceDB opens an object store's catalog by URL (its own object-store client): the path of the lake's
    filesystem alone would be taken for a local folder."""
    assert catalog.catalog_uri(Lake("s3://bucket/lake"), "a") == "s3://bucket/lake/runs/a/catalog"


def test_the_heavy_columns_stay_in_the_shards(tmp_path):
    """The token ids and behaviour log-probabilities (most of a sample's bytes) are left out of the catalog: audits
    read the shards for them."""
    uri = str(tmp_path / "catalog")
    samples = _samples(0).append_column("behavior_logprobs", pa.array([[-0.5, -0.25]] * 32))
    catalog.write_iteration(uri, samples, _shards(0), version=1)
    assert catalog.query(uri).column_names == ["sample_id", "iteration", "reward"]


def test_query_filters_rows_and_selects_columns(tmp_path):
    uri = str(tmp_path / "catalog")
    for k in (0, 1):
        catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1)
    rows = catalog.query(uri, where="iteration = 1")
    assert rows.num_rows == 32 and set(rows.column("iteration").to_pylist()) == {1}
    narrow = catalog.query(uri, columns=["sample_id"])
    assert narrow.column_names == ["sample_id"] and narrow.num_rows == 64


@pytest.mark.parametrize("folder", ["a#b", "lake é", "x~y"])
def test_a_catalog_whose_path_lancedb_would_tag_elsewhere_writes_nothing_outside_it(tmp_path, caplog, folder):
    """LanceDB 0.40 percent-encodes a path's '#', 'é', '~', ... in its tags' path only: the tags of a catalog under
    `a#b/` were written to a sibling `a%23b/`, outside the lake. Such a catalog is not tagged (said once); its rows
    and audits are whole, and nothing appears beside the lake."""
    import logging

    lake = tmp_path / folder
    uri = str(lake / "runs" / "r" / "catalog")
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        for k in (0, 1):
            catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1, compact_every=1)
    assert [p.name for p in tmp_path.iterdir()] == [folder]
    assert not catalog.tags_in_place(uri)
    assert catalog.query(uri, where="iteration = 1").num_rows == 32 and catalog.query(uri).num_rows == 64
    assert lancedb.connect(uri).open_table(catalog.ROLLOUTS).tags.list() == {}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"the catalog at {uri} is not tagged per version: LanceDB would write its tags outside")
    assert catalog.tags_in_place(str(tmp_path / "my lake (2)" / "runs" / "r-1_x" / "catalog"))
    assert catalog.tags_in_place("s3://bucket/lake/runs/r/catalog")


def test_a_version_tag_shows_the_rows_of_that_version(tmp_path):
    """`v{version}` is taken after the iteration's upserts: checking it out gives the catalog as it was when that
    version was promoted."""
    uri = str(tmp_path / "catalog")
    for k in (0, 1):
        catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1)
    db = lancedb.connect(uri)
    for name, per_version in ((catalog.ROLLOUTS, 32), (catalog.SHARDS, 2)):
        table = db.open_table(name)
        for v in (1, 2):
            table.checkout(f"v{v}")
            assert table.count_rows() == per_version * v, (name, v)


@pytest.mark.parametrize("compact_every", [3, 0])
def test_the_first_compaction_at_n_versions_and_never_with_zero(tmp_path, compact_every):
    uri = str(tmp_path / "catalog")
    fragments = []
    for k in range(3):
        catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1, compact_every=compact_every)
        fragments.append(_fragments(uri, catalog.ROLLOUTS))
    # each upsert adds a fragment; the compaction after version 3, and only it, merges some of them
    assert fragments[:2] == [1, 2]
    assert fragments[2] < 3 if compact_every else fragments[2] == 3
    assert catalog.query(uri).num_rows == 96


def test_compactions_at_doubling_versions_keep_the_catalog_from_growing_with_the_square_of_its_versions(tmp_path):
    """Every version's tag keeps the files a compaction replaced, and a compaction rewrites the whole table: after
    each version (`compact_every=1` before) the catalog grew with the square of its versions (3.27x from 32 to 64
    versions here on e2eafe7); at versions 1, 2, 4, ... it about doubles with them (the manifests, which list the
    fragments since the last compaction, still grow faster, but are small at 64 versions)."""
    uri = str(tmp_path / "catalog")
    size = {}
    for k in range(64):
        catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1, compact_every=1)
        if k + 1 in (32, 64):
            size[k + 1] = sum(os.path.getsize(f"{d}/{f}") for d, _, files in os.walk(uri) for f in files)
    assert 1.8 < size[64] / size[32] < 2.5, size
    assert [v for v in range(1, 65) if catalog.compacts(v, 1)] == [1, 2, 4, 8, 16, 32, 64]
    assert [v for v in range(1, 200) if catalog.compacts(v, 10)] == [10, 20, 40, 80, 160]
    assert not any(catalog.compacts(v, 0) for v in range(1, 100))
    assert not catalog.compacts(0, 10)  # version 0 (v0, the bootstrap) is never cataloged
    assert catalog.query(uri).num_rows == 64 * 32
    table = lancedb.connect(uri).open_table(catalog.ROLLOUTS)
    assert table.stats()["fragment_stats"]["num_fragments"] <= 2  # compacted after version 64
    assert len(table.tags.list()) == 64


def test_the_heap_is_released_after_each_compaction_and_only_then(tmp_path, monkeypatch):
    uri = str(tmp_path / "catalog")
    released = []
    monkeypatch.setattr(catalog, "release_heap", lambda: released.append(k + 1))
    for k in range(9):
        catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1, compact_every=2)
    assert released == [2, 4, 8]  # (that it runs once the tables are released: `benchmarks.catalog`, README)
    released.clear()
    for k in range(9, 12):
        catalog.write_iteration(uri, _samples(k), _shards(k), version=k + 1, compact_every=0)
    assert released == []


@pytest.mark.skipif(not hasattr(os, "sysconf") or not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_releasing_the_heap_gives_its_free_pages_back():
    """A compaction's buffers, once freed, stayed in glibc's heap (`benchmarks.catalog`'s writer held 73-101 MB more
    just after the compaction at version 2,560). Here 200 MB of C heap blocks are written and freed but for the last,
    which keeps the heap's top from shrinking by itself: the pages stay resident until `release_heap`. In a fresh
    interpreter, so that the figures are this heap's alone."""
    import json

    source = (
        "import ctypes, json, os\n"
        "from storage import catalog\n"
        "libc = ctypes.CDLL(None)\n"
        "if not hasattr(libc, 'malloc_trim'):\n"
        "    print(json.dumps({'glibc': False})); raise SystemExit\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20\n"
        "start = rss()\n"
        "blocks = [libc.malloc(4000) for _ in range(50_000)]\n"
        "for b in blocks: ctypes.memset(b, 1, 4000)\n"
        "held = rss()\n"
        "for b in blocks[:-1]: libc.free(b)\n"
        "freed = rss()\n"
        "released = catalog.release_heap()\n"
        "print(json.dumps({'glibc': True, 'start': start, 'held': held, 'freed': freed, 'after': rss(),\n"
        "                  'released': released}))\n"
    )
    # glibc's own heap: no other allocator preloaded, no malloc tunables of the environment's
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and k[:7] != "MALLOC_"}
    mb = json.loads(_in_fresh_interpreter(source, env))
    if not mb["glibc"]:
        pytest.skip("this C library has no malloc_trim")
    assert mb["released"] is True
    assert mb["held"] - mb["start"] > 150, mb  # the blocks are resident
    assert mb["freed"] - mb["start"] > 150, mb  # and stay so once freed
    assert mb["after"] - mb["start"] < 30, mb  # until the heap is released


def test_releasing_the_heap_where_the_c_library_cannot_is_a_no_op(monkeypatch):
    import ctypes

    opened = []

    class NoTrim:  # a C library without malloc_trim (macOS's, musl's)
        def __init__(self, name):
            opened.append(name)

    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    catalog._malloc_trim.cache_clear()
    try:
        assert catalog.release_heap() is False
        assert catalog.release_heap() is False
        assert opened == [None]  # looked up once
    finally:
        catalog._malloc_trim.cache_clear()  # the real C library's, for the tests after this one


def test_a_tag_that_exists_is_kept_and_a_tag_that_cannot_be_made_is_raised(tmp_path, monkeypatch):
    uri = str(tmp_path / "catalog")
    catalog.write_iteration(uri, _samples(0), _shards(0), version=1, compact_every=0)
    table = lancedb.connect(uri).open_table(catalog.ROLLOUTS)
    tagged = table.tags.get_version("v1")
    catalog.write_iteration(uri, _samples(0, 0.75), _shards(0), version=1, compact_every=0)  # cataloged again
    table = lancedb.connect(uri).open_table(catalog.ROLLOUTS)
    assert table.tags.get_version("v1") == tagged  # the first write's version, as before the retry
    assert {r["reward"] for r in catalog.query(uri).to_pylist()} == {0.75}

    def refused(self, tag, version):
        raise RuntimeError("lance error: IO error: permission denied")

    monkeypatch.setattr(lancedb.table.Tags, "create", refused)
    with pytest.raises(RuntimeError, match="permission denied"):
        catalog.write_iteration(uri, _samples(1), _shards(1), version=2, compact_every=0)


def test_a_query_of_a_table_not_written_yet_names_it(tmp_path):
    """A catalog whose first rollouts write never happened (a crash during it) is reported as such, not as LanceDB's
    error."""
    uri = str(tmp_path / "catalog")
    lancedb.connect(uri).create_table(catalog.SHARDS, _shards(0))
    with pytest.raises(FileNotFoundError, match=f"the catalog at {uri} has no table 'rollouts'"):
        catalog.query(uri)


def test_a_catalog_write_cut_short_is_finished_by_the_next(tmp_path):
    """The audit can be killed anywhere in `write_iteration` (it runs beside training, and a kill mid-train lands
    in it at random); resume writes the iteration again. Each place it can stop leaves a catalog that the rewrite
    completes: a table created without its first version (data files, no manifest), a table created but not
    indexed, the samples upserted but not the shards."""
    import shutil

    uri = str(tmp_path / "catalog")
    db = lancedb.connect(uri)
    db.create_table(catalog.ROLLOUTS, _samples(0, 0.1).drop_columns(["prompt_ids"]))
    shutil.rmtree(f"{uri}/{catalog.ROLLOUTS}.lance/_versions")  # killed inside create_table: no version yet
    assert catalog.last_iteration(uri) == -1  # its rows are not there
    with pytest.raises(FileNotFoundError, match="the run stopped while writing it"):  # an audit meanwhile
        catalog.query(uri, catalog.ROLLOUTS)
    db.create_table(catalog.SHARDS, _shards(0))  # killed between create_table and create_index

    catalog.write_iteration(uri, _samples(0, 0.25), _shards(0), version=1)
    rows = catalog.query(uri, catalog.ROLLOUTS).to_pylist()
    assert len(rows) == 32 == len({r["sample_id"] for r in rows}) and {r["reward"] for r in rows} == {0.25}
    assert len(catalog.query(uri, catalog.SHARDS).to_pylist()) == 2  # merged into the unindexed table, once

    # killed after the samples' upsert of iteration 1, before its shards and tags
    catalog._write_table(
        lancedb.connect(uri), catalog.ROLLOUTS, _samples(1, 0.5).drop_columns(["prompt_ids"]), "sample_id"
    )
    catalog.write_iteration(uri, _samples(1, 0.5), _shards(1), version=2)
    rows = catalog.query(uri, catalog.ROLLOUTS).to_pylist()
    assert len(rows) == 64 == len({r["sample_id"] for r in rows})
    assert sorted(r["path"] for r in catalog.query(uri, catalog.SHARDS).to_pylist()) == [
        f"r/s/{i}/{j}.arrow" for i in range(2) for j in range(2)
    ]
    db = lancedb.connect(uri)
    for name in (catalog.ROLLOUTS, catalog.SHARDS):
        assert {"v1", "v2"} <= set(db.open_table(name).tags.list())
    v1 = db.open_table(catalog.ROLLOUTS)
    v1.checkout("v1")
    assert v1.count_rows() == 32  # the tag of version 1 shows iteration 0's rows only


def test_lancedb_is_imported_in_a_thread_of_its_own_that_a_run_ending_waits_for():
    """`import_in_background` starts the import at once, off the caller's thread, in a thread the interpreter's exit
    waits for (not a daemon: a run that ends mid-import does not tear it down). Checked in a fresh interpreter, where
    LanceDB is not imported yet."""
    source = (
        "import sys, threading\n"
        "from storage import catalog\n"
        "assert 'lancedb' not in sys.modules\n"
        "thread = catalog.import_in_background()\n"
        "assert thread is not threading.current_thread() and thread.is_alive() and not thread.daemon\n"
        "thread.join()\n"
        "print(sys.modules['lancedb'].__name__)\n"
    )
    assert _in_fresh_interpreter(source).strip() == "lancedb"


def test_a_lancedb_that_fails_to_import_is_left_to_the_first_audit_to_name(monkeypatch, tmp_path):
    """The thread says nothing of a failed import (no traceback in the middle of the run's progress); the audit's
    own import raises it where it belongs."""
    import sys
    import threading

    seen = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    monkeypatch.setitem(sys.modules, "lancedb", None)  # `import lancedb` raises ImportError
    catalog.import_in_background().join()
    assert seen == []
    with pytest.raises(ImportError):
        catalog._connect(str(tmp_path / "catalog"))
