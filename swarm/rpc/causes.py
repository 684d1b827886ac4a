"""Why a hop failed, kept and said (DESIGN.md, "Failures say why").

A failed call's cause is its gRPC code and text (`described`): "FAILED_PRECONDITION: handover
refused: ...". The hop loop (`swarm.rpc.hop`) hands every failed call to its sender's `Causes`,
which keeps each stage's last one, so a hop that later finds every replica in backoff still says
why they are there, and the text travels on in the next error (a replica's next hop answers its
caller with it, and so on up to the trainer).

The first failure behind each backoff (the call whose failure put the replica in backoff) is
logged at WARNING, at most once per `every_s` for each peer and cause: a replica refusing every
push, thousands a minute, makes one line a rate window with the count held back, where before
every line was at INFO and the default log level said nothing. A cause's numbers (a step, a
microbatch) do not make it another cause. Failures while a replica is already in backoff are
the same outage, logged at INFO."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.errors import RemoteError
from swarm.ops.rated import RatedLog
from swarm.rpc.status import status_code

__all__ = ["CAUSE_CHARS", "FAILURE_LOG_S", "Cause", "Causes", "brief", "described", "kind"]

log = logging.getLogger(__name__)

FAILURE_LOG_S = 60.0
"""The rate window of a peer's failure WARNINGs, for each cause."""
CAUSE_CHARS = 2000
"""The longest cause kept or sent on: a cause nests the causes of the hops after it (one per
stage), and a peer's text is untrusted: its length is bounded wherever it is kept."""

_CODE = re.compile(r"[A-Z][A-Z_]+: ")  # a text that names its code already (`from_rpc_error`)
_NUMBERS = re.compile(r"\d+")


def described(error: BaseException) -> str:
    """`error` as its gRPC code and text: "CODE: text" (the code it would cross the wire with, or
    the one it crossed with: a `RemoteError`'s, or the one its text starts with)."""
    text = str(error) or type(error).__name__
    if _CODE.match(text):
        return bounded(text)
    code = error.code if isinstance(error, RemoteError) else None
    if code is None:
        status = status_code(error)
        code = status.name if status is not None else type(error).__name__
    return bounded(f"{code}: {text}")


def brief(error: BaseException) -> str:
    """`error` in a few words: its code and its last cause ("UNAVAILABLE: Connection refused");
    a gRPC error's details run on through every layer that passed it up."""
    lines = str(error).splitlines()
    parts = lines[0].split(": ") if lines else [type(error).__name__]
    text = f"{parts[0]}: {parts[-1]}" if len(parts) > 2 else ": ".join(parts)
    return text if len(text) <= 120 else text[:117] + "..."


def kind(text: str) -> str:
    """What makes two causes the same for the rate of their log lines: their text, numbers aside
    (a step, a microbatch, a time)."""
    return _NUMBERS.sub("N", text)


def bounded(text: str) -> str:
    """`text`, cut to `CAUSE_CHARS` (its start says the outermost hops; the end is cut)."""
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."


@dataclass(frozen=True)
class Cause:
    """A replica's failed call: whom it went to and why it failed."""

    stage: int
    peer: str
    text: str  # `described`
    at: float  # the `Causes` clock's seconds (monotonic)
    wall: float  # unix seconds: when, as a message says it

    @property
    def clock_time(self) -> str:
        """When, as "HH:MM:SS" local time: a message that is kept (a job's status) must not
        say how long ago, which is only true the moment it is written."""
        return time.strftime("%H:%M:%S", time.localtime(self.wall))

    def __str__(self) -> str:
        return f"peer {self.peer}: {self.text}"


class Causes:
    """The last failed call of each stage one sender saw, and the WARNINGs said of them."""

    def __init__(
        self, every_s: float = FAILURE_LOG_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._rated = RatedLog(log, every_s, clock)
        self._last: dict[int, Cause] = {}

    def failed(self, stage: int, peer: str, error: BaseException, backoff_s: float) -> Cause:
        """`peer` of `stage` failed a call with `error`; `backoff_s`: the backoff that failure
        started (0: it was in backoff already, or it left the stage meanwhile)."""
        cause = Cause(stage, peer, described(error), self._clock(), time.time())
        self._last[stage] = cause
        if backoff_s > 0:
            key = (stage, peer, kind(cause.text))
            self._rated.warning(
                key,
                "stage %d: %s failed: %s; backoff %.1f s, trying another replica",
                stage,
                peer,
                cause.text,
                backoff_s,
            )
        else:
            log.info("stage %d: %s failed (in backoff already): %s", stage, peer, cause.text)
        return cause

    def last(self, stage: int) -> Cause | None:
        """The last failed call to a replica of `stage`, if any."""
        return self._last.get(stage)

    def latest(self) -> Cause | None:
        """The last failed call to any stage, if any."""
        return max(self._last.values(), key=lambda c: c.at, default=None)
