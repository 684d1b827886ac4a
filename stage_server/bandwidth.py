"""A peer's link rates, measured from the transfers it makes anyway (issue 43): averaging rounds,
state downloads served and taken, activations received. No probe traffic: a rate is the bytes of
a transfer over the time it was on the wire, per direction, and what a peer announces
(`PeerAnnouncement.upload_bytes_per_second`, `download_bytes_per_second`; 0: unknown) unless
`--bandwidth UP/DOWN` (`swarm.net.bandwidth`) says otherwise.

Why the max of recent transfers, not an average: every transfer's rate is at most the link's (it
also waits for the other end's link, its compute, the summing of a round), so each is a lower
bound of what the link can do, and the largest recent one is the tightest. An average (an EMA)
of lower bounds stays below the link for good, and most below it on the slowest peer's partners,
which a round waits for: exactly the peers water-filling must tell apart. Idle gaps cost nothing
(no transfer, no sample). Only transfers of `min_bytes` or more count: a small call's time is
its latency, not its bytes. "Recent" is the last `keep` transfers of the last `window_s`
seconds, so a link that got slower shows within that window; after a longer silence the newest
transfer alone is the estimate (a stale rate is better than none: links change less often than
peers idle).

A round's own traffic is more than what `all_reduce` counts (`on_bytes`: the parts this replica
sends out and the sums it gets back): as an owner it also receives the others' parts and sends
them its part's sum (`PoolServicer`'s `on_bytes`). `RoundTraffic` adds the owner's bytes that
came during a round to the round's own, over the round's time, in both directions at once
(a round is full duplex)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from swarm.net.bandwidth import format_rate

__all__ = [
    "DIRECTIONS",
    "Direction",
    "LinkMeter",
    "RoundTraffic",
    "fill_rates",
    "material",
    "reannounce",
]

log = logging.getLogger(__name__)

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, Direction] = ("up", "down")
MIN_BYTES = 1 << 20  # smaller transfers take their latency's time, not their bytes'
KEEP = 8  # transfers the estimate is the max of...
WINDOW_S = 600.0  # ... when no older than this
CHANGE = 0.2  # re-announced when a rate moved by more than this share (or became known)
PERIOD_S = 5.0  # and checked no more often than this


class LinkMeter:
    """Upload and download rates in bytes per second, from `transferred(direction, nbytes,
    seconds)` (see the module's note for which transfers, and why their recent max); `fix(up,
    down)` overrides a direction with an operator's rate (0: measured). `clock` is monotonic
    seconds (injected: tests move it)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        min_bytes: int = MIN_BYTES,
        keep: int = KEEP,
        window_s: float = WINDOW_S,
    ) -> None:
        self.clock, self.min_bytes, self.window_s = clock, min_bytes, window_s
        self._samples: dict[Direction, deque[tuple[float, float]]] = {
            d: deque(maxlen=keep) for d in DIRECTIONS
        }
        self._fixed: dict[Direction, float] = dict.fromkeys(DIRECTIONS, 0.0)
        self.announced: tuple[float, float] = (0.0, 0.0)  # the rates the peer announced last

    def fix(self, up: float, down: float) -> None:
        """The operator's rates (`--bandwidth`), bytes per second; 0 leaves a direction measured."""
        if up < 0 or down < 0:
            raise ValueError(f"link rates are not negative: {up}/{down}")
        self._fixed = {"up": up, "down": down}

    def transferred(self, direction: Direction, nbytes: int, seconds: float) -> None:
        """`nbytes` went `direction` over `seconds` on the wire; counted when big enough."""
        if direction not in self._samples:
            raise ValueError(f"direction is 'up' or 'down', not {direction!r}")
        if nbytes < self.min_bytes or seconds <= 0:
            return
        self._samples[direction].append((self.clock(), nbytes / seconds))

    def measured(self, direction: Direction) -> float:
        """The measured rate `direction` (0: no transfer big enough yet), whatever is fixed."""
        samples = self._samples[direction]
        if not samples:
            return 0.0
        since = self.clock() - self.window_s
        recent = [rate for at, rate in samples if at >= since]
        return max(recent) if recent else samples[-1][1]

    def rate(self, direction: Direction) -> float:
        """What the peer announces `direction`: the operator's rate, else the measured one."""
        return self._fixed[direction] or self.measured(direction)

    def rates(self) -> tuple[float, float]:
        """(upload, download) bytes per second; 0 where unknown."""
        return self.rate("up"), self.rate("down")


class RoundTraffic:
    """A pool round's bytes into a `LinkMeter`: `counted(sent, received)` is the round's own
    (`all_reduce`'s `on_bytes`, when it ends), `served(sent, received)` each part this replica
    summed as an owner (`PoolServicer`'s `on_bytes`), `finished(seconds)` the round completed in
    `seconds`: its own bytes and the owner's of that span count, in both directions. A failed
    round (counted, never finished) counts nothing: the next round's bytes replace it."""

    def __init__(self, meter: LinkMeter, served_kept: int = 4096) -> None:
        self.meter = meter
        self._own: tuple[int, int] | None = None
        self._served: deque[tuple[float, int, int]] = deque(maxlen=served_kept)

    def counted(self, sent: int, received: int) -> None:
        self._own = (sent, received)

    def served(self, sent: int, received: int) -> None:
        self._served.append((self.meter.clock(), sent, received))

    def finished(self, seconds: float) -> None:
        own, self._own = self._own, None
        since = self.meter.clock() - seconds
        during = [(s, r) for at, s, r in self._served if at >= since]
        self._served.clear()
        if own is None:
            return
        sent = own[0] + sum(s for s, _ in during)
        received = own[1] + sum(r for _, r in during)
        self.meter.transferred("up", sent, seconds)
        self.meter.transferred("down", received, seconds)


def material(before: tuple[float, float], now: tuple[float, float], change: float = CHANGE) -> bool:
    """Whether rates moved enough from `before` to announce again: one became known or unknown,
    or one moved by more than `change` of what was announced."""
    for old, new in zip(before, now, strict=True):
        if (old <= 0) != (new <= 0):
            return True
        if old > 0 and abs(new - old) > change * old:
            return True
    return False


class Measured(Protocol):
    """What carries a peer's meter (its `StageMetrics`)."""

    @property
    def link(self) -> LinkMeter: ...


class Announcement(Protocol):
    upload_bytes_per_second: float
    download_bytes_per_second: float


def fill_rates(msg: Announcement, metrics: Measured | None) -> None:
    """The peer's announcement `msg` carries its link rates now (none: no meter, left 0), and the
    meter remembers them as announced."""
    if metrics is None:
        return
    up, down = metrics.link.rates()
    msg.upload_bytes_per_second, msg.download_bytes_per_second = up, down
    metrics.link.announced = (up, down)


async def reannounce(
    metrics: Measured | None,
    announce: Callable[[], Awaitable[None]],
    period_s: float = PERIOD_S,
    change: float = CHANGE,
) -> None:
    """Run for the peer's life: `announce()` again when its rates moved materially from what it
    announced last (`material`), checked every `period_s` (so at most that often)."""
    if metrics is None:
        return
    meter = metrics.link
    while True:
        await asyncio.sleep(period_s)
        now = meter.rates()
        if not material(meter.announced, now, change):
            continue
        log.info(
            "link measured at %s up, %s down: announced",
            format_rate(now[0]),
            format_rate(now[1]),
        )
        try:
            await announce()
        except Exception as e:  # a broker hiccup: the next check announces them
            log.debug("link rates not announced: %s", e)
