"""The servers the agent runs: started, supervised and stopped (`supervisor`) through the
`Launcher` seam (`launch`)."""
