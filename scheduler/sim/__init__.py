"""A discrete-event simulator of a swarm that drives the real wiring, placement and rebalancing
policies (docs/architecture.md, "Policies"): `simulate(SimConfig(...))` returns a `Summary` of
throughput against the optimum, window by window. `swarm simulate` is its command line
(`scheduler.sim.cli`)."""

from __future__ import annotations

from scheduler.sim.engine import Simulation, simulate
from scheduler.sim.model import SimClock, SimConfig
from scheduler.sim.report import Summary, Window

__all__ = ["SimClock", "SimConfig", "Simulation", "Summary", "Window", "simulate"]
