"""The values the pure core works on: what fleet.yaml asks for (`desired`), what the agents
reported (`observed`), and the diagnostics every layer speaks. Data only: no I/O, no clock."""
