"""A committed step's record (`StepRecord`) and the coordinator metrics that follow commits: how
long the step took, how much of that no work could be leased because a commit was under way,
the tokens it trained on, its gradient norm and validation loss.

Why its own clock: with `training.delayed_update` a step opens before the one before it is
applied, so a step's seconds are counted from the later of its opening and the last step's end;
that way the records' seconds add up to the job's, never counting an overlap twice. Blocked
seconds run from the moment the newest step is complete (nothing left to lease) until the next
step opens, and are handed out once: each record carries those since the record before it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.metrics import CoordinatorMetrics
from swarm.ops import timeline
from swarm.ops.progress import StepRecord

__all__ = ["StepRecords"]


class StepRecords:
    """The timing of one coordinator's steps, and the records it reports for them."""

    def __init__(self, metrics: CoordinatorMetrics, seq_len: int) -> None:
        self.metrics, self._seq_len = metrics, seq_len
        self.metrics.last_commit.set(time.time())
        self._applied_at = -math.inf  # perf_counter() of the last step's end
        # since when no step has been open to lease because of a commit; the seconds of that
        # since the last step's record
        self._blocked_since: float | None = None
        self._blocked = 0.0

    def blocked(self, step: int) -> None:
        """The newest step, `step`, is complete: no work can be leased until the next one opens
        (its commit starts)."""
        if self._blocked_since is None:
            self._blocked_since = time.perf_counter()
            timeline.mark("commit", step=step)  # the benches' timeline (`swarm.ops.timeline`)

    def opened(self, step: int) -> None:
        """Step `step` opened: the time blocked since `blocked` is over."""
        timeline.mark("open", step=step)
        if self._blocked_since is not None:
            blocked = time.perf_counter() - self._blocked_since
            self._blocked, self._blocked_since = self._blocked + blocked, None
            self.metrics.blocked.inc(blocked)

    def applied(self, ledger: StepLedger, started: float, grad_norm: float | None) -> StepRecord:
        """The record of `ledger`'s step, applied now; it opened at `started` (perf_counter).
        `grad_norm` counts only for a step with microbatches (not the final evaluation)."""
        # With delayed_update the step began before the one before it ended: its seconds are
        # counted from that end, so that the records' seconds add up to the job's.
        now = time.perf_counter()
        timeline.mark("applied", step=ledger.step)
        seconds, self._applied_at = now - max(started, self._applied_at), now
        self.metrics.last_commit.set(time.time())
        tokens = ledger.samples() * self._seq_len
        self.metrics.tokens.inc(tokens)
        norm = grad_norm if ledger.microbatches else None
        val_loss = ledger.val_loss()
        if val_loss is not None:
            self.metrics.val_loss.set(val_loss)
        return StepRecord(
            ledger.step, ledger.loss(), ledger.samples(), seconds, tokens, norm, val_loss
        )

    def with_blocked(self, record: StepRecord) -> StepRecord:
        """`record` with the seconds blocked on commits since the last record."""
        blocked, self._blocked = self._blocked, 0.0
        return replace(record, blocked_seconds=blocked)
