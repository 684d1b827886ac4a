"""A stage server in this process (`tests.support.inprocess.Swarm`) that refuses every push with
one error while `Refusing.on`: the error crosses real gRPC as a replica's own refusal would (a
handover it cannot take, say), for the tests of how a failure's cause travels and bounds a job."""

from __future__ import annotations

from typing import Any

from stage_server.server import RunningStageServer
from swarm.errors import SwarmError

__all__ = ["Refusing"]


class Refusing:
    """`server`'s pushes fail with `error` while `on` (from the start), then are served again."""

    def __init__(self, server: RunningStageServer, error: SwarmError) -> None:
        self.on, self.refused = True, 0
        plane = server.servicer._push
        push = plane.push

        async def refusing(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.refused += 1
                raise error
            return await push(*args, **kwargs)

        plane.push = refusing  # type: ignore[method-assign]
