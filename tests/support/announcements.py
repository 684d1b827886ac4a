"""Peer announcements as the scheduler's registry takes them, for its unit tests."""

from __future__ import annotations

from collections.abc import Sequence

from swarm.proto import control_pb2 as cpb

__all__ = ["serving"]


def serving(
    peer: str, stage: int, job: str = "j", speeds: Sequence[float] = (2.0, 3.0)
) -> cpb.PeerAnnouncement:
    """`peer` serving `stage` of `job`, measured at `speeds` (samples/s per stage)."""
    return cpb.PeerAnnouncement(
        peer=peer,
        address=f"{peer}:1",
        job=job,
        stage=stage,
        state=cpb.PEER_STATE_SERVING,
        samples_per_second=dict(enumerate(speeds)),
    )
