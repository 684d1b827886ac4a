"""The peer registry: what the scheduler knows of each peer from its announcements and load reports.

Pure state, no I/O: `Scheduler` feeds it what arrives on the bus (`announce`, `report_load`) and the
assignments it publishes (`assigned`); time comes from an injected `Clock`. It answers who serves
each stage of a job (`members`, `serving`), who waits to be placed (`available`) and what each
member measurably does (`measured`, for rebalancing; `live_speed`, for status).

A serving peer whose load reports stop for `load_silence_s` is left out of `members` (hung, or cut
off from the broker while its last-will has not fired yet); one that reports again is back. A peer
that has sent no report for the job yet is timed from when it was first seen serving the job: one
that hangs before its first report (a second after it began) is left out as any other. A peer
that announces itself offline is forgotten entirely, so the registry holds only present peers;
only the stage it was last given stays (`given`): that assignment is retained on the broker, and
the peer acts on it when it comes back.

What the scheduler's dial-back found of each peer (`scheduler.reachability`) is kept here too
(`reached`): an UNREACHABLE peer is no member, serves nothing and is not placed; a RELAYED one is
dialled through its relay (`dial_address`: every call to it, the coordinator's and the trainers',
goes there). With `require_reachable` (the scheduler's) a peer not checked yet is not placed
either: its check takes two seconds. A serving peer not checked yet (the scheduler restarted)
counts meanwhile, at the address (or relay) it announces: it served until now.

A peer that says it serves is not yet a replica that counts: `shown` is each stage's peers as
`swarm status` and the gauges show them, serving only once the step coordinator admitted them
(their join succeeded), else joining with what they wait for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Container, Mapping
from dataclasses import dataclass

from scheduler.failure_domains import domains_of
from scheduler.own_link import OwnLink
from swarm.clock import Clock
from swarm.net import paths
from swarm.net.bandwidth import plausible_rates
from swarm.policy.domains import Domains
from swarm.policy.placement import path_speeds
from swarm.policy.speeds import MAX_SAMPLES_PER_SECOND, known_speed, plausible_speeds
from swarm.policy.window import plausible_capacity
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Replica

__all__ = ["UNREACHABLE_SHOWN", "PeerRegistry", "Shown"]

log = logging.getLogger(__name__)

UNREACHABLE_SHOWN = 3
"""The most unreachable peers a job's message or status names; the rest are counted."""


@dataclass(slots=True)
class _Load:
    """A peer's last load report: one peer serves one job, so one per peer."""

    job: str
    stage: int
    at: float  # clock time it arrived
    speed: float | None  # samples/s it measured on `stage`; None: not measured yet
    boundary: cpb.BoundaryTraffic | None = None  # what it sent across its boundaries (unset: None)
    capacity: int = 0  # microbatches its activation cache holds (`plausible_capacity`; 0: not said)


@dataclass(frozen=True, slots=True)
class Shown:
    """A peer of a job's stage as status shows it."""

    announcement: cpb.PeerAnnouncement
    stage: int
    state: cpb.PeerState  # SERVING only once admitted; JOINING until then
    joining: str  # while JOINING: what it waits for


