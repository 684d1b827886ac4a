"""`PoolService.Reduce` served: the owner's side of a round over the wire. A contribution to a part
this replica owns is received (routed from its header, its bytes from the process's receive
budget as they arrive), summed by the `Averager` (`stage_server.averaging.owner`) with the other
senders', and the sum answered; a round that fails answers ABORTED naming the senders it waited
for."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from stage_server.averaging.owner import Averager
from stage_server.averaging.slot import checked_group
from stage_server.peer.links import LinkMeter, incoming, outgoing
from swarm.errors import InvalidArgument
from swarm.net.round_tickets import RoundTickets
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.rpc.servicing import Observe, Servicing
from swarm.wire import chunking as wire
from swarm.wire.budget import Held, ReceiveBudget

__all__ = ["PoolServicer"]

# The server answers this much before the caller's deadline, so the caller reads why (ABORTED with
# the missing senders) rather than a bare DEADLINE_EXCEEDED (seconds).
_REPLY_MARGIN_S = 0.25


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    """`PoolService.Reduce` over an `Averager`: receive a part, wait for its sum, reply it.

    `route(job, stage)` raises NotFound when this replica does not serve that job and stage;
    `timeout_s` bounds a wait when the caller set no deadline; `on_bytes(sent, received)` counts
    wire bytes; `observe` sees every call (the stage server's request metrics). `served()`,
    read at every call, is `(chunk_bytes, max_bytes, timeout_s)` of the job the replica serves
    now (its `[runtime]` within the peer's own limits; None while it serves none), so the owner
    side of a round follows the job however its stage was installed.

    A contribution is routed from its header, before a byte of its part is allocated, and the
    part's bytes come from `budget` (the process's, shared with the stage's calls) as they
    arrive, held until its sum is answered: a part declared past what is free, or bytes past
    it, and the call is refused with RESOURCE_EXHAUSTED. `limit_name` names the
    setting behind `max_bytes` in refusals. `scheduler_key(job)` is the key of the scheduler
    that placed the job's replicas (None: none did), whose round tickets a contribution must
    carry then. `timeout_of(job)`: that job's averaging timeout, where this owner serves
    several jobs' rounds (an aggregator; None: `settings`' timeout): a round keeps its own job's,
    so a member's call that lasts it is judged by it (`Slot.wait_ended`).
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
        link: LinkMeter | None = None,
        observe: Observe | None = None,
        scheduler_key: Callable[[str], bytes | None] = lambda job: None,
        timeout_of: Callable[[str], float | None] = lambda job: None,
    ) -> None:
        self.averager, self._route, self.peer, self._on_bytes = averager, route, peer, on_bytes
        self._link = link  # where its streams record their bytes (`stage_server.peer.links`)
        self._chunk, self._max_bytes, self._timeout_s = chunk_bytes, max_bytes, timeout_s
        self._served = served
        # No budget given (a pool on its own, in tests): bounded by max_bytes per call only.
        self._budget, self._limit_name = budget or ReceiveBudget(1 << 62), limit_name
        self._serving = Servicing(peer, observe)  # the server's request metrics, if any
        self._scheduler_key = scheduler_key
        self._timeout_of = timeout_of
        self._tickets: RoundTickets | None = None  # of the last key a job was placed with

    def settings(self) -> tuple[int, int, float]:
        """`(chunk_bytes, max_bytes, timeout_s)` a call is served with now."""
        served = self._served() if self._served is not None else None
        return served if served is not None else (self._chunk, self._max_bytes, self._timeout_s)

    def _admit(self, first: pool_pb2.PoolReduceRequest) -> None:
        """A contribution is taken for a job and stage this owner serves, and, where a scheduler
        placed it, from the member its round's ticket places at `sender`
        (`swarm.net.round_tickets`): before a byte of its part is held."""
        self._route(first.job, first.stage)
        key = self._scheduler_key(first.job)
        if key is None:
            return  # its owner coordinates the pool: the token, as before
        # The group it names is bounded before its ticket is read: the ticket's digests, one
        # per member, are as many as the header says.
        group = (first.group_size, first.contributors)
        checked_group(f"round {first.round!r}", (first.part, first.slice), first.sender, group)
        if self._tickets is None or self._tickets.public != key:
            self._tickets = RoundTickets(key, self.peer)
        self._tickets.check(first)

    async def Reduce(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pool_pb2.PoolReduceResponse]:
        requests = incoming(request_iterator, self._link)
        replies, held = await self._serving.run(
            "Reduce", context, lambda: self._reduce(requests, context)
        )
        with held, outgoing(self._link) as sending:
            for msg in replies:
                sending(msg)
                yield msg

    async def _reduce(
        self, requests: Any, context: grpc.aio.ServicerContext
    ) -> tuple[Iterator[pool_pb2.PoolReduceResponse], contextlib.ExitStack]:
        """The call's replies, and its hold on the receive budget, which stays until they are
        sent: the sum (and a lossy codec's encoding beside it) lives as long as the reply, which
        a caller that does not read keeps for as long as it keeps the stream."""
        hold = contextlib.ExitStack()
        held = hold.enter_context(self._budget.hold())
        try:
            return await self._reduce_held(requests, context, held), hold
        except BaseException:
            hold.close()
            raise

    async def _reduce_held(
        self, requests: Any, context: grpc.aio.ServicerContext, held: Held
    ) -> Iterator[pool_pb2.PoolReduceResponse]:
        chunk_bytes, max_bytes, timeout = self.settings()
        # A caller with no deadline must not wait for its part forever.
        body = wire.within_deadline(requests, timeout, "the job's runtime.averaging_timeout_s")
        # A part's bytes are held as they come, not as its header declares them: headers that
        # declare a GiB each and send nothing would hold the whole budget for the averaging
        # timeout, and refuse every honest round meanwhile (issue 44, N6). A declared part
        # that could not fit now is still refused at once.
        body = held.arriving(body)
        received = await wire.receive(
            body,
            max_bytes=max_bytes,
            admit=self._admit,
            reserve=held.expect,
            limit_name=self._limit_name,
        )
        h: pool_pb2.PoolReduceRequest = received.header
        tensors = await wire.decode_named_async(  # a lossy part widened off the loop
            received, device="cpu", max_bytes=max_bytes, reserve=held.reserve
        )
        if set(tensors) != {"part"}:
            raise InvalidArgument(f"Reduce carries one tensor named 'part', got {sorted(tensors)}")
        (meta,) = h.tensors
        timeout = self._timeout_of(h.job) or timeout  # its own job's, not the largest of all
        remaining = context.time_remaining()
        wait = None  # the caller's own deadline, where it set one: its wait ends there
        if remaining is not None:
            wait = remaining - min(_REPLY_MARGIN_S, remaining / 10)
        reduced = await self.averager.reduce(
            (h.job, h.stage, h.round),
            h.part,
            h.sender,
            h.group_size,
            tensors["part"],
            timeout_s=timeout,
            wait_s=wait,
            codec=meta.codec,
            block_size=meta.block_size,
            owned=not meta.data,  # chunked: received into a buffer of its own, summed into
            slice=h.slice,
            contributors=h.contributors,
        )
        # The sender closed its side before it waits for this sum: its end is here already.
        await wire.read_to_end(body, "the contribution's")
        replies = reduced.replies(chunk_bytes)
        if self._on_bytes is not None:
            self._on_bytes(reduced.wire_bytes, meta.nbytes)
        return replies
