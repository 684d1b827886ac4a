"""One replica as `swarm status` shows it (`spb.Replica`): what it announced, its samples/s as its
load reports measure it now (not the figure it measured at join), its state as the
coordinator sees it, and its path as the scheduler's dial-back found it (direct, relayed through
a relay, or unreachable with why and the remedy) with its measured link rates and what it sent
across its stage's boundaries (its load reports say), and since when a serving one stopped
reporting (a pulled router shows at once); and the job's peers nobody can dial, which
are on no stage (never placed), as warnings."""

from __future__ import annotations

import time
from collections.abc import Callable

from scheduler.registry import UNREACHABLE_SHOWN, PeerRegistry, Shown
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb

__all__ = ["REPORT_GAP_S", "replica_status", "unreachable_warnings"]

# A serving peer reports its load every second: this long without one (several missed: a pulled
# router), status says since when, rather than show it `serving` until the coordinator drops it
# at `load_silence_s` (issue 68 item 3).
REPORT_GAP_S = 3.0


def replica_status(
    shown: Shown, registry: PeerRegistry, wall: Callable[[], float] = time.time
) -> spb.Replica:
    """`wall`: the time of day, to say since when a serving replica has been silent."""
    p = shown.announcement
    quiet = registry.quiet(p.job, p.peer) if shown.state == cpb.PEER_STATE_SERVING else 0.0
    silent = quiet if quiet > REPORT_GAP_S else 0.0
    report = registry.reachability(p.peer)
    reachability = report.reachability if report is not None else cpb.REACHABILITY_UNKNOWN
    detail = ""
    if report is not None and reachability == cpb.REACHABILITY_UNREACHABLE:
        detail = f"{report.detail}: {report.remedy}" if report.remedy else report.detail
    return spb.Replica(
        peer=p.peer,
        address=p.address,
        metrics_address=p.metrics_address,
        device=p.device,
        state=shown.state,
        samples_per_second=registry.live_speed(p.peer, p.job, shown.stage),
        joining=shown.joining,
        reachability=reachability,
        relay=report.relay if report is not None else "",
        reachability_detail=detail,
        upload_bytes_per_second=p.upload_bytes_per_second,
        download_bytes_per_second=p.download_bytes_per_second,
        boundary=registry.boundary(p.peer, p.job, shown.stage),
        activation_capacity=registry.capacity(p.peer, p.job, shown.stage),
        silent_since=wall() - silent if silent else 0.0,
    )


def unreachable_warnings(registry: PeerRegistry, job_id: str) -> list[str]:
    """A warning for each of `job_id`'s peers a dial-back could not reach: it is placed nowhere,
    so no stage shows it; this says why, and what fixes it. At most `UNREACHABLE_SHOWN`, then
    one line counting the rest (a crowd of them made each status tens of MB)."""
    reports = registry.unreachable(job_id)
    lines = [
        f"peer {r.peer} is UNREACHABLE at {r.address} ({r.detail}), so it is not placed: {r.remedy}"
        for r in reports[:UNREACHABLE_SHOWN]
    ]
    more = len(reports) - len(lines)
    said = f"{more} more peer is UNREACHABLE" if more == 1 else f"{more} more peers are UNREACHABLE"
    return lines + ([said] if more > 0 else [])
