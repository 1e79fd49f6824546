"""The LanceDB audit catalog: upserts on stable ids (a retried write never duplicates), indexed merge keys, version
tags."""

from __future__ import annotations

import lancedb
import pyarrow as pa

from storage import catalog


def _samples(iteration: int, reward: float) -> pa.Table:
    ids = [f"r/{iteration}/{g}/{j}" for g in range(4) for j in range(8)]
    return pa.table({"sample_id": ids, "iteration": [iteration] * len(ids), "reward": [reward] * len(ids),
                     "prompt_ids": [[1, 2, 3]] * len(ids)})


def _shards(iteration: int) -> pa.Table:
    return pa.table({"path": [f"s/{iteration}/{i}.arrow" for i in range(2)], "rows": [16, 16]})


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
