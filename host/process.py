"""Processes on this machine, by pid."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether a process `pid` exists here (one of another user's counts: signalling it is refused,
    not unknown), so that what a dead process left behind can be taken back. A pid no process can
    have (0 and below would signal a process group; past the kernel's range) is not alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
