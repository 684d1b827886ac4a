"""What a job waiting for peers says of the peers present that placement cannot take (yet):
those still measuring it, those another job holds, those nobody can dial, and those that say
they refused the job (`scheduler.assignments`' waiting message; `scheduler.no_shows` and
`scheduler.build_crashes` say theirs). Each is the peer's state as the registry holds it, named
and bounded: a crowd is counted, not listed. Without them the message asked for more stage
servers where the ones there were measuring, or busy with another job."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from scheduler.registry import UNREACHABLE_SHOWN, PeerRegistry
from swarm.ops.printable import quoted
from swarm.proto import control_pb2 as cpb

__all__ = ["REFUSALS_SHOWN", "Present", "refusal", "refused_words", "unreachable_words"]

REFUSALS_SHOWN = 3  # the peers' refusals a job's waiting message names at most (others counted)
JOBS_SHOWN = 3  # the other jobs holding stage servers a job's waiting message names at most


@dataclass(frozen=True)
class Present:
    """The stage servers present that are not (yet) measured for a job: free ones still
    measuring it (`measuring`: a free one announces its figures once measured, until then it
    may be measuring this job or another), and those other jobs hold (`held`, by job: measured
    for it, or serving it; a stage server takes one job at a time, until that job ends)."""

    measuring: int
    held: Counter[str]

    @classmethod
    def of(cls, registry: PeerRegistry, job_id: str, stages: int) -> Present:
        measuring, held = 0, Counter[str]()
        for p in registry.peers.values():
            if p.role != cpb.PEER_ROLE_STAGE_SERVER or registry.is_unreachable(p.peer):
                continue
            if refusal(p, job_id) is not None:  # named with its refusal (`refused_words`)
                continue
            if p.job in ("", job_id) and p.state == cpb.PEER_STATE_JOINING:
                measuring += not all(k in p.samples_per_second for k in range(stages))
            elif p.job not in ("", job_id):
                held[p.job] += 1
        return cls(measuring, held)

    def words(self) -> str:
        """What the job's waiting message adds ("" when nobody is present but those placed)."""
        said = []
        if self.measuring:
            said.append(
                f"{self.measuring} free stage server(s) not measured yet (measuring, or about to)"
            )
        if self.held:
            # quoted: a job's id here is what a peer announced (any token holder's, any text)
            held = self.held.most_common(JOBS_SHOWN)
            jobs = ", ".join(f"{n} by job {quoted(job)}" for job, n in held)
            more = len(self.held) - JOBS_SHOWN
            jobs += f" (and {more} more job(s))" if more > 0 else ""
            said.append(
                f"{self.held.total()} stage server(s) held by other jobs ({jobs}): a stage server "
                "takes one job at a time, until that job ends (`swarm cancel JOB` ends one)"
            )
        return f"; present: {'; '.join(said)}" if said else ""


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


def refusal(announced: cpb.PeerAnnouncement | None, job_id: str) -> str | None:
    """Why the peer so announced refused `job_id` (its words: measuring it or building a stage
    of it failed), or None: it says no refusal of the job, or has taken the job up since."""
    if announced is None or announced.job == job_id or announced.refused_job != job_id:
        return None
    return announced.refused or None


def refused_words(registry: PeerRegistry, job_id: str) -> str:
    """The peers that say they refused the job, with why ("" when none): a server is there,
    and its own log alone said why it is not measured."""
    refusals = sorted(  # the peer's word, said as such
        (p, why) for p, a in registry.peers.items() if (why := refusal(a, job_id)) is not None
    )
    if not refusals:
        return ""
    # At most a few, each quoted and escaped: any token holder's peer may say it refused
    # any job, and the job's message is stored, logged and sent with its status; within
    # its quotes a peer's words cannot pass for the scheduler's ("; left out after ...").
    said = "; ".join(f"{peer}: {quoted(why)}" for peer, why in refusals[:REFUSALS_SHOWN])
    more = len(refusals) - REFUSALS_SHOWN
    return f"; refused by {said}" + (f" (and {more} more)" if more > 0 else "")
