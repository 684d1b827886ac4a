"""The aggregator peer (`swarm aggregator`): a process with no model and no GPU that owns
averaging parts in the pools of the running jobs it follows (`main`); its flags (`cli`)."""
