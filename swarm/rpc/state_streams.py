"""The bounded streams a stage replica sends: its state (`DownloadState`) and the updates a follower
applies (`Updates`). Each is read as it comes, with a deadline that follows progress (and a state,
one for the whole transfer: its bound at `STATE_MIN_RATE`, at least `STATE_FLOOR_S`, so a member
that trickles is cut off in bounded time), at most the bytes the stage could hold, each tensor
checked as the stage would load it and each message in the order `swarm.rpc.stream_order` admits:
the first refused ends the call, before more is read or held (a hostile member is cut off where it
passes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

import torch

from swarm.deadline import within
from swarm.errors import InvalidArgument, PeerUnavailable, ResourceExhausted
from swarm.job.rule import EagerOp
from swarm.proto import tensor_pb2
from swarm.rpc.stream_order import OutOfOrder, StateOrder, UpdateHeader, UpdateOrder
from swarm.wire import chunking as wire

__all__ = [
    "FLAT",
    "MAX_FLAT_PARTS",
    "STATE_FLOOR_S",
    "STATE_MIN_RATE",
    "ExpectedState",
    "FlatSum",
    "ReplicaStreams",
    "StateSink",
    "Update",
    "whole_state_s",
]

# A state download's whole-transfer deadline: the stage's state bound (`max_state_bytes`, about
# twice an fp32 state with AdamW's moments) at this rate, and never under the floor. Far under
# any real link, so only a member that trickles on purpose (a chunk just inside each idle
# deadline) reaches it.
STATE_MIN_RATE = 1 << 20  # bytes a second
STATE_FLOOR_S = 60.0


def whole_state_s(limit: int, min_rate: float | None = None, floor_s: float | None = None) -> float:
    """The longest a state transfer of at most `limit` bytes may take: the receiver gives up
    then, and the sender frees its place (`stage_server.replica.state_transfer`). The module's
    rate and floor by default, read at each call."""
    rate = STATE_MIN_RATE if min_rate is None else min_rate
    return max(STATE_FLOOR_S if floor_s is None else floor_s, limit / rate)


P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Update:
    """One update a replica applied, as one value: kept in its update log for the peers copying
    it (`stage_server.replica.update_log`), streamed to them (`Updates`) and applied by each as
    it was (`stage_server.replica.following.Following.apply`)."""

    step: int  # the step this update was applied at (it moved the replica to step + 1)
    grad_sums: list[torch.Tensor]  # the pool's summed gradient, in parameter order
    total_samples: int
    scale: float = 1.0  # the clipping coefficient it was applied with
    # pool.mode = "local": the round's end before step `step` (its own update comes after),
    # `grad_sums` the pool's summed pseudo-gradient
    round_end: bool = False
    # pool.overlap = "eager" (with round_end; `swarm.job.rule.EagerOp`): STEP, the outer
    # gradient applied at the round's end before `step` (its fresh share of `total_samples`);
    # AVERAGE, the pool's sum of the shares of the round that ended before step `boundary`,
    # which arrived while the replica was at `step`
    eager: int = EagerOp.NONE
    boundary: int = -1
    # The pool's summed gradient as the averaging's lossy codec carried it, where one did: the
    # flat sum's parts in order, each the bytes every replica decoded its part from, so that a
    # follower decoding them applies the very values the pool applied (`grad_sums` are those
    # decodings, and go unsent). Empty: the sums travel as they are (no codec, a pool of one).
    encoded: tuple[tensor_pb2.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        """What it takes kept or sent: its encoding's bytes, else its sums'."""
        if self.encoded:
            return sum(part.nbytes for part in self.encoded)
        return sum(t.nbytes for t in self.grad_sums)


# (step, name, tensor) of each tensor of a state as it comes (`StageClient.stream_state`)
StateSink = Callable[[int, str, torch.Tensor], Awaitable[None]]


class ExpectedState(Protocol):
    """What a stage's state and its updates may hold (`swarm.model.state_checks.StateChecks`,
    from the job's layout of the stage): checked as each tensor arrives."""

    @property
    def num_parameters(self) -> int: ...

    def max_state_bytes(self) -> int: ...

    def max_state_tensors(self) -> int: ...

    def max_update_bytes(self) -> int: ...

    def state_tensor(self, name: str, tensor: torch.Tensor) -> None: ...

    def complete(self, names: Collection[str]) -> None: ...

    def update_tensor(self, index: int, tensor: torch.Tensor) -> None: ...

    def update_shapes(self) -> list[torch.Size]: ...


