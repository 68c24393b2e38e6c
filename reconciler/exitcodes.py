"""Exit codes, the same for every command (the README's table): part of the interface, never renumbered."""

from enum import IntEnum


class Exit(IntEnum):
    OK = 0  # success; for `plan`, no changes
    FAILURE = 1  # unexpected failure (a bug, or an error with no better code)
    CHANGES = 2  # `plan --detailed-exitcode`: success, changes present
    INVALID_CONFIG = 3  # what `validate` finds
    PLAN_REFUSED = 4  # at least one plan error
    LOCKED = 5  # another apply holds the lock
    STALE_PLAN = 6  # saved plan no longer matches the config or the fleet
    APPLY_FAILED = 7  # apply ran and some actions failed
