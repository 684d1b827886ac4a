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
(no transfer, no sample). Only bursts of `min_bytes` or more count (`min_up_bytes` up, whose
end a sender sees early, see below): a small call's time is its latency, not its bytes.
"Recent" is the last `keep` bursts (below) of the last `window_s` seconds, so a link that got
slower shows within that window; after a longer silence the newest burst alone is the estimate
(a stale rate is better than none: links change less often than peers idle).

Why bursts, not a round's bytes over its time: in a round every member waits for the slowest,
so each member's bytes over the round's time is the slowest member's rate, whatever its own
link: the one thing water-filling needs to know (who is slow) would not show. What a link did
is measured where its bytes move instead: each stream a pool's round opens or serves
(`TimedCall` for the calls this replica makes, `incoming` and `outgoing` for those it serves)
records when its bytes moved, the state downloads and activations likewise, and transfers that
overlap in time (a round's streams to every owner at once) merge into one burst: its bytes over
the union of their times is one sample. A member whose link idles while it waits for others
(for the slowest member's part) is not charged for the wait. A sender's side ends when its last
write is handed to gRPC, a receiver's at its last arrival: what the socket and HTTP/2's window
still hold (a few MiB) reads as sent, so a burst much larger than that is what tells the rate."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal, Protocol

from swarm.net.bandwidth import format_rate
from swarm.ops.rated import RatedLog
from swarm.proto.framing import Framed

__all__ = [
    "DIRECTIONS",
    "Direction",
    "LinkMeter",
    "TimedCall",
    "fill_rates",
    "incoming",
    "material",
    "outgoing",
    "payload_bytes",
    "reannounce",
]

log = logging.getLogger(__name__)

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, Direction] = ("up", "down")
MIN_BYTES = 1 << 20  # smaller bursts take their latency's time, not their bytes'
# A sender's bursts end when gRPC took the last write, with a few MiB still in the socket and
# HTTP/2's window (measured: 2-3 MiB on a 10 Mbit/s link): only bursts far larger than that
# tell an upload rate, not how fast the buffers filled.
MIN_UP_BYTES = 16 << 20
KEEP = 8  # bursts the estimate is the max of...
WINDOW_S = 600.0  # ... when no older than this
SETTLE_S = 1.0  # a burst nothing joined for this long is over: a sample
CHANGE = 0.2  # re-announced when a rate moved by more than this share (or became known)
PERIOD_S = 5.0  # and checked no more often than this


class LinkMeter:
    """Upload and download rates in bytes per second, from `record(direction, started, ended,
    nbytes)` (the module's note says which transfers, how they merge into bursts, and why the
    recent max); `fix(up, down)` overrides a direction with an operator's rate (0: measured).
    `clock` is monotonic seconds, the transfers' times too (injected: tests move it)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        min_bytes: int = MIN_BYTES,
        min_up_bytes: int = MIN_UP_BYTES,
        keep: int = KEEP,
        window_s: float = WINDOW_S,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.clock, self.window_s = clock, window_s
        self.min_bytes: dict[Direction, int] = {"up": min_up_bytes, "down": min_bytes}
        self.settle_s = settle_s
        self._samples: dict[Direction, deque[tuple[float, float]]] = {
            d: deque(maxlen=keep) for d in DIRECTIONS
        }
        # The burst under way each direction: [started, ended, bytes] (None: none).
        self._burst: dict[Direction, list[float] | None] = dict.fromkeys(DIRECTIONS)
        self._fixed: dict[Direction, float] = dict.fromkeys(DIRECTIONS, 0.0)
        self.announced: tuple[float, float] = (0.0, 0.0)  # the rates the peer announced last

    def fix(self, up: float, down: float) -> None:
        """The operator's rates (`--bandwidth`), bytes per second; 0 leaves a direction measured."""
        if up < 0 or down < 0:
            raise ValueError(f"link rates are not negative: {up}/{down}")
        self._fixed = {"up": up, "down": down}

    def record(self, direction: Direction, started: float, ended: float, nbytes: int) -> None:
        """`nbytes` moved `direction` between `started` and `ended` (this meter's clock). A
        transfer that overlaps the burst under way joins it; one after it ends it (a sample)."""
        if direction not in self._burst:
            raise ValueError(f"direction is 'up' or 'down', not {direction!r}")
        burst = self._burst[direction]
        if burst is not None and started <= burst[1]:
            burst[0], burst[1] = min(burst[0], started), max(burst[1], ended)
            burst[2] += nbytes
            return
        self._end(direction)
        self._burst[direction] = [started, ended, float(nbytes)]

    def transferred(self, direction: Direction, nbytes: int, seconds: float) -> None:
        """`nbytes` went `direction` in the `seconds` up to now."""
        now = self.clock()
        self.record(direction, now - seconds, now, nbytes)

    def _end(self, direction: Direction) -> None:
        burst, self._burst[direction] = self._burst[direction], None
        if burst is None:
            return
        started, ended, nbytes = burst
        if nbytes >= self.min_bytes[direction] and ended > started:
            self._samples[direction].append((ended, nbytes / (ended - started)))

    def settle(self, idle_s: float | None = None) -> None:
        """End the bursts nothing joined for `idle_s` (`settle_s` by default; 0: a round just
        ended, its streams with it): their samples count from now."""
        idle = self.settle_s if idle_s is None else idle_s
        for direction in DIRECTIONS:
            burst = self._burst[direction]
            if burst is not None and burst[1] <= self.clock() - idle:
                self._end(direction)

    def measured(self, direction: Direction) -> float:
        """The measured rate `direction` (0: no burst big enough yet), whatever is fixed."""
        self.settle()
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


def payload_bytes(message: Any) -> int:
    """The tensor bytes a streamed message carries: a chunk's, or a message's inline ones."""
    if isinstance(message, Framed):
        return memoryview(message.data).nbytes
    return sum(len(t.data) for t in getattr(message, "tensors", ()))


class _Arrivals:
    """A stream read as it comes: from its first message's arrival to its last's, the bytes of
    all but the first (whose own time is before the first arrival)."""

    def __init__(self, meter: LinkMeter) -> None:
        self.meter, self.first, self.last, self.nbytes = meter, -1.0, -1.0, 0

    def came(self, message: Any) -> None:
        now = self.meter.clock()
        if self.first < 0:
            self.first = now
        else:
            self.nbytes += payload_bytes(message)
        self.last = now

    def done(self) -> None:
        if self.first >= 0:
            self.meter.record("down", self.first, self.last, self.nbytes)


async def incoming(stream: AsyncIterator[Any], meter: LinkMeter | None) -> AsyncIterator[Any]:
    """`stream` (a call's requests, served here) as it is, its bytes recorded as they came."""
    if meter is None:
        async for message in stream:
            yield message
        return
    arrivals = _Arrivals(meter)
    try:
        async for message in stream:
            arrivals.came(message)
            yield message
    finally:
        arrivals.done()


@contextlib.contextmanager
def outgoing(meter: LinkMeter | None) -> Iterator[Callable[[Any], None]]:
    """`with outgoing(meter) as sending:` call `sending(message)` before each message a served
    call yields: from the first to the end of the block, their bytes went up."""
    started, nbytes = -1.0, 0

    def sending(message: Any) -> None:
        nonlocal started, nbytes
        if meter is not None and started < 0:
            started = meter.clock()
        nbytes += payload_bytes(message)

    try:
        yield sending
    finally:
        if meter is not None and started >= 0:
            meter.record("up", started, meter.clock(), nbytes)


class TimedCall:
    """A stream-stream call this replica makes, as it is (`write`, `done_writing`, its replies),
    its bytes recorded in `meter`: up from its first write to `done_writing`, down as its
    replies come. Anything else is the call's own."""

    def __init__(self, call: Any, meter: LinkMeter) -> None:
        self._call, self._meter = call, meter
        self._started, self._nbytes = -1.0, 0

    async def write(self, message: Any) -> None:
        if self._started < 0:
            self._started = self._meter.clock()
        self._nbytes += payload_bytes(message)
        await self._call.write(message)

    async def done_writing(self) -> None:
        await self._call.done_writing()
        if self._started >= 0:
            self._meter.record("up", self._started, self._meter.clock(), self._nbytes)
            self._started = -1.0

    def __aiter__(self) -> AsyncIterator[Any]:
        return incoming(self._call.__aiter__(), self._meter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


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
    unsaid = RatedLog(log, every_s=60.0)  # a broker away for long: said once a minute
    while True:
        await asyncio.sleep(period_s)
        now, said = meter.rates(), meter.announced
        if not material(said, now, change):
            continue
        try:
            await announce()  # it marks what it sends as announced (`fill_rates`)
        except Exception as e:  # a broker away: not announced, so the next check tries again
            meter.announced = said
            unsaid.warning("unsent", "link rates not announced (tried again): %s", e)
            continue
        log.info(
            "link measured at %s up, %s down: announced",
            format_rate(now[0]),
            format_rate(now[1]),
        )
