"""Stochastic wiring: which replica of a stage a trainer sends its next task to.

Pure policy, no I/O: its owner's routes feed it membership (`add`/`remove`/`set_draining`) and
the load peers publish on MQTT (`report_load`), and the one hop loop (`swarm.rpc.hop`) the
outcome of every call (`started`/`busy`/`finished`/`failed`); the discrete-event simulator drives
the same code with simulated peers. Time comes from an injected `Clock`, randomness from an
injected `random.Random`, so tests and the simulator are reproducible.

The rule (docs/architecture.md, "Policies"): send the task to the replica with the smallest expected
finish time `(queued + task) / throughput`, ties broken at random, replicas in backoff and draining
ones excluded; a replica not tried yet, or left idle `probe_after` times its expected task time, is
tried next (only its own tasks can correct its figures). Each stage's replicas and the choice
among them are a `StagePool` (`swarm.policy.stage_pool`, with the cost of a choice); `Wiring`
holds one per stage of a job."""

from __future__ import annotations

import random

from swarm.clock import Clock
from swarm.errors import ConfigError
from swarm.policy.stage_pool import NoReplicaError, StagePool
from swarm.policy.wiring_config import WiringConfig

# The policy's public names, wherever they live.
__all__ = ["NoReplicaError", "StagePool", "Wiring", "WiringConfig"]


class Wiring:
    """One `StagePool` per stage of a job, and the peer -> stage index that routes membership
    and load reports to the right pool. Calls about a task (`choose`, `started`, `finished`,
    `failed`) go to `wiring[stage]`, since a peer may change stage while a task is in flight."""

    def __init__(
        self,
        num_stages: int,
        *,
        clock: Clock,
        rng: random.Random,
        config: WiringConfig | None = None,
        task_samples: float = 1.0,
    ) -> None:
        if num_stages < 1:
            raise ConfigError(f"num_stages={num_stages}: a job has at least one stage")
        self._pools = [
            StagePool(clock=clock, rng=rng, config=config, task_samples=task_samples)
            for _ in range(num_stages)
        ]
        self._stage_of: dict[str, int] = {}

    @property
    def num_stages(self) -> int:
        return len(self._pools)

    def __getitem__(self, stage: int) -> StagePool:
        return self._pools[stage]

    def stage_of(self, peer: str) -> int | None:
        return self._stage_of.get(peer)

    def add(self, peer: str, stage: int, throughput: float) -> None:
        """The peer serves `stage` now; if it served another stage (rebalancing), it leaves it."""
        if not 0 <= stage < len(self._pools):
            raise ValueError(f"stage {stage} out of range 0..{len(self._pools) - 1}")
        old = self._stage_of.get(peer)
        if old is not None and old != stage:
            self._pools[old].remove(peer)
        self._stage_of[peer] = stage
        self._pools[stage].add(peer, throughput)

    def remove(self, peer: str) -> bool:
        stage = self._stage_of.pop(peer, None)
        return stage is not None and self._pools[stage].remove(peer)

    def set_draining(self, peer: str, draining: bool) -> None:
        stage = self._stage_of.get(peer)
        if stage is not None:
            self._pools[stage].set_draining(peer, draining)

    def report_load(
        self, peer: str, queued_samples: float, seconds_per_sample: float | None
    ) -> bool:
        stage = self._stage_of.get(peer)
        return stage is not None and self._pools[stage].report_load(
            peer, queued_samples, seconds_per_sample
        )

    def choose(self, stage: int, task_samples: float) -> str:
        return self._pools[stage].choose(task_samples)

    def stages_without_eligible(self) -> list[int]:
        """Stages whose every replica is in backoff, draining or gone (O(total replicas))."""
        return [k for k, pool in enumerate(self._pools) if not pool.eligible()]
