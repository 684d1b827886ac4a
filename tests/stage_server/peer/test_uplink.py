"""The uplink's waiting lane (`stage_server.peer.uplink`, issue 67 item 3) on a moved clock: a
standby's update waits while the boundary's tensors are on the link, goes paced at the link's
rate, never holds back longer than `HOLD_S`, and holds nothing back where the rate is unknown;
where the link meter knows none, the rate is the lane's own, from its writes that waited."""

from __future__ import annotations

import asyncio
import threading

from stage_server.peer.links import Direction
from stage_server.peer.uplink import (
    HOLD_S,
    LEARNED_SHARE,
    MAX_CLAIMS,
    MIN_PART_BYTES,
    PART_S,
    Uplink,
)

RATE = 1_000_000.0  # bytes a second: 100 kB is 0.1 s on the link


class Meter:
    def __init__(self, up: float) -> None:
        self.up = up

    def rate(self, direction: Direction) -> float:
        return self.up if direction == "up" else 0.0


class Clock:
    """A clock that moves only when the lane sleeps; every sleep is written down."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []
        self.during_sleep: list[tuple[float, int]] = []  # (at, bytes) claimed as a sleep ends
        self.uplink: Uplink | None = None

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        while self.during_sleep and self.during_sleep[0][0] <= self.now:
            _, nbytes = self.during_sleep.pop(0)
            assert self.uplink is not None
            self.uplink.claim(nbytes)


def lane(up: float = RATE) -> tuple[Uplink, Clock]:
    clock = Clock()
    uplink = Uplink(Meter(up), clock=clock, sleep=clock.sleep)
    clock.uplink = uplink
    return uplink, clock


def test_a_part_waits_until_the_boundary_tensor_is_through() -> None:
    uplink, clock = lane()
    uplink.claim(100_000)  # 0.1 s of link
    asyncio.run(uplink.waiting("f").before())
    assert clock.now == 100.1


def test_claims_back_to_back_add_up_and_a_claim_during_the_wait_extends_it() -> None:
    uplink, clock = lane()
    uplink.claim(100_000)
    uplink.claim(200_000)  # queued behind the first: through at +0.3 s
    clock.during_sleep.append((100.3, 100_000))  # sent as the wait ends: through at +0.4 s
    asyncio.run(uplink.waiting("f").before())
    assert round(clock.now, 9) == 100.4


def test_an_old_claim_already_through_holds_nothing() -> None:
    uplink, clock = lane()
    uplink.claim(100_000)
    clock.now += 1.0
    asyncio.run(uplink.waiting("f").before())
    assert clock.slept == []


def test_parts_are_paced_at_the_link_rate() -> None:
    uplink, clock = lane()
    waiting = uplink.waiting("f")

    async def send(parts: int) -> None:
        for _ in range(parts):
            await waiting.before()
            waiting.sent(50_000, 0.0)  # 0.05 s each

    asyncio.run(send(4))
    assert round(clock.now - 100.0, 9) == 0.15  # the 4th goes as the 3rd is through


def test_the_hold_is_bounded_and_pacing_goes_on_past_it() -> None:
    uplink, clock = lane()
    uplink.claim(int(RATE * 10))  # a boundary that claims the link for 10 s
    waiting = uplink.waiting("f")

    async def two_parts() -> None:
        await waiting.before()
        waiting.sent(50_000, 0.0)
        await waiting.before()

    asyncio.run(two_parts())
    assert round(clock.now - 100.0, 9) == HOLD_S + 0.05


def test_an_unknown_rate_holds_nothing_back() -> None:
    uplink, clock = lane(up=0.0)
    uplink.claim(10_000_000)
    waiting = uplink.waiting("f")

    async def parts() -> None:
        for _ in range(3):
            await waiting.before()
            waiting.sent(1_000_000, 0.0)

    asyncio.run(parts())
    assert clock.slept == []


def test_claims_from_another_thread_are_all_counted() -> None:
    uplink, clock = lane()
    threads = [threading.Thread(target=lambda: [uplink.claim(5_000) for _ in range(100)])]
    threads.append(threading.Thread(target=lambda: [uplink.claim(5_000) for _ in range(100)]))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert round(uplink.busy_until() - clock.now, 9) == 1.0  # 1 MB at 1 MB/s


def test_without_a_meter_rate_the_lane_learns_one_from_its_writes_that_waited() -> None:
    uplink, clock = lane(up=0.0)
    first = uplink.waiting("f")
    assert first.part_bytes(4 << 20) == 4 << 20  # no rate: the job's chunks, unpaced
    first.sent(4 << 20, 0.0001)  # into the buffers at once: says nothing of the link
    for _ in range(4):
        first.sent(1 << 20, 0.5)  # waited for the link: 2 MB/s
    first.done()
    assert uplink.rate() == LEARNED_SHARE * (4 << 20) / 2.0
    uplink.claim(1 << 20)  # a boundary tensor: 0.5 s of this link, at the share of it used
    asyncio.run(uplink.waiting("f").before())
    assert round(clock.now - 100.0, 9) == round(0.5 / LEARNED_SHARE, 9)


def test_a_few_blocked_bytes_are_no_rate_and_the_meters_rate_comes_first() -> None:
    uplink, _ = lane(up=0.0)
    waiting = uplink.waiting("f")
    waiting.sent(100_000, 1.0)  # one slow write: the loop was busy, maybe
    waiting.done()
    assert uplink.rate() == 0.0
    meter = Meter(up=RATE)
    uplink2 = Uplink(meter)
    w2 = uplink2.waiting("f")
    w2.sent(4 << 20, 1.0)
    w2.done()
    assert uplink2.rate() == RATE


def test_a_part_is_about_part_s_of_link_within_bounds() -> None:
    uplink, _ = lane(up=100e6 / 8)  # 100 Mbit/s
    assert uplink.waiting("f").part_bytes(16 << 20) == int(100e6 / 8 * PART_S)
    assert uplink.waiting("f").part_bytes(64 << 10) == 64 << 10  # the job's smaller chunks
    slow, _ = lane(up=1e6 / 8)
    assert slow.waiting("f").part_bytes(16 << 20) == MIN_PART_BYTES


def test_a_follower_that_reads_slowly_lowers_no_one_elses_rate() -> None:
    uplink, clock = lane(up=0.0)
    honest = uplink.waiting("standby")
    honest.sent(4 << 20, 1.0)  # waited for the link: 4 MiB/s
    honest.done()
    slow = uplink.waiting("crawler")  # reads 1 MiB a second, whatever the link
    slow.sent(4 << 20, 4.0)
    slow.done()
    assert uplink.rate() == LEARNED_SHARE * (4 << 20)
    # its own newest sample is each follower's: the link got slower for the standby too
    again = uplink.waiting("standby")
    again.sent(4 << 20, 2.0)
    again.done()
    assert uplink.rate() == LEARNED_SHARE * (2 << 20)
    clock.now += 601.0  # both samples older than the window: no rate, nothing held
    assert uplink.rate() == 0.0


def test_the_followers_samples_kept_are_bounded() -> None:
    uplink, _ = lane(up=0.0)
    for i in range(100):
        w = uplink.waiting(f"follower{i}")
        w.sent(1 << 20, 1.0 + i)  # each slower than the one before
        w.done()
    # only the newest 16 are kept: the fastest of them is follower84's
    assert uplink.rate() == LEARNED_SHARE * (1 << 20) / 85.0


def test_a_replica_nobody_follows_keeps_a_bounded_number_of_claims() -> None:
    uplink, clock = lane()
    for _ in range(10 * MAX_CLAIMS):  # a long job's boundary tensors, no answer folding them
        uplink.claim(1_000)
        clock.now += 1.0
    assert len(uplink._claims) == MAX_CLAIMS
    uplink.claim(500_000)  # the newest still claims the link
    assert round(uplink.busy_until() - clock.now, 9) == 0.5
