"""An aggregator's answer to the scheduler's dial-back: `StageService.Info` with its peer id, and
no other StageService call (it serves no stage: they stay UNIMPLEMENTED). The dial-back takes a
peer as reachable only where it answers as itself: an UNIMPLEMENTED, which any gRPC server
answers, proves nothing (issue 54, M-scan)."""

from __future__ import annotations

from typing import Any

import grpc

from swarm.proto import stage_pb2 as pb

__all__ = ["add_info"]


def add_info(server: grpc.aio.Server, peer: str) -> None:
    """Serve `StageService.Info` on `server`, answering as `peer`."""

    async def info(request: pb.StageInfoRequest, context: Any) -> pb.StageInfoResponse:
        return pb.StageInfoResponse(peer=peer)

    handler = grpc.unary_unary_rpc_method_handler(
        info,
        request_deserializer=pb.StageInfoRequest.FromString,
        response_serializer=pb.StageInfoResponse.SerializeToString,
    )
    service = grpc.method_handlers_generic_handler("swarm.proto.StageService", {"Info": handler})
    server.add_generic_rpc_handlers((service,))
