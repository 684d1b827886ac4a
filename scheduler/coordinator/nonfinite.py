"""Whose NaN or infinite answer fails the job, and whose leaves only its replica out.

The members of a pool average one sum, so their averages are the same, bit for bit (a hostile
owner that sends members different sums fails the round's sum checks first, named; under
`pool.mode = "local"` each step's PREPARE averages with no one, and they differ). A NaN or
infinite norm from every member of a stage is the model's or the data's: no step is applied,
and the job fails with its cause (`NonFiniteStep`), as it always did. So does any split this
cannot read for sure. Where a strict majority of a stage's members answered one and the same
finite norm, the others' NaN is their own word: a faulty device, or a hostile volunteer that
answers PREPARE with a NaN (or refuses its APPLY as NaN) to end another submitter's job. Before,
either ended the job. Now those members are left out, their microbatches replayed (PREPARE), or
dropped a step behind to rejoin by copying a member that applied (APPLY); the job goes on. A
majority, not any one finite answer: else one hostile member answering a finite norm beside its
pool's honest NaNs (its own NaN contribution's) would have them all left out, and itself the
stage's pool of one, unchecked.

A member's own words can say it too, majority or not (a pool of two has none): its round's
reports of the very average it took back, which a NaN or infinite norm of that average can
contradict (`scheduler.coordinator.trust.own_norms`). It is left out alone. And an APPLY is sent
only where every member answered a finite norm (or was left out): a member refusing it as NaN
contradicts its own PREPARE (an honest replica applies the very sums it answered the norm of),
and is dropped wherever another member of its stage applied it, majority or not; a stage none of
whose members applied it cannot move on exactly, and the job fails."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence

from scheduler.coordinator.failures import NonFiniteStep
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.round_failure import LeftOut, RoundFailure
from swarm.errors import NonFiniteGradient
from swarm.rpc.lease import Replica

__all__ = ["NonFinite", "split"]

log = logging.getLogger(__name__)

# `TwoPhaseCommit._leave_out`: void a replica's gradients of the step, leave it out of the pool
LeaveOut = Callable[[StepLedger, int, Replica, list[str], str], Awaitable[None]]


def split(
    answers: Iterable[tuple[int, str, float | None]],
) -> tuple[dict[int, list[str]], list[tuple[int, str]]]:
    """Of each member's answer `(stage, peer, value)` (a norm; None: not NaN, nothing to
    compare): the stages whose NaN or infinite answers cannot be
    read as their members' own (stage -> those members: the job fails), and the members whose
    can, a strict majority of their stage having answered one and the same finite value
    (`(stage, peer)`: left out alone)."""
    by_stage: dict[int, tuple[list[float | None], list[str]]] = {}
    for stage, peer, value in answers:
        fine, bad = by_stage.setdefault(stage, ([], []))
        if value is None or math.isfinite(value):
            fine.append(value)
        else:
            bad.append(peer)
    diverged: dict[int, list[str]] = {}
    alone: list[tuple[int, str]] = []
    for stage, (fine, bad) in by_stage.items():
        if not bad:
            continue
        agreed = len(set(fine)) == 1 and 2 * len(fine) > len(fine) + len(bad)
        if agreed:
            alone += [(stage, peer) for peer in bad]
        else:
            diverged[stage] = bad
    return diverged, alone


class NonFinite:
    """A commit attempt's NaN or infinite answers (`split`), as PREPARE's norms and APPLY's
    refusals come: counted (`metrics.nonfinite`), the job failed where a whole stage said so,
    the members alone in saying so left out (`leave_out`) or dropped."""

    def __init__(
        self, metrics: CoordinatorMetrics, membership: Membership, leave_out: LeaveOut
    ) -> None:
        self.metrics, self.membership, self.leave_out = metrics, membership, leave_out

    async def prepared(
        self,
        ledger: StepLedger,
        reported: Sequence[tuple[int, str, float]],
        where: Sequence[tuple[int, Replica]],
        own: Collection[tuple[int, str]] = (),
    ) -> RoundFailure | None:
        """PREPARE's `(stage, peer, squared norm)` answers: raise `NonFiniteStep`, with nothing
        applied, where every member of a stage answered a NaN or infinite norm; leave out each
        member that did while another of its stage answered a finite one, or whose own reports
        of its round contradict it (`own`: `(stage, peer)`), and say so (the attempt fails and
        is retried without them); None where every norm is finite."""
        norms = {(stage, peer): sq_norm for stage, peer, sq_norm in reported}
        own = [key for key in norms if key in own]
        diverged, alone = split((k, p, n) for (k, p), n in norms.items() if (k, p) not in own)
        for stage in sorted({k for (k, _), n in norms.items() if not math.isfinite(n)}):
            self.metrics.nonfinite(stage)
        if diverged:
            bad = {k: [f"{p}: {norms[k, p]}" for p in peers] for k, peers in diverged.items()}
            raise NonFiniteStep(
                f"step {ledger.step}: the averaged gradient of "
                + "; ".join(
                    f"stage {stage} is NaN or infinite (squared norm from {', '.join(peers)})"
                    for stage, peers in bad.items()
                )
                + ". Nothing of the step was applied, and the job fails: its microbatches on "
                "the same parameters give the same gradient again (a lower optimizer.lr, or the "
                "data, may be at fault)"
            )
        if not alone and not own:
            return None
        replicas = {(stage, r.peer): r for stage, r in where}
        failure = RoundFailure(f"step {ledger.step}: a NaN or infinite norm beside finite ones")
        for stage, peer in [*own, *alone]:
            why = f"its word of its pool's average's norm is {norms[stage, peer]}, " + (
                "against its own reports of that average (r·S and ‖S‖ of every part finite)"
                if (stage, peer) in own
                else "others' finite"
            )
            await self.leave_out(ledger, stage, replicas[stage, peer], [peer], why)
            failure.left_out.append(LeftOut(stage, peer, [peer], why))
        return failure

    def applied(
        self, step: int, where: Sequence[tuple[int, Replica]], results: Sequence[object]
    ) -> set[tuple[int, str]]:
        """APPLY's results, in `where`'s order: drop each member that refused it as NaN or
        infinite where another member of its stage applied it (its refusal is against its own
        finite PREPARE norm; a step behind, it rejoins by copying one that applied); raise
        `NonFiniteStep` where none of a stage's members applied it and one refused (its sums
        are not what its norm said: the stage cannot move on exactly). A failure of another
        kind applied nothing. The members that refused."""
        refused = {
            (stage, r.peer): result
            for (stage, r), result in zip(where, results, strict=True)
            if isinstance(result, NonFiniteGradient)
        }
        moved = {k for (k, _), result in zip(where, results, strict=True) if _applied(result)}
        for stage in sorted({stage for stage, _ in refused}):
            self.metrics.nonfinite(stage)
        alone = [(k, p) for k, p in sorted(refused) if k in moved]
        if len(alone) < len(refused):
            raise NonFiniteStep(
                f"step {step}: APPLY refused as NaN or infinite by "
                + "; ".join(f"stage {k} {p}: {refused[(k, p)]}" for k, p in sorted(refused))
                + "; the replicas that applied it are a step ahead of these"
            )
        for stage, peer in alone:
            log.warning(
                "step %d: stage %d: %s refused its APPLY as NaN or infinite (%s), against its "
                "own finite PREPARE norm, while another of its pool applied it: dropped; it "
                "rejoins by copying one that applied",
                step,
                stage,
                peer,
                refused[(stage, peer)],
            )
            self.membership.drop(peer, f"it refused its APPLY of step {step} as not finite")
        return set(refused)


def _applied(result: object) -> bool:
    """Whether an APPLY's result says it applied (or had: a retried commit's)."""
    return not isinstance(result, BaseException)
