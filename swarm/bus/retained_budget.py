"""What the embedded broker retains for its users, counted: a retained message lives in the
scheduler's memory until someone clears it, and with the shared token anyone can log in as any
number of made-up peers. So each user but the scheduler has a budget of retained bytes, and all
of them together another (`BrokerLimits.max_retained_bytes_per_user`, `max_retained_bytes`);
which topics may be retained at all is the gate's (`Gate.may_retain`).

A message counts for its topic and the broker's record of it as well as its payload: 100 bytes
retained on a topic of 60 kB (a user named past a peer id's bound, refused at its login now)
counted as 100.
"""

from __future__ import annotations

__all__ = ["RETAINED_ENTRY_BYTES", "RetainedBudget"]

# The broker's own record of a retained message beside its topic and payload (amqtt's message
# object, its packet, the dict entry): counted once a message, so that many small ones cost.
RETAINED_ENTRY_BYTES = 256


class RetainedBudget:
    """The retained payload bytes of each counted user, by topic. The broker asks `refusal`
    before it retains a message and tells `stored` what it then holds on the topic; a topic the
    scheduler (or a trusted client, `user` None) retains on leaves the count."""

    def __init__(self, per_user: int, total: int) -> None:
        self._per_user, self._total = per_user, total
        self._topics: dict[str, tuple[str, int]] = {}  # topic -> (user, bytes) it holds
        self._users: dict[str, int] = {}  # user -> its bytes, over its topics
        self._sum = 0

    @property
    def used(self) -> int:
        """The counted bytes held now, all users together."""
        return self._sum

    def refusal(self, user: str | None, topic: str, size: int) -> str | None:
        """None when `user` may leave `size` bytes retained on `topic` (replacing what it holds
        there), else why not; `user` None: not counted."""
        if user is None:
            return None
        size = _cost(topic, size)
        owner, held = self._topics.get(topic, (None, 0))
        mine = self._users.get(user, 0) - (held if owner == user else 0) + size
        if mine > self._per_user:
            return (
                f"{mine} retained bytes of user {user!r} would exceed "
                f"limits.max_retained_bytes_per_user={self._per_user}"
            )
        if self._sum - (held if owner is not None else 0) + size > self._total:
            return (
                f"the users' retained messages would exceed limits.max_retained_bytes={self._total}"
            )
        return None

    def stored(self, user: str | None, topic: str, size: int) -> None:
        """The broker now holds `size` bytes (0: nothing) retained on `topic`, from `user`."""
        size = _cost(topic, size)
        owner, held = self._topics.pop(topic, (None, 0))
        if owner is not None:
            self._sum -= held
            left = self._users[owner] - held
            if left:
                self._users[owner] = left
            else:
                del self._users[owner]
        if user is not None and size > 0:
            self._topics[topic] = (user, size)
            self._users[user] = self._users.get(user, 0) + size
            self._sum += size


def _cost(topic: str, size: int) -> int:
    """What `size` payload bytes retained on `topic` count for (0: nothing is retained)."""
    return size + len(topic.encode()) + RETAINED_ENTRY_BYTES if size > 0 else 0
