"""What a job waiting for peers says of the peers present that placement cannot take: those
nobody can dial, and those that say they refused the job (`scheduler.assignments`' waiting
message; `scheduler.no_shows` and `scheduler.build_crashes` say theirs). Each is the peer's
state as the registry holds it, named and bounded: a crowd is counted, not listed."""

from __future__ import annotations

from scheduler.registry import UNREACHABLE_SHOWN, PeerRegistry
from swarm.ops.printable import quoted

__all__ = ["REFUSALS_SHOWN", "refused_words", "unreachable_words"]

REFUSALS_SHOWN = 3  # the peers' refusals a job's waiting message names at most (others counted)


def unreachable_words(registry: PeerRegistry, job_id: str) -> str:
    """The job's peers nobody can dial, with why and the remedy ("" when none): they wait
    too, but a dial-back found no path to them, and none serves until that is fixed."""
    reports = registry.unreachable(job_id)
    if not reports:
        return ""
    shown = reports[:UNREACHABLE_SHOWN]  # a crowd of them is counted (`UNREACHABLE_SHOWN`)
    who = "; ".join(f"{r.peer} at {r.address} ({r.detail})" for r in shown)
    more = len(reports) - len(shown)
    who += f" (and {more} more)" if more > 0 else ""
    return f"; not placed, UNREACHABLE: {who}: {reports[0].remedy}"


def refused_words(registry: PeerRegistry, job_id: str) -> str:
    """The peers that say they refused the job, with why ("" when none): a server is there,
    and its own log alone said why it is not measured."""
    refusals = sorted(
        (p, a.refused)
        for p, a in registry.peers.items()
        if a.refused_job == job_id and a.refused  # the peer's word, said as such
    )
    if not refusals:
        return ""
    # At most a few, each quoted and escaped: any token holder's peer may say it refused
    # any job, and the job's message is stored, logged and sent with its status; within
    # its quotes a peer's words cannot pass for the scheduler's ("; left out after ...").
    said = "; ".join(f"{peer}: {quoted(why)}" for peer, why in refusals[:REFUSALS_SHOWN])
    more = len(refusals) - REFUSALS_SHOWN
    return f"; refused by {said}" + (f" (and {more} more)" if more > 0 else "")
