"""A scheduler's placement over a registry on a fake clock, for the unit tests of what it gives
peers (`scheduler.assignments`): no bus (assignments are published nowhere), no grace."""

from __future__ import annotations

from scheduler.assignments import Assignments
from scheduler.registry import PeerRegistry
from swarm.clock import FakeClock
from swarm.proto import control_pb2 as cpb
from tests.support.fakes import SilentBus

__all__ = ["measured", "placement"]


def placement(
    clock: FakeClock, serve_timeout_s: float, said: list[str] | None = None
) -> tuple[PeerRegistry, Assignments]:
    """The registry and the placement reading it; what placement says of its jobs is appended
    to `said`, when given."""
    registry = PeerRegistry(clock, load_silence_s=1e9, serve_timeout_s=serve_timeout_s)

    async def say(job: str, text: str) -> None:
        if said is not None:
            said.append(text)

    assignments = Assignments(
        registry,
        SilentBus(),
        say,
        grace_s=0.0,
        serve_timeout_s=serve_timeout_s,
        lost_stage_grace_s=0.0,
    )
    return registry, assignments


def measured(
    peer: str, incarnation: str = "1", speeds: dict[int, float] | None = None
) -> cpb.PeerAnnouncement:
    """`peer` free and measured for job "j" (by default of one stage, 5 samples/s): one
    placement takes."""
    return cpb.PeerAnnouncement(
        peer=peer,
        address=f"{peer}:1",
        job="j",
        state=cpb.PEER_STATE_JOINING,
        samples_per_second=speeds or {0: 5.0},
        incarnation=incarnation,
    )
