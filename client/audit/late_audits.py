"""Audits that end off their step's critical path (issue 69 item 4; docs/decisions.md, "A step's
last audits off its critical path").

A push-plane microbatch is reported (its holders, its loss) as soon as its push returns; its
audit runs on here and reports what it found when it ends, in a report of its own
(`MicrobatchResult.late`): its verdicts, the re-executions it took, its digests. The step may
commit meanwhile. That keeps training exact because a ban already rolls the job back to the last
checkpoint at or before the first step the banned peer was a member at
(`scheduler.coordinator.trust.bans`): a verdict about step N that arrives during step N+1 rolls
N's work away just as a verdict before N's commit rolls the earlier steps' away.

- **An honest replica is never accused for the step having moved on.** A re-execution of step N
  asked of an auditor that has applied N's update is refused there as stale
  (`stage_server.replica.runtime`'s step check, before any compute): no evidence either way, the
  audit skipped and counted (`swarm_trainer_audits_total{outcome="skipped"}`), never a
  disagreement.
- **Bounded.** An audit of step N not ended once this trainer is given work of step N + 2 (so
  step N + 1 has committed) is cut: cancelled, counted (`outcome="cut"`) and logged with its
  microbatch. At most one step late, so the rollback a late verdict costs reaches at most one
  step further than a verdict before the commit. The plane reports no microbatch of step
  N + 1 before the audits of the steps before it ended (`client.data_plane.push`), so on time
  none is cut: a cut one was a contribution judged without its digests, a liar let go by a slow
  machine.
- **In turn at its auditors.** Its re-executions say they are late (`swarm.rpc.late_audit`), and
  queue in turn with the pushes there (`stage_server.replica.answering`): with a step to end in,
  it need not hold up the step being trained. An audit that gates its microbatch's report (the
  job's last step, `PushAudits.defers`) still runs ahead of them.
- **Reported, or said why not.** A late report that fails (the coordinator gone) is logged with
  its cause; its verdicts are lost with it, as a report's are.
- **Not past the trainer.** The trainer's shutdown (`PipelineTrainer.close`, through its
  plane's `stop`: the job over for it, cancelled, or failed) cancels every audit still out,
  logged with their count and microbatches, and waits for them to end before its clients
  close: none calls an auditor over a closed client or reports to a coordinator it has left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from client.metrics import TrainerMetrics
from swarm.rpc import late_audit
from swarm.rpc.lease import MicrobatchResult

__all__ = ["LateAudits", "LateReport"]

log = logging.getLogger(__name__)

LateReport = Callable[[MicrobatchResult], Awaitable[None]]
"""Send an audit's own report to the coordinator (`LeaseSource.report`)."""
Audit = Callable[[], Awaitable[MicrobatchResult | None]]
"""One microbatch's audit, started when called: its report (None: nothing to tell)."""


class LateAudits:
    """One trainer's audits still running after their microbatches were reported."""

    def __init__(self, metrics: TrainerMetrics, report: LateReport | None = None) -> None:
        """`report`: where a late audit's report goes (None: nowhere to send it; the plane then
        waits for its audits, as before, `deferred` says)."""
        self.metrics, self.report = metrics, report
        self._running: dict[asyncio.Task[None], tuple[int, int]] = {}  # -> (step, index)

    @property
    def deferred(self) -> bool:
        """Whether an audit may end after its microbatch is reported."""
        return self.report is not None

    @property
    def running(self) -> list[tuple[int, int]]:
        """The microbatches whose audit is still out, as (step, index)."""
        return sorted(self._running.values())

    def start(self, step: int, index: int, audit: Audit) -> None:
        """Run `audit` of microbatch `(step, index)` on; what it returns (None: nothing to
        tell) is reported when it ends."""
        task = asyncio.create_task(self._reported(step, index, audit))
        self._running[task] = (step, index)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)

    async def _reported(self, step: int, index: int, audit: Audit) -> None:
        # its re-executions queue in turn at their auditors, not ahead of the pushes there
        # (`swarm.rpc.late_audit`): its bound is a step away
        late_audit.in_late_audit()
        try:
            found = await audit()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no one awaits this task for its outcome: told here, or never
            self.metrics.audited("failed")
            log.warning(
                "the audit of microbatch (%d, %d) failed: %s: its microbatch unaudited",
                step,
                index,
                str(e) or type(e).__name__,
            )
            return
        if found is None or self.report is None:
            return
        try:
            await self.report(found)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # its verdicts are lost with it, as a failed report's are
            log.warning(
                "the late audit of microbatch (%d, %d) was not reported: %s", step, index, e
            )

    def cut(self, step: int) -> None:
        """Work of `step` was given: step `step - 1` has committed, so every audit of a step
        before it is past its bound (and one of a step past `step + 1` was of steps a rollback
        took back). Cancel them, counted and logged."""
        for task, (at, index) in list(self._running.items()):
            # (past `step + 1`: a rollback since, whose replay makes the audit moot)
            if (at < step - 1 or at > step + 1) and not task.done():
                task.cancel()
                self._running.pop(task, None)
                self.metrics.audited("cut")
                log.warning(
                    "the audit of microbatch (%d, %d) was cut (work of step %d given: past its "
                    "bound, step %d's commit, or a rollback since): its microbatch unaudited",
                    at,
                    index,
                    step,
                    at + 1,
                )

    async def stop(self) -> None:
        """The trainer shuts down: cancel every audit still out (its microbatch goes
        unaudited), logged with their count, and wait for them to end."""
        pending = {t: at for t, at in self._running.items() if not t.done()}
        if not pending:
            return
        log.warning(
            "%d late audit(s) cancelled as the trainer shuts down: microbatches %s unaudited",
            len(pending),
            ", ".join(f"({step}, {index})" for step, index in sorted(pending.values())),
        )
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def settled(self, before: int) -> None:
        """Wait for every audit of a step before `before` (the job's last step waits for them:
        no later step's commit bounds them)."""
        pending = [t for t, (at, _) in self._running.items() if at < before]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
