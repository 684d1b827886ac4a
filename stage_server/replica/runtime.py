"""One replica's compute: forward, backward (from cached activations or by recomputing),
per-step gradient accumulation with receipts, and the optimizer update at commit.

What differs by the job's training rule (`swarm.job.rule`) is each a strategy chosen once here:
the parameters each step computes on (`stage_server.replica.delayed_copies`: the module itself, or
delayed_update's copies one update old) and the replica's round (`stage_server.replica.no_round`:
none, a local round, an eager round or the step-eager round). The step's sums and receipts are
`stage_server.replica.step_sums`'s; a copy following its source, `stage_server.replica.following`'s.

Pure torch, no networking: the servicer calls these methods from one worker thread, so nothing here
is shared between threads.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from stage_server.replica.accumulate import backprop_into
from stage_server.replica.activation_cache import ActivationCache
from stage_server.replica.following import Following
from stage_server.replica.gradient_digest import backprop_apart
from stage_server.replica.in_flight import PushesInFlight
from stage_server.replica.prior_params import PriorParams
from stage_server.replica.round_choice import ROUNDS
from stage_server.replica.snapshot import Snapshot, Snapshots
from stage_server.replica.step_sums import Receipt, Sent, Sums, another_run
from stage_server.replica.tensor_checks import Given, TensorChecks
from stage_server.replica.update_log import UpdateLog
from swarm.device.compiled import CompiledRuns
from swarm.device.kernels import apply_kernels
from swarm.device.oom import inject, named
from swarm.device.sharing import DeviceMemory, FixedWindow, TorchDeviceMemory, Window
from swarm.errors import ActivationsNotCached, FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model import stage_state
from swarm.model.cast_once import step_precision
from swarm.model.low_copies import LowCopies
from swarm.model.optim import build_optimizer, grad_sq_norm, scale_grads, update
from swarm.model.transformer import (
    DTYPES,
    build_stage,
    layer_costs,
    loss_sum,
    num_layers,
    partition,
)
from swarm.ops.faults import Point, due
from swarm.rpc.state_streams import Update

__all__ = ["Receipt", "Served", "StageRuntime"]


class StageRuntime:
    def __init__(self, job: JobConfig, stage: int, device: torch.device | str = "cpu") -> None:
        self.job, self.stage, self.device = job, stage, torch.device(device)
        self.dtype = DTYPES[job.training.dtype]
        self.layers = list(partition(layer_costs(job.model), job.training.stages)[stage])
        self.is_first = stage == 0
        self.is_last = stage == job.training.stages - 1
        apply_kernels(job, self.device)  # TF32 as the job says; deterministic where it audits
        self.module = build_stage(job, stage, self.device)
        self.checks = TensorChecks(job, stage, self.module, self.device)  # what it accepts
        self.params = list(self.module.parameters())
        self.optimizer = build_optimizer(self.params, job.optimizer)
        self.step = 0  # steps committed so far; the step being accumulated
        # states loaded so far (a rollback's, a copy's): a copy begun before one is stale even
        # where the load left the step as it was (`stage_server.replica.following`)
        self.loads = 0
        self.rule = rule_of(job)
        # the parameters each step computes on: the module's, delayed_update's copies, an audit's
        self.copies = PriorParams.of(job, stage, self.module)
        self.sums = Sums(self.params)  # step -> its sums: `step`, and `step + 1` if delayed
        self.in_flight = PushesInFlight()  # the accumulating calls not yet ended, for Info
        # (step, index) -> (leaf input, output with its graph), for a Backward on this replica.
        self._cache = ActivationCache()
        self.compiled: CompiledRuns | None = None  # eager unless the server compiles (CUDA)
        self.low = LowCopies.of(job)  # bf16-mixed: the Linears' bf16 copies (`low_copies`)
        # How many it keeps (the job's `activation_cache` within the peer's limit) and how many
        # bytes (`window`: the peer's `--max-activation-cache-bytes`, or its part of its device):
        # the servicer sets both (`Limits.bound`), the window through the device's `memory`.
        self.activation_cache = job.runtime.activation_cache
        self.memory: DeviceMemory = TorchDeviceMemory()
        self.window: Window = FixedWindow()
        self.updates = UpdateLog(job.runtime.update_log_bytes)  # for replicas copying this one
        self.snapshots = Snapshots()  # states being sent, sharing this replica's tensors
        # (step, clipping coefficient) of the last update applied here (step -1: none since the
        # start or the last state loaded), for a coordinator finishing a half-applied commit
        self.applied: tuple[int, float] = (-1, 1.0)
        # A copy of another replica that still applies that replica's updates (`follow`) until
        # it is a member: the first PREPARE, round's end or Discard it gets ends that.
        self.following = False
        self.follow = Following(self)
        # The replica's round, chosen once from the job's rule (`ROUNDS`): under a local rule
        # the round's start, the outer optimizer and this replica's samples in the round;
        # `NoRound` where every step is averaged.
        self.round = ROUNDS[self.rule.kind](job, self)

    # -- validation -----------------------------------------------------------------------------
    def _check_step(self, step: int, next_ok: bool = False) -> None:
        """`step` must be this replica's; with `next_ok` under delayed_update, or the next."""
        if self.copies.holds(step):  # an audit's late re-execution of the step before
            return
        if step != self.step and not (
            next_ok and self.step < step <= self.step + self.copies.ahead
        ):
            raise FailedPrecondition(
                f"stage {self.stage} is at step {self.step}; microbatch of step {step} is stale"
                if step < self.step
                else f"stage {self.stage} is at step {self.step}; step {step} has not started here"
            )

    def _run(self, step: int, given: Given) -> torch.Tensor:
        """The stage's outputs of `given` (its inputs as accepted, and the token ids beside)."""
        module = self.copies.module_at(step, self.step)  # the parameters step `step` computes on
        x, tokens = given.hidden, self.checks.tokens(given)
        if self.compiled is not None and tokens is None:  # CUDA, --compile-stage
            return self.compiled.run(module, x)  # (`swarm.device.compiled`)
        if self.low is not None:
            return self.low.call(module, (x, tokens))  # type: ignore[no-any-return]
        return module(x, tokens)  # type: ignore[no-any-return]

    def _precision(self, step: int) -> AbstractContextManager[None]:
        """Where step `step` computes (`swarm.model.cast_once`)."""
        return step_precision(self.job, self.device, lambda: self.copies.params_at(step, self.step))

    def _named(self, what: str, tensor: torch.Tensor) -> AbstractContextManager[None]:
        """Out of device memory in `what` (of a microbatch like `tensor`): a clear error
        (`swarm.device.oom`) naming the job, this stage and the free memory."""
        samples = int(tensor.shape[0]) if tensor.dim() else 1
        return named(self.job.name, self.stage, what, self.device, samples=samples)

    # -- compute --------------------------------------------------------------------------------
    def _leaf(self, inputs: torch.Tensor) -> torch.Tensor:
        # Token ids are not differentiable; hidden states become leaves whose .grad we return.
        return inputs if self.is_first else inputs.detach().requires_grad_(True)

    def forward(
        self,
        step: int,
        index: int,
        given: Given,
        *,
        evaluate: bool = False,
        holder: str = "",
    ) -> torch.Tensor:
        """The stage's outputs of what crossed into it (`given`: its inputs, and the token ids
        a subspace boundary, `model.boundary_rank`, needs at every stage after the first); kept
        with their graph for this microbatch's Backward by the same `holder` (the caller:
        `stage_server.replica.activation_cache`), unless `evaluate` (a validation microbatch:
        no Backward follows, no graph is built)."""
        self._check_step(step, next_ok=True)
        if evaluate:
            with torch.no_grad(), self._precision(step), self._named("Forward", given.hidden):
                return self._run(step, given.carrying(self.checks.inputs(given.hidden)))
        x = self._leaf(self.checks.inputs(given.hidden))
        with (
            torch.enable_grad(),
            self._precision(step),
            self._named("Forward", x),
            self._cache.counting(self.device, self.memory) as held,
        ):
            inject(Point.FORWARD_OOM, step)
            out = self._run(step, given.carrying(x))
        key = (step, index, holder)
        self._cache.keep(key, x, out, held, self.activation_cache, self.window)
        return out.detach()

    @property
    def cached_footprint(self) -> int:
        return self._cache.footprint  # the mean bytes of a microbatch's activations (0: none yet)

    @property
    def cache_evictions(self) -> int:
        """Microbatches the cache dropped to its bounds (each Backward recomputes one)."""
        return self._cache.evictions

    def backward(
        self,
        step: int,
        index: int,
        given: Given | None,
        grad_outputs: torch.Tensor,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
        digest_seed: int = 0,
        holder: str = "",
        run: int = 0,
    ) -> tuple[torch.Tensor | None, Receipt]:
        """Backward of microbatch `(step, index)`. What crossed in (`given`, as for `forward`)
        may be None when this replica did the forward for the same `holder`: then its cached
        activations must still be here. `run`: the push-plane run it accumulates under
        (`StepSums.other_run`)."""
        self._check_step(step, next_ok=True)
        cached = self._cache.take((step, index, holder))
        if cached is None and given is None:
            raise ActivationsNotCached(
                f"{ActivationsNotCached.PREFIX} for microbatch ({step}, {index}) at stage "
                f"{self.stage}; send its inputs"
            )
        with self._named("Backward", grad_outputs):
            if cached is None:  # another replica did the forward, or the cache evicted it
                assert given is not None
                x = self._leaf(self.checks.inputs(given.hidden))
                with torch.enable_grad(), self._precision(step):
                    out = self._run(step, given.carrying(x))
            else:
                x, out = cached
            grad = self.checks.grad(grad_outputs, out)
            return self._backprop(
                step, index, x, out, grad, accumulate, need_grad_inputs, digest_seed, run
            )

    def forward_backward(
        self,
        step: int,
        index: int,
        given: Given,
        targets: torch.Tensor,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
        digest_seed: int = 0,
        holder: str = "",  # as `backward`'s: nothing is cached between two calls here
        run: int = 0,
    ) -> tuple[float, torch.Tensor | None, Receipt]:
        del holder
        if not self.is_last:
            raise InvalidArgument(
                f"ForwardBackward is for the last stage; this is stage {self.stage}"
            )
        self._check_step(step, next_ok=True)
        x = self._leaf(self.checks.inputs(given.hidden))
        y = self.checks.targets(targets, x)
        with self._named("ForwardBackward", x):
            with torch.enable_grad(), self._precision(step):
                inject(Point.FORWARD_OOM, step)
                loss = loss_sum(self._run(step, given.carrying(x)), y)
            grad_x, receipt = self._backprop(
                step, index, x, loss, None, accumulate, need_grad_inputs, digest_seed, run
            )
            return float(loss.detach()), grad_x, receipt

    def evaluate(
        self,
        step: int,
        given: Given,
        targets: torch.Tensor,
    ) -> float:
        """The last stage's loss sum of a validation microbatch: forward only, nothing kept,
        nothing accumulated."""
        if not self.is_last:
            raise InvalidArgument(f"the loss is the last stage's; this is stage {self.stage}")
        self._check_step(step, next_ok=True)
        x = self.checks.inputs(given.hidden)
        y = self.checks.targets(targets, x)
        with torch.no_grad(), self._precision(step):
            return float(loss_sum(self._run(step, given.carrying(x)), y))

    def _backprop(
        self,
        step: int,
        index: int,
        x: torch.Tensor,
        out: torch.Tensor,
        grad: torch.Tensor | None,
        accumulate: bool,
        need_grad_inputs: bool,
        digest_seed: int = 0,
        run: int = 0,
    ) -> tuple[torch.Tensor | None, Receipt]:
        if accumulate and not 0 <= index < self.job.training.microbatches_per_step:
            # a receipt for it would read to the coordinator as work the step never leased
            raise InvalidArgument(
                f"microbatch {index} of step {step} is none of the step's 0.."
                f"{self.job.training.microbatches_per_step - 1}"
            )
        want_x = need_grad_inputs and not self.is_first
        params = self.copies.params_at(step, self.step)
        samples = int(x.shape[0])
        sums = self.copies.sums_of(self.sums, step, self.step, accumulate)
        held = sums.other_run(index, run) if accumulate else None
        if held is not None:  # its header was looked at before (Busy), this is now
            raise FailedPrecondition(another_run(index, held, run))
        duplicate = index in sums.receipts
        receipt = Receipt(self.stage, step, index, samples, duplicate and accumulate)
        if accumulate and not duplicate:  # its receipt once the sums hold it whole
            fail = f"{Point.BACKWARD_OOM}@{step}" if due(Point.BACKWARD_OOM, step) else ""
            grad_x = backprop_into(
                sums, index, samples, self.params, params, x, out, grad, want_x, fail, self.low, run
            )
            return grad_x, receipt
        # nothing accumulated (an audit's re-execution, or a duplicate's)
        return backprop_apart(list(params), x, out, grad, want_x, receipt, digest_seed)

    # -- commit ---------------------------------------------------------------------------------
    def receipts(self, step: int | None = None) -> dict[int, int]:
        """What this replica accumulated for `step` (its own step by default): index -> samples."""
        return self.sums.receipts(self.step if step is None else step)

    def receipt_runs(self, step: int | None = None) -> dict[int, int]:
        """The push-plane run each of `step`'s receipts was accumulated under: index -> run."""
        return self.sums.runs(self.step if step is None else step)

    def commit(self, step: int, microbatches: list[int], total_samples: int) -> bool:
        """Prepare and apply step `step` from this replica's gradients alone (a pool of one).
        Returns True when `step` was already applied (a retried commit), which changes nothing."""
        if step < self.step:
            return True
        self.prepare(step, microbatches, total_samples)
        self.set_prepared(step, self.sums.accum_or_zeros(step), total_samples)
        return self.apply(step)

    def prepare(self, step: int, microbatches: list[int], total_samples: int) -> list[torch.Tensor]:
        """Check that this replica holds exactly the receipts of `microbatches` for `step` and
        return its gradient sums (zeros if it holds none): the replica's part of the average."""
        self._check_step(step)
        self.following = False  # a member now: its updates come from its own pool
        expected, held = set(microbatches), set(self.sums.receipts(step))
        if expected != held:
            missing, extra = sorted(expected - held), sorted(held - expected)
            raise FailedPrecondition(
                f"stage {self.stage} step {step}: receipts missing for microbatches {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}, unexpected {extra[:10]}"
            )
        if total_samples < 0 or (total_samples == 0 and (not self.round.EMPTY_STEPS or held)):
            # A local step of a replica that took no sample moves nothing (and 0 says so)
            raise InvalidArgument(f"total_samples must be positive; got {total_samples}")
        # The sums themselves, lent to the commit (`Sums.lend`): a late Backward adds into a copy.
        return self.sums.lend(step)

    def set_prepared(
        self, step: int, grad_sums: list[torch.Tensor], total_samples: int, sent: Sent = ()
    ) -> None:
        """Keep the pool's summed gradient for `step` until `apply` (`sent`: as the averaging's
        lossy codec carried it, for followers: `Update.encoded`)."""
        self._check_step(step)
        self.sums.set_prepared(step, grad_sums, total_samples, sent)

    def prepared_sq_norm(self, step: int) -> float:
        """The squared L2 norm of the pool's averaged gradient prepared for `step`: this stage's
        part of the whole model's norm, which the coordinator clips by."""
        grad_sums, total_samples = self._prepared(step)
        if total_samples == 0:  # a local step of a replica that took no sample moves nothing
            return 0.0
        # ||sums / n||^2 = ||sums||^2 / n^2: no divided copy of every gradient on each commit
        return grad_sq_norm(grad_sums) / total_samples**2

    def apply(self, step: int, scale: float = 1.0) -> bool:
        """Apply the prepared step, its gradient clipped by `scale`. True when `step` was
        already applied."""
        if step < self.step:
            return True
        grad_sums, total_samples = self._prepared(step)
        self.apply_update(grad_sums, total_samples, scale, self.sums.sent(step))
        return False

    def _prepared(self, step: int) -> tuple[list[torch.Tensor], int]:
        """The pool's summed gradient prepared for `step`, this replica's, and its samples."""
        self._check_step(step)
        prepared = self.sums.prepared(step)
        if prepared is None:
            raise FailedPrecondition(f"stage {self.stage}: step {step} was not prepared")
        return prepared

    @property
    def copy_step(self) -> int:
        """The step this replica is a whole copy at: its step, unless (pool.mode = "local") a
        round ends there that it has not applied yet, or (pool.overlap = "eager") the pool's
        average of its last round has not arrived."""
        return self.round.copy_step(self.step)

    def discard(self, step: int) -> int:
        """Void this replica's gradients of `step` (they will be replayed elsewhere); returns how
        many microbatches were dropped."""
        self._check_step(step, next_ok=True)
        self.following = False
        dropped = self.sums.drop(step)
        if step == self.step:
            self.sums.unprepare()
        return dropped

    def apply_update(
        self, grad_sums: list[torch.Tensor], total_samples: int, scale: float = 1.0, sent: Sent = ()
    ) -> None:
        """One optimizer step with gradient `scale * grad_sums / total_samples` at the step's
        learning rate (`swarm.model.optim.update`, as the reference); then the next step."""
        # Recorded first (a copy, only while a peer follows): the mean is taken in place below.
        self.updates.record(Update(self.step, grad_sums, total_samples, scale, encoded=sent))
        self.copies.keep(self.step, self.params)  # for the step's late audits, before it moves
        self.snapshots.detach()  # the state changes in place
        # This step's own sums: not needed once prepared (averaged in place, they are
        # `grad_sums` now; a replica alone prepares them as they are).
        self.sums.drop(self.step)
        # (the step-eager round keeps them for the step's end, which applies them)
        if not self.round.keeps(grad_sums, total_samples) and total_samples > 0:
            # (a local step without samples, pool.mode = "local", moves nothing)
            # In place: the prepared sums are this step's alone (a retried APPLY of an applied
            # step changes nothing), so the mean takes no memory of its own; one kernel over
            # the flat sums, then the clipping's in `update`.
            scale_grads(grad_sums, total_samples)
            for p, g in zip(self.params, grad_sums, strict=True):
                p.grad = g
            update(self.optimizer, self.job, self.step, scale)
            self.round.took(total_samples)
        self.applied = (self.step, scale)
        self.step += 1
        self.sums.unprepare()
        # Activations of the old step are useless now; with delayed_update the next step's
        # (already under way, on a copy of the parameters) are kept.
        for key in [k for k in self._cache if k[0] < self.step]:
            del self._cache[key]
        self.copies.applied(self.step)

    # -- state transfer -------------------------------------------------------------------------
    # What a request or a state to load may hold (`stage_server.replica.tensor_checks`).
    def max_state_bytes(self) -> int:
        return self.checks.max_state_bytes()

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
        if not include_optimizer:
            return {}
        state = self.round.export(self._param_names())
        state.update(self.copies.export(self.step))
        return state

    def load_state(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """Become the replica whose `export_state` this is, at `step`."""
        self.snapshots.detach()  # the state changes in place
        try:
            # what the copies and the round need of it, before anything is overwritten: a
            # refusal after the module's load left a replica a mix of two states
            self.copies.check(step, state)
            self.round.check(self._param_names(), state, step)
            stage_state.load_state(self.module, self.optimizer, state)
        except InvalidArgument as e:
            raise InvalidArgument(f"stage {self.stage}: {e}") from e
        self.copies.load(step, state)
        self.round.load(self._param_names(), state, step)
        self.step = step
        self.loads += 1
        self.sums.clear()
        self._cache.clear()
        self.updates.clear()  # its followers copied another state: they start again
        self.following = False
        self.applied = (-1, 1.0)

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


Served = Callable[[], StageRuntime]
"""The stage a replica serves now (its servicer's `runtime`); raises NotFound while it serves none.
The servicer's parts take this, not a runtime, because they read it at the moments the servicer
did: a stage released or replaced during a call is seen there, as before."""
