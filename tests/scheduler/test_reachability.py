"""The scheduler's dial-back (`scheduler.reachability`), with a fake dialer behind its `Dialer`
seam: what it reports for each answer, when it dials, and how many at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from scheduler.reachability import DialFailed, ReachabilityChecker, path_text
from swarm.net import paths
from swarm.proto import control_pb2 as cpb

pytestmark = pytest.mark.timeout(30)


class FakeDialer:
    """Answers per dial address: a peer id, or a `DialFailed` text; unknown addresses refuse."""

    def __init__(self, answers: dict[str, str | DialFailed] | None = None) -> None:
        self.answers = dict(answers or {})
        self.calls: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.hold: asyncio.Event | None = None  # set: dials wait for it

    async def answer(self, address: str, timeout_s: float) -> str:
        self.calls.append(address)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold.wait()
            answer = self.answers.get(address, DialFailed("UNAVAILABLE: Connection refused"))
            if isinstance(answer, DialFailed):
                raise answer
            return answer
        finally:
            self.in_flight -= 1


class Checked:
    """A checker over a `FakeDialer`, with what it published and reported."""

    def __init__(self, dialer: FakeDialer, **kwargs: Any) -> None:
        self.published: list[tuple[str, cpb.ReachabilityReport | None]] = []
        self.reported: asyncio.Queue[cpb.ReachabilityReport] = asyncio.Queue()
        self.dialer = dialer
        self.dials_at: list[int] = []  # the dials made when each report came
        self.checker = ReachabilityChecker(dialer, self._publish, self._reported, **kwargs)

    def _reported(self, report: cpb.ReachabilityReport) -> None:
        self.dials_at.append(len(self.dialer.calls))
        self.reported.put_nowait(report)

    async def _publish(self, peer: str, report: cpb.ReachabilityReport | None) -> None:
        self.published.append((peer, report))

    async def report(self) -> cpb.ReachabilityReport:
        return await asyncio.wait_for(self.reported.get(), 10)


@contextlib.asynccontextmanager
async def checking(dialer: FakeDialer, **kwargs: Any) -> AsyncIterator[Checked]:
    checked = Checked(dialer, **kwargs)
    task = asyncio.create_task(checked.checker.run())
    try:
        yield checked
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def announce(peer: str, address: str, relay: str = "", speed: float = 0.0) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer,
        address=address,
        relay=relay,
        state=cpb.PEER_STATE_JOINING,
        samples_per_second={0: speed},
    )


async def test_a_peer_that_answers_at_its_address_is_direct_and_its_report_is_published() -> None:
    async with checking(FakeDialer({"10.0.0.1:5000": "a"})) as c:
        c.checker.announced(announce("a", "10.0.0.1:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_DIRECT
        assert (report.peer, report.address) == ("a", "10.0.0.1:5000")
        assert c.published == [("a", report)]
        assert path_text(report) == "direct"


async def test_a_peer_nobody_can_dial_is_unreachable_with_the_error_and_the_flags_that_fix_it() -> (
    None
):
    async with checking(FakeDialer()) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "Connection refused" in report.detail
        for flag in ("--announce-host", "forward port 5000", "swarm relay", "--relay"):
            assert flag in report.remedy, flag
        assert path_text(report).startswith(
            "UNREACHABLE (no answer: UNAVAILABLE: Connection refused)"
        )


async def test_a_peer_behind_nat_that_announces_a_relay_is_relayed_through_it() -> None:
    via = paths.relayed_address("a", "192.168.1.20:5000", "relay.example:7000")
    async with checking(FakeDialer({via: "a"})) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000", relay="relay.example:7000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_RELAYED
        assert report.relay == "relay.example:7000"
        assert c.dialer.calls == ["192.168.1.20:5000", via]  # directly first, then the relay
        assert path_text(report) == "via relay.example:7000"


async def test_a_relay_that_does_not_carry_the_call_leaves_the_peer_unreachable() -> None:
    async with checking(FakeDialer()) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000", relay="relay.example:7000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "through relay relay.example:7000" in report.detail


async def test_another_peer_answering_at_the_address_is_not_the_peer() -> None:
    async with checking(FakeDialer({"10.0.0.1:5000": "b"})) as c:
        c.checker.announced(announce("a", "10.0.0.1:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "answers as peer 'b'" in report.detail


async def test_a_peer_with_another_token_is_told_about_the_token() -> None:
    refused = DialFailed("UNAUTHENTICATED: wrong token; this swarm needs its token")
    async with checking(FakeDialer({"10.0.0.1:5000": refused})) as c:
        c.checker.announced(announce("a", "10.0.0.1:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "token" in report.remedy


async def test_announcements_repeated_are_not_dialled_again_but_a_new_address_or_relay_is() -> None:
    dialer = FakeDialer({"h:1": "a", "h:2": "a"})
    async with checking(dialer, recheck_s=3600) as c:
        c.checker.announced(announce("a", "h:1"))
        await c.report()
        for _ in range(5):
            c.checker.announced(announce("a", "h:1", speed=1.0))
        c.checker.announced(announce("a", "h:2"))
        report = await c.report()
        assert report.address == "h:2"
        assert dialer.calls == ["h:1", "h:2"]
        c.checker.announced(announce("a", "h:2", relay="r:9"))  # attached to a relay: checked
        await asyncio.sleep(0)
        for _ in range(100):
            if len(dialer.calls) == 3:
                break
            await asyncio.sleep(0.01)
        assert dialer.calls[2] == "h:2"


async def test_a_peer_that_leaves_has_its_report_cleared() -> None:
    async with checking(FakeDialer({"h:1": "a"})) as c:
        c.checker.announced(announce("a", "h:1"))
        await c.report()
        c.checker.announced(cpb.PeerAnnouncement(peer="a", state=cpb.PEER_STATE_OFFLINE))
        for _ in range(100):
            if len(c.published) == 2:
                break
            await asyncio.sleep(0.01)
        assert c.published[-1] == ("a", None)
        assert "a" not in c.checker.reports


async def test_checks_run_at_most_concurrency_at_once_and_do_not_hold_up_announcements() -> None:
    dialer = FakeDialer({f"h:{i}": f"p{i}" for i in range(20)})
    dialer.hold = asyncio.Event()
    async with checking(dialer, concurrency=3) as c:
        for i in range(20):
            c.checker.announced(announce(f"p{i}", f"h:{i}"))  # returns at once: nothing dialled
        for _ in range(100):
            if dialer.in_flight == 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert dialer.in_flight == 3
        dialer.hold.set()
        reports = [await c.report() for _ in range(20)]
        assert {r.peer for r in reports} == {f"p{i}" for i in range(20)}
        assert dialer.most_in_flight == 3


async def test_a_reachable_peer_missing_one_recheck_stays_until_it_misses_several() -> None:
    dialer = FakeDialer({"h:1": "a"})
    async with checking(dialer, recheck_s=0.05, retry_s=0.05, demote_after=3) as c:
        c.checker.announced(announce("a", "h:1"))
        assert (await c.report()).reachability == cpb.REACHABILITY_DIRECT
        del dialer.answers["h:1"]  # it stops answering
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert c.dials_at[-1] == 4  # the first check, then three misses in a row (not one)
        dialer.answers["h:1"] = "a"  # back: found again at its next retry
        assert (await c.report()).reachability == cpb.REACHABILITY_DIRECT


async def test_a_dialer_that_hangs_is_cut_off_by_the_checks_deadline() -> None:
    dialer = FakeDialer({"h:1": "a"})
    dialer.hold = asyncio.Event()  # never set
    async with checking(dialer, timeout_s=0.1) as c:
        c.checker.announced(announce("a", "h:1"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "no answer within 0.1 s" in report.detail


async def test_the_checker_holds_only_present_peers() -> None:
    dialer = FakeDialer({f"h:{i}": f"p{i}" for i in range(200)})
    async with checking(dialer) as c:
        for i in range(200):
            c.checker.announced(announce(f"p{i}", f"h:{i}"))
        for _ in range(200):
            await c.report()
        for i in range(200):
            c.checker.announced(cpb.PeerAnnouncement(peer=f"p{i}", state=cpb.PEER_STATE_OFFLINE))
        for _ in range(500):
            if len(c.published) == 400:
                break
            await asyncio.sleep(0.01)
        checker = c.checker
        assert checker.reports == {} and checker._targets == {} and checker._due == {}
        assert checker._misses == {} and checker._checking == {}
        assert sorted(p for p, report in c.published if report is None) == sorted(
            f"p{i}" for i in range(200)
        )
