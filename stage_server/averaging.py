"""Averaging within a stage's pool: a butterfly all-reduce over `PoolService.Reduce`.

At a step commit every replica holds its gradient sum as one flat tensor. With N replicas in the
round's group the flat tensor is cut into N contiguous parts and replica k owns part k: every
replica sends its values of part k to replica k, which sums the N contributions in sender order,
`((c0 + c1) + c2) + ...`, once, and gives that one sum to all of them. Each element is thus added
by one process in one order, so every replica ends with bitwise the same total.

Lossy codecs (fp16, bf16, int8_blockwise): the owner encodes the sum once and every replica, the
owner included, uses the decoding of those same bytes; that keeps the replicas identical. The
owner's own contribution also makes the encode/decode round trip the others' contributions make on
the wire, so every contribution is quantized alike, whoever owns the part.

A round that cannot complete (a peer missing, unreachable or refusing, a timeout) raises
`AveragingAborted` on every replica that takes part; the caller discards the round and retries it
under a new round id. Caution: one replica can still finish while another aborts (a reply lost
after the owner answered), so a commit must not treat one replica's success as the pool's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from swarm import auth, wire
from swarm.codec import CODEC_INT8_BLOCKWISE, CODEC_NONE, decode, encode
from swarm.errors import (
    Aborted,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    WireError,
)
from swarm.proto import pool_pb2, pool_pb2_grpc, tensor_pb2
from swarm.status import status_code

__all__ = [
    "Averager",
    "AveragingAborted",
    "ChannelPool",
    "PoolServicer",
    "Reduced",
    "RoundKey",
    "all_reduce",
    "flatten",
    "split_parts",
    "unflatten",
]

log = logging.getLogger(__name__)

RoundKey = tuple[str, int, str]  # (job, stage, round id): rounds of two stages never mix
_COMPLETED = "completed"
# The server answers this much before the caller's deadline, so the caller reads why (ABORTED with
# the missing senders) rather than a bare DEADLINE_EXCEEDED (seconds).
_REPLY_MARGIN_S = 0.25


class AveragingAborted(Aborted):
    """An averaging round cannot complete here: a peer is missing, unreachable or refused, or the
    round timed out or was aborted. Answered as ABORTED; retry the round under a new id.
    `missing`: the senders (group indices) a timed-out part still waited for."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D copy of `tensors` (which must share one dtype and device)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise InvalidArgument(f"flatten needs tensors of one dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like` (no copy: writing to one writes to `flat`)."""
    sizes = [t.numel() for t in like]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise InvalidArgument(f"flat {list(flat.shape)} does not hold {sum(sizes)} elements")
    return [p.view(t.shape) for p, t in zip(torch.split(flat, sizes), like, strict=True)]


def split_parts(numel: int, n: int) -> list[slice]:
    """`n` contiguous parts of `range(numel)`, the first `numel % n` one element longer."""
    if n < 1 or numel < 0:
        raise ConfigError(f"cannot split {numel} elements into {n} parts; need n >= 1")
    q, r = divmod(numel, n)
    bounds = [k * q + min(k, r) for k in range(n + 1)]
    return [slice(bounds[k], bounds[k + 1]) for k in range(n)]


class Reduced:
    """One part summed over its group, shared by every waiter: `tensor` (not to be modified in
    place) and the reply all senders receive, encoded and split once."""

    def __init__(self, tensor: torch.Tensor, message: tensor_pb2.Tensor | None) -> None:
        self.tensor, self._message = tensor, message
        self.wire_bytes = 0  # encoded bytes of the sum, once `replies` ran
        self._replies: dict[int, list[pool_pb2.PoolReduceResponse]] = {}

    def replies(self, chunk_bytes: int) -> list[pool_pb2.PoolReduceResponse]:
        if chunk_bytes not in self._replies:
            if self._message is None:
                self._message = encode(self.tensor, "sum")
            self.wire_bytes = self._message.nbytes
            response = pool_pb2.PoolReduceResponse(tensors=[self._message])
            self._replies[chunk_bytes] = list(wire.split(response, chunk_bytes))
        return self._replies[chunk_bytes]


def _reduce(values: list[torch.Tensor], codec: int, block_size: int) -> Reduced:
    total = values[0]
    if len(values) > 1:
        total = values[0] + values[1]  # a new tensor: the inputs may be read-only wire buffers
        for v in values[2:]:
            total.add_(v)  # elementwise, so the same bits as ((c0 + c1) + c2) + ...
    if codec == CODEC_NONE:
        return Reduced(total, None)
    msg = encode(total, "sum", codec, block_size)
    return Reduced(decode(msg), msg)  # the owner keeps exactly what the senders will decode


@dataclass
class _Slot:
    group_size: int
    signature: tuple[Any, ...]  # shape, dtype, codec, block size: all contributions agree
    done: asyncio.Future[Reduced]
    timer: asyncio.TimerHandle
    values: list[torch.Tensor | None] = field(default_factory=list)

    def missing(self) -> list[int]:
        return [i for i, v in enumerate(self.values) if v is None]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bytes, not values: NaN != NaN would refuse an honest retry.
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


class Averager:
    """The owner's side of the rounds this replica takes part in (one per replica process).

    A round's part completes when all `group_size` senders contributed; a timeout or `abort` fails
    every open part of the round. Finished rounds are forgotten but for their outcome, of which the
    last `history` are kept, so a late contribution gets a clear error instead of waiting.
    """

    def __init__(self, *, max_open_rounds: int = 64, history: int = 256) -> None:
        self._max_open, self._history = max_open_rounds, history
        self._open: dict[RoundKey, dict[int, _Slot]] = {}
        self._closed: OrderedDict[RoundKey, str] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def open_rounds(self) -> set[RoundKey]:
        return set(self._open)

    def outcome(self, round: RoundKey) -> str | None:
        """The outcome ("completed" or "aborted: <why>"); None while open or once forgotten."""
        return self._closed.get(round)

    async def contribute(
        self,
        round: RoundKey,
        part: int,
        sender: int,
        group_size: int,
        values: torch.Tensor,
        *,
        timeout_s: float,
        codec: int = CODEC_NONE,
        block_size: int = 2048,
    ) -> torch.Tensor:
        """Add `values` as `sender`'s contribution to `part` of `round`; the part's sum once all
        `group_size` arrived. `codec` is how the contributions travelled; the sum is given back
        through the same codec. A sender may repeat bit-identical values (a retry): it joins."""
        return (await self.reduce(round, part, sender, group_size, values, timeout_s=timeout_s,
                                  codec=codec, block_size=block_size)).tensor  # fmt: skip

    async def reduce(
        self,
        round: RoundKey,
        part: int,
        sender: int,
        group_size: int,
        values: torch.Tensor,
        *,
        timeout_s: float,
        codec: int = CODEC_NONE,
        block_size: int = 2048,
    ) -> Reduced:
        """`contribute`, returning the shared `Reduced` (the servicer replies its bytes)."""
        slot = self._admit(round, part, sender, group_size, values, timeout_s, codec, block_size)
        try:
            return await asyncio.wait_for(asyncio.shield(slot.done), max(timeout_s, 0.0))
        except TimeoutError:
            missing = slot.missing()
            self.abort(round, f"part {part} timed out after {timeout_s:.3g} s", missing)
            raise AveragingAborted(f"{_name(round)}: part {part} timed out", missing) from None
        except AveragingAborted as e:
            raise AveragingAborted(str(e), e.missing) from None  # a fresh one per waiter

    def abort(self, round: RoundKey, reason: str, missing: Sequence[int] = ()) -> None:
        """Fail every open part of `round` (waiters raise AveragingAborted) and refuse it later."""
        if missing:
            reason += f" waiting for senders {list(missing)}"
        slots = self._open.pop(round, {})
        for part, slot in slots.items():
            slot.timer.cancel()
            if not slot.done.done():
                error = AveragingAborted(f"{_name(round)} part {part}: {reason}", missing)
                slot.done.set_exception(error)
        if slots:
            log.info("%s aborted: %s", _name(round), reason)
        self._remember(round, f"aborted: {reason}")

    def close(self) -> None:
        for round in list(self._open):
            self.abort(round, "the averager closed")

    def _remember(self, round: RoundKey, outcome: str) -> None:
        self._closed[round] = outcome
        self._closed.move_to_end(round)
        while len(self._closed) > self._history:
            self._closed.popitem(last=False)

    def _admit(
        self,
        round: RoundKey,
        part: int,
        sender: int,
        group_size: int,
        values: torch.Tensor,
        timeout_s: float,
        codec: int,
        block_size: int,
    ) -> _Slot:
        name = f"{_name(round)} part {part}"
        if group_size < 1 or not (0 <= part < group_size and 0 <= sender < group_size):
            raise InvalidArgument(f"{name}: sender {sender} or part out of 0..{group_size - 1}")
        outcome = self._closed.get(round)
        if outcome == _COMPLETED:
            raise FailedPrecondition(f"{name}: completed already; sender {sender} came too late")
        if outcome is not None:
            raise AveragingAborted(f"{name}: {outcome}")
        if not values.is_floating_point():
            codec = CODEC_NONE  # as `encode` sends it
        signature = (
            tuple(values.shape),
            values.dtype,
            codec,
            block_size if codec == CODEC_INT8_BLOCKWISE else 0,
        )
        slots = self._open.get(round)
        if slots is None:
            if len(self._open) >= self._max_open:
                raise ResourceExhausted(f"{name}: {self._max_open} rounds are open already")
            slots = self._open[round] = {}
        slot = slots.get(part)
        loop = asyncio.get_running_loop()
        if slot is None:
            done: asyncio.Future[Reduced] = loop.create_future()
            done.add_done_callback(_retrieve)
            # The round's deadline even when every waiter has gone (cancelled calls).
            timer = loop.call_later(max(timeout_s, 0.0), self._expire, round, part, timeout_s)
            slot = slots[part] = _Slot(group_size, signature, done, timer, [None] * group_size)
        elif slot.group_size != group_size:
            raise InvalidArgument(f"{name}: group size {group_size}, others said {slot.group_size}")
        elif slot.signature != signature:
            raise InvalidArgument(
                f"{name}: sender {sender} sent {signature}, others {slot.signature}"
            )
        old = slot.values[sender]
        if old is not None:
            if not _same_bits(old, values):
                raise InvalidArgument(f"{name}: sender {sender} contributed other values already")
            return slot  # a retry: it waits for the same sum
        slot.values[sender] = values
        if not slot.missing():
            slot.timer.cancel()
            del slots[part]
            if not slots:
                del self._open[round]
                self._remember(round, _COMPLETED)
            task = loop.create_task(self._finish(round, part, slot, codec, block_size))
            self._tasks.add(task)  # a reference, so the task is not collected mid-way
            task.add_done_callback(self._tasks.discard)
        return slot

    async def _finish(
        self, round: RoundKey, part: int, slot: _Slot, codec: int, block_size: int
    ) -> None:
        values = [v for v in slot.values if v is not None]
        slot.values = []
        try:
            # Off the event loop: a large part's sum would hold up every other call.
            reduced = await asyncio.to_thread(_reduce, values, codec, block_size)
        except Exception as e:
            log.exception("%s part %d: the sum failed", _name(round), part)
            if not slot.done.done():
                slot.done.set_exception(AveragingAborted(f"{_name(round)} part {part}: {e}"))
        else:
            if not slot.done.done():
                slot.done.set_result(reduced)

    def _expire(self, round: RoundKey, part: int, timeout_s: float) -> None:
        slot = self._open.get(round, {}).get(part)
        if slot is not None:
            self.abort(round, f"part {part} timed out after {timeout_s:.3g} s", slot.missing())


def _retrieve(fut: asyncio.Future[Reduced]) -> None:
    if not fut.cancelled():
        fut.exception()  # marks it retrieved: a round nobody waits for any more logs nothing


def _name(round: RoundKey) -> str:
    return f"round {round[2]!r} of job {round[0]} stage {round[1]}"


def _status(e: WireError) -> grpc.StatusCode:
    return status_code(e) or grpc.StatusCode.INVALID_ARGUMENT


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    """`PoolService.Reduce` over an `Averager`: receive a part, wait for its sum, reply it.

    `route(job, stage)` raises NotFound when this replica does not serve that job and stage;
    `timeout_s` bounds a wait when the caller set no deadline; `on_bytes(sent, received)` counts
    wire bytes.
    """

    def __init__(
        self,
        averager: Averager,
        *,
        route: Callable[[str, int], None],
        chunk_bytes: int,
        max_bytes: int,
        timeout_s: float,
        peer: str = "",
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> None:
        self.averager, self._route, self.peer, self._on_bytes = averager, route, peer, on_bytes
        self._chunk, self._max_bytes, self._timeout_s = chunk_bytes, max_bytes, timeout_s

    async def Reduce(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pool_pb2.PoolReduceResponse]:
        code, message = grpc.StatusCode.OK, ""
        try:
            replies = await self._reduce(request_iterator, context)
        except WireError as e:
            code, message = _status(e), str(e)
            log.info("%s Reduce refused: %s: %s", self.peer, code.name, e)
        except Exception as e:  # a bug, not bad input: report it, keep serving
            code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
            log.exception("%s Reduce failed", self.peer)
        if code != grpc.StatusCode.OK:
            await context.abort(code, message)
            return
        for msg in replies:
            yield msg

    async def _reduce(
        self, requests: Any, context: grpc.aio.ServicerContext
    ) -> list[pool_pb2.PoolReduceResponse]:
        received = await wire.receive(requests, max_bytes=self._max_bytes)
        h: pool_pb2.PoolReduceRequest = received.header
        self._route(h.job, h.stage)
        tensors = wire.decode_named(received, device="cpu", max_bytes=self._max_bytes)
        if set(tensors) != {"part"}:
            raise InvalidArgument(f"Reduce carries one tensor named 'part', got {sorted(tensors)}")
        (meta,) = h.tensors
        timeout = self._timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining - min(_REPLY_MARGIN_S, remaining / 10))
        reduced = await self.averager.reduce(
            (h.job, h.stage, h.round), h.part, h.sender, h.group_size, tensors["part"],
            timeout_s=timeout, codec=meta.codec, block_size=meta.block_size,
        )  # fmt: skip
        replies = reduced.replies(self._chunk)
        if self._on_bytes is not None:
            self._on_bytes(reduced.wire_bytes, meta.nbytes)
        return replies


class ChannelPool:
    """One `grpc.aio` channel per peer address, reused across rounds (a channel reconnects by
    itself); `discard` drops a peer that left, `close` all of them."""

    def __init__(
        self, *, token: str | None = None, options: Sequence[tuple[str, Any]] | None = None
    ) -> None:
        self._token, self._options = token, options
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = auth.channel(
                address, token=self._token, options=self._options
            )
        return self._channels[address]

    def stub(self, address: str) -> pool_pb2_grpc.PoolServiceStub:
        return pool_pb2_grpc.PoolServiceStub(self.channel(address))

    async def discard(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


async def all_reduce(
    flat: torch.Tensor,
    *,
    group: Sequence[str],
    index: int,
    round: str,
    job: str,
    stage: int,
    averager: Averager,
    channels: ChannelPool,
    codec: int = CODEC_NONE,
    block_size: int = 2048,
    timeout_s: float,
    chunk_bytes: int,
    max_bytes: int,
    on_bytes: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """The sum of `flat` over the replicas of `group` (PoolService addresses; this replica is
    `group[index]`), bitwise the same on every replica; `flat` itself when the group is alone.

    Part k goes to `group[k]` over `PoolService.Reduce`, all concurrently; this replica's own part
    goes to its `averager` directly. The result is a new tensor on `flat`'s device. Any failure
    aborts the round in `averager` too (so peers waiting on this replica learn it at once) and
    raises AveragingAborted naming the peer. `on_bytes(sent, received)` counts wire bytes.
    """
    n = len(group)
    if not 0 <= index < n or len(set(group)) != n:
        raise ConfigError(f"index {index} in a group of {n} distinct addresses: {list(group)}")
    if flat.dim() != 1:
        raise InvalidArgument(f"all_reduce takes a 1-D tensor, got shape {list(flat.shape)}")
    if n == 1:
        return flat
    key: RoundKey = (job, stage, round)
    parts = split_parts(flat.numel(), n)
    src = flat.detach()
    sent = received = 0

    async def remote(k: int) -> torch.Tensor:
        nonlocal sent, received
        msg = encode(src[parts[k]], "part", codec, block_size)
        request = pool_pb2.PoolReduceRequest(
            job=job, stage=stage, round=round, part=k, sender=index, group_size=n, tensors=[msg]
        )
        call: Any = channels.stub(group[k]).Reduce(timeout=timeout_s)
        for m in wire.split(request, chunk_bytes):
            await call.write(m)
        await call.done_writing()
        sent += msg.nbytes
        reply = await wire.receive(call.__aiter__(), max_bytes=max_bytes)
        tensors = wire.decode_named(reply, device="cpu", max_bytes=max_bytes)
        total = tensors.get("sum")
        length = parts[k].stop - parts[k].start
        if total is None or total.dtype != flat.dtype or tuple(total.shape) != (length,):
            got = {name: (t.dtype, list(t.shape)) for name, t in tensors.items()}
            raise InvalidArgument(f"expected a 'sum' of {flat.dtype}[{length}], got {got}")
        received += sum(t.nbytes for t in reply.header.tensors)
        return total

    async def own() -> torch.Tensor:
        values = src[parts[index]].cpu()
        if codec != CODEC_NONE and values.is_floating_point():
            values = decode(encode(values, "part", codec, block_size))  # as it would travel
        return await averager.contribute(
            key, index, index, n, values, timeout_s=timeout_s, codec=codec, block_size=block_size
        )

    async def guarded(k: int) -> torch.Tensor:
        where = f"peer {group[k]} (part {k})" if k != index else f"own part {index}"
        try:
            return await (own() if k == index else remote(k))
        except grpc.aio.AioRpcError as e:
            reason = f"{where}: {e.code().name}: {e.details()}"
        except AveragingAborted as e:  # own part: timed out or aborted
            reason = f"{where}: {e}"
            if e.missing:
                reason += f"; missing {[group[i] for i in e.missing if i < n]}"
        except Exception as e:  # a bad reply, a refused contribution: all abort
            reason = f"{where}: {type(e).__name__}: {e}"
        raise AveragingAborted(reason)

    tasks = [asyncio.ensure_future(guarded(k)) for k in range(n)]
    try:
        sums = await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        reason = str(e) if isinstance(e, AveragingAborted) else f"{type(e).__name__} {e}"
        # Peers still waiting on this replica's part learn it now, not at their timeout.
        averager.abort(key, f"{group[index]} gave up: {reason}")
        if not isinstance(e, AveragingAborted):
            raise  # cancelled: the caller's own doing
        log.warning("%s: %s aborted: %s", group[index], _name(key), reason)
        raise AveragingAborted(f"{group[index]}: {_name(key)} aborted: {reason}") from None
    finally:
        if on_bytes is not None:
            on_bytes(sent, received)
    return torch.cat(sums).to(flat.device)
