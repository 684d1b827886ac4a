"""The parameters of the step before this replica's, kept for the audits that end after their
step committed (issue 69 item 4; docs/decisions.md, "A step's last audits off its critical path").

On the push plane a microbatch is reported before its audit ends (`client.audit.late_audits`),
so the step may commit, and this replica apply its update, while an audit of that step still
asks it to re-execute a microbatch. Computed on the new parameters, an honest replica's work
would disagree with its own re-execution: a false accusation. So the update of a step whose
pushes (or the step before's) this replica recorded (a run id: some stage has a second replica
to audit, issue 69 item 2) first copies the parameters it computed on, and a re-execution
(`redoing`: on the push plane every Forward, Backward or ForwardBackward that does not evaluate
is one) of exactly that step runs on the copy. Anything else of an older step is refused as
stale, as before: a training call never computes on the copy, and an accumulating one of an
older step is refused.

What it costs: one copy of the stage's parameters (no optimizer state) on its device, made
once (a compiled stage compiles it once too), and one in-place copy of them at each update of a
step that was recorded. Nothing where no record was kept (a pool of one, audits off): the copy
is let go at the next update. Not kept under `delayed_update` (two steps compute at once on
copies of their own), nor in a bf16-mixed job (its per-module bf16 copies of the parameters),
nor across a state loaded (a rollback's, a copy's): there a late re-execution is refused as
stale, no evidence either way, counted by the trainer as a skipped audit.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Sequence

import torch

from stage_server.replica.delayed_copies import NoCopies, copies_for
from stage_server.replica.step_sums import StepSums, Sums
from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of

__all__ = ["PriorParams"]


class PriorParams:
    """The parameters each step computes on (`copies`, which it stands in front of), and the
    parameters one step computed on after its update applied (`keep`), for that step's
    re-executions (while `redoing`)."""

    def __init__(self, copies: NoCopies, job: JobConfig) -> None:
        self.copies, self.module = copies, copies.module
        # kept nowhere the parameters have copies of their own (see the module's docstring)
        self.enabled = not rule_of(job).delays and job.training.precision != "bf16-mixed"
        # whether the job audits at all (no fraction, or local steps' rounds: no record is kept,
        # `stage_server.replica.push`), for `pooled`
        self._audits = bool(job.trust.audit_fraction) and not rule_of(job).rounds
        self._copy: torch.nn.Module | None = None  # made once, then copied into in place
        self.step = -1  # the step `_copy` holds the parameters of (-1: none)
        self._recorded: int | None = None  # the newest step a push of which was recorded here
        self._here = threading.local()  # `redoing`, on the worker thread that computes

    @classmethod
    def of(cls, job: JobConfig, stage: int, module: torch.nn.Module) -> PriorParams:
        """In front of the parameters `job`'s steps compute on (`copies_for`)."""
        return cls(copies_for(job, stage, module), job)

    @property
    def ahead(self) -> int:
        """How many steps past its own a replica computes (`NoCopies.ahead`)."""
        return self.copies.ahead

    def module_at(self, step: int, at: int) -> torch.nn.Module:
        """The module step `step` computes with on a replica at step `at`: a re-execution of
        the step kept, its kept copy; else `copies`'."""
        if self.holds(step) and self._copy is not None:
            return self._copy
        return self.copies.module_at(step, at)

    def params_at(self, step: int, at: int) -> list[torch.Tensor]:
        if self.holds(step) and self._copy is not None:
            return list(self._copy.parameters())
        return self.copies.params_at(step, at)

    def applied(self, step: int) -> None:
        self.copies.applied(step)

    def export(self, step: int) -> dict[str, torch.Tensor]:
        return self.copies.export(step)

    def check(self, step: int, state: dict[str, torch.Tensor]) -> None:
        self.copies.check(step, state)

    def load(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """A state was loaded (a rollback's, a copy's): what was kept is of another history
        (its memory kept for the next `keep`)."""
        self.copies.load(step, state)
        self.step, self._recorded = -1, None

    def sums_of(self, sums: Sums, step: int, at: int, accumulate: bool) -> StepSums:
        """The sums a Backward of `step` adds into on a replica at step `at`: `sums`' own; for
        a re-execution of the step before (it accumulates nothing), sums of none, so that no
        step's entry is made for it; an accumulating call there is refused, as stale."""
        if step >= at:
            return sums.of(step)
        if accumulate:  # only a re-execution computes on the kept parameters (`holds`)
            raise FailedPrecondition(
                f"a replica at step {at}: an accumulating call of step {step} is stale"
            )
        return StepSums()

    def recorded(self, step: int) -> None:
        """A push of `step` was recorded here: an audit of it may come, even after its update."""
        self._recorded = step if self._recorded is None else max(self._recorded, step)

    def pooled(self, step: int) -> None:
        """`step`'s PREPARE named a second replica of the stage (`Committer.commit`): others'
        microbatches of it may be audited here after the update, though no push of `step` was
        recorded here (the routes sent this replica none of them: a step's first, or one after
        a state was loaded, where no earlier record stands in). As `recorded`, where the job
        audits."""
        if self._audits:
            self.recorded(step)

    def keep(self, step: int, params: Sequence[torch.Tensor]) -> None:
        """Step `step`'s update is about to apply to `params` (the module's): keep them first
        where a push of `step` or the step before was recorded here (an auditor of a step need
        not be on the path of any of its microbatches: the routes chose others); else let go
        of what was kept: nothing is paid for an audit that cannot come (issue 69 item 2)."""
        if not self.enabled or self._recorded is None or self._recorded < step - 1:
            self.step, self._copy = -1, None
            return
        if self._copy is None:
            self._copy = copy.deepcopy(self.module)
        with torch.no_grad():
            for q, p in zip(self._copy.parameters(), params, strict=True):
                q.copy_(p)
        self.step = step

    @contextlib.contextmanager
    def redoing(self) -> Iterator[None]:
        """The call run inside is an audit's re-execution: it may compute on the kept copy."""
        self._here.on = True
        try:
            yield
        finally:
            self._here.on = False

    def holds(self, step: int) -> bool:
        """Whether a re-execution of `step` runs here now, on the kept parameters of `step`."""
        return getattr(self._here, "on", False) and self._copy is not None and step == self.step
