"""A swarm whose stage servers run in the test's process (real gRPC servers on real ports), so
every replica's state can be looked at after each step."""

from __future__ import annotations

import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.rpc.lease import Replica

__all__ = ["Swarm"]


class Swarm:
    """Stage servers in this process, grouped per stage, and a coordinator over them."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.servers: list[list[RunningStageServer]] = [[] for _ in range(job.training.stages)]

    async def add(self, stage: int) -> RunningStageServer:
        server = await start_stage_server(self.job, StageServerOptions(stage=stage))
        self.servers[stage].append(server)
        return server

    def members(self) -> list[list[Replica]]:
        return [[Replica(s.address, s.address, 1.0) for s in stage] for stage in self.servers]

    def assert_replicas_identical(self) -> None:
        for stage in self.servers:
            first = stage[0].runtime
            for other in stage[1:]:
                assert other.runtime.step == first.step
                for (name, a), b in zip(
                    first.export_state().items(), other.runtime.export_state().values(), strict=True
                ):
                    assert torch.equal(a, b), f"stage {first.stage} differs at {name}"

    async def close(self) -> None:
        for stage in self.servers:
            for s in stage:
                await s.stop()
