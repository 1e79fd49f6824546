"""Failpoints for the resilience tests: `LOCKSTEP_FAULT=name@n` SIGKILLs the process the n-th time it passes
the point `name` (n defaults to 1); `name@n:TERM` sends SIGTERM instead (a polite stop: the CLI unwinds the run).
Unset, a failpoint is a dictionary lookup. Several may be given, comma-separated. A point passed with its
iteration also answers to `name[k]@n`, counted over iteration k's passes only: `mid-train[1]@2` is the second
micro-step of iteration 1 however many micro-steps iteration 0 had (that depends on how shards landed).

Points: `shard-write` (a shard's bytes written under _tmp/, not yet published), `file-write` (the same for any other
lake file written through a temporary one), `after-plan` (rollouts in
flight), `mid-train` (after the first micro-step), `mid-checkpoint` (checkpoint files written, not yet moved
into place), `before-promote` (checkpoint complete, PROMOTED not written), `after-promote` (PROMOTED written,
ledger not yet updated). A spec naming another point, or a count that is not a positive integer, is refused (a
ValueError at the first point passed) rather than never firing.
"""

from __future__ import annotations

import os
import re
import signal
from collections import Counter

_passes: Counter = Counter()


_SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}
POINTS = ("shard-write", "file-write", "after-plan", "mid-train", "mid-checkpoint", "before-promote", "after-promote")
_KEY = re.compile(r"(?P<point>[a-z-]+)(\[(?P<iteration>\d+)\])?")


def _armed() -> dict[str, tuple[int, int]]:
    """point name -> (pass that fires, signal)."""
    spec = os.environ.get("LOCKSTEP_FAULT", "")
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, rest = item.partition("@")
        n, _, sig = rest.partition(":")
        key = _KEY.fullmatch(name)
        if key is None or key["point"] not in POINTS:
            raise ValueError(f"LOCKSTEP_FAULT={spec!r}: {name!r} is not a failpoint: one of {', '.join(POINTS)}, "
                             "optionally with [iteration]")
        if not (n or "1").isdigit() or int(n or 1) < 1:
            raise ValueError(f"LOCKSTEP_FAULT={spec!r}: pass {n!r} of {name!r} is not a positive integer")
        if (sig or "KILL") not in _SIGNALS:
            raise ValueError(f"LOCKSTEP_FAULT={spec!r}: signal {sig!r} of {name!r} is not one of {sorted(_SIGNALS)}")
        out[name] = (int(n or 1), _SIGNALS[sig or "KILL"])
    return out


def point(name: str, iteration: int | None = None) -> None:
    armed = _armed()
    for key in (name, f"{name}[{iteration}]") if iteration is not None else (name,):
        if key not in armed:
            continue
        _passes[key] += 1
        n, sig = armed[key]
        if _passes[key] == n:
            os.kill(os.getpid(), sig)
