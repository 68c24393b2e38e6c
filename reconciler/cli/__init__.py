"""The `fleet` command: its arguments, one function per command, how each ends (text or the
JSON error document), the tables and the demo."""
