"""`FaultPlan`, the one fault-injection plan, and the demo's faults built on it: what `swarm demo`
kills and when, without starting any process."""

from __future__ import annotations

import random

from client.demo import Chaos
from swarm.ops.faults import ANY_REPLICA, Fault, FaultPlan, Point, parse_faults
from swarm.proto import scheduler_pb2
from swarm.proto.control_pb2 import PEER_STATE_JOINING, PEER_STATE_SERVING


def test_due_returns_each_fault_once_and_add_plans_more() -> None:
    plan = FaultPlan(parse_faults("s0r0:backward@1,s1r0:idle@2,trainer:forward@4,*:idle@4"))
    assert plan.pending == [  # a process's own faults are its own business (maybe_die)
        Fault("s1r0", Point.IDLE, 2),
        Fault("trainer", Point.FORWARD, 4),
        Fault(ANY_REPLICA, Point.IDLE, 4),
    ]
    assert plan.due(1) == []
    assert plan.due(3) == [Fault("s1r0", Point.IDLE, 2)]
    assert plan.due(3) == []
    plan.add(Fault("s0r0", Point.AVERAGING, 5))  # in-process: not planned from outside
    plan.add(Fault("broker", Point.IDLE, 6))
    assert [f.target for f in plan.due(10)] == ["trainer", ANY_REPLICA, "broker"]


def _status(step: int, steps: int, *pools: list[str]) -> scheduler_pb2.JobStatus:
    """Each pool's replicas serving; a name ending in "?" is still joining (it does not count)."""
    stages = [
        scheduler_pb2.StageStatus(
            stage=k,
            replicas=[
                scheduler_pb2.Replica(
                    peer=p.rstrip("?"),
                    state=PEER_STATE_JOINING if p.endswith("?") else PEER_STATE_SERVING,
                )
                for p in peers
            ],
        )
        for k, peers in enumerate(pools)
    ]
    return scheduler_pb2.JobStatus(step=step, steps=steps, stages=stages)


def test_the_demo_kills_one_spare_replica_halfway() -> None:
    chaos = Chaos(40, chaos=False, rng=random.Random(0))
    spare = (["peer0"], ["peer1", "peer2"], ["peer3"])
    assert chaos.victim(_status(19, 40, *spare)) is None
    # due, but no stage can spare a replica: it waits for one
    assert chaos.victim(_status(20, 40, ["peer0"], ["peer1"])) is None
    # nor one whose second replica is still joining: it holds no state yet (issue 45, item 2)
    assert chaos.victim(_status(20, 40, ["peer0", "peer4?"], ["peer1"])) is None
    assert chaos.victim(_status(21, 40, *spare)) in ("peer1", "peer2")
    assert all(chaos.victim(_status(s, 40, *spare)) is None for s in range(22, 40))


def test_with_chaos_it_kills_again_five_steps_later_but_not_near_the_end() -> None:
    chaos = Chaos(20, chaos=True, rng=random.Random(0))
    spare = (["peer0", "peer4"], ["peer1"], ["peer2"], ["peer3"])
    kills = [s for s in range(20) if chaos.victim(_status(s, 20, *spare)) is not None]
    assert kills == [10, 15]  # 20 would be in the last 3 steps


def test_a_due_kill_near_the_end_never_happens() -> None:
    chaos = Chaos(10, chaos=False, rng=random.Random(0))
    assert chaos.victim(_status(7, 10, ["a", "b"])) is None  # due since step 5, first seen at 7
    assert chaos.victim(_status(9, 10, ["a", "b"])) is None


def test_the_demo_says_why_it_killed_no_replica() -> None:
    chaos = Chaos(40, chaos=False, rng=random.Random(0))
    assert "did not reach step 20" in chaos.why_not
    assert chaos.victim(_status(20, 40, ["peer0", "peer4?"], ["peer1"])) is None
    assert chaos.why_not == (
        "no stage had two serving replicas at step 20: stage 0: peer0 serving, peer4 joining; "
        "stage 1: peer1 serving"
    )
    assert chaos.victim(_status(38, 40, ["peer0", "peer4"], ["peer1"])) is None  # near the end
    assert "at step 20" in chaos.why_not  # what kept it from the kill while one was due
