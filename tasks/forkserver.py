"""Imported first by the fork server that starts lockstep's worker processes (`tasks.workers.child_context`).

The server moves into a process group of its own. In the run's group, a signal sent to the whole group (a terminal's
Ctrl-C, `kill -TERM -- -PGID`, a job scheduler, `timeout`) would reach it too: killed, it would take with it the pipes
through which the run learns how its workers ended, and the run would read every live worker as dead (exit code 255)
while it stops them in order. It still ends with the run, at the end of its pipe from it. Each child it forks joins
the run's group once it ignores SIGINT and takes SIGTERM from the run only (`tasks.workers.enter_child`), so that a
group signal or kill reaches the workers as it reaches spawned ones. Imported anywhere else, this module does nothing.
"""

from __future__ import annotations

import os
import sys

if "from multiprocessing.forkserver import main" in " ".join(getattr(sys, "orig_argv", ())):
    try:
        os.setpgid(0, 0)
    except OSError:  # refused (not seen): the server stays in the run's group, as a spawned worker would be; an
        pass  # error here would stop the server's start, and with it every worker's
