"""Failpoints for the resilience tests: `LOCKSTEP_FAULT=name@n` SIGKILLs the process the n-th time it passes
the point `name` (n defaults to 1). Unset, a failpoint is a dictionary lookup. Several may be given, comma-separated.

Points: `shard-write` (a shard's bytes written under _tmp/, not yet published), `after-plan` (rollouts in
flight), `mid-train` (after the first micro-step), `mid-checkpoint` (checkpoint files written, not yet moved
into place), `before-promote` (checkpoint complete, PROMOTED not written), `after-promote` (PROMOTED written,
ledger not yet updated).
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_passes: Counter = Counter()


def _armed() -> dict[str, int]:
    spec = os.environ.get("LOCKSTEP_FAULT", "")
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, n = item.partition("@")
        out[name] = int(n or 1)
    return out


def point(name: str) -> None:
    armed = _armed()
    if name not in armed:
        return
    _passes[name] += 1
    if _passes[name] == armed[name]:
        os.kill(os.getpid(), signal.SIGKILL)
