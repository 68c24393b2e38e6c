"""The process's descriptor limit, which both servers (fleet serve's front, the agent) raise at
start and size their connection caps from."""

from __future__ import annotations

import resource


def raise_descriptor_limit(ceiling: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard one, to `ceiling` at most (systemd gives 1,024
    soft and 524,288 hard, and expects a service that needs more to raise it itself; beyond 65,536
    the cap would let idle connections hold more memory than descriptors are worth). Returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft
