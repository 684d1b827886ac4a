"""swarm: SWARM-parallel training across unreliable, heterogeneous stage servers."""

__version__ = "0.1.0"
