"""The push plane's hops, unit-tested like the coordinator: a replica's next hop
(`stage_server.replica.next_hop.NextHop`) and the trainer's push plane, each over the shared fake
stage (`tests.support.stages`) behind the client factory. Both go through the one hop loop
(`swarm.rpc.hop`): a busy replica gets the next try elsewhere and is not banned; a failed
accumulating push may have accumulated downstream, so its stages are never accumulated again
from this hop and go back as uncertain; no replica, or a deadline gone, is `PeerUnavailable`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from client.trainer import PipelineTrainer
from stage_server.replica.next_hop import NextHop, Onward
from swarm.errors import Busy, NotFound, PeerUnavailable, RemoteError
from swarm.job.config import JobConfig
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Lease, MicrobatchResult, Replica, Task
from swarm.rpc.push_call import PushCall
from swarm.rpc.route_clients import Retiring
from swarm.rpc.routes import MAX_ROUTE_MEMBERS
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.stages import LOSS, Call, FakeCalls, FakeFactory, FakeStage

pytestmark = pytest.mark.timeout(30)

STAGES = 3
OUTPUTS, TARGETS = torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)


def _job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"stages": STAGES}, runtime={"data_plane": "push"})


def _route(*peers: str) -> pb.Route:
    return pb.Route(peers=list(peers), addresses=list(peers), throughput=[1.0] * len(peers))


async def _push(
    hop: NextHop,
    peers: Sequence[str],
    accumulate: list[int],
    *,
    need_grad: bool = True,
    deadline_s: float = 10.0,
) -> object:
    call: Onward = PushCall(
        0,
        3,
        Crossing(OUTPUTS),
        TARGETS,
        accumulate=tuple(accumulate),
        route=(_route(*peers), _route("later")),
        need_grad_inputs=need_grad,
    )
    return await hop.send(call, deadline=time.monotonic() + deadline_s)


async def test_a_push_goes_to_a_replica_of_the_next_stage_with_the_rest_of_the_route(
    tmp_path: Path,
) -> None:
    calls = FakeCalls()
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=calls.factory())
    try:
        pushed = await _push(hop, ["b"], [1, 2])
    finally:
        await hop.close()
    assert calls.calls == [Call("b", 1, "push", accumulate=True, need_grad_inputs=True)]
    assert calls.accumulated == {1: ["b"], 2: ["b"]}
    assert [(r.stage, r.peer) for r in pushed.receipts] == [(1, "b"), (2, "b")]  # type: ignore[attr-defined]
    assert pushed.uncertain == set() and pushed.loss_sum == LOSS  # type: ignore[attr-defined]
    assert pushed.grad is not None  # type: ignore[attr-defined]


async def test_a_busy_replica_gets_the_next_try_elsewhere_and_is_not_banned(
    tmp_path: Path,
) -> None:
    calls = FakeCalls()
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=calls.factory())
    calls.fail_next("a", Busy("queue full"))
    calls.fail_next("b", Busy("queue full"))
    try:
        pushed = await _push(hop, ["a", "b"], [1, 2])
        eligible = hop.routes.wiring[1].eligible()
    finally:
        await hop.close()
    tried = [c.peer for c in calls.calls]
    assert len(tried) == 3 and set(tried[:2]) == {"a", "b"}, "each busy one: the next elsewhere"
    assert set(eligible) == {"a", "b"}, "a busy replica is not banned"
    assert calls.accumulated == {1: [tried[2]], 2: [tried[2]]}
    assert pushed.uncertain == set()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "error",
    [
        PeerUnavailable("DEADLINE_EXCEEDED"),
        RemoteError("INTERNAL: a bug", "INTERNAL"),
        NotFound("x"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_failed_accumulating_push_is_never_accumulated_again_from_here(
    tmp_path: Path, error: Exception
) -> None:
    # Whatever the error, a push may have passed the microbatch on before it failed: the stages
    # it was to accumulate at are uncertain, and the next try only fetches the gradient.
    calls = FakeCalls()
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=calls.factory())
    calls.fail(1, error, after=True)
    try:
        pushed = await _push(hop, ["a", "b"], [1, 2])
        (failed,) = [c.peer for c in calls.accumulating(1)]
        assert failed not in hop.routes.wiring[1].eligible(), "a failed replica is banned"
    finally:
        await hop.close()
    other = ({"a", "b"} - {failed}).pop()
    assert calls.calls[1:] == [Call(other, 1, "push", accumulate=False, need_grad_inputs=True)]
    assert calls.accumulated == {1: [failed], 2: [failed]}
    assert pushed.uncertain == {1, 2} and pushed.receipts == []  # type: ignore[attr-defined]
    assert pushed.grad is not None  # type: ignore[attr-defined]


async def test_a_failed_push_that_needs_no_answer_ends_at_once_as_uncertain(
    tmp_path: Path,
) -> None:
    calls = FakeCalls()
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=calls.factory())
    calls.fail(1, PeerUnavailable("UNAVAILABLE"), after=True)
    try:
        pushed = await _push(hop, ["a", "b"], [1, 2], need_grad=False)
    finally:
        await hop.close()
    assert len(calls.calls) == 1
    assert pushed.uncertain == {1, 2} and pushed.grad is None  # type: ignore[attr-defined]


async def test_no_replica_or_no_time_left_is_a_peer_unavailable(tmp_path: Path) -> None:
    calls = FakeCalls()
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=calls.factory())
    try:
        with pytest.raises(PeerUnavailable, match="named no replica"):
            nowhere: Onward = PushCall(
                0, 0, Crossing(OUTPUTS), TARGETS, accumulate=(1,), need_grad_inputs=True
            )
            await hop.send(nowhere, deadline=1e18)
        with pytest.raises(PeerUnavailable, match="no replica took"):
            await _push(hop, ["a"], [1, 2], deadline_s=-1.0)
        calls.fail_next("a", NotFound("stage 1 is not served here"))  # refused, then banned
        with pytest.raises(PeerUnavailable, match="no eligible replica"):
            await _push(hop, ["a"], [1, 2])
    finally:
        await hop.close()
    assert calls.accumulated == {}


async def test_the_next_hop_follows_each_requests_route(tmp_path: Path) -> None:
    calls = FakeCalls()
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=calls.factory())
    try:
        await _push(hop, ["a", "b"], [1])
        first_b = hop.routes.clients["b"]
        hop.routes.clients["a"]  # made (a call may need it): its client is retired below
        await _push(hop, ["b", "c"], [1])  # a left, c joined
        assert set(hop.routes.clients) == {"b", "c"} and hop.routes.clients["b"] is first_b
        assert sorted(hop.routes.wiring[1]) == ["b", "c"]
        assert len(hop.routes.retiring) == 1  # a's client, closed after its calls' deadline
    finally:
        await hop.close()


@dataclass
class _Counted:
    """A client factory counting the clients it makes."""

    factory: FakeFactory
    made: int = 0

    def __call__(self, address: str, *args: Any, **kwargs: Any) -> object:
        self.made += 1
        return self.factory(address, *args, **kwargs)


@pytest.mark.attack("route-clients")
async def test_a_route_of_a_thousand_makes_only_the_clients_its_hop_calls(
    tmp_path: Path,
) -> None:
    """Any lease holder's push names the route its receiver follows: up to 1,024 replicas of
    the next stage, each before a client made on the event loop (about 90 ms a route here, 17
    KB each) and, once the next push named others, kept for the calls' deadline (60 s). A
    stream of such pushes grew the receiver without bound. Now a member's client is made when
    the hop calls it, and the replaced ones kept are bounded (`MAX_RETIRING`)."""
    calls = FakeCalls()
    counted = _Counted(calls.factory())
    hop = NextHop(_job(tmp_path), "job", 0, None, client_factory=counted)  # type: ignore[arg-type]
    many = [[f"n{k}-{i}" for i in range(MAX_ROUTE_MEMBERS)] for k in range(3)]
    try:
        for k, peers in enumerate(many):
            await _push(hop, peers, [1])
            assert len(hop.routes.clients) == MAX_ROUTE_MEMBERS  # every member followed
            assert counted.made <= (k + 1) * hop.attempts, counted.made  # before: 1,024 each
        assert len(hop.routes.retiring) <= 2 * hop.attempts
        retiring = Retiring(60.0, most=4)
        clients = [FakeStage(calls, f"r{i}", 1) for i in range(10)]
        for client in clients:
            retiring.retire(client)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the early closes run
        assert len(retiring) == 4
        await retiring.close()
    finally:
        await hop.close()


class _Recorder:
    def __init__(self) -> None:
        self.reports: list[MicrobatchResult] = []

    async def report_and_lease(
        self, trainer: str, results: Sequence[MicrobatchResult], count: int, *, working: object
    ) -> Lease:
        self.reports.extend(results)
        return Lease(0, [], [])


def _trainer(tmp_path: Path, calls: FakeCalls) -> tuple[PipelineTrainer, _Recorder]:
    source = _Recorder()
    trainer = PipelineTrainer(
        _job(tmp_path),
        source,  # type: ignore[arg-type]
        seed=0,
        client_factory=calls.factory(),  # type: ignore[arg-type]
    )
    trainer._leased_step = 0
    trainer.sync([[Replica("a", "a"), Replica("b", "b")], [Replica("c", "c")], [Replica("d", "d")]])
    return trainer, source


async def test_the_trainers_push_reports_every_stage_the_push_plane_accumulated_at(
    tmp_path: Path,
) -> None:
    calls = FakeCalls()
    trainer, source = _trainer(tmp_path, calls)
    try:
        await trainer._run_task(Task(0, 1, frozenset(range(STAGES))))
    finally:
        await trainer.close()
    ((peer, stage, method),) = [(c.peer, c.stage, c.method) for c in calls.calls]
    assert stage == 0 and method == "push" and peer in ("a", "b")
    (report,) = source.reports
    assert report.holders == {0: peer, 1: peer, 2: peer} and report.loss_sum == LOSS


async def test_the_trainers_failed_push_leaves_every_stage_to_the_coordinator(
    tmp_path: Path,
) -> None:
    calls = FakeCalls()
    calls.fail(0, PeerUnavailable("DEADLINE_EXCEEDED"), after=True)
    trainer, source = _trainer(tmp_path, calls)
    try:
        await trainer._run_task(Task(0, 1, frozenset(range(STAGES))))
    finally:
        await trainer.close()
    assert len(calls.calls) == 1, "the push needs no answer: nothing is tried elsewhere"
    (report,) = source.reports
    assert report.holders == {} and report.loss_sum is None
    assert trainer.metrics.unreported._value.get() == 1  # type: ignore[attr-defined]
