"""`fleet serve`: the control plane's long-running side (heartbeat, alerts, router)."""
