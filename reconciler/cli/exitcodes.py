"""Exit codes, the same for every command of `fleet` and `fleet-agent` (the README's table): part of
the interface, never renumbered. Defined in wire/command_line.py, the contract both commands share
(the agent may not import the control plane)."""

from wire.command_line import EXIT_TABLE, Exit, ExitRow, exit_codes_epilog

__all__ = ["EXIT_TABLE", "Exit", "ExitRow", "exit_codes_epilog"]
