"""The dial-back's one gRPC call (`scheduler.reachability.Dialer`): StageService.Info with the
swarm's token, through `swarm.net.dial.channel`, the one dialer every call to a peer goes
through (a relayed address is carried by its relay there)."""

from __future__ import annotations

import grpc

from scheduler.reachability import DialFailed
from swarm.net.dial import channel
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc

__all__ = ["StageDialer"]


class StageDialer:
    """StageService.Info with the swarm's token through `swarm.net.dial.channel`, the one dialer
    every call to a peer goes through (a relayed address goes through its relay there)."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    async def answer(self, address: str, timeout_s: float) -> str:
        # One try, no waiting for a connection to come back: the deadline is the whole check.
        options = [("grpc.max_reconnect_backoff_ms", int(timeout_s * 1000))]
        conn = channel(address, token=self._token, options=options)
        try:
            info = stage_pb2_grpc.StageServiceStub(conn).Info
            reply = await info(pb.StageInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            # UNIMPLEMENTED too: any gRPC server answers so, and the peer is reachable only
            # where it answers as itself (an aggregator answers Info with its peer id).
            raise DialFailed(f"{e.code().name}: {_last(e.details() or '')}") from None
        finally:
            await conn.close()
        return reply.peer


def _last(details: str) -> str:
    """The last cause of a gRPC error's details, which run on through every layer."""
    parts = details.splitlines()[0].split(": ") if details else [""]
    text = ": ".join(parts[-2:]) if len(parts) > 2 else ": ".join(parts)
    return text if len(text) <= 160 else text[:157] + "..."
