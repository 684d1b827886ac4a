"""Averaging within a stage's pool: a butterfly all-reduce over `PoolService.Reduce`.

At a step commit every replica holds its gradient sum as one flat tensor. With N replicas in the
round's group the flat tensor is cut into N contiguous parts and replica k owns part k: every
replica sends its values of part k to replica k, which sums the N contributions in sender order,
`((c0 + c1) + c2) + ...`, once, and gives that one sum to all of them. Each element is thus added
by one process in one order, so every replica ends with bitwise the same total.

Lossy codecs (fp16, bf16, int8_blockwise): the owner encodes the sum once and every replica, the
owner included, uses the decoding of those same bytes; that keeps the replicas identical. The
owner's own contribution also makes the encode/decode round trip the others' contributions make on
the wire, so every contribution is quantized alike, whoever owns the part. With `residuals`
(`stage_server.averaging.error_feedback`) what the last step's encodings dropped is added back
first: to every contribution this replica sends, and by the owner to its part's sum (through its own
contribution, which the sum includes as it is).

A round that cannot complete (a peer missing, unreachable or refusing, a timeout) raises
`AveragingAborted` on every replica that takes part, naming in `missing` the members it failed on
(group indices; they travel with the ABORTED answer, see `swarm.rpc.status`); the caller discards
the round and retries it under a new round id, and the coordinator can leave the culprit out.
Caution: one replica can still finish while another aborts (a reply lost after the owner
answered), so a commit must not treat one replica's success as the pool's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
import torch

from stage_server.averaging.error_feedback import Residuals
from stage_server.averaging.owner import (
    Averager,
    AveragingAborted,
    RoundKey,
    round_name,
    split_parts,
)
from swarm.clock import Clock, MonotonicClock
from swarm.errors import Aborted, ConfigError, InvalidArgument
from swarm.net import tokens as auth
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.rpc.servicing import Servicing
from swarm.rpc.status import from_rpc_error
from swarm.wire import chunking as wire
from swarm.wire.budget import Held, ReceiveBudget
from swarm.wire.codec import CODEC_NONE, decode, dtype_name, encode

__all__ = ["SLICE_BYTES", "WINDOW", "ChannelPool", "PoolServicer", "all_reduce"]

log = logging.getLogger(__name__)

# A part travels in slices of this many bytes, this many at once to each owner: enough to keep
# the link busy while a slice is summed and answered, few enough that an owner holds little.
SLICE_BYTES = 16 << 20
WINDOW = 2

# The server answers this much before the caller's deadline, so the caller reads why (ABORTED with
# the missing senders) rather than a bare DEADLINE_EXCEEDED (seconds).
_REPLY_MARGIN_S = 0.25


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    """`PoolService.Reduce` over an `Averager`: receive a part, wait for its sum, reply it.

    `route(job, stage)` raises NotFound when this replica does not serve that job and stage;
    `timeout_s` bounds a wait when the caller set no deadline; `on_bytes(sent, received)` counts
    wire bytes. `served()`, read at every call, is `(chunk_bytes, max_bytes, timeout_s)` of the
    job the replica serves now (its `[runtime]` within the peer's own limits; None while it
    serves none), so the owner side of a round follows the job however its stage was installed.

    A contribution is routed from its header, before a byte of its part is allocated, and the
    part's bytes come from `budget` (the process's, shared with the stage's calls) until its sum
    is answered: past it the call is refused with RESOURCE_EXHAUSTED. `limit_name` names the
    setting behind `max_bytes` in refusals.
    """

    def __init__(
        self,
        averager: Averager,
        *,
        route: Callable[[str, int], None],
        chunk_bytes: int,
        max_bytes: int,
        timeout_s: float,
        served: Callable[[], tuple[int, int, float] | None] | None = None,
        peer: str = "",
        on_bytes: Callable[[int, int], None] | None = None,
        budget: ReceiveBudget | None = None,
        limit_name: str = "",
    ) -> None:
        self.averager, self._route, self.peer, self._on_bytes = averager, route, peer, on_bytes
        self._chunk, self._max_bytes, self._timeout_s = chunk_bytes, max_bytes, timeout_s
        self._served = served
        # No budget given (a pool on its own, in tests): bounded by max_bytes per call only.
        self._budget, self._limit_name = budget or ReceiveBudget(1 << 62), limit_name
        self._serving = Servicing(peer)

    def settings(self) -> tuple[int, int, float]:
        """`(chunk_bytes, max_bytes, timeout_s)` a call is served with now."""
        served = self._served() if self._served is not None else None
        return served if served is not None else (self._chunk, self._max_bytes, self._timeout_s)

    async def Reduce(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pool_pb2.PoolReduceResponse]:
        replies = await self._serving.run(
            "Reduce", context, lambda: self._reduce(request_iterator, context)
        )
        for msg in replies:
            yield msg

    async def _reduce(
        self, requests: Any, context: grpc.aio.ServicerContext
    ) -> Iterator[pool_pb2.PoolReduceResponse]:
        with self._budget.hold() as held:
            return await self._reduce_held(requests, context, held)

    async def _reduce_held(
        self, requests: Any, context: grpc.aio.ServicerContext, held: Held
    ) -> Iterator[pool_pb2.PoolReduceResponse]:
        chunk_bytes, max_bytes, timeout = self.settings()
        # A caller with no deadline must not hold its part's share of the budget forever.
        body = wire.within_deadline(requests, timeout, "the job's runtime.averaging_timeout_s")
        received = await wire.receive(
            body,
            max_bytes=max_bytes,
            admit=lambda first: self._route(first.job, first.stage),
            reserve=held.reserve,
            limit_name=self._limit_name,
        )
        h: pool_pb2.PoolReduceRequest = received.header
        tensors = wire.decode_named(
            received, device="cpu", max_bytes=max_bytes, reserve=held.reserve
        )
        if set(tensors) != {"part"}:
            raise InvalidArgument(f"Reduce carries one tensor named 'part', got {sorted(tensors)}")
        (meta,) = h.tensors
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining - min(_REPLY_MARGIN_S, remaining / 10))
        reduced = await self.averager.reduce(
            (h.job, h.stage, h.round), h.part, h.sender, h.group_size, tensors["part"],
            timeout_s=timeout, codec=meta.codec, block_size=meta.block_size,
            owned=not meta.data,  # chunked: received into a buffer of its own, summed into
            slice=h.slice,
        )  # fmt: skip
        # The sender closed its side before it waits for this sum: its end is here already.
        await wire.read_to_end(body, "the contribution's")
        replies = reduced.replies(chunk_bytes)
        if self._on_bytes is not None:
            self._on_bytes(reduced.wire_bytes, meta.nbytes)
        return replies


class ChannelPool:
    """One `grpc.aio` channel per peer address, reused across rounds (a channel reconnects by
    itself); `discard` drops a peer that left, `close` all of them.

    A channel not asked for in `idle_s` (a peer no longer in any of this replica's groups: it left,
    or moved to another stage) is closed the next time any channel is asked for, so the pool over
    days of churn holds about the peers of the recent groups only. `idle_s` must outlast any call
    (the averaging and download deadlines): a call is made right after its channel is asked for.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        idle_s: float = 600.0,
        clock: Clock | None = None,
    ) -> None:
        self._token, self._options = token, options
        self._idle_s, self._clock = idle_s, clock or MonotonicClock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._used: dict[str, float] = {}  # address -> when its channel was last asked for
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def channel(self, address: str) -> grpc.aio.Channel:
        now = self._clock.now()
        self._used[address] = now
        self._expire(now)
        if address not in self._channels:
            self._channels[address] = auth.channel(
                address, token=self._token, options=self._options
            )
        return self._channels[address]

    def stub(self, address: str) -> pool_pb2_grpc.PoolServiceStub:
        return pool_pb2_grpc.PoolServiceStub(self.channel(address))

    def _expire(self, now: float) -> None:
        for address in [a for a, t in self._used.items() if now - t > self._idle_s]:
            del self._used[address]
            channel = self._channels.pop(address, None)
            if channel is not None:
                log.debug("pool: closing the idle channel to %s", address)
                task = asyncio.get_running_loop().create_task(channel.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def discard(self, address: str) -> None:
        self._used.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels, self._used = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


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
    residuals: Residuals | None = None,
    slice_bytes: int = SLICE_BYTES,
    window: int = WINDOW,
    in_place: bool = False,
    keep: Callable[[slice], Awaitable[None]] | None = None,
) -> torch.Tensor:
    """The sum of `flat` over the replicas of `group` (PoolService addresses; this replica is
    `group[index]`), bitwise the same on every replica; `flat` itself when the group is alone.

    Part k goes to `group[k]` over `PoolService.Reduce`, all concurrently; this replica's own part
    goes to its `averager` directly. The result is a new tensor on `flat`'s device. Any failure
    aborts the round in `averager` too (so peers waiting on this replica learn it at once) and
    raises AveragingAborted naming the peer. `on_bytes(sent, received)` counts wire bytes.
    `residuals` (a lossy codec's error feedback) are read, and replaced once the round completed.
    Uncompressed, a part travels in slices of `slice_bytes`, `window` of them under way to each
    owner at once: while one slice is summed and answered the next is sent, and an owner holds
    `window` slices of each sender, not its whole part.

    `in_place` (a CPU `flat`): each slice's sum lands over the slice of `flat` it was made from,
    once that slice is sent (or, this replica's own part, summed), and `flat` is the result: no
    second tensor of its size. `await keep(where)` comes first, before `flat[where]` is
    overwritten (`stage_server.averaging.spill`: what a retry reads back). A round that fails
    leaves `flat` partly summed: only what `keep` kept restores it.
    """
    n = len(group)
    if not 0 <= index < n or len(set(group)) != n:
        raise ConfigError(f"index {index} in a group of {n} distinct addresses: {list(group)}")
    if flat.dim() != 1:
        raise InvalidArgument(f"all_reduce takes a 1-D tensor, got shape {list(flat.shape)}")
    if window < 1:
        raise ConfigError(f"window must be at least 1, got {window}")
    if n == 1:
        return flat
    key: RoundKey = (job, stage, round)
    parts = split_parts(flat.numel(), n)
    src = flat.detach()
    # Every part's sum lands in its place here, as its bytes arrive: no part is held twice.
    in_place = in_place and flat.device.type == "cpu" and flat.is_contiguous()
    total = src if in_place else torch.empty(flat.shape, dtype=flat.dtype)

    async def overwriting(where: slice) -> None:
        """`total[where]` is about to be written: in place, what `keep` keeps of it first."""
        if in_place and keep is not None:
            await keep(where)

    sent = received = 0
    lossy = codec != CODEC_NONE and flat.is_floating_point()
    feedback = residuals if lossy else None
    if feedback is not None:
        if feedback.sent.shape != flat.shape or feedback.summed.shape != flat.shape:
            shape = list(feedback.sent.shape)
            raise InvalidArgument(f"residuals of {shape} for a tensor of {list(flat.shape)}")
        dropped_sent = torch.zeros_like(feedback.sent)
        dropped_sum = torch.zeros_like(feedback.summed)

    def fed(k: int, where: slice | None = None) -> torch.Tensor:
        """Part k (or its slice `where`) of this replica's values, with what its last encoding
        of them dropped."""
        where = parts[k] if where is None else where
        if feedback is None:
            return src[where]
        return src[where].cpu() + feedback.sent[where]

    def slices(k: int) -> list[slice]:
        """Part k as it travels: consecutive slices of at most `slice_bytes` (each summed and
        answered on its own, up to `window` at once), or whole for a lossy codec (whose blocks
        are the part's)."""
        part = parts[k]
        if lossy:
            return [part]
        step = max(1, slice_bytes // flat.element_size())
        starts = range(part.start, part.stop, step)
        return [slice(a, min(a + step, part.stop)) for a in starts] or [part]

    def into(where: slice) -> wire.Into:
        """Where a slice's sum goes as it arrives: its place in `total`, when it comes as the
        round's own dtype uncompressed (else decoded first, then copied there)."""
        place = total[where]

        def locate(i: int, meta: Any) -> memoryview | None:
            plain = meta.codec == CODEC_NONE and meta.dtype == dtype_name(flat.dtype)
            if i != 0 or not plain or meta.nbytes != place.nbytes:
                return None
            return wire.tensor_bytes(place)

        return locate

    async def remote_slice(k: int, j: int, where: slice) -> None:
        nonlocal sent, received
        values = fed(k, where)
        header = pool_pb2.PoolReduceRequest(
            job=job, stage=stage, round=round, part=k, sender=index, group_size=n, slice=j
        )
        if lossy:
            msg = encode(values, "part", codec, block_size)
            if feedback is not None:  # what the encoding dropped waits for the next step's round
                dropped_sent[where] = values - decode(msg)
            header.tensors.append(msg)
            messages, nbytes = wire.split(header, chunk_bytes), msg.nbytes
        else:  # cut from the gradient's memory as it is sent: no copy of the part
            messages = wire.split_tensor(header, "part", values, chunk_bytes)
            nbytes = values.numel() * values.element_size()
        call: Any = channels.stub(group[k]).Reduce(timeout=timeout_s)
        for m in messages:
            await call.write(m)
        await call.done_writing()
        sent += nbytes
        await overwriting(where)  # the reply lands there: this slice's values are sent
        reply: wire.Received[Any] = await wire.receive_reply(
            call, max_bytes=max_bytes, into=into(where)
        )
        tensors = wire.decode_named(reply, device="cpu", max_bytes=max_bytes)
        got = tensors.get("sum")
        length = where.stop - where.start
        if got is None or got.dtype != flat.dtype or tuple(got.shape) != (length,):
            shapes = {name: (t.dtype, list(t.shape)) for name, t in tensors.items()}
            raise InvalidArgument(f"expected a 'sum' of {flat.dtype}[{length}], got {shapes}")
        place = total[where]
        if got.data_ptr() != place.data_ptr():  # not received in place: decoded elsewhere
            place.copy_(got)
        received += sum(t.nbytes for t in reply.header.tensors)

    async def remote(k: int) -> None:
        """Part k's slices to its owner, `window` calls at a time, in order."""
        pending: deque[asyncio.Future[None]] = deque()
        try:
            for j, where in enumerate(slices(k)):
                if len(pending) >= window:
                    await pending.popleft()
                pending.append(asyncio.ensure_future(remote_slice(k, j, where)))
            while pending:
                await pending.popleft()
        finally:  # failed or cancelled: the slices still under way end with it
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def own_slice(j: int, where: slice) -> None:
        values = fed(index, where).cpu()
        if lossy:  # as it would travel (whole: a lossy part is one slice)
            travelled = decode(encode(values, "part", codec, block_size))
            if feedback is not None:
                dropped_sent[where] = values - travelled  # as in `remote`
                # The sum's own error goes in through the one contribution its owner makes.
                travelled = travelled + feedback.summed[where]
            values = travelled
        reduced = await averager.reduce(
            key, index, index, n, values, timeout_s=timeout_s, codec=codec,
            block_size=block_size, slice=j,
        )  # fmt: skip
        if feedback is not None:
            dropped_sum[where] = reduced.exact - reduced.tensor
        await overwriting(where)
        total[where].copy_(reduced.tensor)

    async def own() -> None:
        """This replica's own part: every slice contributed at once (views of the gradient,
        nothing sent), each summed as the others' slices arrive."""
        tasks = [asyncio.ensure_future(own_slice(j, w)) for j, w in enumerate(slices(index))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def others(missing: Sequence[int]) -> list[int]:
        return [i for i in missing if 0 <= i < n and i != index]

    async def guarded(k: int) -> None:
        """Part k's sum, or AveragingAborted naming the members the part failed on: the owner
        of a part that could not be had (unreachable, refusing, a bad reply), or those the owner
        says it waited for; for this replica's own part, the senders that never came."""
        where = f"peer {group[k]} (part {k})" if k != index else f"own part {index}"
        culprits: list[int] = [k] if k != index else []
        try:
            await (own() if k == index else remote(k))
            return
        except grpc.aio.AioRpcError as e:
            reason = f"{where}: {e.code().name}: {e.details()}"
            refusal = from_rpc_error(e)
            if isinstance(refusal, Aborted):  # the owner aborted: whom it names, else itself
                culprits = others(refusal.missing) or culprits
        except AveragingAborted as e:  # own part: timed out or aborted
            reason, culprits = f"{where}: {e}", others(e.missing)
        except Exception as e:  # a bad reply, a refused contribution: all abort
            reason = f"{where}: {type(e).__name__}: {e}"
        if culprits:
            reason += f"; failed on {[group[i] for i in culprits]}"
        raise AveragingAborted(reason, culprits)

    tasks = [asyncio.ensure_future(guarded(k)) for k in range(n)]
    try:
        await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        reason = str(e) if isinstance(e, AveragingAborted) else f"{type(e).__name__} {e}"
        missing = e.missing if isinstance(e, AveragingAborted) else ()
        # Peers still waiting on this replica's part learn it now, not at their timeout, and
        # whom it failed on.
        averager.abort(key, f"{group[index]} gave up: {reason}", missing)
        if not isinstance(e, AveragingAborted):
            raise  # cancelled: the caller's own doing
        log.warning("%s: %s aborted: %s", group[index], round_name(key), reason)
        raise AveragingAborted(
            f"{group[index]}: {round_name(key)} aborted: {reason}", missing
        ) from None
    finally:
        if on_bytes is not None:
            on_bytes(sent, received)
    if feedback is not None:
        feedback.sent, feedback.summed = dropped_sent, dropped_sum
    return total.to(flat.device)
