"""The lease contract between the step coordinator and trainers: the work a trainer leases
(`Task`, in a `Lease` with the replicas serving each stage), what it reports back
(`MicrobatchResult`), their wire form, and the `LeaseSource` a trainer leases from (the coordinator
in-process, or the scheduler over gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from swarm.proto import scheduler_pb2 as spb

__all__ = [
    "ContributionAudit",
    "GradientDigest",
    "Lease",
    "LeaseSource",
    "MicrobatchResult",
    "Replica",
    "Task",
    "Verdict",
    "Working",
    "lease_from_proto",
    "lease_request",
    "lease_to_proto",
    "result_from_proto",
    "result_to_proto",
    "working_from_proto",
]


@dataclass(frozen=True)
class Task:
    """Run microbatch `(step, index)` and add its gradient at `stages` (all of them, unless this
    is a replay); or, `evaluate`, run validation microbatch `index` forward only and report its
    loss (the parameters of `step` are evaluated; nothing is accumulated)."""

    step: int
    index: int
    stages: frozenset[int]
    evaluate: bool = False
    # the step's contributions audited (issue 55): where one's replica accumulates this
    # microbatch, the trainer has two others of the stage redo it and digest its gradient
    audits: tuple[ContributionAudit, ...] = ()
    # the coordinator's rollback epoch when leased: the task's stage calls carry it, and a
    # replica that loaded a rollback's state since refuses them (`swarm.rpc.epoch`); when the
    # task was leased, not what it is: tasks compare without it
    epoch: int = field(default=0, compare=False)
    # the scheduler's lease ticket of the microbatch at each stage in `stages`, indexed by stage
    # (b"" elsewhere; none where no scheduler leased it): the task's accumulating call at a
    # stage carries that stage's (`swarm.net.lease_tickets`). Compared without, as epoch.
    tickets: tuple[bytes, ...] = field(default=(), compare=False)
    # the run it is pushed as on the push plane (`StagePushRequest.run`; 0: none, no record
    # kept), drawn by the coordinator and named by its tickets (`scheduler.coordinator.
    # lease_signer`): a replica on its route holds a later stage's ticket, and under a run of its
    # own would accumulate there ahead of the lessee's push. Compared without, as epoch.
    run: int = field(default=0, compare=False)


@dataclass(frozen=True)
class ContributionAudit:
    """Replica `peer`'s contribution to a step's averaging at `stage` is audited: its
    microbatches' gradients digested with r drawn from `seed`, which it never learns
    (`scheduler.coordinator.trust.contributions`)."""

    stage: int
    peer: str
    seed: int


@dataclass(frozen=True)
class GradientDigest:
    """A microbatch's parameter gradient at `stage`, accumulated there by `peer`, as two other
    replicas (`auditors`) re-executed it and agreed on bit for bit: r·g, Σ|r_i·g_i|, ‖g‖ (or,
    `disputed`, one of two that differ)."""

    stage: int
    peer: str
    dot: float
    magnitude: float
    norm: float
    auditors: str
    seed: int = 0  # the audit's: a straggler's digest of a step since replayed has another
    # One auditor's alone (`auditors` names it), the other's differing and reported beside it:
    # the coordinator judges which is the gradient's
    # (`scheduler.coordinator.trust.digest_disputes`).
    disputed: bool = False


@dataclass(frozen=True)
class Replica:
    peer: str
    address: str
    throughput: float = 0.0  # measured samples/s on its stage; 0 when unknown
    # microbatches whose activations it keeps for their Backward (its load reports'
    # `activation_capacity`, as the scheduler took it); 0 when not said
    capacity: int = 0


@dataclass(frozen=True)
class Lease:
    step: int
    tasks: list[Task]
    replicas: list[list[Replica]]  # per stage, the replicas serving it now
    done: bool = False  # the job has no more steps

    def unaudited(self) -> Lease:
        """This lease with no task telling its step's contribution audits: for a trainer that
        is not the job's own (`scheduler.callers.Caller.manages`)."""
        tasks = [replace(t, audits=()) if t.audits else t for t in self.tasks]
        return Lease(self.step, tasks, self.replicas, self.done)


@dataclass(frozen=True)
class Verdict:
    """A replica caught lying by an audit: its work contradicted by two re-executions on other
    replicas of its stage (`client.audit.audits`); `evidence` says what differed."""

    peer: str
    stage: int
    evidence: str
    # the replicas whose agreeing re-executions contradict it (none: its own commitment does):
    # the coordinator convicts on no single host's word (`scheduler.coordinator.trust.bans`)
    auditors: tuple[str, ...] = ()


@dataclass(frozen=True)
class MicrobatchResult:
    step: int
    index: int
    holders: dict[int, str]  # stage -> peer that accumulated the gradient there
    loss_sum: float | None  # None when the last stage was not accumulated (a replay)
    samples: int
    # A validation microbatch (`Task.evaluate`) reports its loss and no holders; the ledger
    # knows it by its index, past the step's training microbatches.
    # pool.mode = "local": the replica of every stage the run went through, 0..S-1, and those
    # whose Backward ran on another (`swarm.model.routes.Run`); empty otherwise
    chain: tuple[str, ...] = ()
    back: tuple[tuple[int, str], ...] = ()
    verdicts: tuple[Verdict, ...] = ()  # replicas its audit caught lying (issue 55)
    # every replica whose answer this result rests on (carry plane; empty: not known): one
    # banned meanwhile makes it void (`scheduler.coordinator.trust.bans`)
    touched: tuple[str, ...] = ()
    # the audit's price: stage computations of this run, and re-executions its audit took
    stage_runs: int = 0
    audit_runs: int = 0
    digests: tuple[GradientDigest, ...] = ()  # of its stages whose contribution is audited
    # An audit's own report, after its microbatch's was (issue 69: the audit ended off the step's
    # critical path, `client.audit.late_audits`): its verdicts, `audit_runs` and `digests` act
    # as any report's; it is never counted as the microbatch's work (the ledger never sees it).
    late: bool = False


