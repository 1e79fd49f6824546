"""Failpoints for the resilience tests: `LOCKSTEP_FAULT=name@n` SIGKILLs the process the n-th time it passes
the point `name` (n defaults to 1); `name@n:TERM` sends SIGTERM instead (a polite stop: the CLI unwinds the run), and
`name@n:INT` SIGINT to the process's whole group, as a terminal's Ctrl-C does (the workers and the temporary Prefect
API server get it too), and `name@n:GROUPTERM` SIGTERM to the whole group (`kill -TERM -- -PGID`, a job scheduler,
systemd, `timeout`).
Unset, a failpoint is a dictionary lookup. Several may be given, comma-separated. A point passed with its
iteration also answers to `name[k]@n`, counted over iteration k's passes only: `mid-train[1]@2` is the second
micro-step of iteration 1 however many micro-steps iteration 0 had (that depends on how shards landed).

Points: `shard-write` (a shard's bytes written under _tmp/, not yet published; on object stores, before its one
PUT), `file-write` (the same for any other lake file), `after-plan` (rollouts in flight), `mid-train` (after the
first micro-step), `mid-checkpoint` (checkpoint files written, not yet moved into place; on object stores, written
in place without their MANIFEST.json), `before-promote` (checkpoint complete, PROMOTED not written),
`after-promote` (PROMOTED written, ledger not yet updated). Only `mid-train` is passed with its iteration. A spec
that could never fire (another point's name, `[k]` on a point passed without its iteration, a pass that is not a
positive integer, an empty pass or signal, a point armed twice) is refused: a ValueError at the first point passed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter

_passes: Counter = Counter()


# name -> (signal, sent to the whole process group rather than this process)
_SIGNALS = {
    "KILL": (signal.SIGKILL, False),
    "TERM": (signal.SIGTERM, False),
    "INT": (signal.SIGINT, True),
    "GROUPTERM": (signal.SIGTERM, True),
}
POINTS = ("shard-write", "file-write", "after-plan", "mid-train", "mid-checkpoint", "before-promote", "after-promote")
ITERATION_POINTS = ("mid-train",)  # the points passed with their iteration: only these answer to name[k]
_KEY = re.compile(r"(?P<point>[a-z-]+)(\[(?P<iteration>[0-9]+)\])?")


def _armed() -> dict[str, tuple[int, tuple[int, bool]]]:
    """point name -> (pass that fires, (signal, to the whole group))."""
    spec = os.environ.get("LOCKSTEP_FAULT", "")
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, at, rest = item.partition("@")
        n, colon, sig = rest.partition(":")
        bad = f"LOCKSTEP_FAULT={spec!r}:"
        key = _KEY.fullmatch(name)
        if key is None or key["point"] not in POINTS:
            raise ValueError(
                f"{bad} {name!r} is not a failpoint: one of {', '.join(POINTS)}, "
                f"or {', '.join(ITERATION_POINTS)} with [iteration]"
            )
        if key["iteration"] is not None:
            if key["point"] not in ITERATION_POINTS:
                raise ValueError(
                    f"{bad} {key['point']!r} is not passed with its iteration: [iteration] only on "
                    f"{', '.join(ITERATION_POINTS)}"
                )
            name = f"{key['point']}[{int(key['iteration'])}]"  # [01] is the key point() looks up as [1]
        if at and not (n.isascii() and n.isdecimal() and int(n) >= 1):
            raise ValueError(f"{bad} pass {n!r} of {name!r} is not a positive integer")
        if colon and sig not in _SIGNALS:
            raise ValueError(f"{bad} signal {sig!r} of {name!r} is not one of {sorted(_SIGNALS)}")
        if name in out:
            raise ValueError(f"{bad} {name!r} is armed twice")
        out[name] = (int(n) if at else 1, _SIGNALS[sig if colon else "KILL"])
    return out


def point(name: str, iteration: int | None = None) -> None:
    armed = _armed()
    for key in (name, f"{name}[{iteration}]") if iteration is not None else (name,):
        if key not in armed:
            continue
        _passes[key] += 1
        n, sig = armed[key]
        if _passes[key] == n:
            sig, group = sig
            if group:
                _signal_group(sig)
            else:
                os.kill(os.getpid(), sig)


def _signal_group(sig: int) -> None:
    """Send `sig` to this process's whole group from another process, as a terminal, a job scheduler or `kill` does:
    the children take a SIGTERM only from this process (`tasks.workers.watch_parent`)."""
    code = "import os, sys; os.killpg(int(sys.argv[1]), int(sys.argv[2]))"
    subprocess.run(  # in a session of its own: outside the group it signals
        [sys.executable, "-c", code, str(os.getpgrp()), str(int(sig))], check=True, start_new_session=True
    )
