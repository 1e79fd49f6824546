"""The audit catalog: LanceDB tables of every rollout sample and every shard of a run, in the lake.

`rollouts` has one row per sample (the shard columns, plus `sample_id`, the trainer's `advantage` and the
shard path); `shards` one row per shard. An iteration that has no row in the catalog yet is appended; one that may
have (a write retried after a crash) is merged on stable ids (`merge_insert`), so it never duplicates a row. After
each promoted version the tables are tagged `v{version}` (where LanceDB writes its tags in place: `tags_in_place`);
they are compacted at versions `compact_every` x 1, 2, 4, 8, ... (`compacts`). Written once per iteration, off the
training hot path. LanceDB does not survive fork: processes that open it must be spawned.
"""

from __future__ import annotations

import functools
import importlib
import logging
import string
import threading

import pyarrow as pa

from storage.lake import Lake

ROLLOUTS = "rollouts"
SHARDS = "shards"
_HEAVY = ("prompt_ids", "behavior_logprobs")  # kept in the shards; the catalog keeps what audits read
# The characters LanceDB 0.40 (Lance 14) writes a table's tags under as they are: it percent-encodes every other one
# in the tags' path only (lance-format/lance PR #4442), so the tags of a catalog in `/data/a#b/lake` or `/data/lake
# é` went to a sibling folder `/data/a%23b/...`, outside the lake, while its rows stayed in place. Found by tagging
# a table under a folder named with each ASCII punctuation character and 'é', one at a time.
_TAG_SAFE = frozenset(string.ascii_letters + string.digits + " -._/!$&'()+,;=:@")
_untagged_warned: set[str] = set()


def catalog_uri(lake: Lake, run_id: str) -> str | None:
    """Where LanceDB stores the run's catalog, or None for filesystems LanceDB cannot write (memory://)."""
    if lake.is_local:
        return f"{lake.run_dir(run_id)}/catalog"
    if lake.is_object_store:
        return lake.url(f"{lake.run_dir(run_id)}/catalog")
    return None


def tags_in_place(uri: str) -> bool:
    """LanceDB writes the version tags of a catalog at `uri` inside it (see `_TAG_SAFE`)."""
    return set(uri) <= _TAG_SAFE


def import_in_background() -> threading.Thread:
    """Import LanceDB in a thread of its own, started now; returns the thread.

    The import is ~1.7 s of Python holding the GIL here. Left to the first audit, which runs beside iteration 1's
    training, it made that iteration ~1.6 s longer in every run (demo config, 2 cores). The flow starts it at its
    first iteration's release: in sync and periodic mode as that iteration's rollouts begin, where its own thread
    only waits for the workers' first shard; in async mode before its first training. Not a daemon thread:
    a run that ends within the import waits for it rather than tearing an extension module's import down."""
    thread = threading.Thread(target=_import_lancedb, name="lockstep-lancedb-import")
    thread.start()
    return thread


def _import_lancedb() -> None:
    try:
        importlib.import_module("lancedb")
    except Exception:  # raised again, in its place, by the first audit's own import
        pass


def _connect(uri: str):
    import lancedb

    return lancedb.connect(uri)


def _write_table(db, name: str, table: pa.Table, key: str, append: bool = False) -> None:
    try:
        tbl = db.open_table(name)
    except ValueError:  # absent, or left without a first version by a crash during its creation
        from lancedb.index import BTree

        # the merge key indexed: without it every merge scans the whole key column (256-row iterations: ~11 ms of
        # CPU per merge at iteration 300 and growing with the table; with it ~7 ms, flat); `optimize` keeps it
        # current. A crash between the two calls leaves the table unindexed: merges stay correct, only slower.
        db.create_table(name, table, mode="overwrite").create_index(key, config=BTree())
        return
    if append:
        tbl.add(table)
    else:
        tbl.merge_insert(key).when_matched_update_all().when_not_matched_insert_all().execute(table)


def write_iteration(
    uri: str, samples: pa.Table, shards: pa.Table, version: int, compact_every: int = 10, append: bool = False
) -> None:
    """Write one iteration's samples and shards, tag the tables with the promoted version, compact sometimes.

    `append=True` says that no row of the iteration is in the catalog (the caller knows: the iteration is later
    than `last_iteration` was at its session's first write): its rows are added. Otherwise they are merged on their
    ids, which reads every fragment written since the last compaction: a merge's time grows with them (256-row
    iterations, never compacted: 30 ms per iteration over the first 100, 204 ms over iterations 401-500), an
    append's does not (5-6 ms; `rollouts` and `shards` together ~10 ms)."""
    # the heap released once `_write` has returned: its connection and tables go with its frame, and their buffers
    # with them (a trim while they were still open gave back little: README, "The audit catalog over a long run")
    if _write(uri, samples, shards, version, compact_every, append):
        release_heap()