# (step, index): a microbatch a trainer is still working on, named in a lease to renew it
Working = tuple[int, int]


class LeaseSource(Protocol):
    """Where a trainer gets its work: the step coordinator, in-process or over the wire.

    `lease` is a long poll: with no work to give it answers once there is some, the job is done
    or the members changed, or after `wait_s` (0: at once). It renews the leases of `working`
    (the trainer's microbatches still in progress), so a lease outlasts its work however slow
    the pipeline; renewing is idempotent, and a lease another trainer took over is not renewed.
    """

    async def lease(
        self, trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease: ...
    async def report(self, trainer: str, result: MicrobatchResult) -> None: ...
    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[Working],
    ) -> Lease:
        """`report` each result, then `lease(count)` at once (no wait), in one round trip."""
        ...

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        """Give microbatches back, with why they failed (for the job's status)."""
        ...


# -- the wire form, shared by the scheduler's job API and the remote trainer --------------------
def lease_request(
    job: str, trainer: str, count: int, wait_s: float, working: Sequence[Working]
) -> spb.SchedulerLeaseMicrobatchesRequest:
    return spb.SchedulerLeaseMicrobatchesRequest(
        job=job,
        trainer=trainer,
        count=count,
        wait_s=wait_s,
        working=[spb.MicrobatchRef(step=s, index=i) for s, i in working],
    )


def working_from_proto(msg: spb.SchedulerLeaseMicrobatchesRequest) -> list[Working]:
    return [(w.step, w.index) for w in msg.working]


def lease_to_proto(lease: Lease) -> spb.SchedulerLeaseMicrobatchesResponse:
    return spb.SchedulerLeaseMicrobatchesResponse(
        step=lease.step,
        done=lease.done,
        tasks=[
            spb.LeaseTask(
                step=t.step,
                index=t.index,
                stages=sorted(t.stages),
                evaluate=t.evaluate,
                audits=[
                    spb.ContributionAudit(stage=a.stage, peer=a.peer, seed=a.seed) for a in t.audits
                ],
                epoch=t.epoch,
                tickets=t.tickets,
                run=t.run,
            )
            for t in lease.tasks
        ],
        replicas=[
            spb.StageStatus(
                stage=k,
                replicas=[
                    spb.Replica(
                        peer=r.peer,
                        address=r.address,
                        samples_per_second=r.throughput,
                        activation_capacity=r.capacity,
                    )
                    for r in stage
                ],
            )
            for k, stage in enumerate(lease.replicas)
        ],
    )


def lease_from_proto(msg: spb.SchedulerLeaseMicrobatchesResponse) -> Lease:
    return Lease(
        step=msg.step,
        done=msg.done,
        tasks=[
            Task(
                t.step,
                t.index,
                frozenset(t.stages),
                t.evaluate,
                tuple(ContributionAudit(a.stage, a.peer, a.seed) for a in t.audits),
                t.epoch,
                tuple(t.tickets),
                t.run,
            )
            for t in msg.tasks
        ],
        replicas=[
            [
                Replica(r.peer, r.address, r.samples_per_second, r.activation_capacity)
                for r in s.replicas
            ]
            for s in msg.replicas
        ],
    )


def result_to_proto(result: MicrobatchResult) -> spb.MicrobatchReport:
    msg = spb.MicrobatchReport(
        step=result.step,
        index=result.index,
        holders=result.holders,
        samples=result.samples,
        chain=result.chain,
        back=dict(result.back),
        verdicts=[
            spb.Verdict(peer=v.peer, stage=v.stage, evidence=v.evidence, auditors=v.auditors)
            for v in result.verdicts
        ],
        touched=result.touched,
        stage_runs=result.stage_runs,
        audit_runs=result.audit_runs,
        digests=[
            spb.GradientDigest(
                stage=d.stage,
                peer=d.peer,
                dot=d.dot,
                magnitude=d.magnitude,
                norm=d.norm,
                auditors=d.auditors,
                seed=d.seed,
                disputed=d.disputed,
            )
            for d in result.digests
        ],
        late=result.late,
    )
    if result.loss_sum is not None:
        msg.loss_sum = result.loss_sum
    return msg


def result_from_proto(msg: spb.MicrobatchReport) -> MicrobatchResult:
    loss = msg.loss_sum if msg.HasField("loss_sum") else None
    back = tuple(sorted(msg.back.items()))
    verdicts = tuple(Verdict(v.peer, v.stage, v.evidence, tuple(v.auditors)) for v in msg.verdicts)
    return MicrobatchResult(
        msg.step,
        msg.index,
        dict(msg.holders),
        loss,
        msg.samples,
        tuple(msg.chain),
        back,
        verdicts,
        tuple(msg.touched),
        msg.stage_runs,
        msg.audit_runs,
        tuple(
            GradientDigest(
                d.stage, d.peer, d.dot, d.magnitude, d.norm, d.auditors, d.seed, d.disputed
            )
            for d in msg.digests
        ),
        msg.late,
    )
