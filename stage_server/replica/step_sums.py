"""A replica's gradient sums of its open steps, the receipts of what they hold, and the pool's sum
prepared for the step's APPLY.

The sums of a step are one flat tensor (which averaging reads as it is), lent to the step's
commit at PREPARE: averaging may then sum the pool's parts over them in place, and a `Spill`
keeps what it overwrites, for a retried PREPARE or a straggler. A late Backward (a straggler's
duplicate, which the ledger counts elsewhere) must not reach what this replica averages and
applies: it adds into a copy of the sums as they were, made when such a Backward comes rather
than at every commit.

Pure torch, no networking: read and written on the replica's worker thread only (but for the
rollback epoch, which a Join raises from the event loop: under its lock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stage_server.averaging.spill import Spill, SpillFile
from swarm.errors import Busy, FailedPrecondition
from swarm.model.flat import flat_copy, flat_view
from swarm.proto import tensor_pb2

__all__ = ["Receipt", "Sent", "StepSums", "Sums", "another_run"]

# The pool's summed gradient as the averaging's lossy codec carried it: the flat sum's parts, the
# bytes every replica decoded them from (`swarm.rpc.state_streams.Update.encoded`); none: as is.
Sent = tuple[tensor_pb2.Tensor, ...]


@dataclass(frozen=True)
class Receipt:
    """Proof that microbatch `(step, index)`'s gradients are in this replica's accumulator."""

    stage: int
    step: int
    index: int
    samples: int
    duplicate: bool
    # an audit's re-execution (nothing accumulated): its gradient's digest, where one was asked
    # (`stage_server.replica.gradient_digest`)
    digest: tuple[float, float, float] | None = None


@dataclass
class StepSums:
    """One step's gradient sums on this replica, and the receipts of what they hold."""

    accum: list[torch.Tensor] | None = None
    receipts: dict[int, int] = field(default_factory=dict)  # index -> samples
    # index -> the push-plane run it was accumulated under (`swarm.rpc.lease.Task.run`; 0: none
    # named): the coordinator adopts a late receipt only under the run of the lease given back
    runs: dict[int, int] = field(default_factory=dict)
    lent: bool = False  # `accum` is a commit's now: a later Backward adds into a copy of it
    # what averaging `accum` in place overwrote, kept for a retry or a straggler (`Spill`)
    spill: Spill | None = None

    def drop(self) -> None:
        """The sums are done with (applied or discarded): so is what their spill kept."""
        if self.spill is not None:
            self.spill.close()

    def open(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The sums a microbatch's gradients add into (of `params`' shapes); no receipt yet:
        `received` gives it once they hold the microbatch whole, `withdraw` undoes a failure."""
        if self.accum is None:
            # One flat tensor (which averaging reads as it is) of -0.0, the one value x + v
            # leaves x as it is whatever x, the sign of a zero included: the first
            # microbatch's gradients land in it with their own bits.
            self.accum = flat_copy(params, fill=-0.0)
        elif self.lent:  # a straggler after PREPARE: the prepared sums stay as they are
            copy = flat_copy(self.accum)
            if self.spill is not None:  # averaged in place: the sums as they were
                whole = flat_view(copy)
                assert whole is not None  # a copy of one flat tensor is one
                self.spill.restore(into=whole)
            self.accum, self.lent, self.spill = copy, False, None
        return self.accum

    def received(self, index: int, samples: int, run: int = 0) -> None:
        """The sums hold microbatch `index` (its `samples`, pushed as `run`) whole now: its
        receipt. Its run first: a receipt Info reads from the event loop has its run."""
        self.runs[index] = run
        self.receipts[index] = samples

    def other_run(self, index: int, run: int) -> int | None:
        """The run microbatch `index` is held under here, where it is held under another than
        `run` (None: not held, or held under `run`). A duplicate under the same run is answered
        as one (a retry); under another it is not the push that accumulated here: a member
        ahead on the route may have pushed the lessee's run first, and the replay, answered as a
        duplicate, would leave that stray standing. The replay is refused instead: it goes to
        another replica, or fails, and the coordinator's late-receipt check voids this one
        (`scheduler.coordinator.late_receipts`)."""
        held = self.runs.get(index)
        return held if index in self.receipts and held != run else None

    def withdraw(self) -> list[int]:
        """A microbatch's backward failed after adding part of its gradients here: the sums
        hold no set of whole microbatches any more. They go, with every receipt of the step
        (returned, for the log): a PREPARE that names them fails its receipt check, and the
        coordinator replays them. Sums that held none yet start again as they were: empty."""
        assert not self.lent and self.spill is None  # `open` made them this replica's own
        withdrawn, self.receipts, self.runs, self.accum = sorted(self.receipts), {}, {}, None
        return withdrawn


def another_run(index: int, held: int, run: int) -> str:
    """Why a push of microbatch `index` under `run` is not accumulated where it is `held` under
    another run."""
    return (
        f"microbatch {index} is held here under run {held}, not run {run}: not accumulated "
        "again under another run"
    )


class Sums:
    """Step -> this replica's sums of it (its own step, and the next one if steps are delayed),
    and the pool's summed gradient of its own step between PREPARE and APPLY."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)  # what the sums are of
        self._steps: dict[int, StepSums] = {}
        # The one spill file each step's spill writes in turn: over pages the page cache holds
        # already, not a new file's (`stage_server.averaging.spill`).
        self._spill_file = SpillFile()
        # (step, the pool's summed gradient, the step's samples, the sum as a lossy codec
        # carried it) between prepare and apply
        self._prepared: tuple[int, list[torch.Tensor], int, Sent] | None = None
        # The epoch of the last rollback's LoadState, or of the coordinator's Join if newer
        # (`swarm.rpc.epoch`): work leased before it would add into a replayed step a gradient
        # taken on the state before.
        self.epoch = 0
        self._epoch_lock = threading.Lock()  # a LoadState sets it on the worker, a Join raises it
        # The epoch of the state this replica holds, which Info says: set only with the state
        # (a rollback's LoadState, a loaded copy). A Join raises `epoch` long before its copy
        # loads, and a lost stage is taken up by a peer whose state is of the last rollback's.
        self.state_epoch = 0

    def rolled_back(self, epoch: int) -> None:
        """A rollback's LoadState loaded this replica's state: work leased before `epoch` is
        stale from now on."""
        with self._epoch_lock:
            self.epoch = self.state_epoch = epoch

    def copied(self, epoch: int) -> None:
        """A copy begun by a Join of `epoch` loaded its source's state (a member's then)."""
        with self._epoch_lock:
            self.state_epoch = epoch

    def retire_before(self, epoch: int) -> None:
        """Work leased before `epoch` is stale from now on: the coordinator's Join said it (a
        replica that joins after a rollback got no LoadState of it), or a rollback's LoadState
        is about to load its state. Only raised: a Join sent before a rollback may come after
        its LoadState."""
        with self._epoch_lock:
            self.epoch = max(self.epoch, epoch)

    def __getitem__(self, step: int) -> StepSums:
        return self._steps[step]

    def __contains__(self, step: int) -> bool:
        return step in self._steps

    def of(self, step: int) -> StepSums:
        """The sums of `step`, new and empty if it has none yet."""
        return self._steps.setdefault(step, StepSums())

    def receipts(self, step: int) -> dict[int, int]:
        """What this replica accumulated for `step`: index -> samples."""
        sums = self._steps.get(step)
        return dict(sums.receipts) if sums is not None else {}

    def runs(self, step: int) -> dict[int, int]:
        """The run each of `step`'s receipts was accumulated under: index -> run."""
        sums = self._steps.get(step)
        return dict(sums.runs) if sums is not None else {}

    def check_run(self, step: int, index: int, run: int) -> None:
        """Busy where `step`'s sums hold microbatch `index` under another run than `run`
        (`StepSums.other_run`): from a push's header on the event loop (dict looks, each whole
        under the GIL), before its body is read, so that the caller tries another replica
        before anything after this stage ran. The worker looks again as it accumulates
        (`another_run`): two pushes of one microbatch may both pass here first."""
        sums = self._steps.get(step)
        held = sums.other_run(index, run) if sums is not None else None
        if held is not None:
            raise Busy(another_run(index, held, run) + "; try another replica")

    def held(self) -> bool:
        """Whether this replica holds work of its own: a receipt, or a prepared step."""
        return any(s.receipts for s in self._steps.values()) or self._prepared is not None

    def admit(self, epoch: int, step: int, index: int) -> None:
        """Refuse the work of microbatch `(step, index)` leased in `epoch` if a rollback since has
        loaded this replica's state (or had happened when it joined). Only the scheduler's calls
        move the epoch, a rollback's LoadState and a Join (both signed): a call's is not taken,
        since on the push plane a peer names the epoch of the push it sends on, and a liar's
        far-off one would have this replica refuse all honest work."""
        if epoch < self.epoch:
            raise FailedPrecondition(
                f"microbatch ({step}, {index}) was leased before a rollback (epoch {epoch}; this "
                f"replica loaded epoch {self.epoch}'s state): stale, not accumulated"
            )

    def lend(self, step: int) -> list[torch.Tensor]:
        """The sums of `step` themselves (zeros if it holds none), lent to its commit."""
        sums = self._steps.get(step)
        if sums is None or sums.accum is None:
            return self.zeros()
        if sums.spill is not None:  # a retry: the last round overwrote some, in place
            sums.spill.restore()
        if self._prepared is not None and self._prepared[0] == step:
            self._prepared = None  # that was the sums, averaged in place: prepared anew now
        sums.lent = True
        return list(sums.accum)

    def spill(self, step: int, directory: Path | None) -> Spill | None:
        """Where the averaging of `step`'s lent sums keeps what it overwrites in place (in
        `directory`, None: in memory); None when they are not one flat tensor (the part
        averaged is then a copy: nothing to keep). A device's are kept on the host."""
        sums = self._steps.get(step)
        if sums is None or sums.accum is None or not sums.lent:
            return None
        if sums.spill is None:
            flat = flat_view(sums.accum)
            if flat is None:
                return None
            sums.spill = Spill(flat, directory, self._spill_file)
        return sums.spill

    def zeros(self) -> list[torch.Tensor]:
        return flat_copy(self.params, fill=0.0)

    def accum_or_zeros(self, step: int) -> list[torch.Tensor]:
        sums = self._steps.get(step)
        return sums.accum if sums is not None and sums.accum is not None else self.zeros()

    def drop(self, step: int) -> int:
        """Let go of the sums of `step` (applied or discarded); how many receipts they held."""
        sums = self._steps.pop(step, StepSums())
        sums.drop()
        return len(sums.receipts)

    def clear(self) -> None:
        self._steps, self._prepared = {}, None

    def close(self) -> None:
        """The replica is no longer served: its spill file goes now, not when its idle timer
        fires, whatever still holds these sums (a call under way ends with them)."""
        self._spill_file.close()

    # -- the pool's sum, between PREPARE and APPLY ----------------------------------------------
    def set_prepared(
        self, step: int, grad_sums: list[torch.Tensor], total_samples: int, sent: Sent = ()
    ) -> None:
        self._prepared = (step, grad_sums, total_samples, sent)

    def prepared(self, step: int) -> tuple[list[torch.Tensor], int] | None:
        """The pool's summed gradient prepared for `step` and its samples (None: not prepared)."""
        if self._prepared is None or self._prepared[0] != step:
            return None
        return self._prepared[1], self._prepared[2]

    def sent(self, step: int) -> Sent:
        """The pool's sum prepared for `step` as the averaging's lossy codec carried it (none: it
        carried none, or no peer followed this replica as it averaged)."""
        if self._prepared is None or self._prepared[0] != step:
            return ()
        return self._prepared[3]

    def unprepare(self) -> None:
        self._prepared = None
