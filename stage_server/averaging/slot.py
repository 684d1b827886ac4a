"""One slice of a round's part, as its owner holds it while the contributions come: the group
its senders name (checked before anything is held for it), what they agree on, the values that
came, and the sum's future and deadline (`stage_server.averaging.owner.Averager` keeps them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from stage_server.averaging.summing import Reduced
from swarm.errors import InvalidArgument

__all__ = ["MAX_GROUP_SIZE", "OWN_DEADLINE_SHARE", "Slot", "checked_group", "same_bits"]

# The most replicas one round of a pool may have. A round's group size arrives in every
# contribution (a uint32): the owner keeps a slot per sender, so it is bounded before anything
# is allocated. Far above any pool (each round also sends a part to every member).
MAX_GROUP_SIZE = 1024


# A contributor's wait that ends before its part has been open this share of the round's
# timeout was ended by the caller's own deadline, not the round's (`Slot.wait_ended`).
OWN_DEADLINE_SHARE = 0.5


@dataclass
class Slot:
    group_size: int
    contributors: int  # the senders 0..contributors-1 whose values the sum waits for
    signature: tuple[Any, ...]  # shape, dtype, codec, block size: all contributions agree
    done: asyncio.Future[Reduced]
    timer: asyncio.TimerHandle
    # sender -> its values, and whether the averager may write into them: what came, not a
    # place for each sender of the group a contribution names (issue 54, N13: two lists of
    # 1,024 a slot, ~17 KiB, for each empty contribution held open)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    owned: dict[int, bool] = field(default_factory=dict)
    waiting: int = 0  # contributions waiting for the sum now (each a call, or the owner's own)
    # every contribution came and the sum is being made (`values` handed to it): none missing
    summing: bool = False
    opened: float = 0.0  # when its first contribution came (the loop's clock)

    def wait_ended(self, own_s: float, round_s: float, now: float) -> tuple[str, list[int], bool]:
        """A contributor's wait for the sum ended, after `own_s` (its call's deadline, at most
        the round's `round_s`): why in words, whom it names, and whether the round aborts.

        - Every sender came and the sum is being made: the caller's own deadline, no round's.
        - The part open for less than `OWN_DEADLINE_SHARE` of the round's timeout: the caller's
          own deadline too, naming nobody; the round waits on. A member's call of 50 ms aborted
          every round it joined first, naming the honest members it came before.
        - Else the round aborts, naming the senders that never came: an honest member's call
          lasts the round's timeout."""
        if self.summing:
            return "timed out while its sum was made", [], False
        opened_s = now - self.opened
        if opened_s < OWN_DEADLINE_SHARE * round_s:
            words = f"the call's own deadline ({own_s:.3g} s) ended {opened_s:.3g} s into it"
            return f"{words} ({round_s:.3g} s a round)", [], False
        missing = self.missing()
        named = f" waiting for senders {missing}" if missing else ""
        return f"timed out after {own_s:.3g} s{named}", missing, True

    def missing(self) -> list[int]:
        if self.summing:
            return []
        return [i for i in range(self.contributors) if i not in self.values]


def checked_group(
    name: str, key: tuple[int, int], sender: int, group: tuple[int, int]
) -> tuple[int, int]:
    """The group a sender names (its size, its contributors: 0 for all), checked against the
    part and the sender before anything is held for it. `name`: the slice, for the refusal."""
    part, _ = key
    group_size, contributors = group
    if group_size > MAX_GROUP_SIZE:
        raise InvalidArgument(f"{name}: group size {group_size} above {MAX_GROUP_SIZE}")
    if not 0 <= contributors <= group_size:
        raise InvalidArgument(f"{name}: {contributors} contributors in a group of {group_size}")
    contributors = contributors or group_size
    if group_size < 1 or not (0 <= part < group_size and 0 <= sender < contributors):
        raise InvalidArgument(
            f"{name}: part {part} out of 0..{group_size - 1} or sender {sender} out of "
            f"0..{contributors - 1} (the contributors)"
        )
    return group_size, contributors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a sender's retry carries the values it sent. Bytes, not values: NaN != NaN would
    refuse an honest retry."""
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )
