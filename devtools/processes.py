"""Child-process hygiene for the processes infermesh starts."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def stop_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGTERM when its parent dies, however it
    dies, so no service outlives what started it (Linux; elsewhere a no-op)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
