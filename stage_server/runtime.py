"""One replica's compute: forward, backward (from cached activations or by recomputing),
per-step gradient accumulation with receipts, and the optimizer update at commit.

With `training.delayed_update` a replica at step m (m updates applied) computes two steps at
once: step m, whose commit may still be averaging or replaying, on the parameters before
update m-1, and step m+1 on those after it (`swarm.model.optim.computes_on`). The optimizer's own
parameters move on at each APPLY, so each step computes on a copy of the module at the version
it needs (`_versions`), which no update touches while graphs of its microbatches are cached.

Pure torch, no networking: the servicer calls these methods from one worker thread, so nothing here
is shared between threads.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stage_server.averaging.owner import flat_view
from stage_server.averaging.spill import Spill
from stage_server.local_round import Eager, LocalRound
from stage_server.snapshot import Snapshot, Snapshots
from stage_server.tensor_checks import TensorChecks
from stage_server.update_log import UpdateLog
from swarm.errors import ActivationsNotCached, FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model import stage_state
from swarm.model.optim import build_optimizer, computes_on, grad_sq_norm, is_boundary, update
from swarm.model.transformer import (
    DTYPES,
    build_stage,
    layer_costs,
    loss_sum,
    num_layers,
    partition,
    precision,
)

__all__ = ["Receipt", "Served", "StageRuntime"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Receipt:
    """Proof that microbatch `(step, index)`'s gradients are in this replica's accumulator."""

    stage: int
    step: int
    index: int
    samples: int
    duplicate: bool


@dataclass
class _Sums:
    """One step's gradient sums on this replica, and the receipts of what they hold."""

    accum: list[torch.Tensor] | None = None
    receipts: dict[int, int] = field(default_factory=dict)  # index -> samples
    lent: bool = False  # `accum` is a commit's now: a later Backward adds into a copy of it
    # what averaging `accum` in place overwrote, kept for a retry or a straggler (`Spill`)
    spill: Spill | None = None

    def drop(self) -> None:
        """The sums are done with (applied or discarded): so is what their spill kept."""
        if self.spill is not None:
            self.spill.close()


