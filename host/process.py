"""Processes on this machine, by pid."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether a process `pid` exists here (one of another user's counts: signalling it is refused,
    not unknown), so that what a dead process left behind can be taken back."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
