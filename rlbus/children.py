"""Child processes that never outlive rlbus: own session (a terminal's Ctrl-C reaches only the
parent, which stops them in order) and, on Linux, a parent-death signal (if the parent is
killed outright, the kernel sends them SIGTERM)."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


def spawn(args: Sequence[str], **kw: Any) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen(list(args), start_new_session=True, preexec_fn=_die_with_parent, **kw)
