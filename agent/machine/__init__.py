"""The machine the agent runs on: what it has (`inventory`: cores, memory, disk, GPUs), who it
is (`identity`), what its engines can use (`environment`)."""
