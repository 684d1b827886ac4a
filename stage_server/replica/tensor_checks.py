"""What one stage accepts from a peer: the tensors of a Forward, Backward or ForwardBackward
(inputs, targets, output gradients) and of a state to load (`swarm.model.state_checks`, shared
with every other receiver of a state), each checked against the stage's own shapes, dtypes and
bounds before any compute or allocation.

Why here and not at each use: a bad tensor must be refused with INVALID_ARGUMENT, never reach
torch (where it would be an internal error, or silently broadcast), and a size a peer declares
must be refused before its bytes are held (`max_request_bytes`, `max_state_bytes`). The checks
depend only on the job and the stage's structure, never on its parameters' values, so they hold
for every replica of the stage alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig
from swarm.model.boundary import boundary_of
from swarm.model.state_checks import StateChecks
from swarm.model.transformer import DTYPES
from swarm.wire.crossing import Crossing

__all__ = ["Given", "TensorChecks", "all_finite"]

Given = Crossing[torch.Tensor, torch.Tensor]
"""What crosses into a stage as the replica takes it: its inputs (stage 0's are the token ids),
and the microbatch's token ids beside them where the job's boundary needs them
(`swarm.model.boundary`)."""


class TensorChecks:
    """Checks for stage `stage` of `job`, whose module is `module`; accepted tensors are moved to
    `device`."""

    def __init__(
        self, job: JobConfig, stage: int, module: torch.nn.Module, device: torch.device
    ) -> None:
        self.job, self.stage, self.device = job, stage, device
        self.dtype = DTYPES[job.training.dtype]
        self.is_first = stage == 0
        self.boundary = boundary_of(job.model)
        self.width = self.boundary.width  # features per token crossing a boundary
        self.needs_tokens = self.boundary.needs_tokens and not self.is_first
        # A state of the stage: the same checks wherever one arrives (a copy, the scheduler).
        self.state = StateChecks(job, stage, module)
        # How an accepted tensor reaches the device: the server's copies (pinned buffers, their
        # own stream: `swarm.device.host_copies`) once it serves; a plain copy before.
        self.to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] = torch.Tensor.to

    def inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """Stage 0: int64 token ids [batch, seq] within the vocabulary; any other stage: hidden
        states [batch, seq, d_model] in the job's dtype ([batch, seq, boundary_rank] coefficients
        under `model.boundary_rank`). At most a microbatch of samples."""
        cfg = self.job.model
        if self.is_first:
            if inputs.dtype != torch.int64 or inputs.dim() != 2:
                raise InvalidArgument(
                    f"stage 0 takes int64 token ids [batch, seq]; got {inputs.dtype} "
                    f"{list(inputs.shape)}"
                )
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= cfg.vocab_size):
                raise InvalidArgument(f"token ids must lie in [0, {cfg.vocab_size})")
        elif inputs.dtype != self.dtype or inputs.dim() != 3 or inputs.shape[2] != self.width:
            raise InvalidArgument(
                f"stage {self.stage} takes {self.job.training.dtype} [batch, seq, {self.width}]; "
                f"got {inputs.dtype} {list(inputs.shape)}"
            )
        if not 1 <= inputs.shape[1] <= cfg.seq_len or inputs.shape[0] < 1:
            raise InvalidArgument(
                f"batch must be >= 1 and seq in 1..{cfg.seq_len}; got {list(inputs.shape)}"
            )
        if inputs.shape[0] > self.job.training.microbatch_size:  # activations grow with it
            raise InvalidArgument(
                f"batch of {inputs.shape[0]} samples; a microbatch has at most "
                f"training.microbatch_size = {self.job.training.microbatch_size}"
            )
        return self.to_device(inputs, self.device)

    def grad(self, grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The gradient of `like` (the stage's outputs): its shape and dtype."""
        if grad.shape != like.shape or grad.dtype != like.dtype:
            raise InvalidArgument(
                f"grad_outputs must be {like.dtype} {list(like.shape)}; "
                f"got {grad.dtype} {list(grad.shape)}"
            )
        return self.to_device(grad, self.device)

    def targets(self, targets: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The last stage's targets: int64 token ids [batch, seq] of `inputs`, in the vocabulary
        (under `model.boundary_rank` also as the push plane sends them, narrow: `wire_targets`)."""
        return self._ids("targets", self.boundary.widened(targets), inputs)

    def tokens(self, given: Given) -> torch.Tensor | None:
        """The microbatch's token ids that crossed beside a subspace boundary's coefficients
        (`given.hidden`): int64 [batch, seq] in the vocabulary, required after stage 0 under
        `model.boundary_rank`, and never taken elsewhere (None then)."""
        if not self.needs_tokens:
            return None
        if given.tokens is None:
            raise InvalidArgument(
                f"stage {self.stage} of a job with {self.boundary} needs the microbatch's token "
                'ids ("tokens")'
            )
        tokens = self.boundary.widened(given.tokens)  # sent narrow
        return self._ids("tokens", tokens, given.hidden)

    def _ids(self, name: str, ids: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        vocab = self.job.model.vocab_size
        if ids.dtype != torch.int64 or tuple(ids.shape) != tuple(inputs.shape[:2]):
            raise InvalidArgument(
                f"{name} must be int64 {list(inputs.shape[:2])}; got {ids.dtype} {list(ids.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InvalidArgument(f"{name} must lie in [0, {vocab})")
        return ids.to(self.device)

    def max_request_bytes(self) -> int:
        """The most tensor bytes a Forward, Backward or ForwardBackward of one microbatch can
        carry (two tensors of at most [microbatch_size, seq_len, d_model] 8-byte values): larger
        declared sizes are refused before anything is allocated."""
        m, t = self.job.model, self.job.training
        return 2 * t.microbatch_size * m.seq_len * max(m.d_model, 1) * 8

    def max_state_bytes(self) -> int:
        """The most bytes a state for this stage can take: LoadState refuses more."""
        return self.state.max_state_bytes()

    def state_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One tensor of a state to load must be one of this stage's (`StateChecks`)."""
        self.state.state_tensor(name, tensor)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating value of `tensors` is finite (True for none): one device sync for
    all of them, not one a tensor."""
    floats = [t for t in tensors if t.is_floating_point()]
    return not floats or bool(torch.stack([torch.isfinite(t).all() for t in floats]).all())
