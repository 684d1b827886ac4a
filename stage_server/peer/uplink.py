"""The uplink's two lanes: the boundary's, which the step waits for, and one for what can wait (a
standby's or a joiner's updates, `stage_server.replica.state_transfer`), which yields to it. A
state download mid-job (a copy, a checkpoint's) is held for the boundary's claims there too, but
not paced: its time stays the link meter's sample where nothing held it.

Why (issue 67, item 3): a standby asks its source replica for each committed update, and the
source answers as the commit lands, just as the next step's first microbatches leave on the same
uplink. On a 100 Mbit/s link a pool of one's update (a d256 stage's float32 sum, 6.6 MB) is half
a second of link; sent at once it shares the link with the pipeline's fill, whose every hop is on
the step's critical path, and a step took 1.27x as long with a standby as without one. Yet the
same uplink idles for much of each step (a stage's link carries its outputs only between its
forwards, and the first stage sends nothing back at all). So the update waits for those gaps:
- **The boundary claims the link.** Each boundary tensor this replica sends (`StageMetrics.sent`,
  the one place every boundary send is counted) claims it for its bytes over the link's upload
  rate, from when it was encoded: until then its bytes are still in the socket and in the link's
  queue, and anything sent beside them delays them.
- **What can wait goes between claims, paced.** Before each part it sends, the waiting lane
  waits until the claims are over, and until its own last part is on the wire at the link's rate
  (so it never fills the socket's buffers with a burst the next boundary tensor would queue
  behind). A part is about `PART_S` of link: a boundary send that starts just after waits that.
- **Bounded.** One answer holds back for at most `HOLD_S` in all; past it, its parts go paced
  only. A standby a step behind when its stage dies costs a rollback, so an update must not wait
  long: two seconds is under a step of the peerbench workload at 100 Mbit/s, and on a link too
  slow for the update to fit between the boundary's sends the standby is as it was before.

**The rate.** The link meter's (`stage_server.peer.links`: `--bandwidth`, else measured from large
transfers this peer made), where it has one; it often has none on a small stage (it counts only
bursts of 16 MiB or more, which a d256 stage's state and updates are not). Else the lane's own:
the waiting lane's parts themselves, where their writes blocked. gRPC takes a write at once while
HTTP/2's window and the socket have room, and only as fast as the link drains them once they are
full, so a part whose write waited (`BLOCKED_S` or more) went at about the link's rate: their
bytes over those waits, less a margin (`LEARNED_SHARE`), are the rate (`Uplink.wrote`). An
answer paced at that rate never fills the buffers, so it adds no sample; one paced faster than
a link that got slower does, and the rate follows it down. Each follower's newest sample counts
for the link meter's window, and the rate is the largest: a follower that reads slowly makes
only its own answers' writes wait, so it cannot slow the others' updates. Where no rate is
known yet (the first answer, or a link so fast that no write ever waits), nothing is held back
or paced: the lane sends as there were none.

A boundary tensor handed over to a co-located replica (`stage_server.replica.handing`) claims the
link too, though its bytes take another way: it holds an update back by as long as those bytes
would have taken, never longer."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from stage_server.peer.links import CHANGE, WINDOW_S, Direction
from swarm.net.bandwidth import format_rate

__all__ = ["BLOCKED_S", "HOLD_S", "PART_S", "Uplink", "Waiting"]

log = logging.getLogger(__name__)

HOLD_S = 2.0  # at most this long, in all, one answer's parts wait for the boundary's claims
PART_S = 0.02  # a waiting answer's part is about this much of link (256 KiB at 100 Mbit/s)
MIN_PART_BYTES = 64 << 10  # and never smaller (each part is a message: a cost of its own)
# A write that took this long waited for the link, not for the loop (which takes well under a
# millisecond to hand gRPC a part it has room for).
BLOCKED_S = 0.002
MIN_SAMPLE_BYTES = 1 << 20  # a rate from fewer blocked bytes says more about the loop than the link
# The blocked writes' rate overstates the link by what HTTP/2's window refills while they wait
# (measured: 14.6 MB/s on a 12.5 MB/s link): the lane uses this share of it, so that its parts
# never go faster than the link drains them and its claims are not cut short.
LEARNED_SHARE = 0.8
MAX_CLAIMS = 256  # boundary tensors' claims not folded yet, kept (the newest)
MAX_LEARNED = 16  # followers' samples kept (a replica's update log serves a few)


class UploadRate(Protocol):
    """What the lane reads of the link meter (`stage_server.peer.links.LinkMeter`)."""

    def rate(self, direction: Direction) -> float: ...


class Uplink:
    """One peer's uplink as the boundary claims it (`claim`, from any thread) and as what can wait
    uses it (`Waiting`, on the event loop)."""

    def __init__(
        self,
        meter: UploadRate,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """`clock` is monotonic seconds and `sleep` waits on it (injected: tests move both)."""
        self._meter, self.clock, self.sleep = meter, clock, sleep
        # Claims not folded in yet: (when, bytes). They come from the replica's worker thread
        # (a boundary tensor is encoded there), and the meter is read on the loop only.
        # Bounded: a replica nobody follows sends on, and its claims are never folded; the
        # oldest go first, long through by the time `MAX_CLAIMS` newer ones were sent.
        self._claims: deque[tuple[float, int]] = deque(maxlen=MAX_CLAIMS)
        self._lock = threading.Lock()
        self._busy_until = 0.0  # the boundary's last claim is on the wire by then (if the rate)
        # Follower -> (when, rate) of the newest answer to it whose writes waited for the link.
        # The lane's rate is the largest of these: a follower that reads slowly (a slow link of
        # its own, or one that means to hold this peer's other followers back) makes its own
        # answers' writes wait, and so reports a low rate; it cannot lower anyone else's.
        self._learned: dict[str, tuple[float, float]] = {}

    def claim(self, nbytes: int) -> None:
        """A boundary tensor of `nbytes` leaves now: the link is the boundary's until its bytes
        are through. Any thread."""
        with self._lock:
            self._claims.append((self.clock(), nbytes))

    def rate(self) -> float:
        """The link's upload rate, bytes a second (0: not known). On the loop."""
        return self._meter.rate("up") or self._learned_rate()

    def _learned_rate(self) -> float:
        since = self.clock() - WINDOW_S
        return max((rate for at, rate in self._learned.values() if at >= since), default=0.0)

    def wrote(self, follower: str, nbytes: int, seconds: float) -> None:
        """The waiting lane's writes to `follower` that waited for the link (`BLOCKED_S` or more
        each): `nbytes` in `seconds` of those waits, one answer's. The newest sample of each
        follower counts; the lane's rate is the largest of the recent ones."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        before = self._learned_rate()
        self._learned.pop(follower, None)  # re-inserted: the dict stays oldest first
        self._learned[follower] = (self.clock(), LEARNED_SHARE * nbytes / seconds)
        while len(self._learned) > MAX_LEARNED:
            del self._learned[next(iter(self._learned))]  # the oldest sample goes
        rate = self._learned_rate()
        if not before or abs(rate - before) > CHANGE * before:
            log.info("uplink: %s, from the updates' writes that waited for it", format_rate(rate))

    def busy_until(self) -> float:
        """When the boundary's claims so far are through (this lane's clock); in the past when
        there are none or the link's rate is not known. On the loop."""
        with self._lock:
            claims = list(self._claims)
            self._claims.clear()
        rate = self.rate()
        for at, nbytes in claims:
            if rate > 0:
                self._busy_until = max(self._busy_until, at) + nbytes / rate
        return self._busy_until

    def waiting(self, follower: str) -> Waiting:
        """A lane for one answer to `follower` that can wait: its `HOLD_S` starts now."""
        return Waiting(self, follower, self.clock() + HOLD_S)


