"""The wiring policy's tuning (`WiringConfig`): the throughput EMA's weight, the backoff after a
failed call and when an idle replica is probed; validated once, shared by every stage's `StagePool`
(`swarm.policy.stage_pool`) and the simulator's model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.errors import ConfigError

__all__ = ["WiringConfig"]


@dataclass(frozen=True, slots=True)
class WiringConfig:
    """Tuning of the wiring policy; every field is validated by `__post_init__`."""

    throughput_ema_alpha: float = 0.2
    """Weight (0, 1] of the newest measurement in the samples/s EMA; 1 keeps only the last one."""
    backoff_base_s: float = 1.0
    """Seconds a replica is in backoff after its first failure."""
    backoff_factor: float = 2.0
    """Each further consecutive failure multiplies the backoff by this (>= 1)."""
    backoff_max_s: float = 60.0
    """Cap on one backoff, seconds (>= backoff_base_s)."""
    probe_after: float = 30.0
    """A measured replica left idle this many times its own expected task time is tried once
    more (> 0): its figures may be stale. One slow measurement (a busy machine, a cold start)
    would otherwise keep it idle for good, since only its own tasks can correct it; a replica
    that really is slow then spends at most about 1/probe_after of its time on probes."""

    def __post_init__(self) -> None:
        if not 0.0 < self.throughput_ema_alpha <= 1.0:
            raise ConfigError(
                f"throughput_ema_alpha={self.throughput_ema_alpha}: use a weight in (0, 1]"
            )
        if not (math.isfinite(self.backoff_base_s) and self.backoff_base_s > 0.0):
            raise ConfigError(
                f"backoff_base_s={self.backoff_base_s}: use a positive number of seconds"
            )
        if not (math.isfinite(self.backoff_factor) and self.backoff_factor >= 1.0):
            raise ConfigError(f"backoff_factor={self.backoff_factor}: use a factor >= 1")
        if not (math.isfinite(self.backoff_max_s) and self.backoff_max_s >= self.backoff_base_s):
            raise ConfigError(f"backoff_max_s={self.backoff_max_s}: use seconds >= backoff_base_s")
        if not (math.isfinite(self.probe_after) and self.probe_after > 0.0):
            raise ConfigError(f"probe_after={self.probe_after}: use a positive factor")
