"""The step coordinator: leases each step's microbatches to trainers, collects where their
gradients live, and commits the step on every replica of every stage in two phases."""

from scheduler.coordinator.coordinator import LocalCoordinator
from scheduler.coordinator.export import gather_model, gather_state

__all__ = ["LocalCoordinator", "gather_model", "gather_state"]
