"""A lake on an object store: runs, kills and resumes against a real S3 API (moto's server on loopback, s3fs and
LanceDB talking to it over HTTP), not memory://, whose files are renamed like a local disk's.

Object stores have no rename (a "move" is a copy and a delete, file by file) and no folders: before these tests the
first run on s3:// failed at its bootstrap checkpoint (s3fs cannot move a folder of objects), and a resume failed
setting aside unpromoted rollouts the same way. Asserted: a run on S3 killed at a point where object stores differ
and then resumed ends with the parameters of an uninterrupted run on a local disk (the periodic-invariant
tolerance, 1e-5), and every checkpoint is complete.
"""

from __future__ import annotations

import pytest

from flows import cli
from flows.train import train_flow
from storage import catalog, checkpoints, lease, ledger
from storage.lake import Lake, LakeURLError, atomic_write_bytes, move_folder
from storage.shards import read_shard, table_to_records
from tasks.session import set_aside_unpromoted_rollouts
from tests.integration.runs import final_params, write_config
from tests.ports import free_port
from tests.resilience.test_resume_after_kill import _lockstep
from tests.s3 import forget_s3_clients, s3_store

ITERS = 3


@pytest.fixture(scope="module")
def bucket():
    with s3_store() as url:
        yield url


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on a local disk, and the Prefect API its process started (shared by the CLI runs, as in
    test_resume_after_kill)."""
    from prefect.server.api.server import SubprocessASGIServer

    tmp = tmp_path_factory.mktemp("local")
    train_flow(config_path=write_config(tmp, "ref", {"run.iterations": ITERS}))
    server = SubprocessASGIServer()
    server.start()
    return final_params(str(tmp / "lake"), "ref", ITERS), server.api_url


def fresh(uri: str) -> Lake:
    """The lake as it is now: s3fs caches listings, and other processes wrote it."""
    lake = Lake(uri)
    lake.fs.invalidate_cache()
    return lake


def assert_equals_reference(lake: Lake, run_id: str, ref_params: dict) -> None:
    params = final_params(lake.uri, run_id, ITERS)
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params)
    assert diff <= 1e-5, f"the run on S3 differs from the uninterrupted local one by {diff}"


def assert_complete(lake: Lake, run_id: str) -> None:
    """Every iteration promoted, each sample trained once and cataloged once, every checkpoint with its manifest
    and verifiable, no lease left."""
    run = lake.run_dir(run_id)
    records = ledger.read_all(lake, run_id)
    assert [r["state"] for r in records] == ["promoted"] * ITERS
    seen = set()
    for k, rec in enumerate(records):
        for sh in rec["shards"]:
            for r in table_to_records(read_shard(lake, sh["path"], sh["checksum"])):
                assert r.policy_version == k
                key = (r.iteration, r.group_id, r.sample_index)
                assert key not in seen, f"sample {key} trained twice"
                seen.add(key)
    assert len(seen) == ITERS * 8 * 4
    rows = catalog.query(catalog.catalog_uri(lake, run_id), catalog.ROLLOUTS).to_pylist()
    assert len(rows) == len({r["sample_id"] for r in rows}) == ITERS * 8 * 4
    assert not lake.fs.exists(f"{run}/LEASE.json")
    folders = [p for p in lake.fs.ls(f"{run}/checkpoints", detail=False) if not p.endswith("PROMOTED")]
    assert len(folders) == ITERS + 1, folders
    for folder in folders:
        checkpoints.verify_checkpoint(lake, folder)
    assert checkpoints.promoted_version(lake, run_id) == ITERS


@pytest.mark.slow
def test_a_run_on_s3_killed_mid_checkpoint_and_resumed_equals_an_uninterrupted_local_run(bucket, reference, tmp_path):
    """Killed with a checkpoint's files written in place and its MANIFEST.json not yet (where object stores differ
    from a rename); every shard of every run here is published by one PUT."""
    ref_params, api = reference
    uri = f"{bucket}/lake-{tmp_path.name}"
    run_id = "s3-killed"
    cfg = write_config(tmp_path, run_id, {"run.iterations": ITERS}, lake=uri)
    code, log = _lockstep(["train", cfg], tmp_path, fault="mid-checkpoint@2", api=api)
    assert code == -9, log[-3000:]
    lake = fresh(uri)
    folders = [p for p in lake.fs.ls(f"{lake.run_dir(run_id)}/checkpoints", detail=False) if "/v" in p]
    incomplete = [p for p in folders if not lake.fs.exists(f"{p}/MANIFEST.json")]
    assert len(incomplete) == 1 and lake.fs.ls(incomplete[0]), folders  # files there, no manifest
    with pytest.raises(checkpoints.CheckpointError, match="no MANIFEST.json"):
        checkpoints.verify_checkpoint(lake, incomplete[0])

    code, log = _lockstep(["resume", run_id, "--lake", uri], tmp_path, api=api)
    assert code == 0, log[-3000:]
    lake = fresh(uri)
    assert_complete(lake, run_id)
    assert_equals_reference(lake, run_id, ref_params)


@pytest.mark.slow
def test_a_damaged_shard_on_s3_is_quarantined_and_regenerated(bucket, reference, tmp_path):
    """Workers load each version from its checkpoint in the lake (`push_weights: false`), a shard of the interrupted
    iteration is cut in half, and resume moves it to quarantine/ (a copy and a delete on S3) and makes it anew."""
    ref_params, api = reference
    uri = f"{bucket}/lake-{tmp_path.name}"
    run_id = "s3-damaged"
    cfg = write_config(tmp_path, run_id, {"run.iterations": ITERS, "pipeline.push_weights": False}, lake=uri)
    code, log = _lockstep(["train", cfg], tmp_path, fault="mid-train[1]@2", api=api)
    assert code == -9, log[-3000:]
    lake = fresh(uri)
    shards = sorted(lake.fs.glob(f"{lake.run_dir(run_id)}/rollouts/policy_version=1/iter-000001/*.arrow"))
    assert shards
    data = lake.fs.cat_file(shards[0])
    lake.fs.pipe_file(shards[0], data[: len(data) // 2])

    code, log = _lockstep(["resume", run_id, "--lake", uri], tmp_path, api=api)
    assert code == 0, log[-3000:]
    lake = fresh(uri)
    (moved,) = ledger.read_record(lake, run_id, 1)["quarantined"]
    assert lake.fs.cat_file(moved) == data[: len(data) // 2]  # the damaged bytes kept as evidence
    assert not lake.fs.exists(shards[0]) or lake.fs.cat_file(shards[0]) != data[: len(data) // 2]
    assert_complete(lake, run_id)
    assert_equals_reference(lake, run_id, ref_params)


def test_a_folder_is_moved_object_by_object_and_unpromoted_rollouts_are_set_aside(bucket):
    lake = fresh(f"{bucket}/moves")
    run = lake.run_dir("r")
    for v in (1, 2, 3):
        for name in ("iter-000001/shard-0-00000.arrow", "iter-000001/shard-1-00001.arrow"):
            lake.fs.pipe_file(f"{run}/rollouts/policy_version={v}/{name}", f"{v}/{name}".encode())
    move_folder(lake, f"{run}/rollouts/policy_version=1", f"{run}/elsewhere/v1")
    assert sorted(lake.fs.find(f"{run}/elsewhere")) == [
        f"{run}/elsewhere/v1/iter-000001/shard-0-00000.arrow",
        f"{run}/elsewhere/v1/iter-000001/shard-1-00001.arrow",
    ]
    assert (
        lake.fs.cat_file(f"{run}/elsewhere/v1/iter-000001/shard-1-00001.arrow") == b"1/iter-000001/shard-1-00001.arrow"
    )
    assert not lake.fs.exists(f"{run}/rollouts/policy_version=1")

    moved = set_aside_unpromoted_rollouts(lake, "r", promoted=2)  # version 3 never became durable
    assert len(moved) == 1 and moved[0].endswith("/policy_version=3")
    assert len(lake.fs.find(moved[0])) == 2
    assert [p.rsplit("/", 1)[-1] for p in lake.fs.ls(f"{run}/rollouts", detail=False)] == ["policy_version=2"]


def test_bootstrap_builders_on_s3_write_their_own_folders_and_the_first_complete_one_serves(
    bucket, tmp_path, monkeypatch
):
    """Two runs that start together both find no bootstrap and both build it: on S3 (no rename to settle it) each
    writes its own folder, never over the other's files; later runs take the first complete one by name, never a
    folder without its MANIFEST.json."""
    from configs.schema import load_config
    from tasks import session

    cfg = load_config(write_config(tmp_path, "b", {"bootstrap.steps": 2}, lake=f"{bucket}/boot"))
    lake = fresh(cfg.lake.uri)
    first, cached = session.bootstrap_v0(cfg, lake)
    assert not cached and first.rsplit("/", 2)[-2] == session.bootstrap_key(cfg)
    before = {p: lake.fs.info(p)["ETag"] for p in lake.fs.find(first)}
    monkeypatch.setattr(session, "_built_bootstrap", lambda lake, folder: None)  # its lookup ran before `first` ended
    second, cached = session.bootstrap_v0(cfg, lake)
    monkeypatch.undo()
    assert not cached and second != first and second.rsplit("/", 1)[0] == first.rsplit("/", 1)[0]
    assert {p: lake.fs.info(p)["ETag"] for p in lake.fs.find(first)} == before  # untouched
    lake.fs.pipe_file(f"{first.rsplit('/', 1)[0]}/0-cut-short/model.safetensors", b"")  # a builder killed early
    assert session.bootstrap_v0(cfg, fresh(cfg.lake.uri)) == (min(first, second), True)


def test_a_file_is_written_in_place_on_s3(bucket, monkeypatch):
    """One PUT, nothing through _tmp/ (a copy and a delete there): a writer killed at its failpoint has left nothing."""
    from storage import faults

    lake = fresh(f"{bucket}/writes")
    path = f"{lake.run_dir('r')}/ledger/iter-000000.json"
    at_failpoint = []
    monkeypatch.setattr(faults, "point", lambda name, *a: at_failpoint.append((name, lake.fs.find(lake.run_dir("r")))))
    atomic_write_bytes(lake, "r", path, b'{"a": 1}')
    assert at_failpoint == [("file-write", [])]
    assert lake.fs.cat_file(path) == b'{"a": 1}'
    assert lake.fs.find(lake.run_dir("r")) == [path]


def test_a_lease_on_s3_is_refused_while_held_and_removed_on_release(bucket):
    lake = fresh(f"{bucket}/leases")
    with lease.acquire(lake, "r", "train"):
        assert lake.fs.exists(f"{lake.run_dir('r')}/LEASE.json")
        with pytest.raises(lease.RunInUseError, match=r"in use by `lockstep train`"):
            lease.acquire(lake, "r", "resume")
    assert not fresh(lake.uri).fs.exists(f"{lake.run_dir('r')}/LEASE.json")
    with lease.acquire(lake, "r", "resume"):
        assert lease.holder(lake, "r")["command"] == "resume"


def test_a_missing_bucket_or_an_unreachable_store_is_one_error_line(bucket, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    missing = "s3://no-such-bucket/lake"
    assert cli.main(["runs", "--lake", missing]) == 2
    assert capsys.readouterr().err == (
        f"error: lake '{missing}': bucket 'no-such-bucket' does not exist; create it, or fix the lake's URL\n"
    )
    assert not fresh(bucket).fs.exists("no-such-bucket")  # not created either
    with pytest.raises(LakeURLError, match="bucket 'no-such-bucket' does not exist"):
        Lake(missing).check_reachable()
    with pytest.raises(LakeURLError, match=r"\(ParamValidationError: .*Invalid bucket name \"Bad_Bucket!\""):
        Lake("s3://Bad_Bucket!/lake").check_reachable()  # the reason, on the error's second line, is kept

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    forget_s3_clients()
    try:
        with pytest.raises(LakeURLError) as e:
            Lake(f"{bucket}/lake").check_reachable()
        assert str(e.value).startswith(f"lake '{bucket}/lake': its store cannot be used (EndpointConnectionError: ")
        assert str(e.value).endswith(
            "; check the URL, the endpoint (AWS_ENDPOINT_URL for an S3-compatible store) and the credentials"
        )
        cfg = write_config(tmp_path, "x", lake=f"{bucket}/lake")
        assert cli.main(["train", cfg]) == 2  # before the bootstrap
        assert "error: lake.uri: lake 's3://" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        forget_s3_clients()
