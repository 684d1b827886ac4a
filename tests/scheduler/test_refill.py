"""The scheduler's answer to a stage that lost its last replica (`Mover.refill`): an idle peer,
else a spare replica, sent at once and once; none where there is no spare; and placement counts
the peers on their way to a stage (`Assignments.on_the_way`)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from scheduler.assignments import Assignments
from scheduler.rebalance_loop import Mover
from scheduler.registry import PeerRegistry
from swarm.clock import Clock, FakeClock, MonotonicClock
from swarm.job.config import RebalanceConfig
from swarm.proto import control_pb2 as cpb
from tests.support.announcements import serving
from tests.support.fakes import SilentBus


def _joining(peer: str, speeds: list[float]) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer, job="j", state=cpb.PEER_STATE_JOINING, samples_per_second=dict(enumerate(speeds))
    )


def _stage_1_lost(registry: PeerRegistry) -> None:
    """Stage 1 of three has lost its last replica; stage 2 has two, stage 0 one."""
    for peer, stage in (("a", 0), ("b", 2), ("c", 2)):
        registry.announce(serving(peer, stage, speeds=[5.0, 5.0, 5.0]))


def _scheduler(
    enabled: bool = True, min_replicas: int = 1, clock: Clock | None = None
) -> tuple[PeerRegistry, Assignments, Mover, Counter]:
    registry = PeerRegistry(clock or MonotonicClock(), load_silence_s=1e9, serve_timeout_s=60.0)

    async def say(job: str, text: str) -> None:
        pass

    assignments = Assignments(
        registry, SilentBus(), say, grace_s=0.0, serve_timeout_s=60.0, lost_stage_grace_s=0.0
    )
    moves = Counter("moves", "moves", ["job"], registry=CollectorRegistry())
    config = RebalanceConfig(enabled=enabled)
    return registry, assignments, Mover("j", 3, config, assignments, moves, min_replicas), moves


def test_a_spare_replica_is_moved_at_once_and_once() -> None:
    registry, assignments, mover, moves = _scheduler()
    for a in (
        serving("a", 0, speeds=[5.0, 5.0, 5.0]),
        serving("b", 2, speeds=[4.0, 2.0, 4.0]),
        serving("c", 2, speeds=[4.0, 3.0, 4.0]),
    ):
        registry.announce(a)  # stage 1 has lost its last replica

    async def twice() -> tuple[dict[int, str], dict[int, str]]:
        return await mover.refill([1]), await mover.refill([1])

    first, again = asyncio.run(twice())
    assert first == again == {1: "moving c from stage 2 (a spare replica)"}
    assert moves.labels(job="j")._value.get() == 1.0  # one move, not one a look
    assert assignments.on_the_way("j", 3) == [[], ["c"], []]
    registry.announce(serving("c", 1, speeds=[4.0, 3.0, 4.0]))  # it serves there now
    assert assignments.on_the_way("j", 3) == [[], [], []]
    assert asyncio.run(mover.refill([])) == {}


def test_a_standby_is_no_replica_to_give_its_stage_a_spare() -> None:
    # Issue 67: stage 2's second peer, c, stands by (serves nothing). Moving b to the empty
    # stage would leave stage 2 with no replica: it has no spare, and none is moved (seen in
    # test_standby: the stage's standby then took it over, a promotion nobody asked for). Nor is
    # the standby itself moved: it holds its own stage's state.
    registry, assignments, _, moves = _scheduler()
    _stage_1_lost(registry)
    mover = Mover("j", 3, RebalanceConfig(), assignments, moves, 1, lambda: {"c"})
    assert asyncio.run(mover.refill([1])) == {}
    assert assignments.on_the_way("j", 3) == [[], [], []]
    assert moves.labels(job="j")._value.get() == 0.0


def test_an_idle_peer_goes_first_and_no_spare_leaves_the_remedy() -> None:
    registry, assignments, mover, moves = _scheduler()
    _stage_1_lost(registry)
    registry.announce(_joining("idle", [1.0, 1.0, 1.0]))
    assert asyncio.run(mover.refill([1])) == {1: "giving it to idle peer idle"}
    assert assignments.on_the_way("j", 3) == [[], ["idle"], []]
    assert moves.labels(job="j")._value.get() == 0.0  # no replica moved: none lost redundancy
    # With moves switched off ([rebalance] enabled = false) and no idle peer: no plan, so the
    # stall's remedy stays "start a stage server".
    registry, _, mover, moves = _scheduler(enabled=False)
    _stage_1_lost(registry)
    assert asyncio.run(mover.refill([1])) == {}


def test_a_peer_placement_sent_to_the_empty_stage_is_what_the_stall_says() -> None:
    # A peer that joined was placed on the empty stage (by the placement loop) before the watch
    # asked: the stall says it is coming instead of moving a replica too.
    registry, assignments, mover, moves = _scheduler()
    _stage_1_lost(registry)
    registry.announce(_joining("new", [1.0, 1.0, 1.0]))
    asyncio.run(assignments.assign("j", "new", 1))
    assert asyncio.run(mover.refill([1])) == {1: "giving it to new (joining)"}
    assert moves.labels(job="j")._value.get() == 0.0


def test_an_idle_peer_that_refuses_the_stage_is_said_at_once_not_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The idle peer sent to the empty stage fails to build it (out of memory) and announces
    itself free, refusing the job: the stall said "giving it to idle peer idle" until the serve
    timeout ran out, though it would never serve (a review found it). Its refusal is said at
    once, and the next idle peer is sent (no spare replica moves: rebalancing off)."""
    registry, assignments, mover, _ = _scheduler(enabled=False)
    _stage_1_lost(registry)
    registry.announce(_joining("idle", [1.0, 1.0, 1.0]))
    assert asyncio.run(mover.refill([1])) == {1: "giving it to idle peer idle"}
    why = "building stage 1 failed (OutOfMemoryError: CUDA out of memory)"
    registry.announce(cpb.PeerAnnouncement(peer="idle", refused_job="j", refused=why))
    assert asyncio.run(mover.refill([1])) == {}
    said = f'idle, sent to it, refused the job: "{why}"'
    assert mover.refused == {1: said}
    assert f"job j: stage 1 has no replica: {said}" in caplog.text  # at WARNING
    assert assignments.on_the_way("j", 3) == [[], [], []]  # not waited for either
    registry.announce(_joining("other", [1.0, 1.0, 1.0]))
    assert asyncio.run(mover.refill([1])) == {1: "giving it to idle peer other"}
    assert mover.refused == {}  # another is on its way: the refusal is no news
    assert asyncio.run(mover.refill([])) == {} and mover.refused == {}


