"""The owner's side of pool averaging: the parts of a round this replica sums, and their outcome.

In a round each member owns one contiguous part of the flat gradient (`swarm.policy.parts`:
sized by the members' links, possibly empty); the contributors (the group's first
`contributors` members: all of them but aggregators, which own parts and contribute nothing)
send it their values of that part, and `Averager` sums the contributions in sender order once and
gives every waiter that one result (see `stage_server.averaging.butterfly` for the round as a
whole).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from stage_server.averaging.slot import MAX_GROUP_SIZE, Slot, checked_group, same_bits
from stage_server.averaging.summing import Reduced, Summer, squares, sum_in_order
from swarm.deadline import within
from swarm.device.oom import is_out_of_memory
from swarm.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from swarm.wire.codec import CODEC_INT8_BLOCKWISE, CODEC_NONE

__all__ = [
    "MAX_GROUP_SIZE",
    "Averager",
    "AveragingAborted",
    "RoundKey",
    "Summing",
    "round_name",
]

log = logging.getLogger(__name__)

RoundKey = tuple[str, int, str]  # (job, stage, round id): rounds of two stages never mix
# (part, slice, each sender's values in sender order): seen before they are summed
Summing = Callable[[int, int, list[torch.Tensor]], None]
_COMPLETED = "completed"


class AveragingAborted(Aborted):
    """An averaging round cannot complete here: a peer is missing, unreachable or refused, or the
    round timed out or was aborted. Answered as ABORTED; retry the round under a new id.
    `missing` (from `Aborted`, and sent with the answer): the group indices of the members it
    failed on: the senders a timed-out part still waited for, or whom the replica that aborted
    the round named."""


class Averager:
    """The owner's side of the rounds this replica takes part in (one per replica process).

    A round's part completes when all its senders contributed (the group's first `contributors`,
    all `group_size` by default); a timeout or `abort` fails every open part of the round.
    Finished rounds are forgotten but for their outcome, of which the last `history` are kept, so
    a late contribution gets a clear error instead of waiting.
    """

    def __init__(
        self,
        *,
        max_open_rounds: int = 64,
        history: int = 256,
        max_open_slices: int = 4096,
        max_open_total: int = 8192,
    ) -> None:
        self._max_open, self._history = max_open_rounds, history
        # Parts (slices) open at once in every round together: each holds a timer, a future and
        # the contributions that came; 64 rounds of 4,096 would be 262,144 (issue 54, N13).
        self._max_open_total, self._open_total = max_open_total, 0
        # Slices of one round open or summed: each open one holds a timer and its contributions
        # (whose bytes the receive budget bounds), each summed one is remembered; a sender
        # sends a few per part at a time, a part of 64 GiB in 16 MiB slices is 4096.
        self._max_open_slices = max_open_slices
        # round -> (part, slice) -> its contributions so far
        self._open: dict[RoundKey, dict[tuple[int, int], Slot]] = {}
        # round -> (outcome, the members an aborted one failed on)
        self._closed: OrderedDict[RoundKey, tuple[str, tuple[int, ...]]] = OrderedDict()
        # round -> its (part, slice)s summed already: a round's slices come and complete one by
        # one, so a round with none open may still have more to come; a late sender of one
        # summed is refused
        self._summed: OrderedDict[RoundKey, set[tuple[int, int]]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.summer: Summer = sum_in_order  # this averager's own (see `Summer`)
        # round -> part -> each sender's squared norm summed into it so far (`received`)
        self._norms: OrderedDict[RoundKey, dict[int, list[float]]] = OrderedDict()
        # round -> what sees each slice's contributions before they are summed (`on_summing`)
        self._summing: dict[RoundKey, Summing] = {}

    def received(self, round: RoundKey, part: int) -> list[float]:
        """The squared norm of each sender's values summed into `part` of `round` (the norm
        bound's evidence: `scheduler.coordinator.trust.norm_bound`), forgotten once read."""
        return self._norms.get(round, {}).pop(part, [])

    def on_summing(self, round: RoundKey, summing: Summing | None) -> None:
        """Have `summing(part, slice, values)` see each slice of `round` summed here from now
        on (None: no longer), off the event loop, before anything is summed into `values`: the
        owner's words about what each sender sent (`checksum.PartChecks.summing`)."""
        if summing is None:
            self._summing.pop(round, None)
        else:
            self._summing[round] = summing

    def _measured(self, round: RoundKey, part: int, squares: list[float]) -> None:
        """Count each contribution's squared norm (on the loop: slices finish concurrently)."""
        of = self._norms.setdefault(round, {})
        self._norms.move_to_end(round)
        so_far = of.setdefault(part, [0.0] * len(squares))
        of[part] = [a + b for a, b in zip(so_far, squares, strict=False)]
        while len(self._norms) > self._history:
            self._norms.popitem(last=False)

    def open_rounds(self) -> set[RoundKey]:
        return set(self._open)

    def outcome(self, round: RoundKey) -> str | None:
        """The outcome ("aborted: <why>", or "completed" while nothing of it is open and some
        was summed); None while open or once forgotten."""
        closed = self._closed.get(round)
        if closed is not None:
            return closed[0]
        return _COMPLETED if round in self._summed and round not in self._open else None

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
        contributors: int = 0,
    ) -> torch.Tensor:
        """Add `values` as `sender`'s contribution to `part` of `round`; the part's sum once all
        `contributors` (0: all `group_size`) arrived. `codec` is how the contributions
        travelled; the sum is given back through the same codec. A sender may repeat
        bit-identical values (a retry): it joins."""
        return (
            await self.reduce(
                round,
                part,
                sender,
                group_size,
                values,
                timeout_s=timeout_s,
                codec=codec,
                block_size=block_size,
                contributors=contributors,
            )
        ).tensor

    async def reduce(
        self,
        round: RoundKey,
        part: int,
        sender: int,
        group_size: int,
        values: torch.Tensor,
        *,
        timeout_s: float,
        wait_s: float | None = None,
        codec: int = CODEC_NONE,
        block_size: int = 2048,
        owned: bool = False,
        slice: int = 0,
        contributors: int = 0,
    ) -> Reduced:
        """`contribute`, returning the shared `Reduced` (the servicer replies its bytes).
        `owned`: `values` is a buffer the averager may sum into (a contribution received for
        it), not a sender's own gradient. `slice`: which slice of the part `values` are (a
        part sent in slices is summed slice by slice, each on its own). `contributors`: how
        many of the group send (senders 0..contributors-1; 0: the whole group).

        `timeout_s` is the round's (the job's): past it the round aborts, naming the senders
        that never came; `wait_s` (None: `timeout_s`) is this caller's own, its call's deadline
        (how a wait's end is judged: `Slot.wait_ended`)."""
        slot = self._admit(
            round,
            (part, slice),
            sender,
            (group_size, contributors),
            values,
            timeout_s,
            codec,
            block_size,
            owned,
        )
        slot.waiting += 1
        own = timeout_s if wait_s is None else min(wait_s, timeout_s)
        try:
            return await self._awaited(slot, max(own, 0.0))
        except TimeoutError:
            now = asyncio.get_running_loop().time()
            why, missing, aborts = slot.wait_ended(own, timeout_s, now)
            if aborts:
                self.abort(round, f"{_where(part, slice)} {why}", missing)
            raise AveragingAborted(
                f"{round_name(round)}: {_where(part, slice)} {why}", missing
            ) from None
        except AveragingAborted as e:
            raise AveragingAborted(str(e), e.missing) from None  # a fresh one per waiter
        finally:
            slot.waiting -= 1
            if not slot.waiting:
                self._forsaken(round, (part, slice), slot)

    def _forsaken(self, round: RoundKey, key: tuple[int, int], slot: Slot) -> None:
        """`slot` still open, with no one waiting for its sum any more (every call that
        contributed to it ended, hung up): no one would receive its sum, so it goes now, not at
        the round's timeout. Else calls that contribute and hang up would each leave a slot (a
        sender list as long as the group they name, up to `MAX_GROUP_SIZE`, and a timer) for
        the whole averaging timeout (issue 44, N13). The round is not aborted: a stranger could
        abort it so. A sender that comes later opens the slot again."""
        slots = self._open.get(round)
        if slots is None or slots.get(key) is not slot:
            return  # summed, timed out or aborted: nothing left open
        slot.timer.cancel()
        self._open_total -= 1
        del slots[key]
        if not slots:
            del self._open[round]
        if not slot.done.done():
            slot.done.cancel()
        log.debug("%s %s: every contributor hung up; dropped", round_name(round), _where(*key))

    @staticmethod
    async def _awaited(slot: Slot, timeout_s: float) -> Reduced:
        """The part's sum, or `TimeoutError`. A slot's own timer (the same timeout, set by its
        first contribution) may end it as this wait runs out: that outcome, not a timeout."""
        try:
            return await within(asyncio.shield(slot.done), timeout_s)
        except TimeoutError:
            if slot.done.done():
                return slot.done.result()
            raise

    def abort(self, round: RoundKey, reason: str, missing: Sequence[int] = ()) -> None:
        """Fail every open part of `round` (waiters raise AveragingAborted) and refuse it later."""
        if missing:
            reason += f" waiting for senders {list(missing)}"
        slots = self._open.pop(round, {})
        self._open_total -= len(slots)
        for (part, slice), slot in slots.items():
            slot.timer.cancel()
            if not slot.done.done():
                where = f"{round_name(round)} {_where(part, slice)}"
                error = AveragingAborted(f"{where}: {reason}", missing)
                slot.done.set_exception(error)
        if slots:
            log.info("%s aborted: %s", round_name(round), reason)
        self._remember(round, f"aborted: {reason}", missing)

    def close(self) -> None:
        for round in list(self._open):
            self.abort(round, "the averager closed")

    def _remember(self, round: RoundKey, outcome: str, missing: Sequence[int] = ()) -> None:
        self._closed[round] = (outcome, tuple(missing))
        self._closed.move_to_end(round)
        while len(self._closed) > self._history:
            self._closed.popitem(last=False)

    def _drop_if_empty(self, round: RoundKey) -> None:
        """A round opened for a contribution then refused holds nothing: it goes."""
        if not self._open.get(round, True):
            del self._open[round]

    def _admit(
        self,
        round: RoundKey,
        key: tuple[int, int],
        sender: int,
        group: tuple[int, int],
        values: torch.Tensor,
        timeout_s: float,
        codec: int,
        block_size: int,
        owned: bool,
    ) -> Slot:
        """`sender`'s values for one slice of `round`, admitted to its slot: the slot to wait
        on. A retry of the same values waits on the same sum; the last contribution starts it."""
        name = f"{round_name(round)} {_where(*key)}"
        group_size, contributors = checked_group(name, key, sender, group)
        outcome, missing = self._closed.get(round, (None, ()))
        if outcome is not None:
            raise AveragingAborted(f"{name}: {outcome}", missing)
        if key in self._summed.get(round, ()):
            raise FailedPrecondition(f"{name}: completed already; sender {sender} came too late")
        if not values.is_floating_point():
            codec = CODEC_NONE  # as `encode` sends it
        signature = (
            tuple(values.shape),
            values.dtype,
            codec,
            block_size if codec == CODEC_INT8_BLOCKWISE else 0,
        )
        slot = self._slot(
            round, key, name, sender, (group_size, contributors), signature, timeout_s
        )
        old = slot.values.get(sender)
        if old is not None:
            if not same_bits(old, values):
                raise InvalidArgument(f"{name}: sender {sender} contributed other values already")
            return slot  # a retry: it waits for the same sum
        slot.values[sender], slot.owned[sender] = values, owned
        if len(slot.values) == slot.contributors:
            self._sum(round, key, name, slot, codec, block_size)
        return slot

    def _slot(
        self,
        round: RoundKey,
        key: tuple[int, int],
        name: str,
        sender: int,
        group: tuple[int, int],
        signature: tuple[object, ...],
        timeout_s: float,
    ) -> Slot:
        """The slice's open slot, opened by its first contribution within the bounds on what
        this owner holds (rounds, slices of a round, parts in all), its deadline set then;
        every later sender must name the same group and send the same kind of values."""
        group_size, contributors = group
        slots = self._open.get(round)
        if slots is None:
            if len(self._open) >= self._max_open:
                raise ResourceExhausted(f"{name}: {self._max_open} rounds are open already")
            slots = self._open[round] = {}
        slot = slots.get(key)
        if slot is None:
            # Summed ones count too: each is remembered with its round (issue 44, N13).
            held = len(slots) + len(self._summed.get(round, ()))
            if held >= self._max_open_slices:
                self._drop_if_empty(round)
                raise ResourceExhausted(f"{name}: {held} slices of the round are open or summed")
            if self._open_total >= self._max_open_total:
                self._drop_if_empty(round)
                raise ResourceExhausted(
                    f"{name}: {self._open_total} parts of rounds are open here already"
                )
            loop = asyncio.get_running_loop()
            done: asyncio.Future[Reduced] = loop.create_future()
            done.add_done_callback(_retrieve)
            # The round's deadline even when every waiter has gone (cancelled calls).
            timer = loop.call_later(max(timeout_s, 0.0), self._expire, round, key, timeout_s)
            slot = slots[key] = Slot(
                group_size, contributors, signature, done, timer, opened=loop.time()
            )
            self._open_total += 1
        elif (slot.group_size, slot.contributors) != (group_size, contributors):
            raise InvalidArgument(
                f"{name}: group size {group_size} of {contributors} contributors, others said "
                f"{slot.group_size} of {slot.contributors}"
            )
        elif slot.signature != signature:
            raise InvalidArgument(
                f"{name}: sender {sender} sent {signature}, others {slot.signature}"
            )
        return slot

    def _sum(
        self,
        round: RoundKey,
        key: tuple[int, int],
        name: str,
        slot: Slot,
        codec: int,
        block_size: int,
    ) -> None:
        """Every contributor has sent: the slot closes (remembered as summed, so a late sender
        is told) and its sum runs as a task of its own."""
        slot.timer.cancel()
        self._open_total -= 1
        slots = self._open[round]
        del slots[key]
        if not slots:
            del self._open[round]
        self._summed.setdefault(round, set()).add(key)
        self._summed.move_to_end(round)
        while len(self._summed) > self._history:
            self._summed.popitem(last=False)
        task = asyncio.get_running_loop().create_task(
            self._finish(round, name, slot, codec, block_size, key)
        )
        self._tasks.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._tasks.discard)

    async def _finish(
        self,
        round: RoundKey,
        name: str,
        slot: Slot,
        codec: int,
        block_size: int,
        key: tuple[int, int],
    ) -> None:
        part = key[0]
        values = [slot.values[i] for i in range(slot.contributors)]  # in sender order
        owned = [slot.owned[i] for i in range(slot.contributors)]
        slot.values, slot.owned, slot.summing = {}, {}, True
        try:
            # Off the event loop: a large part's sum would hold up every other call.
            self._measured(round, part, await asyncio.to_thread(squares, values))
            summing = self._summing.get(round)
            if summing is not None:
                await asyncio.to_thread(summing, part, key[1], values)
            reduced = await asyncio.to_thread(self.summer, values, owned, codec, block_size)
        except Exception as e:
            log.exception("%s: the sum failed", name)
            # Out of memory: the owner failed, not a sender; part k's owner is member k.
            failed = [part] if is_out_of_memory(e) else []
            if not slot.done.done():
                slot.done.set_exception(AveragingAborted(f"{name}: {e}", failed))
        else:
            if not slot.done.done():
                slot.done.set_result(reduced)

    def _expire(self, round: RoundKey, key: tuple[int, int], timeout_s: float) -> None:
        slot = self._open.get(round, {}).get(key)
        if slot is not None:
            where = _where(*key)
            self.abort(round, f"{where} timed out after {timeout_s:.3g} s", slot.missing())


def _retrieve(fut: asyncio.Future[Reduced]) -> None:
    if not fut.cancelled():
        fut.exception()  # marks it retrieved: a round nobody waits for any more logs nothing


def _where(part: int, slice: int) -> str:
    return f"part {part}" if slice == 0 else f"part {part} slice {slice}"


def round_name(round: RoundKey) -> str:
    return f"round {round[2]!r} of job {round[0]} stage {round[1]}"
