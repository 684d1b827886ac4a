"""Compute speeds as peers announce them (samples/s per stage, measured at join): what placement
divides by, so the scheduler keeps only plausible ones (issue 64, item 2), as it does link rates
(`swarm.net.bandwidth.plausible_rate`) and capacities (`swarm.policy.window.plausible_capacity`).

Two peers announcing 1e308 samples/s made placement's prices overflow and divide by zero, outside
the job loop's retry: the job failed within two seconds. Each announced speed is now taken within
`MAX_SAMPLES_PER_SECOND` (past it: the ceiling; one not finite or negative leaves its peer out, as
before), and where the swarm measured a peer on a stage its measurement stands instead
(`scheduler.registry.PeerRegistry.available`).
"""

from __future__ import annotations

import logging
import math

from swarm.proto import control_pb2 as cpb

__all__ = ["MAX_SAMPLES_PER_SECOND", "known_speed", "plausible_speed", "plausible_speeds"]

# A stage's samples/s no real peer reaches (a tiny model's stage on a fast GPU does some 10^4):
# any placement's sums of speeds stay far from overflow, and a liar's share is bounded.
MAX_SAMPLES_PER_SECOND = 1e6

log = logging.getLogger(__name__)


def plausible_speed(value: float) -> float:
    """An announced samples/s as placement takes it: at most `MAX_SAMPLES_PER_SECOND`. One not
    finite or negative is kept as it is: `PeerRegistry.available` leaves such a peer out."""
    return (
        MAX_SAMPLES_PER_SECOND if math.isfinite(value) and value > MAX_SAMPLES_PER_SECOND else value
    )


def known_speed(speed: float) -> float:
    """An announced samples/s where a serving replica's is used as one (a lease, a push's route,
    the fastest source): itself, or 0 (unknown) where it is none (NaN, infinite, negative:
    `plausible_speed` keeps those for `PeerRegistry.available` to refuse a joiner; a serving
    peer's went into every lease of its stage, and a route refuses them: `check_route`)."""
    return speed if math.isfinite(speed) and speed >= 0.0 else 0.0


def plausible_speeds(message: cpb.PeerAnnouncement, warned: set[str]) -> cpb.PeerAnnouncement:
    """`message` with each of its speeds (stage -> samples/s) `plausible_speed`: itself when all
    already are, else a copy (logged once per peer: `warned`, the peers already logged)."""
    announced = dict(message.samples_per_second)
    if all(plausible_speed(v) == v or math.isnan(v) for v in announced.values()):
        return message
    speeds = {k: plausible_speed(v) for k, v in announced.items()}
    if message.peer in warned:
        return _kept(message, speeds)
    warned.add(message.peer)
    log.warning(
        "peer %s announced speeds %s samples/s: taken as %s (within %g)",
        message.peer,
        announced,
        speeds,
        MAX_SAMPLES_PER_SECOND,
    )
    return _kept(message, speeds)


def _kept(message: cpb.PeerAnnouncement, speeds: dict[int, float]) -> cpb.PeerAnnouncement:
    kept = cpb.PeerAnnouncement()
    kept.CopyFrom(message)
    kept.samples_per_second.clear()
    kept.samples_per_second.update(speeds)
    return kept
