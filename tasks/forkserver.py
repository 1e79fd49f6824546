"""Imported first by the fork server that starts lockstep's worker processes (`tasks.workers.child_context`).

The server is in the run's process group, so a SIGTERM sent to the whole group (`kill -TERM -- -PGID`, a job
scheduler, `timeout`) reaches it too. Killed, it would take with it the pipes through which the run learns how its
workers ended, and the run would read every worker as dead (exit code 255) while it stops them in order: here the
server ignores SIGTERM. It still ends with the run, at the end of its pipe from it; its children reset SIGTERM
(`tasks.workers.enter_child`). Imported anywhere else, this module does nothing.
"""

from __future__ import annotations

import signal
import sys

if "from multiprocessing.forkserver import main" in " ".join(getattr(sys, "orig_argv", ())):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
