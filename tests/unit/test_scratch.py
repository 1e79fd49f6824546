"""`storage.scratch`: a process's model-sized local scratch is named for it, and what a killed process left behind is
removed by the next sweep, never what a live process (or another host, or another user) holds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from storage import checkpoints, scratch
from storage.lake import Lake
from tests.unit.test_lease import dead_pid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_prefix_names_the_kind_the_process_and_the_host():
    kind, pid, host, rest = scratch.prefix("v0").split("-", 1)[1].split("-")
    assert (kind, int(pid), rest) == ("v0", os.getpid(), "")
    assert len(host) == 8 and host == scratch.prefix("ckpt").split("-")[3]


@pytest.mark.parametrize("kind", ["", "v-0", "a/b"])
def test_a_kind_that_would_break_the_name_is_refused(kind):
    with pytest.raises(ValueError, match="must be letters and digits"):
        scratch.prefix(kind)


def test_a_killed_process_folder_is_removed_and_nothing_else(tmp_path):
    code = (
        "import os, signal, sys, tempfile; from storage import scratch; "
        "d = tempfile.mkdtemp(prefix=scratch.prefix('v0'), dir=sys.argv[1]); "
        "open(os.path.join(d, 'model.safetensors'), 'wb').write(b'0' * 4096); "
        "print(d, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    orphan = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(orphan), killed.stderr[-2000:]

    host = scratch.prefix("x").split("-")[3]
    dead = dead_pid()
    dead_file = tmp_path / f"lockstep-weights-{dead}-{host}-abc.bin"
    live = tmp_path / f"{scratch.prefix('weights')}def.bin"  # this process's
    elsewhere = tmp_path / f"lockstep-v0-{dead}-{'0' * 8 if host != '0' * 8 else '1' * 8}-x"  # another host's
    kept = [
        live,
        elsewhere,
        tmp_path / "lockstep-ckpt-108717a7312d153f",  # a cache named by a checkpoint, no process
        tmp_path / "lockstep-weights-notapid-x.bin",
        tmp_path / f"lockstep-{dead}",
        tmp_path / f"other-v0-{dead}-{host}-x",
    ]
    for path in [dead_file, *kept]:
        path.write_bytes(b"\0" * 64)
    assert scratch.remove_orphans(str(tmp_path)) == sorted([orphan, str(dead_file)])
    assert not os.path.exists(orphan) and not dead_file.exists()
    assert all(p.exists() for p in kept)
    assert scratch.remove_orphans(str(tmp_path)) == []


def test_another_users_live_process_keeps_its_scratch(tmp_path, monkeypatch):
    kept = tmp_path / f"lockstep-weights-1-{scratch.prefix('x').split('-')[3]}-abc.bin"
    kept.write_bytes(b"\0" * 64)

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(scratch.os, "kill", kill)
    assert scratch.remove_orphans(str(tmp_path)) == []
    assert kept.exists()


def test_a_scratch_another_sweep_removed_first_is_skipped(tmp_path, monkeypatch):
    orphan = tmp_path / f"lockstep-v0-{dead_pid()}-{scratch.prefix('x').split('-')[3]}-x"
    orphan.mkdir()

    def raced(path, *args, **kwargs):
        os.rmdir(path)  # the other sweep
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(shutil, "rmtree", raced)
    assert scratch.remove_orphans(str(tmp_path)) == []
    assert not orphan.exists()


def test_names_that_only_look_like_a_scratch_are_kept(tmp_path):
    """A scratch name has five parts at least (the prefix ends with '-') and a process id of digits: a name of this
    host and of a dead process id without its trailing part, or with a process id that is not a number, is someone
    else's file, and the sweep neither removes it nor fails on it."""
    host, dead = scratch.prefix("x").split("-")[3], dead_pid()
    kept = [tmp_path / f"lockstep-weights-{dead}-{host}", tmp_path / f"lockstep-v0-x{dead}-{host}-x"]
    for path in kept:
        path.mkdir()
    assert scratch.remove_orphans(str(tmp_path)) == []
    assert all(p.exists() for p in kept)


def test_a_dead_process_link_is_removed_not_what_it_points_to(tmp_path):
    """A scratch that is a symbolic link to a folder is unlinked: the link goes, the folder it points to stays."""
    target = tmp_path / "weights"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"\0" * 64)
    link = tmp_path / f"lockstep-v0-{dead_pid()}-{scratch.prefix('x').split('-')[3]}-x"
    link.symlink_to(target)
    assert scratch.remove_orphans(str(tmp_path)) == [str(link)]
    assert not link.is_symlink() and (target / "model.safetensors").read_bytes() == b"\0" * 64


def test_another_hosts_sweep_keeps_this_hosts_scratch(tmp_path, monkeypatch):
    """The host tag is the host name's: on another host sharing the folder (a container with process ids of its own)
    a process id says nothing of this host's processes, so that host's sweep leaves this host's scratch alone, even
    a dead process's, which this host's sweep removes."""
    orphan = tmp_path / f"lockstep-v0-{dead_pid()}-{scratch.prefix('x').split('-')[3]}-x"
    orphan.mkdir()
    here = scratch.prefix("v0")
    monkeypatch.setattr(scratch.socket, "gethostname", lambda: "another-host")
    there = scratch.prefix("v0")
    assert there.split("-")[3] != here.split("-")[3] and len(there.split("-")[3]) == 8
    assert scratch.remove_orphans(str(tmp_path)) == [] and orphan.exists()
    monkeypatch.undo()
    assert scratch.remove_orphans(str(tmp_path)) == [str(orphan)]


def test_the_temporary_folder_is_swept_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    orphan = tmp_path / f"lockstep-load-{dead_pid()}-{scratch.prefix('x').split('-')[3]}-x"
    orphan.mkdir()
    assert scratch.remove_orphans() == [str(orphan)]


def test_a_checkpoint_is_staged_in_a_scratch_folder_of_this_process(tiny_hf, tmp_path, monkeypatch):
    """Killed mid-upload, the staged checkpoint (model and optimizer state) is a scratch the next session sweeps."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_write, staged = checkpoints._write_model_dir, []

    def write(local, *args):
        staged.append((local, os.path.isdir(local)))
        return real_write(local, *args)

    monkeypatch.setattr(checkpoints, "_write_model_dir", write)
    lake = Lake(f"memory://lockstep-scratch-{uuid.uuid4().hex}")
    try:
        checkpoints.save_checkpoint(lake, "r", 1, tiny_hf.model, tiny_hf.tokenizer)
    finally:
        lake.fs.rm(lake.root, recursive=True)
    [(local, existed)] = staged
    assert existed and os.path.dirname(local) == str(tmp_path)
    assert os.path.basename(local).startswith(scratch.prefix("ckpt"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pid", ["2147483648", "99999999999999999999", "\u00b2"])
def test_a_name_whose_pid_field_is_no_pid_is_kept_and_does_not_stop_the_sweep(tmp_path, pid):
    """`os.kill` raises OverflowError past a pid_t and `int` ValueError on "²" (which `isdigit` accepts): one such
    name in the temporary folder stopped every session from opening."""
    host = scratch.prefix("x").split("-")[3]
    stray = tmp_path / f"lockstep-v0-{pid}-{host}-x"
    stray.mkdir()
    orphan = tmp_path / f"lockstep-v0-{dead_pid()}-{host}-y"
    orphan.mkdir()
    assert scratch.remove_orphans(str(tmp_path)) == [str(orphan)]
    assert stray.exists()