class ReplicaStreams:
    """The state and update streams of stage `stage`'s replica at `address`, whose every
    refusal names that replica: each message within `idle_s` of the one before, each tensor at
    most `max_tensor` bytes (`runtime.max_tensor_bytes`); a whole state within its bound at
    `min_rate` bytes a second, and at least `floor_s`."""

    def __init__(
        self,
        stage: int,
        address: str,
        idle_s: float,
        max_tensor: int,
        *,
        min_rate: float | None = None,
        floor_s: float | None = None,
    ) -> None:
        self.stage, self.address, self.idle_s, self.max_tensor = stage, address, idle_s, max_tensor
        self.min_rate, self.floor_s = min_rate, floor_s  # None: the module's, when a state comes

    async def receive_state(self, call: Any, expect: ExpectedState, sink: StateSink) -> int:
        """Each tensor of the state `call` streams handed to `sink` as it comes; the step."""
        why = (
            "the stage's parameters and an optimizer's state at 8 bytes a value, and "
            f"{wire.TENSOR_OVERHEAD_BYTES} bytes a tensor"
        )
        limit = expect.max_state_bytes()
        rate = STATE_MIN_RATE if self.min_rate is None else self.min_rate
        floor_s = STATE_FLOOR_S if self.floor_s is None else self.floor_s
        whole_s = whole_state_s(limit, rate, floor_s)
        within = (
            whole_s,
            f"{self._sender} did not send its state within {whole_s:g}s (its bound of {limit} "
            f"bytes at {rate:g} bytes a second, at least {floor_s:g}s): the transfer is too slow",
        )
        received = self._bounded(call, limit, why, wire.TENSOR_OVERHEAD_BYTES, within)
        order = StateOrder(expect.max_state_tensors())
        while (message := await received.next()) is not None:
            header, tensors = message
            self._in_order(order.message, header.step)
            for name, tensor in tensors.items():
                self._in_order(order.tensor, name, self.stage)
                self._check(expect.state_tensor, name, tensor)
                await sink(order.step, name, tensor)  # its own buffer (`_Bounded.next`): no copy
        self._check(expect.complete, order.names)  # a replica always has parameters
        return order.step

    async def receive_updates(
        self, call: Any, from_step: int, expect: ExpectedState, *, rounds: bool, log_bytes: int
    ) -> list[Update]:
        """The updates `call` streams from `from_step` on, at most `log_bytes` (what the
        sender's update log keeps: `runtime.update_log_bytes`) or one update when larger;
        `rounds`: the job's rule has rounds (`Rule.rounds`)."""
        # An update log keeps at most update_log_bytes, or its last update whatever its size.
        limit = max(log_bytes, expect.max_update_bytes())
        why = (
            "runtime.update_log_bytes (within a stage server's --max-update-log-bytes), or one "
            "update when larger"
        )
        # No overhead charged: each tensor has its parameter's shape, so the sender cannot make
        # them many and tiny (and the bound stays what the log keeps).
        received = self._bounded(call, limit, why, 0)
        order = UpdateOrder(from_step, rounds=rounds, sums=expect.num_parameters)
        updates: list[Update] = []
        flat = FlatSum(expect.update_shapes())
        while (message := await received.next()) is not None:
            header, tensors = message
            scale = header.grad_scale if header.HasField("grad_scale") else 1.0
            said = UpdateHeader(
                header.step,
                header.total_samples,
                scale,
                header.round_end,
                header.eager,
                header.boundary,
            )
            begun = self._in_order(order.message, said)
            if begun is not None:
                step, samples, scale, end, eager, boundary = begun
                updates.append(Update(step, [], samples, scale, end, EagerOp(eager), boundary))
                flat = FlatSum(flat.shapes)  # each update's own (a flat sum or sums)
            sums = updates[-1].grad_sums
            for name, tensor in tensors.items():
                for sum_name, g in self._in_order(flat.add, name, tensor, order.count):
                    index = self._in_order(order.sum, sum_name)
                    self._check(expect.update_tensor, index, g)
                    sums.append(g)  # its own buffer (or a view of the whole sum's): no copy
        self._in_order(order.end)
        return updates

    @property
    def _sender(self) -> str:
        return f"stage {self.stage}'s replica at {self.address}"

    def _bounded(
        self,
        call: Any,
        limit: int,
        why: str,
        overhead: int,
        within: tuple[float, str] | None = None,
    ) -> _Bounded:
        stream = _progressing(call, self.idle_s, within)
        return _Bounded(stream, self._sender, limit, why, self.max_tensor, overhead)

    def _refused(self, what: str) -> InvalidArgument:
        return InvalidArgument(f"{self._sender} sent {what}")

    def _in_order(self, judge: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`judge(*args)` of the stream's order, whose refusal names this replica."""
        try:
            return judge(*args, **kwargs)
        except OutOfOrder as e:
            raise self._refused(str(e)) from None

    def _check(self, check: Callable[..., None], *args: Any) -> None:
        """`check(*args)`, whose refusal names this replica."""
        try:
            check(*args)
        except InvalidArgument as e:
            raise self._refused(f"what stage {self.stage} would not load: {e}") from None


FLAT = "flat/"  # the name of a part of a flat sum (`FlatSum`), before its index
# The most parts a flat sum comes in: one a member of its round (a pool's largest group), so
# that a sender cannot make it many tiny tensors, each held at a tensor's cost.
MAX_FLAT_PARTS = 1024


class FlatSum:
    """An update's sums as they come, one message's tensor at a time: each itself (named by its
    index), or, where the pool's averaging carried them in a lossy codec (`Update.encoded`), the
    flat sum's parts, decoded, named `flat/<j>` in order, gathered until they hold every
    parameter's values and then cut into the parameters' shapes (`shapes`)."""

    def __init__(self, shapes: list[torch.Size]) -> None:
        self.shapes = shapes
        self.total = sum(shape.numel() for shape in shapes)
        self.parts: list[torch.Tensor] = []
        self.held = 0  # values the parts so far hold

    def add(self, name: str, tensor: torch.Tensor, sums: int) -> list[tuple[str, torch.Tensor]]:
        """The sums (name, tensor) that `tensor` named `name` completes; `sums`: how many of
        the update came before it. OutOfOrder for a part not due (a sum's, or a part after
        one, or past the sums' values)."""
        if not name.startswith(FLAT):
            if self.parts:
                raise OutOfOrder(f"gradient sum {name!r} in a flat sum of {self.held} values")
            return [(name, tensor)]
        due = f"{FLAT}{len(self.parts)}"
        first = self.parts[0] if self.parts else tensor
        numel = tensor.numel()
        if name != due or sums or tensor.dim() != 1 or tensor.dtype != first.dtype:
            raise OutOfOrder(f"a part {name!r} of {tensor.dtype}{list(tensor.shape)} of a flat sum")
        if self.held + numel > self.total or len(self.parts) >= MAX_FLAT_PARTS:
            raise OutOfOrder(
                f"a flat sum of more than the stage's {self.total} values or {MAX_FLAT_PARTS} parts"
            )
        self.parts.append(tensor)
        self.held += numel
        if self.held < self.total:
            return []
        whole = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
        self.parts, self.held = [], 0
        sizes = [shape.numel() for shape in self.shapes]
        cut = torch.split(whole, sizes)
        return [(str(i), t.view(s)) for i, (t, s) in enumerate(zip(cut, self.shapes, strict=True))]


class _Bounded:
    """The messages of a server stream from `sender`, at most `limit` tensor bytes in all (`why`
    says where that bound comes from) and `max_tensor` a message, each tensor charged `overhead`
    bytes more than its payload (`wire.TENSOR_OVERHEAD_BYTES`: what it costs held, however
    small): a message declaring more than is left is refused from its header, before its bytes
    are read or allocated, and nothing after it is read."""

    def __init__(
        self,
        stream: AsyncIterator[Any],
        sender: str,
        limit: int,
        why: str,
        max_tensor: int,
        overhead: int,
    ) -> None:
        self.stream, self.sender, self.limit, self.why = stream, sender, limit, why
        self.max_tensor, self.overhead = max_tensor, overhead
        self.left = limit

    async def next(self) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """The next message's header and tensors (decoded, the caller's own), or None at the
        end."""
        bound = min(self.max_tensor, self.left)
        try:
            received = await wire.receive(
                self.stream, max_bytes=bound, tensor_overhead=self.overhead
            )
            tensors = await wire.decode_named_async(  # a lossy update widened off the loop
                received, device="cpu", max_bytes=bound, owned=True
            )
        except wire.EndOfStream:
            return None
        except InvalidArgument as e:  # a header of too many tensors, or bytes that do not fit
            raise InvalidArgument(f"{self.sender} sent {e}") from None
        except ResourceExhausted as e:
            raise ResourceExhausted(
                f"{self.sender} sent more than it may: {e} ({self.limit - self.left} bytes came "
                f"before it, of at most {self.limit} in all: {self.why}; at most "
                f"runtime.max_tensor_bytes = {self.max_tensor} a tensor)"
            ) from None
        if not tensors:  # a replica sends at least one tensor a message
            raise InvalidArgument(f"{self.sender} sent a message without tensors")
        held = sum(len(p) for p in received.payloads)
        charged = self.overhead * len(tensors)
        self.left -= max(held, sum(t.nbytes for t in tensors.values())) + charged
        return received.header, tensors


def _aiter(call: Any) -> AsyncIterator[Any]:
    return call.__aiter__()  # type: ignore[no-any-return]


async def _progressing(
    call: Any, idle_s: float, whole: tuple[float, str] | None = None
) -> AsyncIterator[Any]:
    """The messages of a server stream with a deadline that follows progress: each must come
    within `idle_s` of the one before; and, given `whole` (seconds, the error's text), the whole
    stream within those seconds however steadily it comes."""
    stream = _aiter(call)
    loop = asyncio.get_running_loop()
    end = loop.time() + whole[0] if whole else None
    while True:
        wait = idle_s if end is None else min(idle_s, end - loop.time())
        try:
            message = await within(anext(stream), max(wait, 0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            call.cancel()
            if whole and wait < idle_s:
                raise PeerUnavailable(whole[1]) from None
            raise PeerUnavailable(f"no bytes for {idle_s:g}s: the transfer stalled") from None
        yield message