def _write(uri: str, samples: pa.Table, shards: pa.Table, version: int, compact_every: int, append: bool) -> bool:
    """`write_iteration`'s writes; returns whether the tables were compacted."""
    db = _connect(uri)
    samples = samples.drop_columns([c for c in _HEAVY if c in samples.column_names])
    _write_table(db, ROLLOUTS, samples, "sample_id", append)
    _write_table(db, SHARDS, shards, "path", append)
    tag = tags_in_place(uri)
    if not tag and uri not in _untagged_warned:  # once per catalog and process
        _untagged_warned.add(uri)
        logging.getLogger("lockstep").warning(
            "the catalog at %s is not tagged per version: LanceDB would write its tags outside the lake, in a "
            "folder named with the path's characters percent-encoded (%s); audits by version read the rows' "
            "policy_version and are unaffected. A lake path of letters, digits and %s keeps the tags",
            uri,
            ", ".join(repr(c) for c in sorted(set(uri) - _TAG_SAFE)),
            '" -._/!$&\'()+,;=:@"',
        )
    compact = compacts(version, compact_every)
    for name in (ROLLOUTS, SHARDS):
        tbl = db.open_table(name)
        if tag:
            _tag(tbl, f"v{version}")
        if compact:
            tbl.optimize()
    return compact


def release_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; False where there is none).

    A compaction reads the whole table (`compacts`), and glibc kept the pages it freed in its heap: the process that
    writes the catalog (the flow's) grew at each compaction and held it (`benchmarks.catalog`'s `rss_mb`, 256-sample
    iterations: +26-28, +46-58 and +57-65 MB at versions 640, 1,280 and 2,560; README, "The audit catalog over a long
    run"). Called after a compaction only, a few times per run: a trim walks the whole heap (~6 ms in the flow's
    process). With another allocator preloaded (jemalloc, tcmalloc) it trims only what glibc still holds."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim` among the symbols the process has loaded; None where the C library has none (macOS,
    musl) or there is no such handle (Windows)."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def last_iteration(uri: str) -> int:
    """The highest iteration with a row in either table of the catalog at `uri`; -1 when it has none. Reads the
    `iteration` column whole: once per run session, not per write. Connecting makes a local catalog's folder."""
    import pyarrow.compute as pc

    db = _connect(uri)
    last = -1
    for name in (ROLLOUTS, SHARDS):
        try:
            tbl = db.open_table(name)
        except ValueError:  # absent, or its creation cut short
            continue
        top = pc.max(tbl.search().select(["iteration"]).limit(None).to_arrow().column("iteration")).as_py()
        last = max(last, -1 if top is None else top)
    return last


def _tag(tbl, tag: str) -> None:
    """Tag the table's current version; a tag there already (an iteration cataloged again after a crash) stays as it
    is. Not by listing the tags first: that reads every tag, one more each iteration (56 ms at 1,500)."""
    try:
        tbl.tags.create(tag, tbl.version)
    except RuntimeError:  # LanceDB's "Ref conflict error: tag ... already exists", or a real failure
        if tag not in tbl.tags.list():
            raise


def compacts(version: int, every: int) -> bool:
    """Whether the catalog is compacted after `version`: at `every` x 1, 2, 4, 8, ... (never with 0).

    LanceDB's `optimize` rewrites a table's data and its merge-key index whole (into one fragment, up to a million
    rows), and the tag of every version keeps the files each rewrite replaced. Compacting every `every` versions
    therefore kept bytes growing with the square of the run's length (`benchmarks.catalog`: 1,277 MB after 1,500
    iterations of 256 samples, 106 MB with this schedule); at doubling intervals the rewrites add up to about twice
    the table. What still grows with the square, with a far smaller constant, is the versions' manifests: each lists
    the fragments written since the last compaction, up to half the versions, and each query (and a retried write's
    merge) reads those fragments: more time per audit late in a long run (README, "The audit catalog over a long
    run")."""
    if every <= 0 or version <= 0 or version % every:
        return False
    m = version // every
    return m & (m - 1) == 0


def query(
    uri: str,
    table: str = ROLLOUTS,
    where: str | None = None,
    limit: int | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """Rows of a catalog table matching a SQL `where` filter (LanceDB / DataFusion syntax)."""
    db = _connect(uri)
    try:
        tbl = db.open_table(table)
    except ValueError:  # absent, or its creation cut short (no first version): the resumed run writes it
        raise FileNotFoundError(
            f"the catalog at {uri} has no table {table!r} (no iteration was promoted yet, or "
            f"the run stopped while writing it: `lockstep resume` completes it)"
        ) from None
    q = tbl.search()
    if where:
        q = q.where(where)
    if columns:
        q = q.select(columns)
    q = q.limit(limit) if limit else q.limit(None)
    return q.to_arrow()
