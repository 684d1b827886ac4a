"""One microbatch on the push plane as one value (`swarm.rpc.push_call.PushCall`): what a
replica sends on to the next stage, and what each try of its hop sends, derived from the call it
serves."""

from __future__ import annotations

import torch

from swarm.proto import stage_pb2 as pb
from swarm.rpc.push_call import PushCall
from swarm.wire.crossing import Crossing

IDS, TARGETS = torch.tensor([[1, 2]]), torch.tensor([[2, 3]])


def _route(peer: str) -> pb.Route:
    return pb.Route(peers=[peer], addresses=[peer], throughput=[1.0])


def test_a_received_call_is_the_request_with_its_tensors() -> None:
    h = pb.StagePushRequest(
        microbatch=pb.MicrobatchId(step=3, index=5, epoch=2),
        accumulate=[1, 2, 3],
        route=[_route("b"), _route("c")],
        need_grad_inputs=True,
        run=7,
    )
    call = PushCall.received(h, Crossing(IDS), TARGETS)
    assert (call.step, call.index, call.accumulate, call.run) == (3, 5, (1, 2, 3), 7)
    assert [r.peers[0] for r in call.route] == ["b", "c"]
    assert call.need_grad_inputs and not call.evaluate and call.crossing.hidden is IDS


def test_the_call_sent_on_accumulates_only_later_stages_through_the_rest_of_the_route() -> None:
    served = PushCall(
        3,
        5,
        Crossing(IDS),
        TARGETS,
        accumulate=(1, 2, 3),
        route=(_route("b"), _route("c")),
        run=7,
    )
    outputs, tokens = torch.zeros(1, 2, 4), torch.tensor([[1, 2]], dtype=torch.uint8)
    onward = served.onward(Crossing(outputs, tokens), TARGETS, after=1, need_grad_inputs=True)
    assert onward.accumulate == (2, 3) and onward.route == served.route
    assert onward.crossing.hidden is outputs and onward.crossing.tokens is tokens
    assert onward.need_grad_inputs and onward.run == 7
    # One try: to a replica of route[0], with the route after it; accumulating only if it may.
    tried = onward.carrying("wire form").past(accumulating=False)
    assert tried.crossing.hidden == "wire form" and tried.crossing.tokens is tokens
    assert tried.accumulate == () and [r.peers[0] for r in tried.route] == ["c"]
    assert onward.past(accumulating=True).accumulate == (2, 3)
    assert onward.trying(accumulating=True) is onward
    assert onward.trying(accumulating=False).route == onward.route
