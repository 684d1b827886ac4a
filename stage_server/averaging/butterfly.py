"""Averaging within a stage's pool: one round of a butterfly all-reduce over `PoolService.Reduce`
(`ButterflyRound`, run with one `RoundSettings` by `all_reduce`). The owner's side of a round is
`stage_server.averaging.owner` (served by `stage_server.averaging.service`); the peers are dialled
over `stage_server.averaging.channels`.

At a step commit every replica holds its gradient sum as one flat tensor. With N members in the
round's group the flat tensor is cut into N contiguous parts and member k owns part k: every
replica sends its values of part k to member k, which sums the contributions in sender order,
`((c0 + c1) + c2) + ...`, once, and gives that one sum to all of them. Each element is thus added
by one process in one order, so every replica ends with bitwise the same total.

The parts follow `RoundSettings.parts` (`swarm.policy.parts`: water-filling over the members'
links; no weights: equal parts): a member of weight 0 owns an empty part (client mode), which is
neither sent nor awaited: it only sends its values of the others' parts and takes their sums
back on the calls it opened. The group's first `parts.contributors` members contribute; the rest
(aggregators: PoolService owners without a gradient, which run no `all_reduce`) only own parts,
summing the contributors' values in sender order like any owner. Where a part ends changes which
process adds an element, never the order its contributions are added in, so the total is the same
bits whatever the weights.

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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from stage_server.averaging.channels import ChannelPool
from stage_server.averaging.checksum import PartChecks
from stage_server.averaging.error_feedback import Residuals
from stage_server.averaging.owner import Averager, AveragingAborted, RoundKey, round_name
from stage_server.averaging.staging import ChunkCopies, OffLoop, TorchChunkCopies, staging
from swarm.device.oom import is_out_of_memory
from swarm.errors import Aborted, ConfigError, InvalidArgument
from swarm.net.round_tickets import RoundPass
from swarm.policy.parts import EQUAL_PARTS, Parts
from swarm.proto import pool_pb2, tensor_pb2
from swarm.rpc import client_stream
from swarm.rpc.status import from_rpc_error
from swarm.wire import chunking as wire
from swarm.wire.codec import CODEC_NONE, decode, dtype_name, encode

__all__ = ["SLICE_BYTES", "WINDOW", "ButterflyRound", "RoundSettings", "all_reduce"]

log = logging.getLogger(__name__)

# A part travels in slices of this many bytes, this many at once to each owner: enough to keep
# the link busy while a slice is summed and answered, few enough that an owner holds little.
SLICE_BYTES = 16 << 20
WINDOW = 2


@dataclass(frozen=True)
class RoundSettings:
    """One round as every member runs it: who takes part (`group`: PoolService addresses, this
    replica `group[index]`), the round's name (`job`, `stage`, `round`), and how its parts travel
    (`all_reduce` says how). `timeout_s` bounds every call and wait; `chunk_bytes` is a message's
    chunk, `max_bytes` the most a reply's tensor may take; `codec` and `block_size` encode the
    parts. `parts` size them (`swarm.policy.parts.Parts`: weights one per member, or none: equal
    parts) and say how many of the group's first members contribute (0: all), the rest being
    aggregators."""

    group: Sequence[str]
    index: int
    round: str
    job: str
    stage: int
    timeout_s: float
    chunk_bytes: int
    max_bytes: int
    codec: int = CODEC_NONE
    block_size: int = 2048
    slice_bytes: int = SLICE_BYTES
    window: int = WINDOW
    in_place: bool = False
    parts: Parts = EQUAL_PARTS
    # What proves this replica a member to each owner (its PREPARE's round ticket); None: a
    # pool its owner coordinates, whose owners ask for none (`swarm.net.round_tickets`).
    proof: RoundPass | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", tuple(self.group))  # frozen: not the caller's list

    @property
    def key(self) -> RoundKey:
        return (self.job, self.stage, self.round)


async def all_reduce(
    flat: torch.Tensor,
    settings: RoundSettings,
    *,
    averager: Averager,
    channels: ChannelPool,
    on_bytes: Callable[[int, int], None] | None = None,
    residuals: Residuals | None = None,
    keep: Callable[[slice], Awaitable[None]] | None = None,
    copies: ChunkCopies | None = None,
    checks: PartChecks | None = None,
    on_sum: Callable[[int, tensor_pb2.Tensor], None] | None = None,
) -> torch.Tensor:
    """The sum of `flat` over the replicas of `settings.group`, bitwise the same on every
    replica; `flat` itself when the group is alone.

    Part k goes to `group[k]` over `PoolService.Reduce`, all concurrently; this replica's own part
    goes to its `averager` directly. The result is a new tensor on `flat`'s device. Any failure
    aborts the round in `averager` too (so peers waiting on this replica learn it at once) and
    raises AveragingAborted naming the peer. `on_bytes(sent, received)` counts wire bytes.
    `residuals` (a lossy codec's error feedback) are read, and replaced once the round completed.
    `checks` takes the checksum of every slice of every part, sent (or, this replica's own part,
    contributed) and summed (a lossy codec's as decoded: `stage_server.averaging.checksum`).
    `on_sum(k, message)`, under a lossy codec: part k's sum as its owner encoded it, the bytes
    this replica decoded it from (what a follower decodes to apply the same values).
    Uncompressed, a part travels in slices of `settings.slice_bytes`, `window` of them to each
    owner at once: while one slice is summed and answered the next is sent, and an owner holds
    `window` slices of each sender, not its whole part.

    `settings.in_place` (a contiguous `flat`): each slice's sum lands over the slice of `flat` it
    was made from, once that slice is sent (or, this replica's own part, summed), and `flat` is the
    result: no second tensor of its size. `await keep(where)` comes first, before `flat[where]`
    is overwritten (`stage_server.averaging.spill`: what a retry reads back). A round that fails
    leaves `flat` partly summed: only what `keep` kept restores it.

    A `flat` on a device (CUDA; `copies` says which are, `TorchChunkCopies` by default) is summed in
    place as on the CPU, staged through host memory a chunk at a time (`staging`): each part is
    copied to the host chunk by chunk as it is sent, each slice's sum goes into its place in
    `flat` chunk by chunk as it arrives, and this replica's own part is summed on the host `window`
    slices at a time. No copy of the gradient is made on the device or the host (a lossy codec's
    parts, sent whole, are copied whole: one part each). Those copies run off the event loop, in
    order, on a thread of the round's (`OffLoop`): the loop never waits on the device.
    """
    n, index = len(settings.group), settings.index
    if not 0 <= index < n or len(set(settings.group)) != n:
        raise ConfigError(
            f"index {index} in a group of {n} distinct addresses: {list(settings.group)}"
        )
    if flat.dim() != 1:
        raise InvalidArgument(f"all_reduce takes a 1-D tensor, got shape {list(flat.shape)}")
    if settings.window < 1:
        raise ConfigError(f"window must be at least 1, got {settings.window}")
    contributors = settings.parts.check(n)
    if index >= contributors:
        raise ConfigError(f"member {index} is an aggregator (of {contributors} contributors)")
    if contributors == 1:
        return flat  # alone with its gradient (aggregators or not): nothing to sum
    butterfly = ButterflyRound(
        flat,
        settings,
        averager=averager,
        channels=channels,
        residuals=residuals,
        keep=keep,
        copies=copies,
        checks=checks,
        on_sum=on_sum,
    )
    try:
        return await butterfly.run()
    finally:
        if on_bytes is not None:
            on_bytes(butterfly.sent, butterfly.received)


class ButterflyRound:
    """One replica's side of one round over `flat` (1-D, in a group of two or more): its parts
    sent to their owners, its own part summed, every sum in its place in `total`."""

    def __init__(
        self,
        flat: torch.Tensor,
        settings: RoundSettings,
        *,
        averager: Averager,
        channels: ChannelPool,
        residuals: Residuals | None = None,
        keep: Callable[[slice], Awaitable[None]] | None = None,
        copies: ChunkCopies | None = None,
        checks: PartChecks | None = None,
        on_sum: Callable[[int, tensor_pb2.Tensor], None] | None = None,
    ) -> None:
        self.flat, self.settings, self.averager, self.channels = flat, settings, averager, channels
        self._keep = keep
        self.n, self.key = len(settings.group), settings.key
        self.parts = settings.parts.bounds(flat.numel(), self.n)
        self.src = flat.detach()
        # A device's gradient crosses to the host and back a chunk at a time (`staging`).
        on_device = (copies or TorchChunkCopies()).on_device(flat)
        self.staging = staging(settings.chunk_bytes, copies) if on_device else None
        self.lossy = settings.codec != CODEC_NONE and flat.is_floating_point()
        # Where its copies (and what reads them) run; a lossy codec's encoding and decoding
        # too, on a CPU as well: hadamard3's rotation of a part held the event loop (every other
        # call of the server waited) as a device's copy would
        self._off = OffLoop(on_device or self.lossy, flat.device)
        # Every part's sum lands in its place here, as its bytes arrive: no part is held twice.
        self.in_place = settings.in_place and flat.is_contiguous()
        # Not in place: a total beside `flat`, on its device (no host copy to move over after).
        self.total = self.src if self.in_place else torch.empty_like(flat)
        self.sent = self.received = 0  # wire bytes, as `on_bytes` counts them
        self.feedback = residuals if self.lossy else None
        self.checks = checks
        self._on_sum = on_sum if self.lossy else None  # each part's sum as it was encoded
        if self.checks is not None and self.lossy:  # checked on the decoded values (issue 54)
            self.checks.lossy(settings.codec, settings.block_size)
        self._dropped: Residuals | None = None  # what this round's encodings drop, as it goes
        if self.feedback is not None:
            sent, summed = self.feedback.sent, self.feedback.summed
            if sent.shape != flat.shape or summed.shape != flat.shape:
                shape = list(sent.shape)
                raise InvalidArgument(f"residuals of {shape} for a tensor of {list(flat.shape)}")
            self._dropped = Residuals(torch.zeros_like(sent), torch.zeros_like(summed))

    async def _overwriting(self, where: slice) -> None:
        """`total[where]` is about to be written: in place, what `keep` keeps of it first."""
        if self.in_place and self._keep is not None:
            await self._keep(where)

    def _fed(self, k: int, where: slice | None = None) -> torch.Tensor:
        """Part k (or its slice `where`) of this replica's values, with what its last encoding
        of them dropped."""
        where = self.parts[k] if where is None else where
        if self.feedback is None:
            return self.src[where]
        return self._host(self.src[where]) + self.feedback.sent[where]

    def _host(self, values: torch.Tensor) -> torch.Tensor:
        """`values` on the host: themselves there, else a new copy made a chunk at a time."""
        return values if self.staging is None else self.staging.to_host(values)

    def _place(self, where: slice, values: torch.Tensor) -> None:
        """`values` (on the host) into `total[where]`, chunk by chunk from a device's."""
        if self.staging is None:
            self.total[where].copy_(values)
        else:
            self.staging.to_device(self.total[where], values)

    def _slices(self, k: int) -> list[slice]:
        """Part k as it travels: consecutive slices of at most `slice_bytes` (each summed and
        answered on its own, up to `window` at once), or whole for a lossy codec (whose blocks
        are the part's)."""
        part = self.parts[k]
        if self.lossy:
            return [part]
        step = max(1, self.settings.slice_bytes // self.flat.element_size())
        starts = range(part.start, part.stop, step)
        return [slice(a, min(a + step, part.stop)) for a in starts] or [part]

    def _into(self, where: slice) -> wire.Into:
        """Where a slice's sum goes as it arrives: its place in `total`, when it comes as the
        round's own dtype uncompressed (else decoded first, then copied there)."""
        place, dtype = self.total[where], dtype_name(self.flat.dtype)

        def locate(i: int, meta: Any) -> memoryview | None:
            if self.staging is not None:  # a device's: received on the host, then placed
                return None
            plain = meta.codec == CODEC_NONE and meta.dtype == dtype
            if i != 0 or not plain or meta.nbytes != place.nbytes:
                return None
            return wire.tensor_bytes(place)

        return locate

    def _encoded(self, k: int, where: slice) -> Any:
        """Part k's slice `where` as a lossy codec sends it (whole: encoded)."""
        s = self.settings
        values = self._fed(k, where)
        values = self._host(values) if self.feedback is None else values
        msg = encode(values, "part", s.codec, s.block_size)
        if self._dropped is not None:  # what the encoding dropped waits for the next round
            self._dropped.sent[where] = values - decode(msg)
        return msg

    async def _remote_slice(self, k: int, j: int, where: slice) -> None:
        s, flat = self.settings, self.flat
        header = pool_pb2.PoolReduceRequest(
            job=s.job,
            stage=s.stage,
            round=s.round,
            part=k,
            sender=s.index,
            group_size=self.n,
            slice=j,
            contributors=s.parts.contributors,
        )
        if s.proof is not None:
            header.proof.CopyFrom(s.proof.to(k))
        messages: Iterator[Any]
        check = self.checks  # every part is checked, a replica's as an aggregator's (issue 55)
        sent: torch.Tensor | None = None  # what was sent as the owner reads it
        if self.lossy:
            msg = await self._off(self._encoded, k, where)
            sent = await self._off(decode, msg) if check is not None else None
            header.tensors.append(msg)
            messages, nbytes = iter(wire.split(header, s.chunk_bytes)), msg.nbytes
        else:
            values = self._fed(k, where)  # a view: uncompressed, nothing is fed back
            if self.staging is not None:  # a device's: one chunk at a time on the host
                messages = self.staging.split(header, "part", values)
            else:  # cut from the gradient's memory as it is sent: no copy of the part
                messages = iter(wire.split_tensor(header, "part", values, s.chunk_bytes))
            nbytes = values.numel() * values.element_size()
        call: Any = self.channels.stub(s.group[k]).Reduce(timeout=s.timeout_s)
        # A device's chunk is copied (and framed) off the loop as it is cut, one at a time.
        while (m := await self._off.next(messages)) is not None:
            await client_stream.write(call, m)
        await client_stream.done_writing(call)
        self.sent += nbytes
        if check is not None:  # what was sent, before its sum lands over it
            values = self._fed(k, where) if sent is None else sent
            await asyncio.to_thread(check.contributed, k, where.start, values)
        await self._overwriting(where)  # the reply lands there: this slice's values are sent
        reply: wire.Received[Any] = await wire.receive_reply(
            call, max_bytes=s.max_bytes, into=self._into(where)
        )
        # The owner's answer, checked by its header before a value of it is decoded (a hostile
        # owner's lossy "sum" of max_bytes would be seconds of widening), then widened off the
        # loop where that is work.
        length, said = where.stop - where.start, list(reply.header.tensors)
        if [(t.name, t.dtype, list(t.shape)) for t in said] != [
            ("sum", dtype_name(flat.dtype), [length])
        ]:
            shapes = {t.name: (t.dtype, list(t.shape)) for t in said[:4]}
            raise InvalidArgument(f"expected a 'sum' of {flat.dtype}[{length}], got {shapes}")
        tensors = await wire.decode_named_async(reply, device="cpu", max_bytes=s.max_bytes)
        got = tensors["sum"]
        if got.data_ptr() != self.total[where].data_ptr():  # not received in place
            await self._off(self._place, where, got)
        if self._on_sum is not None:  # a lossy part is one slice: its sum whole
            self._on_sum(k, _as_received(reply))
        if check is not None:
            await asyncio.to_thread(check.summed, k, where.start, self.total[where])
        self.received += sum(t.nbytes for t in reply.header.tensors)

    async def _remote(self, k: int) -> None:
        """Part k's slices to its owner, `window` calls at a time, in order."""
        pending: deque[asyncio.Future[None]] = deque()
        try:
            for j, where in enumerate(self._slices(k)):
                if len(pending) >= self.settings.window:
                    await pending.popleft()
                pending.append(asyncio.ensure_future(self._remote_slice(k, j, where)))
            while pending:
                await pending.popleft()
        finally:  # failed or cancelled: the slices still under way end with it
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _own_slice(self, j: int, where: slice, gate: asyncio.Semaphore | None) -> None:
        if gate is None:
            return await self._own_summed(j, where)
        async with gate:
            await self._own_summed(j, where)

    def _own_slice_values(self, where: slice) -> tuple[torch.Tensor, bool]:
        """This replica's values of its own slice `where` on the host as they are contributed,
        and whether they are a copy the averager may sum into."""
        s = self.settings
        values = self._fed(s.index, where)
        if self.staging is not None and self.feedback is None:
            values, owned = self.staging.to_host(values), True
        else:
            values, owned = values.cpu(), False
        if not self.lossy:
            return values, owned
        # As it would travel (whole: a lossy part is one slice).
        travelled = decode(encode(values, "part", s.codec, s.block_size))
        if self.feedback is not None and self._dropped is not None:
            self._dropped.sent[where] = values - travelled  # as in `_encoded`
            # The sum's own error goes in through the one contribution its owner makes.
            travelled = travelled + self.feedback.summed[where]
        return travelled, False

    async def _own_summed(self, j: int, where: slice) -> None:
        s, index = self.settings, self.settings.index
        values, owned = await self._off(self._own_slice_values, where)
        if self.checks is not None:  # before the averager may sum into `values`
            await asyncio.to_thread(self.checks.contributed, index, where.start, values)
        reduced = await self.averager.reduce(
            self.key,
            index,
            index,
            self.n,
            values,
            timeout_s=s.timeout_s,
            codec=s.codec,
            block_size=s.block_size,
            slice=j,
            owned=owned,
            contributors=s.parts.contributors,
        )
        if self._dropped is not None:
            self._dropped.summed[where] = reduced.exact - reduced.tensor
        if self._on_sum is not None and reduced.message is not None:
            self._on_sum(index, reduced.message)
        if self.checks is not None:  # the sum as every member takes it
            await asyncio.to_thread(self.checks.summed, index, where.start, reduced.tensor)
        await self._overwriting(where)
        await self._off(self._place, where, reduced.tensor)

    async def _own(self) -> None:
        """This replica's own part: every slice contributed at once (views of the gradient,
        nothing sent), each summed as the others' slices arrive. A device's: `window` slices at
        a time, in order (as the others send theirs), so that only those are on the host."""
        gate = asyncio.Semaphore(self.settings.window) if self.staging is not None else None
        slices = self._slices(self.settings.index)
        checks = self.checks
        if checks is not None:  # its words about what each sender sent (`PartChecks.summing`)
            self.averager.on_summing(
                self.key, lambda k, j, values: checks.summing(k, slices[j].start, values)
            )
        tasks = [asyncio.ensure_future(self._own_slice(j, w, gate)) for j, w in enumerate(slices)]
        try:
            await asyncio.gather(*tasks)
        finally:
            self.averager.on_summing(self.key, None)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.checks is not None:  # what each contributor sent it: the norm bound's evidence
            index = self.settings.index
            self.checks.received[index] = self.averager.received(self.key, index)

    def _others(self, missing: Sequence[int]) -> list[int]:
        return [i for i in missing if 0 <= i < self.n and i != self.settings.index]

    async def _guarded(self, k: int) -> None:
        """Part k's sum, or AveragingAborted naming the members the part failed on: the owner
        of a part that could not be had (unreachable, refusing, a bad reply), or those the owner
        says it waited for; for this replica's own part, the senders that never came."""
        group, index = self.settings.group, self.settings.index
        where = f"peer {group[k]} (part {k})" if k != index else f"own part {index}"
        culprits: list[int] = [k] if k != index else []
        try:
            await (self._own() if k == index else self._remote(k))
            return
        except grpc.aio.AioRpcError as e:
            reason = f"{where}: {e.code().name}: {e.details()}"
            refusal = from_rpc_error(e)
            if isinstance(refusal, Aborted):  # the owner aborted: whom it names, else itself
                culprits = self._others(refusal.missing) or culprits
        except AveragingAborted as e:  # own part: timed out or aborted
            reason, culprits = f"{where}: {e}", self._others(e.missing)
        except Exception as e:  # a bad reply, a refused contribution: all abort
            if is_out_of_memory(e):
                raise  # this replica's own failure, not the peer's: `run` names it
            reason = f"{where}: {type(e).__name__}: {e}"
        if culprits:
            reason += f"; failed on {[group[i] for i in culprits]}"
        raise AveragingAborted(reason, culprits)

    async def run(self) -> torch.Tensor:
        """Every part at once; the total (on `flat`'s device), or AveragingAborted. Either way
        no copy of the round's is still under way once it returns (a failed round's caller
        restores `flat`: nothing may land in it after)."""
        try:
            return await self._run()
        finally:
            await self._off.close()

    async def _run(self) -> torch.Tensor:
        me = self.settings.group[self.settings.index]
        # An empty part (its owner is a client) is neither sent nor awaited.
        owned = [k for k, part in enumerate(self.parts) if part.stop > part.start]
        tasks = [asyncio.ensure_future(self._guarded(k)) for k in owned]
        try:
            await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reason = str(e) if isinstance(e, AveragingAborted) else f"{type(e).__name__} {e}"
            missing: tuple[int, ...] = ()
            if isinstance(e, AveragingAborted):
                missing = e.missing
            elif isinstance(e, Exception):  # this replica failed (out of memory): it is the
                missing = (self.settings.index,)  # one its partners leave out
            # Peers still waiting on this replica's part learn it now, not at their timeout, and
            # whom it failed on.
            self.averager.abort(self.key, f"{me} gave up: {reason}", missing)
            if not isinstance(e, AveragingAborted):
                raise  # cancelled (the caller's own doing), or this replica's own failure
            log.warning("%s: %s aborted: %s", me, round_name(self.key), reason)
            raise AveragingAborted(
                f"{me}: {round_name(self.key)} aborted: {reason}", missing
            ) from None
        if self.feedback is not None and self._dropped is not None:
            self.feedback.sent, self.feedback.summed = self._dropped.sent, self._dropped.summed
        return self.total


def _as_received(reply: wire.Received[Any]) -> tensor_pb2.Tensor:
    """The sum an owner's reply carries (its part's) as one message, its bytes in `data`
    (a chunked payload copied there: a lossy codec's, a fraction of the part's values)."""
    i = next(i for i, t in enumerate(reply.header.tensors) if t.name == "sum")  # decoded: there
    sent = tensor_pb2.Tensor()
    sent.CopyFrom(reply.header.tensors[i])
    payload = reply.payloads[i]
    if isinstance(payload, torch.Tensor):  # handed over: never on the pool's wire, but whole
        sent.data = payload.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    else:
        sent.data = bytes(payload)
    sent.ClearField("handover")
    return sent
