"""The `fleet-agent` command."""

import sys


def main() -> None:
    print("fleet-agent: not built yet", file=sys.stderr)
    sys.exit(1)
