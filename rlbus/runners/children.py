"""Child processes that never outlive rlbus: own session (a terminal's Ctrl-C reaches only the
parent, which stops them in order) and, on Linux, a parent-death signal (if the parent is
killed outright, the kernel sends them SIGTERM)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


# Linux sends the parent-death signal when the spawning *thread* exits, so children are
# spawned from the main thread, or else from one spawner thread that lives as long as the process.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbus-spawner")


def spawn(args: Sequence[str], **kw: Any) -> subprocess.Popen:  # type: ignore[type-arg]
    def start() -> subprocess.Popen:  # type: ignore[type-arg]
        return subprocess.Popen(list(args), start_new_session=True, preexec_fn=_die_with_parent, **kw)

    if threading.current_thread() is threading.main_thread():
        return start()
    return _spawner.submit(start).result()
