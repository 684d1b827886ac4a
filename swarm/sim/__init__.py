"""A discrete-event simulator of a swarm that drives the real wiring, placement and rebalancing
policies (DESIGN.md, "Simulator"): `simulate(SimConfig(...))` returns a `Summary` of throughput
against the optimum, window by window. `swarm simulate` is its command line (`swarm.sim.cli`)."""

from __future__ import annotations

from swarm.sim.engine import Simulation, simulate
from swarm.sim.model import SimClock, SimConfig
from swarm.sim.report import Summary, Window

__all__ = ["SimClock", "SimConfig", "Simulation", "Summary", "Window", "simulate"]