def test_a_spare_that_refuses_the_stage_is_followed_by_the_next_after_the_timeout_only() -> None:
    """A spare replica moved to the empty stage refuses it (the stage does not fit such a peer)
    and leaves the job with its old stage. Sent on at the next look, the next spare would go
    the same way at once, and the next: one is moved a `serve_timeout_s`, as before."""
    clock = FakeClock()
    registry, _, mover, moves = _scheduler(clock=clock)
    for peer, stage in (("a", 0), ("b", 2), ("c", 2), ("d", 2)):
        registry.announce(serving(peer, stage, speeds=[5.0, 5.0, 5.0]))
    first = asyncio.run(mover.refill([1]))
    assert list(first) == [1] and first[1].startswith("moving ")
    sent = first[1].split()[1]
    registry.announce(cpb.PeerAnnouncement(peer=sent, refused_job="j", refused="no room"))
    assert asyncio.run(mover.refill([1])) == {}  # said, and no second spare moved yet
    assert 1 in mover.refused and moves.labels(job="j")._value.get() == 1.0
    clock.advance(61.0)  # the serve timeout (60 s) since the refusal
    again = asyncio.run(mover.refill([1]))
    assert list(again) == [1] and sent not in again[1], again
    assert moves.labels(job="j")._value.get() == 2.0 and mover.refused == {}


def test_joining_peers_fill_the_short_stage_once_counting_those_on_their_way() -> None:
    # min_replicas = 2; stage 1 has one replica. The first peer to join goes there (though stage
    # 0 is the bottleneck); the second, joining before the first serves, goes by throughput.
    registry, assignments, _, _ = _scheduler(min_replicas=2)
    for a in (
        serving("a", 0, speeds=[1.0, 1.0, 1.0]),
        serving("b", 0, speeds=[1.0, 1.0, 1.0]),
        serving("c", 1, speeds=[5.0, 5.0, 5.0]),
        serving("d", 2, speeds=[5.0, 5.0, 5.0]),
        serving("e", 2, speeds=[5.0, 5.0, 5.0]),
    ):
        registry.announce(a)

    def sent_to(peer: str) -> int | None:
        return next((k for k, ps in enumerate(assignments.on_the_way("j", 3)) if peer in ps), None)

    async def join(peer: str) -> int | None:
        registry.announce(_joining(peer, [3.0, 3.0, 3.0]))
        grow = asyncio.create_task(assignments.grow("j", 3, [], 2))
        try:
            async with asyncio.timeout(10):
                while sent_to(peer) is None:
                    assignments.changed.set()  # as an announcement does
                    await asyncio.sleep(0.01)
        finally:
            grow.cancel()
        return sent_to(peer)

    assert asyncio.run(join("x")) == 1  # redundancy first
    assert asyncio.run(join("y")) == 0  # stage 1 has its two, x counted: the bottleneck next
