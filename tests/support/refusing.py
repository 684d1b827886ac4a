"""A stage server in this process (`tests.support.inprocess.Swarm`) that refuses every push, and
every ForwardBackward (the carry plane's call at the last stage), with one error while
`Refusing.on`: the error crosses real gRPC as a replica's own refusal would (a handover it cannot
take, say), for the tests of how a failure's cause travels and bounds a job."""

from __future__ import annotations

from typing import Any

from stage_server.server import RunningStageServer
from swarm.errors import SwarmError

__all__ = ["Refusing"]


class Refusing:
    """`server`'s pushes and its stage's forward-backward fail with `error` while `on` (from the
    start), then are served again."""

    def __init__(self, server: RunningStageServer, error: SwarmError) -> None:
        self.on, self.refused = True, 0
        self.error = error
        plane, runtime = server.servicer._push, server.runtime
        push, forward_backward = plane.push, runtime.forward_backward

        async def refusing(*args: Any, **kwargs: Any) -> Any:
            self._refuse()
            return await push(*args, **kwargs)

        def refusing_compute(*args: Any, **kwargs: Any) -> Any:
            self._refuse()
            return forward_backward(*args, **kwargs)

        plane.push = refusing  # type: ignore[method-assign]
        runtime.forward_backward = refusing_compute  # type: ignore[method-assign]

    def _refuse(self) -> None:
        if self.on:
            self.refused += 1
            raise self.error