class Waiting:
    """One answer's parts on the waiting lane (`Uplink.waiting`): each is sent `after` the
    boundary's claims and the answer's own last part are through, or the hold is spent."""

    def __init__(self, uplink: Uplink, follower: str, hold_until: float) -> None:
        self._uplink, self._follower, self.hold_until = uplink, follower, hold_until
        self._own_until = 0.0  # this answer's last part is on the wire by then
        self._blocked = [0, 0.0]  # bytes and seconds of its writes that waited for the link
        # Seconds its parts were held back or paced: the lane's time, not the link's (a state
        # download's bytes over its time measure the link only where this is 0)
        self.waited = 0.0

    def part_bytes(self, most: int) -> int:
        """How large a part to cut: about `PART_S` of link, within [`MIN_PART_BYTES`, `most`]."""
        rate = self._uplink.rate()
        if rate <= 0:
            return most
        return max(MIN_PART_BYTES, min(most, int(rate * PART_S)))

    async def before(self) -> None:
        """Wait until the next part may go: the boundary's claims through (until the hold is
        spent) and this answer's last part through. The claims are read again after each wait:
        a boundary tensor sent meanwhile claims the link from then."""
        up = self._uplink
        while True:
            now = up.clock()
            ready = self._own_until
            if now < self.hold_until:
                ready = max(ready, min(up.busy_until(), self.hold_until))
            if ready <= now:
                return
            self.waited += ready - now
            await up.sleep(ready - now)

    def sent(self, nbytes: int, seconds: float) -> None:
        """A part of `nbytes` went; gRPC took `seconds` to take it. The next part waits until
        this one is through at the link's rate."""
        if seconds >= BLOCKED_S:
            self._blocked[0] += nbytes
            self._blocked[1] += seconds
        rate = self._uplink.rate()
        if rate > 0:
            self._own_until = max(self._own_until, self._uplink.clock()) + nbytes / rate

    def done(self) -> None:
        """The answer is sent: what its blocked writes say of the link goes to the lane."""
        nbytes, seconds = self._blocked
        self._uplink.wrote(self._follower, int(nbytes), seconds)
