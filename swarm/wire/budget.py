"""A process's budget for the bodies of the requests it holds at once.

Every request a server receives declares its tensor bytes in its header (`swarm.wire.chunking`);
a server reserves them here before it allocates or accumulates a byte of the body, and gives them
back when the call is done with them. A call past the budget is refused at once (Busy on the data
plane, where another replica can take it; RESOURCE_EXHAUSTED elsewhere), never queued: however
many calls arrive, the bodies held stay within the budget, so no message, and no number of them,
sizes the process's memory.

Used from one event loop: no locking.
"""

from __future__ import annotations

from types import TracebackType

from swarm.errors import ConfigError, ResourceExhausted

__all__ = ["Held", "ReceiveBudget"]


class ReceiveBudget:
    """At most `max_bytes` bytes of request bodies held at once; `flag` names the setting in
    refusals (how an operator raises it)."""

    def __init__(self, max_bytes: int, flag: str = "--receive-budget-bytes") -> None:
        if max_bytes <= 0:
            raise ConfigError(f"{flag} must be positive, got {max_bytes}")
        self.max_bytes, self.flag = max_bytes, flag
        self.in_use = 0  # bytes reserved now, by every call together

    def hold(self, refuse: type[ResourceExhausted] = ResourceExhausted) -> Held:
        """A call's reservations, given back together when it ends (`with budget.hold() as h`);
        a reservation past the budget raises `refuse`."""
        return Held(self, refuse)


class Held:
    """The bytes one call holds of a `ReceiveBudget`."""

    def __init__(self, budget: ReceiveBudget, refuse: type[ResourceExhausted]) -> None:
        self._budget, self._refuse = budget, refuse
        self.nbytes = 0

    def reserve(self, nbytes: int) -> None:
        """Take `nbytes` more for this call, or raise before anything is held for them."""
        budget = self._budget
        if nbytes > budget.max_bytes - budget.in_use:
            raise self._refuse(
                f"{nbytes} bytes declared, but {budget.in_use} of this process's "
                f"{budget.max_bytes} bytes for received bodies are in use ({budget.flag}); "
                "try again later or elsewhere"
            )
        budget.in_use += nbytes
        self.nbytes += nbytes

    def release(self) -> None:
        """Give back everything this call holds (twice is harmless)."""
        self._budget.in_use -= self.nbytes
        self.nbytes = 0

    def __enter__(self) -> Held:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
