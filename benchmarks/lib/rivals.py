"""Busy processes competing for the cores while a benchmark runs (its --compete N), as on a
shared machine. Each is a Python loop under the normal scheduling policy: a benchmark run under
`chrt -f 1` would otherwise hand its real-time policy to them, and a real-time busy loop never
gives its core back (run --compete without chrt: a real-time benchmark always wins its cores)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys


def _normal_policy() -> None:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


@contextlib.contextmanager
def competing(n: int):
    """n busy processes for the duration of the block, killed when it ends, however it ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_normal_policy)
             for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