class PeerRegistry:
    def __init__(
        self,
        clock: Clock,
        *,
        load_silence_s: float,
        serve_timeout_s: float,
        require_reachable: bool = False,
        link: Callable[[], bool] = lambda: True,
    ) -> None:
        """`serve_timeout_s`: a peer assigned a stage that still says JOINING after this long is
        available to be placed again; `require_reachable`: only peers a dial-back reached are
        placed (`reached`); `link()`: whether this process's own broker link is up (silences
        are not judged while it is down: `scheduler.own_link`)."""
        self.link = OwnLink(clock, link)
        self.require_reachable = require_reachable
        self._reach: dict[str, cpb.ReachabilityReport] = {}  # peer -> its last dial-back
        self.clock = clock
        self.load_silence_s = load_silence_s
        self.serve_timeout_s = serve_timeout_s
        self.peers: dict[str, cpb.PeerAnnouncement] = {}  # present peers' last announcement
        self._loads: dict[str, _Load] = {}
        # peer -> (job, when) of its last assignment, until it serves or leaves: a peer building
        # its stage still says JOINING, and must not be assigned again (perhaps elsewhere).
        self._assigned_at: dict[str, tuple[str, float]] = {}
        self._unplaceable: set[str] = set()  # peers already warned about
        self._implausible: set[str] = set()  # peers already warned about their link rates
        self._implausible_speeds: set[str] = set()  # ... about their compute speeds
        # peer -> (job, when) it was first seen serving that job: a member's silence is timed
        # from there until its first load report for the job.
        self._serving_since: dict[str, tuple[str, float]] = {}
        self._silent_logged: set[str] = set()  # silent peers already logged as such
        # peer -> (job, stage) it was last given: kept when it leaves (the assignment is retained
        # on the broker, and a peer that comes back builds that stage), until the job lets go.
        self._given: dict[str, tuple[str, int]] = {}
        # peer -> the relay it was last reached through (or announced): kept while the peer is
        # present, so a stage cut off by its relay's death can say which relay (`lost_relays`)
        self._via: dict[str, str] = {}

    # -- what arrives -----------------------------------------------------------------------------
    def announce(self, message: cpb.PeerAnnouncement) -> None:
        peer = message.peer
        if not peer:
            return
        if message.state == cpb.PEER_STATE_OFFLINE:
            self.forget(peer)
            return
        message = self._plausible(message)
        self.peers[peer] = message
        if message.relay:
            self._via[peer] = message.relay
        if message.state != cpb.PEER_STATE_JOINING:  # serving, moving, or gone
            self._assigned_at.pop(peer, None)
        if message.state != cpb.PEER_STATE_SERVING:
            self._serving_since.pop(peer, None)
        elif self._serving_since.get(peer, ("", 0.0))[0] != message.job:
            self._serving_since[peer] = (message.job, self.clock.now())

    def _plausible(self, message: cpb.PeerAnnouncement) -> cpb.PeerAnnouncement:
        """The announcement as the registry keeps it: its speeds (placement divides by them) and
        link rates (every pool's parts are sized by them) within their ceilings, where they
        enter; each logged once per peer."""
        message = plausible_speeds(message, self._implausible_speeds)
        return plausible_rates(message, self._implausible)

    def report_load(self, message: cpb.LoadReport) -> None:
        """A load report; from a peer not (or no longer) present it is ignored."""
        if message.peer not in self.peers:
            return
        seconds = message.ema_seconds_per_sample
        old = self._loads.get(message.peer)
        speed = min(1.0 / seconds, MAX_SAMPLES_PER_SECOND) if seconds > 0 else None
        same = old is not None and (old.job, old.stage) == (message.job, message.stage)
        if speed is None and old is not None and same:
            speed = old.speed  # a report without a figure keeps the last one
        boundary = message.boundary if message.HasField("boundary") else None
        # what it holds sizes trainers' windows: believed only within a ceiling, where it enters
        held = plausible_capacity(message.activation_capacity)
        self._loads[message.peer] = _Load(
            message.job, message.stage, self.clock.now(), speed, boundary, held
        )

    def reached(self, report: cpb.ReachabilityReport) -> None:
        """What the dial-back found of a present peer (one that left meanwhile is ignored)."""
        if report.peer in self.peers:
            self._reach[report.peer] = report
            if report.reachability == cpb.REACHABILITY_RELAYED and report.relay:
                self._via[report.peer] = report.relay

    def reachability(self, peer: str) -> cpb.ReachabilityReport | None:
        """`peer`'s last dial-back; None: not checked yet."""
        return self._reach.get(peer)

    def dial_address(self, p: cpb.PeerAnnouncement) -> str:
        """Where a call to `p` goes: through its relay when the dial-back reached it there (or,
        not checked yet, when it announces one), else (or where its announcement names no
        relayed address: `paths.relayable`) its announced address."""
        report = self._reach.get(p.peer)
        if report is not None and report.reachability == cpb.REACHABILITY_RELAYED:
            # The relay it announces now first: its relay died and it re-attached to that one
            # (checked again at once, but calls meanwhile would go to the dead one).
            return paths.relayable(p.peer, p.address, p.relay or report.relay) or p.address
        if (report is None or report.reachability == cpb.REACHABILITY_UNKNOWN) and p.relay:
            return paths.relayable(p.peer, p.address, p.relay) or p.address
        return p.address

    def relayed(self, peer: str) -> bool:
        """Whether calls to `peer` go through a relay (placement discounts its throughput)."""
        p = self.peers.get(peer)
        return p is not None and self.dial_address(p) != p.address

    def domains(self) -> dict[str, Domains]:
        """Each present peer's failure domains (`scheduler.failure_domains`), for placement."""
        return {p: domains_of(a, self.relayed(p)) for p, a in list(self.peers.items())}

    def unreachable(self, job_id: str) -> list[cpb.ReachabilityReport]:
        """The dial-backs of the peers nobody can dial among `job_id`'s (joining or serving it)
        and those free for any job (no job yet): the job's own first, by peer id (a crowd of free
        ones fills none of the `UNREACHABLE_SHOWN` a status names)."""
        return [
            self._reach[p.peer]
            for p in sorted(self.peers.values(), key=lambda p: (p.job != job_id, p.peer))
            if p.job in (job_id, "") and self.is_unreachable(p.peer)
        ]

    def lost_relays(self, job_id: str, stages: Collection[int]) -> dict[int, str]:
        """Of `stages` of `job_id`, those whose every peer (one at least) is cut off by its
        relay's loss, with that relay: it was reached through the relay, no present peer
        announces that relay any longer, and nothing reaches the peer another way now. For
        such a stage the missing piece is the relay, not a stage server."""
        present = {a.relay_address for a in self.peers.values() if a.relay_address}
        lost: dict[int, list[str]] = {}
        for p in self.peers.values():
            if p.job != job_id or not p.HasField("stage") or p.stage not in stages:
                continue
            via, report = self._via.get(p.peer, ""), self._reach.get(p.peer)
            reached = report is not None and report.reachability == cpb.REACHABILITY_DIRECT
            cut_off = bool(via) and via not in present and not reached
            lost.setdefault(p.stage, []).append(via if cut_off else "")  # "": not the relay's
        return {k: ", ".join(sorted(set(v))) for k, v in lost.items() if v and all(v)}

    def is_unreachable(self, peer: str) -> bool:
        """Whether the dial-back found nothing answering at `peer`'s address (nor its relay)."""
        report = self._reach.get(peer)
        return report is not None and report.reachability == cpb.REACHABILITY_UNREACHABLE

    def _placeable(self, peer: str) -> bool:
        """Whether `peer` may be given work: not unreachable, and checked if that is required."""
        report = self._reach.get(peer)
        if report is None or report.reachability == cpb.REACHABILITY_UNKNOWN:
            return not self.require_reachable
        return report.reachability != cpb.REACHABILITY_UNREACHABLE

    def assigned(self, peer: str, job_id: str, stage: int | None = None) -> None:
        """The scheduler gave `peer` `stage` of `job_id` just now."""
        self._assigned_at[peer] = (job_id, self.clock.now())
        if stage is not None:
            self._given[peer] = (job_id, stage)

    def placed(self, peer: str) -> bool:
        """Whether the scheduler gave `peer` work it may hold, by its own records (never the
        peer's word): a stage now or before (kept while its job lets it), or an assignment it
        has not acted on yet."""
        return peer in self._given or peer in self._assigned_at

    def given(self, job_id: str, peer: str) -> int | None:
        """The stage of `job_id` last given to `peer` (None: none), even if it left since."""
        job, stage = self._given.get(peer, ("", -1))
        return stage if job == job_id else None

    def withdrawn(self, job_id: str) -> None:
        """`job_id` ended: its assignments are cleared from the broker."""
        self._given = {p: g for p, g in self._given.items() if g[0] != job_id}

    def forget(self, peer: str) -> None:
        """`peer` left: drop everything kept about it."""
        self.peers.pop(peer, None)
        self._loads.pop(peer, None)
        self._assigned_at.pop(peer, None)
        self._unplaceable.discard(peer)
        self._implausible.discard(peer)
        self._implausible_speeds.discard(peer)
        self._serving_since.pop(peer, None)
        self._silent_logged.discard(peer)
        self._reach.pop(peer, None)
        self._via.pop(peer, None)

    # -- what it answers --------------------------------------------------------------------------
    def largest_memory(self) -> tuple[int, str]:
        """The most memory a present peer announced (bytes) and that peer; (0, "") when none
        said. The largest: a peer that understates its own cannot lower the bound for others."""
        return max(((a.memory_bytes, p) for p, a in self.peers.items()), default=(0, ""))

    def members(self, job_id: str, stages: int) -> list[list[Replica]]:
        """Per stage, the peers serving it for this job, in a stable order (peer id), each at its
        `dial_address`; an unreachable one is none."""
        result: list[list[Replica]] = [[] for _ in range(stages)]
        for p in sorted(self.peers.values(), key=lambda p: p.peer):
            if (
                p.job == job_id
                and p.state == cpb.PEER_STATE_SERVING
                and p.HasField("stage")
                and p.stage < stages
                and not self.is_unreachable(p.peer)
                and not self._silent(job_id, p.peer)
            ):
                speed = known_speed(p.samples_per_second.get(p.stage, 0.0))  # into leases, routes
                held = self.capacity(p.peer, job_id, p.stage)
                result[p.stage].append(Replica(p.peer, self.dial_address(p), speed, held))
        return result

    def shown(
        self,
        job_id: str,
        admitted: Collection[str] | None,
        waits: Mapping[str, str] | None = None,
        stages: int | None = None,
        standbys: Collection[str] = (),
    ) -> list[Shown]:
        """The job's peers on its stages as status shows them: `admitted`, the coordinator's
        members (None: no coordinator, nobody is admitted); `waits`, what each joining one
        waits for (the coordinator's words); `standbys`, the coordinator's (STANDBY, with its
        words). Safe on another thread (the metrics')."""
        waits = waits or {}
        now, result = self.clock.now(), []
        for p in sorted(list(self.peers.values()), key=lambda p: p.peer):
            if p.job != job_id:
                continue
            stage = p.stage if p.HasField("stage") else None
            state, joining = p.state, ""
            if p.state == cpb.PEER_STATE_SERVING and stage is not None:
                if admitted is not None and p.peer in admitted:
                    pass
                elif admitted is None:
                    state, joining = cpb.PEER_STATE_JOINING, "waiting for training to start"
                else:
                    standby = p.peer in standbys
                    state = cpb.PEER_STATE_STANDBY if standby else cpb.PEER_STATE_JOINING
                    joining = waits.get(p.peer) or (
                        "its load reports stopped"
                        if self.quiet(job_id, p.peer) > self.load_silence_s
                        else "waiting for a step's end to download state from a member"
                    )
            elif p.state == cpb.PEER_STATE_JOINING:
                job, at = self._assigned_at.get(p.peer, ("", 0.0))
                stage = self.given(job_id, p.peer)
                if stage is None or job != job_id or now - at >= self.serve_timeout_s:
                    continue  # not placed (or it gave up): not on a stage
                joining = f"building stage {stage} (assigned {now - at:.0f} s ago)"
            if stage is None or (stages is not None and stage >= stages):
                continue
            result.append(Shown(p, stage, state, joining))
        return result

    def serving(self, job_id: str, barred: Container[str] = ()) -> dict[int, str]:
        """Per stage, the dial address of the fastest replica serving it (not an unreachable
        one, it serves nobody; nor one `barred`: banned from the job, it is no replica)."""
        best: dict[int, tuple[float, str]] = {}
        for p in self.peers.values():
            serves = p.job == job_id and p.state == cpb.PEER_STATE_SERVING and p.HasField("stage")
            if serves and not self.is_unreachable(p.peer) and p.peer not in barred:
                speed = known_speed(p.samples_per_second.get(p.stage, 0.0))  # an inf is no fastest
                if p.stage not in best or speed > best[p.stage][0]:
                    best[p.stage] = (speed, self.dial_address(p))
        return {k: address for k, (_, address) in best.items()}

    def available(self, job_id: str, stages: int) -> dict[str, list[float]]:
        """Joining peers measured for this job, not building a stage they were given, and
        `_placeable` (reached by a dial-back): their samples/s per stage. A peer whose figures
        cannot be placed (not finite, negative, none positive) is left out, with a log line."""
        available = {}
        now = self.clock.now()
        for p in self.peers.values():
            if not (
                p.state == cpb.PEER_STATE_JOINING
                and p.job == job_id
                and all(k in p.samples_per_second for k in range(stages))
            ):
                continue
            job, assigned_at = self._assigned_at.get(p.peer, ("", 0.0))
            if job == job_id and now - assigned_at < self.serve_timeout_s:
                continue  # building the stage it was given
            if not self._placeable(p.peer):
                continue  # no work down a path nobody can dial (`unreachable` says why)
            speeds = [p.samples_per_second[k] for k in range(stages)]
            for k in range(stages):  # where the swarm measured it, that, not its word
                load = self._load_at(p.peer, job_id, k)
                speeds[k] = load.speed if load is not None and load.speed else speeds[k]
            if all(math.isfinite(v) and v >= 0.0 for v in speeds) and max(speeds) > 0.0:
                available[p.peer] = speeds
            elif p.peer not in self._unplaceable:
                self._unplaceable.add(p.peer)
                log.warning("peer %s announced unusable speeds %s: not placed", p.peer, speeds)
        return available

    def measured(
        self, job_id: str, stages: int, leave_out: Collection[str] = ()
    ) -> tuple[dict[str, int], dict[str, list[float]]] | None:
        """The job's members as rebalancing sees them: each one's stage, and its samples/s on
        every stage (measured where it serves, announced elsewhere; a relayed one's at its path's
        price, `placement.path_speeds`, as placement counts it: its compute was measured, not its
        relay). None until every member has reported a measurement on its stage: decide on
        measured throughput only. `leave_out`: peers that serve no work (standbys)."""
        members = self.members(job_id, stages)
        assignment = {
            r.peer: k for k, reps in enumerate(members) for r in reps if r.peer not in leave_out
        }
        speeds: dict[str, list[float]] = {}
        for peer, k in assignment.items():
            load = self._loads.get(peer)
            if load is None or load.speed is None or (load.job, load.stage) != (job_id, k):
                return None
            announced = self.peers[peer].samples_per_second
            speeds[peer] = [announced.get(j, 0.0) for j in range(stages)]
            speeds[peer][k] = load.speed  # what it really does where it is now
        return assignment, path_speeds(speeds, {p: None for p in speeds if self.relayed(p)})

    def _load_at(self, peer: str, job_id: str, stage: int) -> _Load | None:
        """`peer`'s last load report, if it was for `stage` of `job_id`."""
        load = self._loads.get(peer)
        return load if load is not None and (load.job, load.stage) == (job_id, stage) else None

    def boundary(self, peer: str, job_id: str, stage: int) -> cpb.BoundaryTraffic | None:
        """What `peer` sent across `stage`'s boundaries of `job_id`, as its last load report
        there said; None: no report there said it."""
        load = self._load_at(peer, job_id, stage)
        return load.boundary if load is not None else None

    def capacity(self, peer: str, job_id: str, stage: int) -> int:
        """Microbatches `peer`'s activation cache holds on `stage` of `job_id`, as its last load
        report there said (within `MAX_ANNOUNCED_CAPACITY`); 0: not said."""
        load = self._load_at(peer, job_id, stage)
        return load.capacity if load is not None else 0

    def live_speed(self, peer: str, job_id: str, stage: int) -> float:
        """`peer`'s samples/s on `stage` of `job_id` as status shows it: what its load reports
        measure now (the moving average of its recent compute, the wiring's figure), else,
        before its first report there, what it measured at join (its announcement); 0: none."""
        load = self._load_at(peer, job_id, stage)
        if load is not None and load.speed is not None:
            return load.speed
        p = self.peers.get(peer)
        return p.samples_per_second.get(stage, 0.0) if p is not None else 0.0

    def quiet(self, job_id: str, peer: str) -> float:
        """Seconds since `peer`'s last load report for this job, or, before its first, since it
        was first seen serving the job (0: neither), or since this process's own broker link
        last came up, whichever was last."""
        load = self._loads.get(peer)
        if load is not None and load.job == job_id:
            at = load.at
        else:
            since = self._serving_since.get(peer)
            if since is None or since[0] != job_id:
                return 0.0
            at = since[1]  # no report for the job yet
        up = self.link.since()  # nobody is heard while this process's own link is down
        return 0.0 if up is None else max(0.0, self.clock.now() - max(at, up))

    def _silent(self, job_id: str, peer: str) -> bool:
        """Whether `peer` has been quiet for longer than `load_silence_s` (`quiet`)."""
        quiet = self.quiet(job_id, peer)
        if quiet <= self.load_silence_s:
            self._silent_logged.discard(peer)
            return False
        if peer not in self._silent_logged:  # hung, or cut off: not a member
            self._silent_logged.add(peer)
            log.warning(
                "job %s: %s's load reports stopped %.0fs ago; leaving it out", job_id, peer, quiet
            )
        return True
