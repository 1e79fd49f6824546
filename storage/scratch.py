"""Local scratch of a process: a copy of an object-store checkpoint, a checkpoint staged before its upload, the
weights shared with the rollout workers. Each is model-sized and removed by the process that made it, except when
that process is killed (SIGKILL, the OOM killer, a lost node): so each is named for its process,
`lockstep-<kind>-<pid>-<host>-...`, and `remove_orphans` (run as a session opens and as shared weights are created)
removes those whose process is gone.

`<host>` is a tag of the host name: two containers that share a temporary folder but not their process ids never
take each other's live processes for dead (a process id seen from another pid namespace names another process)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def prefix(kind: str) -> str:
    """The name prefix of a scratch file or folder of `kind` (letters and digits) made by this process."""
    if not kind.isalnum():
        raise ValueError(f"scratch kind {kind!r} must be letters and digits")
    return f"lockstep-{kind}-{os.getpid()}-{_host_tag()}-"


def _pid(field: str) -> int | None:
    """The process id a name's field gives, or None where it cannot be one (not ASCII digits, or beyond a pid_t:
    `os.kill` would raise on it, and one stray name in the temporary folder must not stop every session's sweep)."""
    if not (field.isascii() and field.isdigit()) or int(field) >= 2**31:
        return None
    return int(field)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True  # alive (or its pid was reused: then the scratch stays, harmlessly)


def remove_orphans(directory: str | None = None) -> list[str]:
    """Remove the scratch files and folders in `directory` (the temporary folder by default) made on this host by
    processes that are gone. Returns their paths; one that cannot be removed (another user's) is left as it is."""
    directory = directory or tempfile.gettempdir()
    host = _host_tag()
    removed = []
    for name in sorted(os.listdir(directory)):
        parts = name.split("-")
        if len(parts) < 5 or parts[0] != "lockstep" or parts[3] != host:
            continue
        pid = _pid(parts[2])
        if pid is None or _alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:  # removed by another process's sweep first, or not ours to remove
            continue
        removed.append(path)
    return removed