class StageRuntime:
    def __init__(self, job: JobConfig, stage: int, device: torch.device | str = "cpu") -> None:
        self.job, self.stage, self.device = job, stage, torch.device(device)
        self.dtype = DTYPES[job.training.dtype]
        self.layers = list(partition(layer_costs(job.model), job.training.stages)[stage])
        self.is_first = stage == 0
        self.is_last = stage == job.training.stages - 1
        self.module = build_stage(job, stage, self.device)
        self.checks = TensorChecks(job, stage, self.module, self.device)  # what it accepts
        self.params = list(self.module.parameters())
        self.optimizer = build_optimizer(self.params, job.optimizer)
        self.step = 0  # steps committed so far; the step being accumulated
        self.delayed = rule_of(job).delays
        self._sums: dict[int, _Sums] = {}  # step -> its sums: `step`, and `step + 1` if delayed
        # delayed_update: updates applied -> a copy of the module then, for `step - 1` (what
        # step `step` computes on) and `step` (what step `step + 1` computes on)
        self._versions: dict[int, torch.nn.Module] = {0: self._copy()} if self.delayed else {}
        # (step, the pool's summed gradient, the step's samples) between prepare and apply
        self._prepared: tuple[int, list[torch.Tensor], int] | None = None
        # (step, index) -> (leaf input, output with its graph), for a Backward on this replica.
        self._cache: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        # How many it keeps: the job's `activation_cache`, within the serving peer's own limit
        # (the servicer sets it: `Limits.activation_cache`).
        self.activation_cache = job.runtime.activation_cache
        self.updates = UpdateLog(job.runtime.update_log_bytes)  # for replicas copying this one
        self.snapshots = Snapshots()  # states being sent, sharing this replica's tensors
        # (step, clipping coefficient) of the last update applied here (step -1: none since the
        # start or the last state loaded), for a coordinator finishing a half-applied commit
        self.applied: tuple[int, float] = (-1, 1.0)
        # A copy of another replica that still applies that replica's updates (`apply_followed`)
        # until it is a member: the first PREPARE or Discard it gets ends that.
        self.following = False
        # pool.mode = "local": the round's start, the outer optimizer and this replica's samples
        # in the round (`stage_server.local_round`); None: every step is averaged
        # (or delayed_update's eager rule: rounds of one step, `swarm.job.rule`)
        self.round = LocalRound(job, self.params, self._inner) if rule_of(job).rounds else None

    # -- validation -----------------------------------------------------------------------------
    def _check_step(self, step: int, next_ok: bool = False) -> None:
        """`step` must be this replica's; with `next_ok` under delayed_update, or the next."""
        if step != self.step and not (next_ok and self.delayed and step == self.step + 1):
            raise FailedPrecondition(
                f"stage {self.stage} is at step {self.step}; microbatch of step {step} is stale"
                if step < self.step
                else f"stage {self.stage} is at step {self.step}; step {step} has not started here"
            )

    # -- the parameters each step computes on ---------------------------------------------------
    def _copy(self, into: torch.nn.Module | None = None) -> torch.nn.Module:
        """A copy of the module with the optimizer's parameters now (`into`, an unused copy, is
        overwritten rather than a new one made)."""
        if into is None:
            return copy.deepcopy(self.module)
        with torch.no_grad():
            for q, p in zip(into.parameters(), self.params, strict=True):
                q.copy_(p)
        return into

    def _module_at(self, step: int) -> torch.nn.Module:
        """The module step `step` computes with (whose parameters it takes gradients of)."""
        if not self.delayed:
            return self.module
        module = self._versions.get(computes_on(self.job, step))
        if module is None:
            raise FailedPrecondition(
                f"stage {self.stage} at step {self.step} no longer holds the parameters step "
                f"{step} computes on"
            )
        return module

    def _params_at(self, step: int) -> list[torch.Tensor]:
        if not self.delayed:
            return list(self.params)
        return list(self._module_at(step).parameters())

    def _run(self, step: int, x: torch.Tensor) -> torch.Tensor:
        return self._module_at(step)(x)  # type: ignore[no-any-return]

    # -- compute --------------------------------------------------------------------------------
    def _leaf(self, inputs: torch.Tensor) -> torch.Tensor:
        # Token ids are not differentiable; hidden states become leaves whose .grad we return.
        return inputs if self.is_first else inputs.detach().requires_grad_(True)

    def forward(
        self, step: int, index: int, inputs: torch.Tensor, *, evaluate: bool = False
    ) -> torch.Tensor:
        """The stage's outputs; kept with their graph for this microbatch's Backward, unless
        `evaluate` (a validation microbatch: no Backward follows, no graph is built)."""
        self._check_step(step, next_ok=True)
        if evaluate:
            with torch.no_grad(), precision(self.job, self.device):
                return self._run(step, self.checks.inputs(inputs))
        x = self._leaf(self.checks.inputs(inputs))
        with torch.enable_grad(), precision(self.job, self.device):
            out = self._run(step, x)
        self._cache[(step, index)] = (x, out)
        self._cache.move_to_end((step, index))
        while len(self._cache) > self.activation_cache:
            self._cache.popitem(last=False)  # the oldest; its Backward will recompute
        return out.detach()

    def backward(
        self,
        step: int,
        index: int,
        inputs: torch.Tensor | None,
        grad_outputs: torch.Tensor,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
    ) -> tuple[torch.Tensor | None, Receipt]:
        """Backward of microbatch `(step, index)`. `inputs` may be None when this replica did the
        forward: then its cached activations must still be here."""
        self._check_step(step, next_ok=True)
        cached = self._cache.pop((step, index), None)
        if cached is None and inputs is None:
            raise ActivationsNotCached(
                f"{ActivationsNotCached.PREFIX} for microbatch ({step}, {index}) at stage "
                f"{self.stage}; send its inputs"
            )
        if cached is None:  # another replica did the forward, or the cache evicted it
            assert inputs is not None
            x = self._leaf(self.checks.inputs(inputs))
            with torch.enable_grad(), precision(self.job, self.device):
                out = self._run(step, x)
        else:
            x, out = cached
        grad = self.checks.grad(grad_outputs, out)
        return self._backprop(step, index, x, out, grad, accumulate, need_grad_inputs)

    def forward_backward(
        self,
        step: int,
        index: int,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
    ) -> tuple[float, torch.Tensor | None, Receipt]:
        if not self.is_last:
            raise InvalidArgument(
                f"ForwardBackward is for the last stage; this is stage {self.stage}"
            )
        self._check_step(step, next_ok=True)
        x = self._leaf(self.checks.inputs(inputs))
        y = self.checks.targets(targets, x)
        with torch.enable_grad(), precision(self.job, self.device):
            loss = loss_sum(self._run(step, x), y)
        grad_x, receipt = self._backprop(step, index, x, loss, None, accumulate, need_grad_inputs)
        return float(loss.detach()), grad_x, receipt

    def evaluate(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The last stage's loss sum of a validation microbatch: forward only, nothing kept,
        nothing accumulated."""
        if not self.is_last:
            raise InvalidArgument(f"the loss is the last stage's; this is stage {self.stage}")
        self._check_step(step, next_ok=True)
        x = self.checks.inputs(inputs)
        y = self.checks.targets(targets, x)
        with torch.no_grad(), precision(self.job, self.device):
            return float(loss_sum(self._run(step, x), y))

    def _backprop(
        self,
        step: int,
        index: int,
        x: torch.Tensor,
        out: torch.Tensor,
        grad: torch.Tensor | None,
        accumulate: bool,
        need_grad_inputs: bool,
    ) -> tuple[torch.Tensor | None, Receipt]:
        want_x = need_grad_inputs and not self.is_first
        params = self._params_at(step)
        samples = int(x.shape[0])
        sums = self._sums.setdefault(step, _Sums())
        duplicate = index in sums.receipts
        receipt = Receipt(self.stage, step, index, samples, duplicate and accumulate)
        if accumulate and not duplicate:
            if sums.accum is None:
                # One flat tensor (which averaging reads as it is) of -0.0, the one value x + v
                # leaves x as it is whatever x, the sign of a zero included: the first
                # microbatch's gradients land in it with their own bits.
                sums.accum = _flat_copy(self.params, fill=-0.0)
            elif sums.lent:  # a straggler after PREPARE: the prepared sums stay as they are
                copy = _flat_copy(sums.accum)
                if sums.spill is not None:  # averaged in place: the sums as they were
                    whole = flat_view(copy)
                    assert whole is not None  # a copy of one flat tensor is one
                    sums.spill.restore(into=whole)
                sums.accum, sums.lent, sums.spill = copy, False, None
            sums.receipts[index] = samples
            return self._backprop_into(sums.accum, params, x, out, grad, want_x), receipt
        targets = [*params, x] if want_x else list(params)
        grads = torch.autograd.grad(out, targets, grad, allow_unused=True)
        return (grads[-1] if want_x else None), receipt

    @staticmethod
    def _backprop_into(
        accum: list[torch.Tensor],
        params: list[torch.Tensor],
        x: torch.Tensor,
        out: torch.Tensor,
        grad: torch.Tensor | None,
        want_x: bool,
    ) -> torch.Tensor | None:
        """Backward of `out` adding the parameters' gradients into `accum` in place, as autograd
        makes them (a parameter's `.grad` is its sum while it runs: the same bits as adding the
        gradients after, without the whole gradient existing once more beside the sums); the
        gradient of `x` when `want_x`."""
        for p, acc in zip(params, accum, strict=True):
            p.grad = acc
        try:
            torch.autograd.backward(out, grad, inputs=[*params, x] if want_x else list(params))
            return x.grad if want_x else None
        finally:
            for p in params:
                p.grad = None

    # -- commit ---------------------------------------------------------------------------------
    def receipts(self, step: int | None = None) -> dict[int, int]:
        """What this replica accumulated for `step` (its own step by default): index -> samples."""
        sums = self._sums.get(self.step if step is None else step)
        return dict(sums.receipts) if sums is not None else {}

    def commit(self, step: int, microbatches: list[int], total_samples: int) -> bool:
        """Prepare and apply step `step` from this replica's gradients alone (a pool of one).
        Returns True when `step` was already applied (a retried commit), which changes nothing."""
        if step < self.step:
            return True
        self.prepare(step, microbatches, total_samples)
        self.set_prepared(step, self._accum_or_zeros(), total_samples)
        return self.apply(step)

    def prepare(self, step: int, microbatches: list[int], total_samples: int) -> list[torch.Tensor]:
        """Check that this replica holds exactly the receipts of `microbatches` for `step` and
        return its gradient sums (zeros if it holds none): the replica's part of the average."""
        self._check_step(step)
        self.following = False  # a member now: its updates come from its own pool
        sums = self._sums.get(step, _Sums())
        expected, held = set(microbatches), set(sums.receipts)
        if expected != held:
            missing, extra = sorted(expected - held), sorted(held - expected)
            raise FailedPrecondition(
                f"stage {self.stage} step {step}: receipts missing for microbatches {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}, unexpected {extra[:10]}"
            )
        if total_samples < 0 or (total_samples == 0 and (self.round is None or sums.receipts)):
            # A local step of a replica that took no sample moves nothing (and 0 says so)
            raise InvalidArgument(f"total_samples must be positive; got {total_samples}")
        # The sums themselves, lent to the commit (one flat tensor, which averaging reads as it
        # is): a late Backward (a straggler's duplicate, which the ledger counts elsewhere) must
        # not reach what this replica averages and applies, so it adds into a copy
        # (`_backprop`): the copy is made when such a Backward comes, not at every commit.
        if sums.accum is None:
            return self._zeros()
        if sums.spill is not None:  # a retry: the last round overwrote some, in place
            sums.spill.restore()
        if self._prepared is not None and self._prepared[0] == step:
            self._prepared = None  # that was the sums, averaged in place: prepared anew now
        sums.lent = True
        return list(sums.accum)

    def spill(self, step: int, directory: Path | None) -> Spill | None:
        """Where the averaging of `step`'s lent sums keeps what it overwrites in place (in
        `directory`, None: in memory); None when they are not one flat tensor on the CPU (the
        part averaged is then a copy, or a device's: nothing to keep)."""
        sums = self._sums.get(step)
        if sums is None or sums.accum is None or not sums.lent:
            return None
        if sums.spill is None:
            flat = flat_view(sums.accum)
            if flat is None or flat.device.type != "cpu":
                return None
            sums.spill = Spill(flat, directory)
        return sums.spill

    def _zeros(self) -> list[torch.Tensor]:
        return _flat_copy(self.params, fill=0.0)

    def _accum_or_zeros(self) -> list[torch.Tensor]:
        sums = self._sums.get(self.step)
        return sums.accum if sums is not None and sums.accum is not None else self._zeros()

    def set_prepared(self, step: int, grad_sums: list[torch.Tensor], total_samples: int) -> None:
        """Keep the pool's summed gradient for `step` until `apply`."""
        self._check_step(step)
        self._prepared = (step, grad_sums, total_samples)

    def prepared_sq_norm(self, step: int) -> float:
        """The squared L2 norm of the pool's averaged gradient prepared for `step`: this stage's
        part of the whole model's norm, which the coordinator clips by."""
        self._check_step(step)
        if self._prepared is None or self._prepared[0] != step:
            raise FailedPrecondition(f"stage {self.stage}: step {step} was not prepared")
        _, grad_sums, total_samples = self._prepared
        if total_samples == 0:  # a local step of a replica that took no sample moves nothing
            return 0.0
        # ||sums / n||^2 = ||sums||^2 / n^2: no divided copy of every gradient on each commit
        return grad_sq_norm(grad_sums) / total_samples**2

    def apply(self, step: int, scale: float = 1.0) -> bool:
        """Apply the prepared step, its gradient clipped by `scale`. True when `step` was
        already applied."""
        if step < self.step:
            return True
        self._check_step(step)
        if self._prepared is None or self._prepared[0] != step:
            raise FailedPrecondition(f"stage {self.stage}: step {step} was not prepared")
        _, grad_sums, total_samples = self._prepared
        self.apply_update(grad_sums, total_samples, scale)
        return False

    # -- rounds (pool.mode = "local") -----------------------------------------------------------
    def _local_round(self, boundary: int) -> LocalRound:
        if self.round is None:
            raise FailedPrecondition(f'stage {self.stage}: rounds are for pool.mode = "local"')
        if boundary != self.step or not is_boundary(self.job, boundary):
            raise FailedPrecondition(
                f"stage {self.stage} is at step {self.step}: no round of it ends at {boundary}"
            )
        return self.round

    def synced(self, boundary: int) -> bool:
        """Whether the round ending at `boundary` was applied here already (a retry)."""
        return self.round is not None and self.round.synced >= boundary

    def prepare_round(self, boundary: int) -> list[torch.Tensor]:
        """This replica's part of the round's average, which ends before step `boundary`."""
        self.following = False  # a member now: its updates come from its own pool
        return self._local_round(boundary).pseudo_gradient()

    def set_round(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        """Keep the pool's summed pseudo-gradient until `apply_round`."""
        self._local_round(boundary).set_prepared(boundary, sums, total_samples)

    def apply_round(self, boundary: int) -> bool:
        """The round's outer step; True when it was applied before."""
        if self.synced(boundary):
            return True
        rnd = self._local_round(boundary)
        prepared = rnd.prepared(boundary)
        if prepared is not None:  # for the replicas copying this one, before it is divided
            self.updates.record(boundary, prepared[0], prepared[1], round_end=True)
        self.snapshots.detach()  # the outer step changes the state in place
        return rnd.apply(boundary)

    # -- pool.overlap = "eager" (`stage_server.local_round`) --------------------------------------
    def eager_step(self, boundary: int, total_samples: int) -> bool:
        """The outer step of the round ending at `boundary`, without waiting for its average;
        True when it was applied before."""
        self._eager_round()
        if self.synced(boundary):
            return True
        rnd = self._local_round(boundary)
        self.following = False  # a member now: its updates come from its own pool
        self.snapshots.detach()  # the outer step changes the state in place
        fresh = rnd.eager_step(boundary, total_samples)
        if fresh is not None:  # for the replicas copying this one
            self.updates.record(boundary, fresh, total_samples, round_end=True, eager=Eager.STEP)
        return False

    def eager_part(self, boundary: int) -> list[torch.Tensor]:
        """This replica's share of the round that ended at `boundary`, for the pool to sum."""
        return self._eager_round().shared_part(boundary)

    def set_average(self, boundary: int, sums: list[torch.Tensor]) -> None:
        """The pool's sum of the shares of the round that ended at `boundary` arrived."""
        self.snapshots.detach()  # a state being sent holds the last average
        self._eager_round().set_average(boundary, sums)
        self.updates.record(
            self.step, sums, 0, round_end=True, eager=Eager.AVERAGE, boundary=boundary
        )

    def last_part(self, boundary: int, total_samples: int) -> list[torch.Tensor]:
        """The job's last round: this replica's fresh share, summed by the pool at once."""
        self._eager_round()
        return self._local_round(boundary).last_part(boundary, total_samples)

    def set_last(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        self._local_round(boundary).set_last(boundary, sums, total_samples)

    def last_step(self, boundary: int) -> bool:
        """The last round's outer step with the pool's whole sum; True when applied before."""
        self._eager_round()
        if self.synced(boundary):
            return True
        self.snapshots.detach()
        return self._local_round(boundary).last_step(boundary)

    def mean_part(self, boundary: int) -> list[torch.Tensor]:
        """This replica's round start after the job's last round, for the members' mean."""
        rnd = self._eager_round()
        if not (boundary == self.step and self.synced(boundary)):
            raise FailedPrecondition(f"stage {self.stage}: the last round ({boundary}) is not "
                                     f"applied here (at step {self.step})")  # fmt: skip
        return rnd.start

    def set_mean(self, sums: list[torch.Tensor], members: int) -> None:
        """The trained model: the members' mean (`sums` of their starts over `members`)."""
        self.snapshots.detach()
        self._eager_round().set_mean(sums, members)

    def _eager_round(self) -> LocalRound:
        if self.round is None or not self.round.eager:
            raise FailedPrecondition(f'stage {self.stage}: not a job with pool.overlap = "eager"')
        return self.round

    @property
    def copy_step(self) -> int:
        """The step this replica is a whole copy at: its step, unless (pool.mode = "local") a
        round ends there that it has not applied yet, or (pool.overlap = "eager") the pool's
        average of its last round has not arrived."""
        if self.round is not None and (
            (is_boundary(self.job, self.step) and not self.synced(self.step)) or self.round.pending
        ):
            return self.step - 1
        return self.step

    def discard(self, step: int) -> int:
        """Void this replica's gradients of `step` (they will be replayed elsewhere); returns how
        many microbatches were dropped."""
        self._check_step(step, next_ok=True)
        self.following = False
        sums = self._sums.pop(step, _Sums())
        sums.drop()
        dropped = len(sums.receipts)
        if step == self.step:
            self._prepared = None
        return dropped

    def apply_update(
        self, grad_sums: list[torch.Tensor], total_samples: int, scale: float = 1.0
    ) -> None:
        """One optimizer step with gradient `scale * grad_sums / total_samples` at the step's
        learning rate (`swarm.model.optim.update`, as the reference); then the next step."""
        # Recorded first (a copy, only while a peer follows): the mean is taken in place below.
        self.updates.record(self.step, grad_sums, total_samples, scale)
        self.snapshots.detach()  # the state changes in place
        # This step's own sums: not needed once prepared (averaged in place, they are
        # `grad_sums` now; a replica alone prepares them as they are).
        self._sums.pop(self.step, _Sums()).drop()
        if self.round is not None and self.round.gradients:  # step_eager: the step's end
            self.round.stash(grad_sums, total_samples)  # applies them (`eager_step`)
        elif total_samples > 0:  # a local step without samples (pool.mode = "local") moves nothing
            for p, g in zip(self.params, grad_sums, strict=True):
                # In place: the prepared sums are this step's alone (a retried APPLY of an
                # applied step changes nothing), so the mean takes no memory of its own.
                p.grad = g.div_(total_samples)
            update(self.optimizer, self.job, self.step, scale)
            if self.round is not None:
                self.round.samples += total_samples
        self.applied = (self.step, scale)
        self.step += 1
        self._prepared = None
        # Activations of the old step are useless now; with delayed_update the next step's
        # (already under way, on a copy of the parameters) are kept.
        for key in [k for k in self._cache if k[0] < self.step]:
            del self._cache[key]
        if self.delayed:  # step + 1 computes on these; step - 1's copy is free for them
            unused = [v for v in self._versions if v < self.step - 1]
            spare = self._versions.pop(unused[0]) if unused else None
            for version in unused[1:]:
                del self._versions[version]
            self._versions[self.step] = self._copy(spare)

    def _inner(self, grad: list[torch.Tensor], step: int) -> None:
        """delayed_update's eager rule (`step_eager`): step `step`'s update with `grad` (the
        last step's average plus this replica's fresh share minus its last share)."""
        for p, g in zip(self.params, grad, strict=True):
            p.grad = g
        update(self.optimizer, self.job, step)

    # -- state transfer -------------------------------------------------------------------------
    # What a request or a state to load may hold (`stage_server.tensor_checks`).
    def max_request_bytes(self) -> int:
        return self.checks.max_request_bytes()

    def max_state_bytes(self) -> int:
        return self.checks.max_state_bytes()

    def check_state_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self.checks.state_tensor(name, tensor)

    def snapshot(self, include_optimizer: bool = True) -> Snapshot:
        """`export_state` as a `Snapshot` sharing the parameters and optimizer state (copied only
        if this replica changes them before they are sent)."""
        state, shared = stage_state.share_state(self.module, self.optimizer, include_optimizer)
        state.update(self._extra_state(include_optimizer))
        return self.snapshots.open(self.step, state, shared)

    def export_state(self, include_optimizer: bool = True) -> dict[str, torch.Tensor]:
        """This replica's state in the stage-state format (`swarm.model.stage_state`). A whole state
        (`include_optimizer`) of a delayed_update job also holds the parameters step `step`
        computes on, as `prev/<name>`: a copy must compute as this replica does."""
        state = stage_state.export_state(self.module, self.optimizer, include_optimizer)
        state.update(self._extra_state(include_optimizer))
        return state

    def _extra_state(self, include_optimizer: bool) -> dict[str, torch.Tensor]:
        """Copies of what a whole state holds besides the module and its optimizer."""
        state: dict[str, torch.Tensor] = {}
        if self.round is not None and include_optimizer:
            state.update(self.round.export(self._param_names()))
        if self.delayed and include_optimizer:
            for name, p in self._module_at(self.step).named_parameters():
                state[f"prev/{name}"] = p.detach().cpu().clone()
        return state

    def load_state(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """Become the replica whose `export_state` this is, at `step`."""
        self.snapshots.detach()  # the state changes in place
        try:
            stage_state.load_state(self.module, self.optimizer, state)
        except InvalidArgument as e:
            raise InvalidArgument(f"stage {self.stage}: {e}") from e
        if self.delayed:
            self._load_prev(step, state)
        if self.round is not None:
            self.round.load(self._param_names(), state, step)
        self.step = step
        self._sums, self._prepared = {}, None
        self._cache.clear()
        self.updates.clear()  # its followers copied another state: they start again
        self.following = False
        self.applied = (-1, 1.0)

    def _load_prev(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """The copies of the parameters steps `step` and `step + 1` compute on, from `state`
        (its `prev/` tensors; at step 0 they are the parameters themselves)."""
        current = self._copy()
        older = copy.deepcopy(self.module)
        with torch.no_grad():
            for name, p in older.named_parameters():
                prev = state.get(f"prev/{name}")
                if prev is None:
                    if computes_on(self.job, step) != step:
                        raise InvalidArgument(
                            f"stage {self.stage}: a delayed_update state of step {step} must "
                            "hold the parameters before its last update (prev/<name>)"
                        )
                    self._versions = {step: current}
                    return
                p.copy_(prev)
        self._versions = {computes_on(self.job, step): older, step: current}

    def load_copy(
        self, step: int, state: dict[str, torch.Tensor], began: int | None = None
    ) -> None:
        """Become a copy of the replica whose state at `step` this is, and follow its updates.
        `began`: this replica's step when the copy started. One that moved since (it applied a
        commit as a member meanwhile) is not overwritten by the copy, which may be older than
        what it holds: FailedPrecondition, and it stays as it is."""
        if began is not None and self.step != began:
            raise FailedPrecondition(
                f"stage {self.stage}: this replica moved from step {began} to {self.step} while "
                f"copying a state of step {step}: the copy is stale, not loaded"
            )
        self.load_state(step, state)
        self.following = True

    def apply_followed(
        self,
        step: int,
        grad_sums: list[torch.Tensor],
        total_samples: int,
        scale: float = 1.0,
        round_end: bool = False,
        eager: int = Eager.NONE,
        boundary: int = -1,
    ) -> bool:
        """Apply the update the copied replica applied at `step`, as it did (same sums, same
        samples, same optimizer code: bitwise the same result). False once this replica stopped
        following (it is a member, or holds work of its own): nothing is applied then."""
        if not self.following or any(s.receipts for s in self._sums.values()) or self._prepared:
            self.following = False
            return False
        if round_end and eager == Eager.AVERAGE:  # what the pool summed, whenever it arrived
            rnd = self._eager_round()
            if rnd.averaged < boundary:
                self.set_average(boundary, [g.to(self.device) for g in grad_sums])
            return True
        if round_end and eager == Eager.STEP:
            if not self.synced(step):
                rnd = self._eager_round()
                self._local_round(step)  # refused before anything is recorded or detached
                fresh = [g.to(self.device) for g in grad_sums]
                self.updates.record(step, fresh, total_samples, round_end=True, eager=Eager.STEP)
                self.snapshots.detach()
                rnd.followed_step(step, fresh)
            return True
        if round_end:  # pool.mode = "local": the round's end before step `step`
            if not self.synced(step):
                sums = [g.to(self.device) for g in grad_sums]
                self.updates.record(step, sums, total_samples, round_end=True)  # its followers
                self.snapshots.detach()  # the outer step changes the state in place
                self._local_round(step).outer_step(step, sums, total_samples)
            return True
        if step < self.step:
            return True  # applied already
        if step > self.step:
            raise FailedPrecondition(f"stage {self.stage}: update of step {step} at {self.step}")
        self.apply_update([g.to(self.device) for g in grad_sums], total_samples, scale)
        return True

    # -- state ----------------------------------------------------------------------------------
    def _param_names(self) -> list[str]:
        return [name for name, _ in self.module.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.module.state_dict().items()}

    @property
    def total_layers(self) -> int:
        return num_layers(self.job.model)


def _flat_copy(tensors: Sequence[torch.Tensor], fill: float | None = None) -> list[torch.Tensor]:
    """Copies of `tensors` (or, with `fill`, tensors like them holding that value) as views of
    one flat tensor, when they share a dtype and device (else one tensor each)."""
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return [t.detach().clone() if fill is None else torch.full_like(t, fill) for t in tensors]
    first = tensors[0]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)
    if fill is not None:
        flat.fill_(fill)
    views, start = [], 0
    for t in tensors:
        view = flat[start : start + t.numel()].view(t.shape)
        if fill is None:
            view.copy_(t.detach())
        views.append(view)
        start += t.numel()
    return views


Served = Callable[[], StageRuntime]
"""The stage a replica serves now (its servicer's `runtime`); raises NotFound while it serves none.
The servicer's parts take this, not a runtime, because they read it at the moments the servicer
did: a stage released or replaced during a call is seen there, as before."""
